//! What a consumer asks of `proxy` (the same shape as the NixOS interface
//! `nixos-module/interfaces/proxy.nix`), and the vhost it resolves to for one caller:
//! every server name a DNS name the provider allows the caller, the upstream its own
//! address unless the provider lets it name another host, the TLS set one the provider
//! declared. Nothing a request carries reaches the nginx config unchecked.

use std::net::IpAddr;

use serde::Deserialize;
use serde_json::Value;

use super::config::{is_tls_name, Config};
use crate::common::Allowances;
use crate::dns::DnsName;

/// Server names one vhost may answer to.
pub const SERVER_NAMES_MAX: usize = 16;
/// Longest upstream path.
const PATH_MAX: usize = 256;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Request {
    /// The names the vhost answers to (its `Host` header).
    pub server_names: Vec<String>,
    /// The upstream's port on the upstream host.
    pub port: u16,
    /// The path requests are forwarded under (`/wiki/`); null: as they came.
    #[serde(default)]
    pub path: Option<String>,
    /// The upstream's scheme; only `http`. Null: `http`.
    #[serde(default)]
    pub scheme: Option<String>,
    /// Another upstream host than the caller's own address, if the provider allows it.
    #[serde(default)]
    pub upstream_host: Option<String>,
    /// The provider's TLS certificate set to serve HTTPS with; null: plain HTTP.
    #[serde(default)]
    pub tls: Option<String>,
    /// A sign-in in front of the upstream, which this handler does not do: a request
    /// with one is refused rather than served without it.
    #[serde(default)]
    pub sign_in_client: Option<Value>,
}

/// A checked vhost: every value safe to write into nginx config as it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Vhost {
    /// Lower-case DNS names, each once, in request order.
    pub server_names: Vec<String>,
    /// `10.0.0.3`, `[fd00::3]` or `app.lan`.
    pub upstream_host: String,
    pub port: u16,
    /// `/`-started and ending in `/`, or `None`.
    pub path: Option<String>,
    /// The TLS set's name (its files come from the config).
    pub tls: Option<String>,
}

impl Vhost {
    /// `http://host:port[/path/]`: what nginx forwards to.
    pub fn upstream(&self) -> String {
        format!(
            "http://{}:{}{}",
            self.upstream_host,
            self.port,
            self.path.as_deref().unwrap_or("")
        )
    }
}

/// The vhost `origin` asks for, or the one-line reason it is refused. `patterns` are the
/// caller's server name patterns (`config.allow.patterns(origin)`), `own_host` its host
/// from hosts.json, if it has one.
pub fn resolve(
    config: &Config,
    origin: &str,
    patterns: &[String],
    own_host: Option<&str>,
    request: &Value,
) -> Result<Vhost, String> {
    if !request.is_object() {
        return Err("the request must be a JSON object".into());
    }
    let request = Request::deserialize(request).map_err(|e| format!("the request: {e}"))?;
    if request
        .sign_in_client
        .as_ref()
        .is_some_and(|v| !v.is_null())
    {
        return Err("sign_in_client: this provider has no sign-in; ask without one".into());
    }
    if request.scheme.as_deref().is_some_and(|s| s != "http") {
        return Err("scheme: only http upstreams are served".into());
    }
    if request.server_names.is_empty() || request.server_names.len() > SERVER_NAMES_MAX {
        return Err(format!("server_names: 1 to {SERVER_NAMES_MAX} names"));
    }
    let mut server_names: Vec<String> = Vec::with_capacity(request.server_names.len());
    for given in &request.server_names {
        let name = DnsName::parse(given).map_err(|e| format!("server_names: {e}"))?;
        let longest = config.longest_server_name();
        if name.as_str().len() > longest {
            return Err(format!(
                "server_names: {} has {} characters; this provider's nginx hashes names of \
                 at most {longest} (server_names_hash_bucket_size {})",
                short(name.as_str()),
                name.as_str().len(),
                config.server_names_hash_bucket_size
            ));
        }
        if !Allowances::any_permits(patterns, name.as_str()) {
            return Err(format!(
                "{origin} may not have the server name {name} (the provider's allow list; {})",
                config.allow.describe(origin)
            ));
        }
        if !server_names.iter().any(|n| n == name.as_str()) {
            server_names.push(name.as_str().to_owned());
        }
    }
    if request.port == 0 {
        return Err("port: 1 to 65535".into());
    }
    let path = request.path.as_deref().map(upstream_path).transpose()?;
    let upstream_host = match &request.upstream_host {
        Some(given) => {
            let host = upstream_host(given)?;
            let bare = host.trim_start_matches('[').trim_end_matches(']');
            if own_host.and_then(|h| upstream_host(h).ok()).as_deref() != Some(host.as_str())
                && !config.upstream_hosts.permits(origin, bare)
            {
                return Err(format!(
                    "{origin} may not forward to {bare} (the provider's upstream_hosts)"
                ));
            }
            host
        }
        None => {
            let own = own_host
                .ok_or_else(|| format!("hosts.json gives {origin} no address to forward to"))?;
            upstream_host(own).map_err(|e| format!("{origin}'s address in hosts.json: {e}"))?
        }
    };
    let tls = match request.tls {
        None => None,
        Some(name) => {
            if !is_tls_name(&name) || !config.tls.contains_key(&name) {
                return Err(format!(
                    "tls: the provider has no certificate set {:?}",
                    short(&name)
                ));
            }
            Some(name)
        }
    };
    Ok(Vhost {
        server_names,
        upstream_host,
        port: request.port,
        path,
        tls,
    })
}

