//! `fort-bench acme`: the acme handler (`fort-handler acme`) against Debian's pebble, which
//! is started with `PEBBLE_VA_ALWAYS_VALID=1` (every challenge is taken as valid without a
//! connection, so neither client spends time on validation; both still publish their
//! HTTP-01 answers in a webroot). N certificates are issued three ways against the same
//! pebble: the handler run as the agent runs it, for CSRs made before the clock starts
//! (the same input, again after each `$fort_rerun_after`, until every entry holds a
//! certificate); real agents (consumers whose needs make their keys and CSRs, one
//! provider running the handler); and what NixOS's `security.acme` runs instead, `lego
//! run` once per certificate with one account. Then runs over M unchanged entries (the
//! issued ones, replicated in the handler's state) with pebble stopped, so no call to the
//! CA can have happened.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use fort_handlers::acme::state::{EntryState, State, STATE_VERSION};
use fort_handlers::common::entries::payload_sha256;
use fort_handlers::common::state::StateFile;
use fort_tests::pebble::Pebble;
use serde_json::{json, Map, Value};

use crate::util::{self, ms, AgentProc, Report};

#[derive(clap::Args, Debug)]
pub struct AcmeArgs {
    /// Certificates issued by each client (the handler, the agents, lego).
    #[arg(long, default_value_t = 200)]
    count: usize,
    /// Entries in the run where nothing changed (the issued ones, replicated in the
    /// handler's state under new keys).
    #[arg(long, default_value_t = 10_000)]
    unchanged: usize,
    /// Runs over the unchanged entries (the median and the slowest are reported).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Consumer agents the needs are spread over (one provider agent answers them all).
    #[arg(long, default_value_t = 4)]
    consumers: usize,
    /// Leave out the issuance through agents.
    #[arg(long)]
    no_agents: bool,
    /// Leave out the `lego run` comparison.
    #[arg(long)]
    no_lego: bool,
    /// The lego binary. Default: `lego` on the PATH.
    #[arg(long)]
    lego: Option<PathBuf>,
    /// Give up on one issuance after this long.
    #[arg(long, default_value = "600s", value_parser = humantime::parse_duration)]
    timeout: Duration,
    /// The fort-handler binary. Default: $FORT_BIN_FORT_HANDLER, else next to fort-bench.
    #[arg(long)]
    handler_bin: Option<PathBuf>,
}

const CAP: &str = "ssl-cert";

/// One certificate to get: who asks, the entry's id, the CSR (PEM) for one name.
struct Wanted {
    origin: String,
    id: String,
    csr: String,
}

impl Wanted {
    fn key(&self) -> String {
        format!("{}:{CAP}/{}", self.origin, self.id)
    }
}

fn wanted(prefix: &str, count: usize, consumers: usize) -> Result<Vec<Wanted>> {
    (0..count)
        .map(|i| {
            let name = format!("{prefix}{i:05}.example.test");
            let key = rcgen::KeyPair::generate()?;
            let csr = rcgen::CertificateParams::new(vec![name.clone()])?
                .serialize_request(&key)?
                .pem()?;
            Ok(Wanted {
                origin: format!("c{:03}", i % consumers.max(1)),
                id: format!("{prefix}{i:05}"),
                csr,
            })
        })
        .collect()
}

/// The bounds the handler keeps on what it asks a CA for (docs/handlers.md, acme), set
/// to what a run of `count` certificates over `consumers` callers needs: the defaults (20
/// per caller a week) hold a caller's 21st certificate for a week, which a benchmark
/// issuing 50 per caller would wait out. Said in the report.
struct Bounds {
    per_week: u32,
    per_caller_per_week: u32,
    orders_per_caller_per_hour: u32,
}

