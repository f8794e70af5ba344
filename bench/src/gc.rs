//! How long one GC sweep takes over entries from many origins.
//!
//! One provider and `--origins` real origin agents (each a `fort-agent` process that
//! declares one need and answers signed `/agent/needs` enumerations). Once every origin
//! is served, `--absent` origins also get a second entry they do not declare (requested
//! by the bench, signed with that origin's key), so the sweep has verified absences to
//! act on. Then sweeps run over the provider's admin socket: `--runs` dry runs and one
//! real sweep, each printing the agent's own `duration_ms` and the wall time seen here.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use fort_core::client::{ClientOptions, SignedClient, Target};
use serde_json::{json, Value};

use crate::util::{self, ms, AgentProc, Report};

#[derive(clap::Args, Debug)]
pub struct GcArgs {
    /// Origin agents, each with one entry at the provider.
    #[arg(long, default_value_t = 200)]
    origins: usize,
    /// Origins that also get an entry they do not declare (removed by the real sweep).
    #[arg(long, default_value_t = 20)]
    absent: usize,
    /// Dry-run sweeps before the real one.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// The provider's `[gc] concurrency` (unset: the agent's default, 16).
    #[arg(long)]
    concurrency: Option<usize>,
    /// Give up waiting for the entries after this long.
    #[arg(long, default_value = "120s", value_parser = humantime::parse_duration)]
    timeout: Duration,
}

const CAP: &str = "gcb";

struct Sweep {
    agent_ms: u64,
    wall: Duration,
    provider_cpu: Duration,
    asked: usize,
    removed: usize,
    pending: usize,
    no_proof: usize,
    first_no_proof: Option<Value>,
}

fn sweep(provider: &AgentProc, dry_run: bool) -> Result<Sweep> {
    let cpu0 = util::proc_cpu(provider.pid()).unwrap_or_default();
    let t = Instant::now();
    let reply = util::admin(
        &provider.socket(),
        &json!({"cmd": "gc", "dry_run": dry_run}),
        Duration::from_secs(300),
    )?;
    let wall = t.elapsed();
    let provider_cpu = util::proc_cpu(provider.pid()).unwrap_or_default() - cpu0;
    let rep = &reply["report"];
    let len = |k: &str| rep[k].as_array().map_or(0, Vec::len);
    Ok(Sweep {
        agent_ms: rep["duration_ms"].as_u64().unwrap_or(0),
        wall,
        provider_cpu,
        asked: rep["origins_asked"].as_u64().unwrap_or(0) as usize,
        removed: len("removed"),
        pending: len("pending_grace"),
        no_proof: len("kept_no_proof"),
        first_no_proof: rep["kept_no_proof"].get(0).cloned(),
    })
}

