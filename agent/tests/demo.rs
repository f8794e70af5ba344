//! The demo as a newcomer meets it: `fort-agent demo --keep` passes its walkthrough, and
//! then every command it prints works exactly as printed. And whichever way the demo
//! ends (done, failed, Ctrl-C), nothing it started is left running: this test process is
//! the reaper of whatever the demo leaves (PR_SET_CHILD_SUBREAPER), so a server, an
//! nginx worker or an agent that outlives it shows up here as a child. The audit trails
//! its hosts wrote name what was issued and delivered without any secret of the fleet.

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use fort_tests::cleanup::{adopt_orphans, leftovers};
use fort_tests::{bin, skip};

fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
}

/// One demo at a time: what each leaves running becomes this process's child.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// The demo, in a process group of its own as a shell's foreground job is. However the
/// test ends, it is asked to stop (SIGTERM, which it handles like Ctrl-C), and killed
/// if it does not.
struct Demo {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
    stderr: std::path::PathBuf,
}

impl Demo {
    fn start(dir: &Path, args: &[&str]) -> Demo {
        let stderr = dir.join("stderr");
        let mut child = Command::new(bin("fort-agent"))
            .arg("demo")
            .args(args)
            .arg("--dir")
            .arg(dir.join("fleet"))
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .expect("start the demo");
        let (tx, lines) = mpsc::channel();
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Demo {
            child,
            lines,
            seen: Vec::new(),
            stderr,
        }
    }

    /// The next line of its output, within `deadline`.
    fn line(&mut self, deadline: Instant) -> String {
        match self
            .lines
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        {
            Ok(l) => {
                self.seen.push(l.clone());
                l
            }
            Err(_) => panic!(
                "the demo ended or stalled:\n{}\n{}",
                self.seen.join("\n"),
                self.stderr()
            ),
        }
    }

