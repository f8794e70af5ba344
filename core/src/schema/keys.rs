//! Keys a consumer makes for one of its needs (docs/protocol.md §11.10): declared in
//! `needs.json` under `keys.<name>`, referred to in the request as
//! `{"$fort_key": "<name>", "as": "csr" | "public" | "openssh"}`, and replaced by the
//! consumer with a CSR or a public key before sending. The private key never leaves the
//! host. A `wireguard` key is an X25519 key pair (WireGuard's), whose public half travels
//! as base64 and whose payload names that public key back instead of a certificate.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use serde_json::Value;

pub const KEY_REF: &str = "$fort_key";
const AS: &str = "as";

/// The algorithms the consumer makes keys with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum KeyType {
    #[serde(rename = "ecdsa-p256")]
    EcdsaP256,
    #[serde(rename = "ed25519")]
    Ed25519,
    #[serde(rename = "rsa-2048")]
    Rsa2048,
    #[serde(rename = "rsa-3072")]
    Rsa3072,
    /// An X25519 key pair, as WireGuard uses: its file is base64 of the 32 private bytes
    /// and a newline (what `wg genkey` prints), its public half base64 (`wg pubkey`).
    #[serde(rename = "wireguard")]
    Wireguard,
}

impl KeyType {
    pub fn as_str(self) -> &'static str {
        match self {
            KeyType::EcdsaP256 => "ecdsa-p256",
            KeyType::Ed25519 => "ed25519",
            KeyType::Rsa2048 => "rsa-2048",
            KeyType::Rsa3072 => "rsa-3072",
            KeyType::Wireguard => "wireguard",
        }
    }

    /// The modulus size of an RSA key type.
    pub fn rsa_bits(self) -> Option<usize> {
        match self {
            KeyType::Rsa2048 => Some(2048),
            KeyType::Rsa3072 => Some(3072),
            _ => None,
        }
    }
}

/// How the private key file is written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KeyFormat {
    /// PKCS#8 PEM (`-----BEGIN PRIVATE KEY-----`): what TLS servers read.
    #[default]
    Pem,
    /// OpenSSH's own format, for `ssh` and `sshd` (which do not read ed25519 PKCS#8).
    Openssh,
}

/// One key of a need (`keys.<name>` in `needs.json`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct KeySpec {
    #[serde(rename = "type")]
    pub key_type: KeyType,
    /// Where the private key is installed, with the certificate that matches it.
    pub path: PathBuf,
    #[serde(default = "root")]
    pub owner: String,
    #[serde(default = "root")]
    pub group: String,
    /// Octal, e.g. `"0400"`.
    #[serde(default = "default_mode")]
    pub mode: String,
    #[serde(default)]
    pub format: KeyFormat,
    /// DNS names or IP addresses of the CSR; the first is its common name.
    #[serde(default)]
    pub names: Vec<String>,
    /// Where in the payload the certificate for this key is (for a `wireguard` key: its
    /// public key, base64, as the provider took it).
    #[serde(default = "default_certificate")]
    pub certificate: String,
    /// Keep the key across renewals.
    #[serde(default)]
    pub reuse: bool,
    /// The provider authorizes the key instead of certifying it (an `authorized_keys`
    /// entry): the value at `certificate` is then the key's own OpenSSH public key line,
    /// which the provider answers once it has authorized that key. Written only when
    /// set, so a declaration without it reads and hashes as before.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub authorized: bool,
}

impl KeySpec {
    /// The key as the file it lands as (§11.3 rules for path, owner, group and mode).
    pub fn as_file(&self, name: &str) -> super::FileSpec {
        super::FileSpec {
            name: Some(name.to_owned()),
            path: self.path.clone(),
            pointer: String::new(),
            owner: self.owner.clone(),
            group: self.group.clone(),
            mode: self.mode.clone(),
            credential_for: Vec::new(),
            encrypt: None,
        }
    }
}

fn root() -> String {
    "root".into()
}

fn default_mode() -> String {
    "0400".into()
}

fn default_certificate() -> String {
    "/certificate".into()
}

/// What a `$fort_key` reference stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum KeyForm {
    /// A PEM PKCS#10 certificate signing request for the key's names.
    Csr,
    /// The public key as PEM SubjectPublicKeyInfo.
    Public,
    /// The public key as an OpenSSH line without a comment.
    Openssh,
}

/// One `$fort_key` reference.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct KeyRef {
    pub key: String,
    pub form: KeyForm,
}

