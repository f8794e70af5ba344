//! The `proxy` provider's config (JSON, written by the NixOS module from
//! `fort.host.capabilities.<name>.proxy`): the directory nginx includes, how nginx is
//! tested and reloaded, where vhosts listen, the TLS certificate sets by name, and which
//! server names (and which other upstream hosts) each caller may have.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::common::Allowances;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The directory the provider's nginx.conf includes (`include DIR/*.conf;` inside
    /// `http`). Required. The handler writes `fort.*.conf` files there and never touches
    /// files it did not write.
    pub include_dir: PathBuf,
    /// Where the handler records the files it wrote (JSON, mode 0600). Required; one per
    /// include directory.
    pub state_file: PathBuf,
    /// The fleet's hosts.json, where a caller's own address (its vhosts' upstream host)
    /// comes from. Unset: `/etc/fort/hosts.json`.
    #[serde(default = "hosts_path")]
    pub hosts: PathBuf,
    /// The command that checks the whole configuration, as an argument vector (no shell).
    /// It must exit 0 only for a configuration nginx would load. Unset: `nginx -t -q`.
    #[serde(default = "test_command")]
    pub test_command: Vec<String>,
    /// The command that makes nginx load the configuration, as an argument vector.
    /// Unset: `nginx -s reload`.
    #[serde(default = "reload_command")]
    pub reload_command: Vec<String>,
    /// Seconds one run of either command may take before it is killed. Unset: 20.
    #[serde(default = "command_timeout")]
    pub command_timeout_seconds: u64,
    /// Where plain-HTTP vhosts listen: `PORT`, `IPv4:PORT` or `[IPv6]:PORT`, each one
    /// `listen` line. Unset: `80` and `[::]:80`.
    #[serde(default = "listen_http")]
    pub listen: Vec<String>,
    /// Where TLS vhosts listen (each `listen … ssl`); their plain-HTTP side on `listen`
    /// redirects to HTTPS. Unset: `443` and `[::]:443`.
    #[serde(default = "listen_https")]
    pub listen_tls: Vec<String>,
    /// Certificate sets a request may name in `tls`: name → the certificate chain and
    /// key files nginx reads (the handler only writes their paths). Unset: none, a request
    /// with `tls` is refused.
    #[serde(default)]
    pub tls: BTreeMap<String, TlsSet>,
    /// Server names each caller may claim: caller → patterns (`wiki.example.org`,
    /// `*.app.example.org`, `{origin}.example.org`), `"*"` for every caller. Unset or
    /// empty: every request is refused.
    #[serde(default)]
    pub allow: Allowances,
    /// Hosts other than its own that a caller may name as `upstream_host`: caller →
    /// patterns (`10.0.0.9`, `*.lan`). Unset: every vhost forwards to its caller's own
    /// address from hosts.json.
    #[serde(default)]
    pub upstream_hosts: Allowances,
    /// nginx's `server_names_hash_bucket_size` as the provider's nginx.conf sets it. A
    /// server name longer than one bucket holds is refused: nginx accepts such a name
    /// while its vhost is the only one on its address, and then refuses every other vhost
    /// added there. Unset: 64, nginx's default on 64-bit machines.
    #[serde(default = "bucket_size")]
    pub server_names_hash_bucket_size: u32,
    /// The HTTP-01 webroot of an `acme` capability on this host: every vhost serves
    /// `/.well-known/acme-challenge/` from it (a path with no file there goes to the
    /// upstream, or to HTTPS), so the CA validates names this nginx proxies. Unset: none.
    #[serde(default)]
    pub acme_webroot: Option<PathBuf>,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TlsSet {
    /// The PEM certificate chain (`ssl_certificate`).
    pub certificate: PathBuf,
    /// The PEM private key (`ssl_certificate_key`); read by nginx, never by the handler.
    pub key: PathBuf,
}

