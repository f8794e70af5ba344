//! `fort-bench chaos`: a whole fleet under faults at random. At least 40 real agents on
//! one machine, running the shipped capabilities (chaos::layout), take seeded faults for
//! `--duration` (chaos::plan, carried out by chaos::inject) while the invariants are
//! checked the whole time (chaos::observe) and once the faults stop (chaos::finale);
//! then the figures: faults by kind, credentials served, the longest a need went
//! unsatisfied and why, moves, failed starts, every violation with what replays it,
//! and the agents' CPU and memory.

mod disk;
mod finale;
mod inject;
mod layout;
mod net;
mod observe;
mod plan;
mod procs;
mod report;
mod timeline;
pub mod token;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use fort_tests::Fleet;
use serde_json::Value;

use layout::{Layout, Timing, TomlOptions, Variant};
use plan::Kind;

#[derive(clap::Args, Debug)]
pub struct ChaosArgs {
    /// How long faults are injected (then the run settles and checks the end state).
    #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// The plan's seed (printed; the same seed, fleet and flags replay the same plan).
    #[arg(long)]
    seed: Option<u64>,
    /// Consumers whose needs name several providers (with the providers and the
    /// consumers that can be rolled back, the fleet's hosts).
    #[arg(long, default_value_t = 30)]
    consumers: usize,
    /// Consumers that can be rolled back to the previous release (their needs name one
    /// provider each, no state key).
    #[arg(long, default_value_t = 4)]
    rollback_hosts: usize,
    /// Providers of `ssh-ca`, each its own CA.
    #[arg(long, default_value_t = 3)]
    cas: usize,
    /// Fault kinds to inject (comma-separated; default: every kind): kill, hang,
    /// partition, one-way, slow-link, disk-full, clock, handler-kill, key-rotation,
    /// reload, rollback.
    #[arg(long, value_delimiter = ',')]
    faults: Option<Vec<String>>,
    /// A kind not to inject (repeatable).
    #[arg(long = "no-fault")]
    no_fault: Vec<String>,
    /// A kind's rate, faults per minute: `--rate kill=4` (repeatable).
    #[arg(long = "rate")]
    rates: Vec<String>,
    /// Faults holding at once, at most.
    #[arg(long, default_value_t = 6)]
    max_active: usize,
    /// Nag interval of every need.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    nag: Duration,
    /// failover_after of the needs naming several providers.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    failover_after: Duration,
    /// Lifetime of certificates and tokens (renewed at half-life).
    #[arg(long, default_value = "120s", value_parser = humantime::parse_duration)]
    lifetime: Duration,
    /// The providers' GC grace.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    gc_grace: Duration,
    /// The providers' GC interval.
    #[arg(long, default_value = "20s", value_parser = humantime::parse_duration)]
    gc_interval: Duration,
    /// Added to every deadline: what a busy machine may take beyond the protocol's times
    /// (handler runs, deliveries, polling).
    #[arg(long, default_value = "20s", value_parser = humantime::parse_duration)]
    slack: Duration,
    /// How often the invariants are checked.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    poll: Duration,
    /// Print every planned fault before the run.
    #[arg(long)]
    print_plan: bool,
    /// The fort-handler binary (default: next to fort-bench).
    #[arg(long)]
    handler_bin: Option<PathBuf>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[derive(Default)]
pub struct Stats {
    pub injected: BTreeMap<&'static str, u64>,
    pub failed_starts: u64,
    pub handler_runs_caught: u64,
    pub rotations: u64,
    pub ops: BTreeMap<String, u64>,
    /// Partitions checked with a connection across them: (whether it was refused) → count.
    pub partitions_seen: BTreeMap<bool, u64>,
}

/// Everything the run's tasks share.
pub struct World {
    pub layout: Layout,
    pub fleet: Fleet,
    pub procs: Mutex<procs::Procs>,
    pub timeline: Mutex<timeline::Timeline>,
    pub stats: Mutex<Stats>,
    variants: Mutex<BTreeMap<String, Variant>>,
    toml: Mutex<BTreeMap<String, TomlOptions>>,
    /// Each keyed host's state key file now.
    pub keys: Mutex<BTreeMap<String, PathBuf>>,
    pub net: Mutex<Option<net::Net>>,
    mounts: Mutex<Option<disk::Mounts>>,
    pub pg: Option<fort_tests::postgres::Postgres>,
    pub faketime: Option<PathBuf>,
    /// The previous release's agent.
    pub previous: Option<PathBuf>,
    pub agent_bin: PathBuf,
    pub log_level: String,
    pub slack: f64,
    pub stopping: AtomicBool,
}

impl World {
    /// The needs `consumer` declares now.
    pub fn declared(&self, consumer: &str) -> BTreeMap<String, Value> {
        let v = lock(&self.variants)
            .get(consumer)
            .copied()
            .unwrap_or_default();
        serde_json::from_value(Layout::needs_json(&self.fleet, consumer, v)).unwrap_or_default()
    }

