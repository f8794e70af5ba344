//! One run over every member's entry: who is a member (a host of the registry, with a key
//! and an endpoint no other member holds, within the mesh's bounds), the address each
//! keeps or gets, and every member's answer: itself and its peers. Joining, a new key, a
//! new endpoint or leaving changes the others' answers, which the agent then delivers to
//! each of them; an unchanged answer is kept by its hash and costs no callback.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, Ipv6Addr};

use serde::{Deserialize, Serialize};

use super::address;
pub use super::answer::answers;
use super::config::Config;
use super::request;
use crate::common::entries::payload_sha256;
use crate::common::{Entry, Output};

pub const STATE_VERSION: u32 = 1;

/// An hour, the window of `max_changes_per_member_per_hour`.
const HOUR: u64 = 3600;

/// What the handler keeps: every member, by host name, and the times each host's
/// membership changed within the last hour.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct State {
    #[serde(default)]
    pub members: BTreeMap<String, Member>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub changes: BTreeMap<String, Vec<u64>>,
}

/// One member as the mesh knows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    /// Its entry key (`<host>:<type>/<id>`).
    pub entry: String,
    pub public_key: String,
    /// Where the others send to, `host:port`.
    pub endpoint: String,
    /// The port its interface listens on.
    pub port: u16,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipv4: Option<Ipv4Addr>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipv6: Option<Ipv6Addr>,
    /// When it joined, and when its current key was taken (unix seconds).
    pub joined_at: u64,
    pub key_since: u64,
}

/// What a run needs of the fleet's registry.
pub trait Registry {
    fn is_host(&self, name: &str) -> bool;
    /// The host part of a host's address in hosts.json.
    fn host_of(&self, name: &str) -> Option<String>;
    /// Every host's name.
    fn host_names(&self) -> Vec<String>;
}

impl Registry for crate::common::hosts::Fleet {
    fn is_host(&self, name: &str) -> bool {
        crate::common::hosts::Fleet::is_host(self, name)
    }
    fn host_of(&self, name: &str) -> Option<String> {
        crate::common::hosts::Fleet::host_of(self, name)
    }
    fn host_names(&self) -> Vec<String> {
        crate::common::hosts::Fleet::host_names(self)
            .cloned()
            .collect()
    }
}

/// How the run went, for its log line.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub members: usize,
    pub joined: usize,
    pub changed: usize,
    pub left: usize,
    pub refused: usize,
    pub waiting: usize,
    pub answered: usize,
    pub kept: usize,
}

/// A member's wish, as its entry asks.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Want {
    entry: String,
    public_key: String,
    endpoint: String,
    port: u16,
}

/// What one entry gets besides its answer as a member.
enum Verdict {
    Refused(String),
    Waiting(String),
}

/// The endpoint host of `origin`, as asked or from the registry, if it may have it.
fn want_of(
    config: &Config,
    registry: &dyn Registry,
    addresses: &request::RegistryAddresses,
    e: &Entry,
) -> Result<Want, String> {
    if !registry.is_host(&e.origin) {
        return Err(format!(
            "{} is not a host of hosts.json; members of a mesh are hosts",
            e.origin
        ));
    }
    let r = request::parse(&e.request)?;
    let own = registry.host_of(&e.origin);
    let host = match (&r.endpoint, &own) {
        (Some(asked), own)
            if own.as_deref().map(request::comparable) != Some(request::comparable(asked)) =>
        {
            if !config.endpoints.permits(&e.origin, asked) {
                return Err(format!(
                    "endpoint {asked} is not one {} may claim ({}; its own address in hosts.json is always allowed)",
                    e.origin,
                    config.endpoints.describe(&e.origin)
                ));
            }
            if let Some(other) = addresses.other_than(&e.origin, asked) {
                return Err(format!(
                    "endpoint {asked} is {other}'s address in hosts.json; a member never claims another host's"
                ));
            }
            asked.clone()
        }
        (Some(asked), _) => asked.clone(),
        (None, Some(own)) => own.clone(),
        (None, None) => {
            return Err(format!(
                "{} has no address in hosts.json, and the request names no endpoint",
                e.origin
            ))
        }
    };
    let port = r.port.unwrap_or(config.default_port);
    Ok(Want {
        entry: e.key.clone(),
        public_key: r.public_key,
        endpoint: request::endpoint(&host, port),
        port,
    })
}

/// Everything a run decides: the members, and a verdict for each entry that is not
/// answered as one.
struct Decided {
    members: BTreeMap<String, Member>,
    verdicts: BTreeMap<String, Verdict>,
    rerun_after: Option<u64>,
    counts: Counts,
}

