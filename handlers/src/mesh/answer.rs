//! What the mesh coordinator answers each member: itself and the peers it should have,
//! as the topology (full mesh, or hubs and spokes) decides.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use super::config::Config;
use super::reconcile::Member;

/// Every member's answer: itself (key, addresses, port, role) and its peers. A member of
/// a full mesh has every other member as a peer; in a hub-and-spoke mesh a hub has every
/// other member, and a spoke the hubs only, the first hub that is a member also routing
/// the whole prefix (so spokes reach each other through it).
pub fn answers(config: &Config, members: &BTreeMap<String, Member>) -> BTreeMap<String, Value> {
    let hub_and_spoke = config.topology == super::config::Topology::HubAndSpoke;
    let router = config
        .hubs
        .iter()
        .find(|h| members.contains_key(h.as_str()));
    let peer = |host: &str, p: &Member, routes: bool| {
        let mut allowed: Vec<String> = Vec::with_capacity(4);
        allowed.extend(p.ipv4.map(|a| format!("{a}/32")));
        allowed.extend(p.ipv6.map(|a| format!("{a}/128")));
        if routes {
            allowed.extend(config.ipv4.map(|n| n.to_string()));
            allowed.extend(config.ipv6.map(|n| n.to_string()));
        }
        let mut v = json!({"host": host, "public_key": p.public_key, "endpoint": p.endpoint,
                           "allowed_ips": allowed});
        if let Some(k) = config.persistent_keepalive {
            v["persistent_keepalive"] = json!(k);
        }
        v
    };
    // Each member as a peer, made once (a mesh of n members lists n − 1 peers n times).
    let as_peer: BTreeMap<&str, Value> = members
        .iter()
        .map(|(h, p)| (h.as_str(), peer(h, p, false)))
        .collect();
    members
        .iter()
        .map(|(host, m)| {
            let role = match (hub_and_spoke, config.is_hub(host)) {
                (false, _) => "member",
                (true, true) => "hub",
                (true, false) => "spoke",
            };
            let peers: Vec<Value> = members
                .iter()
                .filter(|(h, _)| *h != host && (role != "spoke" || config.is_hub(h)))
                .map(|(h, p)| {
                    if role == "spoke" && router == Some(h) {
                        peer(h, p, true)
                    } else {
                        as_peer[h.as_str()].clone()
                    }
                })
                .collect();
            let mut v = json!({"mesh": config.name, "host": host, "public_key": m.public_key,
                               "listen_port": m.port, "role": role, "peers": peers});
            if let (Some(net), Some(a)) = (config.ipv4, m.ipv4) {
                v["ipv4"] = json!(format!("{a}/{}", net.prefix_len()));
            }
            if let (Some(net), Some(a)) = (config.ipv6, m.ipv6) {
                v["ipv6"] = json!(format!("{a}/{}", net.prefix_len()));
            }
            if let Some(life) = config.key_lifetime {
                v["expires_at"] = json!(m.key_since.saturating_add(life.as_secs()));
            }
            (host.clone(), v)
        })
        .collect()
}
