//! N consumer agents × M needs requested at once against one provider agent
//! with a trivial handler.
//!
//! Method: every agent is started and listening first, consumers with an empty
//! needs.json. Then each consumer's needs.json is replaced with its M needs and all
//! consumers get SIGHUP at the same instant (t0): a reload requests every new need at
//! once. So the clock covers request → durable 202 → coalesced handler runs → signed
//! callbacks → consumer acknowledgement, and not process start-up. The end is the first
//! poll (every `--poll`) at which the provider has N×M entries with nothing undelivered
//! and every consumer reports M of M needs satisfied.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::json;

use crate::paired::{self, Side};
use crate::util::{self, ms, AgentProc, Report};

#[derive(clap::Args, Debug)]
pub struct BurstArgs {
    /// Consumer agents.
    #[arg(long, default_value_t = 20)]
    consumers: usize,
    /// Needs per consumer.
    #[arg(long, default_value_t = 50)]
    needs: usize,
    /// Give up after this long.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    timeout: Duration,
    /// How often completion is polled over the admin sockets.
    #[arg(long, default_value = "10ms", value_parser = humantime::parse_duration)]
    poll: Duration,
    /// Print every poll: time, entries, undelivered, handler runs, state writes.
    #[arg(long)]
    timeline: bool,
    /// Consumers run a handler (`cat >/dev/null`) per callback instead of taking `OK`.
    #[arg(long)]
    consumer_handler: bool,
    /// Every agent sends each request and callback alone (`batches = false`, protocol
    /// 1.1) instead of in batches.
    #[arg(long)]
    one_by_one: bool,
    /// Every agent keeps no audit trail (`[audit] enable = false`).
    #[arg(long, conflicts_with = "compare_audit")]
    audit_off: bool,
    /// Run the burst with every agent's audit trail on and with it off, side by side in
    /// one run (alternating rounds); report each side's median and the ratios.
    #[arg(long, conflicts_with = "compare_sealed")]
    compare_audit: bool,
    /// Run the burst with the provider's state sealed with a state key (its cached
    /// responses, docs/at-rest.md) and in plaintext, side by side in one run
    /// (alternating rounds); report each side's median and the ratios.
    #[arg(long)]
    compare_sealed: bool,
    /// Rounds of --compare-audit and --compare-sealed: each is one burst of either kind.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

/// What one side of a comparison turns on.
#[derive(Clone, Copy)]
struct Setup {
    audit: bool,
    sealed: bool,
}

/// What one burst measured.
struct Measured {
    elapsed: Duration,
    polls: u64,
    all_entries: Option<(Duration, u64, u64)>,
    runs: u64,
    writes: u64,
    cpu: Duration,
    consumer_cpu: Duration,
    hwm: u64,
    last_run: serde_json::Value,
    timeline: Vec<(Duration, u64, u64, u64, u64)>,
}

const CAP: &str = "burst";

pub async fn run(args: BurstArgs, json_out: bool) -> Result<()> {
    util::require_jq()?;
    if args.compare_audit {
        let off = Setup {
            audit: false,
            sealed: false,
        };
        return compare(&args, json_out, "audit", off, Setup { audit: true, ..off }).await;
    }
    if args.compare_sealed {
        let plain = Setup {
            audit: !args.audit_off,
            sealed: false,
        };
        let sealed = Setup {
            sealed: true,
            ..plain
        };
        return compare(&args, json_out, "sealed", plain, sealed).await;
    }
    let setup = Setup {
        audit: !args.audit_off,
        sealed: false,
    };
    let m = measure(&args, setup).await?;
    let total = (args.consumers * args.needs) as u64;
    let mut r = Report::new("burst", json_out);
    r.line("consumers", args.consumers, args.consumers);
    r.batches(args.one_by_one);
    r.line(
        "audit",
        !args.audit_off,
        if args.audit_off { "off" } else { "on" },
    );
    r.line("needs_per_consumer", args.needs, args.needs);
    r.line("needs_total", total, total);
    r.line("all_called_back_ms", ms(m.elapsed), format!("{:.1} ms (SIGHUP of all consumers → every consumer satisfied; polled every {:?}, {} polls)", ms(m.elapsed), args.poll, m.polls));
    if let Some((at, runs, writes)) = m.all_entries {
        r.line("all_entries_stored_ms", ms(at), format!("{:.1} ms (first poll showing all {total} entries; {runs} handler runs and {writes} state writes by then)", ms(at)));
    }
    r.line("handler_runs", m.runs, m.runs);
    r.line(
        "state_writes",
        m.writes,
        format!("{} (provider-state.json)", m.writes),
    );
    r.line(
        "provider_cpu_ms",
        ms(m.cpu),
        format!(
            "{:.0} ms (utime+stime during the burst, 10 ms ticks)",
            ms(m.cpu)
        ),
    );
    r.line(
        "provider_peak_rss_kb",
        m.hwm,
        format!("{:.1} MiB (VmHWM)", m.hwm as f64 / 1024.0),
    );
    r.line(
        "consumers_cpu_ms",
        ms(m.consumer_cpu),
        format!("{:.0} ms (all consumers together)", ms(m.consumer_cpu)),
    );
    r.line("last_handler_run", m.last_run.clone(), &m.last_run);
    if args.timeline {
        for (at, entries, undelivered, runs, writes) in &m.timeline {
            r.note(&format!("t={:>7.1} ms entries={entries:>5} undelivered={undelivered:>5} handler_runs={runs:>3} state_writes={writes:>4}", ms(*at)));
        }
    }
    r.target("all called back < 3 s", m.elapsed < Duration::from_secs(3));
    r.target("< 50 handler runs", m.runs < 50);
    r.target("< 100 state writes", m.writes < 100);
    r.finish();
    Ok(())
}

/// One figure of a burst.
type Pick = fn(&Measured) -> Duration;

/// The same burst with `what` (every agent's audit trail, or the provider's state key)
/// and without it, side by side in one run (alternating rounds, see [`paired`]): each
/// side's median, and on/off as the median of the rounds' ratios.
async fn compare(
    args: &BurstArgs,
    json_out: bool,
    what: &str,
    without: Setup,
    with: Setup,
) -> Result<()> {
    let pairs = paired::rounds(args.rounds, |side| {
        measure(args, if side == Side::A { with } else { without })
    })
    .await?;
    let total = (args.consumers * args.needs) as u64;
    let mut r = Report::new(&format!("burst --compare-{what}"), json_out);
    r.line("consumers", args.consumers, args.consumers);
    r.batches(args.one_by_one);
    r.line("needs_total", total, total);
    r.line(
        "rounds",
        pairs.len(),
        format!("{} (on and off alternating)", pairs.len()),
    );
    let secs = |d: Duration| d.as_secs_f64();
    let metrics: [(&str, &str, Pick); 3] = [
        (
            "all_called_back_ms",
            "SIGHUP → every consumer satisfied",
            |m| m.elapsed,
        ),
        ("provider_cpu_ms", "provider utime+stime", |m| m.cpu),
        ("consumers_cpu_ms", "all consumers' utime+stime", |m| {
            m.consumer_cpu
        }),
    ];
    let mut medians = Vec::new();
    for (key, measured, f) in metrics {
        for (side, pick) in [("on", 0), ("off", 1)] {
            let v = paired::median(
                pairs
                    .iter()
                    .map(|p| secs(f(if pick == 0 { &p.0 } else { &p.1 })) * 1e3)
                    .collect(),
            );
            r.line(
                &format!("{key}_{what}_{side}"),
                v.round(),
                format!("{v:.0} ms ({measured}, {what} {side}, median)"),
            );
        }
        let (each, x) = paired::ratios(&pairs, |m| secs(f(m)));
        r.line(
            &format!("{key}_ratio"),
            json!(each),
            paired::shown(&each, x),
        );
        medians.push(x);
    }
    r.line(
        &format!("provider_peak_rss_kb_{what}_on_off"),
        json!([pairs[0].0.hwm, pairs[0].1.hwm]),
        format!(
            "{} / {} KiB (VmHWM, on / off, first round)",
            pairs[0].0.hwm, pairs[0].1.hwm
        ),
    );
    r.target(&format!("{what} on ≤ 1.15× off (time)"), medians[0] <= 1.15);
    r.target(
        &format!("{what} on ≤ 1.15× off (provider CPU)"),
        medians[1] <= 1.15,
    );
    r.finish();
    Ok(())
}

async fn measure(args: &BurstArgs, setup: Setup) -> Result<Measured> {
    let mut fleet = util::new_fleet();
    let handler = util::ok_handler(&fleet, None);
    let sink = fleet.script("sink", "cat >/dev/null");
    fleet.capability("forge", CAP, json!({"handler": handler, "mode": "async"}));
    let consumers: Vec<String> = (0..args.consumers).map(|i| format!("c{i:03}")).collect();
    for c in &consumers {
        for n in 0..args.needs {
            let mut spec = json!({"nag_seconds": 3600, "request": {"n": n}});
            if args.consumer_handler {
                spec["handler"] = json!(sink);
            }
            fleet.need(c, &format!("{CAP}/n{n:04}"), "forge", spec);
        }
    }
    for name in std::iter::once("forge".to_owned()).chain(consumers.iter().cloned()) {
        let mut toml = String::new();
        if args.one_by_one {
            toml.push_str("batches = false\n");
        }
        if setup.sealed && name == "forge" {
            use std::os::unix::fs::PermissionsExt;
            let key = fleet.dir.path().join("state-key");
            std::fs::write(&key, fort_core::sealed::StateKey::generate_hex().as_bytes())?;
            std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600))?;
            toml.insert_str(0, &format!("state_key_file = \"{}\"\n", key.display()));
        }
        if !setup.audit {
            toml.push_str("[audit]\nenable = false\n");
        }
        fleet.host(&name).extra_toml = toml;
    }
    fleet.write_files();
    for c in &consumers {
        std::fs::write(fleet.host_dir(c).join("needs.json"), "{}")?;
    }

    let mut provider = vec![AgentProc::spawn(&fleet, "forge")?];
    util::wait_listening(&mut provider, Duration::from_secs(20))?;
    let provider = provider.pop().expect("one");
    let mut agents = Vec::new();
    for c in &consumers {
        agents.push(AgentProc::spawn(&fleet, c)?);
    }
    util::wait_listening(&mut agents, Duration::from_secs(60))?;
    for a in &agents {
        // Answers once the agent has started (both sockets are bound before that).
        util::status(&a.socket()).with_context(|| format!("{} admin socket", a.name))?;
    }
    // The SIGHUP handler is installed just after the admin socket starts answering;
    // a SIGHUP before that would kill the agent.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = util::status(&provider.socket())?;
    let (_, _, runs0, writes0) = util::provider_counts(&before, CAP);
    let cpu0 = util::proc_cpu(provider.pid()).unwrap_or_default();
    let consumer_cpu0: Duration = agents.iter().filter_map(|a| util::proc_cpu(a.pid())).sum();

    for c in &consumers {
        let needs = serde_json::to_vec_pretty(&fleet.hosts[c].needs)?;
        std::fs::write(fleet.host_dir(c).join("needs.json"), needs)?;
    }
    let t0 = Instant::now();
    for a in &agents {
        a.hup();
    }
    let total = (args.consumers * args.needs) as u64;
    let deadline = t0 + args.timeout;
    let mut polls = 0u64;
    let mut timeline = Vec::new();
    let mut all_entries: Option<(Duration, u64, u64)> = None;
    // Consumers are polled for counts only; the provider's full status (a walk over every
    // entry) only every half second, so the measurement does not load what it measures.
    let mut last_full = Instant::now() - Duration::from_secs(1);
    let entry_count = |socket: &std::path::Path| -> Result<u64> {
        let c = util::admin(socket, &json!({"cmd": "counts"}), Duration::from_secs(30))?;
        Ok(c["entries"][CAP].as_u64().unwrap_or(0))
    };
    // A consumer all of whose needs are satisfied stays so: it is not asked again.
    let mut done = vec![false; agents.len()];
    let mut entries = 0;
    let elapsed = loop {
        polls += 1;
        let at = t0.elapsed();
        if entries < total {
            entries = entry_count(&provider.socket())?;
        }
        if entries == total && all_entries.is_none() {
            let s = util::status(&provider.socket())?;
            let (_, _, runs, writes) = util::provider_counts(&s, CAP);
            all_entries = Some((at, runs - runs0, writes - writes0));
        }
        if args.timeline && last_full.elapsed() >= Duration::from_millis(500) {
            last_full = Instant::now();
            let s = util::status(&provider.socket())?;
            let (entries, undelivered, runs, writes) = util::provider_counts(&s, CAP);
            timeline.push((at, entries, undelivered, runs - runs0, writes - writes0));
        }
        for (i, a) in agents.iter().enumerate() {
            if !done[i] {
                done[i] = util::needs_satisfied(&a.socket())
                    == Some((args.needs as u64, args.needs as u64));
            }
        }
        let satisfied = done.iter().filter(|d| **d).count() as u64 * args.needs as u64;
        if entries == total && satisfied == total {
            break t0.elapsed();
        }
        if Instant::now() > deadline {
            bail!(
                "not converged after {:?}: provider entries {entries}/{total}, consumers satisfied {satisfied}/{total}",
                args.timeout
            );
        }
        tokio::time::sleep(args.poll).await;
    };
    // Every consumer has its payload; the provider's delivery records (written lazily)
    // follow within a second or so.
    let last = loop {
        let s = util::status(&provider.socket())?;
        let (_, undelivered, _, _) = util::provider_counts(&s, CAP);
        if undelivered == 0 || Instant::now() > deadline {
            break s;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let cpu = util::proc_cpu(provider.pid()).unwrap_or_default() - cpu0;
    let consumer_cpu = agents
        .iter()
        .filter_map(|a| util::proc_cpu(a.pid()))
        .sum::<Duration>()
        - consumer_cpu0;
    let hwm = util::proc_kb(provider.pid(), "VmHWM").unwrap_or(0);
    let (_, _, runs1, writes1) = util::provider_counts(&last, CAP);
    let runs = runs1 - runs0;
    let writes = writes1 - writes0;
    let last_run = last["provider"]["capabilities"][CAP]["last_run"].clone();
    drop(agents);
    drop(provider);
    Ok(Measured {
        elapsed,
        polls,
        all_entries,
        runs,
        writes,
        cpu,
        consumer_cpu,
        hwm,
        last_run,
        timeline,
    })
}
