//! What a caller asks the SSH CA for (the same shape as the `ssh-ca` NixOS interface and
//! its request schema), and the checks every field passes before anything is signed:
//! requests come from other hosts.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use ssh_key::public::KeyData;
use ssh_key::PublicKey;

/// A host certificate (for the caller's own SSH host key) or a user certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Host,
    User,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Host => "host",
            Kind::User => "user",
        }
    }
}

/// `{"kind": "host", "public_key": "ssh-ed25519 AAAA…", "principals": [...],
/// "validity_seconds": N}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Request {
    pub kind: Kind,
    /// The key to certify, as an OpenSSH public key line (a comment is ignored).
    pub public_key: String,
    /// Names the certificate is valid for. Host certificates: unset means every exact
    /// name the caller may have; user certificates must name at least one.
    #[serde(default)]
    pub principals: Option<Vec<String>>,
    /// A shorter validity than the provider's; longer is cut to the provider's.
    #[serde(default)]
    pub validity_seconds: Option<u64>,
}

/// Longest public key line accepted: a 16384-bit RSA key is about 2.8 KB.
const MAX_KEY_LINE: usize = 8192;
/// Most principals one certificate may carry.
pub const MAX_PRINCIPALS: usize = 32;
/// Longest principal (a DNS name is at most 253 bytes).
const MAX_PRINCIPAL: usize = 253;
/// Shortest validity a request may ask for.
pub const MIN_VALIDITY: u64 = 60;

impl Request {
    /// The request as sent, or why it is not one.
    pub fn parse(value: &Value) -> Result<Request, String> {
        // The interface lets `public_key` be unset (a `ca` request has none).
        if let (Some(kind @ ("host" | "user")), None | Some(Value::Null)) = (
            value.get("kind").and_then(Value::as_str),
            value.get("public_key"),
        ) {
            return Err(format!("request: a {kind} certificate needs public_key"));
        }
        Request::deserialize(value).map_err(|e| format!("request: {e}"))
    }
}

/// Whether `value` is `{"kind": "ca"}`: no certificate, only what is to be trusted (the
/// CA key, its `@cert-authority` line and its KRL). The fields of a certificate request
/// may be there as `null` (the NixOS module sends unset options so), nothing else.
pub fn is_ca(value: &Value) -> Result<bool, String> {
    let Some(fields) = value.as_object() else {
        return Ok(false);
    };
    if fields.get("kind").and_then(Value::as_str) != Some("ca") {
        return Ok(false);
    }
    const CERTIFICATE_FIELDS: [&str; 3] = ["public_key", "principals", "validity_seconds"];
    for (name, v) in fields {
        if name == "kind" || (CERTIFICATE_FIELDS.contains(&name.as_str()) && v.is_null()) {
            continue;
        }
        return Err(format!(
            "request: a {{\"kind\": \"ca\"}} request has no field {:?}; it certifies nothing",
            truncate(name)
        ));
    }
    Ok(true)
}

/// The key to certify, or why it may not be: its type must be one OpenSSH certifies
/// and fort accepts (ed25519, ECDSA, RSA of at least 2048 bits, and their FIDO forms).
pub fn public_key(line: &str) -> Result<PublicKey, String> {
    if line.len() > MAX_KEY_LINE {
        return Err(format!("public_key is longer than {MAX_KEY_LINE} bytes"));
    }
    let key = PublicKey::from_openssh(line.trim())
        .map_err(|_| "public_key is not an OpenSSH public key line of a known type".to_owned())?;
    match key.key_data() {
        KeyData::Ed25519(_) | KeyData::Ecdsa(_) | KeyData::SkEd25519(_) => Ok(key),
        KeyData::SkEcdsaSha2NistP256(_) => Ok(key),
        KeyData::Rsa(rsa) => {
            let bits = rsa.n.as_positive_bytes().map_or(0, bit_length);
            if (2048..=16384).contains(&bits) {
                Ok(key)
            } else {
                Err(format!(
                    "public_key is a {bits}-bit RSA key; 2048 to 16384 bits are certified"
                ))
            }
        }
        _ => Err(format!(
            "public_key is of type {}, which this CA does not certify",
            key.algorithm()
        )),
    }
}

fn bit_length(bytes: &[u8]) -> usize {
    let bytes = {
        let start = bytes.iter().position(|b| *b != 0).unwrap_or(bytes.len());
        &bytes[start..]
    };
    match bytes.first() {
        None => 0,
        Some(first) => bytes.len() * 8 - first.leading_zeros() as usize,
    }
}

/// Whether `name` may be a principal of a certificate of `kind`. Host principals are
/// lower-case host names or addresses, optionally `*.` and a domain; user principals are
/// lower-case account names (an `@domain` allowed). Upper case is refused: OpenSSH
/// compares user principals exactly, and the allowances compare without case.
pub fn check_principal(kind: Kind, name: &str) -> Result<(), String> {
    let bad = |why: &str| Err(format!("principal {:?} {why}", truncate(name)));
    if name.is_empty() || name.len() > MAX_PRINCIPAL {
        return bad("must be 1 to 253 bytes");
    }
    match kind {
        Kind::Host => {
            let body = name.strip_prefix("*.").unwrap_or(name);
            let ok = !body.is_empty()
                && body
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-._:".contains(&b))
                && !body.starts_with(['.', '-'])
                && !body.ends_with(['.', '-']);
            if !ok {
                return bad("is not a lower-case host name, address or *.domain");
            }
        }
        Kind::User => {
            let ok = name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-._@+".contains(&b))
                && name.starts_with(|c: char| {
                    c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'
                });
            if !ok {
                return bad("is not a lower-case account name");
            }
        }
    }
    Ok(())
}

