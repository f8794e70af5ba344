//! Responses kept without printing them again (docs/protocol.md §11.11), with real agents:
//! the handler's input names the hash of the response each entry holds; `$fort_keep` with
//! that hash keeps it (and ends a verdict); with another hash it changes nothing; a forced
//! run names no hash.

use std::time::Duration;

use fort_core::canonical::sha256_hex;
use fort_tests::{eventually, Fleet};
use serde_json::{json, Value};

/// A provider handler (no `cacheResponse`) that keeps its last input in `<dir>/input`,
/// counts runs in `<dir>/runs` and answers as `<dir>/mode` says: `answer` prints
/// `<dir>/answer` for every entry, `keep` prints `$fort_keep` with the entry's `held`,
/// `other` prints `$fort_keep` with a hash no entry holds.
fn provider(f: &mut Fleet) {
    let d = f.dir.path().display().to_string();
    let h = f.script(
        "provide",
        &format!(
            r#"echo run >> {d}/runs; cat > {d}/input
case $(cat {d}/mode) in
  answer) jq -c --argjson a "$(cat {d}/answer)" 'with_entries(.value = $a)' {d}/input ;;
  keep) jq -c 'with_entries(.value = {{"$fort_keep": .value.held}})' {d}/input ;;
  other) jq -c 'with_entries(.value = {{"$fort_keep": "00"}})' {d}/input ;;
esac"#
        ),
    );
    f.capability("p", "cert", json!({"handler": h, "mode": "async"}));
}

fn set(f: &Fleet, name: &str, value: &str) {
    std::fs::write(f.dir.path().join(name), value).unwrap();
}

fn runs(f: &Fleet) -> usize {
    std::fs::read_to_string(f.dir.path().join("runs"))
        .unwrap_or_default()
        .lines()
        .count()
}

fn input(f: &Fleet) -> Value {
    serde_json::from_slice(&std::fs::read(f.dir.path().join("input")).unwrap()).unwrap()
}

fn entry(f: &Fleet) -> Value {
    f.read_state("p", "provider-state.json")["entries"]["c:cert/web"].clone()
}

/// Runs the handler once more (as an operator would) and waits for the run to be over.
async fn run(f: &Fleet, args: &[&str]) {
    let before = runs(f);
    let mut argv = vec!["trigger", "cert"];
    argv.extend_from_slice(args);
    let (ok, out) = f.admin("p", &argv);
    assert!(ok, "{out}");
    assert!(eventually(Duration::from_secs(10), || runs(f) > before).await);
    // The run's outcome is recorded after the handler exits.
    tokio::time::sleep(Duration::from_millis(500)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_keeps_the_response_an_entry_holds_by_its_hash() {
    let mut f = Fleet::new();
    provider(&mut f);
    set(&f, "mode", "answer");
    set(&f, "answer", r#"{"cert": "v1", "chain": "c"}"#);
    let file = f.dir.path().join("out/cert");
    f.need(
        "c",
        "cert/web",
        "p",
        json!({"nag_seconds": 600, "files": [{"path": file, "pointer": "/cert"}]}),
    );
    f.start();
    assert!(eventually(Duration::from_secs(10), || f.all_satisfied("c")).await);

    // The input names the hash of the payload the entry holds: its compact JSON, keys
    // sorted, as the consumer received it; the response itself is not passed.
    run(&f, &[]).await;
    let held = sha256_hex(br#"{"cert":"v1","chain":"c"}"#);
    let seen = input(&f)["c:cert/web"].clone();
    assert_eq!(seen["held"], held, "{seen}");
    assert_eq!(seen["response"], Value::Null, "{seen}");
    assert_eq!(entry(&f)["response_hash"], held);

    // Work under way, then a keep naming another hash: nothing changes, the verdict stays.
    set(&f, "answer", r#"{"$fort_pending": "renewing"}"#);
    run(&f, &[]).await;
    let waiting = "p is working on it: renewing";
    assert!(
        eventually(Duration::from_secs(10), || {
            f.need_status("c", "cert/web")["reason"] == waiting
        })
        .await,
        "{}",
        f.need_status("c", "cert/web")
    );
    set(&f, "mode", "other");
    run(&f, &[]).await;
    let e = entry(&f);
    assert_eq!(e["notice"], json!({"pending": "renewing"}), "{e}");
    assert_eq!(e["response"], json!({"cert": "v1", "chain": "c"}), "{e}");
    assert_eq!(f.need_status("c", "cert/web")["reason"], waiting);
    let log = std::fs::read_to_string(f.host_dir("p").join("agent.log")).unwrap();
    assert!(
        log.contains("handler kept responses the entries do not hold"),
        "{log}"
    );

    // A keep with the entry's hash: the response stays, the verdict ends, the consumer
    // hears so and still has its file.
    set(&f, "mode", "keep");
    run(&f, &[]).await;
    let e = entry(&f);
    assert_eq!(e.get("notice"), None, "{e}");
    assert_eq!(e["response"], json!({"cert": "v1", "chain": "c"}), "{e}");
    assert!(
        eventually(Duration::from_secs(10), || {
            let st = f.need_status("c", "cert/web");
            st["state"] == "satisfied" && st["reason"] != waiting
        })
        .await,
        "{}",
        f.need_status("c", "cert/web")
    );
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "v1");

    // A forced run answers in full: no hash is named.
    set(&f, "mode", "answer");
    set(&f, "answer", r#"{"cert": "v2", "chain": "c"}"#);
    run(&f, &["--force"]).await;
    assert_eq!(input(&f)["c:cert/web"].get("held"), None);
    assert!(
        eventually(Duration::from_secs(10), || {
            std::fs::read_to_string(&file).is_ok_and(|c| c == "v2")
        })
        .await
    );
}
