//! K consumer agents × M needs, each need naming two providers (docs/protocol.md
//! §11.13), and the home killed with `kill -9` just as every need comes due.
//!
//! Method: both providers and every consumer are started and every need is served by
//! its home, `e1`. Then `e1` is SIGKILLed, a listener takes its address (it accepts each
//! connection and closes it at once, and counts it: what reaches a dead host's address),
//! and every consumer's needs.json is replaced with the same needs asking something new,
//! and all consumers get SIGHUP at the same instant (t0): every need is due, at a dead
//! home. The clock stops at the first poll at which every consumer reports all its needs
//! satisfied again, which only `e2` can do; each consumer's status then says every need
//! is served by `e2`. The listener keeps counting for `--tail` after that: a consumer
//! that keeps asking the dead home shows there.

use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::json;

use crate::util::{self, ms, AgentProc, Report};

#[derive(clap::Args, Debug)]
pub struct FailoverArgs {
    /// Consumer agents.
    #[arg(long, default_value_t = 500)]
    consumers: usize,
    /// Needs per consumer, each from ["e1", "e2"].
    #[arg(long, default_value_t = 2)]
    needs: usize,
    /// The needs' nag interval.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    nag: Duration,
    /// The needs' failover_after (null in the protocol: twice the nag interval).
    #[arg(long, default_value = "20s", value_parser = humantime::parse_duration)]
    failover_after: Duration,
    /// How long the dead home's address is watched after every need is served again.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    tail: Duration,
    /// Give up after this long.
    #[arg(long, default_value = "180s", value_parser = humantime::parse_duration)]
    timeout: Duration,
    /// How often completion is polled over the admin sockets.
    #[arg(long, default_value = "200ms", value_parser = humantime::parse_duration)]
    poll: Duration,
}

const CAP: &str = "tok";

