//! The NixOS module, evaluated with the real nixpkgs `lib` (set `NIXPKGS_LIB`): its
//! generated files match the expected JSON and pass `fort-agent check`; agents loading
//! them report the manifest hashes the module computed; the units and files the systemd
//! lane installs are what it renders; docs/options.md matches the option declarations;
//! and every `.nix` file in the repo parses. Skips (through
//! `fort_tests::skip`) when nixpkgs lib or Nix is absent.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use fort_tests::{eventually, free_addr, Agent};
use serde_json::Value;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("repo root")
        .to_path_buf()
}

/// Runs one of `nixos-module/tests/*.sh` (or `../*.sh`) under bash: `None` when it skipped
/// (exit 77, recorded as a skip of `test`), else whether it passed and what it printed.
fn run_script(
    test: &str,
    script: &str,
    command: impl FnOnce(&mut Command),
) -> Option<(bool, String)> {
    let mut cmd = Command::new("bash");
    cmd.arg(repo().join("nixos-module/tests").join(script));
    cmd.env("FORT_AGENT", fort_tests::bin("fort-agent"))
        .env("FORT_HANDLER", fort_tests::bin("fort-handler"));
    command(&mut cmd);
    let out = cmd.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.code() == Some(77) {
        let why = text.trim().lines().last().unwrap_or("skipped");
        fort_tests::skip(
            &format!("{test} (nixos-module/tests/{script})"),
            why.strip_prefix("SKIP: ").unwrap_or(why),
        );
        return None;
    }
    Some((out.status.success(), text))
}

/// nixos-module/check-fleet.sh, as the README gives it: a fleet checked with only the
/// nixpkgs lib, every assertion fort makes at evaluation and `fort-agent check --fleet`
/// with the requests held against the providers' allow lists; a fleet asking outside
/// them fails, naming the need, the value and what is allowed.
#[test]
fn a_fleet_is_checked_with_only_the_nixpkgs_lib() {
    const TEST: &str = "a_fleet_is_checked_with_only_the_nixpkgs_lib";
    let fleet = repo().join("nixos-module/tests/check-fleet/fleet.nix");
    let Some((passed, text)) = run_script(TEST, "../check-fleet.sh", |cmd| {
        cmd.arg(&fleet);
    }) else {
        return;
    };
    assert!(passed, "{text}");
    for line in [
        "app → edge: ok: 3 requests fit edge's request schemas",
        "edge's proxy (1 request): ok: every request within its allowances",
        "edge's dns-record (1 request): ok: every request within its allowances",
    ] {
        assert!(text.contains(line), "{line:?} in:\n{text}");
    }
    let dir = tempfile::tempdir().unwrap();
    let wrong = dir.path().join("fleet.nix");
    std::fs::write(
        &wrong,
        format!(
            "{{ fort }}: import {} {{ inherit fort; wrong = true; }}\n",
            fleet.display()
        ),
    )
    .unwrap();
    let (passed, text) = run_script(TEST, "../check-fleet.sh", |cmd| {
        cmd.arg(&wrong);
    })
    .expect("ran above");
    assert!(!passed, "{text}");
    let refusal = "host app: fort.host.needs.proxy.wiki.request.server_names: wiki.edge.example.org is not one capability proxy of edge allows app (allowed: *.app.example.org).";
    assert!(text.contains(refusal), "{text}");
    // Each problem once, and each named after its host once.
    assert_eq!(text.matches(refusal).count(), 1, "{text}");
    assert!(!text.contains("host app: host app:"), "{text}");

    // The files each host would install, for hosts without NixOS, from the fleet checked.
    let out = dir.path().join("rendered");
    let (passed, text) = run_script(TEST, "../check-fleet.sh", |cmd| {
        cmd.arg(&fleet)
            .arg("--out")
            .arg(&out)
            .args(["--handler", "/opt/fort/bin/fort-handler"]);
    })
    .expect("ran above");
    assert!(passed, "{text}");
    for host in ["app", "edge"] {
        let etc = out.join(host).join("etc/fort");
        for file in [
            "hosts.json",
            "needs.json",
            "capabilities.json",
            "agent.toml",
        ] {
            assert!(etc.join(file).is_file(), "{host}: {file}:\n{text}");
        }
        let toml = std::fs::read_to_string(etc.join("agent.toml")).unwrap();
        assert!(toml.contains("hosts = \"/etc/fort/hosts.json\""), "{toml}");
        assert!(toml.contains(&format!("host = \"{host}\"")), "{toml}");
    }
    let caps: serde_json::Value = serde_json::from_slice(
        &std::fs::read(out.join("edge/etc/fort/capabilities.json")).unwrap(),
    )
    .unwrap();
    let handled = caps
        .as_object()
        .unwrap()
        .values()
        .filter(|c| c["handler"] == "/opt/fort/bin/fort-handler");
    let mut configs = 0;
    for c in handled {
        let config = c["args"][2].as_str().unwrap();
        assert!(config.starts_with("/etc/fort/handlers/"), "{c}");
        let rendered = out.join("edge").join(config.trim_start_matches('/'));
        assert!(rendered.is_file(), "{}", rendered.display());
        configs += 1;
    }
    assert!(configs >= 2, "{caps:#}");
}