    fn write_needs(&self, consumer: &str) {
        let v = lock(&self.variants)
            .get(consumer)
            .copied()
            .unwrap_or_default();
        let needs = Layout::needs_json(&self.fleet, consumer, v);
        let path = self.fleet.host_dir(consumer).join("needs.json");
        let tmp = path.with_extension("json.new");
        std::fs::write(&tmp, serde_json::to_vec_pretty(&needs).expect("json")).expect("needs");
        std::fs::rename(&tmp, &path).expect("needs.json");
    }

    /// Changes what `consumer` declares (a new round of `tok/api`, `tok/extra` released
    /// or declared again) and writes its needs.json; says what changed.
    pub fn change_needs(&self, consumer: &str, param: u64) -> String {
        let mut detail = Vec::new();
        {
            let mut vs = lock(&self.variants);
            let v = vs.entry(consumer.to_owned()).or_default();
            if param % 3 != 1 {
                v.round += 1;
                detail.push(format!("tok/api round {}", v.round));
            }
            if !param.is_multiple_of(3) {
                v.extra = !v.extra;
                detail.push(format!(
                    "tok/extra {}",
                    if v.extra { "declared" } else { "released" }
                ));
            }
        }
        self.write_needs(consumer);
        detail.join(", ")
    }

    /// Changes how `host`'s agent.toml is written, and writes it.
    pub fn set_toml(&self, host: &str, change: impl FnOnce(&mut TomlOptions)) {
        let mut all = lock(&self.toml);
        let o = all.entry(host.to_owned()).or_default();
        change(o);
        o.state_key = lock(&self.keys).get(host).cloned();
        let text = self.layout.agent_toml(&self.fleet, host, o);
        std::fs::write(self.fleet.config_path(host), text).expect("agent.toml");
    }
}

/// libfaketime, where Debian's `faketime` (or `$FORT_LIBFAKETIME`) put it.
fn find_faketime() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("FORT_LIBFAKETIME") {
        return Some(PathBuf::from(p));
    }
    [
        "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
        "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
        "/usr/lib/faketime/libfaketime.so.1",
        "/usr/local/lib/faketime/libfaketime.so.1",
    ]
    .iter()
    .map(PathBuf::from)
    .find(|p| p.exists())
}

/// Which kinds run, at which rate, and why the others cannot.
fn kinds(args: &ChaosArgs, skips: &BTreeMap<Kind, String>) -> Result<BTreeMap<Kind, f64>> {
    let mut chosen: Vec<Kind> = match &args.faults {
        None => Kind::ALL.to_vec(),
        Some(list) => list
            .iter()
            .filter(|s| !s.is_empty())
            .map(|s| Kind::parse(s).with_context(|| format!("no fault kind {s:?}")))
            .collect::<Result<_>>()?,
    };
    for s in &args.no_fault {
        let k = Kind::parse(s).with_context(|| format!("no fault kind {s:?}"))?;
        chosen.retain(|c| *c != k);
    }
    let mut rates: BTreeMap<Kind, f64> = chosen
        .into_iter()
        .filter(|k| !skips.contains_key(k))
        .map(|k| (k, k.default_rate()))
        .collect();
    for r in &args.rates {
        let (k, v) = r
            .split_once('=')
            .with_context(|| format!("--rate {r:?}: KIND=PER_MINUTE"))?;
        let k = Kind::parse(k).with_context(|| format!("no fault kind {k:?}"))?;
        let v: f64 = v.parse().with_context(|| format!("--rate {r:?}"))?;
        if let Some(rate) = rates.get_mut(&k) {
            *rate = v;
        }
    }
    Ok(rates)
}

