//! The figures of a chaos run, as aligned lines or one JSON object (`--json`).

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::json;

use super::observe::Observer;
use super::plan::{Kind, Plan};
use super::World;
use crate::util::{ms, Report};

pub struct Run<'a> {
    pub plan: &'a Plan,
    pub skips: &'a BTreeMap<Kind, String>,
    pub rates: &'a BTreeMap<Kind, f64>,
    pub obs: &'a Observer,
    pub converged: Duration,
    pub fault_phase: Duration,
    pub settled: Duration,
    /// Trails verified, witnessed checkpoints checked.
    pub trails: (usize, u64),
    pub max_active: usize,
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub fn print(w: &World, run: &Run, json_out: bool) {
    let tl = lock(&w.timeline);
    let stats = lock(&w.stats);
    let (cpu, rss_mean, rss_max) = lock(&w.procs).usage();
    let hosts = w.layout.hosts();
    let needs: usize = w
        .layout
        .consumers
        .iter()
        .map(|c| w.declared(&c.name).len())
        .sum();
    let mut r = Report::new("chaos", json_out);
    r.line(
        "seed",
        tl.seed,
        format!(
            "{} (replay: fort-bench chaos --seed {} with the same flags; plan {})",
            tl.seed,
            tl.seed,
            super::plan::fingerprint(run.plan)
        ),
    );
    r.line(
        "hosts",
        hosts.len(),
        format!(
            "{} ({} ssh-ca CAs, {} postgres on one server, 1 token issuer, {} consumers of which {} can be rolled back)",
            hosts.len(),
            w.layout.cas.len(),
            w.layout.pgs.len(),
            w.layout.consumers.len(),
            w.layout.consumers.iter().filter(|c| c.rollback).count()
        ),
    );
    if w.layout.pgs.is_empty() {
        r.note("SKIP the shared backend (postgres): PostgreSQL could not be started here");
    }
    let t = w.layout.timing;
    r.line(
        "timing_s",
        json!({"nag": t.nag, "failover_after": t.failover_after, "lifetime": t.lifetime,
               "gc_grace": t.gc_grace, "gc_interval": t.gc_interval,
               "slack": w.slack, "deadline": t.recovery() as f64 + w.slack}),
        format!(
            "nag {}s, failover_after {}s, credentials live {}s (renewed at half-life), GC grace {}s every {}s; a need is due again {}s + {:.0}s slack after the last fault that concerned it",
            t.nag, t.failover_after, t.lifetime, t.gc_grace, t.gc_interval, t.recovery(), w.slack
        ),
    );
    let network = match run.skips.get(&Kind::Partition) {
        Some(why) => format!("SKIP: {why}"),
        None => "kernel: a network namespace per host, veth pairs to a bridge, nftables rules"
            .to_owned(),
    };
    r.line("network_faults", network.clone(), network);
    r.line(
        "phases_s",
        json!({"converged": run.converged.as_secs(), "faults": run.fault_phase.as_secs(),
               "settled": run.settled.as_secs()}),
        format!(
            "converged in {:.0}s, faults for {:.0}s, settled in {:.0}s",
            run.converged.as_secs_f64(),
            run.fault_phase.as_secs_f64(),
            run.settled.as_secs_f64()
        ),
    );
    let mut by_kind = serde_json::Map::new();
    let mut shown = Vec::new();
    for k in Kind::ALL {
        let name = k.name();
        if let Some(why) = run.skips.get(&k) {
            by_kind.insert(name.into(), json!({"skip": why}));
            shown.push(format!("{name} SKIP ({why})"));
        } else if !run.rates.contains_key(&k) {
            by_kind.insert(name.into(), json!("off"));
            shown.push(format!("{name} off"));
        } else {
            let n = stats.injected.get(name).copied().unwrap_or(0);
            let dropped = run.plan.dropped.get(name).copied().unwrap_or(0);
            by_kind.insert(
                name.into(),
                json!({"injected": n, "rate_per_minute": run.rates[&k],
                                               "not_placed": dropped}),
            );
            shown.push(format!("{name} {n}"));
        }
    }
    let total: u64 = stats.injected.values().sum();
    let not_placed: u64 = run.plan.dropped.values().sum();
    r.line(
        "faults",
        serde_json::Value::Object(by_kind),
        format!(
            "{total}: {} ({not_placed} drawn found no free host or {} faults holding already)",
            shown.join(", "),
            run.max_active
        ),
    );
    let held = stats.partitions_seen.get(&true).copied().unwrap_or(0);
    let leaked = stats.partitions_seen.get(&false).copied().unwrap_or(0);
    r.line(
        "partitions_seen_to_hold",
        json!({"held": held, "did_not": leaked}),
        format!("{held} partitions seen to hold (a connection across each refused), {leaked} not"),
    );
    r.line(
        "handler_runs_killed",
        stats.handler_runs_caught,
        format!(
            "{} providers killed in the middle of a handler run",
            stats.handler_runs_caught
        ),
    );
    let crashes = tl.faults.iter().filter(|f| f.kind == "crash").count();
    r.line(
        "needs",
        needs,
        format!(
            "{needs} declared at the end, {} bad at the end",
            run.obs.bad_now().len()
        ),
    );
    let o = run.obs;
    r.line(
        "credentials_applied",
        json!({"certificates": o.certificates_applied, "tokens": o.tokens_applied,
               "passwords": o.passwords_applied}),
        format!(
            "{} certificates, {} tokens, {} passwords newly in consumers' files (issues and renewals served)",
            o.certificates_applied, o.tokens_applied, o.passwords_applied
        ),
    );
    let l = &o.longest;
    r.line(
        "longest_unsatisfied",
        json!({"seconds": l.seconds.round(), "consumer": l.consumer, "need": l.need,
               "why": l.why, "cause": l.cause}),
        format!(
            "{:.0}s: {} {} ({}); last fault: {}",
            l.seconds, l.consumer, l.need, l.why, l.cause
        ),
    );
    r.line(
        "moves",
        o.moves,
        format!(
            "{} moves of needs naming several CAs; {} of {} certificates newly applied to them held to their home by the CA that signed them",
            o.moves, o.attributed.1, o.attributed.0
        ),
    );
    r.line(
        "failed_starts",
        stats.failed_starts,
        format!(
            "{} (of {} starts); {crashes} agents died by themselves",
            stats.failed_starts,
            lock(&w.procs).hosts.values().map(|h| h.starts).sum::<u32>()
        ),
    );
    r.line(
        "operator_calls",
        json!(stats.ops),
        stats
            .ops
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", "),
    );
    r.line(
        "trails",
        json!({"verified": run.trails.0, "of": hosts.len(), "witnessed_checkpoints": run.trails.1}),
        format!(
            "{} of {} verified with the others' witnesses ({} witnessed checkpoints checked)",
            run.trails.0,
            hosts.len(),
            run.trails.1
        ),
    );
    let minutes = (run.converged + run.fault_phase + run.settled).as_secs_f64() / 60.0;
    r.line(
        "agents_cpu_s",
        (ms(cpu) / 1000.0).round(),
        format!(
            "{:.0}s for all agents and their handlers ({:.2}s per agent-minute)",
            cpu.as_secs_f64(),
            cpu.as_secs_f64() / (hosts.len() as f64 * minutes.max(0.01))
        ),
    );
    r.line(
        "agents_rss_kb",
        json!({"mean": rss_mean, "max": rss_max}),
        format!("mean {rss_mean} kB, largest {rss_max} kB"),
    );
    r.line(
        "violations",
        tl.violations_json(),
        if tl.violations.is_empty() {
            "none".to_owned()
        } else {
            format!("{}", tl.violations.len())
        },
    );
    for v in &tl.violations {
        r.note(&format!(
            "VIOLATION at {:.0}s (seed {}): {}: {} {}: {}",
            v.at - tl.t0,
            tl.seed,
            v.invariant,
            v.hosts.join(","),
            v.need.as_deref().unwrap_or(""),
            v.detail
        ));
    }
    r.target("no invariant violated", tl.violations.is_empty());
    r.target("zero failed starts", stats.failed_starts == 0);
    r.target("every partition held", leaked == 0);
    r.finish();
}
