//! `needs.json`: what this host needs, from whom, and how a delivered payload lands
//! (docs/protocol.md §10, §11.3–§11.5).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::encrypted::{check_encrypted_not_referred, CredentialKey};
use super::hosts::Registry;
use super::keys::{check_keys, KeySpec};
use super::refs::{references, NeedRef};
use super::{invalid, parse_json, read, SchemaError};
use crate::names::{is_unit_name, NeedKey};
use crate::wire::{json_depth, MAX_REQUEST_DEPTH};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NeedSpec {
    /// The provider host, or several in order of preference (§11.13).
    pub from: Providers,
    /// Sent as `request` in the async body; must be a JSON object. May hold references
    /// to other needs' payloads (§11.5).
    pub request: serde_json::Value,
    /// How often an unsatisfied need is re-requested.
    pub nag_seconds: u64,
    /// Run with the payload on stdin; absent means a side-effect-only need (unless it
    /// has `files`).
    #[serde(default)]
    pub handler: Option<PathBuf>,
    /// Freshness probe run each cycle for a satisfied need; non-zero marks it unsatisfied.
    #[serde(default)]
    pub check: Option<PathBuf>,
    /// Re-request every nag interval even when satisfied.
    #[serde(default)]
    pub never_satisfied: bool,
    /// Files written from each non-empty payload (§11.3).
    #[serde(default)]
    pub files: Vec<FileSpec>,
    /// Units restarted when a file's content changes (at most once per unit per round).
    #[serde(default)]
    pub restart_units: Vec<String>,
    /// Units reloaded when a file's content changes.
    #[serde(default)]
    pub reload_units: Vec<String>,
    /// Ask again this long before the payload expires (§11.4).
    #[serde(default)]
    pub renew_before_seconds: Option<u64>,
    /// Needs that must be satisfied before this one is sent (§11.5).
    #[serde(default)]
    pub after: Vec<String>,
    /// Keys this host makes for the need and never sends (§11.10). Not written when
    /// empty, so that declarations hashed before keys existed hash the same.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub keys: BTreeMap<String, KeySpec>,
    /// How long the home must have failed before a due need moves to the next provider
    /// (§11.13); `None`: twice `nag_seconds`. Not written when absent, so declarations
    /// read before it existed read and hash the same.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failover_after_seconds: Option<u64>,
}

/// The most providers one need may name: each is a place a consumer may be moved to, and
/// every one of them has to accept the consumer.
pub const MAX_PROVIDERS: usize = 8;

/// `from`: one provider, or several in order of preference (§11.13). Written back the
/// way it was read, so that a single string serialises (and hashes) as it always did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Providers {
    One(String),
    Several(Vec<String>),
}

impl Providers {
    /// Every provider, in order.
    pub fn all(&self) -> &[String] {
        match self {
            Providers::One(p) => std::slice::from_ref(p),
            Providers::Several(list) => list,
        }
    }

    /// The provider a need starts at.
    pub fn first(&self) -> &str {
        self.all().first().map_or("", String::as_str)
    }

    /// Whether `host` is one of the providers.
    pub fn names(&self, host: &str) -> bool {
        self.all().iter().any(|p| p == host)
    }

    /// More than one provider: the need can move (§11.13).
    pub fn several(&self) -> bool {
        self.all().len() > 1
    }
}

impl From<&str> for Providers {
    fn from(host: &str) -> Providers {
        Providers::One(host.to_owned())
    }
}

impl std::fmt::Display for Providers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.all().join(", "))
    }
}

impl NeedSpec {
    /// How long the home must have failed before the need moves (§11.13).
    pub fn failover_after(&self) -> std::time::Duration {
        std::time::Duration::from_secs(
            self.failover_after_seconds
                .unwrap_or(self.nag_seconds.saturating_mul(2)),
        )
    }
}

impl NeedSpec {
    /// Side-effect-only: no handler and no files, satisfied by the payload `OK` (§7).
    pub fn side_effect_only(&self) -> bool {
        self.handler.is_none() && self.files.is_empty() && self.keys.is_empty()
    }

    /// Whether the request sent can differ from the request written: it holds references
    /// to other needs' payloads or to keys, resolved at send time.
    pub fn resolved_at_send(&self) -> bool {
        !self.keys.is_empty() || !self.references().is_empty()
    }