/// The key reference a value is, if it is one.
fn as_key_ref(v: &Value) -> Result<Option<KeyRef>, String> {
    let Value::Object(map) = v else {
        return Ok(None);
    };
    let Some(target) = map.get(KEY_REF) else {
        return Ok(None);
    };
    if map.keys().any(|k| k != KEY_REF && k != AS) {
        return Err(format!(
            "an object with {KEY_REF} may only have \"{AS}\" beside it"
        ));
    }
    let key = target
        .as_str()
        .ok_or_else(|| format!("{KEY_REF} must be a string naming one of the need's keys"))?;
    let form = match map.get(AS) {
        None => KeyForm::Public,
        Some(Value::String(s)) if s == "csr" => KeyForm::Csr,
        Some(Value::String(s)) if s == "public" => KeyForm::Public,
        Some(Value::String(s)) if s == "openssh" => KeyForm::Openssh,
        Some(other) => {
            return Err(format!(
            "{KEY_REF} {key:?}: \"{AS}\" must be \"csr\", \"public\" or \"openssh\", not {other}"
        ))
        }
    };
    Ok(Some(KeyRef {
        key: key.to_owned(),
        form,
    }))
}

/// The declared keys no reference in `request` names: no certificate can ever be for
/// them, so the need cannot be satisfied (`fort-agent check` warns).
pub fn unused_keys<'a>(keys: &'a BTreeMap<String, KeySpec>, request: &Value) -> Vec<&'a str> {
    let refs = key_refs(request).unwrap_or_default();
    keys.keys()
        .filter(|k| !refs.iter().any(|r| &r.key == *k))
        .map(String::as_str)
        .collect()
}

/// Every key reference inside `request`.
pub fn key_refs(request: &Value) -> Result<Vec<KeyRef>, String> {
    let mut out = Vec::new();
    let mut stack = vec![request];
    while let Some(v) = stack.pop() {
        if let Some(r) = as_key_ref(v)? {
            out.push(r);
            continue;
        }
        match v {
            Value::Object(m) => stack.extend(m.values()),
            Value::Array(a) => stack.extend(a.iter()),
            _ => {}
        }
    }
    Ok(out)
}

/// `request` with every key reference replaced by `lookup(reference)`.
pub fn resolve_keys(
    request: &Value,
    lookup: &mut dyn FnMut(&KeyRef) -> Result<String, String>,
) -> Result<Value, String> {
    if let Some(r) = as_key_ref(request)? {
        return lookup(&r).map(Value::String);
    }
    Ok(match request {
        Value::Object(m) => Value::Object(
            m.iter()
                .map(|(k, v)| Ok((k.clone(), resolve_keys(v, lookup)?)))
                .collect::<Result<_, String>>()?,
        ),
        Value::Array(a) => Value::Array(
            a.iter()
                .map(|v| resolve_keys(v, lookup))
                .collect::<Result<_, _>>()?,
        ),
        other => other.clone(),
    })
}

/// A name a CSR may carry: an IP address, or a DNS name (a leading `*.` allowed).
fn is_csr_name(name: &str) -> bool {
    if name.parse::<IpAddr>().is_ok() {
        return true;
    }
    let host = name.strip_prefix("*.").unwrap_or(name);
    !host.is_empty()
        && name.len() <= 253
        && host.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|c| c.is_ascii_alphanumeric() || c == b'-')
        })
}

/// A key name: what a file's `name` may be.
pub fn is_key_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"._-".contains(&c))
}

