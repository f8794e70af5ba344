//! The coordinator's config of a `mesh` (JSON, written by the NixOS module from
//! `fort.host.capabilities.<name>.mesh`): the mesh's name and prefixes, its shape, the
//! endpoints members may claim, addresses pinned by the operator, and the bounds.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use ipnet::{Ipv4Net, Ipv6Net};
use serde::Deserialize;

use crate::common::Allowances;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The mesh's name (letters, digits, `-`, `_`; at most 63). Required. Every member's
    /// address is derived from it and the member's host name, so the coordinators of one
    /// mesh (a home and its standbys) must name it alike.
    pub name: String,
    /// The handler's record of the members: their keys, endpoints and addresses (JSON,
    /// mode 0600). Required: a member keeps its address across runs and restarts.
    pub state_file: PathBuf,
    /// The fleet's hosts.json: members are hosts of it, and a member's default endpoint
    /// is its address there. Unset: `/etc/fort/hosts.json`.
    #[serde(default = "default_hosts_file")]
    pub hosts_file: PathBuf,
    /// The IPv4 prefix members' tunnel addresses come from (`10.77.0.0/16`; at most /30,
    /// with room for four addresses per member of `max_members`). Unset: no IPv4 in the
    /// tunnel. At least one of `ipv4` and `ipv6` must be set.
    #[serde(default)]
    pub ipv4: Option<Ipv4Net>,
    /// The IPv6 prefix members' tunnel addresses come from (`fd77:77::/64`; at most
    /// /124). Unset: no IPv6 in the tunnel.
    #[serde(default)]
    pub ipv6: Option<Ipv6Net>,
    /// `mesh`: every member is the peer of every other. `hub-and-spoke`: the `hubs` are
    /// peers of every member, and a spoke's only peers are the hubs (the first hub that is
    /// a member routes the whole mesh prefix, so spokes reach each other through it when
    /// it forwards). Unset: `mesh`.
    #[serde(default)]
    pub topology: Topology,
    /// The hubs of a hub-and-spoke mesh, host names in order of preference. Required
    /// (and only allowed) with `hub-and-spoke`.
    #[serde(default)]
    pub hubs: Vec<String>,
    /// `PersistentKeepalive` of every peer, in seconds (1 to 65535): for members behind
    /// NAT. Unset: none.
    #[serde(default)]
    pub persistent_keepalive: Option<u16>,
    /// The port of a member's endpoint and interface when its request names none. Unset:
    /// 51820.
    #[serde(default = "default_port")]
    pub default_port: u16,
    /// Endpoint hosts a member may claim instead of its own address from hosts.json, per
    /// caller and `"*"`; `{origin}` is the caller (`{"*": ["{origin}.example.org"]}`).
    /// Unset: none; every member's endpoint is its registry address.
    #[serde(default)]
    pub endpoints: Allowances,
    /// Addresses the operator gives members by host name instead of derived ones
    /// (`{"gw": {"ipv4": "10.77.0.1", "ipv6": "fd77:77::1"}}`); each must be in its
    /// prefix and given to one host only. A pin wins over an address a member holds.
    #[serde(default)]
    pub addresses: BTreeMap<String, Pinned>,
    /// The most members of the mesh (1 to 400): each answer lists every peer, so a run's
    /// output grows with its square. A new member past it is refused. Unset: 250, or
    /// fewer when the IPv4 prefix has room for fewer (four addresses per member).
    #[serde(default)]
    pub max_members: Option<usize>,
    /// Changes one member may make in any hour (joining, a new key, a new endpoint):
    /// each changes every other member's answer, so one member cannot have the whole
    /// mesh reconfigured without end. Past it a change waits (the member keeps what it
    /// has). Unset: 10.
    #[serde(default = "default_changes_per_hour")]
    pub max_changes_per_member_per_hour: usize,
    /// How long a member's key serves before its answer expires (`"30d"`): the member's
    /// agent then makes a new key and asks with it (its need's `renew_before`). Unset:
    /// keys are kept until the member replaces one.
    #[serde(default, with = "humantime_serde")]
    pub key_lifetime: Option<Duration>,
    /// The other coordinators (fort host names) of this mesh, for members whose need
    /// names several (docs/protocol.md §11.13). They must have the same `name`, prefixes,
    /// shape and pins. With peers, the fleet check refuses two members whose derived
    /// addresses collide unless one is pinned, so every coordinator gives every member
    /// the same address. Unset: none.
    #[serde(default)]
    pub peers: Vec<String>,
}

