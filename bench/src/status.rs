//! Signed `status` calls from this process at one agent over N keep-alive TLS
//! connections; every response signature is verified before it counts. Optionally the
//! same load against a plain-HTTP agent in the same run (the price of TLS as a ratio),
//! and a phase of fresh connections that measures full TLS handshakes per second.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use fort_core::client::{ClientOptions, SignedClient, Target};
use fort_core::schema::Registry;
use fort_core::sign::{verify, Signer};
use serde_json::json;
use ssh_key::PublicKey;
use tokio::time::Instant;

use crate::paired::{self, Side};
use crate::util::{self, ms, percentile, AgentProc, Report};

#[derive(clap::Args, Debug)]
pub struct StatusArgs {
    /// Concurrent connections; each is a worker loop with its own keep-alive client.
    #[arg(long, default_value_t = 32)]
    connections: usize,
    /// Measured time.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Unmeasured time before it (connections open, caches warm).
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    warmup: Duration,
    /// One pooled SignedClient shared by every worker instead of one per connection.
    #[arg(long)]
    shared_client: bool,
    /// Needs the started agent declares (its status document lists each of them).
    #[arg(long, default_value_t = 0)]
    agent_needs: usize,
    /// Extra TOML for the started agent's config (e.g. `nonce_capacity = 50000`).
    #[arg(long, default_value = "")]
    agent_toml: String,
    /// Base URL of a running agent instead of starting one.
    #[arg(long, requires_all = ["host", "key", "origin"])]
    target: Option<String>,
    /// The target's name in hosts.json (the signed target line).
    #[arg(long)]
    host: Option<String>,
    /// Private key to sign with (OpenSSH ed25519).
    #[arg(long)]
    key: Option<PathBuf>,
    /// The host or principal name the key belongs to.
    #[arg(long)]
    origin: Option<String>,
    /// hosts.json with the target's public keys, to verify its responses.
    #[arg(long, default_value = "/etc/fort/hosts.json")]
    hosts: PathBuf,
    /// The target agent's pid, to report its CPU use (with --target).
    #[arg(long)]
    pid: Option<u32>,
    /// Also run the same load against a second agent serving plain HTTP (`plaintext =
    /// true`), and report TLS throughput as a ratio of it.
    #[arg(long)]
    compare_plaintext: bool,
    /// Ask for the status with entries (an operator call, which the audit trail records)
    /// and run the same load against a second agent whose trail is off; report the
    /// cost of the trail as a ratio (same run). The started agents let `bench` see
    /// entries (`[access] trigger`), so --agent-toml must not have an `[access]` table.
    #[arg(long)]
    compare_audit: bool,
    /// Rounds of --compare-audit: each measures the agent with its trail and the one
    /// without, in alternating order.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Length of the handshake phase: fresh connections, each a full TLS 1.3 handshake
    /// and one signed request; `0s` skips it.
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    handshake_duration: Duration,
    /// Connections opened at once in the handshake phase.
    #[arg(long, default_value_t = 8)]
    handshake_concurrency: usize,
    /// Measure again while N strangers hold connections with headers naming the agent's
    /// own host, a signature from another key and a body that never comes; report the
    /// throughput as a ratio of the measurement without them.
    #[arg(long, default_value_t = 0)]
    stall: usize,
    /// Stalled connections per attacking address (127.77.x.y).
    #[arg(long, default_value_t = 50)]
    stall_per_address: usize,
}

#[derive(Default)]
struct WorkerOut {
    latencies_us: Vec<u32>,
    ok: u64,
    errors: BTreeMap<String, u64>,
    first_error: Option<String>,
}

struct Endpoint {
    host: String,
    address: String,
    keys: Vec<PublicKey>,
    /// The status request's body.
    body: &'static [u8],
}

/// The body of a status call that shows the provider's entries, which the audit trail
/// records as an operator call.
const WITH_ENTRIES: &[u8] = br#"{"entries":true}"#;