/// Checks a need's keys against each other and against its request's references. The
/// file-like fields (path, owner, group, mode) are checked with the need's files.
pub fn check_keys(keys: &BTreeMap<String, KeySpec>, request: &Value) -> Result<(), String> {
    for (name, k) in keys {
        if !is_key_name(name) {
            return Err(format!(
                "key {name:?}: a key name is letters, digits, . _ - (not starting with .)"
            ));
        }
        if k.key_type == KeyType::Wireguard {
            // WireGuard reads its own form and nothing else; there is no certificate
            // request for an X25519 key.
            if k.format != KeyFormat::Pem {
                return Err(format!(
                    "key {name:?}: a wireguard key is written as wg reads it (base64); leave format unset"
                ));
            }
            if !k.names.is_empty() {
                return Err(format!(
                    "key {name:?}: a wireguard key has no names (no certificate is made for it)"
                ));
            }
        }
        if k.format == KeyFormat::Openssh && k.key_type != KeyType::Ed25519 {
            return Err(format!(
                "key {name:?}: format openssh is for ed25519 keys (OpenSSH reads P-256 and RSA keys as PEM)"
            ));
        }
        if let Some(bad) = k.names.iter().find(|n| !is_csr_name(n)) {
            return Err(format!(
                "key {name:?}: {bad:?} is not a DNS name or an IP address"
            ));
        }
        if k.names.len() > 100 {
            return Err(format!("key {name:?}: at most 100 names"));
        }
        if !(k.certificate.is_empty() || k.certificate.starts_with('/')) {
            return Err(format!(
                "key {name:?}: certificate {:?} must be a JSON pointer (empty or starting with /)",
                k.certificate
            ));
        }
    }
    for r in key_refs(request)? {
        let Some(k) = keys.get(&r.key) else {
            return Err(format!(
                "{KEY_REF} {:?} names no key of this need (keys: {})",
                r.key,
                keys.keys().cloned().collect::<Vec<_>>().join(", ")
            ));
        };
        if k.key_type == KeyType::Wireguard && r.form != KeyForm::Public {
            return Err(format!(
                "{KEY_REF} {:?} is a wireguard key: it travels only as its public key (as \"public\", base64)",
                r.key
            ));
        }
        if r.form == KeyForm::Csr && k.names.is_empty() {
            return Err(format!(
                "{KEY_REF} {:?} asks for a CSR, but the key has no names",
                r.key
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn key(names: &[&str]) -> KeySpec {
        serde_json::from_value(json!({"type": "ecdsa-p256", "path": "/run/k.pem", "names": names}))
            .unwrap()
    }

    #[test]
    fn references_resolve_and_are_checked() {
        let req = json!({"csr": {"$fort_key": "tls", "as": "csr"}, "k": [{"$fort_key": "tls"}]});
        let refs = key_refs(&req).unwrap();
        assert_eq!(refs.len(), 2);
        let out = resolve_keys(&req, &mut |r| Ok(format!("{}:{:?}", r.key, r.form))).unwrap();
        assert_eq!(out, json!({"csr": "tls:Csr", "k": ["tls:Public"]}));
        let keys = BTreeMap::from([("tls".to_owned(), key(&["a.example.org"]))]);
        check_keys(&keys, &req).unwrap();
        for (bad, says) in [
            (json!({"x": {"$fort_key": "other"}}), "names no key"),
            (
                json!({"x": {"$fort_key": "tls", "as": "der"}}),
                "\"as\" must be",
            ),
            (json!({"x": {"$fort_key": "tls", "y": 1}}), "may only have"),
            (json!({"x": {"$fort_key": 1}}), "must be a string"),
        ] {
            let err = check_keys(&keys, &bad).unwrap_err();
            assert!(err.contains(says), "{bad}: {err}");
        }
        let nameless = BTreeMap::from([("tls".to_owned(), key(&[]))]);
        assert!(check_keys(&nameless, &req)
            .unwrap_err()
            .contains("no names"));
    }

    #[test]
    fn names_and_formats() {
        for good in [
            "a.example.org",
            "*.app.example.org",
            "127.0.0.1",
            "::1",
            "x",
        ] {
            assert!(is_csr_name(good), "{good}");
        }
        for bad in ["", "*.", "a..b", "-a.b", "a b", "a/b", "*.*.a", "é.org"] {
            assert!(!is_csr_name(bad), "{bad}");
        }
        let mut k = key(&["a"]);
        k.format = KeyFormat::Openssh;
        let keys = BTreeMap::from([("ssh".to_owned(), k)]);
        assert!(check_keys(&keys, &json!({}))
            .unwrap_err()
            .contains("openssh"));
    }

    #[test]
    fn a_wireguard_key_travels_only_as_its_public_key() {
        let wg: KeySpec =
            serde_json::from_value(json!({"type": "wireguard", "path": "/run/wg/key"})).unwrap();
        assert_eq!(wg.key_type, KeyType::Wireguard);
        let keys = BTreeMap::from([("wg".to_owned(), wg.clone())]);
        check_keys(&keys, &json!({"public_key": {"$fort_key": "wg"}})).unwrap();
        for (request, says) in [
            (
                json!({"k": {"$fort_key": "wg", "as": "openssh"}}),
                "only as its public key",
            ),
            (
                json!({"k": {"$fort_key": "wg", "as": "csr"}}),
                "only as its public key",
            ),
        ] {
            let err = check_keys(&keys, &request).unwrap_err();
            assert!(err.contains(says), "{request}: {err}");
        }
        let mut named = wg.clone();
        named.names = vec!["a.example.org".into()];
        let err = check_keys(&BTreeMap::from([("wg".to_owned(), named)]), &json!({})).unwrap_err();
        assert!(err.contains("no names"), "{err}");
        let mut openssh = wg;
        openssh.format = KeyFormat::Openssh;
        let err =
            check_keys(&BTreeMap::from([("wg".to_owned(), openssh)]), &json!({})).unwrap_err();
        assert!(err.contains("leave format unset"), "{err}");
    }
}
