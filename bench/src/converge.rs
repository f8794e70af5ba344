//! One provider and K consumer agents with M needs each, started cold.
//!
//! The provider is started and serving first. The clock starts when the K consumer
//! processes are spawned (all at once) and stops at the first poll at which the
//! provider holds K×M entries with nothing undelivered and every consumer reports M of
//! M satisfied — so it includes the consumers' own start-up. After `--idle`, every
//! agent's resident memory (VmRSS) is read.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use serde_json::json;

use crate::util::{self, ms, AgentProc, Report};

#[derive(clap::Args, Debug)]
pub struct ConvergeArgs {
    /// Consumer agents.
    #[arg(long, default_value_t = 50)]
    consumers: usize,
    /// Needs per consumer.
    #[arg(long, default_value_t = 10)]
    needs: usize,
    /// Quiet time after convergence before memory is read.
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    idle: Duration,
    /// Give up after this long.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    timeout: Duration,
    /// Pause between the provider being up and the consumers' start (e.g. to attach a
    /// profiler to the provider; its pid is printed on stderr).
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
    settle: Duration,
    /// How often completion is polled.
    #[arg(long, default_value = "20ms", value_parser = humantime::parse_duration)]
    poll: Duration,
}

const CAP: &str = "conv";

pub async fn run(args: ConvergeArgs, json_out: bool) -> Result<()> {
    util::require_jq()?;
    let mut fleet = util::new_fleet();
    let handler = util::ok_handler(&fleet, None);
    fleet.capability("forge", CAP, json!({"handler": handler, "mode": "async"}));
    let consumers: Vec<String> = (0..args.consumers).map(|i| format!("k{i:03}")).collect();
    for c in &consumers {
        for n in 0..args.needs {
            fleet.need(
                c,
                &format!("{CAP}/n{n:03}"),
                "forge",
                json!({"nag_seconds": 600, "request": {"n": n}}),
            );
        }
    }
    fleet.write_files();
    let mut p = vec![AgentProc::spawn(&fleet, "forge")?];
    util::wait_listening(&mut p, Duration::from_secs(20))?;
    let provider = p.pop().expect("one");
    util::status(&provider.socket())?;
    if !args.settle.is_zero() {
        eprintln!(
            "fort-bench: provider pid {}; consumers start in {:?}",
            provider.pid(),
            args.settle
        );
        tokio::time::sleep(args.settle).await;
    }
    let provider_idle_rss = util::proc_kb(provider.pid(), "VmRSS").unwrap_or(0);

    let t0 = Instant::now();
    let mut agents = Vec::new();
    for c in &consumers {
        agents.push(AgentProc::spawn(&fleet, c)?);
    }
    let spawned = t0.elapsed();
    let total = (args.consumers * args.needs) as u64;
    let m = args.needs as u64;
    let deadline = t0 + args.timeout;
    let mut done = vec![false; agents.len()];
    let mut first_all_entries: Option<Duration> = None;
    let elapsed = loop {
        let s = util::status(&provider.socket())?;
        let (entries, undelivered, _, _) = util::provider_counts(&s, CAP);
        if entries == total && first_all_entries.is_none() {
            first_all_entries = Some(t0.elapsed());
        }
        if entries == total && undelivered == 0 {
            for (i, a) in agents.iter().enumerate() {
                if !done[i] {
                    done[i] = util::needs_satisfied(&a.socket()) == Some((m, m));
                }
            }
            if done.iter().all(|d| *d) {
                break t0.elapsed();
            }
        }
        if Instant::now() > deadline {
            bail!(
                "not converged after {:?}: provider entries {entries}/{total}, undelivered {undelivered}, consumers done {}/{}",
                args.timeout,
                done.iter().filter(|d| **d).count(),
                agents.len()
            );
        }
        tokio::time::sleep(args.poll).await;
    };
    let last = util::status(&provider.socket())?;
    let (_, _, runs, writes) = util::provider_counts(&last, CAP);

    tokio::time::sleep(args.idle).await;
    let mut rss: Vec<u64> = agents
        .iter()
        .filter_map(|a| util::proc_kb(a.pid(), "VmRSS"))
        .collect();
    let mut hwm: Vec<u64> = agents
        .iter()
        .filter_map(|a| util::proc_kb(a.pid(), "VmHWM"))
        .collect();
    let read = rss.len();
    let (lo, mid, hi) = util::spread(&mut rss);
    let (hlo, hmid, hhi) = util::spread(&mut hwm);
    let prss = util::proc_kb(provider.pid(), "VmRSS").unwrap_or(0);
    let phwm = util::proc_kb(provider.pid(), "VmHWM").unwrap_or(0);
    let mut cpu: Vec<u64> = agents
        .iter()
        .filter_map(|a| util::proc_cpu(a.pid()).map(|d| d.as_millis() as u64))
        .collect();
    let (clo, cmid, chi) = util::spread(&mut cpu);
    let pcpu = util::proc_cpu(provider.pid()).unwrap_or_default();

    let mut r = Report::new("converge", json_out);
    r.line("consumers", args.consumers, args.consumers);
    r.line("needs_per_consumer", args.needs, args.needs);
    r.line("needs_total", total, total);
    r.line(
        "spawn_ms",
        ms(spawned),
        format!(
            "{:.1} ms to spawn the {} consumer processes",
            ms(spawned),
            args.consumers
        ),
    );
    if let Some(d) = first_all_entries {
        r.line(
            "all_entries_at_provider_ms",
            ms(d),
            format!("{:.0} ms", ms(d)),
        );
    }
    r.line(
        "converged_ms",
        ms(elapsed),
        format!(
            "{:.0} ms (consumer spawn → every need satisfied and acknowledged; polled every {:?})",
            ms(elapsed),
            args.poll
        ),
    );
    r.line("provider_handler_runs", runs, runs);
    r.line("provider_state_writes", writes, writes);
    r.line(
        "consumer_idle_rss_kb_min_median_max",
        json!([lo, mid, hi]),
        format!(
            "{lo} / {mid} / {hi} kB (VmRSS of {read} consumers, {:?} after convergence)",
            args.idle
        ),
    );
    r.line(
        "consumer_peak_rss_kb_min_median_max",
        json!([hlo, hmid, hhi]),
        format!("{hlo} / {hmid} / {hhi} kB (VmHWM)"),
    );
    r.line(
        "provider_rss_kb_before_after_peak",
        json!([provider_idle_rss, prss, phwm]),
        format!("{provider_idle_rss} kB idle before, {prss} kB idle after, {phwm} kB peak"),
    );
    r.line(
        "consumer_cpu_ms_min_median_max",
        json!([clo, cmid, chi]),
        format!("{clo} / {cmid} / {chi} ms (whole life, 10 ms ticks)"),
    );
    r.line(
        "provider_cpu_ms",
        ms(pcpu),
        format!("{:.0} ms (whole life)", ms(pcpu)),
    );
    r.target("converge < 5 s", elapsed < Duration::from_secs(5));
    r.target("consumer idle RSS < 20 MB", hi * 1024 < 20_000_000);
    r.target("provider idle RSS < 20 MB", prss * 1024 < 20_000_000);
    r.finish();
    drop(agents);
    drop(provider);
    Ok(())
}
