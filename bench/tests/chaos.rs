//! `fort-bench chaos` for five minutes on every change: 40 agents on loopback under
//! seeded random faults, every invariant checked throughout and at the end. It fails on
//! any violation and on any failed start; its figures (and each fault kind this machine
//! cannot inject, as a SKIP with the reason) go to the list `scripts/test.sh` prints.
//! `FORT_CHAOS_SEED` replays a seed (printed in the figures and in a failure), and
//! `FORT_CHAOS_DURATION` changes the length.

use std::process::Command;

use serde_json::Value;

const T: &str = "chaos::five_minutes_of_chaos";

#[test]
fn five_minutes_of_chaos() {
    let duration = std::env::var("FORT_CHAOS_DURATION").unwrap_or_else(|_| "5m".into());
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_fort-bench"));
    cmd.arg("--agent-bin")
        .arg(fort_tests::bin("fort-agent"))
        .args(["--json", "chaos", "--duration", &duration])
        .arg("--handler-bin")
        .arg(fort_tests::bin("fort-handler"));
    if let Ok(seed) = std::env::var("FORT_CHAOS_SEED") {
        cmd.args(["--seed", &seed]);
    }
    let out = cmd.output().expect("run fort-bench chaos");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let report: Value = match serde_json::from_slice(&out.stdout) {
        Ok(v) => v,
        Err(_) => panic!(
            "fort-bench chaos printed no figures ({}):\n{stderr}",
            out.status
        ),
    };
    let seed = &report["seed"];
    for (kind, v) in report["faults"].as_object().into_iter().flatten() {
        if let Some(why) = v["skip"].as_str() {
            fort_tests::skip(T, &format!("chaos fault {kind}: {why}"));
        }
    }
    if report["hosts"].as_u64().unwrap_or(0) > 0 && stderr.contains("SKIP the shared backend") {
        fort_tests::skip(
            T,
            "chaos: the postgres capability (PostgreSQL could not be started)",
        );
    }
    let injected: Vec<String> = report["faults"]
        .as_object()
        .into_iter()
        .flatten()
        .filter_map(|(k, v)| Some(format!("{k} {}", v["injected"].as_u64()?)))
        .collect();
    let l = &report["longest_unsatisfied"];
    let c = &report["credentials_applied"];
    fort_tests::figure(&format!(
        "chaos run ({duration}, seed {seed}, {} hosts): faults {}; {} certificates, {} tokens, {} passwords applied; longest unsatisfied {}s ({} {}: {}); {} moves; {} failed starts; {} violations; agents' CPU {}s, largest RSS {} kB",
        report["hosts"],
        injected.join(", "),
        c["certificates"],
        c["tokens"],
        c["passwords"],
        l["seconds"],
        l["consumer"].as_str().unwrap_or(""),
        l["need"].as_str().unwrap_or(""),
        l["cause"].as_str().unwrap_or(""),
        report["moves"],
        report["failed_starts"],
        report["violations"].as_array().map_or(0, Vec::len),
        report["agents_cpu_s"],
        report["agents_rss_kb"]["max"],
    ));
    let violations = report["violations"].as_array().cloned().unwrap_or_default();
    assert!(
        violations.is_empty(),
        "seed {seed}: {} violations (replay with FORT_CHAOS_SEED={seed}):\n{}\n\nfort-bench's log:\n{stderr}",
        violations.len(),
        violations
            .iter()
            .map(Value::to_string)
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert_eq!(report["failed_starts"], 0, "seed {seed}: {stderr}");
    assert!(out.status.success(), "seed {seed}: {stderr}");
    // Real faults were injected, and the fleet did real work under them.
    assert!(
        report["faults"]["kill"]["injected"].as_u64().unwrap_or(0) > 0,
        "{report}"
    );
    assert!(c["certificates"].as_u64().unwrap_or(0) > 0, "{report}");
    assert!(c["tokens"].as_u64().unwrap_or(0) > 0, "{report}");
}
