//! A member's request (interface `mesh`, nixos-module/interfaces/mesh.nix): the public
//! half of the WireGuard key its agent made, and where it listens. Nothing else: its
//! tunnel address is the coordinator's to give, and who it is comes from the entry's
//! authenticated origin.

use std::collections::BTreeMap;
use std::net::IpAddr;

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use serde::Deserialize;
use serde_json::Value;

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Request {
    /// The member's WireGuard public key, base64 (`wg pubkey`; `{"$fort_key": …}` in the
    /// need, so the private key never leaves the member).
    pub public_key: String,
    /// The host other members send to (an IP address or a DNS name), when it is not the
    /// member's address in hosts.json; the coordinator's `endpoints` must allow it.
    #[serde(default)]
    pub endpoint: Option<String>,
    /// The UDP port the member's interface listens on, and its endpoint's port. Unset:
    /// the coordinator's `default_port`.
    #[serde(default)]
    pub port: Option<u16>,
}

/// The request of an entry, checked: a refusal's reason otherwise.
pub fn parse(request: &Value) -> Result<Request, String> {
    let r: Request = serde_json::from_value(request.clone())
        .map_err(|e| format!("the request is not a mesh request: {e}"))?;
    check_public_key(&r.public_key)?;
    if let Some(host) = &r.endpoint {
        if !is_endpoint_host(host) {
            return Err(format!(
                "endpoint {:?} is neither an IP address nor a DNS name",
                fort_core::text::printable(host, 80)
            ));
        }
    }
    if r.port == Some(0) {
        return Err("port: 1 to 65535".into());
    }
    Ok(r)
}

/// A WireGuard public key: base64 of 32 bytes, not all zero (no key has that one).
pub fn check_public_key(key: &str) -> Result<(), String> {
    let bytes = STANDARD
        .decode(key.as_bytes())
        .ok()
        .filter(|b| b.len() == 32)
        .ok_or_else(|| {
            format!(
                "public_key {:?} is not a WireGuard public key (base64 of 32 bytes, as wg pubkey prints it)",
                fort_core::text::printable(key, 60)
            )
        })?;
    if bytes.iter().all(|b| *b == 0) {
        return Err("public_key is all zeros, which is no key".into());
    }
    Ok(())
}

/// An IP address, or a DNS name of letters, digits and `-` in labels of at most 63.
fn is_endpoint_host(host: &str) -> bool {
    if host.parse::<IpAddr>().is_ok() {
        return true;
    }
    !host.is_empty()
        && host.len() <= 253
        && host.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|c| c.is_ascii_alphanumeric() || c == b'-')
        })
}

/// `host:port`, an IPv6 address in brackets: as WireGuard's `Endpoint` reads it.
pub fn endpoint(host: &str, port: u16) -> String {
    match host.parse::<IpAddr>() {
        Ok(IpAddr::V6(a)) => format!("[{a}]:{port}"),
        Ok(IpAddr::V4(a)) => format!("{a}:{port}"),
        Err(_) => format!("{}:{port}", host.to_ascii_lowercase()),
    }
}

/// The hosts' addresses in hosts.json: no member claims another host's as its endpoint,
/// whatever `endpoints` allows it (a wildcard may name them), so no member takes a
/// host's traffic or keeps that host out of the mesh by holding its endpoint first.
pub struct RegistryAddresses(BTreeMap<String, Vec<String>>);

impl RegistryAddresses {
    /// From every host's address (its host part) and name.
    pub fn new(hosts: impl IntoIterator<Item = (String, String)>) -> RegistryAddresses {
        let mut by_address: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (host, name) in hosts {
            by_address.entry(comparable(&host)).or_default().push(name);
        }
        RegistryAddresses(by_address)
    }

    /// Another host than `origin` whose address in hosts.json `host` is.
    pub fn other_than(&self, origin: &str, host: &str) -> Option<&str> {
        self.0
            .get(&comparable(host))?
            .iter()
            .find(|name| *name != origin)
            .map(String::as_str)
    }
}

/// A host as it is compared: an IP address in its one form (an IPv4-mapped IPv6 address
/// as IPv4), a name lower-cased without a final dot.
pub fn comparable(host: &str) -> String {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    match bare.parse::<IpAddr>() {
        Ok(ip) => ip.to_canonical().to_string(),
        Err(_) => bare.trim_end_matches('.').to_ascii_lowercase(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const KEY: &str = "xTIBA5rboUvnH4htodjb6e697QjLERt1NAB4mZqp8Dg=";

    #[test]
    fn requests_and_refusals() {
        let r = parse(&json!({"public_key": KEY})).unwrap();
        assert_eq!((r.endpoint, r.port), (None, None));
        let r = parse(&json!({"public_key": KEY, "endpoint": "wg.example.org", "port": 51900}))
            .unwrap();
        assert_eq!(r.endpoint.as_deref(), Some("wg.example.org"));
        for (bad, says) in [
            (json!({"public_key": "AAAA"}), "not a WireGuard public key"),
            (
                json!({"public_key": STANDARD.encode([0u8; 32])}),
                "all zeros",
            ),
            (json!({"public_key": KEY, "endpoint": "a b"}), "neither"),
            (json!({"public_key": KEY, "port": 0}), "port"),
            (
                json!({"public_key": KEY, "address": "10.0.0.1"}),
                "unknown field",
            ),
            (json!({"endpoint": "x"}), "missing field"),
        ] {
            let err = parse(&bad).unwrap_err();
            assert!(err.contains(says), "{bad}: {err}");
        }
        assert_eq!(endpoint("fd00::1", 51820), "[fd00::1]:51820");
        assert_eq!(endpoint("10.0.0.1", 1), "10.0.0.1:1");
        assert_eq!(endpoint("WG.example.org", 2), "wg.example.org:2");
    }
}
