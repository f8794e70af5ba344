//! Batches (docs/protocol.md §11.8) against real agents: needs that come due together
//! travel to their provider in batches and come back in batches; every item is decided as
//! the single endpoint decides it; and agents that take no batches get items one by one,
//! in both directions.

use std::net::SocketAddr;
use std::time::Duration;

use fort_tests::{eventually, free_addr, metrics, Fleet};
use serde_json::{json, Value};

/// Requests of `endpoint` answered with `status`, from the agent's metrics.
fn served(metrics_addr: SocketAddr, endpoint: &str, status: &str) -> u64 {
    let prefix = format!("fort_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}} ");
    metrics(metrics_addr)
        .lines()
        .find_map(|l| l.strip_prefix(&prefix).and_then(|n| n.trim().parse().ok()))
        .unwrap_or(0)
}

struct Setup {
    f: Fleet,
    provider_metrics: SocketAddr,
    consumer_metrics: SocketAddr,
}

/// A provider `p` whose capability `cred` answers `OK` to everything, and a consumer `c`
/// with `needs` needs of it. `*_toml`: top-level agent.toml keys of each. The handler
/// takes a moment, so requests arriving one by one are answered together.
fn setup(needs: usize, provider_toml: &str, consumer_toml: &str) -> Setup {
    setup_with(needs, provider_toml, consumer_toml, "\"OK\"")
}

/// As [`setup`], the handler answering every entry with the jq expression `answer`.
fn setup_with(needs: usize, provider_toml: &str, consumer_toml: &str, answer: &str) -> Setup {
    let mut f = Fleet::new();
    let ok = f.script(
        "ok",
        &format!("sleep 0.3; exec jq -c 'with_entries(.value = {answer})'"),
    );
    f.capability("p", "cred", json!({"handler": ok, "mode": "async"}));
    for i in 0..needs {
        f.need(
            "c",
            &format!("cred/n{i:03}"),
            "p",
            json!({"nag_seconds": 3600, "request": {"n": i}}),
        );
    }
    let provider_metrics = free_addr("127.0.0.1");
    let consumer_metrics = free_addr("127.0.0.1");
    f.host("p").extra_toml = format!(
        "{provider_toml}metrics_listen = \"{provider_metrics}\"\n[callbacks]\nbackoff = \"200ms\"\n"
    );
    f.host("c").extra_toml = format!(
        "{consumer_toml}metrics_listen = \"{consumer_metrics}\"\n[fulfill]\nbackoff = \"200ms\"\n"
    );
    Setup {
        f,
        provider_metrics,
        consumer_metrics,
    }
}

