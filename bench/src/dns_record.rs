//! `dns-record` against real primaries (knotd, named): one handler run creating `--create`
//! records, then the zone filled to `--unchanged` records, then handler runs over that
//! many unchanged entries with the primary stopped, which proves they send nothing: a
//! run that needed the primary would fail. Each run is `fort-handler dns-record` as the
//! agent starts it (a process, entries on stdin), with the cached responses fed back.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use fort_tests::dns::{DnsServer, Flavor};
use serde_json::{json, Map, Value};

use crate::util::{self, ms, Report, UnchangedRuns};

#[derive(clap::Args, Debug)]
pub struct DnsRecordArgs {
    /// Records created by the first handler run.
    #[arg(long, default_value_t = 500)]
    create: usize,
    /// Entries of the unchanged runs (the zone is filled to this many records first).
    #[arg(long, default_value_t = 10_000)]
    unchanged: usize,
    /// Unchanged runs timed.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Which primaries: knot, bind or both.
    #[arg(long, default_value = "both", value_parser = ["knot", "bind", "both"])]
    server: String,
    /// The fort-handler binary. Default: $FORT_BIN_FORT_HANDLER, else next to fort-bench.
    #[arg(long)]
    handler_bin: Option<PathBuf>,
}

const ZONE: &str = "bench.test";
/// Unchanged runs must take less than this (the design's goal for 10,000 entries).
const GOAL: Duration = Duration::from_millis(200);

struct Run {
    ok: bool,
    output: Value,
    stderr: String,
    wall: Duration,
}

fn run_handler(bin: &Path, config: &Path, trigger: &str, input: &[u8]) -> Result<Run> {
    let t = Instant::now();
    let mut child = Command::new(bin)
        .args(["dns-record", "--config"])
        .arg(config)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("FORT_TRIGGER", trigger)
        .env("FORT_CAPABILITY", "dns-record")
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

fn key_of(i: usize) -> String {
    format!("app:dns-record/n{i:05}")
}

/// The agent's input for entries `0..n`, each with its cached response (if any).
fn input(n: usize, responses: &Map<String, Value>) -> Vec<u8> {
    let entries: Map<String, Value> = (0..n)
        .map(|i| {
            let key = key_of(i);
            let response = responses.get(&key).cloned().unwrap_or(Value::Null);
            let request = json!({"name": format!("n{i:05}.{ZONE}")});
            (key, json!({"request": request, "response": response}))
        })
        .collect();
    serde_json::to_vec(&Value::Object(entries)).expect("json")
}

/// Responses (not markers) of a run's output.
fn responses(output: &Value) -> Map<String, Value> {
    output
        .as_object()
        .map(|m| {
            m.iter()
                .filter(|(k, v)| !k.starts_with('$') && v.get("values").is_some())
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        })
        .unwrap_or_default()
}

pub async fn run(args: DnsRecordArgs, json_out: bool) -> Result<()> {
    if args.create == 0 || args.unchanged < args.create {
        bail!("--create must be at least 1 and --unchanged at least --create");
    }
    let bin = util::handler_bin(args.handler_bin.clone())?;
    let flavors: Vec<Flavor> = match args.server.as_str() {
        "knot" => vec![Flavor::Knot],
        "bind" => vec![Flavor::Bind],
        _ => vec![Flavor::Knot, Flavor::Bind],
    };
    for flavor in flavors {
        one_server(&args, &bin, flavor, json_out)?;
    }
    Ok(())
}

fn one_server(args: &DnsRecordArgs, bin: &Path, flavor: Flavor, json_out: bool) -> Result<()> {
    let mut server = DnsServer::start(flavor, ZONE, "").map_err(|why| anyhow!("{why}"))?;
    let dir = tempfile::tempdir()?;
    let key = fort_core::sign::Signer::generate().public_openssh();
    let hosts = dir.path().join("hosts.json");
    std::fs::write(
        &hosts,
        json!({"hosts": {"app": {"address": "https://10.1.0.1:7770", "keys": [key]}}}).to_string(),
    )?;
    let tsig = dir.path().join("tsig.key");
    server.write_key(&tsig);
    let config = dir.path().join("dns-record.json");
    std::fs::write(
        &config,
        json!({
            "zone": ZONE,
            "primary": server.addr.to_string(),
            "key": {"name": server.key_name, "file": tsig},
            "allow": {"app": [format!("*.{ZONE}")]},
            "hosts": hosts,
            "state": dir.path().join("state.json"),
        })
        .to_string(),
    )?;
    let mut report = Report::new(&format!("dns-record ({})", flavor.name()), json_out);
    if cfg!(debug_assertions) {
        report.note("debug build of fort-bench; build with --release for numbers to compare");
    }
    let count_records = |server: &DnsServer| {
        server
            .zone_records()
            .iter()
            // The benchmark's own names (n00042.…), not the zone's name server (ns.…).
            .filter(|l| {
                let label = l.split('.').next().unwrap_or("");
                l.split_whitespace().nth(3) == Some("A")
                    && label.len() > 1
                    && label.starts_with('n')
                    && label[1..].bytes().all(|c| c.is_ascii_digit())
            })
            .count()
    };

    // 1. One run creating --create records.
    let first = run_handler(bin, &config, "request", &input(args.create, &Map::new()))?;
    if !first.ok {
        bail!("the creating run failed: {}", first.stderr);
    }
    let mut cached = responses(&first.output);
    let on_server = count_records(&server);
    report.line(
        "create_ms",
        ms(first.wall),
        format!(
            "{:.0} ms for {} records in one run ({:.0} records/s); {} answered, {} A records at the primary",
            ms(first.wall),
            args.create,
            args.create as f64 / first.wall.as_secs_f64(),
            cached.len(),
            on_server
        ),
    );
    report.target(
        &format!("{} created in one run", args.create),
        cached.len() == args.create && on_server == args.create,
    );

    // 2. The zone filled to --unchanged records (runs end at the handler's time budget
    //    and ask to be run again, as the agent would).
    let t = Instant::now();
    let mut runs = 0;
    while cached.len() < args.unchanged {
        runs += 1;
        let r = run_handler(bin, &config, "request", &input(args.unchanged, &cached))?;
        if !r.ok || runs > 50 {
            bail!("filling the zone: run {runs} failed: {}", r.stderr);
        }
        cached = responses(&r.output);
    }
    let on_server = count_records(&server);
    report.line(
        "fill_ms",
        ms(t.elapsed()),
        format!(
            "{:.0} ms for {} more records in {runs} runs; {on_server} A records at the primary",
            ms(t.elapsed()),
            args.unchanged - args.create
        ),
    );

    // 3. Unchanged runs with the primary stopped: no message can have been needed.
    server.stop();
    let unchanged = input(args.unchanged, &cached);
    let mut runs = UnchangedRuns::default();
    for _ in 0..args.runs.max(1) {
        let r = run_handler(bin, &config, "request", &unchanged)?;
        if !r.ok {
            bail!(
                "an unchanged run failed with the primary stopped: {}",
                r.stderr
            );
        }
        if responses(&r.output) != cached {
            bail!("an unchanged run answered differently");
        }
        runs.add(r.wall, &r.stderr);
    }
    runs.report(
        &mut report,
        args.unchanged,
        unchanged.len(),
        "primary stopped",
        GOAL,
        &dir.path().join("state.json"),
    );
    report.finish();
    Ok(())
}
