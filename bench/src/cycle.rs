//! CPU time of one fulfiller scheduler cycle over N needs, measured in-process
//! on a real `fort_fulfill::Fulfiller` built the way the agent builds it.
//!
//! (b) all due: a fresh fulfiller whose N needs are all unsatisfied; one `run_due()`
//!     starts N requests to a real provider agent; the process's CPU time
//!     (`RUSAGE_SELF`: signing, HTTP, response verification, state flushes) is measured
//!     until every request has its answer (`202`).
//! (a) steady state: the same fulfiller, after each need got its callback (`deliver(..,
//!     "OK")`, the path the agent's callback route takes): the real sequence request →
//!     202 → callback. `run_due()` is called `--iterations` times on this thread and its
//!     CPU time (`getrusage(RUSAGE_THREAD)`) divided. Two variants: needs without `check`
//!     (nothing stays scheduled) and needs with a `check` (every need keeps a timer one
//!     nag interval away, so each pass walks all of them).

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use fort_core::client::{ClientOptions, SignedClient};
use fort_core::schema::{load_needs, Needs, Registry};
use fort_core::sign::Signer;
use fort_core::store::Store;
use fort_core::wire::{Delivered, MAX_BATCH_ITEMS};
use fort_fulfill::{FulfillOptions, Fulfiller};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::util::{self, ms, AgentProc, Report};

#[derive(clap::Args, Debug)]
pub struct CycleArgs {
    /// Needs of the consumer.
    #[arg(long, default_value_t = 500)]
    needs: usize,
    /// Steady-state `run_due()` calls measured (CPU per cycle is the average).
    #[arg(long, default_value_t = 2000)]
    iterations: u32,
    /// Requests in flight to the provider at once (the agent's default is 8).
    #[arg(long, default_value_t = 8)]
    per_provider_concurrency: usize,
    /// Send every request alone (protocol 1.1) instead of in batches.
    #[arg(long)]
    one_by_one: bool,
    /// Give up on the all-due cycle after this long.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    timeout: Duration,
}

const CAP: &str = "cycle";
const ME: &str = "consumer";

struct Built {
    fulfiller: Fulfiller,
    tasks: TaskTracker,
}

async fn build(
    dir: &Path,
    signer: &Signer,
    needs: Needs,
    registry: Arc<Registry>,
    shutdown: &CancellationToken,
    concurrency: usize,
    batches: bool,
) -> Result<Built> {
    std::fs::create_dir_all(dir)?;
    let store = Store::open(
        &dir.join(fort_fulfill::state::FILE),
        fort_fulfill::state::FIELD,
    )?;
    tokio::spawn(store.clone().run_flusher(shutdown.clone()));
    let client = SignedClient::new(ME, signer.clone(), &ClientOptions::default());
    let tasks = TaskTracker::new();
    let fulfiller = Fulfiller::new(
        FulfillOptions {
            host: ME.into(),
            handler_timeout: Duration::from_secs(60),
            per_provider_concurrency: concurrency,
            backoff: Duration::from_secs(2),
            request_timeout: Duration::from_secs(30),
            handler_environment: Vec::new(),
            systemctl: "systemctl".into(),
            systemd_creds: "systemd-creds".into(),
            batches,
            key_dir: dir.join("keys"),
            audit: fort_core::audit::Audit::disabled(),
        },
        store,
        client,
        tasks.clone(),
        shutdown.clone(),
    );
    fulfiller.reload(needs, registry).await?;
    Ok(Built { fulfiller, tasks })
}

/// Marks every need satisfied through the callback path, concurrently.
async fn satisfy_all(f: &Fulfiller, needs: &Needs) -> Result<()> {
    let mut set = tokio::task::JoinSet::new();
    for key in needs.keys() {
        let (f, key) = (f.clone(), key.clone());
        set.spawn(async move { f.deliver(&key, "forge", Delivered::Payload(b"OK")).await });
    }
    while let Some(r) = set.join_next().await {
        // Needs without files or a handler are applied inline: satisfied at once.
        if r.context("deliver task")?? != Some(true) {
            bail!("an OK payload did not satisfy its need");
        }
    }
    let n = f.status().iter().filter(|s| s.satisfied).count();
    if n != needs.len() {
        bail!("only {n} of {} needs satisfied", needs.len());
    }
    Ok(())
}

struct Steady {
    cpu: Duration,
    wall: Duration,
    spawned: u64,
    started: usize,
    next_in: Option<Duration>,
}

