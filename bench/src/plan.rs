//! How long `fort-agent plan` takes on a consumer with many needs and on a provider with
//! many entries, and proof that it writes nothing.
//!
//! A provider `forge` serves `web`; a consumer agent `app` declares `--needs` needs from
//! it, all satisfied; `--origins` more hosts (never started) are callers whose entries
//! the bench requests itself, signed with their keys, until the provider holds
//! `--entries` entries (those get no response, so nothing is called back). Then plans
//! go over each agent's admin socket exactly as `fort-agent plan` sends them (the files'
//! text in the request): on `app`, a needs.json with some needs changed, removed and
//! added; on `forge`, a hosts.json without one origin and capabilities whose callers
//! lose half of another origin's ids. Each is timed `--runs` times.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use fort_core::client::{ClientOptions, SignedClient, Target};
use serde_json::{json, Value};

use crate::util::{self, ms, percentile, AgentProc, Report};

#[derive(clap::Args, Debug)]
pub struct PlanArgs {
    /// Needs of the consumer agent, all satisfied before planning.
    #[arg(long, default_value_t = 500)]
    needs: usize,
    /// Entries the provider holds: the consumer's needs plus entries of other callers.
    #[arg(long, default_value_t = 5000)]
    entries: usize,
    /// Caller hosts (not started) sharing the entries beyond the consumer's.
    #[arg(long, default_value_t = 9)]
    origins: usize,
    /// Plans timed on each agent.
    #[arg(long, default_value_t = 20)]
    runs: usize,
    /// Give up waiting for the entries after this long.
    #[arg(long, default_value = "180s", value_parser = humantime::parse_duration)]
    timeout: Duration,
}

const CAP: &str = "web";

/// One timed plan: wall time, agent CPU, and what it found.
struct Timed {
    wall: Vec<Duration>,
    cpu: Duration,
    request_bytes: usize,
    plan: Value,
}

fn file(path: &std::path::Path, text: String) -> Value {
    json!({"path": path, "text": text})
}

fn timed(agent: &AgentProc, request: &Value, runs: usize) -> Result<Timed> {
    let request_bytes = serde_json::to_vec(request)?.len();
    let cpu0 = util::proc_cpu(agent.pid()).unwrap_or_default();
    let mut wall = Vec::new();
    let mut plan = Value::Null;
    for _ in 0..runs.max(1) {
        let t = Instant::now();
        let mut reply = util::admin(&agent.socket(), request, Duration::from_secs(120))?;
        wall.push(t.elapsed());
        plan = reply["plan"].take();
    }
    let cpu = (util::proc_cpu(agent.pid()).unwrap_or_default() - cpu0) / runs.max(1) as u32;
    wall.sort_unstable();
    Ok(Timed {
        wall,
        cpu,
        request_bytes,
        plan,
    })
}

fn show(t: &Timed) -> String {
    format!(
        "median {:.1} ms, p95 {:.1} ms, max {:.1} ms wall; agent CPU {:.1} ms per plan; request {} kB",
        ms(percentile(&t.wall, 0.5)),
        ms(percentile(&t.wall, 0.95)),
        ms(percentile(&t.wall, 1.0)),
        ms(t.cpu),
        t.request_bytes / 1024
    )
}

fn numbers(t: &Timed) -> Value {
    json!({
        "median_ms": ms(percentile(&t.wall, 0.5)),
        "p95_ms": ms(percentile(&t.wall, 0.95)),
        "max_ms": ms(percentile(&t.wall, 1.0)),
        "agent_cpu_ms": ms(t.cpu),
        "request_bytes": t.request_bytes,
    })
}

fn len(v: &Value) -> usize {
    v.as_array().map_or(0, Vec::len)
}