/// Decides every entry against `state` at `now`; `state` is not changed.
fn decide(
    config: &Config,
    registry: &dyn Registry,
    state: &State,
    entries: &[Entry],
    now: u64,
) -> Decided {
    let mut verdicts = BTreeMap::new();
    let mut counts = Counts::default();
    let addresses = request::RegistryAddresses::new(
        registry
            .host_names()
            .into_iter()
            .filter_map(|name| Some((registry.host_of(&name)?, name))),
    );
    // One membership per host: its entry the state knows, else its first.
    let mut by_host: BTreeMap<&str, Vec<&Entry>> = BTreeMap::new();
    for e in entries {
        by_host.entry(e.origin.as_str()).or_default().push(e);
    }
    // Host → (its entry, what it asks for or why it may not).
    let mut wants: BTreeMap<String, (String, Result<Want, String>)> = BTreeMap::new();
    for (host, mut list) in by_host {
        let known = state.members.get(host).map(|m| m.entry.as_str());
        list.sort_by_key(|e| (Some(e.key.as_str()) != known, e.key.clone()));
        let (first, rest) = list.split_first().expect("grouped entries");
        for e in rest {
            verdicts.insert(
                e.key.clone(),
                Verdict::Refused(format!(
                    "{host} is already a member of mesh {} through {}",
                    config.name, first.key
                )),
            );
        }
        wants.insert(
            host.to_owned(),
            (
                first.key.clone(),
                want_of(config, registry, &addresses, first),
            ),
        );
    }
    // Members that stay keep their key and endpoint against newcomers: the holders are
    // those of the state whose hosts still ask, of an endpoint they may still have
    // (not one that became, or always was, another host's address).
    let mut key_holder: BTreeMap<String, String> = BTreeMap::new();
    let mut endpoint_holder: BTreeMap<String, String> = BTreeMap::new();
    for (host, m) in &state.members {
        if wants.contains_key(host) {
            key_holder.insert(m.public_key.clone(), host.clone());
            if still_allowed(config, registry, &addresses, host, m) {
                endpoint_holder.insert(m.endpoint.clone(), host.clone());
            }
        }
    }
    // Established members first (in the order they joined), then newcomers by name.
    let mut order: Vec<&String> = wants.keys().collect();
    order.sort_by_key(|h| match state.members.get(*h) {
        Some(m) => (0, m.joined_at, (*h).clone()),
        None => (1, 0, (*h).clone()),
    });
    let max = config.max_members();
    let mut members: BTreeMap<String, Member> = BTreeMap::new();
    let mut rerun_after: Option<u64> = None;
    for host in order {
        let (entry, want) = &wants[host];
        let entry = entry.clone();
        let previous = state.members.get(host);
        // The key and the endpoint must be no other member's.
        let claimed = want.as_ref().map_err(Clone::clone).and_then(|w| {
            let other = |holders: &BTreeMap<String, String>, value: &str| {
                holders
                    .get(value)
                    .filter(|h| *h != host)
                    .cloned()
                    .or_else(|| {
                        members
                            .iter()
                            .find(|(h, m)| {
                                *h != host && (m.public_key == value || m.endpoint == value)
                            })
                            .map(|(h, _)| h.clone())
                    })
            };
            if let Some(o) = other(&key_holder, &w.public_key) {
                return Err(format!(
                    "the public key is {o}'s, another member of the mesh"
                ));
            }
            if let Some(o) = other(&endpoint_holder, &w.endpoint) {
                return Err(format!(
                    "the endpoint {} is {o}'s, another member of the mesh",
                    w.endpoint
                ));
            }
            Ok(w.clone())
        });
        let want = match claimed {
            Ok(w) => w,
            Err(why) => {
                counts.refused += 1;
                // A refused change keeps the membership the host had, while its key and
                // endpoint are still its own and allowed.
                let kept = previous.filter(|p| {
                    still_allowed(config, registry, &addresses, host, p)
                        && !members.iter().any(|(h, m)| {
                            h != host && (m.public_key == p.public_key || m.endpoint == p.endpoint)
                        })
                });
                let why = match kept {
                    Some(p) => {
                        let mut m = p.clone();
                        m.entry = entry.clone();
                        members.insert(host.clone(), m);
                        format!(
                            "{why}; it stays a member with the key and endpoint ({}) it had",
                            p.endpoint
                        )
                    }
                    None => why,
                };
                verdicts.insert(entry, Verdict::Refused(why));
                continue;
            }
        };
        let same = previous.is_some_and(|p| {
            p.public_key == want.public_key && p.endpoint == want.endpoint && p.port == want.port
        });
        if !same {
            // Joining and every change after it change every other member's answer.
            let recent: Vec<u64> = state
                .changes
                .get(host)
                .map(|t| t.iter().copied().filter(|t| t + HOUR > now).collect())
                .unwrap_or_default();
            if recent.len() >= config.max_changes_per_member_per_hour {
                let oldest = recent.iter().copied().min().unwrap_or(now);
                let wait = (oldest + HOUR).saturating_sub(now).max(1);
                rerun_after = Some(rerun_after.map_or(wait, |r| r.min(wait)));
                counts.waiting += 1;
                let mut why = format!(
                    "{} changes of {host}'s membership in the last hour, the most max_changes_per_member_per_hour allows; the change is made in {} min",
                    recent.len(),
                    wait.div_ceil(60)
                );
                if let Some(p) = previous {
                    let mut m = p.clone();
                    m.entry = entry.clone();
                    members.insert(host.clone(), m);
                    why.push_str("; it stays a member as it was");
                }
                verdicts.insert(entry, Verdict::Waiting(why));
                continue;
            }
        }
        if previous.is_none() && members.len() >= max {
            counts.refused += 1;
            verdicts.insert(
                entry,
                Verdict::Refused(format!(
                    "mesh {} has {max} members, the most max_members allows",
                    config.name
                )),
            );
            continue;
        }
        match previous {
            None => counts.joined += 1,
            Some(_) if !same => counts.changed += 1,
            Some(_) => {}
        }
        let key_since = match previous {
            Some(p) if p.public_key == want.public_key => p.key_since,
            _ => now,
        };
        members.insert(
            host.clone(),
            Member {
                entry: want.entry,
                public_key: want.public_key,
                endpoint: want.endpoint,
                port: want.port,
                ipv4: previous.and_then(|p| p.ipv4),
                ipv6: previous.and_then(|p| p.ipv6),
                joined_at: previous.map_or(now, |p| p.joined_at),
                key_since,
            },
        );
    }
    counts.left = state
        .members
        .keys()
        .filter(|h| !members.contains_key(*h))
        .count();
    let unplaced = place(config, state, &mut members);
    for (host, why) in unplaced {
        if let Some(m) = members.remove(&host) {
            counts.refused += 1;
            verdicts.insert(m.entry, Verdict::Refused(why));
        }
    }
    counts.members = members.len();
    Decided {
        members,
        verdicts,
        rerun_after,
        counts,
    }
}

