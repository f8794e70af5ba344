//! Provider orchestration against real agents: bursts coalesce, 202 means durable,
//! misbehaving handlers change nothing, triggers call back only what changed.

use std::time::Duration;

use fort_tests::{eventually, Fleet};
use serde_json::{json, Value};

/// An async handler: each entry's response is its cached one, or a fresh one derived
/// from a per-consumer version file (so a test can change one response). Each run
/// appends a line to `runs`.
fn provider_script(f: &Fleet) -> std::path::PathBuf {
    let d = f.dir.path().display();
    f.script(
        "issue",
        &format!(
            r#"echo run >> {d}/runs
mode=$(cat {d}/mode 2>/dev/null || echo ok)
case "$mode" in
  fail) exit 3 ;;
  hang) sleep 30 ;;
  garbage) echo 'this is not json'; exit 0 ;;
  array) echo '[1,2]'; exit 0 ;;
  huge) head -c 100000000 /dev/zero | tr '\0' 'x'; exit 0 ;;
esac
out=$(jq -c 'with_entries(.value = (.value.response // {{"client": .key, "secret": ("s-" + .key)}}))')
for f in {d}/version-*; do
  [ -e "$f" ] || continue
  who=${{f##*/version-}}
  v=$(cat "$f")
  out=$(printf '%s' "$out" | jq -c --arg who "$who" --arg v "$v" 'with_entries(if (.key | startswith($who + ":")) then .value.v = $v else . end)')
done
if [ "$mode" = stray ]; then out=$(printf '%s' "$out" | jq -c '. + {{"nobody:x/y": 1}}'); fi
printf '%s' "$out""#
        ),
    )
}

