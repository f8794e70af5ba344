//! One consumer agent with N needs that deliver files, all answered in one burst by one
//! provider agent, then all rotated at once.
//!
//! Every need writes one file (a JSON pointer into its payload, mode 0400) and names one
//! of U units to restart. The consumer's `systemctl` is a recorder script appending its
//! arguments to a log, so restarts are counted as issued, not guessed.
//!
//! (1) first delivery: the consumer starts with an empty needs.json; its N needs are
//!     written and it gets SIGHUP (t0). The end is the first poll at which every need is
//!     satisfied and every file holds its payload.
//! (2) rotation: the provider's handler starts answering new values and is triggered
//!     (t0). The end is the first poll at which every file holds its new value.
//!
//! Goal: each phase restarts each unit once (restarts = U), whatever N is.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use serde_json::json;

use crate::util::{self, ms, AgentProc, Report};

#[derive(clap::Args, Debug)]
pub struct DeliverArgs {
    /// Needs of the consumer, each delivering one file.
    #[arg(long, default_value_t = 500)]
    needs: usize,
    /// Distinct units the needs name in `restart_units` (need n restarts unit n mod U).
    #[arg(long, default_value_t = 5)]
    units: usize,
    /// Give up on a phase after this long.
    #[arg(long, default_value = "120s", value_parser = humantime::parse_duration)]
    timeout: Duration,
    /// How often completion is polled.
    #[arg(long, default_value = "20ms", value_parser = humantime::parse_duration)]
    poll: Duration,
}

const CAP: &str = "secret";
const ME: &str = "app";

