//! Whole-fleet scenarios: several real agents, each with its own key, state and config.

use std::time::Duration;

use fort_tests::{eventually, Fleet};
use serde_json::{json, Value};

/// Provider handler for `cert`: a response per entry that carries the current round
/// (from `<dir>/round`), keeping each entry's cached serial unless `<dir>/rotate-<host>`
/// exists, in which case that host's entries get a new serial.
fn cert_provider(f: &mut Fleet, host: &str) {
    let d = f.dir.path().display().to_string();
    let h = f.script(
        "cert",
        &format!(
            r#"round=$(cat {d}/round 2>/dev/null || echo 0)
out=$(jq -c --arg round "$round" 'with_entries(.value = {{"serial": (.value.response.serial // 1), "round": $round, "for": .key}})')
for f in {d}/rotate-*; do
  [ -e "$f" ] || continue
  who=${{f##*/rotate-}}; rm -f "$f"
  out=$(printf '%s' "$out" | jq -c --arg who "$who" 'with_entries(if (.key | startswith($who + ":")) then .value.serial += 1 else . end)')
done
printf '%s' "$out""#
        ),
    );
    f.capability(
        host,
        "cert",
        json!({"handler": h, "mode": "async", "cacheResponse": true, "allowed": ["ops"]}),
    );
    f.host(host).extra_toml =
        "[callbacks]\nbackoff = \"300ms\"\n[gc]\ninterval = \"0s\"\ngrace = \"0s\"\n".into();
}

fn store_handler(f: &Fleet) -> std::path::PathBuf {
    let d = f.dir.path().display().to_string();
    f.script(
        "store",
        &format!(r#"mkdir -p {d}/got; t={d}/got/.$FORT_HOST.$$; cat > $t; mv $t {d}/got/$(echo "$FORT_HOST-$FORT_NEED" | tr / _)"#),
    )
}

fn payload(f: &Fleet, host: &str, need: &str) -> Option<Value> {
    let p = f
        .dir
        .path()
        .join("got")
        .join(format!("{host}-{}", need.replace('/', "_")));
    std::fs::read(p)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_lifecycle_declare_satisfy_rotate_release_gc() {
    let mut f = Fleet::new();
    f.principal("ops");
    cert_provider(&mut f, "forge");
    let store = store_handler(&f);
    f.need(
        "app",
        "cert/web",
        "forge",
        json!({"handler": store, "nag_seconds": 600, "request": {"domain": "web.example"}}),
    );
    f.need(
        "app",
        "cert/api",
        "forge",
        json!({"handler": store, "nag_seconds": 600, "request": {"domain": "api.example"}}),
    );
    f.need(
        "old",
        "cert/legacy",
        "forge",
        json!({"handler": store, "nag_seconds": 600}),
    );
    f.host("old").extra_toml = "[fulfill]\nbackoff = \"100ms\"\n".into();
    f.start();
    // Declare → satisfied.
    assert!(
        eventually(Duration::from_secs(10), || f.all_satisfied("app")
            && f.all_satisfied("old"))
        .await
    );
    assert_eq!(payload(&f, "app", "cert/web").unwrap()["serial"], 1);
    // Rotate one consumer's certificates: only app is called back, with serial 2.
    std::fs::write(f.dir.path().join("rotate-app"), "").unwrap();
    let (ok, out) = f.admin("forge", &["trigger", "cert", "--reason", "systemd"]);
    assert!(ok, "{out}");
    assert!(
        eventually(Duration::from_secs(5), || payload(&f, "app", "cert/web")
            .is_some_and(|p| p["serial"] == 2))
        .await
    );
    assert_eq!(payload(&f, "old", "cert/legacy").unwrap()["serial"], 1);
    // Release: app drops cert/api; the entry goes at once.
    f.host("app").needs.remove("cert/api");
    f.write_files();
    f.agents["app"].hup();
    assert!(
        eventually(Duration::from_secs(5), || !f
            .entries("forge")
            .contains(&"app:cert/api".to_owned()))
        .await
    );
    // GC: old drops its need while forge is down, so its release cannot land; the next
    // sweep proves the absence and collects the entry.
    f.kill("forge");
    f.kill("old");
    f.host("old").needs.clear();
    f.write_files();
    f.start_host("old");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    f.start_host("forge");
    assert!(f.entries("forge").contains(&"old:cert/legacy".to_owned()));
    let (ok, out) = f.admin("forge", &["gc"]);
    assert!(ok, "{out}");
    assert!(
        !f.entries("forge").contains(&"old:cert/legacy".to_owned()),
        "{out}"
    );
    assert_eq!(f.entries("forge"), vec!["app:cert/web"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumers_converge_soon_after_a_provider_comes_back() {
    let mut f = Fleet::new();
    f.principal("ops");
    cert_provider(&mut f, "forge");
    let store = store_handler(&f);
    for c in ["c1", "c2", "c3"] {
        f.need(
            c,
            "cert/web",
            "forge",
            json!({"handler": store, "nag_seconds": 120}),
        );
        f.host(c).extra_toml = "[fulfill]\nbackoff = \"200ms\"\n".into();
    }
    f.write_files();
    for c in ["c1", "c2", "c3"] {
        f.start_host(c);
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!f.all_satisfied("c1"));
    let back = std::time::Instant::now();
    f.start_host("forge");
    assert!(
        eventually(Duration::from_secs(10), || ["c1", "c2", "c3"]
            .iter()
            .all(|c| f.all_satisfied(c)))
        .await
    );
    assert!(
        back.elapsed() < Duration::from_secs(10),
        "waited like a 120 s nag"
    );
}

/// `app` holds a satisfied certificate (nag: an hour away), is stopped, and forge rotates
/// it: the new serial is decided while nobody can receive it.
async fn rotation_while_app_is_away() -> Fleet {
    let mut f = Fleet::new();
    f.principal("ops");
    cert_provider(&mut f, "forge");
    let store = store_handler(&f);
    f.need(
        "app",
        "cert/web",
        "forge",
        json!({"handler": store, "nag_seconds": 3600}),
    );
    f.start();
    assert!(eventually(Duration::from_secs(10), || f.all_satisfied("app")).await);
    f.kill("app");
    std::fs::write(f.dir.path().join("rotate-app"), "").unwrap();
    let (ok, _) = f.admin("forge", &["trigger", "cert"]);
    assert!(ok);
    f
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_down_during_its_callback_gets_it_on_return() {
    let mut f = rotation_while_app_is_away().await;
    let failed_once = eventually(Duration::from_secs(5), || {
        f.read_state("forge", "provider-state.json")["entries"]["app:cert/web"]["delivery"]
            ["last_error"]
            .is_string()
    })
    .await;
    assert!(
        failed_once,
        "the delivery to a stopped consumer did not fail"
    );
    f.start_host("app");
    // The retry lands; the consumer's hour-long nag had nothing to do with it.
    assert!(
        eventually(Duration::from_secs(8), || payload(&f, "app", "cert/web")
            .is_some_and(|p| p["serial"] == 2))
        .await
    );
    // The acknowledgement is bookkeeping: on disk within the lazy flush interval.
    let recorded = eventually(Duration::from_secs(3), || {
        f.read_state("forge", "provider-state.json")["entries"]["app:cert/web"]["delivery"]
            ["last_error"]
            .is_null()
    })
    .await;
    assert!(recorded, "the successful delivery was not recorded");
}

/// A tiny deterministic generator so a failing round can be replayed.
struct Lcg(u64);
impl Lcg {
    fn next(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_9_at_random_moments_loses_nothing_acknowledged() {
    let mut f = Fleet::new();
    f.principal("ops");
    cert_provider(&mut f, "forge");
    let store = store_handler(&f);
    let consumers = ["k1", "k2", "k3"];
    for c in consumers {
        for n in 0..5 {
            f.need(
                c,
                &format!("cert/n{n}"),
                "forge",
                json!({"handler": store, "nag_seconds": 2}),
            );
        }
        f.host(c).extra_toml = "[fulfill]\nbackoff = \"100ms\"\n".into();
    }
    f.start();
    assert!(
        eventually(Duration::from_secs(15), || consumers
            .iter()
            .all(|c| f.all_satisfied(c)))
        .await
    );
    let seed = std::env::var("FORT_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed);
    let mut rng = Lcg(seed);
    let ops = f.client("ops");
    let forge_address = f.hosts["forge"].address();
    let forge_keys = vec![f.hosts["forge"].signer.public_key().clone()];
    for round in 1..=20u64 {
        std::fs::write(f.dir.path().join("round"), round.to_string()).unwrap();
        let victim = ["forge", "k1", "k2", "k3"][rng.next(4) as usize];
        let delay = Duration::from_millis(rng.next(250));
        // The burst: 30 async requests from ops (whose entries get no callbacks, so the
        // check is exact) plus a forced run that calls every consumer back.
        let mut burst = Vec::new();
        for k in 0..30 {
            let (ops, address, keys) = (ops.clone(), forge_address.clone(), forge_keys.clone());
            burst.push(tokio::spawn(async move {
                let need = format!("cert/b{k}");
                let body = serde_json::to_vec(&json!({"need": need, "request": {"round": round}}))
                    .unwrap();
                let target = fort_core::client::Target {
                    name: "forge",
                    address: &address,
                    keys: &keys,
                };
                let r = ops.post(&target, "/agent/capabilities/cert", body).await;
                (
                    format!("ops:{need}"),
                    r.is_ok_and(|r| r.status == 202 && r.verified()),
                )
            }));
        }
        let config = f.config_path("forge");
        let trigger = tokio::task::spawn_blocking(move || {
            let _ = std::process::Command::new(fort_tests::bin("fort-agent"))
                .args(["trigger", "cert", "--force", "--config"])
                .arg(config)
                .output();
        });
        tokio::time::sleep(delay).await;
        f.kill(victim);
        let _ = trigger.await;
        let state = f.read_state("forge", "provider-state.json");
        for b in burst {
            let (key, acked) = b.await.unwrap();
            if acked {
                let r = state["entries"][&key]["request"]["round"].as_u64();
                assert!(
                    r.is_some_and(|r| r >= round),
                    "round {round} (victim {victim}): acknowledged {key} lost ({r:?})"
                );
            }
        }
        f.start_host(victim);
    }
    // After the chaos, the fleet converges on the last round everywhere.
    let (ok, _) = f.admin("forge", &["trigger", "cert", "--force"]);
    assert!(ok);
    let converged = eventually(Duration::from_secs(30), || {
        consumers.iter().all(|c| {
            f.all_satisfied(c)
                && (0..5).all(|n| {
                    payload(&f, c, &format!("cert/n{n}")).is_some_and(|p| p["round"] == "20")
                })
        })
    })
    .await;
    assert!(
        converged,
        "fleet did not converge after 20 rounds of kill -9"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotation_interrupted_by_a_provider_crash_is_delivered_after_restart() {
    // The provider then dies before any retry lands.
    let mut f = rotation_while_app_is_away().await;
    f.kill("forge");
    assert_eq!(
        f.read_state("forge", "provider-state.json")["entries"]["app:cert/web"]["response"]
            ["serial"],
        2
    );
    f.start_host("app");
    f.start_host("forge");
    assert!(
        eventually(Duration::from_secs(8), || payload(&f, "app", "cert/web")
            .is_some_and(|p| p["serial"] == 2))
        .await,
        "the rotated certificate was never delivered"
    );
}

/// A provider killed with SIGKILL in the middle of a 20,000-request burst: every request
/// it answered 202 is in its state after the restart (the log's torn tail, if any, held
/// nothing acknowledged).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_9_in_the_middle_of_a_20k_burst_loses_nothing_acknowledged() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;
    const SENDERS: usize = 10;
    const PER_SENDER: usize = 2000;
    const KILL_AFTER: usize = 10_000;
    let mut f = Fleet::new();
    let h = f.script("ok", r#"jq -c 'with_entries(.value = "OK")'"#);
    let senders: Vec<String> = (0..SENDERS).map(|i| format!("bulk{i}")).collect();
    for s in &senders {
        f.principal(s);
    }
    f.capability(
        "p",
        "web",
        json!({"handler": h, "mode": "async", "allowed": senders}),
    );
    f.host("p").extra_toml = "max_entries_per_origin = 5000\nmax_connections_per_address = 256\n[gc]\ninterval = \"0s\"\n".into();
    f.start();
    let pid = f.agents["p"].pid();
    let accepted = Arc::new(AtomicUsize::new(0));
    let killed = Arc::new(AtomicBool::new(false));
    let f = Arc::new(f);
    let mut tasks = Vec::new();
    // Each sender keeps 8 requests in flight until the agent is gone.
    for s in &senders {
        for lane in 0..8 {
            let (f, s, accepted, killed) = (f.clone(), s.clone(), accepted.clone(), killed.clone());
            tasks.push(tokio::spawn(async move {
                let client = f.client(&s);
                let h = &f.hosts["p"];
                let (address, keys) = (h.address(), h.keys());
                let target = fort_core::client::Target {
                    name: "p",
                    address: &address,
                    keys: &keys,
                };
                let mut ok = Vec::new();
                for n in (lane..PER_SENDER).step_by(8) {
                    let need = format!("web/n{n:05}");
                    let body =
                        serde_json::to_vec(&json!({"need": need, "request": {"n": n}})).unwrap();
                    match client.post(&target, "/agent/capabilities/web", body).await {
                        Ok(r) if r.status == 202 => {
                            ok.push(format!("{s}:{need}"));
                            if accepted.fetch_add(1, Ordering::SeqCst) + 1 == KILL_AFTER
                                && !killed.swap(true, Ordering::SeqCst)
                            {
                                #[allow(unsafe_code)]
                                // SAFETY: kill(2) on the pid of our own child agent.
                                unsafe {
                                    libc::kill(pid as i32, libc::SIGKILL);
                                }
                            }
                        }
                        _ if killed.load(Ordering::SeqCst) => break,
                        Ok(r) => panic!("{need}: {}", r.status),
                        Err(e) => panic!("{need}: {e}"),
                    }
                }
                ok
            }));
        }
    }
    let mut acknowledged = Vec::new();
    for t in tasks {
        acknowledged.extend(t.await.unwrap());
    }
    assert!(killed.load(Ordering::SeqCst), "the agent was never killed");
    assert!(acknowledged.len() >= KILL_AFTER);
    let mut f = Arc::try_unwrap(f).ok().expect("no other owner");
    f.kill("p");
    f.start_host("p");
    let state = f.read_state("p", "provider-state.json");
    let entries = state["entries"].as_object().expect("the state reads back");
    let lost: Vec<&String> = acknowledged
        .iter()
        .filter(|k| !entries.contains_key(*k))
        .collect();
    assert!(
        lost.is_empty(),
        "{} of {} acknowledged entries lost, e.g. {:?}",
        lost.len(),
        acknowledged.len(),
        &lost[..lost.len().min(5)]
    );
    // And the restarted agent serves them: its own view agrees with the files.
    assert_eq!(
        f.status("p")["provider"]["capabilities"]["web"]["entries"]
            .as_u64()
            .unwrap() as usize,
        entries.len()
    );
}
