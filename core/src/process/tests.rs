//! Unit tests of the subprocess helper: real handlers (`/bin/sh`) run through [`run`],
//! and the subreaper scenarios in a fresh copy of the test binary.

use std::collections::HashMap;

use super::tree::{environ_has, parse_stat, scan, Proc};
use super::*;

fn sh(script: &str, timeout: Duration) -> RunSpec {
    RunSpec::new("/bin/sh", Vec::new(), timeout)
        .arg("-c")
        .arg(script)
}

fn stat(pid: i32) -> Option<Proc> {
    read_stat(pid, &mut Vec::new())
}

/// Waits for a pid a handler wrote to `path`.
fn pid_in(path: &Path) -> i32 {
    for _ in 0..500 {
        if let Some(pid) = std::fs::read_to_string(path)
            .ok()
            .and_then(|s| s.trim().parse().ok())
        {
            return pid;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("no pid in {}", path.display());
}

/// Gone or a zombie within a couple of seconds (a SIGKILLed process dies at once;
/// one left alive lives 300 s).
fn dies(pid: i32) -> bool {
    for _ in 0..200 {
        if stat(pid).is_none_or(|p| p.is_zombie()) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}

/// Living processes whose environment holds `FORT_TEST_TAG=<tag>`.
fn tagged(tag: &str) -> Vec<i32> {
    let needle = format!("FORT_TEST_TAG={tag}").into_bytes();
    let mut buf = Vec::new();
    scan(&mut buf)
        .into_iter()
        .filter(|p| !p.is_zombie())
        .filter(|p| environ_has(p.pid, &needle, &mut buf))
        .map(|p| p.pid)
        .collect()
}

fn tag() -> String {
    format!("{:016x}", rand::random::<u64>())
}

#[tokio::test]
async fn echoes_stdin_and_env() {
    let mut spec = sh("cat; printf %s \"$X\"", Duration::from_secs(5)).env("X", "!");
    spec.stdin = b"hello".to_vec();
    let ok = run(&spec).await.unwrap();
    assert_eq!(ok.stdout, b"hello!");
}

#[tokio::test]
async fn nonzero_exit_is_typed() {
    let err = run(&sh("echo oops >&2; exit 3", Duration::from_secs(5)))
        .await
        .unwrap_err();
    assert_eq!(err.exit_code(), 3);
    assert!(err.to_string().contains("oops"));
}

#[tokio::test]
async fn timeout_kills_the_group() {
    let started = Instant::now();
    // The grandchild keeps stdout open; only a group kill ends the read.
    let err = run(&sh("sleep 30 & sleep 30", Duration::from_millis(300)))
        .await
        .unwrap_err();
    assert!(matches!(err, RunError::Timeout(_)));
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[tokio::test]
async fn huge_output_is_refused() {
    let mut spec = sh("head -c 50000000 /dev/zero", Duration::from_secs(10));
    spec.max_stdout = 1024 * 1024;
    let err = run(&spec).await.unwrap_err();
    assert!(matches!(err, RunError::OutputTooLarge(_)));
}

#[tokio::test]
async fn huge_stderr_is_capped_and_unread_stdin_is_fine() {
    let mut spec = sh(
        "head -c 5000000 /dev/zero >&2; echo ok",
        Duration::from_secs(10),
    );
    spec.max_stderr = 1000;
    spec.stdin = vec![b'x'; 4 * 1024 * 1024];
    let ok = run(&spec).await.unwrap();
    assert_eq!(ok.stdout, b"ok\n");
    assert_eq!(ok.stderr.len(), 1000);
}

#[tokio::test]
async fn environment_is_clean_and_cwd_is_root() {
    // Edition 2021: set_var is safe; the name is this test's own.
    std::env::set_var("FORT_PROCESS_TEST_LEAK", "secret");
    let spec = sh("pwd; env", Duration::from_secs(5))
        .env("FORT_HOST", "h1")
        .envs([("FORT_NEED", "cert/x"), ("EXTRA", "e")]);
    let ok = run(&spec).await.unwrap();
    let text = String::from_utf8(ok.stdout).unwrap();
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("/"), "{text}");
    let env: HashMap<&str, &str> = lines.filter_map(|l| l.split_once('=')).collect();
    let path = std::env::var("PATH").unwrap_or_else(|_| DEFAULT_PATH.to_owned());
    assert_eq!(env.get("PATH"), Some(&path.as_str()), "{text}");
    assert_eq!(env.get("FORT_HOST"), Some(&"h1"));
    assert_eq!(env.get("FORT_NEED"), Some(&"cert/x"));
    assert_eq!(env.get("EXTRA"), Some(&"e"));
    assert_eq!(env.get(RUN_ID_VAR).map(|m| m.len()), Some(32));
    assert!(!env.contains_key("FORT_PROCESS_TEST_LEAK"), "{text}");
    // Nothing else but what the shell itself sets.
    let mut keys: Vec<&str> = env.keys().copied().collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        ["EXTRA", "FORT_HOST", "FORT_NEED", RUN_ID_VAR, "PATH", "PWD"],
        "{text}"
    );
}

#[tokio::test]
async fn timeout_kills_setsid_grandchildren() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    // One leaves the session but stays a child; the other (`-f`) is orphaned too.
    let script = format!(
        "setsid sh -c 'echo $$ > {d}/a; exec sleep 300' & \
         setsid -f sh -c 'echo $$ > {d}/b; exec sleep 300'; sleep 300"
    );
    let err = run(&sh(&script, Duration::from_millis(500)))
        .await
        .unwrap_err();
    assert!(matches!(err, RunError::Timeout(_)), "{err}");
    for f in ["a", "b"] {
        let pid = pid_in(&dir.path().join(f));
        assert!(
            dies(pid),
            "setsid grandchild {f} ({pid}) survived the timeout"
        );
    }
}

#[tokio::test]
async fn exit_zero_with_children_holding_stdout_is_done() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    let script = format!(
        "sleep 300 & echo $! > {d}/a; \
         setsid sh -c 'echo $$ > {d}/b; exec sleep 300' & \
         while [ ! -s {d}/b ]; do sleep 0.01; done; echo ok"
    );
    let started = Instant::now();
    let ok = run(&sh(&script, Duration::from_secs(20))).await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(ok.stdout, b"ok\n");
    for f in ["a", "b"] {
        let pid = pid_in(&dir.path().join(f));
        assert!(dies(pid), "child {f} ({pid}) outlived its handler");
    }
    // And the leader's status still decides.
    let started = Instant::now();
    let err = run(&sh("sleep 300 & echo no; exit 4", Duration::from_secs(20)))
        .await
        .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(err.exit_code(), 4);
}

