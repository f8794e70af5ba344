//! The SSH CA's config, as the provider's operator declares it (the NixOS module writes
//! it as JSON): the CA key, the principals each caller may have certified, validity.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::common::Allowances;

/// `fort-handler ssh-ca --config FILE`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The CA's private key: an unencrypted OpenSSH ed25519 key that group and others
    /// cannot read (mode 0400). Required.
    pub ca_key_file: PathBuf,
    /// When `ca_key_file` does not exist, make a new ed25519 key there (mode 0400) on the
    /// first run. Unset: false, and a missing key fails every run.
    #[serde(default)]
    pub generate_ca_key: bool,
    /// The handler's own record (serials, what each entry holds, revocations; mode 0600).
    /// Required.
    pub state_file: PathBuf,
    /// The fleet registry: the `"*"` patterns of `host_principals` apply to the hosts it
    /// lists, never to principals (people, CI). Unset: `/etc/fort/hosts.json`.
    #[serde(default = "default_hosts_file")]
    pub hosts_file: PathBuf,
    /// Host principals (names a host certificate may carry) per caller; `"*"` applies to
    /// every host, `{origin}` stands for the caller, `*.SUFFIX` allows every name below
    /// SUFFIX. Unset: nobody gets a host certificate.
    #[serde(default)]
    pub host_principals: Allowances,
    /// User principals (accounts a user certificate logs in as) per caller, as above;
    /// `"*"` applies to every caller. Unset: nobody gets a user certificate.
    #[serde(default)]
    pub user_principals: Allowances,
    /// How long a host certificate is valid. Unset: 30 days.
    #[serde(default = "default_host_validity", with = "humantime_serde")]
    pub host_validity: Duration,
    /// How long a user certificate is valid. Unset: 8 hours.
    #[serde(default = "default_user_validity", with = "humantime_serde")]
    pub user_validity: Duration,
    /// A certificate is issued again when less than this fraction of its validity is
    /// left (on any run; the handler asks to be run again in time). Unset: 0.25.
    #[serde(default = "default_renew_fraction")]
    pub renew_fraction: f64,
    /// Extensions of user certificates. Unset: what `ssh-keygen -s` grants
    /// (`permit-X11-forwarding`, `permit-agent-forwarding`, `permit-port-forwarding`,
    /// `permit-pty`, `permit-user-rc`).
    #[serde(default = "default_user_extensions")]
    pub user_extensions: Vec<String>,
    /// Host patterns of the `@cert-authority` line in responses: which host names
    /// clients trust this CA for. Unset: `["*"]`.
    #[serde(default = "default_known_hosts_patterns")]
    pub known_hosts_patterns: Vec<String>,
    /// The first serial number. Certificates signed with this CA by hand should use
    /// serials below it (or the default 0, which no KRL revokes), so a revocation never
    /// touches them. Unset: 1.
    #[serde(default = "default_first_serial")]
    pub first_serial: u64,
    /// Certificates are valid from this long before they are signed, for hosts whose
    /// clocks are behind. Unset: 5 minutes.
    #[serde(default = "default_backdate", with = "humantime_serde")]
    pub backdate: Duration,
    /// Certificates for new or changed requests (a new entry, another key, validity or
    /// principals) per caller in any hour; past it the entry keeps what it has and waits.
    /// Each such certificate revokes the one it replaces, or is revoked when its entry is
    /// released, and the KRL is in every consumer's payload: without a bound one caller
    /// could change every other consumer's payload on every run. Unset: 10.
    #[serde(default = "default_max_new_per_caller")]
    pub max_new_certificates_per_caller_per_hour: u32,
}