async fn worker(
    client: SignedClient,
    ep: Arc<Endpoint>,
    measure_from: Instant,
    end: Instant,
) -> WorkerOut {
    let target = Target {
        name: &ep.host,
        address: &ep.address,
        keys: &ep.keys,
    };
    let mut out = WorkerOut::default();
    // Bounded by time; the cap on recorded samples only bounds memory.
    while Instant::now() < end && out.latencies_us.len() < 20_000_000 {
        let t = Instant::now();
        let r = client
            .post(&target, "/agent/capabilities/status", ep.body.to_vec())
            .await;
        let took = t.elapsed();
        if t < measure_from {
            continue;
        }
        let error = match r {
            Ok(reply) if reply.status == 200 && reply.verified() => {
                out.ok += 1;
                out.latencies_us
                    .push(took.as_micros().min(u32::MAX as u128) as u32);
                continue;
            }
            Ok(reply) if reply.status == 200 => ("unverified", format!("{:?}", reply.auth)),
            Ok(reply) => (
                "status",
                format!("{}: {}", reply.status, String::from_utf8_lossy(&reply.body)),
            ),
            Err(e) => (e.class(), e.to_string()),
        };
        *out.errors.entry(error.0.to_owned()).or_default() += 1;
        out.first_error.get_or_insert(error.1);
    }
    out
}

/// Per-operation cost of the crypto every request pays four times (client sign, agent
/// verify, agent sign, client verify), measured on this thread: the median of seven
/// batches, so one preempted batch on a shared machine does not move it.
fn crypto_costs() -> (Duration, Duration) {
    let signer = Signer::generate();
    let keys = vec![signer.public_key().clone()];
    let msg = fort_core::canonical::request_bytes(
        "forge",
        "/agent/capabilities/status",
        "bench",
        "1700000000",
        "00112233445566778899aabbccddeeff",
        b"{}",
    );
    let n = 500u32;
    let sig = signer.sign(&msg);
    let median = |mut batches: Vec<Duration>| {
        batches.sort_unstable();
        batches[batches.len() / 2]
    };
    let batch = |op: &dyn Fn()| {
        let t = util::thread_cpu();
        for _ in 0..n {
            op();
        }
        (util::thread_cpu() - t) / n
    };
    let sign = median(
        (0..7)
            .map(|_| {
                batch(&|| {
                    std::hint::black_box(signer.sign(std::hint::black_box(&msg)));
                })
            })
            .collect(),
    );
    let verify = median(
        (0..7)
            .map(|_| {
                batch(&|| {
                    let _ = std::hint::black_box(verify(&sig, &keys, &msg));
                })
            })
            .collect(),
    );
    (sign, verify)
}

/// What one load phase measured.
struct Measured {
    ok: u64,
    window: Duration,
    latencies_us: Vec<u32>,
    errors: BTreeMap<String, u64>,
    first_error: Option<String>,
    agent_cpu: Option<Duration>,
    self_cpu: Duration,
    machine: Duration,
}

impl Measured {
    fn rps(&self) -> f64 {
        self.ok as f64 / self.window.as_secs_f64()
    }
    fn lat(&self, q: f64) -> Duration {
        Duration::from_micros(percentile(&self.latencies_us, q) as u64)
    }
    fn errors(&self) -> u64 {
        self.errors.values().sum()
    }
}

/// `connections` workers, each with its own keep-alive client (or one shared pool),
/// against `ep` for `warmup` + `duration`; CPU sampled over the measured window only.
async fn measure(
    ep: Arc<Endpoint>,
    origin: &str,
    signer: &Signer,
    opts: &ClientOptions,
    args: &StatusArgs,
    agent_pid: Option<u32>,
) -> Result<Measured> {
    let shared = SignedClient::new(origin, signer.clone(), opts);
    let start = Instant::now();
    let measure_from = start + args.warmup;
    let end = measure_from + args.duration;
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..args.connections.max(1) {
        let client = if args.shared_client {
            shared.clone()
        } else {
            SignedClient::new(origin, signer.clone(), opts)
        };
        workers.spawn(worker(client, ep.clone(), measure_from, end));
    }
    let sampler = tokio::spawn(async move {
        tokio::time::sleep_until(measure_from).await;
        let a0 = agent_pid.and_then(util::proc_cpu);
        let s0 = util::self_cpu();
        let m0 = util::machine_busy();
        tokio::time::sleep_until(end).await;
        let a1 = agent_pid.and_then(util::proc_cpu);
        let s1 = util::self_cpu();
        let m1 = util::machine_busy();
        (a0.zip(a1).map(|(a, b)| b - a), s1 - s0, m1 - m0)
    });
    let mut all = WorkerOut::default();
    while let Some(w) = workers.join_next().await {
        let w = w.context("worker")?;
        all.ok += w.ok;
        all.latencies_us.extend(w.latencies_us);
        for (k, v) in w.errors {
            *all.errors.entry(k).or_default() += v;
        }
        if all.first_error.is_none() {
            all.first_error = w.first_error;
        }
    }
    let window = measure_from.elapsed();
    let (agent_cpu, self_cpu, machine) = sampler.await.context("sampler")?;
    all.latencies_us.sort_unstable();
    Ok(Measured {
        ok: all.ok,
        window,
        latencies_us: all.latencies_us,
        errors: all.errors,
        first_error: all.first_error,
        agent_cpu,
        self_cpu,
        machine,
    })
}

