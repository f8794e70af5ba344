//! Seeing what a fleet runs: the manifest hash each agent reports, `fort fleet --expect`
//! against what was built, and `fort fleet --graph`.

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

use fort_core::canonical::manifest_sha256;
use fort_tests::{eventually, skip, Fleet};
use serde_json::{json, Value};

/// What `host` should report: the hash of its three files as on disk now.
fn expected_hash(f: &Fleet, host: &str) -> String {
    let read = |name: &str| std::fs::read(f.host_dir(host).join(name)).unwrap_or_default();
    manifest_sha256(
        &read("hosts.json"),
        &read("needs.json"),
        &read("capabilities.json"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_reports_the_hash_of_the_files_as_loaded() {
    let mut f = Fleet::new();
    let h = f.script("provide", r#"jq -c 'with_entries(.value = "OK")'"#);
    f.capability("p", "web", json!({"handler": h, "mode": "async"}));
    f.need("c", "web/site", "p", json!({}));
    f.start();
    for host in ["p", "c"] {
        assert_eq!(
            f.status(host)["manifest_sha256"],
            json!(expected_hash(&f, host)),
            "{host}"
        );
    }
    // A new needs.json counts once it is loaded; an absent one counts as empty.
    let before = expected_hash(&f, "c");
    f.need("c", "web/other", "p", json!({}));
    f.write_files();
    assert_eq!(
        f.status("c")["manifest_sha256"],
        json!(before),
        "not loaded yet"
    );
    f.agents["c"].hup();
    let after = expected_hash(&f, "c");
    assert_ne!(before, after);
    assert!(
        eventually(Duration::from_secs(10), || f.status("c")["manifest_sha256"]
            == json!(after))
        .await
    );
    std::fs::remove_file(f.host_dir("c").join("needs.json")).unwrap();
    f.agents["c"].hup();
    let empty = expected_hash(&f, "c");
    assert!(
        eventually(Duration::from_secs(10), || f.status("c")["manifest_sha256"]
            == json!(empty))
        .await
    );
}

/// `fort --origin ops <args>` with the registry of `host`: (exit code, stdout, stderr).
fn fort(f: &Fleet, registry_of: &str, args: &[&str]) -> (i32, String, String) {
    f.fort("ops", registry_of, args)
}

fn write_expected(f: &Fleet, expected: &BTreeMap<&str, String>) -> String {
    let path = f.dir.path().join("fleet-manifest.json");
    std::fs::write(&path, serde_json::to_vec(expected).unwrap()).unwrap();
    path.display().to_string()
}

/// The table row of `host` in `fort fleet`.
fn row<'a>(table: &'a str, host: &str) -> &'a str {
    table
        .lines()
        .find(|l| l.split_whitespace().next() == Some(host))
        .unwrap_or_else(|| panic!("no row for {host}:\n{table}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fleet_expect_marks_drift_unreachable_hosts_and_hosts_the_build_does_not_know() {
    let mut f = Fleet::new();
    f.principal("ops");
    let h = f.script("provide", r#"jq -c 'with_entries(.value = "OK")'"#);
    f.capability("a", "web", json!({"handler": h, "mode": "async"}));
    f.need("b", "web/x", "a", json!({}));
    f.need("c", "web/y", "a", json!({}));
    f.host("extra");
    f.host("down");
    f.write_files();
    for host in ["a", "b", "c", "extra"] {
        f.start_host(host);
    }
    assert!(eventually(Duration::from_secs(20), || f.all_satisfied("c")).await);

    // The new build changes only c's needs.json; c has not loaded it yet.
    let running_c = expected_hash(&f, "c");
    f.hosts
        .get_mut("c")
        .unwrap()
        .needs
        .get_mut("web/y")
        .unwrap()["nag_seconds"] = json!(30);
    f.write_files();
    let built_c = expected_hash(&f, "c");
    assert_ne!(running_c, built_c);
    let mut expected: BTreeMap<&str, String> = ["a", "b", "c", "down"]
        .into_iter()
        .map(|h| (h, expected_hash(&f, h)))
        .collect();
    expected.insert("ghost", "0".repeat(64));
    let file = write_expected(&f, &expected);

    let (code, table, err) = fort(&f, "a", &["fleet", "--expect", &file]);
    assert_eq!(code, 1, "{table}{err}");
    assert!(
        table.lines().next().unwrap().ends_with(" MANIFEST"),
        "{table}"
    );
    assert!(row(&table, "a").ends_with(" ok"), "{table}");
    assert!(row(&table, "b").ends_with(" ok"), "{table}");
    assert!(row(&table, "c").ends_with(" DRIFT"), "{table}");
    assert!(row(&table, "extra").ends_with(" NOT IN BUILD"), "{table}");
    assert!(row(&table, "down").contains(" NO "), "{table}");
    assert!(
        row(&table, "ghost").contains("not in hosts.json"),
        "{table}"
    );
    assert!(
        table.contains(&format!(
            "NOT RUNNING WHAT WAS BUILT\n  c: runs {}, the build expects {}\n",
            &running_c[..12],
            &built_c[..12]
        )),
        "{table}"
    );
    assert!(
        table.contains("  extra: runs ") && table.contains("the build does not know this host"),
        "{table}"
    );

    let (code, out, _) = fort(&f, "a", &["fleet", "--json", "--expect", &file]);
    assert_eq!(code, 1);
    let v: Value = serde_json::from_str(&out).unwrap();
    let m = |h: &str| v["hosts"][h]["manifest"].clone();
    assert_eq!(
        m("c"),
        json!({"state": "drift", "running": running_c, "expected": built_c})
    );
    assert_eq!(m("a")["state"], "ok");
    assert_eq!(m("extra")["state"], "not_in_build");
    assert_eq!(m("extra")["expected"], Value::Null);
    assert_eq!(m("down")["state"], "unreachable");
    assert_eq!(m("ghost")["state"], "unreachable");
    assert_eq!(v["hosts"]["ghost"]["error"], "not in hosts.json");

    // Once c reloads, starts the missing host and the build knows every host: clean.
    f.agents["c"].hup();
    assert!(
        eventually(Duration::from_secs(10), || f.status("c")["manifest_sha256"]
            == json!(built_c))
        .await
    );
    f.start_host("down");
    expected.remove("ghost");
    expected.insert("extra", expected_hash(&f, "extra"));
    let file = write_expected(&f, &expected);
    let (code, table, err) = fort(&f, "a", &["fleet", "--expect", &file]);
    assert_eq!(code, 0, "{table}{err}");
    assert!(!table.contains("NOT RUNNING WHAT WAS BUILT"), "{table}");

    // A file that is not a manifest map is refused before anything is asked.
    std::fs::write(&file, r#"{"a": "abc"}"#).unwrap();
    let (code, _, err) = fort(&f, "a", &["fleet", "--expect", &file]);
    assert_eq!(code, 1);
    assert!(
        err.contains("\"abc\" is not a lower-case hex SHA-256"),
        "{err}"
    );
}

/// An edge line of the graph: `"from" -> "to" [label="<need>\n<state>", ...]`.
fn edge<'a>(dot: &'a str, from: &str, need: &str) -> &'a str {
    let start = format!("  \"{from}\" -> ");
    let label = format!("[label=\"{need}\\n");
    dot.lines()
        .find(|l| l.starts_with(&start) && l.contains(&label))
        .unwrap_or_else(|| panic!("no edge {from} {need}:\n{dot}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_as_a_graph_and_needs_in_trouble_under_the_table() {
    let mut f = Fleet::new();
    f.principal("ops");
    // Payloads that expire in a day (renewal wanted a year ahead: expiring) or expired
    // a minute ago; "OK" otherwise.
    let h = f.script(
        "provide",
        r#"now=$(date +%s)
jq -c --argjson now "$now" 'with_entries(.value = (
  if (.key | endswith("/soon")) then {expires_at: ($now + 86400)}
  elif (.key | endswith("/gone")) then {expires_at: ($now - 60)}
  else "OK" end))'"#,
    );
    let take = f.script("take", "cat > /dev/null");
    f.capability("a", "web", json!({"handler": h, "mode": "async"}));
    f.need("c", "web/ok", "a", json!({}));
    f.need(
        "c",
        "web/soon",
        "a",
        json!({"handler": take, "renew_before_seconds": 31_536_000}),
    );
    f.need("c", "web/gone", "a", json!({"handler": take}));
    // a serves no `mail`: a 404, so failed.
    f.need("c", "mail/box", "a", json!({}));
    // down never answers: pending; and what comes after it waits.
    f.need("c", "web/far", "down", json!({}));
    f.need("c", "web/next", "a", json!({"after": ["web/far"]}));
    f.host("c").extra_toml = "[fulfill]\nbackoff = \"200ms\"\n".into();
    f.host("down");
    f.write_files();
    f.start_host("a");
    f.start_host("c");
    let states = [
        ("web/ok", "satisfied"),
        ("web/soon", "expiring"),
        ("web/gone", "expired"),
        ("mail/box", "failed"),
        ("web/far", "pending"),
        ("web/next", "waiting"),
    ];
    assert!(
        eventually(Duration::from_secs(20), || states
            .iter()
            .all(|(n, s)| f.need_status("c", n)["state"] == *s))
        .await,
        "{:#}",
        f.status("c")["needs"]
    );

    let (code, dot, err) = fort(&f, "a", &["fleet", "--graph"]);
    assert_eq!(code, 1, "down is unreachable: {err}");
    assert!(dot.starts_with("digraph fort {\n"), "{dot}");
    for (need, colour) in [
        ("web/ok", "green4"),
        ("web/soon", "orange"),
        ("web/gone", "darkred"),
        ("mail/box", "red"),
        ("web/far", "grey50"),
        ("web/next", "grey50"),
    ] {
        let e = edge(&dot, "c", need);
        assert!(e.contains(&format!(", color={colour},")), "{need}: {e}");
    }
    assert!(edge(&dot, "c", "web/far").starts_with("  \"c\" -> \"down\""));
    let down = dot
        .lines()
        .find(|l| l.starts_with("  \"down\" ["))
        .expect("a node for down");
    assert!(down.contains("style=\"rounded,dashed\""), "{down}");
    assert!(down.contains("unreachable"), "{down}");

    match Command::new("dot")
        .arg("-Tcanon")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
    {
        Err(_) => skip(
            "the_fleet_as_a_graph_and_needs_in_trouble_under_the_table",
            "Graphviz `dot` not installed: the graph was not parsed (apt-get install graphviz)",
        ),
        Ok(mut child) => {
            use std::io::Write;
            child
                .stdin
                .take()
                .unwrap()
                .write_all(dot.as_bytes())
                .unwrap();
            let out = child.wait_with_output().unwrap();
            assert!(
                out.status.success(),
                "dot refuses the graph: {}\n{dot}",
                String::from_utf8_lossy(&out.stderr)
            );
            // What dot read back: every edge is there.
            let canon = String::from_utf8_lossy(&out.stdout);
            assert_eq!(canon.matches(" -> ").count(), states.len(), "{canon}");
        }
    }

    // The table lists every need in trouble with its state and why.
    let (_, table, _) = fort(&f, "a", &["fleet"]);
    assert!(
        table.contains("UNSATISFIED NEEDS (host:need from provider: state: reason)"),
        "{table}"
    );
    for (need, state) in &states[1..] {
        let line = table
            .lines()
            .find(|l| l.starts_with(&format!("  c:{need} from ")))
            .unwrap_or_else(|| panic!("{need} not listed:\n{table}"));
        assert!(line.contains(&format!(": {state}: ")), "{line}");
    }
    assert!(!table.contains("c:web/ok"), "{table}");
    let failed = table.lines().find(|l| l.contains("c:mail/box")).unwrap();
    assert!(failed.contains("404"), "the reason says why: {failed}");
}