    /// Every need this one waits for: its references and its `after`, once each.
    pub fn dependencies(&self) -> BTreeSet<NeedKey> {
        let mut deps: BTreeSet<NeedKey> = references(&self.request)
            .unwrap_or_default()
            .into_iter()
            .map(|r| r.need)
            .collect();
        deps.extend(self.after.iter().filter_map(|a| NeedKey::parse(a)));
        deps
    }

    /// The references in the request (validated at load, so never an error here).
    pub fn references(&self) -> Vec<NeedRef> {
        references(&self.request).unwrap_or_default()
    }
}

/// One file written from a payload (§11.3).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FileSpec {
    /// A short name for status and logs (the NixOS module's attribute name).
    #[serde(default)]
    pub name: Option<String>,
    /// Absolute path of the file.
    pub path: PathBuf,
    /// RFC 6901 pointer into the JSON payload; `""` writes the whole payload.
    #[serde(default)]
    pub pointer: String,
    #[serde(default = "root")]
    pub owner: String,
    #[serde(default = "root")]
    pub group: String,
    /// Octal, e.g. `"0400"`.
    #[serde(default = "default_mode")]
    pub mode: String,
    /// Units that receive the file as a systemd credential and are started by a path
    /// unit when it appears: restarted when its content is replaced, left to the path
    /// unit when it is created (§11.3). Not part of what identifies the declaration
    /// (units change in place), and not written when empty, so that the declarations
    /// agents hashed before this field existed hash the same.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub credential_for: Vec<String>,
    /// Stored as a systemd encrypted credential made on this host with this key, never
    /// as the plaintext (§11.3, *Encrypted files*). Not written when absent, so that the
    /// declarations agents hashed before this field existed hash the same.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encrypt: Option<CredentialKey>,
}

fn root() -> String {
    "root".into()
}

fn default_mode() -> String {
    "0400".into()
}

impl FileSpec {
    /// The mode as a number (validated at load).
    pub fn mode_bits(&self) -> u32 {
        u32::from_str_radix(&self.mode, 8).unwrap_or(0o400)
    }

    /// Whether the file is stored as an encrypted credential.
    pub fn encrypted(&self) -> bool {
        self.encrypt.is_some()
    }

    pub fn label(&self) -> String {
        self.name
            .clone()
            .unwrap_or_else(|| self.path.display().to_string())
    }
}

/// `needs.json`, validated: keys are need keys.
pub type Needs = BTreeMap<NeedKey, NeedSpec>;

pub fn load_needs(file: &Path, registry: &Registry) -> Result<Needs, SchemaError> {
    needs_from_bytes(file, &read(file)?, registry)
}

/// `needs.json` from bytes already read (`file` names them in errors).
pub fn needs_from_bytes(
    file: &Path,
    bytes: &[u8],
    registry: &Registry,
) -> Result<Needs, SchemaError> {
    // Parsed member by member, so that the templates beside the needs (§11.14) are not
    // taken for one; a field at fault is still named from the file's root.
    let members: BTreeMap<String, Box<serde_json::value::RawValue>> = parse_json(file, bytes)?;
    let mut raw = BTreeMap::new();
    for (key, value) in members {
        if key == super::templates::TEMPLATES_KEY {
            continue;
        }
        let de = &mut serde_json::Deserializer::from_str(value.get());
        let spec: NeedSpec =
            serde_path_to_error::deserialize(de).map_err(|e| SchemaError::Parse {
                file: file.display().to_string(),
                path: match e.path().to_string().as_str() {
                    "." => key.clone(),
                    inner => format!("{key}.{inner}"),
                },
                message: e.inner().to_string(),
            })?;
        raw.insert(key, spec);
    }
    validate_needs(file, raw, registry)
}

/// A user or group name as `useradd` accepts it, or a numeric id.
/// Bounds on the intervals of a need: every deadline is computed from them.
const MAX_NAG_SECONDS: u64 = 365 * 24 * 3600;
const MAX_RENEW_BEFORE_SECONDS: u64 = 10 * 365 * 24 * 3600;

fn is_account_name(s: &str) -> bool {
    if !s.is_empty() && s.len() <= 10 && s.bytes().all(|c| c.is_ascii_digit()) {
        // 4294967295 is (uid_t)-1: chown reads it as "leave unchanged", never an owner.
        return s.parse::<u32>().is_ok_and(|id| id != u32::MAX);
    }
    let b = s.as_bytes();
    let body = b.strip_suffix(b"$").unwrap_or(b);
    !body.is_empty()
        && s.len() <= 32
        && (body[0].is_ascii_lowercase() || body[0] == b'_')
        && body
            .iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'_' || *c == b'-')
}