/// An operator's address for one member.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Pinned {
    #[serde(default)]
    pub ipv4: Option<Ipv4Addr>,
    #[serde(default)]
    pub ipv6: Option<Ipv6Addr>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Topology {
    #[default]
    Mesh,
    HubAndSpoke,
}

impl Topology {
    pub fn as_str(self) -> &'static str {
        match self {
            Topology::Mesh => "mesh",
            Topology::HubAndSpoke => "hub-and-spoke",
        }
    }
}

fn default_hosts_file() -> PathBuf {
    PathBuf::from("/etc/fort/hosts.json")
}
fn default_port() -> u16 {
    51820
}
/// Members when the config does not say.
const DEFAULT_MAX_MEMBERS: usize = 250;
fn default_changes_per_hour() -> usize {
    10
}

/// The most members any mesh may have: 400 answers of 399 peers are about 30 MB of
/// output per run, half the agent's bound on a handler's stdout.
pub const MOST_MEMBERS: usize = 400;
/// The most other coordinators (a need names at most 8 providers).
const MAX_PEERS: usize = 7;

impl Config {
    pub fn load(path: &Path) -> anyhow::Result<Config> {
        let config: Config = crate::common::config::load(path)?;
        config
            .validate()
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), String> {
        if !is_mesh_name(&self.name) {
            return Err(format!(
                "name: {:?} must be 1 to 63 letters, digits, - or _",
                self.name
            ));
        }
        if self.ipv4.is_none() && self.ipv6.is_none() {
            return Err("ipv4, ipv6: at least one prefix is needed".into());
        }
        if self
            .max_members
            .is_some_and(|n| !(1..=MOST_MEMBERS).contains(&n))
        {
            return Err(format!("max_members: 1 to {MOST_MEMBERS}"));
        }
        if let Some(net) = self.ipv4 {
            if net.trunc() != net {
                return Err(format!(
                    "ipv4: {net} has host bits set; the prefix is {}",
                    net.trunc()
                ));
            }
            if net.prefix_len() > 30 {
                return Err(format!("ipv4: {net}: the prefix length must be at most 30"));
            }
            // Four addresses per member keep collisions of derived addresses rare.
            if self.max_members() == 0 || self.max_members() as u64 * 4 > room4(net) {
                return Err(format!(
                    "ipv4: {net} holds {} addresses, fewer than four per member of max_members ({}); take a shorter prefix or a smaller max_members",
                    room4(net),
                    self.max_members()
                ));
            }
        }
        if let Some(net) = self.ipv6 {
            if net.trunc() != net {
                return Err(format!(
                    "ipv6: {net} has host bits set; the prefix is {}",
                    net.trunc()
                ));
            }
            if net.prefix_len() > 124 || net.prefix_len() == 0 {
                return Err(format!("ipv6: {net}: the prefix length must be 1 to 124"));
            }
        }
        match (self.topology, self.hubs.is_empty()) {
            (Topology::HubAndSpoke, true) => {
                return Err("hubs: a hub-and-spoke mesh needs at least one hub".into())
            }
            (Topology::Mesh, false) => {
                return Err("hubs: only a hub-and-spoke mesh has hubs".into());
            }
            _ => {}
        }
        for (i, hub) in self.hubs.iter().enumerate() {
            if !fort_core::names::is_host_name(hub) {
                return Err(format!("hubs: {hub:?} is not a fort host name"));
            }
            if self.hubs[..i].contains(hub) {
                return Err(format!("hubs: {hub} is named twice"));
            }
        }
        if self.persistent_keepalive == Some(0) {
            return Err("persistent_keepalive: 1 to 65535 seconds, or leave it out".into());
        }
        if self.default_port == 0 {
            return Err("default_port: 1 to 65535".into());
        }
        if self.max_changes_per_member_per_hour == 0 {
            return Err("max_changes_per_member_per_hour: at least 1".into());
        }
        if self
            .key_lifetime
            .is_some_and(|d| d < Duration::from_secs(60))
        {
            return Err("key_lifetime: at least a minute".into());
        }
        self.endpoints.validate()?;
        self.validate_pins()?;
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
        Ok(())
    }

