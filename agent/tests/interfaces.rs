//! Capability interfaces and references between needs against real agents
//! (docs/protocol.md §11.5, §11.6): requests that break a capability's `request_schema`
//! are refused with the path and neither stored nor run; a consumer's own malformed
//! request fails with that reason; a chain of needs built from each other's payloads
//! converges, and rotating the first sends each dependent again exactly once; `check`
//! refuses cycles and references to needs that are not declared.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use fort_tests::{bin, eventually, Fleet, Relay};
use serde_json::{json, Value};

/// `{"client_name": string, "redirect_uris": [string]}`, nothing else, name required.
fn oidc_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "client_name": {"type": "string"},
            "redirect_uris": {"type": "array", "items": {"type": "string"}}
        },
        "required": ["client_name"],
        "additionalProperties": false
    })
}

fn lines(path: &Path) -> usize {
    std::fs::read_to_string(path)
        .map(|t| t.lines().count())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_breaking_the_schema_are_refused_with_the_path_and_never_stored_or_run() {
    let mut f = Fleet::new();
    let d = f.dir.path().to_path_buf();
    let async_runs = d.join("async-runs");
    let rpc_runs = d.join("rpc-runs");
    let issue = f.script(
        "issue",
        &format!(
            "echo run >> {}; jq -c 'with_entries(.value = \"OK\")'",
            async_runs.display()
        ),
    );
    let echo = f.script("echo", &format!("echo run >> {}; cat", rpc_runs.display()));
    f.principal("ops");
    f.capability(
        "p",
        "oidc",
        json!({"handler": issue, "mode": "async", "request_schema": oidc_schema()}),
    );
    f.capability(
        "p",
        "lookup",
        json!({"handler": echo, "mode": "rpc", "allowed": ["ops"], "request_schema": oidc_schema()}),
    );
    f.need("c", "oidc/wiki", "p", json!({}));
    // Only the provider runs: requests are sent by hand, as any caller could.
    f.write_files();
    f.start_host("p");

    let ask = |request: Value| {
        let body = json!({"need": "oidc/wiki", "request": request});
        let f = &f;
        async move { f.post("c", "p", "/agent/capabilities/oidc", &body).await }
    };
    let cases = [
        (json!({}), "/", "client_name is required"),
        (
            json!({"client_nmae": "wiki"}),
            "/",
            "unexpected field client_nmae",
        ),
        (
            json!({"client_name": "wiki", "redirect_uris": ["https://a", 7]}),
            "/redirect_uris/1",
            "type",
        ),
        (
            json!({"client_name": "wiki", "extra": true}),
            "/",
            "unexpected field extra",
        ),
    ];
    for (request, at, what) in &cases {
        let r = ask(request.clone()).await;
        let body = String::from_utf8_lossy(&r.body).into_owned();
        assert_eq!(r.status, 400, "{request}: {body}");
        assert!(r.verified(), "a 400 after the signature is signed");
        assert!(
            body.contains("invalid_request")
                && body.contains(&format!("at {at}:"))
                && body.contains(what),
            "{request}: {body}"
        );
        // The message names places, never values.
        assert!(!body.contains("https://a"), "{body}");
    }
    // Nothing stored, nothing run (a run would follow an accepted request at once).
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(f.entries("p").is_empty(), "{:?}", f.entries("p"));
    assert_eq!(lines(&async_runs), 0, "the handler ran");

    // The same contract for rpc bodies.
    let call = |body: Value| {
        let f = &f;
        async move {
            f.post("ops", "p", "/agent/capabilities/lookup", &body)
                .await
        }
    };
    let r = call(json!({"client_name": 3})).await;
    let body = String::from_utf8_lossy(&r.body).into_owned();
    assert_eq!(r.status, 400, "{body}");
    assert!(body.contains("at /client_name:"), "{body}");
    assert_eq!(lines(&rpc_runs), 0, "the rpc handler ran");

    // A request that keeps the contract is taken, stored and run.
    let r = ask(json!({"client_name": "wiki", "redirect_uris": ["https://wiki/cb"]})).await;
    assert_eq!(r.status, 202);
    assert_eq!(f.entries("p"), vec!["c:oidc/wiki".to_owned()]);
    assert!(
        eventually(Duration::from_secs(10), || lines(&async_runs) >= 1).await,
        "an accepted request was never run"
    );
    let r = call(json!({"client_name": "wiki"})).await;
    assert_eq!(r.status, 200);
    assert_eq!(lines(&rpc_runs), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_whose_request_breaks_the_schema_fails_with_the_path() {
    let mut f = Fleet::new();
    let issue = f.script("issue", "jq -c 'with_entries(.value = \"OK\")'");
    f.capability(
        "p",
        "oidc",
        json!({"handler": issue, "mode": "async", "request_schema": oidc_schema()}),
    );
    f.need(
        "c",
        "oidc/wiki",
        "p",
        json!({"request": {"client_name": ["not", "a", "string"]}}),
    );
    f.start();
    let failed = || {
        let s = f.need_status("c", "oidc/wiki");
        s["state"] == "failed"
            && s["reason"]
                .as_str()
                .is_some_and(|r| r.contains("at /client_name:"))
    };
    assert!(
        eventually(Duration::from_secs(15), failed).await,
        "{}",
        f.need_status("c", "oidc/wiki")
    );
    assert!(f.entries("p").is_empty());
}

/// Provider of `token`: `token/first` gets `{"value": <version>}`; any other entry gets
/// `{"value": "f(<its request's upstream>)"}`, so each link of a chain shows what it was
/// built from.
fn chain_provider(f: &mut Fleet) {
    let version = f.dir.path().join("version");
    std::fs::write(&version, "v1").unwrap();
    let h = f.script(
        "token",
        &format!(
            r#"v=$(cat {})
jq -c --arg v "$v" 'with_entries(.value = (if .key | endswith("token/first") then {{"value": $v}} else {{"value": "f(\(.value.request.upstream))"}} end))'"#,
            version.display()
        ),
    );
    f.capability("p", "token", json!({"handler": h, "mode": "async"}));
    f.host("p").extra_toml = "[callbacks]\nbackoff = \"200ms\"\n".into();
}

fn count(haystack: &[u8], needle: &str) -> usize {
    haystack
        .windows(needle.len())
        .filter(|w| *w == needle.as_bytes())
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_of_references_converges_and_a_rotation_resends_each_dependent_once() {
    let mut f = Fleet::new();
    // Plain HTTP through a relay, so the test can count what the consumer sends: the
    // requests themselves are what is under test here, not their confidentiality.
    f.plaintext = true;
    chain_provider(&mut f);
    let got = f.dir.path().join("got");
    let keep = f.script(
        "keep",
        &format!(
            r#"mkdir -p {g}; cat > {g}/$(echo "$FORT_NEED" | tr / _)"#,
            g = got.display()
        ),
    );
    f.need("c", "token/first", "p", json!({"handler": keep}));
    f.need(
        "c",
        "token/second",
        "p",
        json!({"handler": keep, "request": {"upstream": {"$fort_ref": "token/first#/value"}}}),
    );
    f.need(
        "c",
        "token/third",
        "p",
        json!({"handler": keep, "request": {"upstream": {"$fort_ref": "token/second#/value"}}}),
    );
    f.host("c").extra_toml = "[fulfill]\nbackoff = \"200ms\"\n".into();
    f.write_files();
    let relay = Relay::start("127.0.0.1", f.hosts["p"].addr);
    f.edit_hosts_json("c", |h| {
        h["hosts"]["p"]["address"] = json!(format!("http://{}", relay.addr))
    });

    // The provider is not up yet: the first need cannot be had, and the others wait,
    // saying for what.
    f.start_host("c");
    let waiting = |need: &str, on: &str| {
        let s = f.need_status("c", need);
        s["state"] == "waiting" && s["reason"].as_str().is_some_and(|r| r.contains(on))
    };
    assert!(
        eventually(Duration::from_secs(10), || waiting(
            "token/second",
            "token/first"
        ) && waiting(
            "token/third",
            "token/second"
        ))
        .await,
        "{}\n{}",
        f.need_status("c", "token/second"),
        f.need_status("c", "token/third")
    );

    f.start_host("p");
    let read = |need: &str| {
        std::fs::read_to_string(got.join(need.replace('/', "_")))
            .ok()
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
            .map(|v| v["value"].clone())
            .unwrap_or(Value::Null)
    };
    assert!(
        eventually(Duration::from_secs(20), || read("token/third")
            == "f(f(v1))")
        .await,
        "chain did not converge: {}",
        f.need_status("c", "token/third")
    );
    // The handler has written the file; the need is satisfied once it has exited.
    assert!(eventually(Duration::from_secs(5), || f.all_satisfied("c")).await);
    assert_eq!(read("token/second"), "f(v1)");

    // Rotate the first: each dependent is sent again with what it is built from, once.
    std::fs::write(f.dir.path().join("version"), "v2").unwrap();
    let (ok, _) = f.admin("p", &["trigger", "token", "--force"]);
    assert!(ok, "trigger");
    assert!(
        eventually(Duration::from_secs(20), || read("token/third")
            == "f(f(v2))")
        .await,
        "the rotation did not reach the end of the chain: {}",
        f.need_status("c", "token/third")
    );
    assert_eq!(read("token/second"), "f(v2)");
    // Anything sent twice would arrive within a nag-free second or two.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let sent = relay.bytes();
    assert_eq!(count(&sent, r#""upstream":"v2""#), 1, "token/second sends");
    assert_eq!(
        count(&sent, r#""upstream":"f(v2)""#),
        1,
        "token/third sends"
    );
    assert_eq!(
        count(&sent, r#""upstream":"v1""#),
        1,
        "token/second sent before"
    );
    assert!(f.all_satisfied("c"));
}

/// `fort-agent ARGS`: whether it succeeded, and stdout and stderr together.
fn fort_agent<I, A>(args: I) -> (bool, String)
where
    I: IntoIterator<Item = A>,
    A: AsRef<std::ffi::OsStr>,
{
    let out = Command::new(bin("fort-agent"))
        .args(args)
        .output()
        .expect("run fort-agent");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn check(f: &Fleet, host: &str) -> (bool, String) {
    let config = f.config_path(host);
    fort_agent([
        std::ffi::OsStr::new("check"),
        "--skip-key".as_ref(),
        "--config".as_ref(),
        config.as_os_str(),
    ])
}

#[test]
fn check_refuses_cycles_and_references_to_undeclared_needs() {
    let mut f = Fleet::new();
    let h = f.script("token", "jq -c 'with_entries(.value = \"OK\")'");
    f.capability("p", "token", json!({"handler": h, "mode": "async"}));
    let r = |to: &str| json!({"request": {"x": {"$fort_ref": to}}});
    f.need("c", "token/a", "p", r("token/b#/value"));
    f.need("c", "token/b", "p", r("token/c"));
    f.need("c", "token/c", "p", r("token/a#/x"));
    f.write_files();
    let (ok, text) = check(&f, "c");
    assert!(!ok, "a cycle passed check: {text}");
    assert!(text.contains("cycle"), "{text}");
    for key in ["token/a", "token/b", "token/c"] {
        assert!(text.contains(key), "{text}");
    }

    // `after` takes part in cycles too.
    f.host("c").needs.clear();
    f.need("c", "token/a", "p", json!({"after": ["token/b"]}));
    f.need("c", "token/b", "p", r("token/a"));
    f.write_files();
    let (ok, text) = check(&f, "c");
    assert!(!ok && text.contains("cycle"), "{text}");

    f.host("c").needs.clear();
    f.need("c", "token/a", "p", r("token/nowhere#/value"));
    f.write_files();
    let (ok, text) = check(&f, "c");
    assert!(
        !ok,
        "a reference to an undeclared need passed check: {text}"
    );
    assert!(text.contains("token/nowhere"), "{text}");

    // The same needs without the loop are fine.
    f.host("c").needs.clear();
    f.need("c", "token/a", "p", json!({}));
    f.need("c", "token/b", "p", r("token/a#/value"));
    f.need("c", "token/c", "p", json!({"after": ["token/b"]}));
    f.write_files();
    let (ok, text) = check(&f, "c");
    assert!(ok, "{text}");
}

fn check_requests(f: &Fleet, extra: &[&str]) -> (bool, String) {
    let (needs, capabilities, hosts) = (
        f.host_dir("c").join("needs.json"),
        f.host_dir("p").join("capabilities.json"),
        f.host_dir("c").join("hosts.json"),
    );
    let mut args: Vec<&std::ffi::OsStr> = vec![
        std::ffi::OsStr::new("check"),
        "--needs".as_ref(),
        needs.as_os_str(),
        "--capabilities".as_ref(),
        capabilities.as_os_str(),
        "--hosts".as_ref(),
        hosts.as_os_str(),
    ];
    args.extend(extra.iter().map(std::ffi::OsStr::new));
    fort_agent(args)
}

#[test]
fn check_holds_a_consumer_s_requests_against_a_provider_s_schemas() {
    let mut f = Fleet::new();
    let h = f.script("issue", "jq -c 'with_entries(.value = \"OK\")'");
    f.capability(
        "p",
        "oidc",
        json!({"handler": h, "mode": "async", "request_schema": oidc_schema()}),
    );
    f.need(
        "c",
        "oidc/wiki",
        "p",
        json!({"request": {"client_name": "wiki"}}),
    );
    // A value built from another need's payload is only known when sent.
    f.need(
        "c",
        "oidc/grafana",
        "p",
        json!({"request": {"client_name": {"$fort_ref": "oidc/wiki#/client_id"}}}),
    );
    f.write_files();
    let (ok, text) = check_requests(&f, &["--provider", "p", "--consumer", "c"]);
    assert!(ok, "{text}");
    assert!(
        text.contains("ok: 2 requests fit p's request schemas"),
        "{text}"
    );
    assert!(text.contains("checked when sent"), "{text}");

    // Every problem at once, each naming the need and the place.
    f.need(
        "c",
        "oidc/bad",
        "p",
        json!({"request": {"client_name": 7, "extra": true, "redirect_uris": ["x", 1]}}),
    );
    f.need("c", "token/x", "p", json!({}));
    f.write_files();
    let (ok, text) = check_requests(&f, &["--provider", "p"]);
    assert!(!ok, "{text}");
    for expected in [
        "oidc/bad: request at /client_name:",
        "oidc/bad: request at /: unexpected field extra",
        "oidc/bad: request at /redirect_uris/1:",
        "token/x: p offers no capability token",
    ] {
        assert!(
            text.contains(expected),
            "{expected:?} missing from:\n{text}"
        );
    }
    assert!(!text.contains("oidc/wiki:"), "{text}");

    // Ids the provider's callers do not list for this consumer.
    f.host("c").needs.retain(|k, _| k == "oidc/wiki");
    f.write_files();
    let (ok, text) = check_requests(&f, &["--provider", "p", "--consumer", "p"]);
    assert!(!ok, "{text}");
    assert!(
        text.contains("oidc/wiki: p is not among the callers of oidc for id wiki"),
        "{text}"
    );
}
