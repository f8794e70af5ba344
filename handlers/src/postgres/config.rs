//! The provider operator's config of the postgres capability (JSON, written by the NixOS
//! module from `fort.host.capabilities.<name>.postgres`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use super::names;
use crate::common::Allowances;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Where the handler records the roles it made and their passwords (JSON, mode 0600).
    /// Required: without it nothing could tell its roles from hand-made ones.
    pub state_file: PathBuf,
    /// The host name or address consumers connect to, as it appears in every response.
    /// Required.
    pub host: String,
    /// The directory of the server's Unix socket, where the handler connects as the admin
    /// role. Unset: `/run/postgresql`.
    #[serde(default = "default_socket_dir")]
    pub socket_dir: PathBuf,
    /// The server's port (also names its socket file, `.s.PGSQL.<port>`). Unset: 5432.
    #[serde(default = "default_port")]
    pub port: u16,
    /// The port in responses, when consumers reach the server through another one (a
    /// pooler, a forwarded port). Unset: `port`.
    #[serde(default)]
    pub public_port: Option<u16>,
    /// The role the handler connects as: it needs `CREATEROLE` and `CREATEDB` (or is a
    /// superuser). Unset: `postgres`.
    #[serde(default = "default_admin_role")]
    pub admin_role: String,
    /// A file holding the admin role's password, for servers that ask for one on the
    /// socket. Unset: no password (peer or trust authentication on the socket).
    #[serde(default)]
    pub admin_password_file: Option<PathBuf>,
    /// The database the admin connection opens. Unset: `postgres`.
    #[serde(default = "default_admin_database")]
    pub admin_database: String,
    /// The first part of every derived role and database name
    /// (`<prefix>_<origin>_<need id>`); two capabilities on one server need two prefixes.
    /// Unset: `fort`.
    #[serde(default = "default_prefix")]
    pub name_prefix: String,
    /// What a released entry's role and database become: `disable` (the role loses
    /// `LOGIN` and its password, its sessions end, the data stays) or `drop` (database
    /// and role are dropped). Unset: `disable`.
    #[serde(default)]
    pub on_release: OnRelease,
    /// The most `CONNECTION LIMIT` of any one role. Unset: none beyond the caller's share.
    #[serde(default)]
    pub connection_limit: Option<u32>,
    /// Connections each caller's roles may hold together: split between them (each gets
    /// at least one), and kept so as roles come and go. Unset: 20. Connections are the
    /// server's, shared by every caller: a caller with many databases, each with its own
    /// limit, could take all of them, and every other caller's (and this handler's,
    /// unless its role is a superuser) with them.
    #[serde(default = "default_connections_per_caller")]
    pub connections_per_caller: u32,
    /// Names a caller may ask for by itself (`"name"` in the request) instead of the
    /// derived one, per caller and `"*"`; `{origin}` is the caller. Unset: none, every
    /// entry gets its derived name.
    #[serde(default)]
    pub allow: Allowances,
    /// How long one run may spend on server work (`"40s"`, `"500ms"`); entries left
    /// over are answered `$fort_pending` and the handler asks to run again in a second.
    /// Unset: 40 s (the agent kills a handler after 60).
    #[serde(default = "default_budget", with = "humantime_serde")]
    pub run_budget: Duration,
    /// The other providers (fort host names) whose handlers make roles on this same
    /// server for needs that may move between them (docs/protocol.md §11.13): a role
    /// one of them made for an entry is taken over when that entry comes here, and
    /// never another entry's. Unset: none, the server is this provider's alone.
    #[serde(default)]
    pub peers: Vec<String>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnRelease {
    #[default]
    Disable,
    Drop,
}

/// Connections one caller's roles may hold together when the config does not say.
const DEFAULT_CONNECTIONS_PER_CALLER: u32 = 20;

fn default_connections_per_caller() -> u32 {
    DEFAULT_CONNECTIONS_PER_CALLER
}

fn default_socket_dir() -> PathBuf {
    PathBuf::from("/run/postgresql")
}
fn default_port() -> u16 {
    5432
}
fn default_admin_role() -> String {
    "postgres".into()
}
fn default_admin_database() -> String {
    "postgres".into()
}
fn default_prefix() -> String {
    "fort".into()
}
fn default_budget() -> Duration {
    Duration::from_secs(40)
}

/// The most peers one provider may list (as a need may name at most 8 providers).
const MAX_PEERS: usize = 7;

/// Largest `CONNECTION LIMIT` accepted (the server takes any int; more is a typo).
const MAX_CONNECTION_LIMIT: u32 = 100_000;

impl Config {
    /// Loads and validates `path`; reads the admin password file when one is named.
    /// Loads and validates the config without reading the files it names (secrets,
    /// roots): what decides which requests a caller may make.
    pub fn load_policy(path: &Path) -> anyhow::Result<Config> {
        let config: Config = crate::common::config::load(path)?;
        config
            .validate()
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        Ok(config)
    }

    pub fn load(path: &Path) -> anyhow::Result<Config> {
        let config = Config::load_policy(path)?;
        if let Some(file) = &config.admin_password_file {
            crate::common::config::read_secret(file)?;
        }
        Ok(config)
    }

