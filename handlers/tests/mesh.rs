//! `mesh` between real agents on loopback and real WireGuard: each member's interface is
//! a `wireguard-go` in a network namespace of its own, the namespaces joined by a bridge
//! (tests/src/wireguard.rs), so a ping between tunnel addresses crosses the tunnels. The
//! agents run on 127.0.0.x; each member's need makes its key (`wireguard`), and its
//! handler applies the answer inside the member's namespace (`fort-handler mesh-wg`).
//!
//! Three members reach each other; a caller claiming another member's key or endpoint is
//! refused and changes nothing; a fourth joins and everyone reaches it within one nag
//! interval, no tunnel among the first three re-keyed (`wg show` handshakes unchanged); a
//! member whose key was lost comes back with a new one and the others follow; a removed
//! member is unreachable; the coordinator restarted (and run forced) and then replaced
//! by its standby gives every member the addresses it had.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use fort_tests::wireguard::{can_run, Member, Underlay};
use fort_tests::{bin, eventually, Fleet};
use serde_json::{json, Value};

const NAG: u64 = 10;
const FAILOVER_AFTER: u64 = 4;
const MEMBERS: [&str; 4] = ["m1", "m2", "m3", "m4"];

fn schema() -> Value {
    let schemas: Value = serde_json::from_slice(
        &std::fs::read(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../nixos-module/tests/expected/schemas.json"),
        )
        .unwrap(),
    )
    .unwrap();
    schemas["schemas"]["mesh"].clone()
}

/// `host` coordinates the mesh `test`; members may claim their underlay address.
fn coordinator(f: &mut Fleet, host: &str, peers: &[&str]) -> PathBuf {
    let dir = f.dir.path().join(format!("{host}-mesh"));
    let config = f.dir.path().join(format!("{host}-mesh.json"));
    let endpoints: serde_json::Map<String, Value> = MEMBERS
        .iter()
        .enumerate()
        .map(|(i, m)| ((*m).to_owned(), json!([format!("198.18.0.{}", i + 1)])))
        .collect();
    std::fs::write(
        &config,
        json!({
            "name": "test",
            "state_file": dir.join("state.json"),
            "hosts_file": f.host_dir(host).join("hosts.json"),
            "ipv4": "10.77.0.0/16",
            "ipv6": "fd77:77::/64",
            "endpoints": endpoints,
            "peers": peers,
        })
        .to_string(),
    )
    .unwrap();
    f.capability(
        host,
        "mesh",
        json!({"handler": bin("fort-handler"), "args": ["mesh", "--config", config],
               "mode": "async", "request_schema": schema()}),
    );
    f.host(host).extra_toml =
        "[gc]\ninterval = \"0s\"\ngrace = \"1s\"\ntimeout = \"3s\"\n[callbacks]\nbackoff = \"1s\"\n"
            .into();
    dir.join("state.json")
}

/// Where a member's key and answer land.
fn wg_dir(f: &Fleet, host: &str) -> PathBuf {
    f.dir.path().join(format!("{host}-wg"))
}

/// `host`'s membership, from `[c1, c2]`: its key made by its agent, its answer applied to
/// its interface in its namespace, asked again every nag interval (so it moves to the
/// standby when the coordinator is gone).
fn member(f: &mut Fleet, host: &str, wg: &Member) {
    let dir = wg_dir(f, host);
    let handler = f.script(
        &format!("{host}-mesh-wg"),
        &format!(
            "exec ip netns exec {} {} mesh-wg --interface {} --private-key {}",
            wg.netns,
            bin("fort-handler").display(),
            wg.interface,
            dir.join("private.key").display()
        ),
    );
    f.need_from(
        host,
        "mesh/wg0",
        &["c1", "c2"],
        json!({
            "request": {"public_key": {"$fort_key": "wg"}, "endpoint": wg.underlay, "port": 51820},
            "nag_seconds": NAG,
            "never_satisfied": true,
            "failover_after_seconds": FAILOVER_AFTER,
            "keys": {"wg": {"type": "wireguard", "path": dir.join("private.key"),
                            "certificate": "/public_key"}},
            "files": [{"name": "answer", "path": dir.join("answer.json"), "pointer": ""}],
            "handler": handler,
        }),
    );
    f.host(host).extra_toml = "[fulfill]\nbackoff = \"1s\"\ntimeout = \"3s\"\n".into();
}

