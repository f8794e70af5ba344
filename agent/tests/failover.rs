//! Needs with several providers (docs/protocol.md §11.13), with real agents on loopback:
//! while the home answers, the standby never hears of the consumer; the home killed with
//! `kill -9` while a need comes due, and the need is served by the standby; the old home
//! back again releases its entry and touches nothing the standby issued; a home that
//! flaps moves a need at most once per failover interval; the needs list says who serves;
//! where a need moved, when and why, survives a restart of the consumer.

use std::time::{Duration, Instant};

use fort_tests::{eventually, Fleet};
use serde_json::{json, Value};

const NEED: &str = "tok/app";
const NAG: u64 = 2;
const FAILOVER_AFTER: u64 = 4;

/// Each answer lives 10 s and is renewed 6 s before it expires: a renewal every ~4 s.
/// The token names the provider that issued it.
fn providers(f: &mut Fleet, hosts: &[&str]) {
    let d = f.dir.path().display().to_string();
    let h = f.script(
        "issue",
        &format!(
            r#"echo run >> {d}/runs-$FORT_HOST; jq -c --arg h "$FORT_HOST" --argjson now "$(date +%s)" 'with_entries(.value = {{"token": ($h + "-" + ($now | tostring)), "expires_at": ($now + 10)}})'"#
        ),
    );
    for host in hosts {
        f.capability(host, "tok", json!({"handler": h, "mode": "async"}));
        // Sweeps only when asked (`fort-agent gc`), with a short grace; renewals as
        // often as the consumer asks.
        f.host(host).extra_toml =
            "renew_interval = \"1s\"\n[gc]\ninterval = \"0s\"\ngrace = \"1s\"\ntimeout = \"3s\"\n"
                .into();
    }
}

fn consumer(f: &mut Fleet, from: &[&str]) {
    let token = f.dir.path().join("out/token");
    f.need_from(
        "app",
        NEED,
        from,
        json!({"nag_seconds": NAG, "renew_before_seconds": 6,
               "failover_after_seconds": FAILOVER_AFTER,
               "files": [{"path": token, "pointer": "/token"}]}),
    );
    // Retries at the pace of the nag interval, so the test does not wait on back-off.
    f.host("app").extra_toml = "[fulfill]\nbackoff = \"1s\"\ntimeout = \"3s\"\n".into();
}

fn token(f: &Fleet) -> String {
    std::fs::read_to_string(f.dir.path().join("out/token")).unwrap_or_default()
}

