//! The `acme` provider's config (JSON, written by the NixOS module): the ACME directory
//! and account, which names each caller may get certificates for, how challenges are
//! answered (a webroot for HTTP-01, RFC 2136 + TSIG for DNS-01), and the state file.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::common::Allowances;
use crate::dns::{DnsName, Server, TsigKey};
use crate::dns_record::config::{parse_primary, KeyConfig};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The CA's ACME directory URL (`https://acme-v02.api.letsencrypt.org/directory`).
    /// Required.
    pub directory: String,
    /// Contact URIs for the account (`mailto:ops@example.org`). Unset: none.
    #[serde(default)]
    pub contact: Vec<String>,
    /// External Account Binding, for CAs that require one. Unset: none.
    #[serde(default)]
    pub eab: Option<EabConfig>,
    /// A PEM file with the root certificate the directory's TLS certificate chains to
    /// (a private CA, a test CA). Unset: the platform's trusted roots.
    #[serde(default)]
    pub ca_root: Option<PathBuf>,
    /// Names each caller may get certificates for: caller → patterns (`app.example.org`,
    /// `*.app.example.org`, `{origin}.hosts.example.org`), `"*"` for every caller. Unset
    /// or empty: every request is refused.
    #[serde(default)]
    pub allow: Allowances,
    /// HTTP-01: answer challenges by files in a directory the provider's web server serves
    /// at `http://NAME/.well-known/acme-challenge/`. Unset: no HTTP-01.
    #[serde(default)]
    pub http01: Option<Http01Config>,
    /// DNS-01: answer challenges by TXT records at `_acme-challenge.NAME`, set by RFC 2136
    /// updates signed with TSIG at the zone's primary; needed for wildcard names. Unset:
    /// no DNS-01 (wildcard names are refused).
    #[serde(default)]
    pub dns01: Option<Dns01Config>,
    /// Revoke a certificate at the CA when its entry is released. Unset: false (the
    /// certificate expires on its own).
    #[serde(default)]
    pub revoke_on_release: bool,
    /// Seconds until the handler asks to be run again while orders are under way. Unset: 3.
    #[serde(default = "rerun_seconds")]
    pub rerun_seconds: u64,
    /// First wait after an entry's order fails at the CA (doubled per failure up to an
    /// hour). Unset: 60.
    #[serde(default = "backoff_seconds")]
    pub backoff_seconds: u64,
    /// An order still not valid after this many seconds is given up and placed again.
    /// Unset: 3600.
    #[serde(default = "order_timeout_seconds")]
    pub order_timeout_seconds: u64,
    /// Seconds to wait for one answer of the CA. Unset: 20.
    #[serde(default = "timeout_seconds")]
    pub timeout_seconds: u64,
    /// Certificates issued in any 7 days for one entry, and for one set of names: past
    /// it, the entry keeps what it holds and waits. A CA's limits are shared by every
    /// caller (Let's Encrypt: 5 certificates a week for one set of names, 50 for one
    /// registered domain), so no caller may spend them by asking. Unset: 5.
    #[serde(default = "max_certificates_per_week")]
    pub max_certificates_per_week: u32,
    /// Certificates issued in any 7 days for all entries of one caller together, those
    /// it released included: a caller with many entries, or one that releases entries
    /// and asks again under new ids with new names, would otherwise spend a limit of the
    /// CA for a whole domain (Let's Encrypt: 50 a week for one registered domain), and
    /// every other caller's new certificates with it. Unset: 20.
    #[serde(default = "max_certificates_per_caller_per_week")]
    pub max_certificates_per_caller_per_week: u32,
    /// Orders placed in any hour for all entries of one caller together, whatever became
    /// of them: a CA limits new orders per account (Let's Encrypt: 300 in 3 hours), and a
    /// caller whose orders fail, or that releases entries and asks again under new ids,
    /// would otherwise spend that limit for every caller. Unset: 30.
    #[serde(default = "max_orders_per_caller_per_hour")]
    pub max_orders_per_caller_per_hour: u32,
    /// The handler's state file: the ACME account (its key), and per entry the
    /// certificate issued and the order under way. Required; 0600.
    pub state: PathBuf,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EabConfig {
    /// The key id the CA gave.
    pub key_id: String,
    /// A file holding the base64url HMAC key the CA gave. Never copied anywhere.
    pub hmac_file: PathBuf,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Http01Config {
    /// The web server's document root for `/.well-known/acme-challenge/` (the handler
    /// creates that directory below it). Required.
    pub webroot: PathBuf,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Dns01Config {
    /// The zone challenge records are made in. Required: names outside it use HTTP-01.
    pub zone: String,
    /// The zone's primary: `IP` (port 53) or `IP:PORT`. Required.
    pub primary: String,
    /// The TSIG key updates are signed with. Required.
    pub key: KeyConfig,
    /// TTL of the challenge records. Unset: 60.
    #[serde(default = "txt_ttl")]
    pub ttl: u32,
    /// Seconds to wait for one answer of the primary. Unset: 10.
    #[serde(default = "dns_timeout")]
    pub timeout_seconds: u64,
}

fn max_certificates_per_week() -> u32 {
    5
}
fn max_certificates_per_caller_per_week() -> u32 {
    20
}
fn max_orders_per_caller_per_hour() -> u32 {
    30
}
fn rerun_seconds() -> u64 {
    3
}
fn backoff_seconds() -> u64 {
    60
}
fn order_timeout_seconds() -> u64 {
    3600
}
fn timeout_seconds() -> u64 {
    20
}
fn txt_ttl() -> u32 {
    60
}
fn dns_timeout() -> u64 {
    10
}

/// The config with every value checked, the DNS key and the EAB key read.
pub struct Checked {
    pub config: Config,
    pub dns: Option<(DnsName, Server)>,
    pub eab: Option<(String, Vec<u8>)>,
}

impl Config {
    /// Loads and checks the config and the files it names; contacts nothing.
    pub fn load(path: &Path) -> anyhow::Result<Checked> {
        let config: Config = crate::common::config::load(path)?;
        config.check()
    }

    /// Loads what decides which names a caller may have (allowances, DNS-01 or not),
    /// without reading the files the config names: what the fleet check holds requests
    /// against.
    pub fn load_policy(path: &Path) -> anyhow::Result<Config> {
        let config: Config = crate::common::config::load(path)?;
        config
            .allow
            .validate()
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(config)
    }

    fn check(self) -> anyhow::Result<Checked> {
        if !self.directory.starts_with("https://") || self.directory.len() > 2048 {
            anyhow::bail!("directory: {:?} is not an https:// URL", self.directory);
        }
        if let Some(root) = &self.ca_root {
            std::fs::metadata(root)
                .map_err(|e| anyhow::anyhow!("ca_root: cannot read {}: {e}", root.display()))?;
        }
        self.allow.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
        for (what, v, lo, hi) in [
            ("rerun_seconds", self.rerun_seconds, 1, 3600),
            ("backoff_seconds", self.backoff_seconds, 1, 86_400),
            (
                "order_timeout_seconds",
                self.order_timeout_seconds,
                60,
                7 * 86_400,
            ),
            ("timeout_seconds", self.timeout_seconds, 1, 120),
            (
                "max_certificates_per_week",
                u64::from(self.max_certificates_per_week),
                1,
                10_000,
            ),
            (
                "max_certificates_per_caller_per_week",
                u64::from(self.max_certificates_per_caller_per_week),
                1,
                100_000,
            ),
            (
                "max_orders_per_caller_per_hour",
                u64::from(self.max_orders_per_caller_per_hour),
                1,
                100_000,
            ),
        ] {
            if !(lo..=hi).contains(&v) {
                anyhow::bail!("{what}: {v} is not {lo} to {hi}");
            }
        }
        if self.http01.is_none() && self.dns01.is_none() {
            anyhow::bail!("neither http01 nor dns01 is set: no challenge could be answered");
        }
        let dns = match &self.dns01 {
            None => None,
            Some(d) => {
                let zone =
                    DnsName::parse(&d.zone).map_err(|e| anyhow::anyhow!("dns01.zone: {e}"))?;
                let addr = parse_primary(&d.primary).ok_or_else(|| {
                    anyhow::anyhow!("dns01.primary: {:?} is not IP or IP:PORT", d.primary)
                })?;
                if !(1..=86_400).contains(&d.ttl) || !(1..=120).contains(&d.timeout_seconds) {
                    anyhow::bail!("dns01: ttl must be 1 to 86400 and timeout_seconds 1 to 120");
                }
                let key = TsigKey::load(&d.key.name, d.key.algorithm, &d.key.file)
                    .map_err(|e| anyhow::anyhow!("dns01.key: {e}"))?;
                let server = Server {
                    addr,
                    zone: zone.clone(),
                    key,
                    timeout: Duration::from_secs(d.timeout_seconds),
                };
                Some((zone, server))
            }
        };
        let eab = match &self.eab {
            None => None,
            Some(e) => {
                use base64::Engine;
                let text = crate::common::config::read_secret(&e.hmac_file)?;
                let key = base64::engine::general_purpose::URL_SAFE_NO_PAD
                    .decode(text.trim().trim_end_matches('='))
                    .map_err(|_| {
                        anyhow::anyhow!("eab.hmac_file: {} is not base64url", e.hmac_file.display())
                    })?;
                Some((e.key_id.clone(), key))
            }
        };
        Ok(Checked {
            config: self,
            dns,
            eab,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn checks() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.json");
        let good = json!({"directory": "https://127.0.0.1:14000/dir",
            "http01": {"webroot": dir.path()}, "allow": {"app": ["*.app.example.org"]},
            "state": dir.path().join("s.json")});
        std::fs::write(&path, good.to_string()).unwrap();
        let c = Config::load(&path).unwrap();
        assert_eq!(c.config.rerun_seconds, 3);
        for (edit, says) in [
            (json!({"directory": "http://x/dir"}), "directory"),
            (json!({"http01": null}), "neither http01 nor dns01"),
            (json!({"allow": {"app": ["a.*.b"]}}), "allow.app"),
            (json!({"rerun_seconds": 0}), "rerun_seconds"),
            (json!({"surprise": 1}), "surprise"),
        ] {
            let mut v = good.clone();
            for (k, x) in edit.as_object().unwrap() {
                v[k] = x.clone();
            }
            std::fs::write(&path, v.to_string()).unwrap();
            let e = Config::load(&path).err().expect(says).to_string();
            assert!(e.contains(says), "{e} does not say {says}");
        }
    }
}