    fn validate_pins(&self) -> Result<(), String> {
        let mut seen4 = BTreeMap::new();
        let mut seen6 = BTreeMap::new();
        for (host, pin) in &self.addresses {
            if !fort_core::names::is_host_name(host) {
                return Err(format!("addresses: {host:?} is not a fort host name"));
            }
            if pin.ipv4.is_none() && pin.ipv6.is_none() {
                return Err(format!("addresses.{host}: give ipv4, ipv6 or both"));
            }
            if let Some(a) = pin.ipv4 {
                let net = self
                    .ipv4
                    .ok_or_else(|| format!("addresses.{host}.ipv4: the mesh has no ipv4 prefix"))?;
                if !super::address::usable4(net, a) {
                    return Err(format!(
                        "addresses.{host}.ipv4: {a} is not a host address of {net}"
                    ));
                }
                if let Some(other) = seen4.insert(a, host) {
                    return Err(format!("addresses: {a} is pinned for {other} and {host}"));
                }
            }
            if let Some(a) = pin.ipv6 {
                let net = self
                    .ipv6
                    .ok_or_else(|| format!("addresses.{host}.ipv6: the mesh has no ipv6 prefix"))?;
                if !super::address::usable6(net, a) {
                    return Err(format!(
                        "addresses.{host}.ipv6: {a} is not a host address of {net}"
                    ));
                }
                if let Some(other) = seen6.insert(a, host) {
                    return Err(format!("addresses: {a} is pinned for {other} and {host}"));
                }
            }
        }
        Ok(())
    }

    /// The address plan every coordinator of the mesh must share (the fleet check holds
    /// a need's coordinators to one): its name, prefixes, shape and pins.
    pub fn plan(&self) -> String {
        let family = |v: Option<String>| v.unwrap_or_else(|| "-".into());
        let mut text = format!(
            "mesh {} {} {} {}",
            self.name,
            family(self.ipv4.map(|n| n.to_string())),
            family(self.ipv6.map(|n| n.to_string())),
            self.topology.as_str()
        );
        if !self.hubs.is_empty() {
            text.push_str(&format!(" hubs {}", self.hubs.join(",")));
        }
        if !self.addresses.is_empty() {
            let pins: Vec<String> = self
                .addresses
                .iter()
                .map(|(h, p)| {
                    let v4 = p.ipv4.map(|a| a.to_string()).unwrap_or_default();
                    let v6 = p.ipv6.map(|a| a.to_string()).unwrap_or_default();
                    format!("{h}={v4}/{v6}")
                })
                .collect();
            text.push_str(&format!(" pins {}", pins.join(",")));
        }
        text
    }

    /// The most members: as configured, else 250 or what the IPv4 prefix has room for.
    pub fn max_members(&self) -> usize {
        self.max_members.unwrap_or_else(|| {
            let room = self.ipv4.map_or(u64::MAX, |net| room4(net) / 4);
            DEFAULT_MAX_MEMBERS.min(usize::try_from(room).unwrap_or(usize::MAX))
        })
    }

    /// Whether `host` is a hub of this mesh.
    pub fn is_hub(&self, host: &str) -> bool {
        self.topology == Topology::HubAndSpoke && self.hubs.iter().any(|h| h == host)
    }
}

/// Host addresses of an IPv4 prefix (without its network and broadcast addresses).
fn room4(net: Ipv4Net) -> u64 {
    (1u64 << (32 - u32::from(net.prefix_len()))).saturating_sub(2)
}

