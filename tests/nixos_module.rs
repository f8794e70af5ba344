//! The NixOS module, evaluated with the real nixpkgs `lib` (set `NIXPKGS_LIB`): its
//! generated files match the expected JSON and pass `fort-agent check`; docs/options.md
//! matches the option declarations; and every `.nix` file in the repo parses. Skips
//! with a message when nixpkgs lib or Nix is absent.

use std::path::PathBuf;
use std::process::Command;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("repo root")
        .to_path_buf()
}

/// Runs one of `nixos-module/tests/*.sh` under bash: `None` when it skipped (exit 77,
/// its message printed), else whether it passed and what it printed.
fn run_script(script: &str, command: impl FnOnce(&mut Command)) -> Option<(bool, String)> {
    let mut cmd = Command::new("bash");
    cmd.arg(repo().join("nixos-module/tests").join(script));
    command(&mut cmd);
    let out = cmd.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.code() == Some(77) {
        let why = text.trim().lines().last().unwrap_or("skipped").to_owned();
        fort_tests::skip(&format!("nixos-module/tests/{script}"), &why);
        return None;
    }
    Some((out.status.success(), text))
}

#[test]
fn every_nix_file_parses() {
    if let Some((passed, text)) = run_script("parse-all.sh", |_| {}) {
        assert!(passed, "{text}");
    }
}

#[test]
fn options_reference_is_current() {
    if let Some((passed, text)) = run_script("options-doc.sh", |cmd| {
        cmd.arg("--check");
    }) {
        assert!(passed, "{text}");
    }
}

#[test]
fn module_generates_the_expected_files_and_they_pass_check() {
    let out_dir = tempfile::tempdir().unwrap();
    let Some((passed, text)) = run_script("run.sh", |cmd| {
        cmd.env("OUT_DIR", out_dir.path());
    }) else {
        return;
    };
    assert!(passed, "module evaluation failed:\n{text}");
    let mut checked = 0;
    for host in std::fs::read_dir(out_dir.path()).unwrap() {
        let config = host.unwrap().path().join("agent.toml");
        let check = Command::new(fort_tests::bin("fort-agent"))
            .args(["check", "--skip-key", "--skip-handlers", "--config"])
            .arg(&config)
            .output()
            .unwrap();
        assert!(
            check.status.success(),
            "{}: {}",
            config.display(),
            String::from_utf8_lossy(&check.stderr)
        );
        checked += 1;
    }
    assert_eq!(checked, 3, "three hosts generated");
    // And check refuses a typo in a generated file.
    let forge = out_dir.path().join("forge");
    let caps = std::fs::read_to_string(forge.join("capabilities.json")).unwrap();
    std::fs::write(
        forge.join("capabilities.json"),
        caps.replacen("\"mode\"", "\"mdoe\"", 1),
    )
    .unwrap();
    let check = Command::new(fort_tests::bin("fort-agent"))
        .args(["check", "--skip-key", "--skip-handlers", "--config"])
        .arg(forge.join("agent.toml"))
        .output()
        .unwrap();
    assert!(!check.status.success());
    assert!(String::from_utf8_lossy(&check.stderr).contains("mdoe"));
}