/// Full TLS 1.3 handshakes per second: fresh TCP connections, each handshaken (pinned,
/// as every fort client does) and closed, `concurrency` at a time.
async fn handshakes(
    ep: &Endpoint,
    concurrency: usize,
    duration: Duration,
) -> Result<(u64, Duration, Vec<u32>, u64)> {
    let addr: std::net::SocketAddr = ep
        .address
        .strip_prefix("https://")
        .ok_or_else(|| anyhow!("{} is not an https:// address", ep.address))?
        .parse()
        .with_context(|| format!("{} is not IP:PORT", ep.address))?;
    let connector = tokio_rustls::TlsConnector::from(Arc::new(fort_core::tls::client_config(
        &ep.host, &ep.keys,
    )));
    let start = Instant::now();
    let end = start + duration;
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..concurrency.max(1) {
        let connector = connector.clone();
        tasks.spawn(async move {
            let (mut ok, mut failed, mut lat) = (0u64, 0u64, Vec::new());
            while Instant::now() < end {
                let t = Instant::now();
                let name = rustls::pki_types::ServerName::IpAddress(addr.ip().into());
                let done = match tokio::net::TcpStream::connect(addr).await {
                    Ok(tcp) => connector.connect(name, tcp).await.is_ok(),
                    Err(_) => false,
                };
                if done {
                    ok += 1;
                    lat.push(t.elapsed().as_micros().min(u32::MAX as u128) as u32);
                } else {
                    failed += 1;
                }
            }
            (ok, failed, lat)
        });
    }
    let (mut ok, mut failed, mut lat) = (0, 0, Vec::new());
    while let Some(t) = tasks.join_next().await {
        let (o, f, l) = t.context("handshake worker")?;
        ok += o;
        failed += f;
        lat.extend(l);
    }
    lat.sort_unstable();
    Ok((ok, start.elapsed(), lat, failed))
}

/// Starts one agent named `forge` in `fleet` (plain HTTP when the fleet is plaintext).
fn start_agent(
    fleet: &mut fort_tests::Fleet,
    args: &StatusArgs,
    audit: bool,
) -> Result<(AgentProc, Endpoint)> {
    let mut toml = args.agent_toml.clone();
    if args.compare_audit {
        toml.push_str("\n[access]\ntrigger = [\"bench\"]\n");
    }
    if !audit {
        toml.push_str("\n[audit]\nenable = false\n");
    }
    fleet.host("forge").extra_toml = toml;
    if args.agent_needs > 0 {
        // A provider that never runs: the needs stay unsatisfied and are listed.
        fleet.capability(
            "elsewhere",
            "thing",
            json!({"handler": "/bin/true", "mode": "async"}),
        );
        for i in 0..args.agent_needs {
            fleet.need(
                "forge",
                &format!("thing/n{i:04}"),
                "elsewhere",
                json!({"nag_seconds": 3600}),
            );
        }
    }
    fleet.write_files();
    let mut a = vec![AgentProc::spawn(fleet, "forge")?];
    util::wait_listening(&mut a, Duration::from_secs(20))?;
    let a = a.pop().expect("one agent");
    let ep = Endpoint {
        host: "forge".into(),
        address: fleet.address_of("forge"),
        keys: vec![fleet.hosts["forge"].signer.public_key().clone()],
        body: if args.compare_audit {
            WITH_ENTRIES
        } else {
            b"{}"
        },
    };
    Ok((a, ep))
}

