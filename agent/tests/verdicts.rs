//! Handler verdicts (docs/protocol.md §11.9) with real agents: a refusal reaches the
//! consumer that asked (in a callback, or in the answer to its next request when it takes
//! no callback batches), shows in its need state and makes it back off; work under way
//! keeps the response and says why it waits; a handler asks to be run again.

use std::time::Duration;

use fort_tests::{eventually, Fleet};
use serde_json::{json, Value};

/// A provider handler that answers every entry with `<dir>/answer` (read each run) and
/// counts runs in `<dir>/runs`.
fn provider(f: &mut Fleet, cap: &str, cache: bool) {
    let d = f.dir.path().display().to_string();
    let h = f.script(
        &format!("provide-{cap}"),
        &format!(
            r#"echo "$FORT_TRIGGER" >> {d}/runs; answer=$(cat {d}/answer); jq -c --argjson a "$answer" 'with_entries(.value = ($a | if type == "object" then del(.["$fort_rerun_after"]) else . end)) + ($a | if type == "object" and has("$fort_rerun_after") then {{"$fort_rerun_after": .["$fort_rerun_after"]}} else {{}} end)'"#
        ),
    );
    f.capability(
        "p",
        cap,
        json!({"handler": h, "mode": "async", "cacheResponse": cache}),
    );
}

fn answer(f: &Fleet, value: Value) {
    std::fs::write(f.dir.path().join("answer"), value.to_string()).unwrap();
}