#[tokio::test]
async fn background_children_with_redirected_output_are_killed_at_exit() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    let script = format!("sleep 300 >/dev/null 2>&1 & echo $! > {d}/a; echo ok");
    let ok = run(&sh(&script, Duration::from_secs(20))).await.unwrap();
    assert_eq!(ok.stdout, b"ok\n");
    let pid = pid_in(&dir.path().join("a"));
    assert!(dies(pid), "background child ({pid}) outlived its handler");
}

#[tokio::test]
async fn cancellation_kills_the_tree() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    let script = format!("setsid sh -c 'echo $$ > {d}/a; exec sleep 300' & sleep 300");
    let spec = sh(&script, Duration::from_secs(60));
    let pid_file = dir.path().join("a");
    let cancelled = tokio::time::timeout(Duration::from_secs(10), async {
        tokio::select! {
            _ = run(&spec) => unreachable!("the run lasts 300 s"),
            () = async {
                while !pid_file.exists() {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            } => {}
        }
    })
    .await;
    assert!(cancelled.is_ok());
    let pid = pid_in(&pid_file);
    assert!(dies(pid), "setsid grandchild ({pid}) survived cancellation");
}

#[tokio::test]
async fn a_forking_handler_is_killed_entirely() {
    let t = tag();
    // Keeps starting detached children until killed.
    let spec = sh(
        "while :; do setsid sleep 300 & sleep 300 & done",
        Duration::from_millis(500),
    )
    .env("FORT_TEST_TAG", &t);
    let err = run(&spec).await.unwrap_err();
    assert!(matches!(err, RunError::Timeout(_)), "{err}");
    let mut left = tagged(&t);
    for _ in 0..200 {
        if left.is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
        left = tagged(&t);
    }
    assert!(
        left.is_empty(),
        "{} processes survived: {left:?}",
        left.len()
    );
}

#[test]
fn stat_lines_parse() {
    let line = b"42 (a) b) c) S 7 42 42 0 -1 4194560 97 0 0 0 0 0 0 0 20 0 1 0 12345 2 3";
    let p = parse_stat(42, line).unwrap();
    assert_eq!((p.ppid, p.pgid, p.state, p.start), (7, 42, b'S', 12345));
}

/// The subreaper flag is process-wide, so this runs in a fresh copy of the test
/// binary where nothing else runs.
#[test]
fn orphans_are_killed_and_reaped_by_a_subreaper() {
    const FLAG: &str = "FORT_PROCESS_TEST_SUBREAPER";
    let name = "process::tests::orphans_are_killed_and_reaped_by_a_subreaper";
    if std::env::var_os(FLAG).is_none() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", name, "--nocapture", "--test-threads=1"])
            .env(FLAG, "1")
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{text}");
        assert!(text.contains("1 passed"), "{text}");
        return;
    }
    become_child_subreaper().unwrap();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(subreaper_scenarios());
}