fn report_load(r: &mut Report, prefix: &str, m: &Measured) {
    let key = |k: &str| format!("{prefix}{k}");
    r.line(&key("verified_ok"), m.ok, m.ok);
    let rps = m.rps();
    r.line(
        &key("requests_per_s"),
        (rps * 10.0).round() / 10.0,
        format!("{rps:.1} verified req/s"),
    );
    for (name, q) in [
        ("p50_ms", 0.5),
        ("p90_ms", 0.9),
        ("p99_ms", 0.99),
        ("max_ms", 1.0),
    ] {
        r.line(&key(name), ms(m.lat(q)), format!("{:.3} ms", ms(m.lat(q))));
    }
    r.line(
        &key("errors"),
        m.errors(),
        format!("{} {:?}", m.errors(), m.errors),
    );
    if let Some(e) = &m.first_error {
        r.line(&key("first_error"), e.clone(), e);
    }
    if let Some(cpu) = m.agent_cpu {
        let cores = cpu.as_secs_f64() / m.window.as_secs_f64();
        r.line(
            &key("agent_cpu_cores"),
            (cores * 100.0).round() / 100.0,
            format!(
                "{cores:.2} cores ({:.1} µs CPU per request)",
                cpu.as_secs_f64() * 1e6 / m.ok.max(1) as f64
            ),
        );
    }
    let cores = m.self_cpu.as_secs_f64() / m.window.as_secs_f64();
    r.line(
        &key("bench_cpu_cores"),
        (cores * 100.0).round() / 100.0,
        format!(
            "{cores:.2} cores ({:.1} µs CPU per request, client side)",
            m.self_cpu.as_secs_f64() * 1e6 / m.ok.max(1) as f64
        ),
    );
    let others = m
        .machine
        .saturating_sub(m.self_cpu)
        .saturating_sub(m.agent_cpu.unwrap_or_default());
    let cores = others.as_secs_f64() / m.window.as_secs_f64();
    r.line(
        &key("other_processes_cpu_cores"),
        (cores * 100.0).round() / 100.0,
        format!("{cores:.2} cores (machine busy time not spent by the agent or this client)"),
    );
}

