//! Transport (docs/protocol.md §11.1): what passes between agents is unreadable on the
//! wire, and a client talks only to the key hosts.json lists for the host it means.

use std::process::Command;
use std::time::Duration;

use fort_core::sign::Signer;
use fort_tests::{contains_bytes, eventually, write_key, Fleet, Impostor, Relay};
use serde_json::{json, Value};

/// p serves `oidc`, whose every response carries `secret`; c needs `oidc/wiki` and stores
/// the payload in `<dir>/got`.
fn secret_fleet(secret: &str, plaintext: bool) -> Fleet {
    let mut f = Fleet::new();
    f.plaintext = plaintext;
    let issue = f.script(
        "issue",
        &format!("exec jq -c --arg s {secret} 'with_entries(.value = {{client_secret: $s}})'"),
    );
    let got = f.dir.path().join("got");
    let store = f.script("store", &format!("cat > {}", got.display()));
    f.capability("p", "oidc", json!({"handler": issue, "mode": "async"}));
    f.need(
        "c",
        "oidc/wiki",
        "p",
        json!({"handler": store, "request": {"client_name": "wiki-behind-relay"}}),
    );
    f
}

fn status_of(f: &Fleet, host: &str, need: &str) -> Value {
    f.status(host)["needs"]["items"]
        .as_array()
        .and_then(|a| a.iter().find(|n| n["need"] == need).cloned())
        .unwrap_or(Value::Null)
}

/// Both directions of the fleet's traffic through recording relays: c → p (requests) and
/// p → c (callbacks). Returns what the relays saw once c holds the secret.
async fn traffic_through_relays(secret: &str, plaintext: bool) -> Vec<u8> {
    let mut f = secret_fleet(secret, plaintext);
    f.write_files();
    let to_p = Relay::start("127.0.0.1", f.hosts["p"].addr);
    let to_c = Relay::start("127.0.0.1", f.hosts["c"].addr);
    let scheme = if plaintext { "http" } else { "https" };
    f.edit_hosts_json("c", |h| {
        h["hosts"]["p"]["address"] = json!(format!("{scheme}://{}", to_p.addr))
    });
    f.edit_hosts_json("p", |h| {
        h["hosts"]["c"]["address"] = json!(format!("{scheme}://{}", to_c.addr))
    });
    f.start_host("p");
    f.start_host("c");
    assert!(
        eventually(Duration::from_secs(15), || f.all_satisfied("c")).await,
        "c never got its payload through the relays"
    );
    let got = std::fs::read(f.dir.path().join("got")).unwrap();
    assert!(
        contains_bytes(&got, secret.as_bytes()),
        "c stored the secret"
    );
    let mut seen = to_p.bytes();
    seen.extend(to_c.bytes());
    assert!(seen.len() > 1000, "the relays carried the traffic");
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wire_between_two_agents_holds_no_delivered_secret() {
    let secret = fort_core::client::new_nonce();
    let seen = traffic_through_relays(&secret, false).await;
    for needle in [
        secret.as_str(),
        "client_secret",
        "wiki-behind-relay",
        "X-Fort-",
    ] {
        assert!(
            !contains_bytes(&seen, needle.as_bytes()),
            "{needle:?} is readable on the wire"
        );
    }
    // TLS records (handshake 0x16, application data 0x17), version 0x0303 on the wire.
    assert!(contains_bytes(&seen, &[0x17, 0x03, 0x03]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_plaintext_the_same_relay_reads_the_secret() {
    // The control experiment: the relay is able to see a secret when nothing hides it.
    let secret = fort_core::client::new_nonce();
    let seen = traffic_through_relays(&secret, true).await;
    assert!(contains_bytes(&seen, secret.as_bytes()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_pinned_to_another_key_refuses_and_the_target_gets_no_request() {
    let mut f = secret_fleet("s3cret", false);
    let marker = f.dir.path().join("echo-ran");
    let echo = f.script("echo", &format!("echo run >> {}; cat", marker.display()));
    let ops = f.principal("ops");
    f.capability(
        "p",
        "echo",
        json!({"handler": echo, "mode": "rpc", "allowed": ["ops"]}),
    );
    f.write_files();
    // c's registry (and the operator's) lists a key for p that p does not hold.
    let other = Signer::generate().public_openssh();
    f.edit_hosts_json("c", |h| h["hosts"]["p"]["keys"] = json!([other]));
    f.start_host("p");
    f.start_host("c");
    assert!(
        eventually(Duration::from_secs(10), || {
            status_of(&f, "c", "oidc/wiki")["reason"]
                .as_str()
                .is_some_and(|e| e.contains("not one that hosts.json lists for p"))
        })
        .await,
        "{}",
        status_of(&f, "c", "oidc/wiki")
    );
    assert!(f.entries("p").is_empty(), "p stored a request");
    assert!(!f.all_satisfied("c"));

    let key = f.dir.path().join("ops.key");
    write_key(&key, &ops);
    let out = Command::new(fort_tests::bin("fort"))
        .args(["--origin", "ops", "--key"])
        .arg(&key)
        .arg("--hosts")
        .arg(f.host_dir("c").join("hosts.json"))
        .args(["call", "p", "echo", "{}"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("TLS") && err.contains("lists for p"), "{err}");
    assert!(!marker.exists(), "the rpc handler ran");
    let metrics_free_log = std::fs::read_to_string(f.host_dir("p").join("agent.log")).unwrap();
    assert!(
        !metrics_free_log.contains("request served") && !metrics_free_log.contains("origin=c"),
        "p saw a request from c"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callback_to_an_impostor_is_not_delivered_and_the_record_says_why() {
    let mut f = secret_fleet("t0ps3cret", false);
    f.write_files();
    // p believes c lives where an impostor with another key listens.
    let impostor = Impostor::start("127.0.0.1", "c");
    f.edit_hosts_json("p", |h| {
        h["hosts"]["c"]["address"] = json!(format!("https://{}", impostor.addr))
    });
    f.start_host("p");
    f.start_host("c");
    let delivery_error = || {
        f.read_state("p", "provider-state.json")["entries"]["c:oidc/wiki"]["delivery"]["last_error"]
            .as_str()
            .map(str::to_owned)
    };
    assert!(
        eventually(Duration::from_secs(15), || delivery_error().is_some()).await,
        "no delivery was attempted"
    );
    let why = delivery_error().unwrap();
    assert!(
        why.contains("TLS") && why.contains("not one that hosts.json lists for c"),
        "{why}"
    );
    assert!(
        impostor
            .connections
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0
    );
    assert!(
        impostor.decrypted().is_empty(),
        "the impostor read a request"
    );
    let entry = &f.read_state("p", "provider-state.json")["entries"]["c:oidc/wiki"];
    assert!(entry["delivery"]["delivered_hash"].is_null());
    assert!(!f.all_satisfied("c"));
}