/// Consumer handler: store the payload and log the run.
fn consumer_script(f: &Fleet) -> std::path::PathBuf {
    let d = f.dir.path().display();
    f.script(
        "receive",
        &format!(r#"mkdir -p {d}/got; n=$(echo "$FORT_HOST-$FORT_NEED" | tr / _); cat > {d}/got/$n; echo "$n" >> {d}/callbacks"#),
    )
}

fn handler_runs(f: &Fleet) -> usize {
    std::fs::read_to_string(f.dir.path().join("runs"))
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

fn callbacks_for(f: &Fleet, who: &str) -> usize {
    std::fs::read_to_string(f.dir.path().join("callbacks"))
        .map(|s| {
            s.lines()
                .filter(|l| l.starts_with(&format!("{who}-")))
                .count()
        })
        .unwrap_or(0)
}

fn got(f: &Fleet, host: &str, need: &str) -> Option<Value> {
    let n = format!("{host}-{}", need.replace('/', "_"));
    std::fs::read(f.dir.path().join("got").join(n))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_burst_of_200_requests_from_20_hosts_coalesces() {
    let mut f = Fleet::new();
    let issue = provider_script(&f);
    let receive = consumer_script(&f);
    f.capability(
        "forge",
        "oidc",
        json!({"handler": issue, "mode": "async", "cacheResponse": true}),
    );
    let consumers: Vec<String> = (0..20).map(|i| format!("c{i:02}")).collect();
    for c in &consumers {
        for n in 0..10 {
            f.need(
                c,
                &format!("oidc/app{n}"),
                "forge",
                json!({"handler": receive, "nag_seconds": 600, "request": {"n": n}}),
            );
        }
    }
    f.start();
    // On top of the consumers' own start-up requests, 200 more at once from the test.
    let calls = consumers
        .iter()
        .flat_map(|c| {
            (0..10).map(move |n| {
                (
                    c.clone(),
                    json!({"need": format!("oidc/app{n}"), "request": {"n": n}}),
                )
            })
        })
        .collect();
    let statuses = f
        .post_concurrently("forge", "/agent/capabilities/oidc", calls)
        .await;
    assert!(statuses.iter().all(|s| *s == Some(202)), "{statuses:?}");
    let done = eventually(Duration::from_secs(30), || {
        consumers.iter().all(|c| f.all_satisfied(c))
    })
    .await;
    assert!(done, "not every consumer converged");
    for c in &consumers {
        for n in 0..10 {
            let v = got(&f, c, &format!("oidc/app{n}")).expect("payload stored");
            assert_eq!(v["client"], json!(format!("{c}:oidc/app{n}")));
        }
    }
    let state = f.read_state("forge", "provider-state.json");
    assert!(state["entries"].is_object(), "the state reads back");
    assert_eq!(state["entries"].as_object().unwrap().len(), 200);
    let runs = handler_runs(&f);
    assert!(runs < 100, "handler ran {runs} times for 400 requests");
    let writes = f.status("forge")["provider"]["state_writes"]
        .as_u64()
        .unwrap();
    assert!(writes < 400, "state written {writes} times");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_9_after_accepting_loses_nothing() {
    let mut f = Fleet::new();
    let issue = provider_script(&f);
    let receive = consumer_script(&f);
    // A slow handler: the kill lands before any callback could be sent.
    std::fs::write(f.dir.path().join("slow"), "").unwrap();
    let slow = f.script("slow-issue", &format!("sleep 3; exec {}", issue.display()));
    f.capability("forge", "oidc", json!({"handler": slow, "mode": "async", "cacheResponse": true, "triggers": {"initialize": false}}));
    let consumers: Vec<String> = (0..5).map(|i| format!("k{i}")).collect();
    for c in &consumers {
        for n in 0..10 {
            f.need(
                c,
                &format!("oidc/n{n}"),
                "forge",
                json!({"handler": receive, "nag_seconds": 3600}),
            );
        }
    }
    f.write_files();
    f.start_host("forge");
    let calls = consumers
        .iter()
        .flat_map(|c| {
            (0..10).map(move |n| {
                (
                    c.clone(),
                    json!({"need": format!("oidc/n{n}"), "request": {}}),
                )
            })
        })
        .collect();
    let statuses = f
        .post_concurrently("forge", "/agent/capabilities/oidc", calls)
        .await;
    assert_eq!(statuses.iter().filter(|s| **s == Some(202)).count(), 50);
    f.kill("forge");
    let state = f.read_state("forge", "provider-state.json");
    assert_eq!(
        state["entries"].as_object().unwrap().len(),
        50,
        "every 202 is on disk"
    );
    // Consumers come up (their nag is an hour away: only the provider can make them
    // converge), then the provider restarts: without any `initialize` trigger, the
    // requesters it still owes a response are run and called back.
    for c in &consumers {
        f.start_host(c);
    }
    f.start_host("forge");
    let done = eventually(Duration::from_secs(40), || {
        consumers.iter().all(|c| f.all_satisfied(c))
    })
    .await;
    assert!(
        done,
        "not every requester was called back after the restart"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn misbehaving_handlers_change_nothing() {
    let mut f = Fleet::new();
    let issue = provider_script(&f);
    let receive = consumer_script(&f);
    f.capability(
        "forge",
        "oidc",
        json!({"handler": issue, "mode": "async", "cacheResponse": true}),
    );
    f.host("forge").extra_toml = "handler_timeout = \"1s\"".into();
    f.need("app", "oidc/one", "forge", json!({"handler": receive}));
    f.need("app", "oidc/two", "forge", json!({"handler": receive}));
    f.start();
    assert!(eventually(Duration::from_secs(15), || f.all_satisfied("app")).await);
    let before = f.read_state("forge", "provider-state.json")["entries"].clone();
    for mode in ["fail", "hang", "garbage", "array", "huge"] {
        std::fs::write(f.dir.path().join("mode"), mode).unwrap();
        let (ok, out) = f.admin("forge", &["trigger", "oidc", "--force"]);
        assert!(!ok, "{mode}: trigger reported success: {out}");
        let after = f.read_state("forge", "provider-state.json")["entries"].clone();
        let strip = |v: &Value| -> Value {
            v.as_object()
                .unwrap()
                .iter()
                .map(|(k, e)| (k.clone(), json!([e["request"], e["response"]])))
                .collect()
        };
        assert_eq!(strip(&after), strip(&before), "{mode} changed the state");
        let last = &f.status("forge")["provider"]["capabilities"]["oidc"]["last_run"];
        assert_eq!(last["ok"], false, "{mode}");
        assert!(
            last["error"].as_str().is_some_and(|e| !e.is_empty()),
            "{mode}: {last}"
        );
    }
    assert!(f.all_satisfied("app"), "a failed run revoked something");
    // Keys that were not in the input are ignored; the rest applies.
    std::fs::write(f.dir.path().join("mode"), "stray").unwrap();
    let (ok, out) = f.admin("forge", &["trigger", "oidc"]);
    assert!(ok, "{out}");
    let entries = f.read_state("forge", "provider-state.json")["entries"].clone();
    assert!(entries.get("nobody:x/y").is_none());
    assert_eq!(entries.as_object().unwrap().len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_trigger_that_changes_one_response_calls_back_only_that_consumer() {
    let mut f = Fleet::new();
    let issue = provider_script(&f);
    let receive = consumer_script(&f);
    f.capability(
        "forge",
        "oidc",
        json!({"handler": issue, "mode": "async", "cacheResponse": true}),
    );
    for c in ["u1", "u2", "u3"] {
        f.need(c, "oidc/web", "forge", json!({"handler": receive}));
    }
    f.start();
    assert!(
        eventually(Duration::from_secs(15), || ["u1", "u2", "u3"]
            .iter()
            .all(|c| f.all_satisfied(c)))
        .await
    );
    let before: Vec<usize> = ["u1", "u2", "u3"]
        .iter()
        .map(|c| callbacks_for(&f, c))
        .collect();
    std::fs::write(f.dir.path().join("version-u2"), "2").unwrap();
    let (ok, out) = f.admin("forge", &["trigger", "oidc"]);
    assert!(ok, "{out}");
    assert!(
        eventually(Duration::from_secs(10), || callbacks_for(&f, "u2")
            == before[1] + 1)
        .await
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(callbacks_for(&f, "u1"), before[0]);
    assert_eq!(callbacks_for(&f, "u3"), before[2]);
    assert_eq!(got(&f, "u2", "oidc/web").unwrap()["v"], "2");
    // The cached secret survived the change of another field.
    assert_eq!(
        got(&f, "u2", "oidc/web").unwrap()["secret"],
        "s-u2:oidc/web"
    );
}

/// Finding: a caller could store anything — 10,000 need ids its host never declared were
/// accepted and handed to the handler, and twenty 1 MiB requests took the provider from
/// 7 MB to 645 MB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_hold_their_declared_needs_and_others_a_bounded_number() {
    let mut f = Fleet::new();
    let issue = provider_script(&f);
    f.principal("ops");
    f.capability(
        "p",
        "oidc",
        json!({"handler": issue, "mode": "async", "allowed": ["ops"]}),
    );
    f.need("c", "oidc/wiki", "p", json!({"nag_seconds": 600}));
    f.host("p").extra_toml = "max_entries_per_origin = 3\n".into();
    f.start();
    let ask = |who: &'static str, need: &str, request: Value| {
        let body = json!({"need": need, "request": request});
        let f = &f;
        async move {
            f.post(who, "p", "/agent/capabilities/oidc", &body)
                .await
                .status
        }
    };
    // A host among the callers: its declared id yes, any other no.
    assert_eq!(ask("c", "oidc/wiki", json!({})).await, 202);
    for i in 0..20 {
        assert_eq!(ask("c", &format!("oidc/made-up-{i}"), json!({})).await, 403);
    }
    // A principal in `allowed`: a few of its own choosing, then 429.
    for i in 0..3 {
        assert_eq!(ask("ops", &format!("oidc/p{i}"), json!({})).await, 202);
    }
    assert_eq!(ask("ops", "oidc/p3", json!({})).await, 429);
    assert_eq!(
        ask("ops", "oidc/p0", json!({"again": true})).await,
        202,
        "refreshing an entry it holds"
    );
    // A release frees a place.
    let r = f
        .post(
            "ops",
            "p",
            "/agent/capabilities/oidc",
            &json!({"need": "oidc/p1", "release": true}),
        )
        .await;
    assert_eq!(r.status, 202);
    assert_eq!(ask("ops", "oidc/p3", json!({})).await, 202);
    // Stored requests are small: a 1 MiB one is refused before anything is kept.
    let rss_before = rss_kb(f.agents["p"].pid());
    for i in 0..20 {
        let big = json!({"blob": "x".repeat(1024 * 1000)});
        assert_eq!(ask("ops", &format!("oidc/p{}", i % 3), big).await, 413);
    }
    let rss_after = rss_kb(f.agents["p"].pid());
    assert!(
        rss_after < rss_before + 30_000,
        "RSS grew from {rss_before} to {rss_after} kB"
    );
    let mut keys = f.entries("p");
    keys.sort();
    assert_eq!(
        keys,
        ["c:oidc/wiki", "ops:oidc/p0", "ops:oidc/p2", "ops:oidc/p3"]
    );
}

fn rss_kb(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Finding: a caller whose address accepts TCP but never answers delayed another
/// consumer's callback from 0.6 s to 89 s: one shared pool of delivery slots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_that_never_answers_does_not_delay_the_others() {
    let mut f = Fleet::new();
    let issue = provider_script(&f);
    let receive = consumer_script(&f);
    f.capability("p", "oidc", json!({"handler": issue, "mode": "async"}));
    // The tarpit: a host of the fleet whose address accepts and then says nothing.
    let ids: Vec<String> = (0..60).map(|i| format!("t{i}")).collect();
    for id in &ids {
        f.need(
            "tarpit",
            &format!("oidc/{id}"),
            "p",
            json!({"nag_seconds": 600}),
        );
    }
    f.need(
        "c",
        "oidc/wiki",
        "p",
        json!({"handler": receive, "nag_seconds": 600}),
    );
    // The test makes the tarpit's 60 requests at once, from its one address.
    f.host("p").extra_toml = "max_connections_per_address = 128\n".into();
    f.write_files();
    let tarpit = std::net::TcpListener::bind(f.hosts["tarpit"].addr).unwrap();
    let held = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let keep = held.clone();
    std::thread::spawn(move || {
        for s in tarpit.incoming().flatten() {
            keep.lock().unwrap().push(s);
        }
    });
    f.start_host("p");
    // The tarpit's entries first, as its own requests would have made them.
    let calls = ids
        .iter()
        .map(|id| {
            (
                "tarpit".to_owned(),
                json!({"need": format!("oidc/{id}"), "request": {}}),
            )
        })
        .collect();
    let statuses = f
        .post_concurrently("p", "/agent/capabilities/oidc", calls)
        .await;
    assert!(statuses.iter().all(|s| *s == Some(202)), "{statuses:?}");
    assert!(eventually(Duration::from_secs(10), || held.lock().unwrap().len() >= 4).await);
    // Now an honest consumer asks: its callback is not queued behind 60 timeouts.
    let started = std::time::Instant::now();
    f.start_host("c");
    assert!(
        eventually(Duration::from_secs(10), || got(&f, "c", "oidc/wiki")
            .is_some())
        .await,
        "the honest consumer's callback was held back"
    );
    assert!(started.elapsed() < Duration::from_secs(8));
    assert!(
        held.lock().unwrap().len() <= 8,
        "{} deliveries to the tarpit at once",
        held.lock().unwrap().len()
    );
}

/// Finding: handlers inherited the agent's whole environment and working directory, a
/// `setsid` grandchild survived the process-group kill, and a handler that exited 0 but
/// left a child holding stdout counted as a timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handlers_get_a_clean_environment_and_leave_nothing_behind() {
    let mut f = Fleet::new();
    let d = f.dir.path().display().to_string();
    let h = f.script(
        "clean",
        &format!(
            r#"env > {d}/env; pwd > {d}/cwd
setsid sh -c 'echo $$ > {d}/orphan; exec sleep 300' &
sleep 300 &
jq -c 'with_entries(.value = "OK")'"#
        ),
    );
    f.capability("p", "proxy", json!({"handler": h, "mode": "async"}));
    f.need("c", "proxy/site", "p", json!({"nag_seconds": 600}));
    let p = f.host("p");
    p.spawn
        .env
        .push(("AGENT_ONLY_SECRET".into(), "hunter2".into()));
    p.extra_toml =
        "handler_timeout = \"20s\"\nhandler_environment = { FROM_CONFIG = \"yes\" }\n".into();
    f.start();
    let started = std::time::Instant::now();
    assert!(
        eventually(Duration::from_secs(10), || f.all_satisfied("c")).await,
        "the handler exited 0 but its run was not counted as done"
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "waited for the lingering children"
    );
    let env = std::fs::read_to_string(f.dir.path().join("env")).unwrap();
    assert!(!env.contains("AGENT_ONLY_SECRET"), "{env}");
    assert!(env.contains("FROM_CONFIG=yes") && env.contains("FORT_CAPABILITY=proxy"));
    assert!(env.lines().any(|l| l.starts_with("PATH=")));
    assert_eq!(
        std::fs::read_to_string(f.dir.path().join("cwd"))
            .unwrap()
            .trim(),
        "/"
    );
    let orphan: u32 = std::fs::read_to_string(f.dir.path().join("orphan"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let gone = || {
        std::fs::read_to_string(format!("/proc/{orphan}/stat"))
            .map(|s| s.split(") ").nth(1).is_some_and(|r| r.starts_with('Z')))
            .unwrap_or(true)
    };
    assert!(
        eventually(Duration::from_secs(5), gone).await,
        "the setsid grandchild {orphan} survived its handler"
    );
}