/// At most 64 characters of a hostile value, for a reason that names it.
pub fn truncate(s: &str) -> String {
    s.chars().take(64).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const ED: &str =
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAID1AF8PoQ4lakrcKp00bfrycmCzPLsSWjMDNVfEq9GYM c";
    fn key_line(data: KeyData) -> String {
        PublicKey::new(data, "").to_openssh().unwrap()
    }

    fn rsa(bits: usize) -> String {
        let mut n = vec![0xffu8; bits / 8];
        n[0] = 0xc5;
        key_line(KeyData::Rsa(ssh_key::public::RsaPublicKey {
            e: ssh_key::Mpint::from_positive_bytes(&[1, 0, 1]).unwrap(),
            n: ssh_key::Mpint::from_positive_bytes(&n).unwrap(),
        }))
    }

    #[test]
    fn requests_and_keys() {
        let r = Request::parse(&json!({"kind": "host", "public_key": ED})).unwrap();
        assert_eq!(r.kind, Kind::Host);
        assert!(r.principals.is_none());
        assert!(public_key(&r.public_key).is_ok());
        for bad in [
            json!({"kind": "root", "public_key": ED}),
            json!({"kind": "user"}),
            json!({"kind": "host", "public_key": null}),
            json!({"kind": "user", "public_key": ED, "extra": 1}),
            json!({"kind": "user", "public_key": ED, "principals": "root"}),
            json!({"kind": "user", "public_key": ED, "validity_seconds": -1}),
        ] {
            assert!(Request::parse(&bad).is_err(), "{bad}");
        }
        let m = || ssh_key::Mpint::from_positive_bytes(&[7; 128]).unwrap();
        let dsa = key_line(KeyData::Dsa(ssh_key::public::DsaPublicKey {
            p: m(),
            q: m(),
            g: m(),
            y: m(),
        }));
        assert!(public_key(&dsa).unwrap_err().contains("ssh-dss"), "{dsa}");
        assert!(public_key(&rsa(3072)).is_ok());
        assert!(public_key(&rsa(1024)).unwrap_err().contains("1024-bit"));
        assert!(public_key("ssh-ed25519 AAAA").is_err());
        assert!(public_key("ssh-foo AAAAB3NzaC1mb28AAAAA").is_err());
        assert!(public_key(&"x".repeat(9000)).is_err());
        let cert_line =
            "ssh-ed25519-cert-v01@openssh.com AAAAIHNzaC1lZDI1NTE5LWNlcnQtdjAxQG9wZW5zc2guY29t";
        assert!(public_key(cert_line).is_err());
    }

    #[test]
    fn ca_requests_carry_nothing_to_certify() {
        assert_eq!(is_ca(&json!({"kind": "ca"})), Ok(true));
        let nulls =
            json!({"kind": "ca", "public_key": null, "principals": null, "validity_seconds": null});
        assert_eq!(is_ca(&nulls), Ok(true));
        assert_eq!(is_ca(&json!({"kind": "host", "public_key": ED})), Ok(false));
        assert_eq!(is_ca(&json!("ca")), Ok(false));
        for bad in [
            json!({"kind": "ca", "public_key": ED}),
            json!({"kind": "ca", "principals": ["app"]}),
            json!({"kind": "ca", "extra": null}),
        ] {
            assert!(is_ca(&bad).is_err(), "{bad}");
        }
        // Not a certificate request either: it never reaches the certificate checks.
        assert!(Request::parse(&json!({"kind": "ca"})).is_err());
    }

    #[test]
    fn principal_grammar() {
        for ok in [
            "app",
            "app.example.org",
            "*.app.example.org",
            "10.0.0.2",
            "fd00::2",
        ] {
            assert!(check_principal(Kind::Host, ok).is_ok(), "{ok}");
        }
        for bad in [
            "", "App", "a b", "a\nb", "*", "*.", ".a", "a.", "a*b", "a,b", "-x",
        ] {
            assert!(check_principal(Kind::Host, bad).is_err(), "{bad:?}");
        }
        for ok in ["root", "deploy", "_svc", "alice@example.org", "a-b.c"] {
            assert!(check_principal(Kind::User, ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "Root",
            "-o",
            "a b",
            "a,b",
            "*",
            "x\u{0}",
            ".x",
            &"a".repeat(300),
        ] {
            assert!(check_principal(Kind::User, bad).is_err(), "{bad:?}");
        }
        assert_eq!(bit_length(&[0, 0x01, 0]), 9);
        assert_eq!(bit_length(&[0x80; 256]), 2048);
    }
}