    fn validate(&self) -> Result<(), String> {
        if !is_host(&self.host) {
            return Err(format!(
                "host: {:?} is neither a DNS name nor an IP address",
                self.host
            ));
        }
        if !self.socket_dir.is_absolute() {
            return Err("socket_dir: must be an absolute path".into());
        }
        if self.port == 0 || self.public_port == Some(0) {
            return Err("port and public_port: 1 to 65535".into());
        }
        if !names::is_role_name(&self.admin_role) {
            return Err("admin_role: 1 to 63 bytes".into());
        }
        if !names::is_role_name(&self.admin_database) {
            return Err("admin_database: 1 to 63 bytes".into());
        }
        if !names::is_prefix(&self.name_prefix) {
            return Err(format!(
                "name_prefix: {:?} must be a lower-case letter and up to 15 letters or digits",
                self.name_prefix
            ));
        }
        if self
            .connection_limit
            .is_some_and(|n| n == 0 || n > MAX_CONNECTION_LIMIT)
        {
            return Err(format!(
                "connection_limit: 1 to {MAX_CONNECTION_LIMIT}, or leave it out"
            ));
        }
        if !(1..=MAX_CONNECTION_LIMIT).contains(&self.connections_per_caller) {
            return Err(format!(
                "connections_per_caller: 1 to {MAX_CONNECTION_LIMIT}"
            ));
        }
        if self.run_budget.is_zero() || self.run_budget > Duration::from_secs(3600) {
            return Err("run_budget: more than 0 s, at most an hour".into());
        }
        self.allow.validate()?;
        if self.peers.len() > MAX_PEERS {
            return Err(format!("peers: at most {MAX_PEERS}"));
        }
        for (i, peer) in self.peers.iter().enumerate() {
            if !fort_core::names::is_host_name(peer) {
                return Err(format!("peers: {peer:?} is not a fort host name"));
            }
            if self.peers[..i].contains(peer) {
                return Err(format!("peers: {peer} is named twice"));
            }
        }
        if !self.peers.is_empty() && self.on_release == OnRelease::Drop {
            // A need that moved to a peer is released here, possibly before the peer
            // took its database over: dropping it would lose the data the peer is
            // about to serve.
            return Err(
                "on_release: drop cannot go with peers (a need that moved to a peer is released here, maybe before the peer took its database over); use disable"
                    .into(),
            );
        }
        Ok(())
    }

    /// The port in responses.
    pub fn public_port(&self) -> u16 {
        self.public_port.unwrap_or(self.port)
    }

    /// The `CONNECTION LIMIT` of each of one caller's `roles` roles, in the order of
    /// their names: the caller's share split between them (the first ones get what does
    /// not divide evenly), at least one each, at most `connection_limit`.
    pub fn connection_limits(&self, roles: usize) -> Vec<i32> {
        let share = self.connections_per_caller as usize;
        let cap = self.connection_limit.unwrap_or(u32::MAX) as usize;
        let (each, rest) = (share / roles.max(1), share % roles.max(1));
        (0..roles)
            .map(|i| {
                let n = (each + usize::from(i < rest)).clamp(1, cap);
                i32::try_from(n).unwrap_or(i32::MAX)
            })
            .collect()
    }
}

/// A DNS name (letters, digits, `-`, `.`) or an IP address.
fn is_host(s: &str) -> bool {
    if s.parse::<std::net::IpAddr>().is_ok() {
        return true;
    }
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && label
                    .bytes()
                    .all(|c| c.is_ascii_alphanumeric() || c == b'-')
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<Config, String> {
        let c: Config = serde_json::from_str(json).map_err(|e| e.to_string())?;
        c.validate().map(|()| c)
    }

    #[test]
    fn defaults_and_mistakes() {
        let c = parse(r#"{"state_file": "/var/lib/x.json", "host": "db.lan"}"#).unwrap();
        assert_eq!(c.port, 5432);
        assert_eq!(c.public_port(), 5432);
        assert_eq!(c.admin_role, "postgres");
        assert_eq!(c.on_release, OnRelease::Disable);
        assert_eq!(c.connection_limits(1), [20]);
        assert_eq!(c.connection_limits(3), [7, 7, 6]);
        assert_eq!(c.connection_limits(25), [1; 25]);
        assert!(c.connection_limits(0).is_empty());
        let capped =
            parse(r#"{"state_file": "/x", "host": "db.lan", "connection_limit": 5}"#).unwrap();
        assert_eq!(capped.connection_limits(2), [5, 5]);
        assert_eq!(capped.connection_limits(8), [3, 3, 3, 3, 2, 2, 2, 2]);
        for bad in [
            r#"{"state_file": "/x", "host": "db lan"}"#,
            r#"{"state_file": "/x", "host": "db.lan", "name_prefix": "a_b"}"#,
            r#"{"state_file": "/x", "host": "db.lan", "connection_limit": 0}"#,
            r#"{"state_file": "/x", "host": "db.lan", "connections_per_caller": 0}"#,
            r#"{"state_file": "/x", "host": "db.lan", "socket_dir": "run"}"#,
            r#"{"state_file": "/x", "host": "db.lan", "on_release": "delete"}"#,
            r#"{"state_file": "/x", "host": "db.lan", "colour": 1}"#,
            r#"{"state_file": "/x", "host": "db.lan", "allow": {"app": ["*"]}}"#,
            r#"{"state_file": "/x", "host": "db.lan", "peers": ["db_2"]}"#,
            r#"{"state_file": "/x", "host": "db.lan", "peers": ["db2", "db2"]}"#,
            r#"{"state_file": "/x", "host": "db.lan", "peers": ["db2"], "on_release": "drop"}"#,
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
        assert!(parse(r#"{"state_file": "/x", "host": "fd00::1"}"#).is_ok());
        let shared = parse(r#"{"state_file": "/x", "host": "db.lan", "peers": ["db2"]}"#).unwrap();
        assert_eq!(shared.peers, ["db2"]);
    }
}