/// The user the files are given to: the one running the bench (the only one a non-root
/// agent may give files to).
fn current_user() -> Result<(String, String)> {
    let out = |args: &[&str]| -> Result<String> {
        let o = std::process::Command::new("id").args(args).output()?;
        if !o.status.success() {
            bail!("id {args:?} failed");
        }
        Ok(String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    Ok((out(&["-un"])?, out(&["-gn"])?))
}

struct Phase {
    wall: Duration,
    files_ok: usize,
    restarts: usize,
    distinct: usize,
    rounds: usize,
    consumer_cpu: Duration,
}

/// Restart calls recorded so far: one line per `systemctl` call.
fn recorded(log: &Path) -> Vec<String> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

fn files_holding(files: &[PathBuf], version: &str) -> usize {
    files
        .iter()
        .enumerate()
        .filter(|(n, p)| {
            std::fs::read_to_string(p).ok().as_deref() == Some(&format!("{version}-{n}"))
        })
        .count()
}

async fn wait_phase(
    consumer: &AgentProc,
    files: &[PathBuf],
    version: &str,
    log: &Path,
    args: &DeliverArgs,
    t0: Instant,
) -> Result<Phase> {
    let calls0 = recorded(log).len();
    let cpu0 = util::proc_cpu(consumer.pid()).unwrap_or_default();
    let n = files.len();
    let wall = loop {
        let sat = util::needs_satisfied(&consumer.socket()).map(|(_, s)| s);
        if sat == Some(n as u64) && files_holding(files, version) == n {
            break t0.elapsed();
        }
        if t0.elapsed() > args.timeout {
            bail!(
                "after {:?}: {} of {n} needs satisfied, {} files hold {version}",
                args.timeout,
                sat.unwrap_or(0),
                files_holding(files, version)
            );
        }
        tokio::time::sleep(args.poll).await;
    };
    // Restarts follow the last file by a round's settling time.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let calls: Vec<String> = recorded(log).into_iter().skip(calls0).collect();
    let units: Vec<&str> = calls
        .iter()
        .filter_map(|l| l.strip_prefix("restart -- "))
        .flat_map(str::split_whitespace)
        .collect();
    let distinct = units.iter().collect::<BTreeSet<_>>().len();
    Ok(Phase {
        wall,
        files_ok: files_holding(files, version),
        restarts: units.len(),
        distinct,
        rounds: calls.len(),
        consumer_cpu: util::proc_cpu(consumer.pid()).unwrap_or_default() - cpu0,
    })
}

fn report_phase(r: &mut Report, tag: &str, what: &str, p: &Phase, n: usize) {
    r.line(
        &format!("{tag}_ms"),
        ms(p.wall),
        format!("{:.1} ms ({what})", ms(p.wall)),
    );
    r.line(
        &format!("{tag}_files_written"),
        p.files_ok,
        format!("{}/{n} files hold their payload", p.files_ok),
    );
    r.line(
        &format!("{tag}_restarts"),
        p.restarts,
        format!(
            "{} unit restarts issued ({} distinct units, {} systemctl calls)",
            p.restarts, p.distinct, p.rounds
        ),
    );
    r.line(
        &format!("{tag}_consumer_cpu_ms"),
        ms(p.consumer_cpu),
        format!("{:.0} ms (consumer agent, 10 ms ticks)", ms(p.consumer_cpu)),
    );
}

pub async fn run(args: DeliverArgs, json_out: bool) -> Result<()> {
    util::require_jq()?;
    if args.units == 0 || args.needs == 0 {
        bail!("--needs and --units must be at least 1");
    }
    let mut fleet = util::new_fleet();
    let root = fleet.dir.path().to_path_buf();
    let version = root.join("version");
    std::fs::write(&version, "v1")?;
    // Need n (key secret/sNNNN) gets {"token": "<version>-<n>"}.
    let handler = fleet.script(
        "secrets",
        &format!(
            r#"v=$(cat {})
exec jq -c --arg v "$v" 'with_entries(.value = {{"token": "\($v)-\(.key | split("/s")[1] | tonumber)"}})'"#,
            version.display()
        ),
    );
    fleet.capability("vault", CAP, json!({"handler": handler, "mode": "async"}));
    let log = root.join("systemctl.log");
    let systemctl = fleet.script("systemctl", &format!(r#"echo "$*" >> {}"#, log.display()));
    let (user, group) = current_user()?;
    let files_dir = root.join("run");
    let mut files = Vec::new();
    for n in 0..args.needs {
        let path = files_dir.join(format!("s{n:05}")).join("token");
        fleet.need(
            ME,
            &format!("{CAP}/s{n:05}"),
            "vault",
            json!({
                "nag_seconds": 3600,
                "request": {"n": n},
                "files": [{"name": "token", "path": path, "pointer": "/token",
                           "owner": user, "group": group, "mode": "0400"}],
                "restart_units": [format!("svc{}.service", n % args.units)],
            }),
        );
        files.push(path);
    }
    fleet.host(ME).extra_toml = format!("systemctl = \"{}\"\n", systemctl.display());
    fleet.write_files();
    std::fs::write(fleet.host_dir(ME).join("needs.json"), "{}")?;

    let mut agents = vec![
        AgentProc::spawn(&fleet, "vault")?,
        AgentProc::spawn(&fleet, ME)?,
    ];
    util::wait_listening(&mut agents, Duration::from_secs(30))?;
    // The SIGHUP handler is installed just after the admin socket starts answering.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let consumer = &agents[1];
    let needs = serde_json::to_vec_pretty(&fleet.hosts[ME].needs)?;
    std::fs::write(fleet.host_dir(ME).join("needs.json"), needs)?;
    let t0 = Instant::now();
    consumer.hup();
    let first = wait_phase(consumer, &files, "v1", &log, &args, t0).await?;

    std::fs::write(&version, "v2")?;
    let t0 = Instant::now();
    util::admin(
        &agents[0].socket(),
        &json!({"cmd": "trigger", "capability": CAP, "force": true}),
        Duration::from_secs(30),
    )?;
    let rotated = wait_phase(consumer, &files, "v2", &log, &args, t0).await?;

    let mut r = Report::new("deliver", json_out);
    let n = args.needs;
    r.line("needs", n, n);
    r.line("units", args.units, args.units);
    report_phase(
        &mut r,
        "first",
        "SIGHUP → every need satisfied and every file written",
        &first,
        n,
    );
    report_phase(
        &mut r,
        "rotated",
        "provider triggered → every file holds the new value",
        &rotated,
        n,
    );
    r.target(
        "every file written",
        first.files_ok == n && rotated.files_ok == n,
    );
    r.target(
        "restarts = distinct units, in each phase",
        first.restarts == args.units && rotated.restarts == args.units,
    );
    r.finish();
    drop(agents);
    Ok(())
}
