//! `fort-agent plan` against running agents: one plan per class of change (needs,
//! files, units, capabilities, callers, hosts and principals, provider entries, access,
//! agent.toml), text and JSON, refusals, and proof that planning changes nothing.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use fort_tests::{eventually, Fleet};
use serde_json::{json, Value};

/// Provider `p` serves `web` (every entry gets `OK`) to consumers `c` and `c2`, and
/// `dns` to the principal `ops` only. `c` needs `web/site` (a file, restarting
/// nginx.service) and `web/old` (a file); `c2` needs `web/blog`.
fn fleet() -> Fleet {
    let mut f = Fleet::new();
    f.principal("ops");
    let ok = f.script("provide", r#"jq -c 'with_entries(.value = "OK")'"#);
    f.capability("p", "web", json!({"handler": ok, "mode": "async"}));
    f.capability(
        "p",
        "dns",
        json!({"handler": ok, "mode": "async", "allowed": ["ops"]}),
    );
    let files = f.dir.path().join("delivered");
    let systemctl = f.script("systemctl", "exit 0");
    f.need(
        "c",
        "web/site",
        "p",
        json!({"nag_seconds": 600, "restart_units": ["nginx.service"],
               "files": [{"path": files.join("site"), "owner": whoami(), "group": groupname()}]}),
    );
    f.need(
        "c",
        "web/old",
        "p",
        json!({"nag_seconds": 600,
               "files": [{"path": files.join("old"), "owner": whoami(), "group": groupname()}]}),
    );
    f.need("c2", "web/blog", "p", json!({"nag_seconds": 600}));
    f.host("c").extra_toml = format!("systemctl = \"{}\"\n", systemctl.display());
    f.host("p").extra_toml = "[access]\njournal = [\"ops\"]\n".into();
    f
}

fn whoami() -> String {
    let out = Command::new("id").arg("-un").output().unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

fn groupname() -> String {
    let out = Command::new("id").arg("-gn").output().unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Starts the fleet and waits until every need is satisfied and `ops` holds a `dns`
/// entry at `p`.
async fn started() -> Fleet {
    let mut f = fleet();
    f.start();
    let r = f
        .post(
            "ops",
            "p",
            "/agent/capabilities/dns",
            &json!({"need": "dns/zone", "request": {}}),
        )
        .await;
    assert!(r.status < 300, "ops asks for dns/zone: {}", r.status);
    for host in ["c", "c2"] {
        assert!(
            eventually(Duration::from_secs(20), || f.all_satisfied(host)).await,
            "{host}: {}",
            f.status(host)
        );
    }
    f
}

/// Writes `value` as JSON under the fleet dir and returns the path.
fn write_json(f: &Fleet, name: &str, value: &Value) -> PathBuf {
    let path = f.dir.path().join("new").join(name);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, serde_json::to_vec_pretty(value).unwrap()).unwrap();
    path
}

fn needs_of(f: &Fleet, host: &str) -> Value {
    serde_json::to_value(&f.hosts[host].needs).unwrap()
}

fn capabilities_of(f: &Fleet, host: &str) -> Value {
    serde_json::to_value(&f.hosts[host].capabilities).unwrap()
}

/// `fort-agent plan --config <host> <args>`: (exit ok, stdout, stderr).
fn run_plan(f: &Fleet, host: &str, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(fort_tests::bin("fort-agent"))
        .arg("plan")
        .arg("--config")
        .arg(f.config_path(host))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The plan as JSON, and as text.
fn plan(f: &Fleet, host: &str, args: &[&str]) -> (Value, String) {
    let mut with_json = args.to_vec();
    with_json.push("--json");
    let (ok, out, err) = run_plan(f, host, &with_json);
    assert!(ok, "plan {args:?} on {host} failed: {err}");
    let (ok, text, err) = run_plan(f, host, args);
    assert!(ok, "plan {args:?} on {host} failed: {err}");
    (serde_json::from_str(&out).expect("plan JSON"), text)
}

fn arg(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Every file under `dir` with its bytes and modification time (but the agent's log,
/// which is no state).
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, (Vec<u8>, std::time::SystemTime)> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let path = e.path();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            if meta.is_dir() {
                stack.push(path);
            } else if meta.is_file() && !path.ends_with("agent.log") {
                out.insert(
                    path.clone(),
                    (std::fs::read(&path).unwrap(), meta.modified().unwrap()),
                );
            }
        }
    }
    out
}

/// What planning must leave alone on every host: state directories, delivered files,
/// the installed JSON files, the provider's entries and each need's state.
#[derive(PartialEq)]
struct Untouched {
    files: BTreeMap<String, BTreeMap<PathBuf, (Vec<u8>, std::time::SystemTime)>>,
    entries: Value,
    needs: BTreeMap<String, Value>,
    manifests: BTreeMap<String, Value>,
}

/// The hosts' state once nothing moves any more: acknowledgements and the writes they
/// cause may trail the moment every need reads satisfied.
async fn settled(f: &Fleet) -> Untouched {
    assert!(
        eventually(Duration::from_secs(20), || {
            f.status("p")["provider"]["capabilities"]["web"]["undelivered"] == json!(0)
        })
        .await,
        "p delivers every response: {}",
        f.status("p")
    );
    let mut last = untouched(f);
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(700)).await;
        let now = untouched(f);
        if now == last {
            return now;
        }
        last = now;
    }
    panic!("the fleet never settled");
}