fn hosts_path() -> PathBuf {
    PathBuf::from("/etc/fort/hosts.json")
}
fn test_command() -> Vec<String> {
    ["nginx", "-t", "-q"].map(String::from).to_vec()
}
fn reload_command() -> Vec<String> {
    ["nginx", "-s", "reload"].map(String::from).to_vec()
}
fn command_timeout() -> u64 {
    20
}
fn bucket_size() -> u32 {
    64
}
fn listen_http() -> Vec<String> {
    ["80", "[::]:80"].map(String::from).to_vec()
}
fn listen_https() -> Vec<String> {
    ["443", "[::]:443"].map(String::from).to_vec()
}

/// Longest TLS set name; it is only looked up, never written.
const TLS_NAME_MAX: usize = 64;

impl Config {
    /// Loads and checks the config; contacts nothing and reads no certificate.
    pub fn load(path: &Path) -> anyhow::Result<Config> {
        let config: Config = crate::common::config::load(path)?;
        config
            .validate()
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), String> {
        if !self.include_dir.is_absolute() || !is_config_path(&self.include_dir) {
            return Err(format!(
                "include_dir: {:?} must be an absolute path of letters, digits and ._+@/-",
                self.include_dir
            ));
        }
        for (field, argv) in [
            ("test_command", &self.test_command),
            ("reload_command", &self.reload_command),
        ] {
            if argv.is_empty() || argv[0].is_empty() || argv.len() > 64 {
                return Err(format!("{field}: a program and its arguments, at most 64"));
            }
        }
        if !(1..=55).contains(&self.command_timeout_seconds) {
            return Err("command_timeout_seconds: 1 to 55".into());
        }
        for (field, list) in [("listen", &self.listen), ("listen_tls", &self.listen_tls)] {
            if list.is_empty() || list.len() > 16 {
                return Err(format!("{field}: 1 to 16 addresses"));
            }
            if let Some(bad) = list.iter().find(|l| !is_listen(l)) {
                return Err(format!(
                    "{field}: {bad:?} is not PORT, IPv4:PORT or [IPv6]:PORT"
                ));
            }
        }
        for (name, set) in &self.tls {
            if !is_tls_name(name) {
                return Err(format!(
                    "tls: {name:?} is not a set name (1 to {TLS_NAME_MAX} of A-Z a-z 0-9 . _ -)"
                ));
            }
            for (what, path) in [("certificate", &set.certificate), ("key", &set.key)] {
                if !path.is_absolute() || !is_config_path(path) {
                    return Err(format!(
                        "tls.{name}.{what}: {path:?} must be an absolute path of letters, digits and ._+@/-"
                    ));
                }
            }
        }
        if let Some(root) = &self.acme_webroot {
            if !root.is_absolute() || !is_config_path(root) {
                return Err(format!(
                    "acme_webroot: {root:?} must be an absolute path of letters, digits and ._+@/-"
                ));
            }
        }
        if !(32..=4096).contains(&self.server_names_hash_bucket_size) {
            return Err("server_names_hash_bucket_size: 32 to 4096".into());
        }
        self.allow.validate().map_err(|e| e.to_string())?;
        self.upstream_hosts
            .validate()
            .map_err(|e| format!("upstream_hosts: {e}"))?;
        Ok(())
    }
}

impl Config {
    /// The longest server name nginx can hash with `server_names_hash_bucket_size`, on a
    /// 64-bit machine: nginx rounds the bucket up to its cache line (64 bytes here), and
    /// each name takes a pointer, its length and two bytes, rounded up to a pointer, with
    /// a pointer left over for the bucket's end (`ngx_hash_init`).
    pub fn longest_server_name(&self) -> usize {
        const POINTER: usize = 8;
        const CACHE_LINE: usize = 64;
        let bucket = (self.server_names_hash_bucket_size as usize).next_multiple_of(CACHE_LINE);
        (bucket - POINTER) / POINTER * POINTER - POINTER - 2
    }
}