fn is_mode(s: &str) -> bool {
    // Permission bits only: setuid, setgid and sticky make no sense on a credential.
    let digits = s.strip_prefix('0').filter(|_| s.len() == 4).unwrap_or(s);
    digits.len() == 3 && digits.bytes().all(|c| (b'0'..=b'7').contains(&c))
}

pub(super) fn check_file(key: &str, f: &FileSpec) -> Result<(), String> {
    let where_ = format!("need {key:?}: file {:?}", f.label());
    let clean = f.path.is_absolute()
        && f.path.components().count() > 1
        && f.path
            .components()
            .all(|c| matches!(c, Component::RootDir | Component::Normal(_)))
        && !f.path.to_string_lossy().ends_with('/');
    if !clean {
        return Err(format!(
            "{where_}: path must be absolute, without . or .. components"
        ));
    }
    if !(f.pointer.is_empty() || f.pointer.starts_with('/')) {
        return Err(format!(
            "{where_}: pointer {:?} must be empty or start with /",
            f.pointer
        ));
    }
    if !is_account_name(&f.owner) || !is_account_name(&f.group) {
        return Err(format!(
            "{where_}: owner {:?} and group {:?} must be account names or numeric ids",
            f.owner, f.group
        ));
    }
    if !is_mode(&f.mode) {
        return Err(format!(
            "{where_}: mode {:?} must be three octal digits, optionally after a 0 (\"0400\")",
            f.mode
        ));
    }
    if let Some(name) = &f.name {
        let ok = !name.is_empty()
            && !name.starts_with('.')
            && name
                .bytes()
                .all(|c| c.is_ascii_alphanumeric() || b"._-".contains(&c));
        if !ok {
            return Err(format!("{where_}: name must be letters, digits, . _ -"));
        }
    }
    if f.encrypted() && f.name.is_none() {
        return Err(format!(
            "{where_}: an encrypted file needs a name: it is the credential's name, the only one it loads under"
        ));
    }
    Ok(())
}

pub fn validate_needs(
    file: &Path,
    raw: BTreeMap<String, NeedSpec>,
    registry: &Registry,
) -> Result<Needs, SchemaError> {
    let mut needs = Needs::new();
    let mut paths: BTreeMap<PathBuf, String> = BTreeMap::new();
    for (key, spec) in raw {
        let bad = |message: String| invalid(file, format!("need {key:?}: {message}"));
        let need = NeedKey::parse(&key)
            .ok_or_else(|| invalid(file, format!("need key {key:?} is not <type>/<id>")))?;
        let providers = spec.from.all();
        if providers.is_empty() || providers.len() > MAX_PROVIDERS {
            return Err(bad(format!(
                "from must name 1 to {MAX_PROVIDERS} providers"
            )));
        }
        for (i, p) in providers.iter().enumerate() {
            if !registry.is_host(p) {
                return Err(bad(format!("from {p:?} is not a host in hosts.json")));
            }
            if providers[..i].contains(p) {
                return Err(bad(format!("from names {p:?} twice")));
            }
        }
        if spec
            .failover_after_seconds
            .is_some_and(|s| s == 0 || s > MAX_NAG_SECONDS)
        {
            return Err(bad(format!(
                "failover_after_seconds must be 1 to {MAX_NAG_SECONDS} (a year), or null"
            )));
        }
        if !spec.request.is_object() {
            return Err(bad("request must be a JSON object".into()));
        }
        if json_depth(&spec.request) > MAX_REQUEST_DEPTH {
            return Err(bad(format!(
                "request nests deeper than {MAX_REQUEST_DEPTH} levels"
            )));
        }
        if spec.nag_seconds == 0 || spec.nag_seconds > MAX_NAG_SECONDS {
            return Err(bad(format!(
                "nag_seconds must be 1 to {MAX_NAG_SECONDS} (a year)"
            )));
        }
        for f in &spec.files {
            check_file(&key, f).map_err(|m| invalid(file, m))?;
            if let Some(other) = paths.insert(f.path.clone(), key.clone()) {
                return Err(bad(format!(
                    "file {} is also written by need {other:?}",
                    f.path.display()
                )));
            }
        }
        check_keys(&spec.keys, &spec.request).map_err(bad)?;
        for (name, k) in &spec.keys {
            // A key lands like a file: the same rules for where and whose.
            let as_file = k.as_file(name);
            check_file(&key, &as_file)
                .map_err(|m| invalid(file, m.replacen(": file ", ": key ", 1)))?;
            if as_file.mode_bits() & 0o027 != 0 {
                return Err(bad(format!(
                    "key {name:?}: mode {} lets other users read it or its group change it; a private key is at most 0640",
                    k.mode
                )));
            }
            if let Some(other) = paths.insert(k.path.clone(), key.clone()) {
                return Err(bad(format!(
                    "key {name:?}: {} is also written by need {other:?}",
                    k.path.display()
                )));
            }
        }
        let credentials = spec.files.iter().flat_map(|f| &f.credential_for);
        for unit in spec
            .restart_units
            .iter()
            .chain(&spec.reload_units)
            .chain(credentials)
        {
            if !is_unit_name(unit) {
                return Err(bad(format!("{unit:?} is not a unit name")));
            }
        }
        if spec
            .renew_before_seconds
            .is_some_and(|s| s == 0 || s > MAX_RENEW_BEFORE_SECONDS)
        {
            return Err(bad(format!(
                "renew_before_seconds must be 1 to {MAX_RENEW_BEFORE_SECONDS} (ten years), or null"
            )));
        }
        references(&spec.request).map_err(|m| bad(format!("request: {m}")))?;
        for a in &spec.after {
            if NeedKey::parse(a).is_none() {
                return Err(bad(format!("after {a:?} is not <type>/<id>")));
            }
        }
        needs.insert(need, spec);
    }
    check_dependencies(file, &needs)?;
    check_encrypted_not_referred(file, &needs)?;
    Ok(needs)
}