fn untouched(f: &Fleet) -> Untouched {
    let mut files = BTreeMap::new();
    let (mut needs, mut manifests) = (BTreeMap::new(), BTreeMap::new());
    for host in f.hosts.keys() {
        files.insert(host.clone(), snapshot(&f.host_dir(host)));
        let status = f.status(host);
        let mut items = status["needs"]["items"].clone();
        // Relative times are computed per call; the rest must not move.
        for n in items.as_array_mut().into_iter().flatten() {
            n.as_object_mut().unwrap().remove("next_request");
        }
        needs.insert(host.clone(), items);
        manifests.insert(host.clone(), status["manifest_sha256"].clone());
    }
    files.insert(
        "delivered".into(),
        snapshot(&f.dir.path().join("delivered")),
    );
    Untouched {
        files,
        entries: f.read_state("p", "provider-state.json"),
        needs,
        manifests,
    }
}

fn assert_untouched(before: &Untouched, f: &Fleet) {
    let after = untouched(f);
    for (host, files) in &before.files {
        let now = &after.files[host];
        assert_eq!(
            files.keys().collect::<Vec<_>>(),
            now.keys().collect::<Vec<_>>(),
            "{host}: files appeared or vanished"
        );
        for (path, (bytes, mtime)) in files {
            let (b, m) = &now[path];
            assert!(bytes == b, "{} changed", path.display());
            assert_eq!(mtime, m, "{} was rewritten", path.display());
        }
    }
    assert_eq!(before.entries, after.entries, "provider entries changed");
    assert_eq!(before.needs, after.needs, "need states changed");
    assert_eq!(before.manifests, after.manifests, "a manifest changed");
}

