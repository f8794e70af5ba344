//! The provider operator's config of the backup-repo capability (JSON, written by the
//! NixOS module from `fort.host.capabilities.<name>.backupRepo`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use super::size::Size;
use crate::common::Allowances;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Where the handler records the repositories it made and the key each may be
    /// reached with (JSON, mode 0600). Required.
    pub state_file: PathBuf,
    /// The directory repositories are made in, one per entry at
    /// `<dir>/<origin>/<need id>`. Required.
    pub repositories_dir: PathBuf,
    /// The `authorized_keys` file the handler writes, whole: one restricted line per
    /// entry and nothing else (sshd reads it besides the account's own, through
    /// `AuthorizedKeysFile`). Required.
    pub authorized_keys_file: PathBuf,
    /// The account consumers log in as (the user of the repository URL), which runs
    /// `borg serve`; repositories are made its own when the handler runs as root.
    /// Unset: `borg`.
    #[serde(default = "default_user")]
    pub user: String,
    /// The host name or address consumers reach sshd at, as every URL and known_hosts
    /// line names it. Required.
    pub host: String,
    /// sshd's port. Unset: 22.
    #[serde(default = "default_port")]
    pub port: u16,
    /// Public host key files of that sshd (`ssh_host_*_key.pub`), for the consumers'
    /// known_hosts. Unset: `/etc/ssh/ssh_host_ed25519_key.pub`.
    #[serde(default = "default_host_keys")]
    pub host_key_files: Vec<PathBuf>,
    /// The borg program the restricted key runs (`<borg> serve …`). Unset: `borg`.
    #[serde(default = "default_borg")]
    pub borg: String,
    /// A repository's storage quota when its request names none. Unset: 100G.
    #[serde(default = "default_quota")]
    pub quota: Size,
    /// The largest quota a request may ask for one repository. Unset: `quota`.
    #[serde(default)]
    pub max_quota: Option<Size>,
    /// The quotas of one caller's repositories together, released ones still kept
    /// included (their data is on this disk): past it a new repository is refused.
    /// Unset: ten times `quota`.
    #[serde(default)]
    pub quota_per_caller: Option<Size>,
    /// Need ids whose repositories a caller may have with full access (`append_only:
    /// false`: delete, prune, compact), per caller and `"*"`; `{origin}` is the caller.
    /// Unset: every repository is append-only.
    #[serde(default)]
    pub full_access: Allowances,
    /// How long a released repository's data is kept (it can no longer be reached)
    /// before it is removed; asked for again within it, the entry gets it back. Unset:
    /// 30 days.
    #[serde(default = "default_retention", with = "humantime_serde")]
    pub retention: Duration,
    /// How long a key is authorized before its consumer is asked to rotate it (the
    /// response's `expires_at`; the key keeps working until it is replaced). Unset: 90
    /// days.
    #[serde(default = "default_key_lifetime", with = "humantime_serde")]
    pub key_lifetime: Duration,
}

fn default_user() -> String {
    "borg".into()
}
fn default_port() -> u16 {
    22
}
fn default_host_keys() -> Vec<PathBuf> {
    vec![PathBuf::from("/etc/ssh/ssh_host_ed25519_key.pub")]
}
fn default_borg() -> String {
    "borg".into()
}
fn default_quota() -> Size {
    Size(100_000_000_000)
}
fn default_retention() -> Duration {
    Duration::from_secs(30 * 86400)
}
fn default_key_lifetime() -> Duration {
    Duration::from_secs(90 * 86400)
}

/// What a path in a forced command may hold: sshd's `command="…"` has no escape for
/// `"`, and borg's arguments are split at spaces.
pub fn is_plain_path(p: &str) -> bool {
    !p.is_empty()
        && p.len() <= 512
        && p.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"/._+-".contains(&b))
}

impl Config {
    pub fn load(path: &Path) -> anyhow::Result<Config> {
        let config: Config = crate::common::config::load(path)?;
        config
            .validate()
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        Ok(config)
    }

    pub fn max_quota(&self) -> u64 {
        self.max_quota.map_or(self.quota.0, |s| s.0)
    }

    pub fn quota_per_caller(&self) -> u64 {
        self.quota_per_caller
            .map_or(self.quota.0.saturating_mul(10), |s| s.0)
    }

    /// `ssh://user@host:port`: what every repository URL starts with.
    pub fn url_prefix(&self) -> String {
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        format!("ssh://{}@{host}:{}", self.user, self.port)
    }