pub async fn run(args: ChaosArgs, json_out: bool, log_level: String) -> Result<()> {
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64 % 1_000_000_007)
    });
    eprintln!("fort-bench chaos: seed {seed} (the same seed and flags replay the same plan: --seed {seed})");
    let timing = Timing {
        nag: args.nag.as_secs().max(1),
        failover_after: args.failover_after.as_secs().max(1),
        lifetime: args.lifetime.as_secs().max(60),
        gc_grace: args.gc_grace.as_secs(),
        gc_interval: args.gc_interval.as_secs().max(1),
    };
    let agent_bin = util::agent_bin()?;
    let handler = util::handler_bin(args.handler_bin.clone())?;
    let token_handler = std::env::current_exe().context("fort-bench's own path")?;
    // What this machine allows; each kind that cannot run says why.
    let mut skips: BTreeMap<Kind, String> = BTreeMap::new();
    let network = net::unavailable();
    if let Some(why) = &network {
        for k in [Kind::Partition, Kind::OneWay, Kind::Slow] {
            skips.insert(k, why.clone());
        }
    }
    if let Some(why) = disk::unavailable() {
        skips.insert(Kind::DiskFull, why);
    }
    let faketime = find_faketime();
    if faketime.is_none() {
        skips.insert(
            Kind::Clock,
            "libfaketime is not installed (Debian: faketime; or set FORT_LIBFAKETIME)".into(),
        );
    }
    let previous = match fort_tests::releases::previous() {
        Ok(r) => Some(r.agent()),
        Err(why) => {
            skips.insert(Kind::Rollback, why);
            None
        }
    };
    let pg = match fort_tests::postgres::Postgres::start(false) {
        Ok(pg) => Some(pg),
        Err(why) => {
            eprintln!("fort-bench chaos: SKIP the shared backend (postgres): {why}");
            None
        }
    };
    let layout = Layout::new(
        args.consumers,
        args.rollback_hosts,
        args.cas,
        pg.is_some(),
        timing,
    );
    let rates = kinds(&args, &skips)?;
    let plan = plan::make(seed, &layout, &rates, args.duration, args.max_active);
    eprintln!(
        "fort-bench chaos: {} hosts, {} faults planned over {:?} (plan {}), {} operator calls",
        layout.hosts().len(),
        plan.events.len(),
        args.duration,
        plan::fingerprint(&plan),
        plan.ops.len()
    );
    if args.print_plan {
        for e in &plan.events {
            eprintln!(
                "  {:>6.1}s {:<12} {:<14} hold {:?}",
                e.at.as_secs_f64(),
                e.kind.name(),
                e.hosts.join("↔"),
                e.hold
            );
        }
    }

    let mut fleet = util::new_fleet();
    let hosts = layout.hosts();
    let net = match &network {
        None => Some(net::Net::setup(&hosts).map_err(anyhow::Error::msg)?),
        Some(_) => None,
    };
    for h in &hosts {
        let spec = fleet.host(h);
        if let Some(n) = &net {
            spec.addr = SocketAddr::new(n.ip(h).into(), 7770);
        }
    }
    let pg_at = pg.as_ref().map(|p| (p.socket_dir(), p.port));
    layout.declare(
        &mut fleet,
        &handler,
        &token_handler,
        pg_at.as_ref().map(|(d, p)| (d.as_path(), *p)),
    );
    fleet.write_files();
    let mounts = if skips.contains_key(&Kind::DiskFull) {
        None
    } else {
        Some(
            disk::Mounts::over(
                hosts
                    .iter()
                    .map(|h| fleet.host_dir(h).join("state"))
                    .collect(),
            )
            .map_err(anyhow::Error::msg)?,
        )
    };
    let mut keys = BTreeMap::new();
    for h in &hosts {
        let keyed = layout.is_provider(h) || layout.consumer(h).is_some_and(|c| c.keyed);
        if keyed {
            let path = fleet.dir.path().join(format!("{h}-key"));
            let made = std::process::Command::new(&agent_bin)
                .args(["state-key", "new"])
                .arg(&path)
                .output()?;
            if !made.status.success() {
                bail!("state-key new: {made:?}");
            }
            keys.insert(h.clone(), path);
        }
    }
    let mut procs = procs::Procs::new(agent_bin.clone());
    for h in &hosts {
        procs.add(
            h,
            fleet.host_dir(h),
            fleet.hosts[h].addr,
            net.as_ref().map(|n| n.netns_path(h)),
        );
    }
    let world = Arc::new(World {
        layout,
        fleet,
        procs: Mutex::new(procs),
        timeline: Mutex::new(timeline::Timeline {
            seed,
            ..Default::default()
        }),
        stats: Mutex::new(Stats::default()),
        variants: Mutex::new(BTreeMap::new()),
        toml: Mutex::new(BTreeMap::new()),
        keys: Mutex::new(keys),
        net: Mutex::new(net),
        mounts: Mutex::new(mounts),
        pg,
        faketime,
        previous,
        agent_bin,
        log_level,
        slack: args.slack.as_secs_f64(),
        stopping: AtomicBool::new(false),
    });
    let outcome = run_fleet(&world, &args, plan, &skips, &rates, json_out).await;
    // Whatever happened: every agent, namespace, mount and server goes. With --keep, a
    // copy of each state directory stays (its tmpfs goes).
    lock(&world.procs).kill_all();
    lock(&world.net).take();
    if util::keeping() && lock(&world.mounts).is_some() {
        for h in world.layout.hosts() {
            let d = world.fleet.host_dir(&h);
            let _ = std::process::Command::new("cp")
                .arg("-a")
                .arg(d.join("state"))
                .arg(d.join("state-kept"))
                .status();
        }
    }
    lock(&world.mounts).take();
    outcome
}

