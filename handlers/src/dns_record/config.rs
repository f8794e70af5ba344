//! The `dns-record` provider's config (JSON, written by the NixOS module): the zone, its
//! primary, the TSIG key (its secret in a file), the names each caller may hold records
//! under, TTLs, and where the handler keeps what it created.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::common::Allowances;
use crate::dns::{Algorithm, DnsName, Server, TsigKey};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The zone records are made in (`example.org`). Required: every requested name must
    /// be this name or below it.
    pub zone: String,
    /// The zone's primary: `IP` (port 53) or `IP:PORT` (`[IPv6]:PORT`). Required. Updates
    /// and queries go to it over TCP; names are not resolved.
    pub primary: String,
    /// The TSIG key every message is signed with. Required: fort never sends an unsigned
    /// update.
    pub key: KeyConfig,
    /// Names each caller may hold records under: caller → patterns (`app.example.org`,
    /// `*.app.example.org`, `{origin}.hosts.example.org`), `"*"` for every caller. Unset or
    /// empty: every request is refused.
    #[serde(default)]
    pub allow: Allowances,
    /// TTL of a record whose request names none. Unset: 300 seconds.
    #[serde(default = "default_ttl")]
    pub default_ttl: u32,
    /// The highest TTL a request may ask for; a higher one is refused. Unset: 86400.
    #[serde(default = "max_ttl")]
    pub max_ttl: u32,
    /// The fleet's hosts.json, where a caller's own address (the default value of its A or
    /// AAAA record) comes from. Unset: `/etc/fort/hosts.json`.
    #[serde(default = "hosts_path")]
    pub hosts: PathBuf,
    /// The handler's state file: the records it created, per entry. Required; one per zone
    /// and capability (two capabilities sharing one would each delete the other's records).
    pub state: PathBuf,
    /// Seconds to wait for one answer of the primary. Unset: 10.
    #[serde(default = "timeout_seconds")]
    pub timeout_seconds: u64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyConfig {
    /// The key's name, as the primary knows it. Required.
    pub name: String,
    /// `hmac-sha256`, `hmac-sha384` or `hmac-sha512`. Unset: `hmac-sha256`.
    #[serde(default)]
    pub algorithm: Algorithm,
    /// A file holding the base64 secret (alone, or as `tsig-keygen` or `keymgr -t` print
    /// it), readable by the agent's user. Required; never copied anywhere.
    pub file: PathBuf,
}

fn default_ttl() -> u32 {
    300
}
fn max_ttl() -> u32 {
    86_400
}
fn hosts_path() -> PathBuf {
    PathBuf::from("/etc/fort/hosts.json")
}
fn timeout_seconds() -> u64 {
    10
}

/// The config with every value checked, and the key read.
pub struct Checked {
    pub config: Config,
    pub zone: DnsName,
    pub server: Server,
}

/// A TTL above a week is a mistake in a fleet whose addresses change.
const TTL_CEILING: u32 = 604_800;

impl Config {
    /// Loads and checks the config and the key file; contacts nothing.
    pub fn load(path: &Path) -> anyhow::Result<Checked> {
        let config: Config = crate::common::config::load(path)?;
        config.check()
    }

    /// Loads and checks what decides which records a caller may have (zone, allowances,
    /// TTLs), without the key: what the fleet check holds requests against.
    pub fn load_policy(path: &Path) -> anyhow::Result<(Config, DnsName)> {
        let config: Config = crate::common::config::load(path)?;
        let zone = config.check_policy()?;
        Ok((config, zone))
    }