    fn validate(&self) -> Result<(), String> {
        for (name, p) in [
            ("state_file", &self.state_file),
            ("repositories_dir", &self.repositories_dir),
            ("authorized_keys_file", &self.authorized_keys_file),
        ] {
            if !p.is_absolute() {
                return Err(format!("{name} must be an absolute path"));
            }
        }
        let dir = self.repositories_dir.to_str().unwrap_or("");
        if !is_plain_path(dir) || dir.split('/').any(|c| c == "..") {
            return Err(
                "repositories_dir: a plain absolute path (letters, digits, / . _ + -)".into(),
            );
        }
        if !is_plain_path(&self.borg) || self.borg.starts_with('-') {
            return Err("borg: a program name or path (letters, digits, / . _ + -)".into());
        }
        if !fort_core::names::is_principal_name(&self.user) {
            return Err(format!("user: {:?} is not an account name", self.user));
        }
        let host_ok = !self.host.is_empty()
            && self.host.len() <= 253
            && self
                .host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b".-:".contains(&b))
            && !self.host.starts_with(['-', '.']);
        if !host_ok {
            return Err(format!(
                "host: {:?} is not a host name or address",
                self.host
            ));
        }
        if self.port == 0 {
            return Err("port: 1 to 65535".into());
        }
        if self.host_key_files.is_empty() {
            return Err("host_key_files: name at least one public host key file".into());
        }
        let min = Size::MIN_QUOTA;
        for (name, s) in [
            ("quota", Some(self.quota)),
            ("max_quota", self.max_quota),
            ("quota_per_caller", self.quota_per_caller),
        ] {
            if s.is_some_and(|s| s.0 < min) {
                return Err(format!(
                    "{name}: at least {} (borg's least quota)",
                    Size(min)
                ));
            }
        }
        if self.quota.0 > self.max_quota() {
            return Err("quota is above max_quota".into());
        }
        if self.max_quota() > self.quota_per_caller() {
            return Err("max_quota is above quota_per_caller".into());
        }
        self.full_access
            .validate()
            .map_err(|e| format!("full_access: {e}"))?;
        if self.key_lifetime < Duration::from_secs(10) {
            return Err("key_lifetime: at least 10 seconds".into());
        }
        const TEN_YEARS: Duration = Duration::from_secs(10 * 366 * 86400);
        if self.retention > TEN_YEARS || self.key_lifetime > TEN_YEARS {
            return Err("retention and key_lifetime: at most ten years".into());
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

    const BASE: &str = r#""state_file": "/s", "repositories_dir": "/srv/borg", "authorized_keys_file": "/etc/ssh/fort-borg", "host": "backup.example.org""#;

    #[test]
    fn defaults_and_mistakes() {
        let c = parse(&format!("{{{BASE}}}")).unwrap();
        assert_eq!(c.quota_per_caller(), 1_000_000_000_000);
        assert_eq!(c.max_quota(), 100_000_000_000);
        assert_eq!(c.url_prefix(), "ssh://borg@backup.example.org:22");
        let six = serde_json::json!({"state_file": "/s", "repositories_dir": "/srv/borg",
            "authorized_keys_file": "/k", "host": "fd00::1", "port": 2222});
        assert_eq!(
            parse(&six.to_string()).unwrap().url_prefix(),
            "ssh://borg@[fd00::1]:2222"
        );
        for bad in [
            r#""colour": 1"#,
            r#""borg": "borg\" --evil""#,
            r#""borg": "-x""#,
            r#""quota": "1M""#,
            r#""quota": "200G", "max_quota": "100G""#,
            r#""max_quota": "2T", "quota_per_caller": "1T""#,
            r#""user": "Borg Backup""#,
            r#""key_lifetime": "1s""#,
            r#""full_access": {"app": ["a b"]}"#,
            r#""host_key_files": []"#,
        ] {
            assert!(parse(&format!("{{{BASE}, {bad}}}")).is_err(), "{bad}");
        }
        for bad_dir in ["/srv/borg dir", "srv/borg", "/srv/../etc", "/srv/\"x"] {
            let json = serde_json::json!({"state_file": "/s", "repositories_dir": bad_dir,
                "authorized_keys_file": "/k", "host": "h"});
            assert!(parse(&json.to_string()).is_err(), "{bad_dir}");
        }
    }
}