fn satisfied_count(f: &Fleet, host: &str) -> u64 {
    f.status(host)["needs"]["satisfied"].as_u64().unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn needs_due_together_travel_in_batches_both_ways() {
    let mut s = setup(300, "", "");
    s.f.start();
    assert!(
        eventually(Duration::from_secs(60), || s.f.all_satisfied("c")).await,
        "{} of 300 satisfied",
        satisfied_count(&s.f, "c")
    );
    // 300 requests in at least two batches (256 at most each).
    let batches = served(s.provider_metrics, "batch", "200");
    let alone = served(s.provider_metrics, "cred", "202");
    assert!(batches >= 2, "{batches} batches of requests");
    // The first to come due may go alone, before the others join its lane, and on a busy
    // machine a few stragglers do too; unbatched, all 300 would.
    assert!(alone < 30, "{alone} requests sent alone");
    assert!(batches < 30, "{batches} batches for 300 requests");
    // The callbacks came back mostly batched: far fewer callback requests than needs.
    let batched = served(s.consumer_metrics, "callbacks", "200");
    let single = served(s.consumer_metrics, "callback", "200");
    assert!(batched >= 1, "no batched callbacks");
    assert!(
        batched + single < 100,
        "{batched} batched and {single} single callback requests for 300 needs"
    );
    // Every entry is stored and acknowledged, as with single requests.
    let state = s.f.read_state("p", "provider-state.json");
    let entries = state["entries"].as_object().unwrap();
    assert_eq!(entries.len(), 300);
    assert!(s.f.entries("p").iter().all(|k| k.starts_with("c:cred/n")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_is_decided_item_by_item() {
    // No answers, so that no callback of the provider's crosses the ones sent by hand.
    let mut s = setup_with(2, "", "", "null");
    let f = &mut s.f;
    f.host("x");
    let rpc = f.script("rpc", "cat");
    f.capability(
        "p",
        "ask",
        json!({"handler": rpc, "mode": "rpc", "allowed": ["c"]}),
    );
    f.write_files();
    f.start_host("p");
    let path = "/agent/capabilities/cred/batch";
    let reply = f
        .post(
            "c",
            "p",
            path,
            &json!({"requests": [
                {"need": "cred/n000", "request": {"n": 0}},
                {"need": "cred/undeclared", "request": {}},
                {"need": "other/n001", "request": {}},
                {"need": "cred/n001", "request": "not an object"},
                {"need": "cred/n000", "request": {"n": 0}},
                {"need": "cred/n001", "request": {}, "surprise": true},
                {"need": "cred/gone", "release": true},
            ]}),
        )
        .await;
    assert_eq!(reply.status, 200);
    assert!(reply.verified());
    let body: Value = serde_json::from_slice(&reply.body).unwrap();
    let statuses: Vec<u64> = body["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["status"].as_u64().unwrap())
        .collect();
    assert_eq!(statuses, [202, 403, 400, 400, 400, 400, 202]);
    assert_eq!(body["results"][0]["body"], json!({"status": "accepted"}));
    assert_eq!(body["results"][1]["body"]["error"], "forbidden");
    assert!(body["results"][4]["body"]["message"]
        .as_str()
        .unwrap()
        .contains("already an item"));
    // Only the good item is stored, and it is on disk.
    assert_eq!(f.entries("p"), ["c:cred/n000"]);

    // Refused as a whole: empty, too many, not the shape; and 404 where batches are not
    // taken, so that the sender falls back to single requests.
    let too_many: Vec<Value> = (0..257)
        .map(|i| json!({"need": format!("cred/x{i}"), "request": {}}))
        .collect();
    for (path, body, status) in [
        (path, json!({"requests": []}), 400),
        (path, json!({"requests": too_many}), 400),
        (path, json!([{"need": "cred/n000", "request": {}}]), 400),
        (
            "/agent/capabilities/ask/batch",
            json!({"requests": [{"need": "ask/a", "request": {}}]}),
            404,
        ),
        (
            "/agent/capabilities/nope/batch",
            json!({"requests": [{"need": "nope/a", "request": {}}]}),
            404,
        ),
        (
            "/agent/capabilities/status/batch",
            json!({"requests": [{"need": "status/a", "request": {}}]}),
            404,
        ),
    ] {
        let reply = f.post("c", "p", path, &body).await;
        assert_eq!(reply.status, status, "{path} {body}");
    }
    assert_eq!(f.entries("p"), ["c:cred/n000"]);

    // Callbacks: the provider of each need only, each item on its own.
    f.start_host("c");
    let reply = f
        .post(
            "p",
            "c",
            "/agent/callbacks",
            &json!({"callbacks": [
                {"need": "cred/n000", "payload": "OK"},
                {"need": "cred/undeclared", "payload": "OK"},
                {"need": "cred/n001", "payload": "not OK"},
                {"need": "cred/n000", "payload": "OK"},
            ]}),
        )
        .await;
    assert_eq!(reply.status, 200);
    let body: Value = serde_json::from_slice(&reply.body).unwrap();
    let results = body["results"].as_array().unwrap();
    let statuses: Vec<u64> = results
        .iter()
        .map(|r| r["status"].as_u64().unwrap())
        .collect();
    assert_eq!(statuses, [200, 404, 200, 400]);
    assert_eq!(
        results[0]["body"],
        json!({"need": "cred/n000", "satisfied": true})
    );
    assert_eq!(
        results[2]["body"],
        json!({"need": "cred/n001", "satisfied": false})
    );
    // From a host that is not the needs' provider: every item refused, nothing applied.
    let reply = f
        .post(
            "x",
            "c",
            "/agent/callbacks",
            &json!({"callbacks": [{"need": "cred/n001", "payload": "OK"}]}),
        )
        .await;
    let body: Value = serde_json::from_slice(&reply.body).unwrap();
    assert_eq!(body["results"][0]["status"], 403);
    assert_eq!(f.need_status("c", "cred/n001")["satisfied"], false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_that_takes_no_batches_gets_requests_one_by_one() {
    let mut s = setup(40, "batches = false\n", "");
    s.f.start();
    assert!(
        eventually(Duration::from_secs(60), || s.f.all_satisfied("c")).await,
        "{} of 40 satisfied",
        satisfied_count(&s.f, "c")
    );
    assert!(served(s.provider_metrics, "batch", "404") >= 1);
    assert_eq!(served(s.provider_metrics, "batch", "200"), 0);
    assert_eq!(served(s.provider_metrics, "cred", "202"), 40);
    // It never marked the consumer as taking batches: callbacks went one by one.
    assert_eq!(served(s.consumer_metrics, "callbacks", "200"), 0);
    assert_eq!(served(s.consumer_metrics, "callback", "200"), 40);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_that_stops_taking_batches_gets_callbacks_one_by_one() {
    let mut s = setup(20, "", "");
    s.f.start();
    assert!(eventually(Duration::from_secs(60), || s.f.all_satisfied("c")).await);
    assert!(served(s.consumer_metrics, "callbacks", "200") >= 1);
    // The consumer comes back speaking protocol 1.1 only, with new needs, which it asks
    // for one by one; the provider still takes it for a batching consumer, is answered
    // 404, and sends the callbacks one by one.
    s.f.kill("c");
    for i in 20..30 {
        s.f.need(
            "c",
            &format!("cred/n{i:03}"),
            "p",
            json!({"nag_seconds": 3600, "request": {"n": i}}),
        );
    }
    let m = s.consumer_metrics;
    s.f.host("c").extra_toml =
        format!("batches = false\nmetrics_listen = \"{m}\"\n[fulfill]\nbackoff = \"200ms\"\n");
    s.f.write_files();
    // The provider learns the new need ids (its callers) before the consumer asks.
    let before = s.f.status("p")["manifest_sha256"].clone();
    s.f.agents["p"].hup();
    assert!(
        eventually(Duration::from_secs(10), || s.f.status("p")
            ["manifest_sha256"]
            != before)
        .await
    );
    s.f.start_host("c");
    assert!(
        eventually(Duration::from_secs(60), || s.f.all_satisfied("c")).await,
        "{} of 30 satisfied",
        satisfied_count(&s.f, "c")
    );
    assert!(served(s.provider_metrics, "cred", "202") >= 10);
    assert!(served(m, "callbacks", "404") >= 1, "no batch was refused");
    assert!(served(m, "callback", "200") >= 10);
}

/// A batch of callbacks whose handlers take long is answered inside the provider's
/// timeout: what cannot start within 10 s is told to come back (here 8 of the 24, after
/// two rounds of 8 six-second handlers), nothing is applied twice, and no more handlers
/// run at once than a few single callbacks would start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_handlers_in_a_callback_batch_run_once_each_and_a_few_at_a_time() {
    let mut s = setup(24, "", "");
    let runs = s.f.dir.path().join("runs");
    let slow = s.f.script(
        "slow",
        &format!(
            "cat >/dev/null; echo s >> {r}; sleep 6; echo e >> {r}",
            r = runs.display()
        ),
    );
    for i in 0..24 {
        s.f.host("c")
            .needs
            .get_mut(&format!("cred/n{i:03}"))
            .unwrap()["handler"] = json!(slow);
    }
    s.f.start();
    assert!(
        eventually(Duration::from_secs(90), || s.f.all_satisfied("c")).await,
        "{} of 24 satisfied",
        satisfied_count(&s.f, "c")
    );
    let log = std::fs::read_to_string(&runs).unwrap();
    let (mut running, mut most) = (0i32, 0i32);
    for line in log.lines() {
        running += if line == "s" { 1 } else { -1 };
        most = most.max(running);
    }
    assert_eq!(
        log.lines().filter(|l| *l == "s").count(),
        24,
        "handler runs"
    );
    // Eight from batches at most; a callback that went alone (a run that answered one
    // entry) is bounded by request slots, as before batches, and may run beside them.
    assert!(
        most <= 10,
        "{most} handlers at once (24 would all start without a bound)"
    );
    assert!(served(s.consumer_metrics, "callbacks", "200") >= 1);
    let failed = metrics(s.provider_metrics)
        .lines()
        .any(|l| l.starts_with("fort_callbacks_total{outcome=\"failed\"}"));
    assert!(!failed, "a callback attempt failed");
}

/// A consumer whose body limit is smaller than a batch gets its callbacks one by one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_with_a_small_body_limit_gets_callbacks_one_by_one() {
    // Quotes: each payload travels escaped, twice its length.
    let mut s = setup_with(40, "", "body_limit = 65536\n", r#"("\"" * 3000)"#);
    let got = s.f.dir.path().join("got");
    let keep = s.f.script(
        "keep",
        &format!(
            "mkdir -p {g}; cat > {g}/$(echo $FORT_NEED | tr / _)",
            g = got.display()
        ),
    );
    for n in s.f.host("c").needs.values_mut() {
        n["handler"] = json!(keep);
    }
    s.f.start();
    assert!(
        eventually(Duration::from_secs(60), || s.f.all_satisfied("c")).await,
        "{} of 40 satisfied",
        satisfied_count(&s.f, "c")
    );
    let log = std::fs::read_to_string(s.f.host_dir("p").join("agent.log")).unwrap();
    assert!(log.contains("takes no batched callbacks"));
    let payload = std::fs::read(got.join("cred_n007")).unwrap();
    assert_eq!(payload, vec![b'"'; 3000]);
}
