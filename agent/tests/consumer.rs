//! The consumer side against real agents: nag pacing, backoff and recovery, request
//! changes, checks, never_satisfied, revocations, callback authorisation, concurrency
//! and crash safety of the fulfilment state.

use std::time::Duration;

use fort_tests::{eventually, Fleet};
use serde_json::{json, Value};

/// Provider handler: every entry gets `{"for": key}` unless `<dir>/withhold` exists, in
/// which case every entry gets no response (a revocation for those that had one).
fn provider(f: &mut Fleet, cap: &str) {
    let d = f.dir.path().display().to_string();
    let h = f.script(
        &format!("provide-{cap}"),
        &format!(r#"if [ -e {d}/withhold ]; then jq -c 'with_entries(.value = null)'; else jq -c 'with_entries(.value = {{"for": .key, "request": .value.request}})'; fi"#),
    );
    f.capability("p", cap, json!({"handler": h, "mode": "async"}));
    f.host("p").extra_toml = "[callbacks]\nbackoff = \"200ms\"\n".into();
}

fn receiver(f: &Fleet) -> std::path::PathBuf {
    let d = f.dir.path().display().to_string();
    f.script(
        "receive",
        &format!(r#"mkdir -p {d}/got; cat > {d}/got/$(echo "$FORT_HOST-$FORT_NEED" | tr / _)"#),
    )
}

fn need_status(f: &Fleet, host: &str, need: &str) -> Value {
    let s = f.status(host);
    s["needs"]["items"]
        .as_array()
        .and_then(|a| a.iter().find(|n| n["need"] == need).cloned())
        .unwrap_or(Value::Null)
}

fn satisfied(f: &Fleet, host: &str, need: &str) -> bool {
    need_status(f, host, need)["satisfied"] == true
}

fn fast_consumer(f: &mut Fleet, host: &str) {
    f.host(host).extra_toml = "[fulfill]\nbackoff = \"200ms\"\n".into();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsatisfied_need_is_nagged_at_its_interval() {
    let mut f = Fleet::new();
    provider(&mut f, "cred");
    std::fs::write(f.dir.path().join("withhold"), "").unwrap();
    f.need("c", "cred/x", "p", json!({"nag_seconds": 1}));
    f.start();
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let attempts = need_status(&f, "c", "cred/x")["attempts"].as_u64().unwrap();
    assert!(
        (3..=5).contains(&attempts),
        "{attempts} requests in 3.5 s at a 1 s nag"
    );
    assert!(!satisfied(&f, "c", "cred/x"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_provider_means_backoff_then_recovery_without_waiting_for_the_nag() {
    let mut f = Fleet::new();
    provider(&mut f, "cred");
    fast_consumer(&mut f, "c");
    let recv = receiver(&f);
    f.need(
        "c",
        "cred/x",
        "p",
        json!({"nag_seconds": 120, "handler": recv}),
    );
    f.write_files();
    f.start_host("c");
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let st = need_status(&f, "c", "cred/x");
    let attempts = st["attempts"].as_u64().unwrap();
    // 200 ms doubling: about 0, 0.2, 0.6, 1.4 s … so 3 to 6 tries, not one per 120 s nag.
    assert!((3..=6).contains(&attempts), "{attempts} tries: {st}");
    assert!(st["reason"].as_str().unwrap().contains("connect"), "{st}");
    f.start_host("p");
    assert!(
        eventually(Duration::from_secs(8), || satisfied(&f, "c", "cred/x")).await,
        "did not recover"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_request_is_sent_at_once() {
    let mut f = Fleet::new();
    provider(&mut f, "cred");
    let recv = receiver(&f);
    f.need(
        "c",
        "cred/x",
        "p",
        json!({"nag_seconds": 600, "request": {"v": 1}, "handler": recv}),
    );
    f.start();
    assert!(eventually(Duration::from_secs(10), || satisfied(&f, "c", "cred/x")).await);
    f.host("c").needs.get_mut("cred/x").unwrap()["request"] = json!({"v": 2});
    f.write_files();
    f.agents["c"].hup();
    let got = f.dir.path().join("got/c-cred_x");
    let ok = eventually(Duration::from_secs(10), || {
        std::fs::read(&got)
            .ok()
            .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
            .is_some_and(|v| v["request"]["v"] == 2)
    })
    .await;
    assert!(
        ok,
        "the new request did not reach the provider within seconds (nag is 600 s)"
    );
    assert_eq!(
        f.read_state("p", "provider-state.json")["entries"]["c:cred/x"]["request"],
        json!({"v": 2})
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_check_makes_the_need_unsatisfied_and_re_requested() {
    let mut f = Fleet::new();
    provider(&mut f, "cred");
    let flag = f.dir.path().join("broken");
    let check = f.script("check", &format!("[ ! -e {} ]", flag.display()));
    let recv = receiver(&f);
    f.need(
        "c",
        "cred/x",
        "p",
        json!({"nag_seconds": 1, "check": check, "handler": recv}),
    );
    f.start();
    assert!(eventually(Duration::from_secs(10), || satisfied(&f, "c", "cred/x")).await);
    let requested_before = f.read_state("p", "provider-state.json")["entries"]["c:cred/x"]
        ["requested_at"]
        .as_u64()
        .unwrap();
    std::fs::write(&flag, "").unwrap();
    let seen = eventually(Duration::from_secs(6), || {
        need_status(&f, "c", "cred/x")["reason"]
            .as_str()
            .is_some_and(|e| e.contains("check failed"))
            || f.read_state("p", "provider-state.json")["entries"]["c:cred/x"]["requested_at"]
                .as_u64()
                .unwrap()
                > requested_before
    })
    .await;
    assert!(seen, "the failing check changed nothing");
    std::fs::remove_file(&flag).unwrap();
    assert!(eventually(Duration::from_secs(6), || satisfied(&f, "c", "cred/x")).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn never_satisfied_needs_are_re_requested_every_interval() {
    let mut f = Fleet::new();
    provider(&mut f, "cred");
    f.need(
        "c",
        "cred/x",
        "p",
        json!({"nag_seconds": 1, "never_satisfied": true}),
    );
    f.start();
    tokio::time::sleep(Duration::from_millis(3600)).await;
    let attempts = need_status(&f, "c", "cred/x")["attempts"].as_u64().unwrap();
    assert!(attempts >= 3, "only {attempts} requests");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revocation_unsatisfies_and_the_nag_asks_again() {
    let mut f = Fleet::new();
    provider(&mut f, "cred");
    let recv = receiver(&f);
    f.need(
        "c",
        "cred/x",
        "p",
        json!({"nag_seconds": 1, "handler": recv}),
    );
    f.start();
    assert!(eventually(Duration::from_secs(10), || satisfied(&f, "c", "cred/x")).await);
    std::fs::write(f.dir.path().join("withhold"), "").unwrap();
    let (ok, out) = f.admin("p", &["trigger", "cred"]);
    assert!(ok, "{out}");
    assert!(
        eventually(Duration::from_secs(5), || !satisfied(&f, "c", "cred/x")).await,
        "revocation not applied"
    );
    assert!(need_status(&f, "c", "cred/x")["reason"]
        .as_str()
        .unwrap()
        .contains("revoked"));
    std::fs::remove_file(f.dir.path().join("withhold")).unwrap();
    assert!(
        eventually(Duration::from_secs(6), || satisfied(&f, "c", "cred/x")).await,
        "nag did not re-request"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn side_effect_only_needs_want_ok() {
    let mut f = Fleet::new();
    let d = f.dir.path().display().to_string();
    let h = f.script("proxy", &format!(r#"if [ -e {d}/refuse ]; then jq -c 'with_entries(.value = "upstream unreachable")'; else jq -c 'with_entries(.value = "OK")'; fi"#));
    f.capability("p", "proxy", json!({"handler": h, "mode": "async"}));
    f.need("c", "proxy/site", "p", json!({"nag_seconds": 600}));
    f.start();
    assert!(eventually(Duration::from_secs(10), || satisfied(&f, "c", "proxy/site")).await);
    std::fs::write(f.dir.path().join("refuse"), "").unwrap();
    let (ok, _) = f.admin("p", &["trigger", "proxy"]);
    assert!(ok);
    assert!(eventually(Duration::from_secs(5), || !satisfied(&f, "c", "proxy/site")).await);
    let err = need_status(&f, "c", "proxy/site")["reason"]
        .as_str()
        .unwrap()
        .to_owned();
    // What the provider sent could be a credential meant for another need: its size and
    // hash are told, its bytes are kept nowhere.
    assert!(
        err.contains("20 bytes") && err.contains("instead of OK"),
        "{err}"
    );
    let log = std::fs::read_to_string(f.host_dir("c").join("agent.log")).unwrap();
    assert!(!log.contains("upstream unreachable") && !err.contains("upstream"));
    let state = serde_json::to_string(&f.read_state("c", "fulfillment-state.json")).unwrap();
    assert!(!state.contains("upstream unreachable"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callbacks_from_anyone_but_the_provider_are_refused() {
    let mut f = Fleet::new();
    provider(&mut f, "cred");
    f.host("other");
    f.need("c", "cred/x", "p", json!({"nag_seconds": 600}));
    f.write_files();
    f.start_host("c");
    let before = f.read_state("c", "fulfillment-state.json");
    let r = f
        .post("other", "c", "/agent/needs/cred/x", &json!("OK"))
        .await;
    assert_eq!(r.status, 403);
    assert!(r.verified());
    let r = f
        .post("p", "c", "/agent/needs/cred/nothere", &json!("OK"))
        .await;
    assert_eq!(r.status, 404);
    let after = f.read_state("c", "fulfillment-state.json");
    assert_eq!(
        before["needs"]["cred/x"]["satisfied"],
        after["needs"]["cred/x"]["satisfied"]
    );
    assert!(!satisfied(&f, "c", "cred/x"));
}

/// Posts a raw payload as the provider would (the body bytes are the payload).
async fn callback(f: &Fleet, from: &str, to: &str, need: &str, payload: &[u8]) -> Option<u16> {
    let client = f.client(from);
    let h = &f.hosts[to];
    let address = h.address();
    let keys = h.keys();
    let target = fort_core::client::Target {
        name: to,
        address: &address,
        keys: &keys,
    };
    client
        .post(&target, &format!("/agent/needs/{need}"), payload.to_vec())
        .await
        .ok()
        .map(|r| r.status)
}

fn fifty_needs(f: &mut Fleet) {
    provider(f, "cred");
    // The test plays a provider opening fifty connections at once from one address.
    f.host("c").extra_toml = "max_connections_per_address = 128\n".into();
    for i in 0..50 {
        f.need(
            "c",
            &format!("cred/n{i}"),
            "p",
            json!({"nag_seconds": 3600}),
        );
    }
    f.write_files();
    // Only the consumer runs: the test plays the provider.
    f.start_host("c");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_concurrent_callbacks_all_land() {
    let mut f = Fleet::new();
    fifty_needs(&mut f);
    let f = std::sync::Arc::new(f);
    let tasks: Vec<_> = (0..50)
        .map(|i| {
            let f = f.clone();
            tokio::spawn(async move { callback(&f, "p", "c", &format!("cred/n{i}"), b"OK").await })
        })
        .collect();
    for t in tasks {
        assert_eq!(t.await.unwrap(), Some(200));
    }
    let state = f.read_state("c", "fulfillment-state.json");
    let n = state["needs"]
        .as_object()
        .unwrap()
        .values()
        .filter(|s| s["satisfied"] == true)
        .count();
    assert_eq!(n, 50);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_9_during_callbacks_loses_nothing_acknowledged() {
    let mut f = Fleet::new();
    fifty_needs(&mut f);
    let fa = std::sync::Arc::new(f);
    let tasks: Vec<_> = (0..50)
        .map(|i| {
            let f = fa.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(i * 4)).await;
                (
                    i,
                    callback(&f, "p", "c", &format!("cred/n{i}"), b"OK").await,
                )
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(90)).await;
    let pid = fa.agents["c"].pid();
    // SAFETY-free: kill(1) the process by pid.
    std::process::Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap();
    let mut acked = Vec::new();
    for t in tasks {
        let (i, status) = t.await.unwrap();
        if status == Some(200) {
            acked.push(i);
        }
    }
    let mut f = std::sync::Arc::try_unwrap(fa).ok().expect("sole owner");
    f.kill("c");
    let state = f.read_state("c", "fulfillment-state.json");
    for i in &acked {
        assert_eq!(
            state["needs"][format!("cred/n{i}")]["satisfied"],
            true,
            "acknowledged callback n{i} lost"
        );
    }
    assert!(
        !acked.is_empty() && acked.len() < 50,
        "the kill did not land mid-burst ({} acked)",
        acked.len()
    );
    // And the agent restarts from that file.
    f.start_host("c");
    // Callbacks processed but cut off before their reply may also be there; none of the
    // acknowledged ones may be missing.
    let s = f.status("c");
    assert!(s["needs"]["satisfied"].as_u64().unwrap() as usize >= acked.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twenty_needs_converge_and_survive_a_restart_of_both() {
    let mut f = Fleet::new();
    provider(&mut f, "cred");
    let recv = receiver(&f);
    for i in 0..20 {
        f.need(
            "c",
            &format!("cred/n{i}"),
            "p",
            json!({"nag_seconds": 600, "handler": recv, "request": {"i": i}}),
        );
    }
    f.start();
    let all = |f: &Fleet| f.status("c")["needs"]["satisfied"] == 20;
    assert!(eventually(Duration::from_secs(15), || all(&f)).await);
    f.kill("c");
    f.kill("p");
    let on_disk = f.read_state("c", "fulfillment-state.json");
    assert_eq!(
        on_disk["needs"]
            .as_object()
            .unwrap()
            .values()
            .filter(|n| n["satisfied"] == true)
            .count(),
        20
    );
    f.start_host("p");
    f.start_host("c");
    assert!(eventually(Duration::from_secs(5), || !f.status("c").is_null()).await);
    let s = f.status("c");
    assert_eq!(
        s["needs"]["satisfied"], 20,
        "satisfaction was not kept across the restart"
    );
    // Kept, not re-earned: nothing had to be asked again.
    assert!(
        s["needs"]["items"]
            .as_array()
            .unwrap()
            .iter()
            .all(|n| n["attempts"] == 0),
        "{s}"
    );
    assert_eq!(
        f.status("p")["provider"]["capabilities"]["cred"]["entries"],
        20
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_need_served_by_an_rpc_capability_is_satisfied_by_the_reply() {
    let mut f = Fleet::new();
    let h = f.script(
        "token",
        r#"jq -c '{token: ("t-" + env.FORT_ORIGIN), asked: .}'"#,
    );
    f.capability("p", "token", json!({"handler": h, "mode": "rpc"}));
    let recv = receiver(&f);
    f.need(
        "c",
        "token/git",
        "p",
        json!({"handler": recv, "nag_seconds": 600, "request": {"repo": "x"}}),
    );
    f.start();
    assert!(eventually(Duration::from_secs(10), || satisfied(&f, "c", "token/git")).await);
    let got: Value =
        serde_json::from_slice(&std::fs::read(f.dir.path().join("got/c-token_git")).unwrap())
            .unwrap();
    assert_eq!(got["token"], "t-c");
    assert_eq!(got["asked"]["need"], "token/git");
    // rpc mode keeps no state at the provider.
    assert!(f.read_state("p", "provider-state.json")["entries"]
        .as_object()
        .is_none_or(|m| m.is_empty()));
}

/// A provider stand-in whose timing the test controls: it records every request body,
/// waits `delay`, and answers with the status `answer` gives it, signed as `name`.
fn scripted_provider(
    f: &Fleet,
    name: &'static str,
    delay: Duration,
    answer: impl Fn(&Value) -> u16 + Send + 'static,
) -> std::sync::Arc<std::sync::Mutex<Vec<Value>>> {
    use std::io::{BufRead, Read, Write};
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let listener = std::net::TcpListener::bind(f.hosts[name].addr).unwrap();
    let signer = f.hosts[name].signer.clone();
    let log = seen.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().take(50) {
            let Ok(stream) = stream else { continue };
            let mut reader = std::io::BufReader::new(fort_tests::tls_accept(stream, &signer, name));
            let (mut len, mut nonce) = (0usize, String::new());
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                let lower = line.to_ascii_lowercase();
                if let Some(v) = lower.strip_prefix("content-length:") {
                    len = v.trim().parse().unwrap_or(0);
                }
                if let Some(v) = lower.strip_prefix("x-fort-nonce:") {
                    nonce = v.trim().to_owned();
                }
            }
            let mut body = vec![0u8; len];
            let _ = reader.read_exact(&mut body);
            let value: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            log.lock().unwrap().push(value.clone());
            std::thread::sleep(delay);
            let status = answer(&value);
            let reply = br#"{"status":"accepted"}"#;
            let sig = signer.sign(&fort_core::canonical::response_bytes(
                name, &nonce, status, reply,
            ));
            let s = reader.get_mut();
            let _ = write!(s, "HTTP/1.1 {status} X\r\nContent-Length: {}\r\nX-Fort-Origin: {name}\r\nX-Fort-Signature: {sig}\r\nConnection: close\r\n\r\n", reply.len());
            let _ = s.write_all(reply);
            let _ = s.flush();
            s.conn.send_close_notify();
            let _ = s.flush();
        }
    });
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_changed_while_one_is_in_flight_is_sent_at_once() {
    let mut f = Fleet::new();
    f.host("p");
    f.need(
        "c",
        "cred/x",
        "p",
        json!({"nag_seconds": 600, "request": {"v": 1}}),
    );
    f.write_files();
    let seen = scripted_provider(&f, "p", Duration::from_millis(1500), |_| 202);
    f.start_host("c");
    tokio::time::sleep(Duration::from_millis(300)).await;
    // v1 is in flight (the provider holds it 1.5 s); the request changes meanwhile.
    f.host("c").needs.get_mut("cred/x").unwrap()["request"] = json!({"v": 2});
    f.write_files();
    f.agents["c"].hup();
    let sent_v2 = eventually(Duration::from_secs(6), || {
        seen.lock().unwrap().iter().any(|b| b["request"]["v"] == 2)
    })
    .await;
    assert!(
        sent_v2,
        "v2 waited for the 600 s nag: {:?}",
        seen.lock().unwrap()
    );
    // A callback answering v1 before v2 went out does not satisfy v2: covered by
    // `superseded`; once v2 is out, the provider's answer to it is what counts.
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_release_does_not_delete_a_need_declared_again() {
    let mut f = Fleet::new();
    f.host("p");
    f.need("c", "cred/x", "p", json!({"nag_seconds": 600}));
    f.host("c").extra_toml = "[fulfill]\nbackoff = \"1s\"\n".into();
    f.write_files();
    // Releases are refused (503) at first; requests accepted.
    let seen = scripted_provider(&f, "p", Duration::ZERO, |b| {
        if b["release"] == true {
            503
        } else {
            202
        }
    });
    f.start_host("c");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let spec = f.host("c").needs.remove("cred/x").unwrap();
    f.write_files();
    f.agents["c"].hup();
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Rolled back before the release's retry.
    f.host("c").needs.insert("cred/x".into(), spec);
    f.write_files();
    f.agents["c"].hup();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let releases = seen
        .lock()
        .unwrap()
        .iter()
        .filter(|b| b["release"] == true)
        .count();
    assert_eq!(
        releases,
        1,
        "the release was retried after the need came back: {:?}",
        seen.lock().unwrap()
    );
}

/// Finding: a failing need handler's stderr (which may echo the credential it was given)
/// was stored in the need's `last_error`. It belongs in the log, bounded, and nowhere else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_handler_s_stderr_stays_in_the_log() {
    let mut f = Fleet::new();
    provider(&mut f, "cred");
    let h = f.script(
        "leaky",
        "echo \"could not use $(cat) STDERR-MARK $(head -c 5000 /dev/zero | tr '\\0' y)\" >&2; exit 3",
    );
    f.need(
        "c",
        "cred/x",
        "p",
        json!({"handler": h, "nag_seconds": 600}),
    );
    f.start();
    assert!(
        eventually(Duration::from_secs(10), || {
            need_status(&f, "c", "cred/x")["reason"]
                .as_str()
                .is_some_and(|e| e.contains("exited with code 3"))
        })
        .await
    );
    let err = need_status(&f, "c", "cred/x")["reason"].to_string();
    assert!(!err.contains("STDERR-MARK"), "{err}");
    let state = serde_json::to_string(&f.read_state("c", "fulfillment-state.json")).unwrap();
    assert!(
        !state.contains("STDERR-MARK") && !state.contains("c:cred/x"),
        "{state}"
    );
    let log = std::fs::read_to_string(f.host_dir("c").join("agent.log")).unwrap();
    let line = log
        .lines()
        .find(|l| l.contains("STDERR-MARK"))
        .expect("stderr is logged");
    assert!(
        line.len() < 3000,
        "the logged stderr is bounded ({} bytes)",
        line.len()
    );
}
