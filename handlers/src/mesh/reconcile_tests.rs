//! The mesh's decisions, run by run: joins, rotations and leaves change every other
//! member's answer and nobody's address; a standby derives the same addresses; callers
//! cannot take another member's key or endpoint.

use std::collections::BTreeMap;

use base64::Engine;
use serde_json::{json, Value};

use super::config::Config;
use super::reconcile::{answers, reconcile, vet, Registry, State};
use crate::common::{Answer, Entry, Output};

struct Hosts(BTreeMap<String, Option<String>>);

impl Registry for Hosts {
    fn is_host(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }
    fn host_of(&self, name: &str) -> Option<String> {
        self.0.get(name).cloned().flatten()
    }
    fn host_names(&self) -> Vec<String> {
        self.0.keys().cloned().collect()
    }
}

fn hosts(names: &[&str]) -> Hosts {
    Hosts(
        names
            .iter()
            .enumerate()
            .map(|(i, n)| ((*n).to_owned(), Some(format!("192.0.2.{}", i + 1))))
            .collect(),
    )
}

fn config(extra: Value) -> Config {
    let mut c = json!({"name": "office", "state_file": "/unused", "ipv4": "10.77.0.0/16",
                       "ipv6": "fd77:77::/64"});
    for (k, v) in extra.as_object().unwrap() {
        c[k] = v.clone();
    }
    serde_json::from_value(c).unwrap()
}

fn key(n: u8) -> String {
    base64::engine::general_purpose::STANDARD.encode([n; 32])
}

fn entry(host: &str, request: Value) -> Entry {
    crate::common::parse_input(
        json!({format!("{host}:mesh/wg0"): {"request": request}})
            .to_string()
            .as_bytes(),
    )
    .unwrap()
    .remove(0)
}

/// Entries as the agent gives them after `out`: each holding the hash of its answer.
fn holding(mut entries: Vec<Entry>, out: &Output) -> Vec<Entry> {
    for e in &mut entries {
        e.held = match out.answers.get(&e.key) {
            Some(Answer::Response(v)) => Some(crate::common::entries::payload_sha256(v)),
            Some(Answer::Keep(h)) => Some(h.clone()),
            _ => e.held.clone(),
        };
    }
    entries
}

fn response<'a>(out: &'a Output, host: &str) -> &'a Value {
    match out.answers.get(&format!("{host}:mesh/wg0")) {
        Some(Answer::Response(v)) => v,
        other => panic!("{host}: {other:?}"),
    }
}

