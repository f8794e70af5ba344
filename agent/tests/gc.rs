//! GC sweeps against real agents: only a verified positive absence removes an entry, and
//! only after the grace period; removed hosts, expired principals and releases.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::time::Duration;

use fort_core::canonical::response_bytes;
use fort_core::sign::Signer;
use fort_tests::{eventually, Fleet};
use serde_json::{json, Value};

const GC: &str =
    "[gc]\ninterval = \"0s\"\ngrace = \"2s\"\nprincipal_ttl = \"2s\"\ntimeout = \"1s\"\n";

fn provider(f: &mut Fleet) {
    f.principal("ops");
    let h = f.script("provide", r#"jq -c 'with_entries(.value = "OK")'"#);
    f.capability("p", "web", json!({"handler": h, "mode": "async"}));
    f.host("p").extra_toml = GC.into();
}

/// The test plays hosts that hold entries without declaring needs, so every host (and
/// ops) is allowed to call `web`. Call after the last host is added or removed.
fn allow_everyone(f: &mut Fleet) {
    let mut allowed: Vec<String> = f.hosts.keys().filter(|h| *h != "p").cloned().collect();
    allowed.push("ops".into());
    f.host("p").capabilities.get_mut("web").unwrap()["allowed"] = json!(allowed);
}

fn sweep(f: &Fleet) -> Value {
    let (ok, out) = f.admin("p", &["gc", "--json"]);
    assert!(ok, "{out}");
    serde_json::from_str::<Value>(&out).unwrap()["report"].clone()
}

/// Stores an entry at `p` as if `origin` had asked for `need`.
async fn request(f: &Fleet, origin: &str, need: &str) {
    let r = f
        .post(
            origin,
            "p",
            "/agent/capabilities/web",
            &json!({"need": need, "request": {}}),
        )
        .await;
    assert_eq!(r.status, 202, "{origin} {need}");
}

/// A peer that is not a fort agent: it answers every request with `status`/`body`,
/// signed by `signer` when given, so each no-proof class can be produced on demand.
fn fake_peer(
    listener: TcpListener,
    name: &'static str,
    tls_key: Signer,
    signer: Option<Signer>,
    status: u16,
    body: &'static str,
) {
    std::thread::spawn(move || {
        for stream in listener.incoming().take(20) {
            let Ok(stream) = stream else { continue };
            // TLS with the key hosts.json lists, so only the reply itself is bad.
            let mut s = fort_tests::tls_accept(stream, &tls_key, name);
            let mut buf = vec![0u8; 16384];
            let n = s.read(&mut buf).unwrap_or(0);
            let req = String::from_utf8_lossy(&buf[..n]).to_string();
            let nonce = req
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("x-fort-nonce: ")
                        .map(str::to_owned)
                })
                .unwrap_or_default();
            let mut head = format!(
                "HTTP/1.1 {status} X\r\nContent-Length: {}\r\nConnection: close\r\n",
                body.len()
            );
            if let Some(signer) = &signer {
                let sig = signer.sign(&response_bytes(name, &nonce, status, body.as_bytes()));
                head.push_str(&format!(
                    "X-Fort-Origin: {name}\r\nX-Fort-Signature: {sig}\r\n"
                ));
            }
            let _ = s.write_all(format!("{head}\r\n{body}").as_bytes());
            let _ = s.flush();
            s.conn.send_close_notify();
            let _ = s.flush();
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_verified_absence_removes_and_only_after_grace() {
    let mut f = Fleet::new();
    provider(&mut f);
    // Real agents: one declares the need, one declares nothing, one is down.
    f.need("keeps", "web/site", "p", json!({"nag_seconds": 3600}));
    f.host("forgot");
    f.host("down");
    // Peers that answer badly.
    for name in [
        "emptyobj",
        "unsigned",
        "wrongsig",
        "nonarray",
        "fivehundred",
    ] {
        f.host(name);
    }
    // A host whose copy of the registry has a stale key for p: it answers p with 401.
    f.host("stale");
    allow_everyone(&mut f);
    f.write_files();
    let mut stale_hosts = f.hosts_json();
    stale_hosts["hosts"]["p"]["keys"] = json!([Signer::generate().public_openssh()]);
    std::fs::write(
        f.host_dir("stale").join("hosts.json"),
        stale_hosts.to_string(),
    )
    .unwrap();
    for h in ["p", "keeps", "forgot", "stale"] {
        f.start_host(h);
    }
    let fakes: [(&'static str, Option<Signer>, u16, &'static str); 5] = [
        (
            "emptyobj",
            Some(f.hosts["emptyobj"].signer.clone()),
            200,
            "{}",
        ),
        ("unsigned", None, 200, r#"{"needs":[]}"#),
        ("wrongsig", Some(Signer::generate()), 200, r#"{"needs":[]}"#),
        (
            "nonarray",
            Some(f.hosts["nonarray"].signer.clone()),
            200,
            r#"{"needs":"web/site"}"#,
        ),
        (
            "fivehundred",
            Some(f.hosts["fivehundred"].signer.clone()),
            500,
            r#"{"error":"x"}"#,
        ),
    ];
    for (name, signer, status, body) in fakes {
        let l = TcpListener::bind(f.hosts[name].addr).unwrap();
        fake_peer(l, name, f.hosts[name].signer.clone(), signer, status, body);
    }
    for origin in [
        "keeps",
        "forgot",
        "down",
        "emptyobj",
        "unsigned",
        "wrongsig",
        "nonarray",
        "fivehundred",
        "stale",
    ] {
        request(&f, origin, "web/site").await;
    }
    let first = sweep(&f);
    assert!(
        first["removed"].as_array().unwrap().is_empty(),
        "removed before grace: {first}"
    );
    assert_eq!(
        first["pending_grace"].as_array().unwrap().len(),
        1,
        "{first}"
    );
    let no_proof = first["kept_no_proof"].as_array().unwrap();
    let reason = |who: &str| {
        no_proof
            .iter()
            .find(|d| d["entry"].as_str().unwrap().starts_with(&format!("{who}:")))
            .map(|d| d["reason"].as_str().unwrap().to_owned())
    };
    for (who, class) in [
        ("down", "refused"),
        ("emptyobj", "bad_json"),
        ("unsigned", "bad_signature"),
        ("wrongsig", "bad_signature"),
        ("nonarray", "bad_json"),
        ("fivehundred", "status_500"),
        ("stale", "status_401"),
    ] {
        let r = reason(who).unwrap_or_else(|| panic!("{who} not kept for lack of proof: {first}"));
        assert!(r.contains(class), "{who}: {r}");
    }
    tokio::time::sleep(Duration::from_millis(2200)).await;
    let second = sweep(&f);
    let removed: Vec<&str> = second["removed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["entry"].as_str().unwrap())
        .collect();
    assert_eq!(removed, vec!["forgot:web/site"]);
    let left = f.entries("p");
    assert_eq!(left.len(), 8);
    assert!(!left.contains(&"forgot:web/site".to_owned()));
    let status = f.status("p");
    assert_eq!(status["gc"]["kept_no_proof"], 7);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_re_request_inside_the_grace_period_cancels_the_removal() {
    let mut f = Fleet::new();
    provider(&mut f);
    f.host("flaky");
    allow_everyone(&mut f);
    f.start();
    request(&f, "flaky", "web/site").await;
    assert_eq!(sweep(&f)["pending_grace"].as_array().unwrap().len(), 1);
    request(&f, "flaky", "web/site").await;
    assert!(
        f.read_state("p", "provider-state.json")["entries"]["flaky:web/site"]["absent_since"]
            .is_null()
    );
    tokio::time::sleep(Duration::from_millis(2200)).await;
    // Absent again, but the clock of grace restarted: not removed yet.
    assert!(sweep(&f)["removed"].as_array().unwrap().is_empty());
    assert_eq!(f.entries("p"), vec!["flaky:web/site"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removed_hosts_expired_principals_and_releases() {
    let mut f = Fleet::new();
    provider(&mut f);
    f.principal("ops");
    f.host("gone");
    f.need("leaver", "web/a", "p", json!({"nag_seconds": 3600}));
    f.need("leaver", "web/b", "p", json!({"nag_seconds": 3600}));
    allow_everyone(&mut f);
    f.start();
    request(&f, "gone", "web/site").await;
    assert!(
        eventually(Duration::from_secs(10), || f.entries("p").len() == 3).await,
        "{:?}",
        f.entries("p")
    );

    // A release goes at once, without a sweep.
    f.host("leaver").needs.remove("web/b");
    f.write_files();
    f.agents["leaver"].hup();
    assert!(
        eventually(Duration::from_secs(5), || !f
            .entries("p")
            .contains(&"leaver:web/b".to_owned()))
        .await
    );
    assert!(f.entries("p").contains(&"leaver:web/a".to_owned()));

    // The principal's entry is young: kept. `gone` leaves hosts.json: its entry goes at
    // the next sweep, with no query.
    request(&f, "ops", "web/tool").await;
    f.hosts.remove("gone");
    allow_everyone(&mut f);
    f.write_files();
    f.agents["p"].hup();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let r = sweep(&f);
    let removed: Vec<&str> = r["removed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["entry"].as_str().unwrap())
        .collect();
    assert_eq!(removed, vec!["gone:web/site"], "{r}");
    assert!(f.entries("p").contains(&"ops:web/tool".to_owned()));
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let r = sweep(&f);
    let removed: Vec<&str> = r["removed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["entry"].as_str().unwrap())
        .collect();
    assert_eq!(removed, vec!["ops:web/tool"], "{r}");
    assert_eq!(f.entries("p"), vec!["leaver:web/a"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sweep_during_100_requests_loses_none_and_resurrects_nothing() {
    let mut f = Fleet::new();
    provider(&mut f);
    f.host("p").extra_toml = GC
        .replace("grace = \"2s\"", "grace = \"0s\"")
        .replace("timeout = \"1s\"", "timeout = \"2s\"");
    // `slow` never answers: the sweep lasts its 2 s timeout while requests pour in.
    f.host("slow");
    f.host("leftover");
    for i in 0..100 {
        f.need(
            "live",
            &format!("web/n{i}"),
            "p",
            json!({"nag_seconds": 3600}),
        );
    }
    allow_everyone(&mut f);
    f.write_files();
    let blackhole = TcpListener::bind(f.hosts["slow"].addr).unwrap();
    f.start_host("p");
    f.start_host("leftover");
    request(&f, "slow", "web/site").await;
    for i in 0..20 {
        request(&f, "leftover", &format!("web/old{i}")).await;
    }
    let config = f.config_path("p");
    let sweeper = tokio::task::spawn_blocking(move || {
        std::process::Command::new(fort_tests::bin("fort-agent"))
            .args(["gc", "--json", "--config"])
            .arg(config)
            .output()
            .unwrap()
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    // The consumer starts now and asks for its 100 needs while the sweep runs.
    f.start_host("live");
    let out = sweeper.await.unwrap();
    assert!(out.status.success());
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        report["report"]["removed"].as_array().unwrap().len(),
        20,
        "{report}"
    );
    assert!(
        eventually(Duration::from_secs(10), || f
            .entries("p")
            .iter()
            .filter(|e| e.starts_with("live:"))
            .count()
            == 100)
        .await
    );
    // Another write later (a new request) must not bring the removed entries back.
    request(&f, "slow", "web/other").await;
    let left = f.entries("p");
    assert!(
        left.iter().all(|e| !e.starts_with("leftover:")),
        "resurrected: {left:?}"
    );
    assert_eq!(left.iter().filter(|e| e.starts_with("live:")).count(), 100);
    drop(blackhole);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_is_honoured_after_the_caller_left_the_callers_list() {
    let mut f = Fleet::new();
    provider(&mut f);
    f.need("leaver", "web/a", "p", json!({"nag_seconds": 3600}));
    f.start();
    assert!(
        eventually(Duration::from_secs(10), || f.entries("p")
            == vec!["leaver:web/a"])
        .await
    );
    // Both sides deploy at once; the provider's new files arrive first.
    f.host("p").capabilities.get_mut("web").unwrap()["callers"] = json!({});
    f.write_files();
    f.agents["p"].hup();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let r = f
        .post(
            "leaver",
            "p",
            "/agent/capabilities/web",
            &json!({"need": "web/a", "request": {}}),
        )
        .await;
    assert_eq!(r.status, 403, "no longer a caller: requests are refused");
    f.host("leaver").needs.clear();
    f.write_files();
    f.agents["leaver"].hup();
    assert!(
        eventually(Duration::from_secs(5), || f.entries("p").is_empty()).await,
        "release refused"
    );
}
