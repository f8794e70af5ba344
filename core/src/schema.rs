//! Typed models of `/etc/fort/hosts.json`, `needs.json` and `capabilities.json`
//! (PROTOCOL.md §10). Unknown fields are errors, reported with the file and field path.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use ssh_key::PublicKey;

use crate::names::{is_capability_name, is_host_name, is_principal_name, NeedKey};
use crate::sign::parse_public_key;

/// Capabilities every agent serves itself; a user capability may not take these names.
pub const BUILTIN_CAPABILITIES: [&str; 5] = ["status", "manifest", "needs", "journal", "systemd"];

/// A configuration file that cannot be used, with enough context to fix it.
#[derive(Debug, thiserror::Error)]
pub enum SchemaError {
    #[error("{file}: cannot read: {source}")]
    Read {
        file: String,
        source: std::io::Error,
    },
    #[error("{file}: at `{path}`: {message}")]
    Parse {
        file: String,
        path: String,
        message: String,
    },
    #[error("{file}: {message}")]
    Invalid { file: String, message: String },
}

fn invalid(file: &Path, message: String) -> SchemaError {
    SchemaError::Invalid {
        file: file.display().to_string(),
        message,
    }
}

/// Parses JSON with serde, naming the failing field path (`hosts.forge.adress`).
pub fn parse_json<T: serde::de::DeserializeOwned>(
    file: &Path,
    bytes: &[u8],
) -> Result<T, SchemaError> {
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(de).map_err(|e| SchemaError::Parse {
        file: file.display().to_string(),
        path: e.path().to_string(),
        message: e.inner().to_string(),
    })
}

/// `https://HOST:PORT` (or `http://HOST:PORT`, usable only with `plaintext = true`): a
/// host and a port, nothing after them.
pub fn is_address(address: &str) -> bool {
    let Some(rest) = address
        .strip_prefix("https://")
        .or_else(|| address.strip_prefix("http://"))
    else {
        return false;
    };
    let Some((host, port)) = rest.rsplit_once(':') else {
        return false;
    };
    !host.is_empty()
        && !rest.contains(['/', '?', '#', '@'])
        && !rest.chars().any(char::is_whitespace)
        && port.parse::<u16>().is_ok_and(|p| p > 0)
}

/// Whether an address is plain HTTP (allowed only with `plaintext = true`).
pub fn is_plaintext_address(address: &str) -> bool {
    address.starts_with("http://")
}

fn read(file: &Path) -> Result<Vec<u8>, SchemaError> {
    std::fs::read(file).map_err(|source| SchemaError::Read {
        file: file.display().to_string(),
        source,
    })
}

