//! `proxy` against a real nginx: one handler run creating `--create` vhosts (written,
//! one `nginx -t`, one reload), the directory filled to `--unchanged` vhosts, then runs
//! over that many unchanged entries with the test and reload commands replaced by
//! `false`, which proves they call nginx for nothing: a run that needed either would
//! fail. Each run is `fort-handler proxy` as the agent starts it (a process, entries on
//! stdin).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use fort_tests::nginx::{Nginx, Upstream};
use serde_json::{json, Map, Value};

use crate::util::{self, ms, Report, UnchangedRuns};

#[derive(clap::Args, Debug)]
pub struct ProxyArgs {
    /// Vhosts created by the first handler run.
    #[arg(long, default_value_t = 500)]
    create: usize,
    /// Entries of the unchanged runs (the directory is filled to this many vhosts first).
    #[arg(long, default_value_t = 10_000)]
    unchanged: usize,
    /// Unchanged runs timed.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// The fort-handler binary. Default: $FORT_BIN_FORT_HANDLER, else next to fort-bench.
    #[arg(long)]
    handler_bin: Option<PathBuf>,
}

/// Unchanged runs must take less than this (the design's goal for 10,000 entries).
const GOAL: Duration = Duration::from_millis(200);

struct Run {
    ok: bool,
    output: Value,
    stderr: String,
    wall: Duration,
}

fn run_handler(bin: &Path, config: &Path, input: &[u8]) -> Result<Run> {
    let t = Instant::now();
    let mut child = Command::new(bin)
        .args(["proxy", "--config"])
        .arg(config)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("FORT_TRIGGER", "request")
        .env("FORT_CAPABILITY", "proxy")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("start fort-handler")?;
    let mut stdin = child.stdin.take().ok_or_else(|| anyhow!("no stdin"))?;
    let input = input.to_vec();
    // Written from another thread: 10,000 entries do not fit a pipe buffer.
    let writer = std::thread::spawn(move || {
        use std::io::Write;
        let _ = stdin.write_all(&input);
    });
    let out = child.wait_with_output()?;
    let wall = t.elapsed();
    let _ = writer.join();
    Ok(Run {
        ok: out.status.success(),
        output: serde_json::from_slice(&out.stdout).unwrap_or(Value::Null),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        wall,
    })
}

/// The agent's input for entries `0..n`: vhost `n<i>.app.bench.test` to app's port.
fn input(n: usize, port: u16) -> Vec<u8> {
    let entries: Map<String, Value> = (0..n)
        .map(|i| {
            let request =
                json!({"server_names": [format!("n{i:05}.app.bench.test")], "port": port});
            (
                format!("app:proxy/n{i:05}"),
                json!({"request": request, "response": null}),
            )
        })
        .collect();
    serde_json::to_vec(&Value::Object(entries)).expect("json")
}

/// How many entries a run answered with a vhost.
fn answered(output: &Value) -> usize {
    output.as_object().map_or(0, |m| {
        m.values().filter(|v| v.get("upstream").is_some()).count()
    })
}

fn write_config(path: &Path, config: &Value) -> Result<()> {
    std::fs::write(path, config.to_string()).with_context(|| format!("write {}", path.display()))
}

pub async fn run(args: ProxyArgs, json_out: bool) -> Result<()> {
    if args.create == 0 || args.unchanged < args.create {
        bail!("--create must be at least 1 and --unchanged at least --create");
    }
    let bin = util::handler_bin(args.handler_bin.clone())?;
    let nginx = Nginx::start().map_err(|why| anyhow!("{why}"))?;
    let upstream = Upstream::start("127.0.0.2", "app");
    let port = upstream.addr.port();
    let dir = tempfile::tempdir()?;
    let key = fort_core::sign::Signer::generate().public_openssh();
    let hosts = dir.path().join("hosts.json");
    std::fs::write(
        &hosts,
        json!({"hosts": {"app": {"address": "https://127.0.0.2:7770", "keys": [key]}}}).to_string(),
    )?;
    let mut config = json!({
        "include_dir": nginx.vhosts(),
        "state_file": dir.path().join("state.json"),
        "hosts": hosts,
        "test_command": nginx.test_command(),
        "reload_command": nginx.reload_command(),
        "listen": [nginx.addr.to_string()],
        "allow": {"app": ["*.app.bench.test"]},
    });
    let config_path = dir.path().join("proxy.json");
    write_config(&config_path, &config)?;
    let mut report = Report::new("proxy (nginx)", json_out);
    if cfg!(debug_assertions) {
        report.note("debug build of fort-bench; build with --release for numbers to compare");
    }
    let files = || {
        std::fs::read_dir(nginx.vhosts())
            .map(|d| d.count())
            .unwrap_or(0)
    };

    // 1. One run creating --create vhosts: written, tested once, reloaded once.
    let first = run_handler(&bin, &config_path, &input(args.create, port))?;
    if !first.ok {
        bail!("the creating run failed: {}", first.stderr);
    }
    let served = nginx.wait_for("n00000.app.bench.test", 200).0 == 200;
    report.line(
        "create_ms",
        ms(first.wall),
        format!(
            "{:.0} ms for {} vhosts in one run ({:.0} vhosts/s; nginx -t and reload included); {} answered, {} files, first one served: {served}",
            ms(first.wall),
            args.create,
            args.create as f64 / first.wall.as_secs_f64(),
            answered(&first.output),
            files()
        ),
    );
    report.line(
        "create_notes",
        first.stderr.lines().next().unwrap_or("").to_owned(),
        first.stderr.lines().next().unwrap_or(""),
    );
    report.target(
        &format!("{} created in one run", args.create),
        answered(&first.output) == args.create && files() == args.create && served,
    );

    // 2. The directory filled to --unchanged vhosts.
    let unchanged = input(args.unchanged, port);
    let fill = run_handler(&bin, &config_path, &unchanged)?;
    if !fill.ok || answered(&fill.output) != args.unchanged {
        bail!("filling the directory failed: {}", fill.stderr);
    }
    report.line(
        "fill_ms",
        ms(fill.wall),
        format!(
            "{:.0} ms for {} more vhosts in one run; {} files",
            ms(fill.wall),
            args.unchanged - args.create,
            files()
        ),
    );

    // 3. Unchanged runs with `false` as test and reload command: any call would fail.
    config["test_command"] = json!(["false"]);
    config["reload_command"] = json!(["false"]);
    write_config(&config_path, &config)?;
    let mut runs = UnchangedRuns::default();
    for _ in 0..args.runs.max(1) {
        let r = run_handler(&bin, &config_path, &unchanged)?;
        if !r.ok || !r.stderr.contains("0 tests, no reload") {
            bail!("an unchanged run called nginx or failed: {}", r.stderr);
        }
        if r.output != fill.output {
            bail!("an unchanged run answered differently");
        }
        runs.add(r.wall, &r.stderr);
    }
    runs.report(
        &mut report,
        args.unchanged,
        unchanged.len(),
        "no nginx call",
        GOAL,
        &dir.path().join("state.json"),
    );
    report.finish();
    Ok(())
}