fn runs(f: &Fleet) -> Vec<String> {
    std::fs::read_to_string(f.dir.path().join("runs"))
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

fn state(f: &Fleet, need: &str) -> Value {
    f.need_status("c", need)
}

async fn refused_and_backs_off(batches: bool) {
    let mut f = Fleet::new();
    provider(&mut f, "cert", false);
    answer(
        &f,
        json!({"$fort_refused": "www.example.net is not a name c may have"}),
    );
    if !batches {
        f.host("c").extra_toml = "batches = false\n".into();
    }
    f.need("c", "cert/web", "p", json!({"nag_seconds": 4}));
    f.start();
    let seen = eventually(Duration::from_secs(15), || {
        state(&f, "cert/web")["reason"]
            .as_str()
            .is_some_and(|r| r.contains("www.example.net is not a name c may have"))
    })
    .await;
    assert!(seen, "{}", state(&f, "cert/web"));
    let st = state(&f, "cert/web");
    assert_eq!(st["state"], "failed", "{st}");
    assert_eq!(
        st["reason"],
        "refused by p: www.example.net is not a name c may have"
    );
    // Asked again at the nag interval (4 s), not at once: over 6 s, one or two more.
    let attempts = st["attempts"].as_u64().unwrap();
    tokio::time::sleep(Duration::from_secs(6)).await;
    let more = state(&f, "cert/web")["attempts"].as_u64().unwrap() - attempts;
    assert!(
        (1..=2).contains(&more),
        "{more} requests in 6 s at a 4 s nag"
    );
    // The provider keeps the verdict beside the entry.
    let entry = f.read_state("p", "provider-state.json")["entries"]["c:cert/web"].clone();
    assert_eq!(
        entry["notice"],
        json!({"refused": "www.example.net is not a name c may have"}),
        "{entry}"
    );
    // Once the handler answers, the need is satisfied.
    answer(&f, json!("OK"));
    assert!(
        eventually(Duration::from_secs(10), || f.all_satisfied("c")).await,
        "{}",
        state(&f, "cert/web")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_reaches_the_consumer_in_a_callback_and_it_backs_off() {
    refused_and_backs_off(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_without_callback_batches_learns_the_refusal_from_its_next_answer() {
    refused_and_backs_off(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_under_way_keeps_the_response_and_says_why() {
    let mut f = Fleet::new();
    provider(&mut f, "cert", true);
    answer(&f, json!({"cert": "v1"}));
    let file = f.dir.path().join("out/cert");
    f.need(
        "c",
        "cert/web",
        "p",
        json!({"nag_seconds": 600, "files": [{"path": file, "pointer": "/cert"}]}),
    );
    f.start();
    assert!(eventually(Duration::from_secs(10), || f.all_satisfied("c")).await);
    answer(
        &f,
        json!({"$fort_pending": "order placed; waiting for the CA"}),
    );
    let (ok, out) = f.admin("p", &["trigger", "cert"]);
    assert!(ok, "{out}");
    assert!(
        eventually(Duration::from_secs(10), || {
            state(&f, "cert/web")["reason"]
                == "p is working on it: order placed; waiting for the CA"
        })
        .await,
        "{}",
        state(&f, "cert/web")
    );
    let st = state(&f, "cert/web");
    assert_eq!(st["state"], "satisfied", "still holds its payload: {st}");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "v1");
    let entry = f.read_state("p", "provider-state.json")["entries"]["c:cert/web"].clone();
    assert_eq!(entry["response"], json!({"cert": "v1"}), "{entry}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_asks_to_be_run_again() {
    let mut f = Fleet::new();
    provider(&mut f, "cert", false);
    answer(
        &f,
        json!({"$fort_pending": "waiting", "$fort_rerun_after": 1}),
    );
    f.need("c", "cert/web", "p", json!({"nag_seconds": 600}));
    f.start();
    assert!(
        eventually(Duration::from_secs(10), || {
            runs(&f).iter().filter(|r| *r == "rerun").count() >= 2
        })
        .await,
        "{:?}",
        runs(&f)
    );
    // Answered at last: no more reruns.
    answer(&f, json!("OK"));
    assert!(eventually(Duration::from_secs(10), || f.all_satisfied("c")).await);
    let settled = runs(&f).len();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(runs(&f).len(), settled, "{:?}", runs(&f));
}

fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_verdicts_for_one_consumer_go_out_together_and_the_provider_rests() {
    let mut f = Fleet::new();
    // One delivery at a time: verdicts handed back to the queue would never go out.
    f.host("p").extra_toml = "[callbacks]\nconcurrency = 1\n".into();
    let h = f.script(
        "provide",
        r#"jq -c 'with_entries(.value = {"$fort_refused": "not today"})'"#,
    );
    f.capability("p", "cert", json!({"handler": h, "mode": "async"}));
    let names: Vec<String> = (0..30).map(|i| format!("cert/n{i}")).collect();
    for n in &names {
        f.need("c", n, "p", json!({"nag_seconds": 600}));
    }
    f.start();
    let refused = |f: &Fleet| {
        names.iter().all(|n| {
            state(f, n)["reason"]
                .as_str()
                .is_some_and(|r| r == "refused by p: not today")
        })
    };
    assert!(
        eventually(Duration::from_secs(20), || refused(&f)).await,
        "{}",
        state(&f, &names[0])
    );
    // Nothing is owed any more: the provider idles (100 ticks a second is a whole core).
    let pid = f.agents["p"].pid();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let before = cpu_ticks(pid);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let spent = cpu_ticks(pid) - before;
    assert!(
        spent < 60,
        "the provider spent {spent} ticks in 3 s with nothing to do"
    );
}

/// A tmpfs mounted over a directory; unmounted on drop.
struct TinyDisk(std::path::PathBuf);

impl TinyDisk {
    fn mount(dir: &std::path::Path, size: &str) -> Option<TinyDisk> {
        std::fs::create_dir_all(dir).ok()?;
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .status()
            .ok()?
            .success();
        ok.then(|| TinyDisk(dir.to_path_buf()))
    }
}

impl Drop for TinyDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

/// Requests of `endpoint` answered with `status`, from an agent's metrics.
fn served(metrics_addr: std::net::SocketAddr, endpoint: &str, status: &str) -> u64 {
    let prefix = format!("fort_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}} ");
    fort_tests::metrics(metrics_addr)
        .lines()
        .find_map(|l| l.strip_prefix(&prefix).and_then(|n| n.trim().parse().ok()))
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_that_cannot_take_a_verdict_is_not_called_forever() {
    const T: &str = "a_consumer_that_cannot_take_a_verdict_is_not_called_forever";
    let mut f = Fleet::new();
    // The handler refuses the entry once `<dir>/refuse` exists (until then it has nothing
    // to say and looks again every second).
    let d = f.dir.path().display().to_string();
    let h = f.script(
        "refuse-later",
        &format!(
            r#"if [ -e {d}/refuse ]; then jq -c 'with_entries(.value = {{"$fort_refused": "not today"}})'; else echo '{{"$fort_rerun_after": 1}}'; fi"#
        ),
    );
    f.capability("p", "cert", json!({"handler": h, "mode": "async"}));
    f.host("p").extra_toml =
        "[callbacks]\nattempts = 3\nbackoff = \"200ms\"\nredeliver_interval = \"1h\"\n".into();
    let metrics = fort_tests::free_addr("127.0.0.1");
    f.host("c").extra_toml = format!("metrics_listen = \"{metrics}\"\n");
    // A key with many names: its CSR, kept in the need's state, makes every record of
    // the need larger than what is left of a page once the disk is full.
    let names: Vec<String> = (0..100)
        .map(|i| format!("n{i:03}-{}.example.test", "a".repeat(50)))
        .collect();
    f.need(
        "c",
        "cert/web",
        "p",
        json!({"nag_seconds": 3600,
               "request": {"csr": {"$fort_key": "tls", "as": "csr"}},
               "keys": {"tls": {"type": "ecdsa-p256", "names": names,
                                "path": f.dir.path().join("out/key.pem")}}}),
    );
    f.write_files();
    // The consumer's state on a disk that fills up: it answers each verdict `503` with
    // `retry_after`, as it cannot record it.
    let Some(_disk) = TinyDisk::mount(&f.host_dir("c").join("state"), "1m") else {
        return fort_tests::skip(
            T,
            "cannot mount a tmpfs here (needs root); a consumer that cannot record is untested",
        );
    };
    f.start();
    assert!(
        eventually(Duration::from_secs(10), || f
            .entries("p")
            .contains(&"c:cert/web".to_owned()))
        .await,
        "{:?}",
        f.entries("p")
    );
    let _ = std::process::Command::new("dd")
        .args(["if=/dev/zero", "bs=4k", "count=1000"])
        .arg(format!(
            "of={}",
            f.host_dir("c").join("state/filler").display()
        ))
        .output();
    std::fs::write(f.dir.path().join("refuse"), "").unwrap();
    assert!(
        eventually(Duration::from_secs(15), || served(
            metrics,
            "callbacks",
            "200"
        ) >= 1)
        .await,
        "the verdict was never sent"
    );
    // Answered 503 every 5 s: sent `[callbacks] attempts` times, then left to the
    // redelivery sweep and the consumer's nag, not sent every 5 s forever.
    tokio::time::sleep(Duration::from_secs(25)).await;
    let sent = served(metrics, "callbacks", "200");
    assert!(
        (2..=3).contains(&sent),
        "the verdict was sent {sent} times in 25 s"
    );
    let delivery =
        f.read_state("p", "provider-state.json")["entries"]["c:cert/web"]["delivery"].clone();
    assert_eq!(delivery["attempts"], 3, "{delivery}");
    assert!(
        delivery["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("503")),
        "{delivery}"
    );
}