async fn run_fleet(
    w: &Arc<World>,
    args: &ChaosArgs,
    plan: plan::Plan,
    skips: &BTreeMap<Kind, String>,
    rates: &BTreeMap<Kind, f64>,
    json_out: bool,
) -> Result<()> {
    let hosts = w.layout.hosts();
    for h in &hosts {
        w.set_toml(h, |_| {});
    }
    for c in &w.layout.consumers {
        w.write_needs(&c.name);
    }
    lock(&w.timeline).t0 = timeline::now();
    let start_id = lock(&w.timeline).begin("start", &hosts, false, String::new());
    let mut starting = Vec::new();
    for h in &hosts {
        let (w, h) = (w.clone(), h.clone());
        starting.push(tokio::spawn(async move { inject::start(&w, &h).await }));
        // Providers first, a moment apart: a fleet's hosts do not all boot at once.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for s in starting {
        s.await?;
    }
    let started = std::time::Instant::now();
    let mut obs = observe::Observer::default();
    let converge_limit = Duration::from_secs(240);
    loop {
        obs = poll(w, obs).await;
        if obs.polls > 1 && obs.bad_now().is_empty() {
            break;
        }
        if started.elapsed() > converge_limit {
            lock(&w.timeline).violate(
                "the fleet converges",
                &[],
                None,
                format!(
                    "not every need satisfied {converge_limit:?} after the start: {:?}",
                    obs.bad_now()
                ),
            );
            break;
        }
        tokio::time::sleep(args.poll).await;
    }
    let converged = started.elapsed();
    lock(&w.timeline).end(start_id);
    eprintln!("fort-bench chaos: converged in {converged:?}; faults begin");

    // The fault phase: the plan's faults and the operators' calls at their times, the
    // checks all along.
    let t0 = tokio::time::Instant::now();
    let ops = tokio::spawn(inject::operators(w.clone(), plan.ops.clone(), t0));
    let observing = Arc::new(AtomicBool::new(true));
    let observer = {
        let (w, on, every) = (w.clone(), observing.clone(), args.poll);
        tokio::spawn(async move {
            let mut obs = obs;
            while on.load(Ordering::Relaxed) {
                obs = poll(&w, obs).await;
                tokio::time::sleep(every).await;
            }
            obs
        })
    };
    let mut faults = Vec::new();
    for e in plan.events.iter().cloned() {
        tokio::time::sleep_until(t0 + e.at).await;
        faults.push(tokio::spawn(inject::fault(w.clone(), e)));
    }
    tokio::time::sleep_until(t0 + args.duration).await;
    for f in faults {
        f.await?;
    }
    let fault_phase = t0.elapsed();
    observing.store(false, Ordering::Relaxed);
    let mut obs = observer.await?;
    eprintln!("fort-bench chaos: faults over after {fault_phase:?}; settling");
    let settled = finale::settle(w, &mut obs).await;
    w.stopping.store(true, Ordering::Relaxed);
    ops.abort();
    obs.close(w);
    // The trails and the disks, with every agent stopped as systemd stops it.
    let mut stopping = Vec::new();
    for h in &hosts {
        let (w, h) = (w.clone(), h.clone());
        stopping.push(tokio::spawn(async move { inject::stop(&w, &h).await }));
    }
    for s in stopping {
        s.await?;
    }
    let (verified, witnessed) = {
        let w = w.clone();
        let passwords = obs.passwords.clone();
        tokio::task::spawn_blocking(move || finale::trails_and_secrets(&w, &passwords)).await?
    };
    let violations = lock(&w.timeline).violations.len();
    report::print(
        w,
        &report::Run {
            plan: &plan,
            skips,
            rates,
            obs: &obs,
            converged,
            fault_phase,
            settled,
            trails: (verified, witnessed),
            max_active: args.max_active,
        },
        json_out,
    );
    if violations > 0 {
        bail!(
            "{violations} invariant violations (seed {})",
            lock(&w.timeline).seed
        );
    }
    Ok(())
}

/// One look at the fleet, off the runtime's threads; agents that died are restarted.
async fn poll(w: &Arc<World>, mut obs: observe::Observer) -> observe::Observer {
    let wb = w.clone();
    let (obs, crashed) = tokio::task::spawn_blocking(move || {
        let crashed = obs.poll(&wb);
        (obs, crashed)
    })
    .await
    .expect("poll");
    for (h, why) in crashed {
        tokio::spawn(inject::restart_crashed(w.clone(), h, why));
    }
    obs
}

use crate::util;