impl Bounds {
    fn for_run(count: usize, consumers: usize) -> Bounds {
        // Both issuances (the handler, the agents) and room to spare.
        let per_caller = count.div_ceil(consumers.max(1)).saturating_mul(4);
        let clamp = |n: usize| u32::try_from(n.max(1)).unwrap_or(u32::MAX);
        Bounds {
            per_week: clamp(count.saturating_mul(4)),
            per_caller_per_week: clamp(per_caller),
            orders_per_caller_per_hour: clamp(per_caller),
        }
    }

    fn note(&self) -> String {
        format!(
            "the handler's bounds are raised for the run: {} certificates a week, {} per caller a week, {} orders per caller an hour (defaults: 300, 20 and 10)",
            self.per_week, self.per_caller_per_week, self.orders_per_caller_per_hour
        )
    }
}

/// The handler's config: HTTP-01 into a webroot nothing serves (pebble does not look).
fn write_config(path: &Path, pebble: &Pebble, dir: &Path, bounds: &Bounds) -> Result<PathBuf> {
    let state = dir.join("acme-state.json");
    std::fs::write(
        path,
        json!({
            "directory": pebble.directory,
            "ca_root": pebble.tls_root,
            "allow": {"*": ["*.example.test"]},
            "http01": {"webroot": dir.join("www")},
            "rerun_seconds": 1,
            "max_certificates_per_week": bounds.per_week,
            "max_certificates_per_caller_per_week": bounds.per_caller_per_week,
            "max_orders_per_caller_per_hour": bounds.orders_per_caller_per_hour,
            "state": state,
        })
        .to_string(),
    )?;
    Ok(state)
}

/// One `fort-handler acme` run with the input the agent would give it.
fn run_handler(bin: &Path, config: &Path, input: &Value) -> Result<(Duration, Value)> {
    let bytes = serde_json::to_vec(input)?;
    let mut cmd = Command::new(bin);
    cmd.args(["acme", "--config"])
        .arg(config)
        .env_clear()
        .env("FORT_TRIGGER", "request")
        .env("FORT_HOST", "ca")
        .env("FORT_CAPABILITY", CAP)
        .env("FORT_HANDLER_LOG", "warn");
    let (wall, out) = util::run_handler_once(&mut cmd, bytes, "fort-handler acme")?;
    Ok((wall, serde_json::from_slice(&out.stdout)?))
}

struct Issuance {
    wall: Duration,
    /// CPU of the handler processes (and, through agents, of the provider agent).
    cpu: Duration,
    pebble_cpu: Duration,
    runs: u64,
    /// Time inside handler runs (the rest is waiting for `$fort_rerun_after`).
    busy: Duration,
    issued: usize,
}

fn pebble_cpu(pebble: &Pebble) -> Duration {
    pebble.pid().and_then(util::proc_cpu).unwrap_or_default()
}

/// The handler driven directly: every entry each run (its request only: the capability
/// has no `cacheResponse`, its handler answers from its own state), again after
/// `$fort_rerun_after`.
async fn issue_direct(
    bin: &Path,
    config: &Path,
    pebble: &Pebble,
    want: &[Wanted],
    timeout: Duration,
) -> Result<(Issuance, BTreeMap<String, Value>)> {
    let mut responses: BTreeMap<String, Value> =
        want.iter().map(|w| (w.key(), Value::Null)).collect();
    let (cpu0, pebble0) = (util::children_cpu(), pebble_cpu(pebble));
    let t0 = Instant::now();
    let (mut runs, mut busy) = (0u64, Duration::ZERO);
    loop {
        let input: Map<String, Value> = want
            .iter()
            .map(|w| {
                (
                    w.key(),
                    json!({"request": {"csr": w.csr}, "response": null}),
                )
            })
            .collect();
        let (wall, out) = run_handler(bin, config, &Value::Object(input))?;
        runs += 1;
        busy += wall;
        for (key, response) in responses.iter_mut() {
            match out.get(key) {
                Some(v) if v.get("certificate").is_some() => *response = v.clone(),
                Some(v) if v.get("$fort_refused").is_some() => bail!("{key} refused: {v}"),
                _ => {}
            }
        }
        if responses.values().all(|v| !v.is_null()) {
            break;
        }
        let after = Duration::from_secs(
            out["$fort_rerun_after"]
                .as_u64()
                .unwrap_or(1)
                .clamp(1, 3600),
        );
        // The timeout holds while it waits: a rerun asked for past it is a failure now.
        if t0.elapsed() + after > timeout {
            let held: Vec<&String> = responses
                .iter()
                .filter(|(_, v)| v.is_null())
                .map(|(k, _)| k)
                .take(3)
                .collect();
            bail!(
                "not every certificate issued within {timeout:?} ({runs} runs; the handler asks to run again in {after:?}; not yet issued: {held:?}, …)"
            );
        }
        tokio::time::sleep(after).await;
    }
    let issuance = Issuance {
        wall: t0.elapsed(),
        cpu: util::children_cpu().saturating_sub(cpu0),
        pebble_cpu: pebble_cpu(pebble).saturating_sub(pebble0),
        runs,
        busy,
        issued: responses.len(),
    };
    Ok((issuance, responses))
}