fn default_hosts_file() -> PathBuf {
    PathBuf::from("/etc/fort/hosts.json")
}
fn default_host_validity() -> Duration {
    Duration::from_secs(30 * 86400)
}
fn default_user_validity() -> Duration {
    Duration::from_secs(8 * 3600)
}
fn default_renew_fraction() -> f64 {
    0.25
}
fn default_user_extensions() -> Vec<String> {
    [
        "permit-X11-forwarding",
        "permit-agent-forwarding",
        "permit-port-forwarding",
        "permit-pty",
        "permit-user-rc",
    ]
    .map(String::from)
    .to_vec()
}
fn default_known_hosts_patterns() -> Vec<String> {
    vec!["*".into()]
}
fn default_first_serial() -> u64 {
    1
}
fn default_backdate() -> Duration {
    Duration::from_secs(300)
}
fn default_max_new_per_caller() -> u32 {
    10
}

/// Longest validity the config may give: ten years (OpenSSH's time fields are 64-bit,
/// but nobody wants a certificate that outlives its CA's operator).
const MAX_VALIDITY: Duration = Duration::from_secs(10 * 366 * 86400);

impl Config {
    pub fn load(path: &Path) -> anyhow::Result<Config> {
        let config: Config = crate::common::config::load(path)?;
        config
            .validate()
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), String> {
        for (name, allow) in [
            ("host_principals", &self.host_principals),
            ("user_principals", &self.user_principals),
        ] {
            allow.validate().map_err(|e| format!("{name}: {e}"))?;
        }
        for (name, v) in [
            ("host_validity", self.host_validity),
            ("user_validity", self.user_validity),
        ] {
            if v < Duration::from_secs(60) || v > MAX_VALIDITY {
                return Err(format!("{name} must be between 1 minute and 10 years"));
            }
        }
        if self.backdate > Duration::from_secs(86400) {
            return Err("backdate must be at most a day".into());
        }
        if !(self.renew_fraction > 0.0 && self.renew_fraction < 1.0) {
            return Err("renew_fraction must be between 0 and 1 (exclusive)".into());
        }
        for e in &self.user_extensions {
            if e.is_empty() || e.len() > 64 || !e.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(format!("user_extensions: {e:?} is not an extension name"));
            }
        }
        if self.known_hosts_patterns.is_empty() {
            return Err("known_hosts_patterns must name at least one pattern".into());
        }
        for p in &self.known_hosts_patterns {
            let ok = !p.is_empty()
                && p.len() <= 255
                && p.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"*?!.-_[]:".contains(&b));
            if !ok {
                return Err(format!("known_hosts_patterns: {p:?} is not a host pattern"));
            }
        }
        if !(1..=100_000).contains(&self.max_new_certificates_per_caller_per_hour) {
            return Err("max_new_certificates_per_caller_per_hour must be 1 to 100000".into());
        }
        if self.first_serial == 0 {
            return Err("first_serial must be at least 1 (serial 0 cannot be revoked)".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<Config, String> {
        let c: Config = serde_json::from_str(json).map_err(|e| e.to_string())?;
        c.validate()?;
        Ok(c)
    }

    #[test]
    fn defaults_and_mistakes() {
        let c = parse(r#"{"ca_key_file": "/k", "state_file": "/s"}"#).unwrap();
        assert_eq!(c.user_validity, Duration::from_secs(8 * 3600));
        assert_eq!(c.known_hosts_patterns, ["*"]);
        assert_eq!(c.max_new_certificates_per_caller_per_hour, 10);
        assert!(c.user_principals.0.is_empty());
        for bad in [
            r#"{"ca_key_file": "/k", "state_file": "/s", "colour": 1}"#,
            r#"{"ca_key_file": "/k"}"#,
            r#"{"ca_key_file": "/k", "state_file": "/s", "user_validity": "1s"}"#,
            r#"{"ca_key_file": "/k", "state_file": "/s", "renew_fraction": 1.5}"#,
            r#"{"ca_key_file": "/k", "state_file": "/s", "first_serial": 0}"#,
            r#"{"ca_key_file": "/k", "state_file": "/s", "max_new_certificates_per_caller_per_hour": 0}"#,
            r#"{"ca_key_file": "/k", "state_file": "/s", "known_hosts_patterns": ["a b"]}"#,
            r#"{"ca_key_file": "/k", "state_file": "/s", "user_principals": {"app": ["a*b"]}}"#,
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }
}