/// Whether a member's recorded endpoint is still one it may have.
fn still_allowed(
    config: &Config,
    registry: &dyn Registry,
    addresses: &request::RegistryAddresses,
    host: &str,
    m: &Member,
) -> bool {
    let own = registry
        .host_of(host)
        .map(|h| request::endpoint(&h, m.port));
    own.as_deref() == Some(m.endpoint.as_str())
        || m.endpoint
            .rsplit_once(':')
            .map(|(h, _)| h.trim_start_matches('[').trim_end_matches(']'))
            .is_some_and(|h| {
                config.endpoints.permits(host, h) && addresses.other_than(host, h).is_none()
            })
}

/// Gives every member its addresses: a pin; else the one it has, while it is in the
/// prefix and no pin's; else its first free derived candidate. Addresses members hold
/// are reserved before anyone is given a new one, so a newcomer never takes an address
/// in use. Returns the members that cannot be placed (a full prefix), with why.
fn place(
    config: &Config,
    state: &State,
    members: &mut BTreeMap<String, Member>,
) -> Vec<(String, String)> {
    let pinned4: BTreeSet<Ipv4Addr> = config.addresses.values().filter_map(|p| p.ipv4).collect();
    let pinned6: BTreeSet<Ipv6Addr> = config.addresses.values().filter_map(|p| p.ipv6).collect();
    let mut taken4 = pinned4.clone();
    let mut taken6 = pinned6.clone();
    let mut order: Vec<String> = members.keys().cloned().collect();
    order.sort_by_key(|h| match state.members.get(h) {
        Some(m) => (0, m.joined_at, h.clone()),
        None => (1, 0, h.clone()),
    });
    let mut keep4: BTreeMap<&str, Ipv4Addr> = BTreeMap::new();
    let mut keep6: BTreeMap<&str, Ipv6Addr> = BTreeMap::new();
    for h in &order {
        let m = &members[h];
        let pin = config.addresses.get(h).cloned().unwrap_or_default();
        if let (Some(net), Some(a), None) = (config.ipv4, m.ipv4, pin.ipv4) {
            if address::usable4(net, a) && !pinned4.contains(&a) && taken4.insert(a) {
                keep4.insert(h, a);
            }
        }
        if let (Some(net), Some(a), None) = (config.ipv6, m.ipv6, pin.ipv6) {
            if address::usable6(net, a) && !pinned6.contains(&a) && taken6.insert(a) {
                keep6.insert(h, a);
            }
        }
    }
    let mut unplaced = Vec::new();
    for h in &order {
        let pin = config.addresses.get(h).cloned().unwrap_or_default();
        let ipv4 = config.ipv4.and_then(|net| {
            pin.ipv4
                .or_else(|| keep4.get(h.as_str()).copied())
                .or_else(|| {
                    let a = address::allocate4(&config.name, h, net, &taken4)?;
                    taken4.insert(a);
                    Some(a)
                })
        });
        let ipv6 = config.ipv6.and_then(|net| {
            pin.ipv6
                .or_else(|| keep6.get(h.as_str()).copied())
                .or_else(|| {
                    let a = address::allocate6(&config.name, h, net, &taken6)?;
                    taken6.insert(a);
                    Some(a)
                })
        });
        if ipv4.is_none() != config.ipv4.is_none() || ipv6.is_none() != config.ipv6.is_none() {
            unplaced.push((
                h.clone(),
                format!(
                    "mesh {}: no free address is left in its prefix",
                    config.name
                ),
            ));
        }
        let m = members.get_mut(h).expect("ordered members");
        m.ipv4 = ipv4;
        m.ipv6 = ipv6;
    }
    unplaced
}

