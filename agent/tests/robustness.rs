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
        fort_tests::skip(
            "a_full_disk_refuses_with_503_and_loses_nothing_accepted",
            "cannot mount a tmpfs here (needs root); full-disk behaviour untested",
        );
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
    // What was refused is nowhere, in memory as on disk: the agent's view and the files
    // agree entry for entry.
    let in_memory = f.status("p")["provider"]["capabilities"]["web"]["entries"]
        .as_u64()
        .unwrap();
    let on_disk = f.read_state("p", "provider-state.json")["entries"]
        .as_object()
        .unwrap()
        .len() as u64;
    assert_eq!(in_memory, on_disk, "refused entries stayed in memory");
    // Room again: the agent recovers without a restart, requests and releases alike.
    std::fs::remove_file(&filler).unwrap();
    assert_eq!(ask(&f, "web/c0").await, 202);
    for i in 0..5 {
        assert_eq!(
            ask(&f, &format!("web/b{i}")).await,
            202,
            "web/b{i} after the disk freed"
        );
    }
    let release = f
        .post(
            "ops",
            "p",
            "/agent/capabilities/web",
            &json!({"need": "web/b0", "release": true}),
        )
        .await;
    assert_eq!(release.status, 202);
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
    let entries = state["entries"].as_object().unwrap();
    assert!(entries.contains_key("ops:web/b4") && !entries.contains_key("ops:web/b0"));
    f.kill("p");
}

/// Finding: a request nested ~125 levels deep was accepted; the state file that stored
/// it could not be parsed at the next start, and the provider started empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deeply_nested_request_is_refused_and_the_state_stays_readable() {
    let mut f = Fleet::new();
    provider(&mut f);
    f.start();
    let nested = |depth: usize| {
        let mut v = json!("leaf");
        for _ in 0..depth {
            v = json!([v]);
        }
        v
    };
    for (depth, expected) in [(125, 400), (40, 400), (20, 202)] {
        let body = json!({"need": format!("web/d{depth}"), "request": {"deep": nested(depth)}});
        let r = f.post("ops", "p", "/agent/capabilities/web", &body).await;
        assert_eq!(r.status, expected, "{depth} levels");
    }
    assert_eq!(ask(&f, "web/plain").await, 202);
    f.kill("p");
    f.start_host("p");
    let state = f.read_state("p", "provider-state.json");
    let keys: Vec<&String> = state["entries"].as_object().unwrap().keys().collect();
    assert_eq!(keys, ["ops:web/d20", "ops:web/plain"]);
    assert_eq!(
        f.status("p")["provider"]["capabilities"]["web"]["entries"],
        2
    );
}

/// Finding: ~1,500 idle connections (at the common limit of 1024 descriptors) made
/// state writes fail with EMFILE, and idle connections to the metrics listener (which
/// had no header timeout) cut off the main port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_cannot_starve_state_writes_or_the_control_plane() {
    let mut f = Fleet::new();
    provider(&mut f);
    let metrics = fort_tests::free_addr("127.0.0.1");
    let p = f.host("p");
    p.spawn.nofile = Some(256);
    p.extra_toml = format!("metrics_listen = \"{metrics}\"\nheader_read_timeout = \"60s\"\n");
    f.start();
    // Idle connections from several addresses, to both listeners, beyond the 256
    // descriptors the agent has.
    let mut idle = Vec::new();
    for ip in 211..=216 {
        for _ in 0..50 {
            if let Ok(s) = fort_tests::tcp_connect_from(&format!("127.0.0.{ip}"), f.hosts["p"].addr)
            {
                idle.push(s);
            }
            if let Ok(s) = fort_tests::tcp_connect_from(&format!("127.0.0.{ip}"), metrics) {
                idle.push(s);
            }
        }
    }
    assert!(idle.len() > 500, "{} connections made", idle.len());
    std::thread::sleep(std::time::Duration::from_millis(300));
    // Durable writes and handler runs still have their descriptors.
    for i in 0..5 {
        assert_eq!(ask(&f, &format!("web/e{i}")).await, 202);
    }
    let state = f.read_state("p", "provider-state.json");
    assert_eq!(state["entries"].as_object().unwrap().len(), 5);
    let log = std::fs::read_to_string(f.host_dir("p").join("agent.log")).unwrap();
    assert!(!log.contains("Too many open files"), "{log}");
    drop(idle);
}

/// Finding: the state directory and nonce journal followed the umask, the admin socket
/// was made private only after it was bound, the journal followed symlinks, admin
/// connections had no timeout, and temporary files of a killed agent stayed forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_are_private_whatever_the_umask_and_nothing_is_followed_or_left() {
    use std::io::Read;
    use std::os::unix::fs::PermissionsExt;
    let mut f = Fleet::new();
    provider(&mut f);
    let p = f.host("p");
    p.spawn.umask = Some(0);
    p.extra_toml = "header_read_timeout = \"1s\"\n".into();
    f.write_files();
    let state = f.host_dir("p").join("state");
    let stale = state.join(".provider-state.json.tmp.4242.0");
    std::fs::write(&stale, b"half a file").unwrap();
    f.start_host("p");
    assert_eq!(ask(&f, "web/m").await, 202);
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&state), 0o700);
    // Files 0600 and directories (the audit trail's) 0700, all the way down.
    let mut dirs = vec![state.clone()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                assert_eq!(mode(&path), 0o700, "{}", path.display());
                dirs.push(path);
            } else {
                assert_eq!(mode(&path), 0o600, "{}", path.display());
            }
        }
    }
    assert_eq!(mode(&f.host_dir("p").join("agent.sock")), 0o600);
    assert!(!stale.exists(), "a stale temporary file stayed");
    // An admin client that says nothing is dropped.
    let mut idle =
        std::os::unix::net::UnixStream::connect(f.host_dir("p").join("agent.sock")).unwrap();
    idle.set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .unwrap();
    let started = std::time::Instant::now();
    let mut buf = [0u8; 16];
    assert_eq!(idle.read(&mut buf).unwrap_or(0), 0);
    assert!(started.elapsed() < std::time::Duration::from_secs(4));
    // A symlink where the nonce journal goes is refused, not followed.
    f.kill("p");
    let journal = state.join("nonces.log");
    let victim = f.dir.path().join("victim");
    std::fs::write(&victim, b"precious\n").unwrap();
    std::fs::remove_file(&journal).unwrap();
    std::os::unix::fs::symlink(&victim, &journal).unwrap();
    let log = f
        .try_start_host("p")
        .expect_err("started through a symlinked journal");
    assert!(log.contains("nonces.log"), "{log}");
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious\n");
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
    let (ok, out) = f.admin("p", &["reload", "--json"]);
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
