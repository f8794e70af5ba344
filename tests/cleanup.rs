//! The harness's servers stop however the program that started them ends. A program
//! (`fort-test-servers`) starts every one installed here (Knot, BIND, nginx, pebble and
//! its webroot nginx, the OpenID provider, PostgreSQL and a psql session, an agent) and
//! then exits, panics, or is interrupted with SIGINT; this test is the reaper of whatever
//! it leaves (PR_SET_CHILD_SUBREAPER), so a server that outlives it, or an nginx worker
//! whose master is gone, shows up here as a child.

use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use fort_tests::cleanup::{adopt_orphans, leftovers};
use fort_tests::skip;

/// One run at a time: every run's leftovers become this process's children.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Runs `fort-test-servers how`, sends `signal` once everything has started, and returns
/// its exit status, what it started, and what it left running.
fn run(how: &str, signal: Option<&str>) -> (ExitStatus, Vec<String>, Vec<(u32, String)>) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    adopt_orphans();
    let mut child = Command::new(env!("CARGO_BIN_EXE_fort-test-servers"))
        .arg(how)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start fort-test-servers");
    let (tx, rx) = std::sync::mpsc::channel();
    let stdout = child.stdout.take().expect("stdout");
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let started = rx
        .recv_timeout(Duration::from_secs(180))
        .ok()
        .and_then(|l| l.strip_prefix("started: ").map(str::to_owned));
    let Some(started) = started else {
        let _ = child.kill();
        let _ = child.wait();
        let left = leftovers(&[]);
        panic!("fort-test-servers did not start its servers; it left {left:?}");
    };
    if let Some(signal) = signal {
        let sent = Command::new("kill")
            .args([signal, &child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(sent.success());
    }
    let status = child.wait().expect("wait for fort-test-servers");
    let left = leftovers(&[]);
    let started: Vec<String> = started.split_whitespace().map(str::to_owned).collect();
    (status, started, left)
}

/// Says which servers could not be started here (not installed), so the test's reach
/// shows in the skip list.
fn report_missing(test: &str, started: &[String]) {
    for server in [
        "knot",
        "bind",
        "nginx",
        "pebble",
        "webroot",
        "oidc-provider",
        "postgres",
        "psql",
    ] {
        if !started.iter().any(|s| s == server) {
            skip(
                test,
                &format!("{server} could not be started here (not installed)"),
            );
        }
    }
}

#[test]
fn servers_stop_when_the_program_exits() {
    let (status, started, left) = run("exit", None);
    report_missing("servers_stop_when_the_program_exits", &started);
    assert!(status.success(), "{status}");
    assert!(started.contains(&"agent".to_owned()), "{started:?}");
    assert!(
        left.is_empty(),
        "still running after a normal exit: {left:?}"
    );
}

#[test]
fn servers_stop_when_the_program_panics() {
    let (status, started, left) = run("panic", None);
    report_missing("servers_stop_when_the_program_panics", &started);
    assert_eq!(status.code(), Some(101), "{status}");
    assert!(left.is_empty(), "still running after a panic: {left:?}");
}

#[test]
fn servers_stop_when_the_program_is_interrupted() {
    let (status, started, left) = run("wait", Some("-INT"));
    report_missing("servers_stop_when_the_program_is_interrupted", &started);
    assert_eq!(status.signal(), Some(libc::SIGINT), "{status}");
    assert!(left.is_empty(), "still running after SIGINT: {left:?}");
}