fn runs(f: &Fleet, host: &str) -> usize {
    std::fs::read_to_string(f.dir.path().join(format!("runs-{host}")))
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

fn row(f: &Fleet) -> Value {
    f.need_status("app", NEED)
}

fn has_entry(f: &Fleet, host: &str) -> bool {
    f.entries(host).iter().any(|e| e == &format!("app:{NEED}"))
}

/// `app`'s needs list, as `asker` gets it (§8).
async fn needs_list(f: &Fleet, asker: &str) -> Value {
    let r = f.post(asker, "app", "/agent/needs", &json!({})).await;
    assert_eq!(r.status, 200);
    serde_json::from_slice(&r.body).unwrap_or(Value::Null)
}

/// One GC sweep at `host`; its report.
fn sweep(f: &Fleet, host: &str) -> Value {
    let (ok, out) = f.admin(host, &["gc", "--json"]);
    assert!(ok, "{out}");
    serde_json::from_str::<Value>(&out).unwrap_or(Value::Null)["report"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_standby_serves_a_due_need_once_the_home_is_dead_and_the_home_back_releases_it() {
    let mut f = Fleet::new();
    f.principal("ops");
    providers(&mut f, &["e1", "e2"]);
    consumer(&mut f, &["e1", "e2"]);
    f.start();

    // Healthy home: several renewals, all from e1, and nothing ever reaches e2.
    assert!(
        eventually(Duration::from_secs(90), || row(&f)["received"]
            .as_u64()
            .is_some_and(|n| n >= 4))
        .await,
        "four payloads from the home: {}",
        row(&f)
    );
    let st = row(&f);
    assert_eq!(st["from"], "e1", "{st}");
    assert_eq!(st["providers"], json!(["e1", "e2"]), "{st}");
    assert_eq!(st["moves"], 0, "{st}");
    assert!(token(&f).starts_with("e1-"), "{}", token(&f));
    assert_eq!(runs(&f, "e2"), 0, "the standby's handler never ran");
    assert!(f.entries("e2").is_empty(), "{:?}", f.entries("e2"));

    // The needs list says who serves the need.
    let list = needs_list(&f, "e1").await;
    assert_eq!(list["served_by"], json!({ NEED: "e1" }), "{list}");

    // The home dies while the need is satisfied; it comes due within seconds.
    f.kill("e1");
    let killed = Instant::now();
    assert!(
        eventually(Duration::from_secs(90), || token(&f).starts_with("e2-")
            && row(&f)["state"] == "satisfied")
        .await,
        "served by the standby: {} (token {})",
        row(&f),
        token(&f)
    );
    eprintln!(
        "served by the standby {:?} after the kill (failover after {FAILOVER_AFTER}s, nag {NAG}s)",
        killed.elapsed()
    );
    let st = row(&f);
    assert_eq!(st["from"], "e2", "{st}");
    assert_eq!(st["moves"], 1, "{st}");
    assert!(st["home_since"].as_u64().is_some(), "{st}");
    let why = st["moved_because"].as_str().unwrap_or_default();
    assert!(why.starts_with("e1 failing since"), "{st}");
    assert!(has_entry(&f, "e2"));
    let (_, table) = f.admin("app", &["status"]);
    assert!(table.contains("e2 (moved "), "{table}");
    // The fleet view lists it with why it moved (e1 shows as unreachable).
    let (_, fleet, err) = f.fort("ops", "app", &["fleet"]);
    let line = fleet
        .lines()
        .find(|l| {
            l.trim_start()
                .starts_with(&format!("app:{NEED} from e2 (moved "))
        })
        .unwrap_or_else(|| panic!("no moved need in: {fleet}{err}"));
    assert!(line.contains(": e1 failing since"), "{line}");
    let list = needs_list(&f, "e2").await;
    assert_eq!(list["served_by"], json!({ NEED: "e2" }), "{list}");

    // The move is part of the need's record: a restart of the consumer keeps it.
    f.kill("app");
    f.start_host("app");
    let again = row(&f);
    for field in ["from", "moves", "home_since", "moved_because"] {
        assert_eq!(again[field], st[field], "{field} after a restart: {again}");
    }

    // The old home comes back: it is not asked again, its redelivery (if any) changes
    // nothing, and its GC releases the entry the needs list says e2 serves.
    let e2_runs = runs(&f, "e2");
    f.start_host("e1");
    assert!(
        has_entry(&f, "e1"),
        "e1 still holds its entry before its sweep"
    );
    assert!(
        eventually(Duration::from_secs(60), || {
            sweep(&f, "e1");
            !has_entry(&f, "e1")
        })
        .await,
        "e1 released its entry: {:?}",
        f.entries("e1")
    );
    // Several renewals later the need is still e2's, and e2 still holds its entry.
    assert!(
        eventually(Duration::from_secs(90), || runs(&f, "e2") >= e2_runs + 3).await,
        "e2 keeps renewing"
    );
    let st = row(&f);
    assert_eq!(st["from"], "e2", "{st}");
    assert_eq!(st["moves"], 1, "{st}");
    assert!(has_entry(&f, "e2"));
    assert!(token(&f).starts_with("e2-"), "{}", token(&f));
    assert!(!has_entry(&f, "e1"), "nothing asked e1 again");
    let report = sweep(&f, "e2");
    assert!(
        report["removed"].as_array().is_some_and(|r| r.is_empty())
            && report["pending_grace"]
                .as_array()
                .is_some_and(|r| r.is_empty()),
        "e2's sweep keeps the entry it serves: {report}"
    );
    assert!(has_entry(&f, "e2"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flapping_home_moves_a_need_at_most_once_and_a_single_provider_lists_no_served_by() {
    let mut f = Fleet::new();
    providers(&mut f, &["e1", "e2"]);
    consumer(&mut f, &["e1", "e2"]);
    // A second need with one provider: the needs list stays as it was for it.
    let d = f.dir.path().join("out/single");
    f.need(
        "app",
        "tok/single",
        "e1",
        json!({"nag_seconds": NAG, "files": [{"path": d, "pointer": "/token"}]}),
    );
    f.start();
    assert!(
        eventually(Duration::from_secs(90), || f.all_satisfied("app")).await,
        "{}",
        f.status("app")
    );
    let list = needs_list(&f, "e2").await;
    assert_eq!(
        list,
        json!({"needs": ["tok/app", "tok/single"], "served_by": {"tok/app": "e1"}})
    );
    assert_eq!(
        f.need_status("app", "tok/single")["providers"],
        json!(["e1"])
    );

    // Up and down, each phase about one nag interval, for several failover intervals.
    let started = Instant::now();
    let mut flaps = 0;
    while started.elapsed() < Duration::from_secs(6 * FAILOVER_AFTER) {
        f.kill("e1");
        tokio::time::sleep(Duration::from_secs(NAG)).await;
        f.start_host("e1");
        tokio::time::sleep(Duration::from_secs(NAG)).await;
        flaps += 1;
        let moves = row(&f)["moves"].as_u64().unwrap_or(0);
        assert!(moves <= 1, "{moves} moves after {flaps} flaps: {}", row(&f));
    }
    // Whichever provider serves it now, it is served, and it moved at most once.
    assert!(
        eventually(Duration::from_secs(60), || row(&f)["state"] == "satisfied").await,
        "{}",
        row(&f)
    );
    let st = row(&f);
    assert!(st["moves"].as_u64().unwrap_or(9) <= 1, "{st}");
    let home = st["from"].as_str().unwrap_or_default().to_owned();
    assert!(
        token(&f).starts_with(&format!("{home}-")),
        "{} from {home}",
        token(&f)
    );
    let other = if home == "e1" { "e2" } else { "e1" };
    if st["moves"] == 0 {
        assert_eq!(
            runs(&f, "e2"),
            0,
            "no move, so the standby never heard of app"
        );
    } else {
        eprintln!("moved once to {home} during {flaps} flaps");
        assert!(
            eventually(Duration::from_secs(60), || {
                sweep(&f, other);
                !has_entry(&f, other)
            })
            .await,
            "{other} released the need it no longer serves"
        );
    }
}

/// A consumer whose state was set aside while its first provider is down does not know
/// where its need is served: its needs list must not name the dead first provider as
/// the home, so the standby that serves the need keeps its entry (its GC would otherwise
/// take it as served elsewhere and run the handler's cleanup on a live credential).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_that_lost_its_state_lets_no_standby_collect_the_need() {
    let mut f = Fleet::new();
    providers(&mut f, &["e1", "e2"]);
    consumer(&mut f, &["e1", "e2"]);
    f.start();
    assert!(
        eventually(Duration::from_secs(60), || row(&f)["state"] == "satisfied").await,
        "{}",
        row(&f)
    );
    f.kill("e1");
    assert!(
        eventually(Duration::from_secs(90), || token(&f).starts_with("e2-")
            && row(&f)["from"] == "e2")
        .await,
        "served by the standby: {}",
        row(&f)
    );
    let live = token(&f);

    // The consumer's state set aside the documented way, e1 still down.
    f.stop("app");
    let out = std::process::Command::new(fort_tests::bin("fort-agent"))
        .args(["set-aside", "--config"])
        .arg(f.config_path("app"))
        .arg("fulfillment-state.json")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    f.start_host("app");
    let list = needs_list(&f, "e2").await;
    assert_eq!(list["needs"], json!([NEED]), "{list}");
    assert!(
        list.get("served_by").is_none_or(|s| s.get(NEED).is_none()),
        "a home the consumer has not confirmed is named: {list}"
    );
    // e2's sweeps, past their grace, keep the entry whose credential app still holds.
    for _ in 0..3 {
        let report = sweep(&f, "e2");
        assert!(
            report["removed"].as_array().is_some_and(|r| r.is_empty()),
            "{report}"
        );
        tokio::time::sleep(Duration::from_millis(700)).await;
    }
    assert!(has_entry(&f, "e2"), "the standby collected the live entry");
    assert_eq!(token(&f), live);
}
