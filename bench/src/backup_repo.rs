//! `backup-repo` against what operators do by hand. fort: one `fort-handler backup-repo`
//! run (as the agent starts it: a process, entries on stdin) gives `--create` clients a
//! repository directory each and one `authorized_keys` line each, restricted to `borg
//! serve` on that directory (the client's first backup inits it, with a passphrase only
//! it holds). By hand, per client: `borg init` of its repository on the server and the
//! `authorized_keys` file edited to add its restricted line (read, append, write back).
//! Then runs over `--unchanged` unchanged entries: what the provider pays on every
//! request.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value};

use crate::util::{self, ms, Report, UnchangedRuns};

#[derive(clap::Args, Debug)]
pub struct BackupRepoArgs {
    /// Repositories created by the first run (and by hand).
    #[arg(long, default_value_t = 100)]
    create: usize,
    /// Entries of the unchanged runs.
    #[arg(long, default_value_t = 10_000)]
    unchanged: usize,
    /// Unchanged runs timed.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Skip the by-hand comparison (`borg init` per client).
    #[arg(long)]
    no_compare: bool,
    /// The fort-handler binary. Default: $FORT_BIN_FORT_HANDLER, else next to fort-bench.
    #[arg(long)]
    handler_bin: Option<PathBuf>,
}

/// Unchanged runs must take less than this (the design's goal for 10,000 entries).
const GOAL: Duration = Duration::from_millis(200);
/// Clients per origin: entries are spread over hosts as a fleet's are.
const PER_ORIGIN: usize = 10;

fn entry_key(i: usize) -> String {
    format!("h{:04}:backup-repo/r{:02}", i / PER_ORIGIN, i % PER_ORIGIN)
}

/// The agent's input for clients `0..n`, each asking with a key of its own.
fn input(keys: &[String], n: usize) -> Vec<u8> {
    let entries: Map<String, Value> = (0..n)
        .map(|i| {
            (
                entry_key(i),
                json!({"request": {"public_key": keys[i]}, "response": null}),
            )
        })
        .collect();
    serde_json::to_vec(&Value::Object(entries)).expect("json")
}

fn answered(output: &Value) -> usize {
    output.as_object().map_or(0, |m| {
        m.values().filter(|v| v.get("repo").is_some()).count()
    })
}