/// The answer `host` applied last.
fn answer(f: &Fleet, host: &str) -> Value {
    std::fs::read(wg_dir(f, host).join("answer.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or(Value::Null)
}

/// `host`'s tunnel addresses (without the prefix length), from its answer.
fn addresses(f: &Fleet, host: &str) -> (String, String) {
    let a = answer(f, host);
    let strip = |v: &Value| {
        v.as_str()
            .unwrap_or("")
            .split('/')
            .next()
            .unwrap()
            .to_owned()
    };
    (strip(&a["ipv4"]), strip(&a["ipv6"]))
}

fn index(host: &str) -> u8 {
    host[1..].parse().unwrap()
}

/// What each member's interface and answer hold, for a failing assertion.
fn describe(net: &Underlay, f: &Fleet, hosts: &[&str]) -> String {
    hosts
        .iter()
        .map(|h| {
            let m = net.get(index(h));
            format!(
                "{h}: key {} peers {:?} handshakes {:?}\n  answer {}\n  need {}\n{}",
                m.public_key(),
                m.peers(),
                m.handshakes(),
                answer(f, h),
                f.need_status(h, "mesh/wg0"),
                m.log_tail(40)
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// What keeps the members in `hosts` from reaching each other now: a peer missing from
/// an interface (by the key the other's interface uses), or a tunnel address a ping does
/// not cross. Every pair is tried, so each one's handshake starts in the same round.
fn unreached(net: &Underlay, f: &Fleet, hosts: &[&str]) -> Vec<String> {
    let keys: BTreeMap<&str, String> = hosts
        .iter()
        .map(|h| (*h, net.get(index(h)).public_key()))
        .collect();
    let mut missing = Vec::new();
    let mut pings = Vec::new();
    for h in hosts {
        let peers = net.get(index(h)).peers();
        if peers.len() != hosts.len() - 1 {
            missing.push(format!("{h} has {} peers", peers.len()));
        }
        for o in hosts.iter().filter(|o| *o != h) {
            if keys[o].is_empty() || !peers.contains(&keys[o]) {
                missing.push(format!("{h} lacks {o}'s key"));
                continue;
            }
            let (v4, v6) = addresses(f, o);
            for a in [v4, v6] {
                let started = net.get(index(h)).start_ping(&a).ok();
                pings.push((format!("{h} does not reach {o} at {a}"), started));
            }
        }
    }
    for (why, child) in pings {
        if !child.is_some_and(|mut c| c.wait().is_ok_and(|s| s.success())) {
            missing.push(why);
        }
    }
    missing
}

/// Waits until every member in `hosts` has every other as a peer and reaches it over
/// the tunnel; `Err` says what was still missing at the end.
async fn all_reach(
    net: &Underlay,
    f: &Fleet,
    hosts: &[&str],
    within: Duration,
) -> Result<(), String> {
    let mut last = Vec::new();
    let ok = eventually(within, || {
        last = unreached(net, f, hosts);
        last.is_empty()
    })
    .await;
    if ok {
        Ok(())
    } else {
        Err(format!("{}\n{}", last.join("; "), describe(net, f, hosts)))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mesh_of_real_tunnels_follows_joins_rotations_leaves_and_a_failover() {
    let test = "mesh::a_mesh_of_real_tunnels_follows_joins_rotations_leaves_and_a_failover";
    if !can_run(test) {
        return;
    }
    let mut f = Fleet::new();
    let mut net = Underlay::new();
    let c1_state = coordinator(&mut f, "c1", &["c2"]);
    coordinator(&mut f, "c2", &["c1"]);
    for (i, m) in MEMBERS.iter().enumerate() {
        net.member(i as u8 + 1, f.dir.path());
        member(&mut f, m, net.get(i as u8 + 1));
    }
    f.host("evil");
    f.write_files();
    for h in ["c1", "m1", "m2", "m3"] {
        f.start_host(h);
    }

    // Three members reach each other over IPv4 and IPv6 in the tunnel.
    let first = ["m1", "m2", "m3"];
    if let Err(why) = all_reach(&net, &f, &first, Duration::from_secs(60)).await {
        panic!("the first three do not reach each other: {why}");
    }
    let (a1, _) = addresses(&f, "m1");
    assert!(a1.starts_with("10.77."), "{a1}");

    // A caller cannot take another member's key or endpoint, nor name an address.
    let m1_key = net.get(1).public_key();
    let refusals = [
        (
            json!({"public_key": m1_key, "endpoint": null}),
            "the public key is m1's",
        ),
        (
            json!({"public_key": "TrMvSoP4jYQlY6RIzBgbssQqY3vxI2Pi+y71lOWWXX0=", "endpoint": "198.18.0.1"}),
            "endpoint 198.18.0.1 is not one evil may claim",
        ),
        (
            json!({"public_key": "TrMvSoP4jYQlY6RIzBgbssQqY3vxI2Pi+y71lOWWXX0=", "address": "10.77.0.1"}),
            "400",
        ),
    ];
    f.need(
        "evil",
        "mesh/wg0",
        "c1",
        json!({"request": {"public_key": m1_key}, "nag_seconds": 2}),
    );
    f.host("evil").extra_toml = "[fulfill]\nbackoff = \"1s\"\ntimeout = \"3s\"\n".into();
    f.write_files();
    f.agents["c1"].hup();
    f.start_host("evil");
    for (request, says) in refusals {
        f.host("evil").needs.get_mut("mesh/wg0").unwrap()["request"] = request.clone();
        f.write_files();
        f.agents["evil"].hup();
        let refused = eventually(Duration::from_secs(20), || {
            f.need_status("evil", "mesh/wg0")["reason"]
                .as_str()
                .is_some_and(|r| r.contains(says))
        })
        .await;
        assert!(refused, "{request}: {}", f.need_status("evil", "mesh/wg0"));
    }
    for h in first {
        let peers = &answer(&f, h)["peers"];
        assert_eq!(peers.as_array().unwrap().len(), 2, "{h}: {peers}");
        assert!(!peers.to_string().contains("evil"), "{h}: {peers}");
    }
    assert!(answer(&f, "m2")["peers"].to_string().contains(&m1_key));
    f.stop("evil");

    // A fourth joins: everyone reaches it within one nag interval, and no tunnel among
    // the first three is re-keyed (their latest handshakes stay what they were).
    let handshakes: Vec<BTreeMap<String, u64>> = (1..=3).map(|i| net.get(i).handshakes()).collect();
    for (i, h) in handshakes.iter().enumerate() {
        assert_eq!(h.len(), 2, "m{}: {h:?}", i + 1);
        assert!(h.values().all(|t| *t > 0), "m{}: {h:?}", i + 1);
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let joined = Instant::now();
    f.start_host("m4");
    if let Err(why) = all_reach(&net, &f, &MEMBERS, Duration::from_secs(NAG)).await {
        panic!("m4 not reached by everyone within {NAG} s: {why}");
    }
    eprintln!("m4 reached by every member in {:?}", joined.elapsed());
    let m4_key = net.get(4).public_key();
    for (i, before) in handshakes.iter().enumerate() {
        let now: BTreeMap<String, u64> = net
            .get(i as u8 + 1)
            .handshakes()
            .into_iter()
            .filter(|(k, _)| *k != m4_key)
            .collect();
        assert_eq!(
            &now,
            before,
            "m{}: a tunnel among the first three was re-keyed",
            i + 1
        );
    }

    // m2 loses its key (as a reboot empties /run): it asks with a new one, keeps its
    // address, and every other member follows.
    let m2_addresses = addresses(&f, "m2");
    let old = net.get(2).public_key();
    f.stop("m2");
    std::fs::remove_file(wg_dir(&f, "m2").join("private.key")).unwrap();
    f.start_host("m2");
    assert!(
        eventually(Duration::from_secs(30), || {
            let new = net.get(2).public_key();
            new != old
                && [1u8, 3, 4].iter().all(|i| {
                    let peers = net.get(*i).peers();
                    peers.contains(&new) && !peers.contains(&old)
                })
        })
        .await,
        "the others did not follow m2's new key: {}",
        answer(&f, "m1")
    );
    if let Err(why) = all_reach(&net, &f, &MEMBERS, Duration::from_secs(20)).await {
        panic!("after m2's new key: {why}");
    }
    assert_eq!(addresses(&f, "m2"), m2_addresses);

    // m3 leaves: released at the coordinator, gone from every other member, unreachable.
    let m3_key = net.get(3).public_key();
    let (m3_v4, m3_v6) = addresses(&f, "m3");
    f.host("m3").needs.clear();
    f.write_files();
    f.agents["m3"].hup();
    let rest = ["m1", "m2", "m4"];
    assert!(
        eventually(Duration::from_secs(30), || rest
            .iter()
            .all(|h| !net.get(index(h)).peers().contains(&m3_key)))
        .await,
        "m3 is still a peer: {}",
        answer(&f, "m1")
    );
    for h in rest {
        let m = net.get(index(h));
        assert!(!m.ping(&m3_v4) && !m.ping(&m3_v6), "{h} still reaches m3");
    }
    if let Err(why) = all_reach(&net, &f, &rest, Duration::from_secs(10)).await {
        panic!("after m3 left: {why}");
    }

    // The coordinator restarted, and run with no answer kept: every address stays.
    let before: BTreeMap<&str, (String, String)> =
        rest.iter().map(|h| (*h, addresses(&f, h))).collect();
    let state_before = members_of(&c1_state);
    f.kill("c1");
    f.start_host("c1");
    let (ok, out) = f.admin("c1", &["trigger", "mesh", "--force"]);
    assert!(ok, "{out}");
    assert_eq!(members_of(&c1_state), state_before);
    for h in rest {
        assert_eq!(
            addresses(&f, h),
            before[h],
            "{h} after the coordinator's restart"
        );
    }

    // The coordinator is gone for good: every member moves to the standby, which gives
    // each the addresses it had, and they reach each other again.
    f.start_host("c2");
    f.kill("c1");
    assert!(
        eventually(Duration::from_secs(90), || rest.iter().all(|h| {
            f.need_status(h, "mesh/wg0")["from"] == "c2"
                && answer(&f, h)["peers"].as_array().map(Vec::len) == Some(2)
        }))
        .await,
        "not every member moved to c2: {}",
        f.need_status("m1", "mesh/wg0")
    );
    if let Err(why) = all_reach(&net, &f, &rest, Duration::from_secs(30)).await {
        panic!("after the failover: {why}");
    }
    for h in rest {
        assert_eq!(addresses(&f, h), before[h], "{h} after the failover");
    }
}

/// The members a coordinator's state records, with their addresses.
fn members_of(state: &Path) -> BTreeMap<String, (Value, Value)> {
    let v: Value = serde_json::from_slice(&std::fs::read(state).unwrap()).unwrap();
    v["state"]["members"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(h, m)| (h.clone(), (m["ipv4"].clone(), m["ipv6"].clone())))
        .collect()
}