fn steady(b: &Built, iterations: u32) -> Steady {
    let spawned0 = b.fulfiller.processes_spawned();
    let tasks0 = b.tasks.len();
    let _ = b.fulfiller.run_due();
    let n = iterations.max(1);
    let c0 = util::thread_cpu();
    let w0 = Instant::now();
    let mut next = None;
    for _ in 0..n {
        next = std::hint::black_box(b.fulfiller.run_due());
    }
    let wall = w0.elapsed() / n;
    let cpu = (util::thread_cpu() - c0) / n;
    Steady {
        cpu,
        wall,
        spawned: b.fulfiller.processes_spawned() - spawned0,
        started: b.tasks.len().saturating_sub(tasks0),
        next_in: next.map(|at| at.saturating_duration_since(tokio::time::Instant::now())),
    }
}

struct Due {
    pass_cpu: Duration,
    started: usize,
    cpu: Duration,
    wall: Duration,
    accepted: usize,
    first_error: Option<String>,
}

/// One pass with every need due, until every request it started has its answer.
async fn all_due(b: &Built, timeout: Duration) -> Result<Due> {
    let self0 = util::self_cpu();
    let t0 = Instant::now();
    let th0 = util::thread_cpu();
    let _ = b.fulfiller.run_due();
    let pass_cpu = util::thread_cpu() - th0;
    let started = b.tasks.len();
    b.tasks.close();
    let finished = tokio::time::timeout(timeout, b.tasks.wait()).await;
    b.tasks.reopen();
    if finished.is_err() {
        bail!("the {started} requests did not finish within {timeout:?}");
    }
    let wall = t0.elapsed();
    let cpu = util::self_cpu() - self0;
    // Attempt counters are bookkeeping, written lazily: on disk (and so in the status)
    // once flushed.
    let _ = b.fulfiller.store().flush_once().await;
    let rows = b.fulfiller.status();
    let accepted = rows
        .iter()
        .filter(|s| s.attempts >= 1 && s.reason.is_none())
        .count();
    let first_error = rows.iter().find_map(|s| s.reason.clone());
    Ok(Due {
        pass_cpu,
        started,
        cpu,
        wall,
        accepted,
        first_error,
    })
}

fn report_steady(r: &mut Report, tag: &str, what: &str, s: &Steady) {
    let us = |d: Duration| (d.as_secs_f64() * 1e7).round() / 10.0;
    r.line(
        &format!("{tag}_cpu_per_cycle_us"),
        us(s.cpu),
        format!("{:.1} µs CPU per run_due() ({what})", us(s.cpu)),
    );
    r.line(
        &format!("{tag}_wall_per_cycle_us"),
        us(s.wall),
        format!("{:.1} µs", us(s.wall)),
    );
    r.line(&format!("{tag}_processes_spawned"), s.spawned, s.spawned);
    r.line(&format!("{tag}_requests_started"), s.started, s.started);
    let next = s.next_in.map(|d| d.as_secs());
    r.line(&format!("{tag}_next_due_in_s"), next, format!("{next:?}"));
}

