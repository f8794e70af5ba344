//! The fleet's registry (`hosts.json`), for what a capability derives from the caller: its
//! own address (a vhost's upstream, a DNS record's default value).

use std::net::IpAddr;
use std::path::Path;

use fort_core::schema::Registry;

/// The fleet as the agent loaded it.
pub struct Fleet {
    registry: Registry,
}

impl Fleet {
    pub fn load(path: &Path) -> anyhow::Result<Fleet> {
        let registry = Registry::load(path).map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(Fleet { registry })
    }

    /// The host part of `origin`'s address in hosts.json (`10.0.0.2`, `app.lan`, an IPv6
    /// address without brackets); `None` for principals and unknown names.
    pub fn host_of(&self, origin: &str) -> Option<String> {
        let address = self.registry.get(origin)?.address.as_deref()?;
        let rest = address
            .strip_prefix("https://")
            .or_else(|| address.strip_prefix("http://"))?;
        let (host, _port) = rest.rsplit_once(':')?;
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        Some(host.to_owned())
    }

    /// The names of hosts.json's hosts (principals have no address).
    pub fn host_names(&self) -> impl Iterator<Item = &String> {
        self.registry.hosts().map(|(name, _)| name)
    }

    /// Whether `name` is a host of hosts.json (not a principal, not unknown).
    pub fn is_host(&self, name: &str) -> bool {
        self.registry.is_host(name)
    }

    /// `origin`'s address as an IP address, when hosts.json gives one.
    pub fn ip_of(&self, origin: &str) -> Option<IpAddr> {
        self.host_of(origin)?.parse().ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_of_hosts_only() {
        let dir = tempfile::tempdir().unwrap();
        let key =
            "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAID1AF8PoQ4lakrcKp00bfrycmCzPLsSWjMDNVfEq9GYM";
        let path = dir.path().join("hosts.json");
        std::fs::write(
            &path,
            serde_json::json!({
                "hosts": {"app": {"address": "https://10.0.0.2:7770", "keys": [key]},
                          "six": {"address": "https://[fd00::2]:7770", "keys": [key]}},
                "principals": {"ops": {"keys": [key]}}
            })
            .to_string(),
        )
        .unwrap();
        let fleet = Fleet::load(&path).unwrap();
        assert_eq!(fleet.ip_of("app"), Some("10.0.0.2".parse().unwrap()));
        assert_eq!(fleet.ip_of("six"), Some("fd00::2".parse().unwrap()));
        assert_eq!(fleet.host_of("ops"), None);
        assert_eq!(fleet.host_of("nobody"), None);
        assert!(fleet.is_host("app") && !fleet.is_host("ops") && !fleet.is_host("nobody"));
    }
}
