//! The demo as a newcomer meets it: `fort-agent demo --keep` passes its walkthrough, and
//! then every command it prints works exactly as printed.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use fort_tests::{bin, skip};

fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
}

/// Kills the demo (and with it its agents) however the test ends.
struct Demo(std::process::Child);

impl Drop for Demo {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn every_command_the_demo_prints_works() {
    if !on_path("jq") || !on_path("openssl") {
        skip(
            "every_command_the_demo_prints_works",
            "the demo's example handlers need jq and openssl",
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("fleet");
    let stderr = std::fs::File::create(dir.path().join("stderr")).unwrap();
    let mut demo = Demo(
        Command::new(bin("fort-agent"))
            .args(["demo", "--keep", "--dir"])
            .arg(&root)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("start the demo"),
    );
    let (tx, rx) = mpsc::channel();
    let out = demo.0.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut seen = Vec::new();
    let mut commands = Vec::new();
    let mut in_commands = false;
    loop {
        let line = match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(l) => l,
            Err(_) => panic!(
                "the demo ended or stalled before printing its commands:\n{}\n{}",
                seen.join("\n"),
                std::fs::read_to_string(dir.path().join("stderr")).unwrap_or_default()
            ),
        };
        seen.push(line.clone());
        if line.starts_with("The fleet keeps running") {
            in_commands = true;
        } else if in_commands && line.starts_with("Ctrl-C") {
            break;
        } else if in_commands && !line.trim().is_empty() {
            commands.push(line.trim().to_owned());
        }
    }
    assert!(
        seen.iter().any(|l| l == "All steps passed."),
        "{}",
        seen.join("\n")
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
    // Ctrl-C (here SIGTERM) stops the fleet: the demo exits cleanly.
    let pid = demo.0.id() as i32;
    assert!(Command::new("kill")
        .arg(pid.to_string())
        .status()
        .unwrap()
        .success());
    let done = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(status) = demo.0.try_wait().unwrap() {
            assert!(status.success(), "the demo exited with {status}");
            break;
        }
        assert!(Instant::now() < done, "the demo did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The demo fleet shipped as NixOS configuration (examples/demo-fleet) evaluates, and
/// asks for exactly what the demo asks for: the same needs from the same hosts with the
/// same requests, plus only the interfaces' defaults the module fills in.
#[test]
fn the_demo_fleet_as_nixos_configuration_asks_what_the_demo_asks() {
    const TEST: &str = "the_demo_fleet_as_nixos_configuration_asks_what_the_demo_asks";
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
