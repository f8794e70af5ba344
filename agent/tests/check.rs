//! What an operator meets before anything runs: `fort-agent check` on handlers that
//! cannot run, files that are missing, plaintext, and its summary; and the messages for
//! key files and listen addresses that cannot be used, from `check`, `serve` and `fort`.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

use fort_tests::{write_key, Fleet};
use serde_json::json;

/// `fort-agent <args> --config <host's agent.toml>`: (exit ok, stdout, stderr).
fn agent(f: &Fleet, host: &str, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(fort_tests::bin("fort-agent"))
        .args(args)
        .arg("--config")
        .arg(f.config_path(host))
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Provider `p` serving `web`, consumer `c` needing `web/site`, principal `ops`, and a
/// third host `q`.
fn fleet() -> Fleet {
    let mut f = Fleet::new();
    f.principal("ops");
    let ok = f.script("provide", r#"jq -c 'with_entries(.value = "OK")'"#);
    f.capability("p", "web", json!({"handler": ok, "mode": "async"}));
    f.need("c", "web/site", "p", json!({}));
    f.host("q");
    f
}

fn edit_toml(f: &Fleet, host: &str, edit: impl FnOnce(String) -> String) {
    let path = f.config_path(host);
    let toml = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, edit(toml)).unwrap();
}

fn chmod(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

#[test]
fn the_summary_counts_hosts_and_principals_apart_with_plurals() {
    let f = fleet();
    f.write_files();
    let (ok, out, err) = agent(&f, "p", &["check"]);
    assert!(ok, "{err}");
    assert!(
        out.ends_with(": ok: host p, 3 hosts, 1 principal, 0 needs, 1 capability\n"),
        "{out}"
    );
    let (ok, out, err) = agent(&f, "c", &["check"]);
    assert!(ok, "{err}");
    assert!(
        out.ends_with(": ok: host c, 3 hosts, 1 principal, 1 need, 0 capabilities\n"),
        "{out}"
    );
    assert!(err.is_empty(), "no warnings: {err}");
}

#[test]
fn handlers_and_checks_that_cannot_run_are_refused_each_by_name() {
    let mut f = fleet();
    let missing = f.dir.path().join("scripts/missing");
    let plain = f.script("not-executable", "exit 0");
    chmod(&plain, 0o644);
    let dir = f.dir.path().join("scripts");
    f.capability("p", "web", json!({"handler": missing, "mode": "async"}));
    f.need(
        "c",
        "web/site",
        "p",
        json!({"handler": plain, "check": dir}),
    );
    f.write_files();

    let (ok, _, err) = agent(&f, "p", &["check"]);
    assert!(!ok);
    let caps = f.host_dir("p").join("capabilities.json");
    assert!(
        err.contains(&format!(
            "{}: capability \"web\": handler {} does not exist",
            caps.display(),
            missing.display()
        )),
        "{err}"
    );

    let (ok, _, err) = agent(&f, "c", &["check"]);
    assert!(!ok);
    let needs = f.host_dir("c").join("needs.json");
    assert!(
        err.contains(&format!(
            "{}: need \"web/site\": handler {} is not executable (mode 0644)",
            needs.display(),
            plain.display()
        )),
        "{err}"
    );
    assert!(
        err.contains(&format!(
            "{}: need \"web/site\": check {} is a directory",
            needs.display(),
            dir.display()
        )),
        "both problems at once: {err}"
    );

    // Checked elsewhere than where they run (a build machine): handlers left out.
    let (ok, _, err) = agent(&f, "c", &["check", "--skip-handlers"]);
    assert!(ok, "{err}");
}

#[test]
fn a_needs_file_that_does_not_exist_is_refused_and_no_needs_is_said_explicitly() {
    let f = fleet();
    f.write_files();
    let needs = f.host_dir("c").join("needs.json");
    std::fs::remove_file(&needs).unwrap();
    let (ok, _, err) = agent(&f, "c", &["check"]);
    assert!(!ok);
    assert!(
        err.contains(&format!(
            "needs = {:?}: no such file. A host with no needs leaves `needs` out of agent.toml, or names a file holding {{}}.",
            needs.display().to_string()
        )),
        "{err}"
    );
    let caps = f.host_dir("p").join("capabilities.json");
    std::fs::remove_file(&caps).unwrap();
    let (ok, _, err) = agent(&f, "p", &["check"]);
    assert!(!ok);
    assert!(err.contains("capabilities = "), "{err}");
    assert!(err.contains("no such file"), "{err}");

    // Both ways of saying "no needs" pass.
    std::fs::write(&needs, "{}").unwrap();
    let (ok, out, err) = agent(&f, "c", &["check"]);
    assert!(ok, "{err}");
    assert!(out.contains(", 0 needs,"), "{out}");
    std::fs::remove_file(&needs).unwrap();
    edit_toml(&f, "c", |t| {
        t.lines()
            .filter(|l| !l.starts_with("needs ="))
            .map(|l| format!("{l}\n"))
            .collect()
    });
    let (ok, out, err) = agent(&f, "c", &["check"]);
    assert!(ok, "{err}");
    assert!(out.contains(", 0 needs,"), "{out}");
}

#[test]
fn plaintext_passes_with_a_warning() {
    let mut f = fleet();
    f.plaintext = true;
    f.write_files();
    let (ok, out, err) = agent(&f, "p", &["check"]);
    assert!(ok, "{err}");
    assert!(out.contains(": ok: "), "{out}");
    assert!(
        err.contains("warning: plaintext = true: requests and replies travel unencrypted"),
        "{err}"
    );
}

#[test]
fn key_files_that_cannot_be_used_say_what_was_expected() {
    let f = fleet();
    f.write_files();
    let key = f.host_dir("p").join("key");
    let cases = [
        (
            "garbage\n".to_owned(),
            format!(
                "key {} is not an OpenSSH private key (expected a file starting with -----BEGIN OPENSSH PRIVATE KEY-----)\n",
                key.display()
            ),
        ),
        (
            f.hosts["p"].signer.public_openssh(),
            "this looks like a public key: give the file without .pub".to_owned(),
        ),
        (
            "-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VwBCIEIA==\n-----END PRIVATE KEY-----\n".to_owned(),
            "this is another PEM format".to_owned(),
        ),
    ];
    for (text, says) in &cases {
        std::fs::write(&key, text).unwrap();
        let (ok, _, err) = agent(&f, "p", &["check"]);
        assert!(!ok);
        assert!(err.contains(says.as_str()), "{text:?}: {err}");
        assert!(!err.contains("PEM preamble"), "{err}");
        let (ok, _, err) = agent(&f, "p", &["serve"]);
        assert!(!ok);
        assert!(err.contains(says.as_str()), "serve, {text:?}: {err}");
    }
    // A missing key: the OS error once, not once per layer.
    std::fs::remove_file(&key).unwrap();
    let (ok, _, err) = agent(&f, "p", &["check"]);
    assert!(!ok);
    assert!(
        err.contains(&format!("cannot read key {}", key.display())),
        "{err}"
    );
    assert_eq!(err.matches("No such file or directory").count(), 1, "{err}");

    // The operator CLI says the same.
    let garbage = f.dir.path().join("ops-key");
    std::fs::write(&garbage, "garbage\n").unwrap();
    let out = Command::new(fort_tests::bin("fort"))
        .args(["--origin", "ops", "--key"])
        .arg(&garbage)
        .arg("--hosts")
        .arg(f.host_dir("p").join("hosts.json"))
        .args(["status", "p"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("is not an OpenSSH private key"), "{err}");
    write_key(&key, &f.hosts["p"].signer);
}

#[test]
fn listen_addresses_must_be_ip_and_port_and_say_so() {
    let f = fleet();
    f.write_files();
    let original = std::fs::read_to_string(f.config_path("p")).unwrap();
    let listen = format!("listen = \"{}\"", f.hosts["p"].addr);
    for (bad, key) in [
        ("localhost:7770", "listen"),
        ("127.0.0.1", "listen"),
        ("localhost:9100", "metrics_listen"),
    ] {
        let toml = if key == "listen" {
            original.replace(&listen, &format!("listen = {bad:?}"))
        } else {
            format!("metrics_listen = {bad:?}\n{original}")
        };
        std::fs::write(f.config_path("p"), toml).unwrap();
        let (ok, _, err) = agent(&f, "p", &["check"]);
        assert!(!ok, "{bad}");
        assert!(
            err.contains(&format!(
                "{key} = {bad:?}: use an IP address and port such as 127.0.0.1:7770 or [::]:7770; host names are not resolved"
            )),
            "{bad}: {err}"
        );
    }
    // A config file that is not there: the OS error once.
    let out = Command::new(fort_tests::bin("fort-agent"))
        .args(["check", "--config", "/nonexistent/agent.toml"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("/nonexistent/agent.toml: cannot read: No such file or directory"),
        "{err}"
    );
    assert_eq!(err.matches("No such file").count(), 1, "{err}");
}

/// A request the provider would refuse at its door (past its `max_request_bytes`) fails
/// the fleet check, held to that provider's own agent.toml; the
/// same request passes once the provider takes it.
#[test]
fn the_fleet_check_holds_requests_to_the_providers_door_limits() {
    let mut f = Fleet::new();
    let h = f.script("provide", r#"jq -c 'with_entries(.value = "OK")'"#);
    f.capability("p", "blob", json!({"handler": h, "mode": "async"}));
    f.need(
        "c",
        "blob/big",
        "p",
        json!({"request": {"data": "x".repeat(75_000)}}),
    );
    let fleet_check = |f: &Fleet| {
        f.write_files();
        let out = Command::new(fort_tests::bin("fort-agent"))
            .args(["check", "--fleet"])
            .arg(f.dir.path())
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, err) = fleet_check(&f);
    assert!(!ok, "the fleet check passed");
    assert!(
        err.contains("blob/big") && err.contains("max_request_bytes"),
        "{err}"
    );
    // The provider that stores larger requests takes it.
    f.host("p").extra_toml = "max_request_bytes = 131072\n".into();
    let (_, err) = fleet_check(&f);
    assert!(!err.contains("blob/big"), "{err}");
}

/// Every command that prints ends quietly when its reader goes away, as `| head -1`
/// does: no panic, no error message, whether it printed one line or many.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn printing_commands_end_quietly_when_the_reader_goes_away() {
    use std::process::Stdio;
    let mut f = fleet();
    f.write_files();
    f.start_host("p");
    f.stop("p");
    let config = f.config_path("p");
    let config = config.to_str().unwrap();
    let commands: [(&str, Vec<&str>); 4] = [
        ("fort-agent", vec!["audit", "show", "--config", config]),
        ("fort-agent", vec!["audit", "verify", "--config", config]),
        (
            "fort-agent",
            vec!["check", "--skip-handlers", "--config", config],
        ),
        ("fort", vec!["--help"]),
    ];
    for (program, args) in commands {
        let mut child = Command::new(fort_tests::bin(program))
            .args(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // The reader goes away before anything is read.
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !stderr.contains("panicked") && !stderr.contains("Broken pipe"),
            "{program} {args:?}: {stderr}"
        );
        assert_ne!(out.status.code(), Some(101), "{program} {args:?}: {stderr}");
    }
}

/// A fleet directory may hold other things than hosts (a CA's files, the handlers'
/// scripts): `check --fleet` passes them over, saying so, instead of failing on each.
#[test]
fn the_fleet_check_passes_over_directories_that_are_not_hosts() {
    let mut f = Fleet::new();
    let h = f.script("provide", r#"jq -c 'with_entries(.value = "OK")'"#);
    f.capability("p", "blob", json!({"handler": h, "mode": "async"}));
    f.need("c", "blob/x", "p", json!({}));
    f.write_files();
    std::fs::create_dir_all(f.dir.path().join("pebble/certs")).unwrap();
    let out = Command::new(fort_tests::bin("fort-agent"))
        .args(["check", "--fleet"])
        .arg(f.dir.path())
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(stdout.contains("note: pebble/ passed over"), "{stdout}");
    assert!(stdout.contains("note: scripts/ passed over"), "{stdout}");
    assert!(stdout.contains("ok: 2 hosts"), "{stdout}");
}
