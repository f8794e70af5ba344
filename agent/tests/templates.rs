//! Files rendered from templates over several needs (docs/protocol.md §11.14), with real
//! agents: an environment file from a database's URL and an OIDC client's secret lands
//! once both needs are satisfied, with its owner and mode, and its unit is restarted
//! once; a rotation of one input renders it again and restarts the unit once more; a
//! payload sent again unchanged, and a restart of the agent, render and restart nothing;
//! a template no longer declared takes its file with it; a template over a need the host
//! does not declare, or one that does not parse, is refused by the check and by a reload.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use fort_tests::{eventually, Fleet};
use serde_json::{json, Value};

const ENV: &str = "DATABASE_URL={{ needs[\"db/wiki\"].uri }}\nOIDC_CLIENT_SECRET={{ needs[\"sso/wiki\"].client_secret }}\n";

fn fleet() -> (Fleet, PathBuf, PathBuf) {
    let mut f = Fleet::new();
    f.principal("ops");
    let db = f.script(
        "db",
        r#"r=$(od -An -N6 -tx1 /dev/urandom | tr -d ' \n'); jq -c --arg r "$r" 'with_entries(.value = (.value.response // {"uri": ("postgresql://wiki:" + $r + "@db/wiki")}))'"#,
    );
    let sso = f.script(
        "sso",
        r#"r=$(od -An -N6 -tx1 /dev/urandom | tr -d ' \n'); jq -c --arg r "$r" 'with_entries(.value = (.value.response // {"client_id": "wiki", "client_secret": ("secret-" + $r)}))'"#,
    );
    for (name, h) in [("db", db), ("sso", sso)] {
        f.capability(
            "p",
            name,
            json!({"handler": h, "mode": "async", "cacheResponse": true}),
        );
    }
    f.need("c", "db/wiki", "p", json!({}));
    f.need("c", "sso/wiki", "p", json!({}));
    let env = f.dir.path().join("out/wiki.env");
    f.host("c").needs.insert(
        "$templates".into(),
        json!({"wiki-env": {"template": ENV, "needs": ["db/wiki", "sso/wiki"],
                            "path": env, "mode": "0440", "restart_units": ["wiki.service"]}}),
    );
    let log = f.dir.path().join("systemctl.log");
    let recorder = f.script("systemctl", &format!(r#"echo "$*" >> {}"#, log.display()));
    f.host("c").extra_toml = format!(
        "systemctl = \"{}\"\n[fulfill]\nbackoff = \"200ms\"\n",
        recorder.display()
    );
    f.host("p").extra_toml = "[access]\ntrigger = [\"ops\"]\n".into();
    (f, env, log)
}

fn restarts(log: &Path) -> usize {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("wiki.service"))
        .count()
}

fn template(f: &Fleet) -> Value {
    f.status("c")["templates"]["wiki-env"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_from_several_needs_is_rendered_once_per_change() {
    let (mut f, env, log) = fleet();
    f.start();
    assert!(
        eventually(Duration::from_secs(30), || template(&f)["state"]
            == "rendered")
        .await,
        "{}",
        f.status("c")
    );
    let text = std::fs::read_to_string(&env).unwrap();
    assert!(
        text.starts_with("DATABASE_URL=postgresql://wiki:"),
        "{text}"
    );
    assert!(
        text.contains("\nOIDC_CLIENT_SECRET=secret-") && text.ends_with('\n'),
        "{text}"
    );
    assert_eq!(
        std::fs::metadata(&env).unwrap().permissions().mode() & 0o777,
        0o440
    );
    assert!(eventually(Duration::from_secs(10), || restarts(&log) == 1).await);

    // One input rotated: rendered again, the unit restarted once more.
    let (code, out, err) = f.fort("ops", "p", &["trigger", "p", "sso", "--force"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        eventually(Duration::from_secs(30), || {
            std::fs::read_to_string(&env).is_ok_and(|t| t != text)
        })
        .await,
        "not rendered again"
    );
    let rotated = std::fs::read_to_string(&env).unwrap();
    assert!(
        rotated.starts_with(text.lines().next().unwrap()),
        "the URL stays: {rotated}"
    );
    assert!(eventually(Duration::from_secs(10), || restarts(&log) == 2).await);

    // The same payloads again (asked for again), and a restart of the agent: nothing
    // rendered, nothing restarted.
    let (ok, out) = f.admin("c", &["resend", "db/wiki"]);
    assert!(ok, "{out}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    f.kill("c");
    f.start_host("c");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(std::fs::read_to_string(&env).unwrap(), rotated);
    assert_eq!(
        restarts(&log),
        2,
        "{}",
        std::fs::read_to_string(&log).unwrap()
    );
    assert_eq!(template(&f)["state"], "rendered", "{}", f.status("c"));

    // A template over a need the host does not declare: the check and a reload refuse it,
    // and the file rendered before stays.
    let needs_file = f.host_dir("c").join("needs.json");
    let good = std::fs::read_to_string(&needs_file).unwrap();
    let mut bad: Value = serde_json::from_str(&good).unwrap();
    bad["$templates"]["wiki-env"]["needs"] = json!(["db/wiki", "sso/other"]);
    std::fs::write(&needs_file, bad.to_string()).unwrap();
    let out = Command::new(fort_tests::bin("fort-agent"))
        .args(["check", "--skip-handlers", "--skip-key", "--config"])
        .arg(f.config_path("c"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the check passed");
    assert!(
        err.contains("\"sso/other\" is not a need this host declares"),
        "{err}"
    );
    let (ok, out) = f.admin("c", &["reload"]);
    assert!(!ok, "{out}");
    bad["$templates"]["wiki-env"]["needs"] = json!(["db/wiki", "sso/wiki"]);
    bad["$templates"]["wiki-env"]["template"] = json!("{{ unclosed");
    std::fs::write(&needs_file, bad.to_string()).unwrap();
    let (ok, out) = f.admin("c", &["reload", "--json"]);
    assert!(!ok && out.contains("$templates.wiki-env.template"), "{out}");
    assert_eq!(std::fs::read_to_string(&env).unwrap(), rotated);

    // Its declaration changed, its inputs did not: written again with the new mode...
    let mut changed: Value = serde_json::from_str(&good).unwrap();
    changed["$templates"]["wiki-env"]["mode"] = json!("0400");
    std::fs::write(&needs_file, changed.to_string()).unwrap();
    let (ok, out) = f.admin("c", &["reload"]);
    assert!(ok, "{out}");
    let mode = || std::fs::metadata(&env).map_or(0, |m| m.permissions().mode() & 0o777);
    assert!(
        eventually(Duration::from_secs(10), || mode() == 0o400).await,
        "a changed mode was not applied: {:o}",
        mode()
    );
    // ...and at a new path, where the old path's copy of the rendering goes.
    let moved = env.with_file_name("wiki-moved.env");
    changed["$templates"]["wiki-env"]["path"] = json!(moved);
    std::fs::write(&needs_file, changed.to_string()).unwrap();
    let (ok, out) = f.admin("c", &["reload"]);
    assert!(ok, "{out}");
    assert!(
        eventually(Duration::from_secs(10), || moved.exists() && !env.exists()).await,
        "a changed declaration was not written again: {}",
        f.status("c")["templates"]
    );
    assert_eq!(
        std::fs::metadata(&moved).unwrap().permissions().mode() & 0o777,
        0o400
    );
    assert_eq!(std::fs::read_to_string(&moved).unwrap(), rotated);
    let env = moved;

    // No longer declared: its file goes.
    let mut without: Value = serde_json::from_str(&good).unwrap();
    without.as_object_mut().unwrap().remove("$templates");
    std::fs::write(&needs_file, without.to_string()).unwrap();
    let (ok, out) = f.admin("c", &["reload"]);
    assert!(ok, "{out}");
    assert!(
        eventually(Duration::from_secs(10), || !env.exists()).await,
        "the file of a template no longer declared stays"
    );
}
