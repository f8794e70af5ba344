//! `scrape` as a monitor's provider pays for it: one `fort-handler scrape` run (as the
//! agent starts it) giving `--create` exporters their Prometheus target, spread over
//! hosts as a fleet's are (one `file_sd` file per host), then the fleet filled to
//! `--unchanged` exporters and runs over them unchanged, which must write no target
//! file (Prometheus re-reads a file that changes).

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Result};
use serde_json::{json, Map, Value};

use crate::util::{self, ms, Report, UnchangedRuns};

#[derive(clap::Args, Debug)]
pub struct ScrapeArgs {
    /// Exporters given a target by the first run.
    #[arg(long, default_value_t = 500)]
    create: usize,
    /// Exporters of the unchanged runs.
    #[arg(long, default_value_t = 10_000)]
    unchanged: usize,
    /// Unchanged runs timed.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// The fort-handler binary. Default: $FORT_BIN_FORT_HANDLER, else next to fort-bench.
    #[arg(long)]
    handler_bin: Option<std::path::PathBuf>,
}

const GOAL: Duration = Duration::from_millis(200);
/// Exporters per host (node, process, a database's, …).
const PER_HOST: usize = 5;

fn host(i: usize) -> String {
    format!("h{:04}", i / PER_HOST)
}

fn input(n: usize) -> Vec<u8> {
    let entries: Map<String, Value> = (0..n)
        .map(|i| {
            (
                format!("{}:scrape/e{}", host(i), i % PER_HOST),
                json!({"request": {"port": 9100 + (i % PER_HOST)}, "response": null}),
            )
        })
        .collect();
    serde_json::to_vec(&Value::Object(entries)).expect("json")
}

fn answered(output: &Value) -> usize {
    output.as_object().map_or(0, |m| {
        m.values().filter(|v| v.get("target").is_some()).count()
    })
}

fn newest_write(dir: &Path) -> Result<std::time::SystemTime> {
    let mut newest = std::time::UNIX_EPOCH;
    for e in std::fs::read_dir(dir)? {
        newest = newest.max(e?.metadata()?.modified()?);
    }
    Ok(newest)
}

pub async fn run(args: ScrapeArgs, json_out: bool) -> Result<()> {
    if args.create == 0 || args.unchanged < args.create {
        bail!("--create must be at least 1 and --unchanged at least --create");
    }
    let bin = util::handler_bin(args.handler_bin.clone())?;
    let dir = tempfile::tempdir()?;
    let root = dir.path();
    let key = fort_core::sign::Signer::generate().public_openssh();
    let hosts: Map<String, Value> = (0..args.unchanged.div_ceil(PER_HOST))
        .map(|h| {
            (
                format!("h{h:04}"),
                json!({"address": format!("https://10.{}.{}.{}:7770", h / 65536 % 256, h / 256 % 256, h % 256),
                       "keys": [key]}),
            )
        })
        .collect();
    std::fs::write(root.join("hosts.json"), json!({"hosts": hosts}).to_string())?;
    let targets = root.join("targets");
    std::fs::create_dir_all(&targets)?;
    let config = root.join("scrape.json");
    std::fs::write(
        &config,
        json!({"state_file": root.join("state.json"), "targets_dir": targets,
               "hosts_file": root.join("hosts.json"), "ports": {"*": ["9100-9199"]}})
        .to_string(),
    )?;
    let mut report = Report::new("scrape (Prometheus file_sd)", json_out);
    if cfg!(debug_assertions) {
        report.note("debug build of fort-bench; build with --release for numbers to compare");
    }
    let files = || std::fs::read_dir(&targets).map_or(0, |d| d.count());

    let (wall, output, stderr) = util::run_capability(&bin, "scrape", &config, input(args.create))?;
    let made = answered(&output);
    report.line(
        "create_ms",
        ms(wall),
        format!(
            "{:.0} ms for {} targets in one run ({:.0} targets/s); {made} answered, {} target files",
            ms(wall),
            args.create,
            args.create as f64 / wall.as_secs_f64(),
            files()
        ),
    );
    report.target(
        &format!("{} created in one run", args.create),
        made == args.create && files() == args.create.div_ceil(PER_HOST),
    );
    if made != args.create {
        bail!(
            "the creating run answered {made} of {}: {stderr}",
            args.create
        );
    }

    let unchanged = input(args.unchanged);
    let (fill, filled, stderr) = util::run_capability(&bin, "scrape", &config, unchanged.clone())?;
    if answered(&filled) != args.unchanged {
        bail!("filling to {} exporters failed: {stderr}", args.unchanged);
    }
    report.line(
        "fill_ms",
        ms(fill),
        format!(
            "{:.0} ms for {} more targets in one run; {} target files",
            ms(fill),
            args.unchanged - args.create,
            files()
        ),
    );
    let written = newest_write(&targets)?;
    let mut runs = UnchangedRuns::default();
    for _ in 0..args.runs.max(1) {
        let (wall, output, stderr) =
            util::run_capability(&bin, "scrape", &config, unchanged.clone())?;
        if output != filled {
            bail!("an unchanged run answered differently: {stderr}");
        }
        runs.add(wall, &stderr);
    }
    if newest_write(&targets)? != written {
        bail!("an unchanged run rewrote a target file");
    }
    runs.report(
        &mut report,
        args.unchanged,
        unchanged.len(),
        "no target file written",
        GOAL,
        &root.join("state.json"),
    );
    report.finish();
    Ok(())
}
