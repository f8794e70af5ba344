//! Issue 2: signed `status` calls from this process at one agent over N keep-alive
//! connections; every response signature is verified before it counts.

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
}

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
            .post(&target, "/agent/capabilities/status", b"{}".to_vec())
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
/// verify, agent sign, client verify), measured on this thread.
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
    let n = 2000u32;
    let t = util::thread_cpu();
    let mut sig = String::new();
    for _ in 0..n {
        sig = signer.sign(std::hint::black_box(&msg));
    }
    let sign = (util::thread_cpu() - t) / n;
    let t = util::thread_cpu();
    for _ in 0..n {
        let _ = std::hint::black_box(verify(&sig, &keys, &msg));
    }
    let verify = (util::thread_cpu() - t) / n;
    (sign, verify)
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
            };
            (ep, signer, args.origin.clone().expect("clap"), args.pid)
        }
        None => {
            let signer = fleet.principal("bench");
            fleet.host("forge").extra_toml = args.agent_toml.clone();
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
            let mut a = vec![AgentProc::spawn(&fleet, "forge")?];
            util::wait_listening(&mut a, Duration::from_secs(20))?;
            let a = a.pop().expect("one agent");
            let ep = Endpoint {
                host: "forge".into(),
                address: format!("https://{}", a.addr),
                keys: vec![fleet.hosts["forge"].signer.public_key().clone()],
            };
            let pid = a.pid();
            agent = Some(a);
            (ep, signer, "bench".to_owned(), Some(pid))
        }
    };
    let ep = Arc::new(ep);
    let opts = ClientOptions {
        total_timeout: Duration::from_secs(10),
        ..ClientOptions::default()
    };
    let shared = SignedClient::new(&origin, signer.clone(), &opts);
    let start = Instant::now();
    let measure_from = start + args.warmup;
    let end = measure_from + args.duration;
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..args.connections.max(1) {
        let client = if args.shared_client {
            shared.clone()
        } else {
            SignedClient::new(&origin, signer.clone(), &opts)
        };
        workers.spawn(worker(client, ep.clone(), measure_from, end));
    }
    // CPU of the agent and of this process over the measured window only.
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
    let (sign, verify) = crypto_costs();
    let doc_bytes = {
        let target = Target {
            name: &ep.host,
            address: &ep.address,
            keys: &ep.keys,
        };
        shared
            .post(&target, "/agent/capabilities/status", b"{}".to_vec())
            .await
            .map(|r| r.body.len())
            .unwrap_or(0)
    };
    let agent_rss =
        agent_pid.and_then(|p| Some((util::proc_kb(p, "VmRSS")?, util::proc_kb(p, "VmHWM")?)));

    all.latencies_us.sort_unstable();
    let lat = |q| Duration::from_micros(percentile(&all.latencies_us, q) as u64);
    let rps = all.ok as f64 / window.as_secs_f64();
    let errors: u64 = all.errors.values().sum();
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
        window.as_secs_f64(),
        format!(
            "{:.2} s (after {:?} warm-up)",
            window.as_secs_f64(),
            args.warmup
        ),
    );
    r.line("verified_ok", all.ok, all.ok);
    r.line(
        "requests_per_s",
        (rps * 10.0).round() / 10.0,
        format!("{rps:.1} verified req/s"),
    );
    r.line("p50_ms", ms(lat(0.5)), format!("{:.3} ms", ms(lat(0.5))));
    r.line("p90_ms", ms(lat(0.9)), format!("{:.3} ms", ms(lat(0.9))));
    r.line("p99_ms", ms(lat(0.99)), format!("{:.3} ms", ms(lat(0.99))));
    r.line("max_ms", ms(lat(1.0)), format!("{:.3} ms", ms(lat(1.0))));
    r.line("status_doc_bytes", doc_bytes, doc_bytes);
    r.line("errors", errors, format!("{errors} {:?}", all.errors));
    if let Some(e) = &all.first_error {
        r.line("first_error", e.clone(), e);
    }
    if let Some(cpu) = agent_cpu {
        let cores = cpu.as_secs_f64() / window.as_secs_f64();
        r.line(
            "agent_cpu_cores",
            (cores * 100.0).round() / 100.0,
            format!(
                "{cores:.2} cores ({:.1} µs CPU per request)",
                cpu.as_secs_f64() * 1e6 / all.ok.max(1) as f64
            ),
        );
    }
    let cores = self_cpu.as_secs_f64() / window.as_secs_f64();
    r.line(
        "bench_cpu_cores",
        (cores * 100.0).round() / 100.0,
        format!(
            "{cores:.2} cores ({:.1} µs CPU per request, client side)",
            self_cpu.as_secs_f64() * 1e6 / all.ok.max(1) as f64
        ),
    );
    if let Some((rss, hwm)) = agent_rss {
        r.line(
            "agent_rss_kb_after",
            json!([rss, hwm]),
            format!(
                "{rss} kB now, {hwm} kB peak (holds every nonce of the last clock-skew window)"
            ),
        );
    }
    let others = machine
        .saturating_sub(self_cpu)
        .saturating_sub(agent_cpu.unwrap_or_default());
    let cores = others.as_secs_f64() / window.as_secs_f64();
    r.line(
        "other_processes_cpu_cores",
        (cores * 100.0).round() / 100.0,
        format!("{cores:.2} cores (machine busy time not spent by the agent or this client)"),
    );
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
    if agent.is_some() {
        r.note("the agent and this client share the machine's cores");
    }
    r.target(">= 5000 verified req/s", rps >= 5000.0);
    r.target("p99 < 20 ms", lat(0.99) < Duration::from_millis(20));
    r.target("no errors", errors == 0);
    r.finish();
    drop(agent);
    Ok(())
}