async fn subreaper_scenarios() {
    let me = std::process::id() as i32;
    let ours = |pid: i32| stat(pid).is_some_and(|p| p.ppid == me);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();

    // A double-forked orphan, alive when its handler exits: killed and reaped by the
    // run itself. The handler checks it was reparented to us.
    let script = format!(
        "( sleep 300 >/dev/null 2>&1 & echo $! > {d}/orphan ); \
         sleep 0.1; cut -d' ' -f4 /proc/$(cat {d}/orphan)/stat > {d}/ppid; echo ok"
    );
    let ok = run(&sh(&script, Duration::from_secs(20))).await.unwrap();
    assert_eq!(ok.stdout, b"ok\n");
    assert_eq!(pid_in(&dir.path().join("ppid")), me, "not reparented to us");
    let orphan = pid_in(&dir.path().join("orphan"));
    assert!(
        !ours(orphan),
        "orphan {orphan} still ours: {:?}",
        stat(orphan)
    );

    // The same on timeout, with the orphan in its own session.
    let script = format!("( setsid sh -c 'echo $$ > {d}/orphan2; exec sleep 300' & ); sleep 300");
    let err = run(&sh(&script, Duration::from_millis(500)))
        .await
        .unwrap_err();
    assert!(matches!(err, RunError::Timeout(_)));
    let orphan = pid_in(&dir.path().join("orphan2"));
    assert!(
        !ours(orphan),
        "orphan {orphan} still ours: {:?}",
        stat(orphan)
    );

    // An orphan that left the session and died by itself during the run: no marker
    // left to read; reap_orphans reaps the zombie.
    let script = format!("( setsid sh -c 'echo $$ > {d}/dead; exit 0' & ); sleep 0.3; echo ok");
    run(&sh(&script, Duration::from_secs(20))).await.unwrap();
    let dead = pid_in(&dir.path().join("dead"));
    tokio::task::spawn_blocking(reap_orphans).await.unwrap();
    assert!(!ours(dead), "zombie {dead} not reaped: {:?}", stat(dead));

    // A sweep during a run leaves that run's orphans alone; the run's end kills them.
    let script = format!(
        "( sleep 300 >/dev/null 2>&1 & echo $! > {d}/live ); \
         while [ ! -e {d}/go ]; do sleep 0.02; done; echo ok"
    );
    let spec = sh(&script, Duration::from_secs(20));
    let running = tokio::spawn(async move { run(&spec).await });
    let live = pid_in(&dir.path().join("live"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    tokio::task::spawn_blocking(reap_orphans).await.unwrap();
    assert!(
        stat(live).is_some_and(|p| p.ppid == me && !p.is_zombie()),
        "an active run's orphan was touched: {:?}",
        stat(live)
    );
    std::fs::write(dir.path().join("go"), "").unwrap();
    running.await.unwrap().unwrap();
    assert!(!ours(live), "orphan {live} still ours: {:?}", stat(live));

    // Orphans from outside `run`: one carrying the marker of a run that is over is
    // killed and reaped; one with no marker is left alone.
    let spawn_orphan = |file: &str, marker: Option<&str>| {
        let mut cmd = std::process::Command::new("/bin/sh");
        cmd.arg("-c")
            .arg(format!(
                "( sleep 300 >/dev/null 2>&1 & echo $! > {d}/{file} )"
            ))
            .env_remove(RUN_ID_VAR);
        if let Some(m) = marker {
            cmd.env(RUN_ID_VAR, m);
        }
        assert!(cmd.status().unwrap().success());
        pid_in(&dir.path().join(file))
    };
    let stale = spawn_orphan("stale", Some("0123456789abcdef0123456789abcdef"));
    let stranger = spawn_orphan("stranger", None);
    assert!(ours(stale) && ours(stranger));
    for _ in 0..100 {
        tokio::task::spawn_blocking(reap_orphans).await.unwrap();
        if !ours(stale) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!ours(stale), "stale orphan {stale}: {:?}", stat(stale));
    assert!(
        stat(stranger).is_some_and(|p| p.ppid == me && !p.is_zombie()),
        "unmarked orphan touched"
    );
    sys::kill(stranger);
    while !(stat(stranger).is_some_and(|p| p.is_zombie()) && sys::reap(stranger)) {
        std::thread::sleep(Duration::from_millis(5));
    }
    let left = runs().clone();
    assert!(left.is_empty(), "runs left registered: {left:?}");
}