pub async fn run(args: GcArgs, json_out: bool) -> Result<()> {
    util::require_jq()?;
    let mut fleet = util::new_fleet();
    // Only the declared entries get a response: the injected ones cause no callbacks.
    let handler = util::ok_handler(&fleet, Some("/main"));
    fleet.capability("forge", CAP, json!({"handler": handler, "mode": "async"}));
    let mut extra = "[gc]\ninterval = \"0s\"\ngrace = \"0s\"\n".to_owned();
    if let Some(c) = args.concurrency {
        extra.push_str(&format!("concurrency = {c}\n"));
    }
    fleet.host("forge").extra_toml = extra;
    let origins: Vec<String> = (0..args.origins).map(|i| format!("o{i:03}")).collect();
    for o in &origins {
        fleet.need(
            o,
            &format!("{CAP}/main"),
            "forge",
            json!({"nag_seconds": 3600}),
        );
    }
    // The first `absent` origins are also listed for a need they no longer declare (the
    // provider's deploy still has it, theirs went first): the provider accepts its
    // request, and the sweep finds it absent. A host may only ever hold need ids the
    // provider lists for it.
    let absent = args.absent.min(args.origins);
    let callers = &mut fleet
        .host("forge")
        .capabilities
        .get_mut(CAP)
        .expect("declared above")["callers"];
    for o in origins.iter().take(absent) {
        if let Some(ids) = callers[o.as_str()].as_array_mut() {
            ids.push(json!("stale"));
        }
    }
    fleet.write_files();
    let mut p = vec![AgentProc::spawn(&fleet, "forge")?];
    util::wait_listening(&mut p, Duration::from_secs(20))?;
    let provider = p.pop().expect("one");
    util::status(&provider.socket())?;

    let t0 = Instant::now();
    let mut agents = Vec::new();
    for o in &origins {
        agents.push(AgentProc::spawn(&fleet, o)?);
    }
    util::wait_listening(&mut agents, args.timeout)?;
    let listening = t0.elapsed();
    let total = args.origins as u64;
    let deadline = Instant::now() + args.timeout;
    let mut done = vec![false; agents.len()];
    loop {
        let (entries, undelivered, _, _) =
            util::provider_counts(&util::status(&provider.socket())?, CAP);
        if entries == total && undelivered == 0 {
            for (i, a) in agents.iter().enumerate() {
                if !done[i] {
                    done[i] = util::needs_satisfied(&a.socket()) == Some((1, 1));
                }
            }
            if done.iter().all(|d| *d) {
                break;
            }
        }
        if Instant::now() > deadline {
            bail!(
                "provider has {entries}/{total} entries, {undelivered} undelivered, {} origins satisfied after {:?}",
                done.iter().filter(|d| **d).count(),
                args.timeout
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let populated = t0.elapsed();
    let rss: Vec<u64> = agents
        .iter()
        .filter_map(|a| util::proc_kb(a.pid(), "VmRSS"))
        .collect();

    // Entries the origins do not declare: proven absent by the sweep.
    let forge = &fleet.hosts["forge"];
    let address = format!("https://{}", forge.addr);
    let keys = vec![forge.signer.public_key().clone()];
    let target = Target {
        name: "forge",
        address: &address,
        keys: &keys,
    };
    for o in origins.iter().take(absent) {
        let client = SignedClient::new(o, fleet.hosts[o].signer.clone(), &ClientOptions::default());
        let body = serde_json::to_vec(&json!({"need": format!("{CAP}/stale"), "request": {}}))?;
        let reply = client
            .post(&target, &format!("/agent/capabilities/{CAP}"), body)
            .await?;
        if reply.status != 202 {
            bail!(
                "injecting {o}:{CAP}/stale: {} {}",
                reply.status,
                String::from_utf8_lossy(&reply.body)
            );
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;

    let mut dry = Vec::new();
    for _ in 0..args.runs {
        dry.push(sweep(&provider, true)?);
    }
    let real = sweep(&provider, false)?;
    let after = util::provider_counts(&util::status(&provider.socket())?, CAP).0;

    let mut r = Report::new("gc", json_out);
    r.line(
        "origins",
        args.origins,
        format!("{} real fort-agent processes", args.origins),
    );
    r.line(
        "origins_listening_s",
        listening.as_secs_f64(),
        format!("{:.2} s to start them all", listening.as_secs_f64()),
    );
    r.line(
        "entries_populated_s",
        populated.as_secs_f64(),
        format!(
            "{:.2} s until the provider held all {total} entries and every origin was satisfied",
            populated.as_secs_f64()
        ),
    );
    let mut rss = rss;
    let (lo, mid, hi) = util::spread(&mut rss);
    r.line(
        "origin_rss_kb_min_median_max",
        json!([lo, mid, hi]),
        format!("{lo} / {mid} / {hi} kB"),
    );
    let show = |s: &Sweep| {
        format!(
            "{} ms in the agent, {:.1} ms wall, provider CPU {:.0} ms; asked {}, removed {}, pending grace {}, kept without proof {}",
            s.agent_ms, ms(s.wall), ms(s.provider_cpu), s.asked, s.removed, s.pending, s.no_proof
        )
    };
    for (i, s) in dry.iter().enumerate() {
        r.line(&format!("dry_run_{}", i + 1), json!({"duration_ms": s.agent_ms, "wall_ms": ms(s.wall), "provider_cpu_ms": ms(s.provider_cpu), "asked": s.asked, "removed": s.removed, "pending_grace": s.pending, "kept_no_proof": s.no_proof}), show(s));
    }
    r.line("real_sweep", json!({"duration_ms": real.agent_ms, "wall_ms": ms(real.wall), "provider_cpu_ms": ms(real.provider_cpu), "asked": real.asked, "removed": real.removed, "pending_grace": real.pending, "kept_no_proof": real.no_proof}), show(&real));
    if let Some(e) = dry
        .iter()
        .chain([&real])
        .find_map(|s| s.first_no_proof.clone())
    {
        r.line("first_kept_no_proof", e.clone(), e);
    }
    r.line(
        "entries_after",
        after,
        format!("{after} (expected {total})"),
    );
    r.target("every origin asked", real.asked == args.origins);
    r.target(
        "only the undeclared removed",
        real.removed == absent && after == total && real.no_proof == 0,
    );
    r.finish();
    drop(agents);
    drop(provider);
    Ok(())
}
