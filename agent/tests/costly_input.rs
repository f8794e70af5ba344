//! Input that costs the agent more than it should, with real agents: request schemas
//! whose patterns could backtrack for seconds, size limits checked before a schema is,
//! one origin against a lowered nonce capacity, and the memory a large plan leaves behind.

use std::time::Duration;

use fort_tests::{eventually, Fleet};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_pattern_that_can_backtrack_is_refused_when_loaded() {
    let mut f = Fleet::new();
    // A backreference under anyOf: with a backtracking engine, one 47 KB request took
    // 31 s of CPU on the agent's runtime threads.
    let h = f.script("h", "cat >/dev/null; echo '{}'");
    f.capability(
        "p",
        "costly",
        json!({"handler": h, "mode": "async", "request_schema": {
            "type": "object",
            "properties": {"items": {"type": "array", "items": {"anyOf": [
                {"type": "string", "pattern": "^(a+)+\\1$"},
                {"type": "string", "pattern": "^b$"}
            ]}}}
        }}),
    );
    f.write_files();
    let err = f
        .try_start_host("p")
        .expect_err("loaded a backtracking pattern");
    assert!(err.contains("request_schema"), "{err}");
    let (ok, out) = f.admin("p", &["check", "--skip-handlers"]);
    assert!(!ok, "check passed: {out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn size_limits_are_checked_before_the_schema_and_big_requests_do_not_stall_others() {
    let mut f = Fleet::new();
    let h = f.script("h", "jq -c 'with_entries(.value = \"OK\")'");
    f.capability(
        "p",
        "tok",
        json!({"handler": h, "mode": "async", "allowed": ["ops"], "request_schema": {
            "type": "object",
            "properties": {"items": {"type": "array", "items": {"anyOf": [
                {"type": "string", "pattern": "^(a|aa)+$"},
                {"type": "string", "pattern": "^[a-z]+[0-9]*x$"}
            ]}}}
        }}),
    );
    f.host("p").extra_toml = "max_request_bytes = 4096\n".into();
    f.principal("ops");
    f.start();
    // Over the size limit and breaking the schema: 413, the cheap answer.
    let big = vec!["a".repeat(60); 100];
    let r = f
        .post(
            "ops",
            "p",
            "/agent/capabilities/tok",
            &json!({"need": "tok/x", "request": {"items": big, "extra": 1}}),
        )
        .await;
    assert_eq!(r.status, 413, "{}", String::from_utf8_lossy(&r.body));
    // Requests at the limit, with long strings for the patterns, in parallel: the agent
    // still answers its status at once meanwhile.
    let item = "a".repeat(3900);
    let bodies: Vec<_> = (0..8)
        .map(|i| json!({"need": format!("tok/n{i}"), "request": {"items": [item]}}))
        .collect();
    let calls: Vec<_> = bodies
        .iter()
        .map(|body| f.post("ops", "p", "/agent/capabilities/tok", body))
        .collect();
    let status = async {
        let started = std::time::Instant::now();
        let (ok, _) = f.admin("p", &["status"]);
        (ok, started.elapsed())
    };
    let (results, (ok, took)) = tokio::join!(futures_util::future::join_all(calls), status);
    assert!(ok);
    assert!(took < Duration::from_secs(5), "status took {took:?}");
    for r in results {
        assert_eq!(r.status, 202, "{}", String::from_utf8_lossy(&r.body));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_origin_gets_a_fair_share_of_a_lowered_nonce_capacity() {
    let mut f = Fleet::new();
    f.principal("noisy");
    f.principal("ops");
    // The per-origin quota is left at its default (250,000): it must shrink with the
    // capacity, or one origin fills the store and everyone else gets 503.
    f.host("a").extra_toml = "nonce_capacity = 800\n".into();
    f.start();
    let mut ok = 0;
    for _ in 0..150 {
        let r = f
            .post("noisy", "a", "/agent/capabilities/status", &json!({}))
            .await;
        ok += (r.status == 200) as usize;
    }
    assert_eq!(ok, 100, "an eighth of 800");
    for _ in 0..20 {
        let r = f
            .post("ops", "a", "/agent/capabilities/status", &json!({}))
            .await;
        assert_eq!(r.status, 200, "another origin was locked out");
    }
}

fn rss_kb(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_plan_leaves_no_large_heap_behind() {
    let mut f = Fleet::new();
    f.host("a");
    f.host("b");
    f.start();
    // About 56 MiB of needs: 20,000 needs with 2.8 KB requests each.
    let mut needs = serde_json::Map::new();
    for i in 0..20_000 {
        needs.insert(
            format!("big/n{i}"),
            json!({"from": "b", "request": {"pad": "x".repeat(2800)}, "nag_seconds": 900}),
        );
    }
    let file = f.dir.path().join("big-needs.json");
    std::fs::write(&file, serde_json::to_vec(&needs).unwrap()).unwrap();
    let pid = f.agents["a"].pid();
    let before = rss_kb(pid);
    let (ok, out) = f.admin("a", &["plan", "--needs", file.to_str().unwrap()]);
    assert!(ok, "{}", &out[..out.len().min(500)]);
    // Handed back once the plan is answered (give the trim a moment).
    let settled = eventually(Duration::from_secs(5), || rss_kb(pid) < before + 60 * 1024).await;
    assert!(
        settled,
        "RSS {} kB after the plan, {} kB before",
        rss_kb(pid),
        before
    );
}
