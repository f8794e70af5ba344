//! `fort-bench unchanged`: every capability's handler over N unchanged entries, measured
//! the same way, in one report. A run over unchanged entries is what every provider pays
//! on every request (the handler runs over all its entries), so each capability must
//! answer 10,000 of them quickly and keep its state small per entry. Each capability's
//! own benchmark makes its entries against its real server (a few created there, the
//! rest recorded in its state as the handler records them), stops the server, and times
//! whole handler processes; this command runs them one after another and puts their
//! `unchanged_summary` side by side.

use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::{json, Value};

use crate::util::Report;

#[derive(clap::Args, Debug)]
pub struct UnchangedArgs {
    /// Unchanged entries in each capability's runs.
    #[arg(long, default_value_t = 10_000)]
    entries: usize,
    /// Runs over them (the median and the slowest are reported).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Only these capabilities (comma-separated); all by default.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// The target for the median run, per capability.
    #[arg(long, default_value = "200ms", value_parser = humantime::parse_duration)]
    goal: Duration,
}

/// Each capability's benchmark, with its arguments for a few created entries and the
/// unchanged ones.
fn commands(entries: usize, runs: usize) -> Vec<(&'static str, Vec<String>)> {
    let e = entries.to_string();
    let r = runs.to_string();
    let v = |args: &[&str]| args.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    vec![
        (
            "acme",
            v(&[
                "acme",
                "--count",
                "10",
                "--unchanged",
                &e,
                "--runs",
                &r,
                "--no-agents",
                "--no-lego",
            ]),
        ),
        (
            "dns-record",
            v(&[
                "dns-record",
                "--create",
                "10",
                "--unchanged",
                &e,
                "--runs",
                &r,
                "--server",
                "knot",
            ]),
        ),
        (
            "backup-repo",
            v(&[
                "backup-repo",
                "--create",
                "10",
                "--unchanged",
                &e,
                "--runs",
                &r,
                "--no-compare",
            ]),
        ),
        (
            "oidc",
            v(&["oidc", "--entries", "10", "--unchanged", &e, "--runs", &r]),
        ),
        (
            "postgres",
            v(&[
                "postgres",
                "--entries",
                "10",
                "--unchanged",
                &e,
                "--runs",
                &r,
                "--no-openbao",
            ]),
        ),
        (
            "proxy",
            v(&["proxy", "--create", "10", "--unchanged", &e, "--runs", &r]),
        ),
        (
            "scrape",
            v(&["scrape", "--create", "10", "--unchanged", &e, "--runs", &r]),
        ),
        (
            "ssh-ca",
            v(&["ssh-ca", "--certs", "10", "--unchanged", &e, "--no-compare"]),
        ),
    ]
}

pub async fn run(args: UnchangedArgs, json_out: bool) -> Result<()> {
    let me = std::env::current_exe().context("current exe")?;
    let agent = crate::util::agent_bin()?;
    let mut r = Report::new("unchanged", json_out);
    r.note(&format!(
        "each capability's own benchmark, {} unchanged entries, {} runs each, its server stopped during them",
        args.entries, args.runs
    ));
    let mut rows = serde_json::Map::new();
    for (name, cmd) in commands(args.entries, args.runs.max(1)) {
        if !args.only.is_empty() && !args.only.iter().any(|o| o == name) {
            continue;
        }
        let out = Command::new(&me)
            .arg("--agent-bin")
            .arg(&agent)
            .arg("--json")
            .args(&cmd)
            .output()
            .with_context(|| format!("run fort-bench {name}"))?;
        let summary = String::from_utf8_lossy(&out.stdout)
            .lines()
            .last()
            .and_then(|l| serde_json::from_str::<Value>(l).ok())
            .map(|v| v["unchanged_summary"].clone())
            .filter(|s| s.is_object());
        let Some(s) = summary else {
            let why = String::from_utf8_lossy(&out.stderr);
            let why = why.lines().last().unwrap_or("no figures").trim();
            r.line(
                &format!("{name}_skipped"),
                json!(why),
                format!("{name}: not measured: {why}"),
            );
            continue;
        };
        let median = s["median_ms"].as_f64().unwrap_or(f64::MAX);
        r.line(
            name,
            s.clone(),
            format!(
                "median {median:.1} ms, max {:.1} ms; state {} bytes per entry",
                s["max_ms"].as_f64().unwrap_or(0.0),
                s["state_bytes_per_entry"]
            ),
        );
        r.target(
            &format!("{name}: median < {} ms", args.goal.as_millis()),
            median < args.goal.as_secs_f64() * 1000.0,
        );
        rows.insert(name.to_owned(), s);
    }
    r.line(
        "capabilities_measured",
        rows.len(),
        format!("{} capabilities measured", rows.len()),
    );
    r.finish();
    Ok(())
}