pub async fn run(args: PlanArgs, json_out: bool) -> Result<()> {
    util::require_jq()?;
    if args.entries < args.needs || args.origins == 0 {
        bail!("--entries must be at least --needs, and --origins at least 1");
    }
    let mut fleet = util::new_fleet();
    // Only the consumer's entries get a response: the others cause no callbacks.
    let handler = fleet.script(
        "plan-handler",
        r#"exec jq -c 'with_entries(.value = (if (.key | startswith("app:")) then "OK" else null end))'"#,
    );
    fleet.capability("forge", CAP, json!({"handler": handler, "mode": "async"}));
    for i in 0..args.needs {
        fleet.need(
            "app",
            &format!("{CAP}/n{i:05}"),
            "forge",
            json!({"nag_seconds": 3600, "request": {"i": i}}),
        );
    }
    let others = args.entries - args.needs;
    let origins: Vec<String> = (0..args.origins).map(|i| format!("o{i:02}")).collect();
    let mut injected: Vec<(String, String)> = Vec::new();
    for k in 0..others {
        let o = &origins[k % origins.len()];
        let need = format!("{CAP}/x{k:05}");
        fleet.need(o, &need, "forge", json!({"nag_seconds": 3600}));
        injected.push((o.clone(), need));
    }
    fleet.write_files();
    let mut agents = vec![
        AgentProc::spawn(&fleet, "forge")?,
        AgentProc::spawn(&fleet, "app")?,
    ];
    util::wait_listening(&mut agents, Duration::from_secs(30))?;

    // The other callers' entries, requested concurrently, one client per origin.
    let t0 = Instant::now();
    let forge = &fleet.hosts["forge"];
    let address = format!("https://{}", forge.addr);
    let keys = vec![forge.signer.public_key().clone()];
    let mut tasks = Vec::new();
    for o in &origins {
        let mine: Vec<String> = injected
            .iter()
            .filter(|(who, _)| who == o)
            .map(|(_, n)| n.clone())
            .collect();
        let client = SignedClient::new(o, fleet.hosts[o].signer.clone(), &ClientOptions::default());
        let (address, keys) = (address.clone(), keys.clone());
        tasks.push(tokio::spawn(async move {
            let target = Target {
                name: "forge",
                address: &address,
                keys: &keys,
            };
            for need in mine {
                let body = serde_json::to_vec(&json!({"need": need, "request": {}}))?;
                let r = client
                    .post(&target, &format!("/agent/capabilities/{CAP}"), body)
                    .await?;
                if r.status != 202 {
                    bail!("{need}: {} {}", r.status, String::from_utf8_lossy(&r.body));
                }
            }
            Ok::<(), anyhow::Error>(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let deadline = Instant::now() + args.timeout;
    loop {
        let (entries, undelivered, _, _) =
            util::provider_counts(&util::status(&agents[0].socket())?, CAP);
        let satisfied = util::needs_satisfied(&agents[1].socket());
        if entries == args.entries as u64
            && undelivered == 0
            && satisfied == Some((args.needs as u64, args.needs as u64))
        {
            break;
        }
        if Instant::now() > deadline {
            bail!("after {:?}: provider has {entries} entries ({undelivered} undelivered), app has {satisfied:?} needs satisfied", args.timeout);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let populated = t0.elapsed();
    // Let trailing acknowledgements land before counting writes.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let writes_before = util::status(&agents[0].socket())?["provider"]["state_writes"].clone();

    // The consumer's next needs.json: a tenth changed, a twentieth removed and added.
    let read = |host: &str, f: &str| std::fs::read_to_string(fleet.host_dir(host).join(f));
    let mut needs: serde_json::Map<String, Value> =
        serde_json::from_str(&read("app", "needs.json")?)?;
    let keys_now: Vec<String> = needs.keys().cloned().collect();
    let (tenth, twentieth) = (args.needs / 10, args.needs / 20);
    for k in keys_now.iter().take(tenth) {
        needs[k]["request"]["changed"] = json!(true);
    }
    for k in keys_now.iter().rev().take(twentieth) {
        needs.remove(k);
    }
    for i in 0..twentieth {
        needs.insert(
            format!("{CAP}/new{i:05}"),
            json!({"from": "forge", "request": {}, "nag_seconds": 3600}),
        );
    }
    let dir = fleet.host_dir("app");
    let consumer_req = json!({
        "cmd": "plan",
        "hosts": file(&dir.join("hosts.json"), read("app", "hosts.json")?),
        "needs": file(&dir.join("needs.json"), serde_json::to_string_pretty(&needs)?),
        "capabilities": file(&dir.join("capabilities.json"), read("app", "capabilities.json")?),
    });
    let consumer = timed(&agents[1], &consumer_req, args.runs)?;

    // The provider's: the last origin leaves hosts.json, the first loses half its ids.
    let mut hosts: Value = serde_json::from_str(&read("forge", "hosts.json")?)?;
    let gone = origins.last().expect("an origin").clone();
    hosts["hosts"].as_object_mut().expect("hosts").remove(&gone);
    let mut caps: Value = serde_json::from_str(&read("forge", "capabilities.json")?)?;
    let callers = caps[CAP]["callers"].as_object_mut().expect("callers");
    callers.remove(&gone);
    let first = &origins[0];
    if let Some(ids) = callers.get_mut(first).and_then(Value::as_array_mut) {
        let keep = ids.len() / 2;
        ids.truncate(keep);
    }
    let dir = fleet.host_dir("forge");
    let provider_req = json!({
        "cmd": "plan",
        "hosts": file(&dir.join("hosts.json"), serde_json::to_string_pretty(&hosts)?),
        "needs": file(&dir.join("needs.json"), read("forge", "needs.json")?),
        "capabilities": file(&dir.join("capabilities.json"), serde_json::to_string_pretty(&caps)?),
    });
    let provider = timed(&agents[0], &provider_req, args.runs)?;
    let status_after = util::status(&agents[0].socket())?;

    let mut r = Report::new("plan", json_out);
    r.line(
        "setup",
        json!({"needs": args.needs, "entries": args.entries, "origins": args.origins, "populated_s": populated.as_secs_f64()}),
        format!(
            "app declares {} needs; forge holds {} entries from app and {} other callers ({:.1} s to populate)",
            args.needs,
            args.entries,
            args.origins,
            populated.as_secs_f64()
        ),
    );
    let cn = &consumer.plan["needs"];
    r.line("consumer_plan", numbers(&consumer), show(&consumer));
    r.line(
        "consumer_plan_found",
        json!({"changed": len(&cn["changed"]), "removed": len(&cn["removed"]), "added": len(&cn["added"])}),
        format!(
            "{} needs changed, {} removed, {} added",
            len(&cn["changed"]),
            len(&cn["removed"]),
            len(&cn["added"])
        ),
    );
    let pe = &provider.plan["entries"];
    r.line("provider_plan", numbers(&provider), show(&provider));
    r.line(
        "provider_plan_found",
        json!({"dropped": len(&pe["dropped"]), "refused": len(&pe["refused"])}),
        format!(
            "{} entries dropped (origin gone), {} refused (callers changed)",
            len(&pe["dropped"]),
            len(&pe["refused"])
        ),
    );
    r.target(
        "the plans found every change",
        len(&cn["changed"]) == tenth
            && len(&cn["removed"]) == twentieth
            && len(&cn["added"]) == twentieth
            && len(&pe["dropped"]) == others / args.origins
            && len(&pe["refused"]) > 0,
    );
    r.target(
        "planning wrote nothing",
        status_after["provider"]["state_writes"] == writes_before
            && util::provider_counts(&status_after, CAP).0 == args.entries as u64,
    );
    r.finish();
    drop(agents);
    Ok(())
}