fn peer_keys(v: &Value) -> BTreeMap<String, String> {
    v["peers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["host"].as_str().unwrap().to_owned(),
                p["public_key"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

#[test]
fn joins_rotations_and_leaves_reach_every_other_member_and_addresses_stay() {
    let c = config(json!({"persistent_keepalive": 25}));
    let reg = hosts(&["a", "b", "c", "d"]);
    let mut state = State::default();
    let three: Vec<Entry> = (1..=3u8)
        .map(|i| {
            entry(
                ["a", "b", "c"][i as usize - 1],
                json!({"public_key": key(i)}),
            )
        })
        .collect();
    let (out, counts, changed) = reconcile(&c, &reg, &mut state, &three, 100);
    assert!(changed);
    assert_eq!((counts.members, counts.joined), (3, 3));
    let a = response(&out, "a");
    assert_eq!(a["role"], "member");
    assert_eq!(a["public_key"], key(1));
    assert_eq!(a["listen_port"], 51820);
    assert!(a["ipv4"].as_str().unwrap().starts_with("10.77."));
    assert!(a["ipv4"].as_str().unwrap().ends_with("/16"));
    assert!(a["ipv6"].as_str().unwrap().ends_with("/64"));
    assert_eq!(
        peer_keys(a),
        BTreeMap::from([("b".into(), key(2)), ("c".into(), key(3))])
    );
    let b_as_peer = &a["peers"][0];
    assert_eq!(b_as_peer["endpoint"], "192.0.2.2:51820");
    assert_eq!(b_as_peer["persistent_keepalive"], 25);
    let b_addr = response(&out, "b")["ipv4"]
        .as_str()
        .unwrap()
        .replace("/16", "/32");
    assert_eq!(b_as_peer["allowed_ips"][0], b_addr);
    let addresses = |s: &State| -> BTreeMap<String, (String, String)> {
        s.members
            .iter()
            .map(|(h, m)| {
                (
                    h.clone(),
                    (m.ipv4.unwrap().to_string(), m.ipv6.unwrap().to_string()),
                )
            })
            .collect()
    };
    let before = addresses(&state);

    // Nothing changed: every answer is kept by its hash, and the state is not written.
    let held = holding(three.clone(), &out);
    let (out, counts, changed) = reconcile(&c, &reg, &mut state, &held, 200);
    assert!(!changed);
    assert_eq!((counts.kept, counts.answered), (3, 0));
    assert!(out.answers.values().all(|a| matches!(a, Answer::Keep(_))));

    // d joins: every other member's answer changes (one callback each), and d has three
    // peers; nobody else's address moves.
    let mut four = held.clone();
    four.push(entry("d", json!({"public_key": key(4)})));
    let (out, counts, _) = reconcile(&c, &reg, &mut state, &four, 300);
    assert_eq!((counts.joined, counts.answered, counts.kept), (1, 4, 0));
    for h in ["a", "b", "c"] {
        assert_eq!(peer_keys(response(&out, h))["d"], key(4));
    }
    assert_eq!(peer_keys(response(&out, "d")).len(), 3);
    let mut after = addresses(&state);
    let d = after.remove("d").unwrap();
    assert_eq!(after, before);
    assert!(!before.values().any(|v| v.0 == d.0 || v.1 == d.1));

    // b rotates its key: its address stays; every other member hears the new key.
    let mut rotated = holding(four, &out);
    rotated[1] = entry("b", json!({"public_key": key(9)}));
    let (out, counts, _) = reconcile(&c, &reg, &mut state, &rotated, 400);
    assert_eq!(counts.changed, 1);
    assert_eq!(response(&out, "b")["public_key"], key(9));
    for h in ["a", "c", "d"] {
        assert_eq!(peer_keys(response(&out, h))["b"], key(9));
    }
    assert_eq!(state.members["b"].key_since, 400);
    assert_eq!(state.members["b"].joined_at, 100);
    assert_eq!(addresses(&state)["b"], before["b"]);

    // c leaves: gone from every answer and from the state.
    let mut left = holding(rotated, &out);
    left.remove(2);
    let (out, counts, _) = reconcile(&c, &reg, &mut state, &left, 500);
    assert_eq!(counts.left, 1);
    for h in ["a", "b", "d"] {
        assert!(!peer_keys(response(&out, h)).contains_key("c"));
    }
    assert!(!state.members.contains_key("c"));

    // A restart reads the state back: the same answers.
    let saved: State = serde_json::from_str(&serde_json::to_string(&state).unwrap()).unwrap();
    assert_eq!(saved, state);
    // A standby that never saw the mesh derives the same address for every member.
    let mut standby = State::default();
    reconcile(&c, &reg, &mut standby, &left, 600);
    assert_eq!(addresses(&standby), addresses(&state));
}

#[test]
fn nobody_takes_another_members_key_or_endpoint() {
    let c = config(json!({"endpoints": {"b": ["192.0.2.1", "b.example.org"]}}));
    let mut reg = hosts(&["a", "b", "c"]);
    reg.0.insert("nowhere".into(), None);
    let mut state = State::default();
    let a = entry("a", json!({"public_key": key(1)}));
    reconcile(&c, &reg, &mut state, std::slice::from_ref(&a), 100);
    let a_before = state.members["a"].clone();
    let cases = [
        (
            entry("b", json!({"public_key": key(1)})),
            "the public key is a's",
        ),
        (
            entry("b", json!({"public_key": key(2), "endpoint": "192.0.2.1"})),
            "endpoint 192.0.2.1 is a's address in hosts.json",
        ),
        (
            entry(
                "c",
                json!({"public_key": key(3), "endpoint": "b.example.org"}),
            ),
            "not one c may claim",
        ),
        (
            entry("ops", json!({"public_key": key(4)})),
            "not a host of hosts.json",
        ),
        (
            entry("nowhere", json!({"public_key": key(5)})),
            "no address in hosts.json",
        ),
        (
            entry("c", json!({"public_key": key(6), "address": "10.77.0.1"})),
            "unknown field",
        ),
    ];
    for (e, says) in cases {
        let mut s = state.clone();
        let (out, _, _) = reconcile(&c, &reg, &mut s, &[a.clone(), e.clone()], 200);
        match out.answers.get(&e.key) {
            Some(Answer::Refused(why)) => assert!(why.contains(says), "{}: {why}", e.key),
            other => panic!("{}: {other:?}", e.key),
        }
        assert_eq!(s.members["a"], a_before, "{}", e.key);
        assert!(!s.members.contains_key(&e.origin), "{}", e.key);
    }
    // b may claim the other endpoint its allowance names, on a port of its own.
    let b = entry(
        "b",
        json!({"public_key": key(2), "endpoint": "b.example.org", "port": 51900}),
    );
    let (out, _, _) = reconcile(&c, &reg, &mut state, &[a.clone(), b.clone()], 300);
    assert_eq!(peer_keys(response(&out, "a"))["b"], key(2));
    assert_eq!(
        response(&out, "a")["peers"][0]["endpoint"],
        "b.example.org:51900"
    );
    assert_eq!(response(&out, "b")["listen_port"], 51900);
    // A second need of one host in the mesh is refused.
    let mut again = entry("b", json!({"public_key": key(7)}));
    again.key = "b:mesh/wg1".into();
    let (out, _, _) = reconcile(&c, &reg, &mut state, &[a, b, again], 400);
    match &out.answers["b:mesh/wg1"] {
        Answer::Refused(why) => assert!(why.contains("already a member"), "{why}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_refused_change_keeps_the_membership_it_had() {
    let c = config(json!({}));
    let reg = hosts(&["a", "b"]);
    let mut state = State::default();
    let first = [
        entry("a", json!({"public_key": key(1)})),
        entry("b", json!({"public_key": key(2)})),
    ];
    reconcile(&c, &reg, &mut state, &first, 100);
    // b asks with a's key: refused, and a still sees b with the key it had.
    let changed = [first[0].clone(), entry("b", json!({"public_key": key(1)}))];
    let (out, _, _) = reconcile(&c, &reg, &mut state, &changed, 200);
    match &out.answers["b:mesh/wg0"] {
        Answer::Refused(why) => {
            assert!(
                why.contains("is a's") && why.contains("stays a member"),
                "{why}"
            )
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(peer_keys(response(&out, "a"))["b"], key(2));
}

#[test]
fn spokes_see_the_hubs_and_the_first_hub_routes_the_mesh() {
    let c = config(json!({"topology": "hub-and-spoke", "hubs": ["h1", "h2"],
                          "addresses": {"h1": {"ipv4": "10.77.0.1", "ipv6": "fd77:77::1"}}}));
    let reg = hosts(&["h1", "h2", "s1", "s2"]);
    let mut state = State::default();
    let entries: Vec<Entry> = ["h1", "h2", "s1", "s2"]
        .iter()
        .enumerate()
        .map(|(i, h)| entry(h, json!({"public_key": key(i as u8 + 1)})))
        .collect();
    let (out, _, _) = reconcile(&c, &reg, &mut state, &entries, 100);
    let s1 = response(&out, "s1");
    assert_eq!(s1["role"], "spoke");
    assert_eq!(
        peer_keys(s1).keys().collect::<Vec<_>>(),
        ["h1", "h2"],
        "a spoke sees only the hubs"
    );
    assert_eq!(
        s1["peers"][0]["allowed_ips"],
        json!([
            "10.77.0.1/32",
            "fd77:77::1/128",
            "10.77.0.0/16",
            "fd77:77::/64"
        ])
    );
    assert_eq!(s1["peers"][1]["allowed_ips"].as_array().unwrap().len(), 2);
    let h2 = response(&out, "h2");
    assert_eq!(h2["role"], "hub");
    assert_eq!(peer_keys(h2).len(), 3, "a hub sees everyone");
    assert_eq!(response(&out, "h1")["ipv4"], "10.77.0.1/16", "pinned");
}

#[test]
fn a_member_changing_without_end_waits() {
    let c = config(json!({"max_changes_per_member_per_hour": 3}));
    let reg = hosts(&["a", "b"]);
    let mut state = State::default();
    let b = entry("b", json!({"public_key": key(200)}));
    for (i, t) in [100u64, 200, 300].iter().enumerate() {
        let a = entry("a", json!({"public_key": key(i as u8 + 1)}));
        let (out, _, _) = reconcile(&c, &reg, &mut state, &[a, b.clone()], *t);
        assert!(matches!(out.answers["a:mesh/wg0"], Answer::Response(_)));
    }
    // The fourth change within the hour waits; a keeps the key it had, b sees that one.
    let a = entry("a", json!({"public_key": key(4)}));
    let (out, _, _) = reconcile(&c, &reg, &mut state, &[a.clone(), b.clone()], 400);
    match &out.answers["a:mesh/wg0"] {
        Answer::Pending(why) => assert!(why.contains("3 changes of a's"), "{why}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(out.rerun_after, Some(3600 - 300));
    assert_eq!(peer_keys(response(&out, "b"))["a"], key(3));
    // An hour after the first, it is made.
    let (out, _, _) = reconcile(&c, &reg, &mut state, &[a, b], 3700);
    assert_eq!(peer_keys(response(&out, "b"))["a"], key(4));
}

#[test]
fn collisions_move_on_and_the_fleet_check_asks_for_a_pin_when_there_are_standbys() {
    // A small prefix, where derived addresses collide among a few dozen hosts.
    let c = config(json!({"ipv4": "10.0.0.0/28", "ipv6": null, "max_members": 2}));
    let names: Vec<String> = (0..40).map(|i| format!("h{i}")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let reg = hosts(&refs);
    // Find two hosts whose first candidates collide.
    let net = c.ipv4.unwrap();
    let mut seen = BTreeMap::new();
    let (x, y) = names
        .iter()
        .find_map(|n| {
            let a = super::address::candidate4("office", n, net, 0);
            seen.insert(a, n.clone()).map(|other| (other, n.clone()))
        })
        .unwrap();
    let entries = [
        entry(&x, json!({"public_key": key(1)})),
        entry(&y, json!({"public_key": key(2)})),
    ];
    let mut state = State::default();
    let (out, _, _) = reconcile(&c, &reg, &mut state, &entries, 100);
    assert_ne!(state.members[&x].ipv4, state.members[&y].ipv4);
    assert!(matches!(out.answers[&entries[1].key], Answer::Response(_)));
    assert!(vet(&c, &reg, &entries, 100).is_empty(), "one coordinator");
    let mut with_peers = config(
        json!({"ipv4": "10.0.0.0/28", "ipv6": null, "max_members": 2,
                                       "peers": ["standby"]}),
    );
    let refused = vet(&with_peers, &reg, &entries, 100);
    assert!(
        refused[&entries[1].key].contains("pin one in addresses"),
        "{refused:?}"
    );
    with_peers.addresses.insert(
        y.clone(),
        super::config::Pinned {
            ipv4: Some("10.0.0.6".parse().unwrap()),
            ipv6: None,
        },
    );
    assert!(vet(&with_peers, &reg, &entries, 100).is_empty());
    // A third member does not fit: max_members.
    let third = entry(&names[39], json!({"public_key": key(3)}));
    let (out, _, _) = reconcile(
        &c,
        &reg,
        &mut state,
        &[entries[0].clone(), entries[1].clone(), third.clone()],
        200,
    );
    match &out.answers[&third.key] {
        Answer::Refused(why) => assert!(why.contains("max_members"), "{why}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn answers_expire_with_the_key_lifetime() {
    let c = config(json!({"key_lifetime": "1h"}));
    let reg = hosts(&["a"]);
    let mut state = State::default();
    reconcile(
        &c,
        &reg,
        &mut state,
        &[entry("a", json!({"public_key": key(1)}))],
        1000,
    );
    assert_eq!(answers(&c, &state.members)["a"]["expires_at"], 4600);
}

/// A wildcard in `endpoints` may match other hosts' addresses: no member claims one, on
/// any port, before or after that host joins, nor keeps one it holds.
#[test]
fn no_member_claims_another_hosts_address_whatever_its_allowance() {
    let c = config(json!({"endpoints": {"*": ["*.lan", "::ffff:192.0.2.1", "shared.nat"]}}));
    let mut reg = hosts(&["a", "b", "c", "d"]);
    reg.0.insert("named".into(), Some("Named.lan".into()));
    let mut state = State::default();
    for (asked, port, says) in [
        (
            "named.lan",
            51820,
            "named.lan is named's address in hosts.json",
        ),
        ("NAMED.lan", 51999, "is named's address in hosts.json"),
        ("::ffff:192.0.2.1", 51900, "is a's address in hosts.json"),
    ] {
        let b = entry(
            "b",
            json!({"public_key": key(2), "endpoint": asked, "port": port}),
        );
        let mut s = state.clone();
        let (out, _, _) = reconcile(&c, &reg, &mut s, std::slice::from_ref(&b), 100);
        match out.answers.get(&b.key) {
            Some(Answer::Refused(why)) => assert!(why.contains(says), "{asked}: {why}"),
            other => panic!("{asked}: {other:?}"),
        }
        assert!(s.members.is_empty(), "{asked}");
    }
    // An endpoint the allowance names that is no host's: two members behind one NAT
    // share it on ports of their own.
    let behind_nat = [
        entry(
            "c",
            json!({"public_key": key(3), "endpoint": "shared.nat", "port": 51830}),
        ),
        entry(
            "d",
            json!({"public_key": key(4), "endpoint": "shared.nat", "port": 51840}),
        ),
    ];
    let (out, counts, _) = reconcile(&c, &reg, &mut state, &behind_nat, 100);
    assert_eq!(
        (counts.members, counts.refused),
        (2, 0),
        "{:?}",
        out.answers
    );

    // A member that holds another host's address (recorded by an earlier release) loses
    // its membership, and that host joins with its own address.
    let mut held = state.clone();
    let mut taken = held.members["c"].clone();
    taken.endpoint = "named.lan:51820".into();
    held.members.insert("c".into(), taken);
    let mut both = behind_nat.to_vec();
    both[0] = entry("c", json!({"public_key": key(3), "endpoint": "named.lan"}));
    both.push(entry("named", json!({"public_key": key(5)})));
    let (out, _, _) = reconcile(&c, &reg, &mut held, &both, 200);
    match out.answers.get("c:mesh/wg0") {
        Some(Answer::Refused(why)) => {
            assert!(
                why.contains("named's address") && !why.contains("stays"),
                "{why}"
            )
        }
        other => panic!("{other:?}"),
    }
    assert!(!held.members.contains_key("c"));
    assert_eq!(held.members["named"].endpoint, "named.lan:51820");
    assert_eq!(
        response(&out, "named")["peers"][0]["endpoint"],
        "shared.nat:51840"
    );
}