    /// Reads lines until one satisfies `f`; that line.
    fn until(&mut self, within: Duration, f: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + within;
        loop {
            let l = self.line(deadline);
            if f(&l) {
                return l;
            }
        }
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// `kill SIGNAL` to the demo (`group`: to its whole process group, as a terminal's
    /// Ctrl-C reaches the foreground job).
    fn signal(&self, signal: &str, group: bool) {
        let target = if group {
            format!("-{}", self.child.id())
        } else {
            self.child.id().to_string()
        };
        let sent = Command::new("kill")
            .args([signal, "--", &target])
            .status()
            .unwrap();
        assert!(sent.success(), "kill {signal} {target}");
    }

    /// Its exit status, waiting up to `within`; the rest of its output is read.
    fn wait(&mut self, within: Duration) -> ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                while let Ok(l) = self.lines.recv_timeout(Duration::from_secs(5)) {
                    self.seen.push(l);
                }
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "the demo did not end within {within:?}:\n{}",
                self.seen.join("\n")
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Demo {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = Command::new("kill")
                .arg(self.child.id().to_string())
                .status();
            let deadline = Instant::now() + Duration::from_secs(30);
            while let Ok(None) = self.child.try_wait() {
                if Instant::now() > deadline {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

/// Whether the demo can run here; says why not otherwise.
fn can_run(test: &str) -> bool {
    if !on_path("jq") || !on_path("openssl") {
        skip(test, "the demo's example handlers need jq and openssl");
        return false;
    }
    true
}

/// Asserts that the demo, now ended, left nothing running.
fn assert_nothing_left(demo: &Demo, how: &str) {
    let left = leftovers(&[]);
    assert!(
        left.is_empty(),
        "after {how}, the demo left running: {left:?}\n{}",
        demo.seen.join("\n")
    );
}

#[test]
fn every_command_the_demo_prints_works() {
    if !can_run("every_command_the_demo_prints_works") {
        return;
    }
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    adopt_orphans();
    let dir = tempfile::tempdir().unwrap();
    let mut demo = Demo::start(dir.path(), &["--keep"]);
    demo.until(Duration::from_secs(180), |l| {
        l.starts_with("The fleet keeps running")
    });
    let mut commands = Vec::new();
    loop {
        let line = demo.line(Instant::now() + Duration::from_secs(10));
        if line.starts_with("Ctrl-C") {
            break;
        } else if !line.trim().is_empty() {
            commands.push(line.trim().to_owned());
        }
    }
    assert!(
        demo.seen.iter().any(|l| l == "All steps passed."),
        "{}",
        demo.seen.join("\n")
    );
    assert!(
        !commands.iter().any(|c| c.starts_with('(')),
        "the demo says something must be built first: {commands:?}"
    );
    let (env, rest) = commands.split_first().expect("commands");
    assert!(env.starts_with("export "), "{env}");
    assert!(rest.len() >= 6, "{commands:?}");
    for command in rest {
        let out = Command::new("sh")
            .arg("-c")
            .arg(format!("{env}\n{command}"))
            .env_remove("FORT_SSH_KEY")
            .env_remove("FORT_ORIGIN")
            .env_remove("FORT_HOSTS")
            .output()
            .expect("run sh");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "`{command}` failed ({}):\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!stdout.trim().is_empty(), "`{command}` printed nothing");
        if command.ends_with(" fleet") {
            for host in ["forge", "beacon", "app"] {
                assert!(stdout.contains(host), "{stdout}");
            }
        }
    }
    // Ctrl-C in a terminal reaches the demo's whole process group: it stops the fleet
    // and exits cleanly, leaving nothing behind.
    demo.signal("-INT", true);
    let status = demo.wait(Duration::from_secs(60));
    assert!(status.success(), "the demo exited with {status}");
    assert_nothing_left(&demo, "Ctrl-C with --keep");
}

#[test]
fn the_demo_leaves_nothing_running_when_it_finishes() {
    const T: &str = "the_demo_leaves_nothing_running_when_it_finishes";
    if !can_run(T) {
        return;
    }
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    adopt_orphans();
    let dir = tempfile::tempdir().unwrap();
    let mut demo = Demo::start(dir.path(), &[]);
    let status = demo.wait(Duration::from_secs(240));
    assert!(
        status.success(),
        "the demo exited with {status}:\n{}\n{}",
        demo.seen.join("\n"),
        demo.stderr()
    );
    assert!(demo.seen.iter().any(|l| l == "All steps passed."));
    // A step whose server is not installed here says so in the summary.
    for l in demo.seen.iter().filter(|l| l.contains(" OK  skipped: ")) {
        skip(T, &format!("demo step {}", l.trim()));
    }
    assert_nothing_left(&demo, "a finished walkthrough");
    no_secret_in_any_audit_file(&dir.path().join("fleet"));
}

/// Every file under `dir`, recursively.
fn walk(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = e.path();
        match e.file_type() {
            Ok(t) if t.is_dir() => walk(&path, out),
            Ok(t) if t.is_file() => out.push(path),
            _ => {}
        }
    }
}

/// What a delivered credential or a private key holds: every run of at least 20
/// characters of a secret's alphabet (base64, hex, URL-safe tokens) with a letter and
/// a digit in it, from every file delivered to a need and every key file.
fn secrets_of(files: &[std::path::PathBuf]) -> std::collections::BTreeSet<String> {
    let mut out = std::collections::BTreeSet::new();
    for file in files {
        let text = file.to_string_lossy();
        let delivered = text.contains("/run/needs/");
        let key = file
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.ends_with(".key") || n.ends_with("_key"));
        if !delivered && !key {
            continue;
        }
        let bytes = std::fs::read(file).unwrap_or_default();
        for token in String::from_utf8_lossy(&bytes)
            .split(|c: char| !(c.is_ascii_alphanumeric() || "+/=_-".contains(c)))
            .filter(|t| t.len() >= 20)
            .filter(|t| t.bytes().any(|b| b.is_ascii_digit()))
            .filter(|t| t.bytes().any(|b| b.is_ascii_alphabetic()))
        {
            out.insert(token.to_owned());
        }
    }
    out
}

fn no_secret_in_any_audit_file(fleet: &Path) {
    let mut files = Vec::new();
    walk(fleet, &mut files);
    let trails: Vec<_> = files
        .iter()
        .filter(|f| {
            f.extension().is_some_and(|e| e == "jsonl")
                && f.parent()
                    .and_then(|d| d.file_name())
                    .is_some_and(|d| d == "audit")
        })
        .collect();
    let written: Vec<String> = trails
        .iter()
        .map(|f| std::fs::read_to_string(f).unwrap())
        .collect();
    for host in ["forge", "beacon", "app"] {
        assert!(
            trails
                .iter()
                .any(|f| f.components().any(|c| c.as_os_str() == host)),
            "{host} wrote no audit trail: {trails:?}"
        );
    }
    assert!(
        written.iter().any(|t| t.contains("\"event\":\"applied\"")),
        "no delivery in the demo's audit trails"
    );
    let secrets = secrets_of(&files);
    assert!(
        secrets.len() >= 5,
        "the demo delivered no secrets to look for: {secrets:?}"
    );
    for (file, text) in trails.iter().zip(&written) {
        for secret in &secrets {
            assert!(
                !text.contains(secret.as_str()),
                "{} holds {secret:?}, which the fleet keeps secret",
                file.display()
            );
        }
    }
}

#[test]
fn the_demo_leaves_nothing_running_when_it_fails() {
    if !can_run("the_demo_leaves_nothing_running_when_it_fails") {
        return;
    }
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    adopt_orphans();
    let dir = tempfile::tempdir().unwrap();
    let mut demo = Demo::start(dir.path(), &[]);
    // app's agent killed under it: the demo cannot go on, after its servers started.
    let up = demo.until(Duration::from_secs(120), |l| l.contains("app is up (pid "));
    let pid = up
        .split("(pid ")
        .nth(1)
        .and_then(|p| p.trim_end_matches(')').parse::<u32>().ok())
        .expect("app's pid");
    assert!(Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap()
        .success());
    let status = demo.wait(Duration::from_secs(60));
    assert!(!status.success(), "the demo went on without app's agent");
    assert!(demo.stderr().contains("demo failed"), "{}", demo.stderr());
    assert_nothing_left(&demo, "a failure");
}

#[test]
fn the_demo_leaves_nothing_running_when_interrupted() {
    if !can_run("the_demo_leaves_nothing_running_when_interrupted") {
        return;
    }
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    adopt_orphans();
    let dir = tempfile::tempdir().unwrap();
    let mut demo = Demo::start(dir.path(), &[]);
    demo.until(Duration::from_secs(120), |l| l.starts_with("Step 1/"));
    // SIGINT to the demo alone: its servers, in groups of their own, see nothing of it.
    demo.signal("-INT", false);
    let status = demo.wait(Duration::from_secs(60));
    assert!(
        !status.success(),
        "an interrupted demo should not report success"
    );
    assert!(
        demo.stderr().contains("interrupted by Ctrl-C"),
        "{}",
        demo.stderr()
    );
    assert_nothing_left(&demo, "SIGINT during the walkthrough");
}

/// The demo fleet shipped as NixOS configuration (examples/demo-fleet) evaluates, and
/// asks for exactly what the demo asks for: the same needs from the same hosts with the
/// same requests, plus only the interfaces' defaults the module fills in.
#[test]
fn the_demo_fleet_as_nixos_configuration_asks_what_the_demo_asks() {
    const TEST: &str = "the_demo_fleet_as_nixos_configuration_asks_what_the_demo_asks";
    // Its child must not be taken for a demo's leftover.
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new("bash")
        .arg(repo.join("nixos-module/tests/example.sh"))
        .output()
        .expect("run bash");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.code() == Some(77) {
        let why = stdout.trim().lines().last().unwrap_or("skipped");
        skip(TEST, why.strip_prefix("SKIP: ").unwrap_or(why));
        return;
    }
    assert!(
        out.status.success(),
        "examples/demo-fleet does not evaluate:\n{stderr}"
    );
    let example: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let demo = fort_agent::demo::requests();
    let schemas: serde_json::Value = serde_json::from_slice(
        &std::fs::read(repo.join("nixos-module/tests/expected/schemas.json")).unwrap(),
    )
    .unwrap();
    let hosts = |v: &serde_json::Value| {
        v.as_object()
            .unwrap()
            .iter()
            .filter(|(_, needs)| !needs.as_object().unwrap().is_empty())
            .map(|(h, _)| h.clone())
            .collect::<Vec<_>>()
    };
    assert_eq!(hosts(&example), hosts(&demo), "hosts with needs");
    for (host, needs) in demo.as_object().unwrap() {
        let shipped = example[host].as_object().unwrap();
        let mut keys: Vec<&String> = shipped.keys().collect();
        keys.sort();
        let mut want: Vec<&String> = needs.as_object().unwrap().keys().collect();
        want.sort();
        assert_eq!(keys, want, "{host}'s needs");
        for (need, request) in needs.as_object().unwrap() {
            let got = shipped[need].as_object().unwrap();
            let cap = need.split('/').next().unwrap();
            for (field, value) in got {
                match request.get(field) {
                    Some(v) => assert_eq!(value, v, "{host} {need} {field}"),
                    // Filled in by the module: the interface's default, nothing else.
                    None => assert_eq!(
                        Some(value),
                        schemas["schemas"][cap]["properties"][field].get("default"),
                        "{host} {need}: {field} is not in the demo's request"
                    ),
                }
            }
            for field in request.as_object().unwrap().keys() {
                assert!(
                    got.contains_key(field),
                    "{host} {need}: {field} is not shipped"
                );
            }
        }
    }
}