pub async fn run(args: CycleArgs, json_out: bool) -> Result<()> {
    util::require_jq()?;
    let mut fleet = util::new_fleet();
    // No responses: the consumer is in-process and has no callback endpoint.
    let handler = fleet.script("nothing", "cat >/dev/null; echo '{}'");
    let check = fleet.script("check", "exit 0");
    fleet.capability("forge", CAP, json!({"handler": handler, "mode": "async"}));
    for n in 0..args.needs {
        fleet.need(
            ME,
            &format!("{CAP}/n{n:04}"),
            "forge",
            json!({"nag_seconds": 3600, "request": {"n": n}}),
        );
    }
    fleet.write_files();
    let dir = fleet.host_dir(ME);
    let mut with_check = fleet.hosts[ME].needs.clone();
    for spec in with_check.values_mut() {
        spec["check"] = json!(check);
    }
    std::fs::write(
        dir.join("needs-check.json"),
        serde_json::to_vec(&with_check)?,
    )?;
    let registry = Arc::new(Registry::load(&dir.join("hosts.json"))?);
    let needs = load_needs(&dir.join("needs.json"), &registry)?;
    let needs_check = load_needs(&dir.join("needs-check.json"), &registry)?;
    let signer = fleet.hosts[ME].signer.clone();
    let shutdown = CancellationToken::new();
    let conc = args.per_provider_concurrency;
    let mut p = vec![AgentProc::spawn(&fleet, "forge")?];
    util::wait_listening(&mut p, Duration::from_secs(20))?;
    let provider = p.pop().expect("one");
    util::status(&provider.socket())?;

    // (b) all due, then (a) steady state on the same fulfiller.
    let a1 = build(
        &dir.join("a1"),
        &signer,
        needs.clone(),
        registry.clone(),
        &shutdown,
        conc,
        !args.one_by_one,
    )
    .await?;
    let prov0 = util::proc_cpu(provider.pid()).unwrap_or_default();
    let writes0 = a1.fulfiller.store().writes();
    let due = all_due(&a1, args.timeout).await;
    let due_writes = a1.fulfiller.store().writes() - writes0;
    let prov_cpu = util::proc_cpu(provider.pid()).unwrap_or_default() - prov0;
    let due = due.inspect_err(|_| shutdown.cancel())?;
    let due_spawned = a1.fulfiller.processes_spawned();
    let entries = util::provider_counts(&util::status(&provider.socket())?, CAP).0;
    satisfy_all(&a1.fulfiller, &needs).await?;
    let s1 = steady(&a1, args.iterations);

    let a2 = build(
        &dir.join("a2"),
        &signer,
        needs_check.clone(),
        registry.clone(),
        &shutdown,
        conc,
        !args.one_by_one,
    )
    .await?;
    let due2 = all_due(&a2, args.timeout)
        .await
        .inspect_err(|_| shutdown.cancel())?;
    satisfy_all(&a2.fulfiller, &needs_check).await?;
    let s2 = steady(&a2, args.iterations);

    // The real scheduler loops, idle, for two seconds.
    let spawned0 = a1.fulfiller.processes_spawned() + a2.fulfiller.processes_spawned();
    let idle_cpu0 = util::self_cpu();
    a1.tasks.spawn(a1.fulfiller.clone().run());
    a2.tasks.spawn(a2.fulfiller.clone().run());
    tokio::time::sleep(Duration::from_secs(2)).await;
    let idle_cpu = util::self_cpu() - idle_cpu0;
    let idle_spawned =
        a1.fulfiller.processes_spawned() + a2.fulfiller.processes_spawned() - spawned0;

    let mut r = Report::new("fulfill-cycle", json_out);
    let n = args.needs;
    r.line("needs", n, n);
    r.batches(args.one_by_one);
    r.line(
        "due_pass_cpu_ms",
        ms(due.pass_cpu),
        format!(
            "{:.3} ms CPU for the run_due() pass that starts {} requests",
            ms(due.pass_cpu),
            due.started
        ),
    );
    r.line(
        "due_cycle_cpu_ms",
        ms(due.cpu),
        format!(
            "{:.1} ms CPU (this process, until all {n} answered: sign, send, verify, flush)",
            ms(due.cpu)
        ),
    );
    let per = due.cpu.as_secs_f64() * 1e6 / n.max(1) as f64;
    r.line(
        "due_cycle_cpu_per_need_us",
        per.round(),
        format!("{per:.0} µs"),
    );
    r.line(
        "due_cycle_wall_ms",
        ms(due.wall),
        if args.one_by_one {
            format!(
                "{:.1} ms (one by one, per-provider concurrency {conc})",
                ms(due.wall)
            )
        } else {
            format!(
                "{:.1} ms (in batches of up to {MAX_BATCH_ITEMS}, 2 in flight)",
                ms(due.wall)
            )
        },
    );
    r.line(
        "due_accepted",
        due.accepted,
        format!("{}/{n} answered 202", due.accepted),
    );
    if let Some(e) = &due.first_error {
        r.line("due_first_error", e.clone(), e);
    }
    r.line(
        "due_state_writes",
        due_writes,
        format!("{due_writes} (fulfillment-state.json, during the cycle)"),
    );
    r.line("due_provider_entries", entries, entries);
    r.line(
        "due_provider_cpu_ms",
        ms(prov_cpu),
        format!(
            "{:.0} ms (provider, accepting them; 10 ms ticks)",
            ms(prov_cpu)
        ),
    );
    r.line("due_processes_spawned", due_spawned, due_spawned);
    r.line(
        "iterations",
        args.iterations,
        format!("{} run_due() calls per steady variant", args.iterations),
    );
    report_steady(&mut r, "steady_no_check", "all satisfied, no check", &s1);
    report_steady(
        &mut r,
        "steady_with_check",
        "all satisfied, each with a check timer pending",
        &s2,
    );
    r.line(
        "idle_loops_cpu_ms_over_2s",
        ms(idle_cpu),
        format!(
            "{:.1} ms CPU for this whole process over 2 s with both Fulfiller::run() loops idle",
            ms(idle_cpu)
        ),
    );
    r.line("idle_loops_processes_spawned", idle_spawned, idle_spawned);
    r.target(
        "steady cycle < 20 ms CPU",
        s1.cpu < Duration::from_millis(20) && s2.cpu < Duration::from_millis(20),
    );
    r.target(
        "0 processes without checks",
        due_spawned == 0 && s1.spawned == 0,
    );
    r.target(
        "all due requests accepted",
        due.accepted == n && due2.accepted == n,
    );
    r.finish();
    shutdown.cancel();
    drop(provider);
    Ok(())
}
