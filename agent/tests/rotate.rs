//! What an operator sees and does with a provider's entries, against real agents: every
//! entry listed (over the admin socket and by `fort status`, hashes and never payloads,
//! with the last delivery's error), one entry rotated while the others keep their
//! responses (`fort trigger --entry --force`, `fort-agent trigger --entry`), and a
//! consumer asked to ask again (`fort resend`, `fort-agent resend`). Who may do it: principals
//! in `[access] trigger`; others are told which setting grants it.

use std::path::PathBuf;
use std::time::Duration;

use fort_core::canonical::sha256_hex;
use fort_tests::{eventually, Fleet};
use serde_json::{json, Value};

/// Provider `p` serves `cred` (cacheResponse): each entry without a response gets a new
/// random secret. Consumers `c1` (cred/a, cred/b) and `c2` (cred/x) store every payload
/// they receive in `<fleet>/store/<host>-<type>_<id>`. `ops` may trigger and resend;
/// `viewer` is a principal without that access.
fn fleet() -> Fleet {
    let mut f = Fleet::new();
    f.principal("ops");
    f.principal("viewer");
    let provider = f.script(
        "issue",
        r#"in=$(cat)
r=$(od -An -N8 -tx1 /dev/urandom | tr -d ' \n')
printf '%s' "$in" | jq -c --arg r "$r" 'with_entries(.value = (.value.response // ("secret-" + $r + "-" + .key)))'"#,
    );
    f.capability(
        "p",
        "cred",
        json!({"handler": provider, "mode": "async", "cacheResponse": true}),
    );
    let store = f.dir.path().join("store");
    std::fs::create_dir_all(&store).unwrap();
    let keep = f.script(
        "keep",
        &format!(
            r#"cat > '{}'/"$FORT_HOST-$(printf %s "$FORT_NEED" | tr / _)""#,
            store.display()
        ),
    );
    for (host, id) in [("c1", "a"), ("c1", "b"), ("c2", "x")] {
        f.need(
            host,
            &format!("cred/{id}"),
            "p",
            json!({"handler": keep, "nag_seconds": 600}),
        );
    }
    for host in ["p", "c1", "c2"] {
        f.host(host).extra_toml = "[access]\ntrigger = [\"ops\"]\n".into();
    }
    f
}

fn stored(f: &Fleet, host: &str, need: &str) -> String {
    let path: PathBuf = f
        .dir
        .path()
        .join("store")
        .join(format!("{host}-{}", need.replace('/', "_")));
    std::fs::read_to_string(path).unwrap_or_default()
}

fn received(f: &Fleet, host: &str, need: &str) -> u64 {
    f.need_status(host, need)["received"].as_u64().unwrap_or(0)
}

/// The entries in `fort-agent status --json` on `host` (the admin socket).
fn admin_entries(f: &Fleet, host: &str) -> serde_json::Map<String, Value> {
    let (ok, out) = f.admin(host, &["status", "--json"]);
    assert!(ok, "{out}");
    let v: Value = serde_json::from_str(&out).unwrap();
    v["status"]["entries"]
        .as_object()
        .cloned()
        .unwrap_or_else(|| panic!("no entries in {out}"))
}