/// Connections to the dead home's address: accepted, closed at once, counted, each with
/// its time since the listener started.
struct Watch {
    stop: Arc<AtomicBool>,
    count: Arc<AtomicU64>,
    after: Arc<std::sync::Mutex<Vec<Duration>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watch {
    fn on(addr: SocketAddr) -> Result<Watch> {
        // SO_REUSEADDR (std sets it): the dead agent's connections may linger.
        let listener = TcpListener::bind(addr).with_context(|| format!("bind {addr}"))?;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let count = Arc::new(AtomicU64::new(0));
        let after = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (s, c, a) = (stop.clone(), count.clone(), after.clone());
        let started = Instant::now();
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((conn, _)) => {
                        drop(conn);
                        c.fetch_add(1, Ordering::Relaxed);
                        a.lock().expect("lock").push(started.elapsed());
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Ok(Watch {
            stop,
            count,
            after,
            thread: Some(thread),
        })
    }

    fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// Connections that came at or after `at` (since the listener started).
    fn since(&self, at: Duration) -> u64 {
        let times = self.after.lock().expect("lock");
        times.iter().filter(|t| **t >= at).count() as u64
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

pub async fn run(args: FailoverArgs, json_out: bool) -> Result<()> {
    util::require_jq()?;
    let mut fleet = util::new_fleet();
    let handler = util::ok_handler(&fleet, None);
    for p in ["e1", "e2"] {
        fleet.capability(p, CAP, json!({"handler": handler, "mode": "async"}));
    }
    let consumers: Vec<String> = (0..args.consumers).map(|i| format!("c{i:03}")).collect();
    let spec = |round: u64, n: usize| {
        json!({"nag_seconds": args.nag.as_secs().max(1),
               "failover_after_seconds": args.failover_after.as_secs().max(1),
               "request": {"n": n, "round": round}})
    };
    for c in &consumers {
        for n in 0..args.needs {
            fleet.need_from(c, &format!("{CAP}/n{n:04}"), &["e1", "e2"], spec(1, n));
        }
    }
    fleet.write_files();
    let mut providers = vec![
        AgentProc::spawn(&fleet, "e1")?,
        AgentProc::spawn(&fleet, "e2")?,
    ];
    util::wait_listening(&mut providers, Duration::from_secs(20))?;
    let mut agents = Vec::new();
    for c in &consumers {
        agents.push(AgentProc::spawn(&fleet, c)?);
    }
    util::wait_listening(&mut agents, Duration::from_secs(120))?;
    let total = (args.consumers * args.needs) as u64;
    let all_satisfied = |agents: &[AgentProc]| {
        agents
            .iter()
            .filter_map(|a| util::needs_satisfied(&a.socket()))
            .map(|(_, s)| s)
            .sum::<u64>()
    };
    let ready = Instant::now() + args.timeout;
    while all_satisfied(&agents) < total {
        if Instant::now() > ready {
            bail!("the needs were never all served by the home");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // Served by e1, all of them: the standby has heard of nobody.
    let (e2_entries, _, _, _) = util::provider_counts(&util::status(&providers[1].socket())?, CAP);

    for c in &consumers {
        for n in 0..args.needs {
            let key = format!("{CAP}/n{n:04}");
            let mut s = spec(2, n);
            s["from"] = json!(["e1", "e2"]);
            fleet.host(c).needs.insert(key, s);
        }
        let needs = serde_json::to_vec_pretty(&fleet.hosts[c].needs)?;
        std::fs::write(fleet.host_dir(c).join("needs.json"), needs)?;
    }
    let home = providers.remove(0);
    let home_addr = home.addr;
    drop(home); // SIGKILL, reaped
    let watch = Watch::on(home_addr)?;
    let t0 = Instant::now();
    for a in &agents {
        a.hup();
    }
    let deadline = t0 + args.timeout;
    // Each consumer, once it no longer shows the old answers (its reload), and once
    // all its needs are served again.
    let mut reloaded = vec![false; agents.len()];
    let mut done = vec![false; agents.len()];
    let mut polls = 0u64;
    let elapsed = loop {
        polls += 1;
        for (i, a) in agents.iter().enumerate() {
            if done[i] {
                continue;
            }
            let Some((n, s)) = util::needs_satisfied(&a.socket()) else {
                continue;
            };
            if !reloaded[i] {
                reloaded[i] = s < n;
            } else {
                done[i] = s == n && n == args.needs as u64;
            }
        }
        if done.iter().all(|d| *d) {
            break t0.elapsed();
        }
        if Instant::now() > deadline {
            let served = done.iter().filter(|d| **d).count();
            bail!(
                "not every consumer served again after {:?}: {served}/{} ({} connections to the dead home so far)",
                args.timeout,
                agents.len(),
                watch.count()
            );
        }
        tokio::time::sleep(args.poll).await;
    };
    let until_served = watch.count();
    let served_at = t0.elapsed();
    tokio::time::sleep(args.tail).await;
    let in_tail = watch.since(served_at);
    let after_all = watch.count();
    // Every need is e2's now.
    let mut on_e2 = 0u64;
    let mut moves = 0u64;
    for a in &agents {
        let st = util::status(&a.socket())?;
        for row in st["needs"]["items"].as_array().into_iter().flatten() {
            on_e2 += u64::from(row["from"] == "e2");
            moves += row["moves"].as_u64().unwrap_or(0);
        }
    }
    let consumer_cpu: Duration = agents.iter().filter_map(|a| util::proc_cpu(a.pid())).sum();
    drop(watch);
    drop(agents);
    drop(providers);

    let mut r = Report::new("failover", json_out);
    r.line("consumers", args.consumers, args.consumers);
    r.line("needs_per_consumer", args.needs, args.needs);
    r.line("needs_total", total, total);
    r.line(
        "nag_and_failover_after_s",
        json!([args.nag.as_secs(), args.failover_after.as_secs()]),
        format!(
            "nag {:?}, failover_after {:?}",
            args.nag, args.failover_after
        ),
    );
    r.line(
        "standby_entries_before",
        e2_entries,
        format!("{e2_entries} (while the home was up)"),
    );
    r.line(
        "all_served_by_standby_ms",
        ms(elapsed),
        format!(
            "{:.0} ms (kill -9 of the home and SIGHUP of every consumer, every need due → every need satisfied again; polled every {:?}, {polls} polls)",
            ms(elapsed),
            args.poll
        ),
    );
    r.line(
        "needs_on_standby",
        on_e2,
        format!("{on_e2} of {total} served by e2, {moves} moves"),
    );
    r.line(
        "dead_home_connections",
        until_served,
        format!(
            "{until_served} connections to the dead home's address until every need was served ({:.2} per consumer, {:.2} per need)",
            until_served as f64 / args.consumers.max(1) as f64,
            until_served as f64 / total.max(1) as f64
        ),
    );
    r.line(
        "dead_home_connections_after",
        in_tail,
        format!(
            "{in_tail} more in the {:?} after (total {after_all})",
            args.tail
        ),
    );
    r.line(
        "consumers_cpu_ms",
        ms(consumer_cpu),
        format!("{:.0} ms (all consumers, whole run)", ms(consumer_cpu)),
    );
    // Probing bounds what reaches a dead home by probe intervals per consumer, not by
    // needs: within failover_after + a nag interval, at most log2(nag / 2 s) + 2 +
    // (failover_after + nag) / nag probes each.
    let per_consumer_bound = {
        let doubling = (args.nag.as_secs_f64() / 2.0).log2().ceil().max(0.0) as u64 + 2;
        doubling + (args.failover_after + args.nag).as_secs() / args.nag.as_secs().max(1)
    };
    r.line(
        "probe_bound_per_consumer",
        per_consumer_bound,
        format!("{per_consumer_bound} (probes one consumer may send the dead home in that time)"),
    );
    r.target(
        "served within failover_after + nag",
        elapsed <= args.failover_after + args.nag,
    );
    r.target("every need on the standby", on_e2 == total);
    r.target("the standby idle while the home was up", e2_entries == 0);
    r.target(
        "dead home asked ≤ bound per consumer",
        until_served <= per_consumer_bound * args.consumers as u64,
    );
    r.target("nothing to the dead home after", in_tail == 0);
    r.finish();
    Ok(())
}