/// Every reference and `after` names a declared need, and none leads back to itself.
fn check_dependencies(file: &Path, needs: &Needs) -> Result<(), SchemaError> {
    for (key, spec) in needs {
        for dep in spec.dependencies() {
            if dep == *key {
                return Err(invalid(file, format!("need \"{key}\" refers to itself")));
            }
            if !needs.contains_key(&dep) {
                return Err(invalid(
                    file,
                    format!("need \"{key}\" refers to \"{dep}\", which this host does not declare"),
                ));
            }
        }
    }
    // Depth-first search with colours; the path on the stack names the cycle.
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        New,
        Open,
        Done,
    }
    let mut marks: BTreeMap<&NeedKey, Mark> = needs.keys().map(|k| (k, Mark::New)).collect();
    for start in needs.keys() {
        if marks[start] != Mark::New {
            continue;
        }
        let mut path: Vec<&NeedKey> = vec![start];
        let mut iters = vec![needs[start].dependencies().into_iter()];
        marks.insert(start, Mark::Open);
        while let Some(it) = iters.last_mut() {
            match it.next() {
                Some(dep) => {
                    let (dep_key, _) = needs.get_key_value(&dep).expect("checked above");
                    match marks[dep_key] {
                        Mark::Open => {
                            let from = path.iter().position(|k| *k == dep_key).unwrap_or(0);
                            let cycle: Vec<String> = path[from..]
                                .iter()
                                .chain(std::iter::once(&dep_key))
                                .map(|k| k.to_string())
                                .collect();
                            return Err(invalid(
                                file,
                                format!(
                                    "needs refer to each other in a cycle: {}",
                                    cycle.join(" → ")
                                ),
                            ));
                        }
                        Mark::New => {
                            marks.insert(dep_key, Mark::Open);
                            path.push(dep_key);
                            iters.push(needs[dep_key].dependencies().into_iter());
                        }
                        Mark::Done => {}
                    }
                }
                None => {
                    iters.pop();
                    if let Some(done) = path.pop() {
                        marks.insert(done, Mark::Done);
                    }
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::schema::hosts::tests::hosts_json;

    pub(crate) fn registry() -> Registry {
        Registry::from_bytes(Path::new("h"), hosts_json().as_bytes()).unwrap()
    }

    /// needs.json text validated against the test registry.
    pub(crate) fn needs(json: &str) -> Result<Needs, SchemaError> {
        let raw: BTreeMap<String, NeedSpec> = serde_json::from_str(json).unwrap();
        validate_needs(Path::new("needs.json"), raw, &registry())
    }

    #[test]
    fn unknown_provider() {
        let err = needs(r#"{"oidc/outline":{"from":"nowhere","request":{},"nag_seconds":5}}"#)
            .unwrap_err();
        assert!(err.to_string().contains("nowhere"));
    }

    #[test]
    fn delivery_fields() {
        let ok = needs(
            r#"{"oidc/o":{"from":"forge","request":{},"nag_seconds":5,
                "files":[{"name":"secret","path":"/run/fort/needs/oidc/o/secret","pointer":"/client_secret","owner":"outline","group":"outline","mode":"0440"}],
                "restart_units":["outline.service"],"renew_before_seconds":60}}"#,
        )
        .unwrap();
        let spec = &ok[&NeedKey::parse("oidc/o").unwrap()];
        assert_eq!(spec.files[0].mode_bits(), 0o440);
        assert!(!spec.side_effect_only());
        for (bad, says) in [
            (r#""path":"relative/x""#, "absolute"),
            (r#""path":"/a/../b""#, "absolute"),
            (r#""path":"/a","mode":"4755""#, "mode"),
            (r#""path":"/a","mode":"rw""#, "mode"),
            (r#""path":"/a","owner":"Bad Name""#, "owner"),
            (r#""path":"/a","pointer":"client_secret""#, "pointer"),
        ] {
            let err = needs(&format!(
                r#"{{"oidc/o":{{"from":"forge","request":{{}},"nag_seconds":5,"files":[{{{bad}}}]}}}}"#
            ))
            .unwrap_err()
            .to_string();
            assert!(err.contains(says), "{bad}: {err}");
        }
        let err = needs(
            r#"{"a/x":{"from":"forge","request":{},"nag_seconds":5,"files":[{"path":"/f"}]},
                "a/y":{"from":"forge","request":{},"nag_seconds":5,"files":[{"path":"/f"}]}}"#,
        )
        .unwrap_err();
        assert!(err.to_string().contains("also written"), "{err}");
    }

    #[test]
    fn references_must_be_declared_and_acyclic() {
        let ok = needs(
            r#"{"ssl/a":{"from":"forge","request":{},"nag_seconds":5},
                "proxy/a":{"from":"forge","request":{"fp":{"$fort_ref":"ssl/a#/fp"}},"nag_seconds":5,"after":["ssl/a"]}}"#,
        )
        .unwrap();
        let proxy = &ok[&NeedKey::parse("proxy/a").unwrap()];
        assert_eq!(proxy.dependencies().len(), 1);
        let err = needs(
            r#"{"proxy/a":{"from":"forge","request":{"fp":{"$fort_ref":"ssl/zz"}},"nag_seconds":5}}"#,
        )
        .unwrap_err();
        assert!(err.to_string().contains("does not declare"), "{err}");
        let err = needs(
            r#"{"a/x":{"from":"forge","request":{"r":{"$fort_ref":"b/y"}},"nag_seconds":5},
                "b/y":{"from":"forge","request":{},"nag_seconds":5,"after":["c/z"]},
                "c/z":{"from":"forge","request":{},"nag_seconds":5,"after":["a/x"]}}"#,
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("cycle: a/x → b/y → c/z → a/x"),
            "{err}"
        );
    }

    #[test]
    fn keys_land_like_files() {
        let ok = needs(
            r#"{"tls/web":{"from":"forge","nag_seconds":5,
                "request":{"csr":{"$fort_key":"tls","as":"csr"}},
                "keys":{"tls":{"type":"ecdsa-p256","path":"/run/k/key.pem","names":["a.example.org"]}}}}"#,
        )
        .unwrap();
        let spec = &ok[&NeedKey::parse("tls/web").unwrap()];
        assert!(spec.resolved_at_send() && !spec.side_effect_only());
        for (bad, says) in [
            (r#""type":"ecdsa-p256","path":"relative""#, "absolute"),
            (r#""type":"ecdsa-p256","path":"/k","mode":"4755""#, "mode"),
            (
                r#""type":"ecdsa-p256","path":"/k","mode":"0644""#,
                "at most 0640",
            ),
            (r#""type":"ecdsa-p256","path":"/f""#, "also written"),
        ] {
            let err = needs(&format!(
                r#"{{"tls/web":{{"from":"forge","request":{{}},"nag_seconds":5,
                    "files":[{{"path":"/f"}}],"keys":{{"tls":{{{bad}}}}}}}}}"#
            ))
            .unwrap_err()
            .to_string();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }

    #[test]
    fn deep_requests_are_refused() {
        let mut v = String::from("1");
        for _ in 0..40 {
            v = format!("[{v}]");
        }
        let err = needs(&format!(
            r#"{{"a/x":{{"from":"forge","request":{{"deep":{v}}},"nag_seconds":5}}}}"#
        ))
        .unwrap_err();
        assert!(err.to_string().contains("deeper"), "{err}");
    }
}