/// Consumers with empty needs and the provider are started; then every consumer gets its
/// needs and a SIGHUP at once, and the clock runs until every need is satisfied.
async fn issue_agents(
    bin: &Path,
    pebble: &Pebble,
    want: &[Wanted],
    consumers: usize,
    timeout: Duration,
    bounds: &Bounds,
) -> Result<Issuance> {
    let mut fleet = util::new_fleet();
    let config = fleet.dir.path().join("acme.json");
    write_config(&config, pebble, fleet.dir.path(), bounds)?;
    fleet.host("ca");
    fleet.capability(
        "ca",
        CAP,
        json!({"handler": bin, "args": ["acme", "--config", config],
               "mode": "async"}),
    );
    // A request lost under load is sent again after `nag_seconds`, within the run.
    // Each consumer makes its key and CSR itself (`$fort_key`, as lego makes its key),
    // and installs the key with the certificate where a web server would read them.
    let delivered = fleet.dir.path().join("delivered");
    for w in want {
        let file = delivered.join(&w.origin).join(format!("{}.pem", w.id));
        let key = delivered.join(&w.origin).join(format!("{}.key", w.id));
        fleet.need(
            &w.origin,
            &format!("{CAP}/{}", w.id),
            "ca",
            json!({"request": {"csr": {"$fort_key": "tls", "as": "csr"}}, "nag_seconds": 10,
                   "keys": {"tls": {"type": "ecdsa-p256", "path": key, "mode": "0600",
                                    "names": [format!("{}.example.test", w.id)]}},
                   "files": [{"path": file, "pointer": "/fullchain", "mode": "0644"}]}),
        );
    }
    fleet.write_files();
    let names: Vec<String> = (0..consumers.max(1).min(want.len().max(1)))
        .map(|i| format!("c{i:03}"))
        .collect();
    for c in &names {
        std::fs::write(fleet.host_dir(c).join("needs.json"), "{}")?;
    }
    let mut provider = vec![AgentProc::spawn(&fleet, "ca")?];
    util::wait_listening(&mut provider, Duration::from_secs(20))?;
    let provider = provider.pop().expect("one");
    let mut agents = Vec::new();
    for c in &names {
        agents.push(AgentProc::spawn(&fleet, c)?);
    }
    util::wait_listening(&mut agents, Duration::from_secs(60))?;
    // The SIGHUP handler is installed just after the admin socket answers.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let runs0 = util::provider_counts(&util::status(&provider.socket())?, CAP).2;
    let (cpu0, pebble0) = (
        util::proc_cpu_with_children(provider.pid()).unwrap_or_default(),
        pebble_cpu(pebble),
    );
    for c in &names {
        let needs = serde_json::to_vec_pretty(&fleet.hosts[c].needs)?;
        std::fs::write(fleet.host_dir(c).join("needs.json"), needs)?;
    }
    let t0 = Instant::now();
    for a in &agents {
        a.hup();
    }
    let mut done = vec![false; agents.len()];
    loop {
        for (i, a) in agents.iter().enumerate() {
            if !done[i] {
                let n = fleet.hosts[&a.name].needs.len() as u64;
                done[i] = util::needs_satisfied(&a.socket()) == Some((n, n));
            }
        }
        if done.iter().all(|d| *d) {
            break;
        }
        if t0.elapsed() > timeout {
            let satisfied: Vec<String> = agents
                .iter()
                .map(|a| format!("{}: {:?}", a.name, util::needs_satisfied(&a.socket())))
                .collect();
            bail!(
                "agents: not every need satisfied after {timeout:?} ((needs, satisfied) per consumer: {}; --keep keeps {})",
                satisfied.join(", "),
                fleet.dir.path().display()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let wall = t0.elapsed();
    let cpu = util::proc_cpu_with_children(provider.pid())
        .unwrap_or_default()
        .saturating_sub(cpu0);
    let pebble_cpu = pebble_cpu(pebble).saturating_sub(pebble0);
    let runs = util::provider_counts(&util::status(&provider.socket())?, CAP).2 - runs0;
    let issued = want
        .iter()
        .filter(|w| {
            let file = delivered.join(&w.origin).join(format!("{}.pem", w.id));
            let key = delivered.join(&w.origin).join(format!("{}.key", w.id));
            std::fs::read_to_string(file).is_ok_and(|t| t.contains("BEGIN CERTIFICATE"))
                && key.is_file()
        })
        .count();
    Ok(Issuance {
        wall,
        cpu,
        pebble_cpu,
        runs,
        busy: Duration::ZERO,
        issued,
    })
}

/// `lego run` once per certificate, as `security.acme` runs it: one account (`--path`
/// shared, so the first run registers it), a new EC P-256 key per certificate, HTTP-01
/// answers written to a webroot.
fn issue_lego(lego: &Path, pebble: &Pebble, dir: &Path, count: usize) -> Result<Issuance> {
    let path = dir.join("lego");
    let webroot = dir.join("lego-www");
    std::fs::create_dir_all(&webroot)?;
    let (cpu0, pebble0) = (util::children_cpu(), pebble_cpu(pebble));
    let t0 = Instant::now();
    let mut issued = 0;
    for i in 0..count {
        let name = format!("l{i:05}.example.test");
        let out = Command::new(lego)
            .env_clear()
            .env("LEGO_CA_CERTIFICATES", &pebble.tls_root)
            .args(["--server", &pebble.directory])
            .args([
                "--email",
                "x@example.test",
                "--accept-tos",
                "--key-type",
                "ec256",
            ])
            .arg("--path")
            .arg(&path)
            .args(["--domains", &name, "--http", "--http.webroot"])
            .arg(&webroot)
            .arg("run")
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("start {}", lego.display()))?;
        if !out.status.success() {
            bail!(
                "lego run for {name}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        issued += usize::from(path.join(format!("certificates/{name}.crt")).is_file());
    }
    Ok(Issuance {
        wall: t0.elapsed(),
        cpu: util::children_cpu().saturating_sub(cpu0),
        pebble_cpu: pebble_cpu(pebble).saturating_sub(pebble0),
        runs: count as u64,
        busy: Duration::ZERO,
        issued,
    })
}

fn find_lego(explicit: Option<PathBuf>) -> Option<PathBuf> {
    explicit.or_else(|| fort_tests::dns::find_program("lego"))
}

fn report_issuance(r: &mut Report, what: &str, label: &str, i: &Issuance, count: usize) {
    let per = |d: Duration| ms(d) / i.issued.max(1) as f64;
    r.line(
        &format!("{what}_wall_s"),
        i.wall.as_secs_f64(),
        format!(
            "{:.2} s for {} of {count} certificates ({label}; {:.1} ms each)",
            i.wall.as_secs_f64(),
            i.issued,
            per(i.wall)
        ),
    );
    r.line(
        &format!("{what}_cpu_ms_per_cert"),
        per(i.cpu),
        format!(
            "{:.2} ms client CPU per certificate ({:.0} ms in all, user+sys); pebble {:.2} ms per certificate",
            per(i.cpu),
            ms(i.cpu),
            per(i.pebble_cpu)
        ),
    );
}

pub async fn run(args: AcmeArgs, json_out: bool) -> Result<()> {
    let bin = util::handler_bin(args.handler_bin.clone())?;
    let lego = if args.no_lego {
        None
    } else {
        Some(find_lego(args.lego.clone()).ok_or_else(|| {
            anyhow!("no lego on the PATH (apt-get install lego, or --lego PATH, or --no-lego)")
        })?)
    };
    let mut pebble = Pebble::start_always_valid().map_err(|e| anyhow!("no pebble: {e}"))?;
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("acme.json");
    let bounds = Bounds::for_run(args.count.max(1), args.consumers);
    let state_path = write_config(&config, &pebble, dir.path(), &bounds)?;
    let mut r = Report::new("acme", json_out);
    r.note(&bounds.note());
    r.note("pebble runs with PEBBLE_VA_ALWAYS_VALID=1: every challenge is valid without a connection, so no client spends time on validation");
    r.note(&format!(
        "{} cores; other processes (builds) may run at the same time: see loadavg",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    ));
    let count = args.count.max(1);

    // 1. The handler driven directly, as an agent runs it.
    let want = wanted("n", count, args.consumers)?;
    let (direct, responses) = issue_direct(&bin, &config, &pebble, &want, args.timeout).await?;
    report_issuance(
        &mut r,
        "handler",
        "fort-handler acme run directly, again after each $fort_rerun_after",
        &direct,
        count,
    );
    r.line(
        "handler_runs",
        direct.runs,
        format!(
            "{} runs, {:.2} s inside them, the rest waiting for $fort_rerun_after (1 s)",
            direct.runs,
            direct.busy.as_secs_f64()
        ),
    );

    // 2. Through agents: the same handler run by a provider agent for consumers' needs.
    let agents = if args.no_agents {
        r.note("issuance through agents left out (--no-agents)");
        None
    } else {
        let want = wanted("a", count, args.consumers)?;
        let a = issue_agents(&bin, &pebble, &want, args.consumers, args.timeout, &bounds).await?;
        report_issuance(
            &mut r,
            "agents",
            &format!(
                "{} consumer agents make keys and CSRs → provider agent → signed callbacks → key and certificate installed, until every need is satisfied",
                args.consumers.clamp(1, count)
            ),
            &a,
            count,
        );
        r.line(
            "agents_handler_runs",
            a.runs,
            format!(
                "{} handler runs by the provider agent (its own CPU included above)",
                a.runs
            ),
        );
        Some(a)
    };

    // 3. What security.acme runs: lego once per certificate.
    if let Some(lego) = &lego {
        let l = issue_lego(lego, &pebble, dir.path(), count)?;
        report_issuance(
            &mut r,
            "lego",
            "`lego run` once per certificate, one account, as security.acme",
            &l,
            count,
        );
        let ratio = |i: &Issuance| l.wall.as_secs_f64() / i.wall.as_secs_f64().max(1e-9);
        r.line(
            "lego_over_handler",
            ratio(&direct),
            format!("{:.1}× (lego wall / handler wall)", ratio(&direct)),
        );
        r.target("handler ≥ 10× faster than lego", ratio(&direct) >= 10.0);
        if let Some(a) = &agents {
            r.line(
                "lego_over_agents",
                ratio(a),
                format!("{:.1}× (lego wall / through-agents wall)", ratio(a)),
            );
            r.target("agents ≥ 10× faster than lego", ratio(a) >= 10.0);
        }
        r.target("lego issued every certificate", l.issued == count);
    } else {
        r.note("the lego comparison left out (--no-lego)");
    }
    r.target("handler issued every certificate", direct.issued == count);
    if let Some(a) = &agents {
        r.target("agents got every certificate", a.issued == count);
    }

    // 4. Unchanged entries: the issued ones plus copies of their records under new keys
    //    (as the handler writes them), each with its certificate; pebble stopped.
    let file = StateFile::new(&state_path);
    let mut state: State = file.load(STATE_VERSION)?;
    let mut input = Map::new();
    let mut expected = Map::new();
    for j in 0..args.unchanged.max(count) {
        let w = &want[j % count];
        let key = if j < count {
            w.key()
        } else {
            format!("c{:03}:{CAP}/u{j:05}", j % args.consumers.max(1))
        };
        let issued = state
            .entries
            .get(&w.key())
            .and_then(|e| e.issued.clone())
            .ok_or_else(|| anyhow!("{} has no certificate in the state", w.key()))?;
        state.entries.insert(
            key.clone(),
            EntryState {
                issued: Some(issued),
                ..EntryState::default()
            },
        );
        // As an agent holding the certificate sends it (protocol §11.11): the hash of the
        // response, which the handler keeps instead of printing it again.
        let held = payload_sha256(&responses[&w.key()]);
        expected.insert(key.clone(), json!({"$fort_keep": held}));
        input.insert(
            key,
            json!({"request": {"csr": w.csr}, "response": null, "held": held}),
        );
    }
    file.save(STATE_VERSION, &state)?;
    let before = std::fs::read(&state_path)?;
    let input = Value::Object(input);
    pebble.stop();
    let mut walls = Vec::new();
    let mut same = true;
    let mut answer_bytes = 0;
    for _ in 0..args.runs.max(1) {
        let (wall, out) = run_handler(&bin, &config, &input)?;
        answer_bytes = out.to_string().len();
        same &= out.get("$fort_rerun_after").is_none()
            && expected.iter().all(|(k, v)| out.get(k) == Some(v));
        walls.push(wall);
    }
    let untouched = std::fs::read(&state_path)? == before;
    util::unchanged_summary(
        &mut r,
        &walls,
        input.as_object().map_or(0, Map::len),
        &state_path,
    );
    walls.sort();
    let (median, slowest) = (walls[walls.len() / 2], walls[walls.len() - 1]);
    let n = input.as_object().map_or(0, Map::len);
    r.line(
        "unchanged_entries",
        n,
        format!("{n} entries ({count} issued, the rest their records copied under new keys)",),
    );
    // Every entry's request and the hash of the certificate it holds come in; the
    // certificates are read from the state and kept, not printed again.
    let mib = |bytes: usize| bytes as f64 / (1024.0 * 1024.0);
    let input_bytes = input.to_string().len();
    r.line(
        "unchanged_mib_in_state_out",
        json!([mib(input_bytes), mib(before.len()), mib(answer_bytes)]),
        format!(
            "{:.1} MiB of input, {:.1} MiB of state, {:.1} MiB of output ({:.1} KiB per entry in)",
            mib(input_bytes),
            mib(before.len()),
            mib(answer_bytes),
            input_bytes as f64 / 1024.0 / n.max(1) as f64
        ),
    );
    r.line(
        "unchanged_run_ms_median_max",
        json!([ms(median), ms(slowest)]),
        format!(
            "{:.1} / {:.1} ms per run over {} runs (whole process: start, parse, state, answer), pebble stopped",
            ms(median),
            ms(slowest),
            walls.len()
        ),
    );
    r.target("unchanged entries median < 200 ms", ms(median) < 200.0);
    r.target(
        "answered without the CA, state untouched",
        same && untouched,
    );
    r.finish();
    drop(pebble);
    Ok(())
}