/// An upstream host as nginx takes it: an IP address (IPv6 in brackets) or a DNS name
/// without wildcard.
fn upstream_host(given: &str) -> Result<String, String> {
    let bare = given
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(given);
    if let Ok(ip) = bare.parse::<IpAddr>() {
        return Ok(match ip {
            IpAddr::V4(v4) => v4.to_string(),
            IpAddr::V6(v6) => format!("[{v6}]"),
        });
    }
    let name = DnsName::parse(given).map_err(|e| format!("upstream_host: {e}"))?;
    if name.is_wildcard() {
        return Err("upstream_host: a wildcard name is no host".into());
    }
    Ok(name.as_str().to_owned())
}

/// `/`-started, of URL path characters that need no quoting in nginx config
/// (`A-Z a-z 0-9 - . _ ~ /`), without `.` or `..` segments; a trailing `/` added.
fn upstream_path(given: &str) -> Result<String, String> {
    let bad = || {
        format!(
            "path: {:?} must start with / and hold only A-Z a-z 0-9 - . _ ~ / (at most {PATH_MAX}), no . or .. segments",
            short(given)
        )
    };
    if !given.starts_with('/')
        || given.len() > PATH_MAX
        || !given
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~' | b'/'))
        || given.split('/').any(|s| s == "." || s == "..")
    {
        return Err(bad());
    }
    Ok(if given.ends_with('/') {
        given.to_owned()
    } else {
        format!("{given}/")
    })
}

