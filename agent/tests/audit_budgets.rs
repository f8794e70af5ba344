//! What remote parties can make the audit trail write, against a real agent: a known host
//! without grants calling an operator built-in as fast as it can causes a bounded number
//! of records (each without its parameters) and a count of the rest, so it cannot push
//! the trail out of its bounded files; and whether a `status` call read the entries is
//! decided from the request as parsed, so an escaped spelling is recorded like the plain
//! one.

use std::time::Duration;

use fort_core::client::Target;
use fort_tests::Fleet;
use serde_json::{json, Value};

fn records(f: &Fleet, host: &str) -> Vec<Value> {
    fort_core::audit::read_lines(&f.host_dir(host).join("state").join("audit"))
        .unwrap_or_default()
        .into_iter()
        .filter_map(|l| l.record)
        .collect()
}

/// `POST path` with `body` exactly as given (bytes another client might send).
async fn post_raw(f: &Fleet, origin: &str, host: &str, path: &str, body: &[u8]) -> u16 {
    let client = f.client(origin);
    let address = f.address_of(host);
    let keys = f.hosts[host].keys();
    let target = Target {
        name: host,
        address: &address,
        keys: &keys,
    };
    client
        .post(&target, path, body.to_vec())
        .await
        .expect("request reaches the agent")
        .status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_records_are_budgeted_per_caller_and_decided_from_what_was_parsed() {
    let mut f = Fleet::new();
    f.principal("ops");
    f.host("p").extra_toml = "[access]\ntrigger = [\"ops\"]\n".into();
    f.host("c");
    f.write_files();
    f.start_host("p");

    // c is a known host with no grant: every journal call is refused, 403.
    let filler = "x".repeat(900);
    let body = json!({"unit": "sshd.service", "lines": 10, "since": filler});
    let bytes = serde_json::to_vec(&body).unwrap();
    for _ in 0..300 {
        let status = post_raw(&f, "c", "p", "/agent/capabilities/journal", &bytes).await;
        assert_eq!(status, 403);
    }
    // A second later one more fits its budget, and the count of the rest goes with it.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let r = f.post("c", "p", "/agent/capabilities/journal", &body).await;
    assert_eq!(r.status, 403);

    // The entries asked for with an escaped member name: shown, and recorded.
    let status = post_raw(
        &f,
        "ops",
        "p",
        "/agent/capabilities/status",
        br#"{"\u0065ntries": true}"#,
    )
    .await;
    assert_eq!(status, 200);
    f.stop("p");

    let all = records(&f, "p");
    let from_c: Vec<&Value> = all
        .iter()
        .filter(|r| r["event"] == "operator" && r["caller"] == "c")
        .collect();
    let burst = fort_core::audit::CausedKind::OperatorRefused.budget().burst as usize;
    assert!(
        from_c.len() > burst / 2 && from_c.len() <= burst + 5,
        "{} operator records from c",
        from_c.len()
    );
    for r in &from_c {
        assert_eq!(r["status"], 403);
        let params = r["detail"]["params"].as_str().unwrap_or_default();
        assert!(
            params.ends_with(" bytes"),
            "a refused call's parameters kept: {r}"
        );
    }
    let suppressed: Vec<&Value> = all
        .iter()
        .filter(|r| r["event"] == "suppressed" && r["caller"] == "c")
        .collect();
    assert_eq!(suppressed.len(), 1, "{suppressed:?}");
    assert_eq!(suppressed[0]["detail"]["event"], "operator");
    let counted = suppressed[0]["detail"]["records"].as_u64().unwrap() as usize;
    assert_eq!(counted + from_c.len(), 301, "every call is counted");

    let read = all
        .iter()
        .filter(|r| r["event"] == "operator" && r["caller"] == "ops")
        .collect::<Vec<_>>();
    assert_eq!(read.len(), 1, "the entries read left no record: {all:#?}");
    assert_eq!(read[0]["detail"]["call"], "status");
    assert_eq!(read[0]["status"], 200);
}