#[test]
fn every_nix_file_parses() {
    if let Some((passed, text)) = run_script("every_nix_file_parses", "parse-all.sh", |_| {}) {
        assert!(passed, "{text}");
    }
}

#[test]
fn options_reference_is_current() {
    if let Some((passed, text)) =
        run_script("options_reference_is_current", "options-doc.sh", |cmd| {
            cmd.arg("--check");
        })
    {
        assert!(passed, "{text}");
    }
}

#[test]
fn lane_units_are_what_the_module_renders() {
    // The systemd lane (tests/systemd) installs the committed trees, so it runs where
    // there is no nixpkgs lib; here they are rendered again and compared.
    if let Some((passed, text)) = run_script(
        "lane_units_are_what_the_module_renders",
        "lane/render.sh",
        |_| {},
    ) {
        assert!(passed, "{text}");
    }
}

#[test]
fn module_generates_the_expected_files_and_they_pass_check() {
    let out_dir = tempfile::tempdir().unwrap();
    // The demo fleet as NixOS configuration (examples/demo-fleet).
    let example_dir = tempfile::tempdir().unwrap();
    let Some((passed, text)) = run_script(
        "module_generates_the_expected_files_and_they_pass_check",
        "run.sh",
        |cmd| {
            cmd.env("OUT_DIR", out_dir.path());
            cmd.env("EXAMPLE_OUT_DIR", example_dir.path());
        },
    ) else {
        return;
    };
    assert!(passed, "module evaluation failed:\n{text}");
    let example = example_dir.path();
    let mut checked = 0;
    for host in std::fs::read_dir(out_dir.path()).unwrap() {
        let host = host.unwrap().path();
        if !host.is_dir() {
            continue;
        }
        let config = host.join("agent.toml");
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
    // The whole fleet at once, as lib.fleetCheck runs it: each host, one registry, and
    // every consumer against its providers' schemas and callers.
    let fleet_check = |dir: &Path| {
        let out = Command::new(fort_tests::bin("fort-agent"))
            .args(["check", "--skip-handlers", "--fleet"])
            .arg(dir)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, out, err) = fleet_check(out_dir.path());
    assert!(ok, "{err}");
    for pair in [
        "app → forge: ok",
        "app → beacon: ok",
        "beacon → forge: ok",
        "forge → forge: ok",
        // forge's host certificate with beacon's SSH CA as the standby.
        "forge → beacon: ok",
    ] {
        assert!(out.contains(pair), "{out}");
    }
    assert!(
        out.ends_with("ok: 3 hosts, 5 consumer → provider pairs checked\n"),
        "{out}"
    );
    // The demo fleet as NixOS configuration passes the same.
    let (ok, out, err) = fleet_check(example);
    assert!(ok, "examples/demo-fleet: {err}");
    assert!(
        out.contains("app → forge: ok: 4 requests fit forge's request schemas"),
        "{out}"
    );
    assert!(out.contains("app → beacon: ok: 1 request fit"), "{out}");
    // What the cross-host check catches that no single host's check can: a provider
    // whose callers lack a consumer's need, and a request its schema refuses.
    let forge_caps = example.join("forge/capabilities.json");
    let caps = std::fs::read_to_string(&forge_caps).unwrap();
    let mut v: Value = serde_json::from_str(&caps).unwrap();
    v["oidc"]["callers"] = serde_json::json!({});
    std::fs::write(&forge_caps, serde_json::to_vec(&v).unwrap()).unwrap();
    let app_needs = example.join("app/needs.json");
    let needs = std::fs::read_to_string(&app_needs).unwrap();
    std::fs::write(
        &app_needs,
        needs.replacen("\"lifetime_seconds\":15", "\"lifetime_seconds\":5", 1),
    )
    .unwrap();
    let (ok, _, err) = fleet_check(example);
    assert!(!ok);
    assert!(
        err.contains("oidc/wiki: app is not among the callers of oidc for id wiki"),
        "{err}"
    );
    assert!(
        err.contains("ssl-cert/short: request at /lifetime_seconds"),
        "{err}"
    );
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

/// The agent.toml run.sh wrote for `dir`, listening on `listen` instead, without a
/// metrics listener (tests run side by side).
fn local_config(dir: &Path, listen: std::net::SocketAddr) {
    let path = dir.join("agent.toml");
    let toml: String = std::fs::read_to_string(&path)
        .unwrap()
        .lines()
        .filter(|l| !l.starts_with("metrics_listen ="))
        .map(|l| {
            if l.starts_with("listen =") {
                format!("listen = \"{listen}\"\n")
            } else {
                format!("{l}\n")
            }
        })
        .collect();
    std::fs::write(&path, toml).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_running_the_generated_files_report_the_fleet_manifest_hashes() {
    let test = "agents_running_the_generated_files_report_the_fleet_manifest_hashes";
    let out_dir = tempfile::tempdir().unwrap();
    let Some((passed, text)) = run_script(test, "run.sh", |cmd| {
        cmd.env("OUT_DIR", out_dir.path());
    }) else {
        return;
    };
    assert!(passed, "module evaluation failed:\n{text}");
    let manifest: Value =
        serde_json::from_slice(&std::fs::read(out_dir.path().join("manifest.json")).unwrap())
            .unwrap();
    // The hosts whose private keys the test keys include.
    let keys = repo().join("nixos-module/tests/keys");
    let mut checked = 0;
    for host in ["forge", "app"] {
        let dir = out_dir.path().join(host);
        std::fs::copy(keys.join(host), dir.join("host_key")).unwrap();
        std::fs::set_permissions(
            dir.join("host_key"),
            std::os::unix::fs::PermissionsExt::from_mode(0o600),
        )
        .unwrap();
        let listen = free_addr("127.0.0.1");
        local_config(&dir, listen);
        let _agent = Agent::try_spawn(host, listen, &dir)
            .unwrap_or_else(|log| panic!("{host} does not start on the generated files: {log}"));
        let status = || {
            let out = Command::new(fort_tests::bin("fort-agent"))
                .args(["status", "--json", "--config"])
                .arg(dir.join("agent.toml"))
                .output()
                .unwrap();
            serde_json::from_slice::<Value>(&out.stdout).unwrap_or(Value::Null)["status"].clone()
        };
        assert!(
            eventually(Duration::from_secs(10), || !status().is_null()).await,
            "{host} answers status"
        );
        let want = &manifest[host];
        assert!(want.is_string(), "lib.fleetManifest has {host}: {manifest}");
        assert_eq!(&status()["manifest_sha256"], want, "{host}");
        checked += 1;
    }
    assert_eq!(checked, 2);
}