async fn converge(f: &mut Fleet) {
    f.write_files();
    for h in ["p", "c1", "c2"] {
        f.start_host(h);
    }
    assert!(
        eventually(Duration::from_secs(20), || f.all_satisfied("c1")
            && f.all_satisfied("c2")
            && admin_entries(f, "p")
                .values()
                .all(|e| e["delivery"]["delivered_hash"] == e["response_hash"]))
        .await,
        "the fleet does not converge: {:?} {:?}",
        f.status("c1"),
        f.status("p")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_are_listed_over_the_admin_socket_and_by_fort_status() {
    let mut f = fleet();
    converge(&mut f).await;
    let (ok, out) = f.admin("p", &["status", "--json"]);
    assert!(ok);
    let entries = admin_entries(&f, "p");
    let keys: Vec<&str> = entries.keys().map(String::as_str).collect();
    assert_eq!(keys, ["c1:cred/a", "c1:cred/b", "c2:cred/x"]);
    for (key, e) in &entries {
        let (origin, need) = key.split_once(':').unwrap();
        let payload = stored(&f, origin, need);
        assert!(payload.starts_with("secret-"), "{key}: {payload:?}");
        // The hash of exactly the bytes the consumer received; never the bytes.
        assert_eq!(
            e["response_hash"],
            json!(sha256_hex(payload.as_bytes())),
            "{key}"
        );
        assert!(!out.contains(&payload), "a payload is in the status: {out}");
        assert_eq!(e["origin"], origin);
        assert_eq!(e["need"], need);
        assert_eq!(e["principal"], false);
        assert_eq!(e["undelivered"], false);
        assert_eq!(e["delivery"]["delivered_hash"], e["response_hash"]);
        assert!(e["delivery"]["delivered_at"].as_u64().is_some());
        assert_eq!(e["delivery"]["last_error"], Value::Null);
        assert_eq!(
            e["request_hash"],
            json!(sha256_hex(b"{}")),
            "the request's hash, as stored"
        );
    }

    // The table, locally.
    let (ok, table) = f.admin("p", &["status"]);
    assert!(ok);
    assert!(table.contains("ENTRIES (3, 0 undelivered)"), "{table}");
    for key in keys.iter() {
        let line = table
            .lines()
            .find(|l| l.starts_with(key))
            .unwrap_or_else(|| panic!("{key} is not listed:\n{table}"));
        let hash = entries[*key]["response_hash"].as_str().unwrap();
        assert!(line.contains(&hash[..12]), "{line}");
        assert!(line.contains("delivered"), "{line}");
    }

    // Remotely: the same entries for a principal with [access] trigger.
    let (code, out, err) = f.fort("ops", "p", &["status", "p", "--json"]);
    assert_eq!(code, 0, "{err}");
    let remote: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        remote["entries"]
            .as_object()
            .unwrap()
            .keys()
            .collect::<Vec<_>>(),
        entries.keys().collect::<Vec<_>>()
    );
    assert_eq!(
        remote["entries"]["c2:cred/x"]["response_hash"],
        entries["c2:cred/x"]["response_hash"]
    );
    let (code, table, _) = f.fort("ops", "p", &["status", "p"]);
    assert_eq!(code, 0);
    assert!(table.contains("ENTRIES (3, 0 undelivered)"), "{table}");
    assert!(table.lines().any(|l| l.starts_with("c2:cred/x")), "{table}");

    // Not for a principal without it, nor for a host: told what would grant it.
    let (code, out, _) = f.fort("viewer", "p", &["status", "p", "--json"]);
    assert_eq!(code, 0);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert!(v.get("entries").is_none(), "{out}");
    assert_eq!(
        v["entries_withheld"],
        "viewer may not see the entries of p: add \"viewer\" to [access] trigger in its agent.toml (NixOS: services.fort-agent.settings.access.trigger)"
    );
    let (_, table, _) = f.fort("viewer", "p", &["status", "p"]);
    assert!(
        table.contains("ENTRIES: not shown: viewer may not see the entries of p"),
        "{table}"
    );
    let r = f
        .post(
            "c1",
            "p",
            "/agent/capabilities/status",
            &json!({"entries": true}),
        )
        .await;
    assert_eq!(r.status, 200);
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert!(v.get("entries").is_none());
    assert!(v["entries_withheld"]
        .as_str()
        .unwrap()
        .contains("hosts never see them"));
    // Asked without `entries`, the document is as it always was.
    let (_, out, _) = f.fort("ops", "p", &["call", "p", "status"]);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert!(v.get("entries").is_none() && v.get("entries_withheld").is_none());

    // A delivery that fails shows with its error: c2 is down when its entry rotates.
    f.kill("c2");
    let (ok, out) = f.admin("p", &["trigger", "cred", "--entry", "c2:cred/x", "--force"]);
    assert!(ok, "{out}");
    assert!(
        eventually(Duration::from_secs(20), || {
            let e = &admin_entries(&f, "p")["c2:cred/x"];
            e["undelivered"] == true && e["delivery"]["last_error"].is_string()
        })
        .await,
        "{:?}",
        admin_entries(&f, "p")
    );
    let (_, table) = f.admin("p", &["status"]);
    let line = table
        .lines()
        .find(|l| l.starts_with("c2:cred/x"))
        .unwrap()
        .to_owned();
    assert!(line.contains("undelivered"), "{table}");
    let error = admin_entries(&f, "p")["c2:cred/x"]["delivery"]["last_error"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        line.ends_with(&error),
        "the error is shown: {line} / {error}"
    );
    assert!(table.contains("ENTRIES (3, 1 undelivered)"), "{table}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_entry_rotated_while_the_others_keep_their_responses() {
    let mut f = fleet();
    converge(&mut f).await;
    let before: Vec<(String, String, u64)> = [("c1", "cred/a"), ("c1", "cred/b"), ("c2", "cred/x")]
        .iter()
        .map(|(h, n)| (h.to_string(), stored(&f, h, n), received(&f, h, n)))
        .collect();
    let hashes = admin_entries(&f, "p");

    // From the workstation: c1's cred/a alone gets a new secret.
    let (code, out, err) = f.fort(
        "ops",
        "p",
        &["trigger", "p", "cred", "--entry", "c1:cred/a", "--force"],
    );
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.starts_with("p: cred handler ran (manual, "), "{out}");
    let old = &hashes["c1:cred/a"]["response_hash"].as_str().unwrap()[..12];
    assert!(
        out.contains(&format!("c1:cred/a: new response ({old} → ")),
        "{out}"
    );
    assert!(
        eventually(Duration::from_secs(10), || stored(&f, "c1", "cred/a")
            != before[0].1)
        .await,
        "c1 never got its new secret"
    );
    let after = admin_entries(&f, "p");
    assert_ne!(
        after["c1:cred/a"]["response_hash"],
        hashes["c1:cred/a"]["response_hash"]
    );
    assert_eq!(
        after["c1:cred/a"]["response_hash"],
        json!(sha256_hex(stored(&f, "c1", "cred/a").as_bytes()))
    );
    // The others: same response, no callback (nothing received), same bytes.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for (key, host, need, i) in [
        ("c1:cred/b", "c1", "cred/b", 1),
        ("c2:cred/x", "c2", "cred/x", 2),
    ] {
        assert_eq!(
            after[key]["response_hash"], hashes[key]["response_hash"],
            "{key}"
        );
        assert_eq!(stored(&f, host, need), before[i].1, "{key}");
        assert_eq!(
            received(&f, host, need),
            before[i].2,
            "{key} was called back"
        );
    }
    assert_eq!(received(&f, "c1", "cred/a"), before[0].2 + 1);

    // JSON: the run and the hashes before and after.
    let (code, out, _) = f.fort(
        "ops",
        "p",
        &["trigger", "p", "cred", "--entry", "c1:cred/b", "--json"],
    );
    assert_eq!(code, 0);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["run"]["ok"], true);
    assert_eq!(v["run"]["trigger"], "manual");
    assert_eq!(
        v["before"], v["after"],
        "without --force the response stays"
    );
    assert_eq!(v["before"], hashes["c1:cred/b"]["response_hash"]);
    // ...and its consumer is called back with it all the same.
    assert!(
        eventually(Duration::from_secs(10), || received(&f, "c1", "cred/b")
            == before[1].2 + 1)
        .await
    );
    assert_eq!(stored(&f, "c1", "cred/b"), before[1].1);

    // On the provider itself, the same.
    let (ok, out) = f.admin("p", &["trigger", "cred", "--entry", "c2:cred/x", "--force"]);
    assert!(ok, "{out}");
    assert!(out.contains("c2:cred/x: new response"), "{out}");
    assert!(
        eventually(Duration::from_secs(10), || stored(&f, "c2", "cred/x")
            != before[2].1)
        .await
    );
    assert_eq!(stored(&f, "c1", "cred/b"), before[1].1);

    // Mistakes and refusals name the cause.
    let (code, _, err) = f.fort(
        "ops",
        "p",
        &["trigger", "p", "cred", "--entry", "c1:cred/zz", "--force"],
    );
    assert_eq!(code, 1);
    assert!(
        err.contains(
            "no entry c1:cred/zz in cred (entries include c1:cred/a, c1:cred/b, c2:cred/x)"
        ),
        "{err}"
    );
    let (code, _, err) = f.fort(
        "ops",
        "p",
        &["trigger", "p", "cred", "--entry", "c1:other/a"],
    );
    assert_eq!(code, 1);
    assert!(err.contains("is not an entry of cred"), "{err}");
    let (code, _, err) = f.fort("ops", "p", &["trigger", "p", "nope"]);
    assert_eq!(code, 1);
    assert!(err.contains("no capability nope"), "{err}");
    let (code, _, err) = f.fort("viewer", "p", &["trigger", "p", "cred"]);
    assert_eq!(code, 2);
    assert!(
        err.contains("viewer may not call trigger on p: add \"viewer\" to [access] trigger"),
        "{err}"
    );
    let r = f
        .post(
            "c1",
            "p",
            "/agent/capabilities/trigger",
            &json!({"capability": "cred"}),
        )
        .await;
    assert_eq!(r.status, 403, "hosts never trigger");
    let r = f
        .post(
            "ops",
            "p",
            "/agent/capabilities/trigger",
            &json!({"capability": "cred", "entry": "C1:cred/a"}),
        )
        .await;
    assert_eq!(r.status, 400);
    let (ok, _) = f.admin("p", &["trigger", "cred", "--entry", "c9:cred/a"]);
    assert!(!ok);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_asked_to_ask_again() {
    let mut f = fleet();
    converge(&mut f).await;
    let sought = f.need_status("c1", "cred/a")["last_sought"]
        .as_u64()
        .unwrap();
    let requested = admin_entries(&f, "p")["c1:cred/a"]["requested_at"]
        .as_u64()
        .unwrap();
    let got = received(&f, "c1", "cred/a");
    let secret = stored(&f, "c1", "cred/a");
    let other = received(&f, "c1", "cred/b");
    // Unix seconds: let a second pass so a new request is told from the first.
    tokio::time::sleep(Duration::from_millis(1100)).await;

    let (code, out, err) = f.fort("ops", "c1", &["resend", "c1", "cred/a"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, "c1 asks p for cred/a again now (state satisfied)\n");
    // c1 sent its request again, p answered it, c1 applied the same secret once more.
    assert!(
        eventually(Duration::from_secs(10), || received(&f, "c1", "cred/a")
            == got + 1)
        .await,
        "{:?}",
        f.need_status("c1", "cred/a")
    );
    assert!(
        f.need_status("c1", "cred/a")["last_sought"]
            .as_u64()
            .unwrap()
            > sought
    );
    assert!(
        admin_entries(&f, "p")["c1:cred/a"]["requested_at"]
            .as_u64()
            .unwrap()
            > requested
    );
    assert_eq!(stored(&f, "c1", "cred/a"), secret);
    assert_eq!(f.need_status("c1", "cred/a")["state"], "satisfied");
    assert_eq!(
        received(&f, "c1", "cred/b"),
        other,
        "only the need asked about"
    );

    // Locally, and as JSON.
    let (ok, out) = f.admin("c1", &["resend", "cred/b", "--json"]);
    assert!(ok, "{out}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        v["resend"],
        json!({"need": "cred/b", "from": "p", "state": "satisfied", "reason": null})
    );
    assert!(
        eventually(Duration::from_secs(10), || received(&f, "c1", "cred/b")
            == other + 1)
        .await
    );

    // Refusals.
    let (code, _, err) = f.fort("ops", "c1", &["resend", "c1", "cred/nope"]);
    assert_eq!(code, 1);
    assert!(err.contains("c1 declares no need cred/nope"), "{err}");
    let (code, _, err) = f.fort("viewer", "c1", &["resend", "c1", "cred/a"]);
    assert_eq!(code, 2);
    assert!(
        err.contains("viewer may not call resend on c1: add \"viewer\" to [access] trigger"),
        "{err}"
    );
    let r = f
        .post(
            "p",
            "c1",
            "/agent/capabilities/resend",
            &json!({"need": "cred/a"}),
        )
        .await;
    assert_eq!(r.status, 403, "hosts never resend");
    let (ok, _) = f.admin("c1", &["resend", "cred/nope"]);
    assert!(!ok);
}

/// A run an operator triggers that fails says why, to that operator: how the handler
/// ended and the last line it wrote on stderr; the status every known caller reads keeps
/// only the short class.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_run_tells_the_operator_who_triggered_it_why() {
    let mut f = Fleet::new();
    f.principal("ops");
    let failing = f.script(
        "failing",
        "cat >/dev/null\necho 'starting' >&2\necho 'cannot reach the CA at https://ca.test/dir: connection refused' >&2\nexit 3",
    );
    f.capability("p", "cred", json!({"handler": failing, "mode": "async"}));
    f.host("p").extra_toml = "[access]\ntrigger = [\"ops\"]\n".into();
    f.start();
    let (code, out, err) = f.fort("ops", "p", &["trigger", "p", "cred"]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains("FAILED: exit_nonzero"), "{out}");
    assert!(
        out.contains(
            "why: exited with code 3: cannot reach the CA at https://ca.test/dir: connection refused"
        ),
        "{out}"
    );
    let (code, json_out, _) = f.fort("ops", "p", &["trigger", "p", "cred", "--json"]);
    assert_eq!(code, 1);
    let v: Value = serde_json::from_str(&json_out).unwrap();
    assert!(
        v["run"]["reason"]
            .as_str()
            .unwrap()
            .contains("connection refused"),
        "{v}"
    );
    // What a host reads in status: the class of the failure, not the handler's words.
    let status = f
        .post("p", "p", "/agent/capabilities/status", &json!({}))
        .await;
    let text = String::from_utf8_lossy(&status.body);
    assert!(text.contains("exit_nonzero"), "{text}");
    assert!(!text.contains("connection refused"), "{text}");
}