// ---------------------------------------------------------------- hosts.json

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct HostsFile {
    pub hosts: BTreeMap<String, HostEntry>,
    #[serde(default)]
    pub principals: BTreeMap<String, PrincipalEntry>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct HostEntry {
    /// Base URL, `https://10.0.0.5:7770`.
    pub address: String,
    pub keys: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PrincipalEntry {
    pub keys: Vec<String>,
}

/// Whether a name in the registry is a host (has an address) or a principal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerKind {
    Host,
    Principal,
}

/// A known caller: its parsed keys and, for hosts, where to reach it.
#[derive(Debug, Clone)]
pub struct Peer {
    pub kind: PeerKind,
    pub address: Option<String>,
    pub keys: Vec<PublicKey>,
}

/// `hosts.json`, validated, with keys parsed once.
#[derive(Debug, Clone, Default)]
pub struct Registry {
    pub peers: BTreeMap<String, Peer>,
}

impl Registry {
    pub fn load(file: &Path) -> Result<Registry, SchemaError> {
        Registry::from_bytes(file, &read(file)?)
    }

    pub fn from_bytes(file: &Path, bytes: &[u8]) -> Result<Registry, SchemaError> {
        let parsed: HostsFile = parse_json(file, bytes)?;
        Registry::from_file(file, parsed)
    }

    pub fn from_file(file: &Path, parsed: HostsFile) -> Result<Registry, SchemaError> {
        let mut peers = BTreeMap::new();
        let parse_keys = |what: &str, name: &str, keys: &[String]| {
            if keys.is_empty() {
                return Err(invalid(file, format!("{what} {name:?} has no keys")));
            }
            keys.iter()
                .enumerate()
                .map(|(i, k)| {
                    parse_public_key(k)
                        .map_err(|e| invalid(file, format!("{what} {name:?} keys[{i}]: {e}")))
                })
                .collect::<Result<Vec<_>, _>>()
        };
        for (name, host) in &parsed.hosts {
            if !is_host_name(name) {
                return Err(invalid(
                    file,
                    format!("host name {name:?} breaks ^[a-z0-9][a-z0-9-]{{0,62}}$"),
                ));
            }
            if !is_address(&host.address) {
                return Err(invalid(
                    file,
                    format!(
                        "host {name:?} address {:?} must look like https://HOST:PORT",
                        host.address
                    ),
                ));
            }
            let keys = parse_keys("host", name, &host.keys)?;
            peers.insert(
                name.clone(),
                Peer {
                    kind: PeerKind::Host,
                    address: Some(host.address.clone()),
                    keys,
                },
            );
        }
        for (name, principal) in &parsed.principals {
            if !is_principal_name(name) {
                return Err(invalid(
                    file,
                    format!("principal name {name:?} breaks ^[a-z_][a-z0-9_-]{{0,31}}$"),
                ));
            }
            if parsed.hosts.contains_key(name) {
                return Err(invalid(
                    file,
                    format!("{name:?} is both a host and a principal"),
                ));
            }
            let keys = parse_keys("principal", name, &principal.keys)?;
            peers.insert(
                name.clone(),
                Peer {
                    kind: PeerKind::Principal,
                    address: None,
                    keys,
                },
            );
        }
        Ok(Registry { peers })
    }

    pub fn get(&self, name: &str) -> Option<&Peer> {
        self.peers.get(name)
    }

    pub fn is_host(&self, name: &str) -> bool {
        matches!(self.peers.get(name), Some(p) if p.kind == PeerKind::Host)
    }

    pub fn hosts(&self) -> impl Iterator<Item = (&String, &Peer)> {
        self.peers.iter().filter(|(_, p)| p.kind == PeerKind::Host)
    }
}

// ---------------------------------------------------------------- needs.json

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NeedSpec {
    /// The provider host.
    pub from: String,
    /// Sent as `request` in the async body; must be a JSON object.
    pub request: serde_json::Value,
    /// How often an unsatisfied need is re-requested.
    pub nag_seconds: u64,
    /// Run with the payload on stdin; absent means a side-effect-only need.
    #[serde(default)]
    pub handler: Option<PathBuf>,
    /// Freshness probe run each cycle for a satisfied need; non-zero marks it unsatisfied.
    #[serde(default)]
    pub check: Option<PathBuf>,
    /// Re-request every nag interval even when satisfied.
    #[serde(default)]
    pub never_satisfied: bool,
}

/// `needs.json`, validated: keys are need keys.
pub type Needs = BTreeMap<NeedKey, NeedSpec>;

pub fn load_needs(file: &Path, registry: &Registry) -> Result<Needs, SchemaError> {
    let raw: BTreeMap<String, NeedSpec> = parse_json(file, &read(file)?)?;
    validate_needs(file, raw, registry)
}

pub fn validate_needs(
    file: &Path,
    raw: BTreeMap<String, NeedSpec>,
    registry: &Registry,
) -> Result<Needs, SchemaError> {
    let mut needs = Needs::new();
    for (key, spec) in raw {
        let need = NeedKey::parse(&key)
            .ok_or_else(|| invalid(file, format!("need key {key:?} is not <type>/<id>")))?;
        if !registry.is_host(&spec.from) {
            return Err(invalid(
                file,
                format!(
                    "need {key:?}: from {:?} is not a host in hosts.json",
                    spec.from
                ),
            ));
        }
        if !spec.request.is_object() {
            return Err(invalid(
                file,
                format!("need {key:?}: request must be a JSON object"),
            ));
        }
        if spec.nag_seconds == 0 {
            return Err(invalid(
                file,
                format!("need {key:?}: nag_seconds must be at least 1"),
            ));
        }
        needs.insert(need, spec);
    }
    Ok(needs)
}

// ---------------------------------------------------------------- capabilities.json

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    Async,
    Rpc,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Triggers {
    /// Run the handler over all entries after start.
    #[serde(default)]
    pub initialize: bool,
    /// Units whose success triggers a run (wired by the NixOS module).
    #[serde(default)]
    pub systemd: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CapabilitySpec {
    pub handler: PathBuf,
    pub mode: Mode,
    /// Pass each entry's last response back to the handler.
    #[serde(rename = "cacheResponse", default)]
    pub cache_response: bool,
    /// Principals and hosts allowed besides the computed callers.
    #[serde(default)]
    pub allowed: Vec<String>,
    /// Hosts that declare a need of this type from this host.
    #[serde(default)]
    pub callers: Vec<String>,
    #[serde(default)]
    pub triggers: Triggers,
    #[serde(default)]
    pub description: Option<String>,
}

impl CapabilitySpec {
    pub fn permits(&self, origin: &str) -> bool {
        self.allowed
            .iter()
            .chain(&self.callers)
            .any(|n| n == origin)
    }
}

pub type Capabilities = BTreeMap<String, CapabilitySpec>;

pub fn load_capabilities(file: &Path, registry: &Registry) -> Result<Capabilities, SchemaError> {
    let raw: Capabilities = parse_json(file, &read(file)?)?;
    validate_capabilities(file, raw, registry)
}

pub fn validate_capabilities(
    file: &Path,
    caps: Capabilities,
    registry: &Registry,
) -> Result<Capabilities, SchemaError> {
    for (name, cap) in &caps {
        if !is_capability_name(name) {
            return Err(invalid(
                file,
                format!("capability name {name:?} breaks ^[a-z0-9][a-z0-9_-]{{0,63}}$"),
            ));
        }
        if BUILTIN_CAPABILITIES.contains(&name.as_str()) {
            return Err(invalid(
                file,
                format!("capability {name:?} clashes with a built-in capability"),
            ));
        }
        for who in &cap.allowed {
            if registry.get(who).is_none() {
                return Err(invalid(
                    file,
                    format!("capability {name:?}: allowed {who:?} is not in hosts.json"),
                ));
            }
        }
        for who in &cap.callers {
            if !registry.is_host(who) {
                return Err(invalid(
                    file,
                    format!("capability {name:?}: caller {who:?} is not a host in hosts.json"),
                ));
            }
        }
        if cap.mode == Mode::Rpc
            && (cap.cache_response || cap.triggers.initialize || !cap.triggers.systemd.is_empty())
        {
            return Err(invalid(
                file,
                format!("capability {name:?}: cacheResponse and triggers apply to async mode only"),
            ));
        }
    }
    Ok(caps)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sign::Signer;

    fn hosts_json() -> String {
        let k = Signer::generate().public_openssh();
        format!(
            r#"{{"hosts":{{"forge":{{"address":"https://127.0.0.1:1","keys":["{k}"]}}}},"principals":{{"ops":{{"keys":["{k}"]}}}}}}"#
        )
    }

    #[test]
    fn unknown_fields_are_named() {
        let bad = hosts_json().replace("\"address\"", "\"adress\"");
        let err = Registry::from_bytes(Path::new("hosts.json"), bad.as_bytes()).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("hosts.json") && msg.contains("hosts.forge") && msg.contains("adress"),
            "{msg}"
        );
    }

    #[test]
    fn registry_and_needs() {
        let reg = Registry::from_bytes(Path::new("h"), hosts_json().as_bytes()).unwrap();
        assert!(reg.is_host("forge"));
        assert!(!reg.is_host("ops"));
        let raw: BTreeMap<String, NeedSpec> = serde_json::from_str(
            r#"{"oidc/outline":{"from":"nowhere","request":{},"nag_seconds":5}}"#,
        )
        .unwrap();
        let err = validate_needs(Path::new("needs.json"), raw, &reg).unwrap_err();
        assert!(err.to_string().contains("nowhere"));
    }

    #[test]
    fn addresses() {
        assert!(is_address("https://10.0.0.5:7770"));
        assert!(is_address("https://[::1]:7770"));
        assert!(is_address("http://forge.lan:7770"));
        for bad in [
            "https://10.0.0.5",
            "https://10.0.0.5:7770/",
            "ftp://x:1",
            "https://:1",
            "https://a:0",
            "https://u@a:1",
        ] {
            assert!(!is_address(bad), "{bad}");
        }
    }

    #[test]
    fn builtin_clash_is_an_error() {
        let reg = Registry::from_bytes(Path::new("h"), hosts_json().as_bytes()).unwrap();
        let caps: Capabilities =
            serde_json::from_str(r#"{"status":{"handler":"/x","mode":"rpc"}}"#).unwrap();
        assert!(validate_capabilities(Path::new("c"), caps, &reg).is_err());
    }
}