pub async fn run(args: StatusArgs, json_out: bool) -> Result<()> {
    let mut fleet = util::new_fleet();
    let mut agent: Option<AgentProc> = None;
    let (ep, signer, origin, agent_pid) = match &args.target {
        Some(url) => {
            let host = args.host.clone().expect("clap requires --host");
            let registry = Registry::load(&args.hosts)
                .with_context(|| format!("reading {}", args.hosts.display()))?;
            let peer = registry
                .get(&host)
                .ok_or_else(|| anyhow!("{host} is not in {}", args.hosts.display()))?;
            let key = args.key.clone().expect("clap requires --key");
            let signer = Signer::from_file(&key)?;
            let ep = Endpoint {
                host,
                address: url.clone(),
                keys: peer.keys.clone(),
                body: if args.compare_audit {
                    WITH_ENTRIES
                } else {
                    b"{}"
                },
            };
            (ep, signer, args.origin.clone().expect("clap"), args.pid)
        }
        None => {
            let signer = fleet.principal("bench");
            let (a, ep) = start_agent(&mut fleet, &args, true)?;
            let pid = a.pid();
            agent = Some(a);
            (ep, signer, "bench".to_owned(), Some(pid))
        }
    };
    let ep = Arc::new(ep);
    let opts = ClientOptions {
        total_timeout: Duration::from_secs(10),
        // One keep-alive connection per worker client; more with a shared pool.
        max_idle_per_peer: args.connections.max(1),
        ..ClientOptions::default()
    };
    let tls = measure(ep.clone(), &origin, &signer, &opts, &args, agent_pid).await?;

    let (sign, verify) = crypto_costs();
    let doc_bytes = {
        let target = Target {
            name: &ep.host,
            address: &ep.address,
            keys: &ep.keys,
        };
        SignedClient::new(&origin, signer.clone(), &opts)
            .post(&target, "/agent/capabilities/status", b"{}".to_vec())
            .await
            .map(|r| r.body.len())
            .unwrap_or(0)
    };
    let stalled = if args.stall > 0 && args.target.is_none() {
        let staller = crate::stall::Staller::start(
            &fleet.hosts["forge"],
            "forge",
            args.stall,
            args.stall_per_address,
        );
        // Every stalled connection open before the measurement starts.
        let ready = Instant::now() + Duration::from_secs(10);
        while staller.held.load(std::sync::atomic::Ordering::Relaxed) < args.stall
            && Instant::now() < ready
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let held_before = staller.held.load(std::sync::atomic::Ordering::Relaxed);
        let m = measure(ep.clone(), &origin, &signer, &opts, &args, agent_pid).await?;
        let held_after = staller.held.load(std::sync::atomic::Ordering::Relaxed);
        let opened = staller.opened.load(std::sync::atomic::Ordering::Relaxed);
        let shed = staller.shed.load(std::sync::atomic::Ordering::Relaxed);
        Some((m, held_before, held_after, opened, shed))
    } else {
        None
    };
    let agent_rss =
        agent_pid.and_then(|p| Some((util::proc_kb(p, "VmRSS")?, util::proc_kb(p, "VmHWM")?)));
    let handshake = if args.handshake_duration.is_zero() || !ep.address.starts_with("https://") {
        None
    } else {
        Some(handshakes(&ep, args.handshake_concurrency, args.handshake_duration).await?)
    };
    // The plain-HTTP agent starts only now: the TLS phase ran with the machine to itself.
    let plain = if args.compare_plaintext && args.target.is_none() {
        let mut plain_fleet = util::new_fleet();
        plain_fleet.plaintext = true;
        let signer = plain_fleet.principal("bench");
        let (a, ep) = start_agent(&mut plain_fleet, &args, true)?;
        let opts = ClientOptions {
            allow_plaintext: true,
            ..opts.clone()
        };
        let m = measure(Arc::new(ep), "bench", &signer, &opts, &args, Some(a.pid())).await?;
        drop(a);
        Some(m)
    } else {
        None
    };

    // The agent without an audit trail, after the others, as the plain-HTTP one; then
    // both measured again in alternating rounds.
    let audit_pairs = if args.compare_audit && args.target.is_none() {
        let mut off_fleet = util::new_fleet();
        let off_signer = off_fleet.principal("bench");
        let (a, off_ep) = start_agent(&mut off_fleet, &args, false)?;
        let (off_ep, off_pid) = (Arc::new(off_ep), a.pid());
        let pairs = paired::rounds(args.rounds, |side| match side {
            Side::A => measure(ep.clone(), &origin, &signer, &opts, &args, agent_pid),
            Side::B => measure(
                off_ep.clone(),
                "bench",
                &off_signer,
                &opts,
                &args,
                Some(off_pid),
            ),
        })
        .await?;
        drop(a);
        Some(pairs)
    } else {
        None
    };

    let mut r = Report::new("status", json_out);
    r.line("target", ep.address.clone(), &ep.address);
    r.line("connections", args.connections, args.connections);
    r.line(
        "client",
        if args.shared_client {
            "shared pool"
        } else {
            "one per connection"
        },
        if args.shared_client {
            "one shared pooled SignedClient"
        } else {
            "one SignedClient (keep-alive) per connection"
        },
    );
    r.line(
        "cores",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0),
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0),
    );
    r.line(
        "window_s",
        tls.window.as_secs_f64(),
        format!(
            "{:.2} s (after {:?} warm-up)",
            tls.window.as_secs_f64(),
            args.warmup
        ),
    );
    report_load(&mut r, "", &tls);
    r.line("status_doc_bytes", doc_bytes, doc_bytes);
    if let Some((rss, hwm)) = agent_rss {
        r.line(
            "agent_rss_kb_after",
            json!([rss, hwm]),
            format!(
                "{rss} kB now, {hwm} kB peak (holds every nonce of the last clock-skew window)"
            ),
        );
    }
    r.line(
        "ed25519_sshsig_sign_us",
        sign.as_secs_f64() * 1e6,
        format!(
            "{:.1} µs (×2 per request: client + agent)",
            sign.as_secs_f64() * 1e6
        ),
    );
    r.line(
        "ed25519_sshsig_verify_us",
        verify.as_secs_f64() * 1e6,
        format!(
            "{:.1} µs (×2 per request: agent + client)",
            verify.as_secs_f64() * 1e6
        ),
    );
    // What the agent must do per request is one verify and one sign; the rest (TLS, HTTP,
    // JSON, the nonce store, the trail) is the agent's own overhead.
    let crypto_us = (sign + verify).as_secs_f64() * 1e6;
    let agent_over_crypto = tls
        .agent_cpu
        .map(|cpu| cpu.as_secs_f64() * 1e6 / tls.ok.max(1) as f64 / crypto_us.max(1e-9));
    if let Some(ratio) = agent_over_crypto {
        r.line(
            "agent_cpu_over_crypto_ratio",
            (ratio * 1000.0).round() / 1000.0,
            format!(
                "{ratio:.2} (agent CPU per request ÷ one SSHSIG sign + one verify, {crypto_us:.1} µs)"
            ),
        );
    }
    let mut handshake_rate = None;
    if let Some((n, took, lat, failed)) = &handshake {
        let rate = *n as f64 / took.as_secs_f64();
        handshake_rate = Some(rate);
        r.line(
            "tls_handshakes_per_s",
            (rate * 10.0).round() / 10.0,
            format!(
                "{rate:.1} full TLS 1.3 handshakes/s ({} at once, p50 {:.3} ms, p99 {:.3} ms, {failed} failed)",
                args.handshake_concurrency,
                ms(Duration::from_micros(percentile(lat, 0.5) as u64)),
                ms(Duration::from_micros(percentile(lat, 0.99) as u64)),
            ),
        );
    }
    if let Some(p) = &plain {
        report_load(&mut r, "plaintext_", p);
        let ratio = tls.rps() / p.rps().max(1e-9);
        r.line(
            "tls_over_plaintext_ratio",
            (ratio * 1000.0).round() / 1000.0,
            format!("{ratio:.3} (TLS keep-alive req/s ÷ plain HTTP req/s, same run)"),
        );
    }
    if let Some(pairs) = &audit_pairs {
        let last = &pairs[pairs.len() - 1];
        report_load(&mut r, "audit_on_", &last.0);
        report_load(&mut r, "audit_off_", &last.1);
        // Time per verified request with the trail on, over the time without it.
        let (each, cost) = paired::ratios(pairs, |m| 1.0 / m.rps().max(1e-9));
        r.line(
            "audit_on_over_off_ratio",
            json!(each),
            format!(
                "{} (status with entries, time per request on ÷ off, same run; the last round shown above)",
                paired::shown(&each, cost)
            ),
        );
        // The agent's CPU per request, which other work on the machine moves less.
        let (each_cpu, cpu_cost) = paired::ratios(pairs, |m| {
            m.agent_cpu.unwrap_or_default().as_secs_f64() / m.ok.max(1) as f64
        });
        r.line(
            "audit_on_over_off_cpu_ratio",
            json!(each_cpu),
            format!(
                "{} (the agent's CPU per request on ÷ off)",
                paired::shown(&each_cpu, cpu_cost)
            ),
        );
        r.target("audit on ≤ 1.15× off", cost <= 1.15);
        r.target("audit on ≤ 1.15× off (agent CPU)", cpu_cost <= 1.15);
    }
    if let Some((m, held_before, held_after, opened, shed)) = &stalled {
        report_load(&mut r, "stalled_", m);
        let ratio = m.rps() / tls.rps().max(1e-9);
        r.line(
            "stalled_connections",
            json!([held_before, held_after, opened, shed]),
            format!(
                "{held_before} held when the measurement began, {held_after} at its end, {opened} opened in all, {shed} shed by the agent before their headers ({} per address)",
                args.stall_per_address
            ),
        );
        r.line(
            "stalled_over_clean_ratio",
            (ratio * 1000.0).round() / 1000.0,
            format!("{ratio:.3} (verified req/s while stalled ÷ without, same run)"),
        );
        r.target("no errors while stalled", m.errors() == 0);
    }
    if agent.is_some() {
        r.note("the agent and this client share the machine's cores");
    }
    r.target(">= 5000 verified req/s", tls.rps() >= 5000.0);
    r.target("p99 < 20 ms", tls.lat(0.99) < Duration::from_millis(20));
    r.target("no errors", tls.errors() == 0);
    if let Some(ratio) = agent_over_crypto {
        r.target("agent CPU ≤ 1.5× its crypto", ratio <= 1.5);
    }
    if let Some(rate) = handshake_rate {
        r.target(">= 1000 TLS handshakes/s", rate >= 1000.0);
    }
    r.finish();
    drop(agent);
    Ok(())
}