/// By hand, per client: `borg init` on the server, and its line added to the file.
fn by_hand(borg: &str, dir: &Path, keys: &[String]) -> Result<Duration> {
    let repos = dir.join("by-hand");
    let authorized = dir.join("by-hand-authorized_keys");
    std::fs::create_dir_all(&repos)?;
    std::fs::write(&authorized, "")?;
    let t = Instant::now();
    for (i, key) in keys.iter().enumerate() {
        let repo = repos.join(format!("c{i:05}"));
        let status = Command::new(borg)
            .args(["init", "--encryption=none"])
            .arg(&repo)
            .env("BORG_BASE_DIR", dir.join("borg-base"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .context("run borg init")?;
        if !status.success() {
            bail!("borg init {} failed", repo.display());
        }
        let mut content = std::fs::read_to_string(&authorized)?;
        let _ = writeln!(
            content,
            "command=\"borg serve --restrict-to-repository {} --append-only\",restrict {key}",
            repo.display()
        );
        std::fs::write(&authorized, content)?;
    }
    Ok(t.elapsed())
}

fn find_borg() -> Option<String> {
    let out = Command::new("sh")
        .args(["-c", "command -v borg"])
        .output()
        .ok()?;
    let path = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    (!path.is_empty()).then_some(path)
}

pub async fn run(args: BackupRepoArgs, json_out: bool) -> Result<()> {
    if args.create == 0 || args.unchanged < args.create {
        bail!("--create must be at least 1 and --unchanged at least --create");
    }
    let bin = util::handler_bin(args.handler_bin.clone())?;
    let borg = find_borg();
    if borg.is_none() && !args.no_compare {
        bail!("borg is not installed (apt-get install borgbackup), or pass --no-compare");
    }
    let dir = tempfile::tempdir()?;
    let root = dir.path();
    let host_key = fort_core::sign::Signer::generate().public_openssh();
    std::fs::write(root.join("host.pub"), format!("{host_key}\n"))?;
    std::fs::create_dir_all(root.join("repos"))?;
    let user = if fort_tests::is_root() {
        "root"
    } else {
        "nobody"
    };
    let config = json!({
        "state_file": root.join("state.json"),
        "repositories_dir": root.join("repos"),
        "authorized_keys_file": root.join("authorized_keys"),
        "user": user,
        "host": "backup.bench.test",
        "host_key_files": [root.join("host.pub")],
        "borg": borg.clone().unwrap_or_else(|| "borg".into()),
    });
    let config_path = root.join("backup-repo.json");
    std::fs::write(&config_path, config.to_string())?;
    let keys: Vec<String> = (0..args.unchanged)
        .map(|_| fort_core::sign::Signer::generate().public_openssh())
        .collect();

    let mut report = Report::new("backup-repo (borg)", json_out);
    if cfg!(debug_assertions) {
        report.note("debug build of fort-bench; build with --release for numbers to compare");
    }
    let lines = || {
        std::fs::read_to_string(root.join("authorized_keys"))
            .map(|s| s.lines().filter(|l| !l.starts_with('#')).count())
            .unwrap_or(0)
    };

    // 1. One run giving --create clients a repository and a key line each.
    let (wall, output, stderr) =
        util::run_capability(&bin, "backup-repo", &config_path, input(&keys, args.create))?;
    let created = answered(&output);
    report.line(
        "create_ms",
        ms(wall),
        format!(
            "{:.0} ms for {} repositories and their keys in one run ({:.0} repositories/s); {created} answered, {} authorized_keys lines",
            ms(wall),
            args.create,
            args.create as f64 / wall.as_secs_f64(),
            lines()
        ),
    );
    report.target(
        &format!("{} created in one run", args.create),
        created == args.create && lines() == args.create,
    );
    if created != args.create {
        bail!(
            "the creating run answered {created} of {}: {stderr}",
            args.create
        );
    }

    // 2. The same by hand: borg init and an authorized_keys edit per client.
    if let (Some(borg), false) = (&borg, args.no_compare) {
        let hand = by_hand(borg, root, &keys[..args.create])?;
        report.line(
            "by_hand_ms",
            ms(hand),
            format!(
                "{:.0} ms by hand for {} clients ({:.0} clients/s: borg init, then authorized_keys read, appended and written back, per client); {:.1}× fort's run, which leaves the init to each client's first backup (its passphrase never reaches the server's operator)",
                ms(hand),
                args.create,
                args.create as f64 / hand.as_secs_f64(),
                hand.as_secs_f64() / wall.as_secs_f64().max(1e-9)
            ),
        );
    }

    // 3. Filled to --unchanged, then runs over them unchanged: nothing is written.
    let unchanged = input(&keys, args.unchanged);
    let (fill, filled, stderr) =
        util::run_capability(&bin, "backup-repo", &config_path, unchanged.clone())?;
    if answered(&filled) != args.unchanged {
        bail!("filling to {} entries failed: {stderr}", args.unchanged);
    }
    report.line(
        "fill_ms",
        ms(fill),
        format!(
            "{:.0} ms for {} more repositories in one run",
            ms(fill),
            args.unchanged - args.create
        ),
    );
    let state_before = std::fs::metadata(root.join("state.json"))?.modified()?;
    let mut runs = UnchangedRuns::default();
    for _ in 0..args.runs.max(1) {
        let (wall, output, stderr) =
            util::run_capability(&bin, "backup-repo", &config_path, unchanged.clone())?;
        if output != filled {
            bail!("an unchanged run answered differently: {stderr}");
        }
        runs.add(wall, &stderr);
    }
    if std::fs::metadata(root.join("state.json"))?.modified()? != state_before {
        bail!("an unchanged run rewrote the state");
    }
    runs.report(
        &mut report,
        args.unchanged,
        unchanged.len(),
        "state and authorized_keys left as they were",
        GOAL,
        &root.join("state.json"),
    );
    report.finish();
    Ok(())
}