fn names(v: &Value, field: &str) -> Vec<String> {
    v.as_array()
        .into_iter()
        .flatten()
        .map(|x| x[field].as_str().unwrap_or("").to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_plan_names_needs_files_and_units_and_changes_nothing() {
    let f = started().await;
    let before = settled(&f).await;
    let delivered = f.dir.path().join("delivered");

    // The files as installed: nothing to do.
    let (same, text) = plan(&f, "c", &[]);
    assert_eq!(same["changes"], json!(false), "{same:#}");
    assert_eq!(
        same["manifest_sha256"]["current"],
        same["manifest_sha256"]["new"]
    );
    assert_eq!(
        same["manifest_sha256"]["current"],
        f.status("c")["manifest_sha256"]
    );
    assert!(text.starts_with("c: no changes"), "{text}");

    // Added: asked for at once, its file written on arrival.
    let mut needs = needs_of(&f, "c");
    needs["web/new"] = json!({"from": "p", "request": {}, "nag_seconds": 60,
        "files": [{"path": delivered.join("new"), "owner": whoami(), "group": groupname()}]});
    let (p, text) = plan(
        &f,
        "c",
        &["--needs", arg(&write_json(&f, "added.json", &needs))],
    );
    assert_eq!(names(&p["needs"]["added"], "need"), ["web/new"]);
    assert_eq!(p["needs"]["added"][0]["from"], "p");
    assert_eq!(
        p["needs"]["files_written"],
        json!([{"path": delivered.join("new"), "need": "web/new"}])
    );
    assert_eq!(p["needs"]["removed"], json!([]));
    assert_ne!(p["manifest_sha256"]["new"], p["manifest_sha256"]["current"]);
    assert!(
        text.contains("needs added (asked for at once):\n  + web/new from p"),
        "{text}"
    );

    // Removed: released at its provider, its file deleted.
    let mut needs = needs_of(&f, "c");
    needs.as_object_mut().unwrap().remove("web/old");
    let (p, text) = plan(
        &f,
        "c",
        &["--needs", arg(&write_json(&f, "removed.json", &needs))],
    );
    assert_eq!(names(&p["needs"]["removed"], "need"), ["web/old"]);
    assert_eq!(
        p["needs"]["files_removed"],
        json!([{"path": delivered.join("old"), "need": "web/old"}])
    );
    assert!(
        text.contains(&format!(
            "files deleted:\n  - {}",
            delivered.join("old").display()
        )),
        "{text}"
    );

    // Changed request: asked again, and its unit restarted if the file changes.
    let mut needs = needs_of(&f, "c");
    needs["web/site"]["request"] = json!({"size": "large"});
    let (p, text) = plan(
        &f,
        "c",
        &["--needs", arg(&write_json(&f, "changed.json", &needs))],
    );
    assert_eq!(names(&p["needs"]["changed"], "need"), ["web/site"]);
    assert_eq!(p["needs"]["changed"][0]["fields"], json!(["request"]));
    assert_eq!(
        p["needs"]["units_restarted"],
        json!({"nginx.service": ["web/site"]})
    );
    // Its file is already there: rewritten in place, neither new nor deleted.
    assert_eq!(p["needs"]["files_written"], json!([]));
    assert_eq!(p["needs"]["files_removed"], json!([]));
    assert!(text.contains("nginx.service (web/site)"), "{text}");

    // A file moved: the old path is deleted, the new one written.
    let mut needs = needs_of(&f, "c");
    needs["web/old"]["files"][0]["path"] = json!(delivered.join("moved"));
    let (p, _) = plan(
        &f,
        "c",
        &["--needs", arg(&write_json(&f, "moved.json", &needs))],
    );
    assert_eq!(p["needs"]["changed"][0]["fields"], json!(["files"]));
    assert_eq!(
        p["needs"]["files_removed"],
        json!([{"path": delivered.join("old"), "need": "web/old"}])
    );
    assert_eq!(
        p["needs"]["files_written"],
        json!([{"path": delivered.join("moved"), "need": "web/old"}])
    );

    // Nag interval and units: applied in place, nothing asked again.
    let mut needs = needs_of(&f, "c");
    needs["web/site"]["nag_seconds"] = json!(30);
    needs["web/site"]["restart_units"] = json!(["nginx.service", "php.service"]);
    let (p, text) = plan(
        &f,
        "c",
        &["--needs", arg(&write_json(&f, "updated.json", &needs))],
    );
    assert_eq!(p["needs"]["changed"], json!([]));
    assert_eq!(
        p["needs"]["updated"],
        json!([{"need": "web/site", "from": "p", "fields": ["nag_seconds", "restart_units"]}])
    );
    assert_eq!(p["needs"]["units_restarted"], json!({}));
    assert!(
        text.contains(
            "needs updated in place (not sent again):\n  ~ web/site (nag_seconds, restart_units)"
        ),
        "{text}"
    );

    assert_untouched(&before, &f);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_plan_names_callers_entries_access_and_config_and_changes_nothing() {
    let f = started().await;
    let before = settled(&f).await;
    let hosts = f.hosts_json();

    // A host leaves hosts.json: it loses access, and its entry goes at the next sweep.
    let mut h = hosts.clone();
    h["hosts"].as_object_mut().unwrap().remove("c2");
    let mut caps = capabilities_of(&f, "p");
    caps["web"]["callers"].as_object_mut().unwrap().remove("c2");
    let (p, text) = plan(
        &f,
        "p",
        &[
            "--hosts",
            arg(&write_json(&f, "hosts.json", &h)),
            "--capabilities",
            arg(&write_json(&f, "caps-no-c2.json", &caps)),
        ],
    );
    assert_eq!(p["registry"]["hosts_removed"], json!(["c2"]));
    assert_eq!(
        p["entries"]["dropped"],
        json!([{"entry": "c2:web/blog", "reason": "c2 is no longer in hosts.json"}])
    );
    assert_eq!(
        p["access"]["lost"],
        json!([{"who": "c2", "to": "this host",
                "why": "no longer in hosts.json: every request it signs gets 401"}])
    );
    assert_eq!(
        p["capabilities"]["callers"],
        json!([{"capability": "web", "host": "c2", "added": [], "removed": ["blog"]}])
    );
    assert!(
        text.contains("provider entries the next GC sweep drops"),
        "{text}"
    );
    assert!(text.contains("  - c2:web/blog"), "{text}");

    // Callers change while the host stays: its entry is refused, and kept until GC
    // proves c2 no longer declares it.
    let mut caps = capabilities_of(&f, "p");
    caps["web"]["callers"]["c2"] = json!(["other"]);
    let (p, text) = plan(
        &f,
        "p",
        &[
            "--capabilities",
            arg(&write_json(&f, "callers.json", &caps)),
        ],
    );
    assert_eq!(
        p["capabilities"]["callers"],
        json!([{"capability": "web", "host": "c2", "added": ["other"], "removed": ["blog"]}])
    );
    assert_eq!(names(&p["entries"]["refused"], "entry"), ["c2:web/blog"]);
    assert_eq!(p["entries"]["dropped"], json!([]));
    assert!(text.contains("web ← c2: +other -blog"), "{text}");

    // A principal loses a capability: its entry expires after the principal TTL.
    let mut caps = capabilities_of(&f, "p");
    caps["dns"]["allowed"] = json!([]);
    caps["web"]["mode"] = json!("rpc");
    caps["mail"] = json!({"handler": caps["web"]["handler"], "mode": "async", "callers": {}});
    let (p, _) = plan(
        &f,
        "p",
        &[
            "--capabilities",
            arg(&write_json(&f, "allowed.json", &caps)),
        ],
    );
    assert_eq!(
        p["access"]["lost"],
        json!([{"who": "ops", "to": "capability dns",
                "why": "dropped from its allowed list: requests get 403"}])
    );
    assert_eq!(names(&p["entries"]["refused"], "entry"), ["ops:dns/zone"]);
    assert!(p["entries"]["refused"][0]["reason"]
        .as_str()
        .unwrap()
        .contains("expires"));
    assert_eq!(p["capabilities"]["added"], json!(["mail"]));
    assert_eq!(
        p["capabilities"]["changed"],
        json!([{"capability": "web", "fields": ["mode"]}])
    );

    // A capability removed: its entries counted, they stay until GC.
    let mut caps = capabilities_of(&f, "p");
    caps.as_object_mut().unwrap().remove("web");
    let (p, _) = plan(
        &f,
        "p",
        &["--capabilities", arg(&write_json(&f, "no-web.json", &caps))],
    );
    assert_eq!(
        p["capabilities"]["removed"],
        json!([{"capability": "web", "entries": 3}])
    );
    assert_eq!(
        names(&p["entries"]["refused"], "entry"),
        ["c2:web/blog", "c:web/old", "c:web/site"]
    );
    assert!(p["entries"]["refused"][0]["reason"]
        .as_str()
        .unwrap()
        .contains("capability web is no longer served"));

    // A new agent.toml: the keys that change, and who loses [access].
    let toml = std::fs::read_to_string(f.config_path("p")).unwrap();
    let new_toml = toml.replace(
        "journal = [\"ops\"]",
        "journal = []\n[gc]\ninterval = \"5m\"",
    );
    let path = f.dir.path().join("new/agent.toml");
    std::fs::write(&path, &new_toml).unwrap();
    let (p, text) = plan(&f, "p", &["--new-config", arg(&path)]);
    assert_eq!(p["config"]["compared"], json!(true));
    assert_eq!(p["config"]["restart_needed"], json!(true));
    assert_eq!(
        p["config"]["changed_keys"],
        json!(["access.journal", "gc.interval"])
    );
    assert_eq!(names(&p["access"]["lost"], "to"), ["journal"]);
    assert!(text.contains("agent.toml keys that change"), "{text}");
    assert!(text.contains("~ gc.interval"), "{text}");

    assert_untouched(&before, &f);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_a_reload_would_refuse_are_refused_and_nothing_changes() {
    let mut f = started().await;
    let before = settled(&f).await;

    // A need from a host hosts.json does not know: the file and the need named.
    let mut needs = needs_of(&f, "c");
    needs["web/x"] = json!({"from": "nowhere", "request": {}, "nag_seconds": 60});
    let bad = write_json(&f, "unknown-provider.json", &needs);
    let (ok, out, err) = run_plan(&f, "c", &["--needs", arg(&bad)]);
    assert!(!ok, "{out}");
    assert!(err.contains(bad.to_str().unwrap()), "{err}");
    assert!(err.contains("nowhere"), "{err}");

    // hosts.json without this host.
    let mut h = f.hosts_json();
    h["hosts"].as_object_mut().unwrap().remove("c");
    let (ok, _, err) = run_plan(&f, "c", &["--hosts", arg(&write_json(&f, "no-c.json", &h))]);
    assert!(!ok);
    assert!(
        err.contains("this host \"c\" is not in hosts.json"),
        "{err}"
    );

    // Not JSON at all.
    let path = f.dir.path().join("new/garbage.json");
    std::fs::write(&path, "{").unwrap();
    let (ok, _, err) = run_plan(&f, "c", &["--capabilities", arg(&path)]);
    assert!(!ok);
    assert!(err.contains("garbage.json"), "{err}");

    // A file given that does not exist is an error, not "no needs".
    let (ok, _, err) = run_plan(&f, "c", &["--needs", "/nonexistent/needs.json"]);
    assert!(!ok);
    assert!(err.contains("cannot read /nonexistent/needs.json"), "{err}");

    assert_untouched(&before, &f);

    // No agent: a clear error, not a plan.
    f.kill("c");
    let (ok, _, err) = run_plan(&f, "c", &[]);
    assert!(!ok);
    assert!(
        err.contains("nothing answers on the admin socket")
            && err.contains("fort-agent is not running"),
        "{err}"
    );
}