/// One run at `now`: decides every entry, replaces `state` with the members it leaves,
/// and answers each entry. Returns whether the state changed (to be saved).
pub fn reconcile(
    config: &Config,
    registry: &dyn Registry,
    state: &mut State,
    entries: &[Entry],
    now: u64,
) -> (Output, Counts, bool) {
    let mut d = decide(config, registry, state, entries, now);
    let mut changes: BTreeMap<String, Vec<u64>> = state
        .changes
        .iter()
        .map(|(h, t)| {
            (
                h.clone(),
                t.iter().copied().filter(|t| t + HOUR > now).collect(),
            )
        })
        .filter(|(_, t): &(String, Vec<u64>)| !t.is_empty())
        .collect();
    for (host, m) in &d.members {
        let changed = state.members.get(host).is_none_or(|p| {
            p.public_key != m.public_key || p.endpoint != m.endpoint || p.port != m.port
        });
        if changed {
            changes.entry(host.clone()).or_default().push(now);
        }
    }
    let next = State {
        members: std::mem::take(&mut d.members),
        changes,
    };
    let changed = next != *state;
    *state = next;

    let mut out = Output::default();
    let answers = answers(config, &state.members);
    let by_entry: BTreeMap<&str, &str> = state
        .members
        .iter()
        .map(|(h, m)| (m.entry.as_str(), h.as_str()))
        .collect();
    for e in entries {
        match d.verdicts.remove(&e.key) {
            Some(Verdict::Refused(why)) => out.refuse(e, why),
            Some(Verdict::Waiting(why)) => out.pending(e, why),
            None => match by_entry.get(e.key.as_str()).and_then(|h| answers.get(*h)) {
                Some(answer) => {
                    let sha = payload_sha256(answer);
                    if e.held.as_deref() == Some(sha.as_str()) {
                        d.counts.kept += 1;
                    } else {
                        d.counts.answered += 1;
                    }
                    out.respond_hashed(e, &sha, || answer.clone());
                }
                None => out.set(e, crate::common::Answer::Nothing),
            },
        }
    }
    if let Some(s) = d.rerun_after {
        out.rerun_within(s);
    }
    (out, d.counts, changed)
}

/// The entries the coordinator's policy refuses, decided as a first run would (no state):
/// what the fleet check holds every member's request against. With other coordinators
/// (`peers`), also a member whose derived address another member's derived address
/// equals, unless one of them is pinned: the coordinators could resolve the collision
/// each its own way, and the member would change address when its need moves.
pub fn vet(
    config: &Config,
    registry: &dyn Registry,
    entries: &[Entry],
    now: u64,
) -> crate::Refusals {
    let d = decide(config, registry, &State::default(), entries, now);
    let mut out: crate::Refusals = d
        .verdicts
        .into_iter()
        .filter_map(|(k, v)| match v {
            Verdict::Refused(why) => Some((k, why)),
            Verdict::Waiting(_) => None,
        })
        .collect();
    if config.peers.is_empty() {
        return out;
    }
    let mut first: BTreeMap<String, Vec<&str>> = BTreeMap::new();
    for host in d.members.keys() {
        let pin = config.addresses.get(host).cloned().unwrap_or_default();
        if let (Some(net), None) = (config.ipv4, pin.ipv4) {
            let a = address::candidate4(&config.name, host, net, 0);
            first.entry(a.to_string()).or_default().push(host);
        }
        if let (Some(net), None) = (config.ipv6, pin.ipv6) {
            let a = address::candidate6(&config.name, host, net, 0);
            first.entry(a.to_string()).or_default().push(host);
        }
    }
    for (a, hosts) in first {
        for later in hosts.iter().skip(1) {
            out.insert(
                d.members[*later].entry.clone(),
                format!(
                    "its derived address {a} is also {}'s, and the mesh has other coordinators, which could each give one of them another; pin one in addresses",
                    hosts[0]
                ),
            );
        }
    }
    out
}
