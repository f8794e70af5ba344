//! A valid host asking to renew its own entry over and over (docs/protocol.md §11.4): the
//! provider passes `renew` to its handler at most once per `renew_interval` and entry, so
//! the flood costs a bounded number of new credentials; another caller's renewal is not
//! held back by it.

use std::time::{Duration, Instant};

use fort_tests::{eventually, Fleet};
use serde_json::json;

/// Counts, in `<dir>/renewals`, the handler runs that saw `renew` on each entry, and
/// answers every entry a new token on such runs (the same one otherwise).
fn provider(f: &mut Fleet) {
    let d = f.dir.path().display().to_string();
    let h = f.script(
        "provide",
        &format!(
            r#"cat > {d}/input
jq -r 'to_entries[] | select(.value.renew) | .key' {d}/input >> {d}/renewals
jq -c --arg t "$(od -An -N8 -tx8 /dev/urandom | tr -d ' ')" \
  'with_entries(.value = (if .value.renew then {{"token": $t}} else (.value.response // {{"token": "first"}}) end))' {d}/input"#
        ),
    );
    f.capability(
        "p",
        "tok",
        json!({"handler": h, "mode": "async", "cacheResponse": true}),
    );
}

fn renewals(f: &Fleet, key: &str) -> usize {
    std::fs::read_to_string(f.dir.path().join("renewals"))
        .unwrap_or_default()
        .lines()
        .filter(|l| *l == key)
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renew_flood_from_a_valid_host_costs_one_renewal_per_interval() {
    let mut f = Fleet::new();
    provider(&mut f);
    f.host("p").extra_toml = "renew_interval = \"1h\"\n".into();
    for consumer in ["c", "d"] {
        let file = f.dir.path().join(format!("{consumer}/token"));
        f.need(
            consumer,
            "tok/api",
            "p",
            json!({"nag_seconds": 600, "files": [{"path": file, "pointer": "/token"}]}),
        );
    }
    f.start();
    for consumer in ["c", "d"] {
        assert!(eventually(Duration::from_secs(10), || f.all_satisfied(consumer)).await);
    }

    // c asks to renew twenty times a second for five seconds, as nothing but a host with
    // a valid key and an allowance.
    let body = json!({"need": "tok/api", "request": {}, "renew": true});
    let started = Instant::now();
    let mut accepted = 0;
    while started.elapsed() < Duration::from_secs(5) {
        let reply = f.post("c", "p", "/agent/capabilities/tok", &body).await;
        accepted += usize::from(reply.status == 202);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        accepted > 50,
        "the flood was refused at the door ({accepted})"
    );
    assert!(eventually(Duration::from_secs(10), || renewals(&f, "c:tok/api") >= 1).await);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        renewals(&f, "c:tok/api"),
        1,
        "one renewal per renew_interval, whatever the caller asks"
    );

    // Another caller's first renewal goes through at once.
    let reply = f.post("d", "p", "/agent/capabilities/tok", &body).await;
    assert_eq!(reply.status, 202);
    assert!(eventually(Duration::from_secs(10), || renewals(&f, "d:tok/api") == 1).await);
}

/// A capability whose credentials live seconds renews each one as it comes due, with the
/// agent's default `renew_interval` (ten minutes): a response past half of its lifetime
/// is always renewable, so the interval bounds a caller that asks too early, never one
/// whose credential is due.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_lived_credentials_renew_as_they_come_due_under_the_default_interval() {
    let mut f = Fleet::new();
    let d = f.dir.path().display().to_string();
    let h = f.script(
        "provide",
        &format!(
            r#"cat > {d}/input
jq -c --argjson now "$(date +%s)" --arg t "$(od -An -N8 -tx8 /dev/urandom | tr -d ' ')" \
  'with_entries(.value = (if .value.renew or .value.response == null then {{"token": $t, "expires_at": ($now + 8)}} else .value.response end))' {d}/input"#
        ),
    );
    f.capability(
        "p",
        "tok",
        json!({"handler": h, "mode": "async", "cacheResponse": true}),
    );
    let file = f.dir.path().join("c/token");
    f.need(
        "c",
        "tok/api",
        "p",
        json!({"nag_seconds": 1, "renew_before_seconds": 5,
               "files": [{"path": file, "pointer": "/token"}]}),
    );
    f.start();
    let mut seen = std::collections::BTreeSet::new();
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(30) && seen.len() < 4 {
        if let Ok(t) = std::fs::read_to_string(&file) {
            seen.insert(t);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        seen.len() >= 4,
        "{} tokens in 30 s: renewals were held back by the agent-wide interval",
        seen.len()
    );
}
