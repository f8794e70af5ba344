//! fort-bench's command line: every benchmark is listed. (Being an integration test of
//! this package, it also makes `cargo test --workspace` build the `fort-bench` binary,
//! whose help texts tests/help.rs reads.)

use std::process::Command;

#[test]
fn help_lists_every_benchmark() {
    let out = Command::new(env!("CARGO_BIN_EXE_fort-bench"))
        .arg("--help")
        .output()
        .expect("run fort-bench");
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for command in [
        "status",
        "burst",
        "failover",
        "fulfill-cycle",
        "deliver",
        "gc",
        "converge",
        "schema",
        "plan",
        "dns-record",
        "postgres",
        "ssh-ca",
        "acme",
        "chaos",
    ] {
        assert!(
            text.lines()
                .any(|l| l.trim_start().starts_with(&format!("{command} "))),
            "{command} missing from:\n{text}"
        );
    }
}

/// `fort-bench acme` at a small size, end to end: 5 certificates from pebble through the
/// handler, through agents and through `lego run`, and 100 unchanged entries answered
/// with pebble stopped. Speed targets are not asserted (the machine may be busy); that
/// every client got every certificate is.
#[test]
fn acme_small() {
    const T: &str = "acme_small";
    for program in ["pebble", "curl", "lego"] {
        if fort_tests::dns::find_program(program).is_none() {
            return fort_tests::skip(T, &format!("{program} is not installed"));
        }
    }
    let out = Command::new(env!("CARGO_BIN_EXE_fort-bench"))
        .arg("--agent-bin")
        .arg(fort_tests::bin("fort-agent"))
        .args(["--json", "acme", "--count", "5", "--unchanged", "100"])
        .args(["--runs", "2", "--consumers", "2", "--timeout", "120s"])
        .arg("--handler-bin")
        .arg(fort_tests::bin("fort-handler"))
        .output()
        .expect("run fort-bench");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "fort-bench acme failed: {stderr}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    for field in [
        "handler_wall_s",
        "handler_cpu_ms_per_cert",
        "agents_wall_s",
        "lego_wall_s",
        "lego_over_handler",
        "unchanged_run_ms_median_max",
    ] {
        assert!(
            report[field].is_number() || report[field].is_array(),
            "{field} missing: {report}"
        );
    }
    assert_eq!(report["unchanged_entries"], 100, "{report}");
    for target in [
        "handler issued every certificate",
        "agents got every certificate",
        "lego issued every certificate",
        "answered without the CA, state untouched",
    ] {
        assert_eq!(report["targets"][target], true, "{target}: {report}");
    }
}
