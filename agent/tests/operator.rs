//! Operator surfaces: built-in capabilities and who may call them, `fort` exit codes,
//! `fort fleet`, `fort-agent status`, and the metrics endpoint.

use std::time::Duration;

use fort_tests::{eventually, Fleet};
use serde_json::{json, Value};

fn fleet() -> Fleet {
    let mut f = Fleet::new();
    f.principal("ops");
    f.principal("viewer");
    let h = f.script("provide", r#"jq -c 'with_entries(.value = "OK")'"#);
    f.capability("p", "web", json!({"handler": h, "mode": "async"}));
    f.need("c", "web/site", "p", json!({"nag_seconds": 600}));
    f.host("down");
    f.host("p").extra_toml = "[access]\njournal = [\"ops\"]\nsystemd = [\"ops\"]\n".into();
    f
}

fn fort(f: &Fleet, origin: &str, args: &[&str]) -> (i32, String, String) {
    f.fort(origin, "p", args)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn builtins_and_their_access() {
    let mut f = fleet();
    f.write_files();
    f.start_host("p");
    f.start_host("c");
    for cap in ["status", "manifest", "needs"] {
        for who in ["viewer", "c"] {
            let r = f
                .post(who, "p", &format!("/agent/capabilities/{cap}"), &json!({}))
                .await;
            assert_eq!(r.status, 200, "{who} {cap}");
            assert!(r.verified());
        }
    }
    let manifest: Value = serde_json::from_slice(
        &f.post("viewer", "p", "/agent/capabilities/manifest", &json!({}))
            .await
            .body,
    )
    .unwrap();
    assert_eq!(
        manifest["capabilities"]["web"]["callers"],
        json!({"c": ["site"]})
    );
    let needs: Value =
        serde_json::from_slice(&f.post("viewer", "c", "/agent/needs", &json!({})).await.body)
            .unwrap();
    assert_eq!(needs, json!({"needs": ["web/site"]}));
    // Operator built-ins: listed principals only; hosts never.
    for (who, cap) in [
        ("viewer", "journal"),
        ("c", "journal"),
        ("viewer", "systemd"),
    ] {
        let r = f
            .post(
                who,
                "p",
                &format!("/agent/capabilities/{cap}"),
                &json!({"unit": "x.service", "action": "status"}),
            )
            .await;
        assert_eq!(r.status, 403, "{who} {cap}");
        // The refusal says how to grant it, to the operator who can.
        let message = serde_json::from_slice::<Value>(&r.body).unwrap()["message"].clone();
        let want = if who == "c" {
            format!("{cap} is for principals (operators); hosts never get it")
        } else {
            format!("{who} may not call {cap} on p: add \"{who}\" to [access] {cap} in its agent.toml (NixOS: services.fort-agent.settings.access.{cap})")
        };
        assert_eq!(message, json!(want));
    }
    // `fort` prints it.
    let (code, out, err) = fort(&f, "viewer", &["journal", "p", "x.service"]);
    assert_eq!(code, 2);
    assert_eq!(
        err.trim_end(),
        "fort: HTTP 403: viewer may not call journal on p: add \"viewer\" to [access] journal in its agent.toml (NixOS: services.fort-agent.settings.access.journal)",
        "{out}"
    );
    // --json prints the reply as it came.
    let (code, out, _) = fort(&f, "viewer", &["journal", "p", "x.service", "--json"]);
    assert_eq!(code, 2);
    assert_eq!(
        serde_json::from_str::<Value>(&out).unwrap()["error"],
        "forbidden"
    );
    // Parameters are checked before anything runs.
    for body in [
        json!({"unit": "--all"}),
        json!({"unit": "x", "lines": 5000}),
        json!({"unit": "x", "extra": 1}),
    ] {
        let r = f
            .post("ops", "p", "/agent/capabilities/journal", &body)
            .await;
        assert_eq!(r.status, 400, "{body}");
    }
    let r = f
        .post(
            "ops",
            "p",
            "/agent/capabilities/systemd",
            &json!({"action": "mask", "unit": "x.service"}),
        )
        .await;
    assert_eq!(r.status, 400);
    // A well-formed call runs journalctl: 200 where there is a journal, otherwise the
    // handler failure is reported as such.
    let r = f
        .post(
            "ops",
            "p",
            "/agent/capabilities/journal",
            &json!({"unit": "fort-agent.service", "lines": 3}),
        )
        .await;
    assert!(r.status == 200 || r.status == 500, "{}", r.status);
    if r.status == 500 {
        let body: Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(body["error"], "handler_failed");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fort_cli_exit_codes_and_the_fleet_table() {
    let mut f = fleet();
    f.write_files();
    f.start_host("p");
    f.start_host("c");
    assert!(
        eventually(Duration::from_secs(10), || f.status("c")["needs"]
            ["satisfied"]
            == 1)
        .await
    );
    let (code, out, _) = fort(&f, "viewer", &["status", "p", "--json"]);
    assert_eq!(code, 0);
    assert_eq!(serde_json::from_str::<Value>(&out).unwrap()["host"], "p");
    // Without --json, the same table `fort-agent status` prints.
    let (code, out, _) = fort(&f, "viewer", &["status", "c"]);
    assert_eq!(code, 0);
    assert!(out.starts_with("host c  release "), "{out}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("web/site") && l.contains(" p ") && l.contains("satisfied")),
        "{out}"
    );
    let (code, _, err) = fort(
        &f,
        "viewer",
        &["call", "p", "journal", r#"{"unit":"x.service"}"#],
    );
    assert_eq!(code, 2, "{err}");
    let (code, _, _) = fort(&f, "viewer", &["call", "p", "nonexistent"]);
    assert_eq!(code, 1);
    let (code, out, _) = fort(&f, "viewer", &["fleet"]);
    assert_eq!(code, 1, "a host is down: {out}");
    let down_line = out
        .lines()
        .find(|l| l.starts_with("down"))
        .expect("unreachable hosts are shown");
    assert!(down_line.contains("NO"), "{down_line}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("c ") && l.contains("1/1")),
        "{out}"
    );
    let (_, out, _) = fort(&f, "viewer", &["fleet", "--json"]);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["hosts"]["down"]["reachable"], false);
    assert_eq!(
        v["hosts"]["p"]["status"]["provider"]["capabilities"]["web"]["entries"],
        1
    );
    // The local table.
    let (ok, table) = f.admin("c", &["status"]);
    assert!(ok);
    assert!(
        table.contains("web/site") && table.contains("satisfied"),
        "{table}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_requests_failures_and_handler_runs() {
    let mut f = fleet();
    let metrics = fort_tests::free_addr("127.0.0.1");
    // Top-level keys go before the [access] table.
    let extra = format!("metrics_listen = \"{metrics}\"\n{}", f.host("p").extra_toml);
    f.host("p").extra_toml = extra;
    f.write_files();
    f.start_host("p");
    f.start_host("c");
    assert!(
        eventually(Duration::from_secs(10), || f.status("c")["needs"]
            ["satisfied"]
            == 1)
        .await
    );
    let _ = f
        .post("viewer", "p", "/agent/capabilities/journal", &json!({}))
        .await;
    let (_, _, body) = fort_tests::raw_http_plain(
        metrics,
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    );
    let text = String::from_utf8_lossy(&body);
    assert!(
        text.contains("fort_requests_total{endpoint=\"web\",status=\"202\"}"),
        "{text}"
    );
    assert!(
        text.contains("fort_handler_runs_total{capability=\"web\",outcome=\"ok\"}"),
        "{text}"
    );
    assert!(
        text.contains("fort_callbacks_total{outcome=\"sent\"}"),
        "{text}"
    );
    assert!(
        text.contains("fort_requests_total{endpoint=\"journal\",status=\"403\"}"),
        "{text}"
    );
}

/// `fort` with its own key and registry file, bypassing the harness's defaults.
fn fort_with(
    key: &std::path::Path,
    hosts: &std::path::Path,
    args: &[&str],
) -> (i32, String, String) {
    let out = std::process::Command::new(fort_tests::bin("fort"))
        .args(["--origin", "ops", "--key"])
        .arg(key)
        .arg("--hosts")
        .arg(hosts)
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_point_at_the_cause() {
    let mut f = fleet();
    f.write_files();
    f.start_host("p");
    let hosts = f.host_dir("p").join("hosts.json");

    // A mistyped host name: the close ones from hosts.json.
    let (code, _, err) = fort(&f, "ops", &["status", "pp"]);
    assert_eq!(code, 1);
    assert!(
        err.contains(&format!(
            "\"pp\" is not a host in {}; did you mean p?",
            hosts.display()
        )),
        "{err}"
    );
    let (code, _, err) = fort(&f, "ops", &["pin", "dwon"]);
    assert_eq!(code, 1);
    assert!(err.contains("did you mean down?"), "{err}");
    let (code, _, err) = fort(&f, "ops", &["status", "viewer"]);
    assert_eq!(code, 1);
    assert!(err.contains("\"viewer\" is a principal in"), "{err}");

    // A key the agent does not list for the origin: which key, which origin, where.
    let other = fort_core::sign::Signer::generate();
    let key = f.dir.path().join("other.key");
    fort_tests::write_key(&key, &other);
    let (code, _, err) = fort_with(&key, &hosts, &["status", "p"]);
    assert_eq!(code, 2, "{err}");
    let fingerprint = other
        .public_key()
        .fingerprint(ssh_key::HashAlg::Sha256)
        .to_string();
    assert!(
        err.contains(&format!(
            "HTTP 401: p did not accept the signature of \"ops\" made with {} ({fingerprint}): check that its public half ({}.pub) is listed for \"ops\" in p's hosts.json (NixOS: fort.cluster.principals.ops.publicKeys)",
            key.display(),
            key.display()
        )),
        "{err}"
    );
    assert!(
        err.contains(&format!(
            "{} here does not list it for \"ops\" either",
            hosts.display()
        )),
        "{err}"
    );
    // Listed in the registry here but not on the host (not deployed yet): only the host.
    let mut registry: Value = serde_json::from_slice(&std::fs::read(&hosts).unwrap()).unwrap();
    registry["principals"]["ops"]["keys"] = json!([other.public_openssh()]);
    let newer = f.dir.path().join("newer-hosts.json");
    std::fs::write(&newer, serde_json::to_vec(&registry).unwrap()).unwrap();
    let (code, _, err) = fort_with(&key, &newer, &["status", "p"]);
    assert_eq!(code, 2);
    assert!(err.contains("and that p runs that configuration"), "{err}");
    assert!(!err.contains("either"), "{err}");

    // The admin socket, to a user who may not use it: who may.
    if !is_root() {
        fort_tests::skip(
            "errors_point_at_the_cause (admin socket refused)",
            "not root: cannot run fort-agent as another user",
        );
        return;
    }
    // The config is readable to everyone, as /etc/fort/agent.toml is; the socket is not.
    use std::os::unix::fs::PermissionsExt;
    for dir in [f.dir.path().to_owned(), f.host_dir("p")] {
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let out = std::process::Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(fort_tests::bin("fort-agent"))
        .args(["status", "--config"])
        .arg(f.config_path("p"))
        .output();
    let Ok(out) = out else {
        fort_tests::skip(
            "errors_point_at_the_cause (admin socket refused)",
            "setpriv (util-linux) is not installed",
        );
        return;
    };
    let err = String::from_utf8_lossy(&out.stderr);
    if err.contains("agent.toml")
        && err.contains("ermission denied")
        && !err.contains("admin socket")
    {
        fort_tests::skip(
            "errors_point_at_the_cause (admin socket refused)",
            "the test's config is not readable by nobody",
        );
        return;
    }
    assert!(!out.status.success());
    assert!(
        err.contains("permission denied on the admin socket")
            && err.contains("only root may use it")
            && err.contains("you are uid 65534"),
        "{err}"
    );
    assert!(!err.contains("is fort-agent running"), "{err}");
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|v| v.split_whitespace().next().map(|u| u == "0"))
            .unwrap_or(false)
    })
}
