//! The consumer's end against hostile or unlucky providers, with real agents: a remote
//! expiry that would overflow a deadline, payloads that arrive already due for renewal,
//! payloads that expire with no renewal window, consumer handlers slower than the
//! provider's patience, and text meant for the operator's terminal.

use std::time::Duration;

use fort_tests::{eventually, Fleet};
use serde_json::{json, Value};

fn need_status(f: &Fleet, host: &str, need: &str) -> Value {
    f.need_status(host, need)
}

/// A provider whose handler answers every entry with the JSON in `<dir>/answer` (read on
/// every run) and counts its runs in `<dir>/runs`.
fn scripted_provider(f: &mut Fleet, cap: &str, extra: Value) {
    let d = f.dir.path().display().to_string();
    let h = f.script(
        &format!("provide-{cap}"),
        &format!(
            r#"echo run >> {d}/runs; answer=$(cat {d}/answer); jq -c --argjson a "$answer" 'with_entries(.value = $a)'"#
        ),
    );
    let mut spec = json!({"handler": h, "mode": "async"});
    for (k, v) in extra.as_object().cloned().unwrap_or_default() {
        spec[k] = v;
    }
    f.capability("p", cap, spec);
}

fn runs(f: &Fleet) -> usize {
    std::fs::read_to_string(f.dir.path().join("runs"))
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

fn answer(f: &Fleet, value: Value) {
    std::fs::write(f.dir.path().join("answer"), value.to_string()).unwrap();
}

fn now() -> u64 {
    fort_core::wire::unix_now()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expiry_past_any_deadline_neither_crashes_nor_wedges_the_consumer() {
    let mut f = Fleet::new();
    scripted_provider(&mut f, "token", json!({}));
    answer(&f, json!({"token": "t", "expires_at": u64::MAX}));
    let file = f.dir.path().join("out/token");
    f.need(
        "c",
        "token/x",
        "p",
        json!({"nag_seconds": 60, "renew_before_seconds": 30,
               "files": [{"path": file, "pointer": "/token"}]}),
    );
    f.start();
    assert!(
        eventually(Duration::from_secs(15), || f.all_satisfied("c")).await,
        "{}",
        need_status(&f, "c", "token/x")
    );
    // An expiry no calendar holds is no expiry: nothing to renew, nothing to overflow.
    let st = need_status(&f, "c", "token/x");
    assert_eq!(st["expires_at"], Value::Null, "{st}");
    // The consumer still answers, and comes back after a restart on the same state.
    f.kill("c");
    f.start_host("c");
    assert!(eventually(Duration::from_secs(10), || f.all_satisfied("c")).await);
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "t");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_already_due_for_renewal_is_asked_again_once_per_nag_not_in_a_loop() {
    let mut f = Fleet::new();
    scripted_provider(&mut f, "cert", json!({}));
    // Each answer lives 20 s; the consumer renews 60 s before expiry: every payload
    // arrives inside its renewal window.
    let d = f.dir.path().display().to_string();
    let h = f.script(
        "short-lived",
        &format!(
            r#"echo run >> {d}/runs; jq -c --argjson now "$(date +%s)" 'with_entries(.value = {{"n": ($now | tostring), "expires_at": ($now + 20)}})'"#
        ),
    );
    f.capability("p", "cert", json!({"handler": h, "mode": "async"}));
    let restarts = f.dir.path().join("restarts");
    let systemctl = f.script(
        "systemctl",
        &format!("echo \"$*\" >> {}", restarts.display()),
    );
    f.host("c").extra_toml = format!("systemctl = {:?}\n", systemctl.display().to_string());
    f.need(
        "c",
        "cert/web",
        "p",
        json!({"nag_seconds": 30, "renew_before_seconds": 60,
               "files": [{"path": f.dir.path().join("out/cert"), "pointer": "/n"}],
               "restart_units": ["web.service"]}),
    );
    f.start();
    assert!(
        eventually(Duration::from_secs(15), || {
            need_status(&f, "c", "cert/web")["state"] == "expiring"
        })
        .await,
        "{}",
        need_status(&f, "c", "cert/web")
    );
    tokio::time::sleep(Duration::from_secs(8)).await;
    // One first answer and at most one renewal: the storm was 15–19 runs a second.
    let n = runs(&f);
    assert!(n <= 3, "{n} provider runs in ~8 s at a 30 s nag");
    let restarted = std::fs::read_to_string(&restarts)
        .unwrap_or_default()
        .lines()
        .count();
    assert!(restarted <= 2, "{restarted} restarts");
    let st = need_status(&f, "c", "cert/web");
    let reason = st["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("inside the renewal window") || reason.contains("asking again"),
        "the reason says why it waits: {st}"
    );
    assert!(
        !reason.contains("every every") && reason.contains("asking again every 30s"),
        "the reason reads as a sentence: {st}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_payload_is_asked_for_again_without_renew_before_and_shows_expired_after_a_restart(
) {
    let mut f = Fleet::new();
    scripted_provider(&mut f, "token", json!({"cacheResponse": true}));
    let soon = now() + 4;
    answer(&f, json!({"token": "old", "expires_at": soon}));
    f.need(
        "c",
        "token/x",
        "p",
        json!({"nag_seconds": 30, "files": [{"path": f.dir.path().join("out/t"), "pointer": "/token"}]}),
    );
    f.start();
    assert!(eventually(Duration::from_secs(10), || f.all_satisfied("c")).await);
    let before = runs(&f);
    // Past its expiry the need is expired and asked again, with renew, at once.
    assert!(
        eventually(Duration::from_secs(10), || {
            need_status(&f, "c", "token/x")["state"] == "expired" && runs(&f) > before
        })
        .await,
        "{} after {} runs",
        need_status(&f, "c", "token/x"),
        runs(&f)
    );
    let entry = f.read_state("p", "provider-state.json")["entries"]["c:token/x"].clone();
    assert_eq!(entry["renew"], true, "asked with renew: {entry}");
    // Down while it expires, up again: expired at once, not satisfied.
    f.kill("c");
    f.start_host("c");
    let st = need_status(&f, "c", "token/x");
    assert_eq!(st["state"], "expired", "{st}");
    assert_eq!(st["satisfied"], false, "{st}");
    // A fresh payload ends it.
    answer(&f, json!({"token": "new", "expires_at": now() + 3600}));
    assert!(
        eventually(Duration::from_secs(40), || f.all_satisfied("c")).await,
        "{}",
        need_status(&f, "c", "token/x")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_handlers_slower_than_the_providers_patience_still_finish() {
    let mut f = Fleet::new();
    scripted_provider(&mut f, "slow", json!({}));
    answer(&f, json!("payload"));
    // The provider gives each callback 2 s; every handler takes 4 s.
    f.host("p").extra_toml = "[callbacks]\ntimeout = \"2s\"\nbackoff = \"500ms\"\n".into();
    let d = f.dir.path().display().to_string();
    let handler = f.script(
        "slow-handler",
        &format!(
            r#"sleep 4; mkdir -p {d}/done; echo "$FORT_NEED" > {d}/done/$(echo "$FORT_NEED" | tr / _)"#
        ),
    );
    for i in 0..12 {
        f.need(
            "c",
            &format!("slow/n{i}"),
            "p",
            json!({"nag_seconds": 600, "handler": handler}),
        );
    }
    f.start();
    // 12 handlers of 4 s, 8 at a time: about 8 s; the 600 s nag never helps.
    assert!(
        eventually(Duration::from_secs(40), || f.all_satisfied("c")).await,
        "{}",
        f.status("c")["needs"]
    );
    let done = std::fs::read_dir(f.dir.path().join("done"))
        .unwrap()
        .count();
    assert_eq!(done, 12, "every handler ran to its end");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_carrying_terminal_escapes_reaches_the_operator_as_plain_text() {
    let mut f = Fleet::new();
    let hostile = "ok\u{1b}[2K\r\u{1b}]52;c;ZXZpbA==\u{7}cert/web  satisfied\u{1b}[0m";
    scripted_provider(&mut f, "cert", json!({}));
    answer(&f, json!({"$fort_refused": hostile}));
    f.need("c", "cert/web", "p", json!({"nag_seconds": 60}));
    f.principal("ops");
    f.start();
    assert!(
        eventually(Duration::from_secs(15), || {
            need_status(&f, "c", "cert/web")["state"] == "failed"
        })
        .await,
        "{}",
        need_status(&f, "c", "cert/web")
    );
    let reason = need_status(&f, "c", "cert/web")["reason"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(reason.starts_with("refused by p: ok"), "{reason}");
    assert!(!reason.chars().any(char::is_control), "{reason:?}");
    // What the operator's terminal gets, from the local status and from `fort status`.
    let (ok, table) = f.admin("c", &["status"]);
    assert!(ok, "{table}");
    let (code, remote, err) = f.fort("ops", "c", &["status", "c"]);
    assert_eq!(code, 0, "{err}");
    for text in [table, remote] {
        assert!(
            !text.contains('\u{1b}') && !text.contains('\u{7}'),
            "{text:?}"
        );
        assert!(
            text.contains("\\u{1b}"),
            "escapes are shown, not acted on: {text}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_superseded_while_its_handler_runs_still_restarts_the_units() {
    let mut f = Fleet::new();
    scripted_provider(&mut f, "cert", json!({}));
    let restarts = f.dir.path().join("restarts");
    let systemctl = f.script(
        "systemctl",
        &format!("echo \"$*\" >> {}", restarts.display()),
    );
    // Slower than the reply's wait, so that the next payload arrives while it runs.
    let slow = f.script("consume", "cat > /dev/null; sleep 6");
    f.host("c").extra_toml = format!("systemctl = {:?}\n", systemctl.display().to_string());
    let file = f.dir.path().join("out/cert");
    answer(&f, json!({"v": "1", "t": 0}));
    f.need(
        "c",
        "cert/web",
        "p",
        json!({"nag_seconds": 600, "handler": slow,
            "files": [{"path": file, "pointer": "/v"}], "restart_units": ["web.service"]}),
    );
    f.start();
    assert!(eventually(Duration::from_secs(30), || f.all_satisfied("c")).await);
    let count = || {
        std::fs::read_to_string(&restarts)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("restart"))
            .count()
    };
    assert!(eventually(Duration::from_secs(5), || count() == 1).await);
    // v2 changes the file; while its handler runs, a payload with the same file content
    // (only another field differs) supersedes it and writes nothing.
    answer(&f, json!({"v": "2", "t": 1}));
    assert!(f.admin("p", &["trigger", "cert"]).0);
    assert!(
        eventually(Duration::from_secs(10), || {
            std::fs::read_to_string(&file).unwrap_or_default() == "2"
        })
        .await
    );
    answer(&f, json!({"v": "2", "t": 2}));
    assert!(f.admin("p", &["trigger", "cert"]).0);
    assert!(
        eventually(Duration::from_secs(30), || count() == 2).await,
        "web.service restarted {} times for two contents: {}",
        count(),
        need_status(&f, "c", "cert/web")
    );
    assert!(
        eventually(Duration::from_secs(20), || f.all_satisfied("c")).await,
        "{}",
        need_status(&f, "c", "cert/web")
    );
    assert_eq!(count(), 2);
}