/// A TLS set's name as a request gives it.
pub fn is_tls_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= TLS_NAME_MAX
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// A path nginx reads without quoting: no spaces, quotes, `;`, braces, `$` or `#`.
fn is_config_path(path: &Path) -> bool {
    let Some(text) = path.to_str() else {
        return false;
    };
    !text.is_empty()
        && text.len() <= 1024
        && text.bytes().all(|b| {
            b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'+' | b'@' | b'/' | b'-')
        })
}

/// `PORT`, `IPv4:PORT` or `[IPv6]:PORT`, with a port 1 to 65535.
fn is_listen(text: &str) -> bool {
    let port_ok = |p: &str| {
        !p.is_empty()
            && p.len() <= 5
            && p.bytes().all(|b| b.is_ascii_digit())
            && p.parse::<u16>().is_ok_and(|n| n > 0)
    };
    if port_ok(text) {
        return true;
    }
    if let Some(rest) = text.strip_prefix('[') {
        return rest
            .split_once("]:")
            .is_some_and(|(ip, port)| ip.parse::<std::net::Ipv6Addr>().is_ok() && port_ok(port));
    }
    text.split_once(':')
        .is_some_and(|(ip, port)| ip.parse::<std::net::Ipv4Addr>().is_ok() && port_ok(port))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: serde_json::Value) -> Result<Config, String> {
        let c: Config = serde_json::from_value(v).map_err(|e| e.to_string())?;
        c.validate().map(|()| c)
    }

    #[test]
    fn defaults_and_mistakes() {
        let good = json!({"include_dir": "/etc/nginx/fort", "state_file": "/var/lib/x.json",
                          "tls": {"example-org": {"certificate": "/etc/ssl/a.pem", "key": "/etc/ssl/a.key"}}});
        let c = parse(good.clone()).unwrap();
        assert_eq!(c.test_command, ["nginx", "-t", "-q"]);
        assert_eq!(c.listen, ["80", "[::]:80"]);
        let bad = |edit: &dyn Fn(&mut serde_json::Value)| {
            let mut v = good.clone();
            edit(&mut v);
            assert!(parse(v.clone()).is_err(), "{v}");
        };
        bad(&|v| v["include_dir"] = json!("nginx/fort"));
        bad(&|v| v["include_dir"] = json!("/etc/nginx/fort dir"));
        bad(&|v| v["test_command"] = json!([]));
        bad(&|v| v["listen"] = json!(["80 default_server"]));
        bad(&|v| v["listen"] = json!(["0"]));
        bad(&|v| v["listen_tls"] = json!(["[::1:443"]));
        bad(&|v| v["tls"]["x;y"] = json!({"certificate": "/a", "key": "/b"}));
        bad(&|v| v["tls"]["x"] = json!({"certificate": "/a;b", "key": "/b"}));
        bad(&|v| v["tls"]["x"] = json!({"certificate": "/a", "key": "b"}));
        bad(&|v| v["allow"] = json!({"app": ["*"]}));
        bad(&|v| v["colour"] = json!(1));
        bad(&|v| v["server_names_hash_bucket_size"] = json!(16));
        // What nginx's own check accepts (ngx_hash_init): 46 with the default bucket, 110
        // with 128, 238 with 256.
        for (bucket, longest) in [(64, 46), (32, 46), (128, 110), (100, 110), (256, 238)] {
            let mut v = good.clone();
            v["server_names_hash_bucket_size"] = json!(bucket);
            assert_eq!(parse(v).unwrap().longest_server_name(), longest, "{bucket}");
        }
        for ok in ["8080", "127.0.0.1:80", "[::]:443", "[fd00::1]:8443"] {
            assert!(is_listen(ok), "{ok}");
        }
        for no in [
            "",
            "80;",
            "localhost:80",
            "1.2.3.4:",
            "[::1]",
            "99999",
            "1.2.3.4:0",
        ] {
            assert!(!is_listen(no), "{no}");
        }
    }
}
