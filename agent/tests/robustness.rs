//! Bad conditions lose nothing: a full disk, a torn state file, a state file from an
//! unknown version, a malformed config file at reload.

use fort_tests::Fleet;
use serde_json::json;
use std::process::Command;

/// A tmpfs mounted over a host's state directory; unmounted on drop.
struct TinyDisk(std::path::PathBuf);

impl TinyDisk {
    fn mount(dir: &std::path::Path, size: &str) -> Option<TinyDisk> {
        std::fs::create_dir_all(dir).ok()?;
        let ok = Command::new("mount")
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
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

fn provider(f: &mut Fleet) {
    f.principal("ops");
    let h = f.script("provide", r#"jq -c 'with_entries(.value = "OK")'"#);
    f.capability(
        "p",
        "web",
        json!({"handler": h, "mode": "async", "allowed": ["ops"]}),
    );
}

async fn ask(f: &Fleet, need: &str) -> u16 {
    f.post(
        "ops",
        "p",
        "/agent/capabilities/web",
        &json!({"need": need, "request": {"pad": "x".repeat(2000)}}),
    )
    .await
    .status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_refuses_with_503_and_loses_nothing_accepted() {
    let mut f = Fleet::new();
    provider(&mut f);
    f.write_files();
    let Some(_disk) = TinyDisk::mount(&f.host_dir("p").join("state"), "512k") else {
        eprintln!("SKIP: cannot mount a tmpfs here (needs root); full-disk behaviour untested");
        return;
    };
    f.start_host("p");
    let mut accepted = Vec::new();
    for i in 0..20 {
        if ask(&f, &format!("web/a{i}")).await == 202 {
            accepted.push(format!("ops:web/a{i}"));
        }
    }
    assert_eq!(accepted.len(), 20);
    // Fill the disk.
    let filler = f.host_dir("p").join("state/filler");
    let _ = Command::new("dd")
        .args(["if=/dev/zero", "bs=4k", "count=1000"])
        .arg(format!("of={}", filler.display()))
        .output();
    let mut refused = 0;
    for i in 0..5 {
        let status = ask(&f, &format!("web/b{i}")).await;
        assert!(status == 503 || status == 202, "{status}");
        refused += (status == 503) as usize;
    }
    assert!(refused > 0, "a full disk still answered 202");
    let state = f.read_state("p", "provider-state.json");
    for key in &accepted {
        assert!(
            state["entries"].get(key).is_some(),
            "{key} lost on a full disk"
        );
    }
    // Room again: the agent recovers without a restart.
    std::fs::remove_file(&filler).unwrap();
    assert_eq!(ask(&f, "web/c0").await, 202);
    let state = f.read_state("p", "provider-state.json");
    assert!(state["entries"].get("ops:web/c0").is_some());
    assert_eq!(
        state["entries"]
            .as_object()
            .unwrap()
            .keys()
            .filter(|k| k.starts_with("ops:web/a"))
            .count(),
        20
    );
    f.kill("p");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_state_file_stops_the_start_and_stays_untouched() {
    let mut f = Fleet::new();
    provider(&mut f);
    f.write_files();
    let state = f.host_dir("p").join("state");
    for (file, bytes) in [
        (
            "provider-state.json",
            &br#"{"version": 1, "entries": {"ops:web/x": {"requ"#[..],
        ),
        (
            "fulfillment-state.json",
            &br#"{"version": 99, "needs": {}}"#[..],
        ),
    ] {
        std::fs::write(state.join(file), bytes).unwrap();
        let log = f
            .try_start_host("p")
            .expect_err("the agent refused to start");
        assert!(
            log.contains(file) && log.contains("will not start"),
            "{log}"
        );
        assert_eq!(
            std::fs::read(state.join(file)).unwrap(),
            bytes,
            "left as it was"
        );
        std::fs::remove_file(state.join(file)).unwrap();
    }
    // With the damaged file moved aside by the operator, it starts (empty).
    f.start_host("p");
    assert_eq!(ask(&f, "web/after").await, 202);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_file_at_reload_keeps_the_old_configuration() {
    let mut f = Fleet::new();
    provider(&mut f);
    f.start();
    std::fs::write(
        f.host_dir("p").join("capabilities.json"),
        r#"{"web": {"handler": "/x", "mode": "async", "cacheRespons": true}}"#,
    )
    .unwrap();
    let (ok, out) = f.admin("p", &["reload"]);
    assert!(!ok);
    assert!(out.contains("cacheRespons"), "{out}");
    assert_eq!(
        ask(&f, "web/still").await,
        202,
        "the old configuration stays in force"
    );
    // And `check` names the same problem before a deploy.
    let (ok, _) = f.admin("p", &["check"]);
    assert!(!ok);
}

#[tokio::test]
async fn an_agent_refuses_to_run_with_a_key_not_in_hosts_json() {
    let mut f = Fleet::new();
    f.host("p");
    f.write_files();
    fort_tests::write_key(
        &f.host_dir("p").join("key"),
        &fort_core::sign::Signer::generate(),
    );
    let out = Command::new(fort_tests::bin("fort-agent"))
        .args(["serve", "--config"])
        .arg(f.config_path("p"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("is not listed for host"));
}