    fn check_policy(&self) -> anyhow::Result<DnsName> {
        let zone = DnsName::parse(&self.zone).map_err(|e| anyhow::anyhow!("zone: {e}"))?;
        if zone.is_wildcard() {
            anyhow::bail!("zone: {zone} is a wildcard name");
        }
        parse_primary(&self.primary).ok_or_else(|| {
            anyhow::anyhow!(
                "primary: {:?} is not IP or IP:PORT (names are not resolved)",
                self.primary
            )
        })?;
        self.allow.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
        for (who, patterns) in &self.allow.0 {
            for p in patterns {
                let name = p.strip_prefix("*.").unwrap_or(p).replace("{origin}", "x");
                let in_zone = DnsName::parse(&name).is_ok_and(|n| n.is_in(&zone));
                if !in_zone {
                    anyhow::bail!("allow.{who}: {p:?} is not a name in the zone {zone}");
                }
            }
        }
        if !(1..=TTL_CEILING).contains(&self.max_ttl) {
            anyhow::bail!("max_ttl: {} is not 1 to {TTL_CEILING}", self.max_ttl);
        }
        if !(1..=self.max_ttl).contains(&self.default_ttl) {
            anyhow::bail!(
                "default_ttl: {} is not 1 to max_ttl ({})",
                self.default_ttl,
                self.max_ttl
            );
        }
        if !(1..=120).contains(&self.timeout_seconds) {
            anyhow::bail!("timeout_seconds: {} is not 1 to 120", self.timeout_seconds);
        }
        Ok(zone)
    }

    fn check(self) -> anyhow::Result<Checked> {
        let zone = self.check_policy()?;
        let addr = parse_primary(&self.primary).expect("checked by check_policy");
        let key = TsigKey::load(&self.key.name, self.key.algorithm, &self.key.file)
            .map_err(|e| anyhow::anyhow!("key: {e}"))?;
        let server = Server {
            addr,
            zone: zone.clone(),
            key,
            timeout: Duration::from_secs(self.timeout_seconds),
        };
        Ok(Checked {
            config: self,
            zone,
            server,
        })
    }
}

pub(crate) fn parse_primary(text: &str) -> Option<SocketAddr> {
    if let Ok(addr) = text.parse::<SocketAddr>() {
        return (addr.port() != 0).then_some(addr);
    }
    text.parse::<IpAddr>()
        .ok()
        .map(|ip| SocketAddr::new(ip, 53))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn write(dir: &Path, config: serde_json::Value) -> PathBuf {
        let path = dir.join("config.json");
        std::fs::write(&path, config.to_string()).unwrap();
        path
    }

    #[test]
    fn checks() {
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("key");
        std::fs::write(&key, "k0xaklPtoel14mVlmTQ2BkNKDbVHbGSTZPB1Xkl7ZUo=\n").unwrap();
        let good = json!({
            "zone": "Example.org.", "primary": "127.0.0.1:5353",
            "key": {"name": "fort", "file": key},
            "allow": {"app": ["app.example.org", "*.app.example.org"], "*": ["{origin}.h.example.org"]},
            "state": dir.path().join("state.json"),
        });
        let c = Config::load(&write(dir.path(), good.clone())).unwrap();
        assert_eq!(c.zone.as_str(), "example.org");
        assert_eq!(c.server.addr, "127.0.0.1:5353".parse().unwrap());
        assert_eq!(c.config.default_ttl, 300);
        let bad = |edit: &dyn Fn(&mut serde_json::Value), says: &str| {
            let mut v = good.clone();
            edit(&mut v);
            let e = Config::load(&write(dir.path(), v))
                .err()
                .expect(says)
                .to_string();
            assert!(e.contains(says), "{e} does not say {says}");
        };
        bad(&|v| v["primary"] = json!("dns.example.org"), "primary");
        bad(&|v| v["zone"] = json!("exa mple.org"), "zone");
        bad(
            &|v| v["allow"]["app"] = json!(["app.example.com"]),
            "allow.app",
        );
        bad(
            &|v| v["key"]["file"] = json!("/nonexistent/key"),
            "cannot read the TSIG key file",
        );
        bad(
            &|v| v["key"]["algorithm"] = json!("hmac-md5"),
            "key.algorithm",
        );
        bad(&|v| v["default_ttl"] = json!(0), "default_ttl");
        bad(&|v| v["surprise"] = json!(1), "surprise");
        assert_eq!(parse_primary("::1"), Some("[::1]:53".parse().unwrap()));
        assert_eq!(
            parse_primary("[::1]:5300"),
            Some("[::1]:5300".parse().unwrap())
        );
    }
}