/// A hostile value is quoted back in a reason only so far.
fn short(text: &str) -> String {
    let mut out: String = text.chars().take(40).collect();
    if text.chars().count() > 40 {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn resolve(c: &Config, origin: &str, own: Option<&str>, r: &Value) -> Result<Vhost, String> {
        super::resolve(c, origin, &c.allow.patterns(origin), own, r)
    }

    fn config() -> Config {
        serde_json::from_value(json!({
            "include_dir": "/etc/nginx/fort", "state_file": "/x",
            "tls": {"example-org": {"certificate": "/c.pem", "key": "/k.pem"}},
            "allow": {"app": ["wiki.example.org", "*.app.example.org"], "*": ["{origin}.example.org"]},
            "upstream_hosts": {"ops": ["10.0.0.9", "*.lan"]},
        }))
        .unwrap()
    }

    #[test]
    fn resolves_to_the_callers_own_address() {
        let c = config();
        let v = resolve(
            &c,
            "app",
            Some("10.0.0.3"),
            &json!({"server_names": ["Wiki.example.org", "wiki.example.org", "app.example.org"],
                    "port": 3000, "path": "/w", "tls": "example-org", "sign_in_client": null}),
        )
        .unwrap();
        assert_eq!(v.server_names, ["wiki.example.org", "app.example.org"]);
        assert_eq!(v.upstream(), "http://10.0.0.3:3000/w/");
        assert_eq!(v.tls.as_deref(), Some("example-org"));
        let v6 = resolve(
            &c,
            "app",
            Some("fd00::3"),
            &json!({"server_names": ["app.example.org"], "port": 80}),
        )
        .unwrap();
        assert_eq!(v6.upstream(), "http://[fd00::3]:80");
        // Naming its own address is no other host.
        assert!(resolve(
            &c,
            "app",
            Some("10.0.0.3"),
            &json!({"server_names": ["app.example.org"], "port": 80, "upstream_host": "10.0.0.3"})
        )
        .is_ok());
        let ops = resolve(&c, "ops", None,
            &json!({"server_names": ["ops.example.org"], "port": 80, "upstream_host": "Grafana.lan"})).unwrap();
        assert_eq!(ops.upstream(), "http://grafana.lan:80");
    }

    #[test]
    fn refusals_name_the_problem() {
        let c = config();
        let cases = [
            (
                json!({"server_names": ["web.example.org"], "port": 1}),
                "may not have the server name web.example.org",
            ),
            (
                json!({"server_names": ["x.app.example.org;"], "port": 1}),
                "is not a DNS name",
            ),
            (
                json!({"server_names": ["a b.app.example.org"], "port": 1}),
                "is not a DNS name",
            ),
            (
                json!({"server_names": ["$host.app.example.org"], "port": 1}),
                "is not a DNS name",
            ),
            (
                json!({"server_names": ["x.app.example.org\n}"], "port": 1}),
                "is not a DNS name",
            ),
            (json!({"server_names": [], "port": 1}), "1 to 16"),
            (
                json!({"server_names": ["app.example.org"], "port": 0}),
                "port",
            ),
            (
                json!({"server_names": ["app.example.org"], "port": 70000}),
                "the request",
            ),
            (
                json!({"server_names": ["app.example.org"], "port": 1, "path": "/a;b"}),
                "path",
            ),
            (
                json!({"server_names": ["app.example.org"], "port": 1, "path": "a"}),
                "path",
            ),
            (
                json!({"server_names": ["app.example.org"], "port": 1, "path": "/a/../b"}),
                "path",
            ),
            (
                json!({"server_names": ["app.example.org"], "port": 1, "path": "/$uri"}),
                "path",
            ),
            (
                json!({"server_names": ["app.example.org"], "port": 1, "upstream_host": "10.0.0.9"}),
                "may not forward to 10.0.0.9",
            ),
            (
                json!({"server_names": ["app.example.org"], "port": 1, "tls": "../etc"}),
                "no certificate set",
            ),
            (
                json!({"server_names": ["app.example.org"], "port": 1, "tls": "other"}),
                "no certificate set",
            ),
            (
                json!({"server_names": ["app.example.org"], "port": 1, "scheme": "https"}),
                "only http",
            ),
            (
                json!({"server_names": ["app.example.org"], "port": 1, "sign_in_client": "wiki"}),
                "no sign-in",
            ),
            (
                json!({"server_names": ["app.example.org"], "port": 1, "extra": 1}),
                "unknown field",
            ),
            (json!(["app.example.org"]), "JSON object"),
        ];
        for (request, says) in cases {
            let e = resolve(&c, "app", Some("10.0.0.3"), &request).unwrap_err();
            assert!(e.contains(says), "{request}: {e}");
        }
        let e = resolve(
            &c,
            "app",
            None,
            &json!({"server_names": ["app.example.org"], "port": 1}),
        )
        .unwrap_err();
        assert!(e.contains("no address"), "{e}");
        let e = resolve(
            &c,
            "ops",
            None,
            &json!({"server_names": ["ops.example.org"], "port": 1, "upstream_host": "a;b.lan"}),
        )
        .unwrap_err();
        assert!(e.contains("upstream_host"), "{e}");
    }
}
