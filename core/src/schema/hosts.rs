//! `hosts.json`: every host (address and keys) and principal (keys) of the fleet.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};
use ssh_key::PublicKey;

use super::{invalid, parse_json, read, SchemaError};
use crate::names::{is_host_name, is_principal_name};
use crate::sign::parse_public_key;

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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
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

    pub fn principals(&self) -> impl Iterator<Item = (&String, &Peer)> {
        self.peers
            .iter()
            .filter(|(_, p)| p.kind == PeerKind::Principal)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::sign::Signer;

    pub(crate) fn hosts_json() -> String {
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
}