/// A mesh's name: what addresses are derived from, and shown in every answer.
fn is_mesh_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_')
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
        let c = parse(r#"{"name": "office", "state_file": "/x", "ipv4": "10.77.0.0/16"}"#).unwrap();
        assert_eq!(c.default_port, 51820);
        assert_eq!(c.topology, Topology::Mesh);
        assert_eq!(c.max_members(), 250);
        let small = parse(r#"{"name": "o", "state_file": "/x", "ipv4": "10.77.0.0/24"}"#).unwrap();
        assert_eq!(small.max_members(), 63);
        assert_eq!(c.plan(), "mesh office 10.77.0.0/16 - mesh");
        let hub = parse(
            r#"{"name": "o", "state_file": "/x", "ipv6": "fd77:77::/64",
                "topology": "hub-and-spoke", "hubs": ["gw"],
                "addresses": {"gw": {"ipv6": "fd77:77::1"}}}"#,
        )
        .unwrap();
        assert!(hub.is_hub("gw") && !hub.is_hub("app"));
        assert_eq!(
            hub.plan(),
            "mesh o - fd77:77::/64 hub-and-spoke hubs gw pins gw=/fd77:77::1"
        );
        for bad in [
            r#"{"name": "o", "state_file": "/x"}"#,
            r#"{"name": "o f", "state_file": "/x", "ipv4": "10.77.0.0/16"}"#,
            r#"{"name": "o", "state_file": "/x", "ipv4": "10.77.0.1/16"}"#,
            r#"{"name": "o", "state_file": "/x", "ipv4": "10.77.0.0/24", "max_members": 64}"#,
            r#"{"name": "o", "state_file": "/x", "ipv4": "10.77.0.0/31"}"#,
            r#"{"name": "o", "state_file": "/x", "ipv6": "fd77::/126"}"#,
            r#"{"name": "o", "state_file": "/x", "ipv6": "fd77::1/64"}"#,
            r#"{"name": "o", "state_file": "/x", "ipv4": "10.0.0.0/8", "hubs": ["gw"]}"#,
            r#"{"name": "o", "state_file": "/x", "ipv4": "10.0.0.0/8", "topology": "hub-and-spoke"}"#,
            r#"{"name": "o", "state_file": "/x", "ipv4": "10.0.0.0/8", "persistent_keepalive": 0}"#,
            r#"{"name": "o", "state_file": "/x", "ipv4": "10.0.0.0/8", "max_members": 401}"#,
            r#"{"name": "o", "state_file": "/x", "ipv4": "10.0.0.0/8", "key_lifetime": "5s"}"#,
            r#"{"name": "o", "state_file": "/x", "ipv4": "10.0.0.0/8", "endpoints": {"*": ["*"]}}"#,
            r#"{"name": "o", "state_file": "/x", "ipv4": "10.0.0.0/8", "addresses": {"a": {"ipv4": "10.0.0.0"}}}"#,
            r#"{"name": "o", "state_file": "/x", "ipv4": "10.0.0.0/8", "addresses": {"a": {"ipv4": "11.0.0.1"}}}"#,
            r#"{"name": "o", "state_file": "/x", "ipv4": "10.0.0.0/8", "addresses": {"a": {"ipv6": "fd::1"}}}"#,
            r#"{"name": "o", "state_file": "/x", "ipv4": "10.0.0.0/8", "addresses": {"a": {"ipv4": "10.0.0.5"}, "b": {"ipv4": "10.0.0.5"}}}"#,
            r#"{"name": "o", "state_file": "/x", "ipv4": "10.0.0.0/8", "peers": ["c2", "c2"]}"#,
            r#"{"name": "o", "state_file": "/x", "ipv4": "10.0.0.0/8", "colour": 1}"#,
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
        // A /24 holds four addresses for each of up to 63 members.
        assert!(parse(
            r#"{"name": "o", "state_file": "/x", "ipv4": "10.77.0.0/24", "max_members": 63}"#
        )
        .is_ok());
    }
}
