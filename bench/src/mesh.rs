//! A join reaching every member of a mesh: one coordinator (`fort-handler mesh`) and N
//! member agents, each with a WireGuard key its own agent made (`$fort_key`, type
//! `wireguard`) and its answer delivered to a file. N−1 members join first and settle;
//! then the last one is started, and the clock runs until every member's delivered
//! answer lists the newcomer's key (and the newcomer's lists all N−1). The figures: that
//! time, the coordinator's handler runs and callbacks it took, and the members' work.
//! No WireGuard interface is touched: what is measured is fort's coordination (the
//! handler's run over N members and the N callbacks), which `wg syncconf` follows on
//! each member.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use serde_json::{json, Value};

use crate::util::{self, ms, AgentProc, Report};

#[derive(clap::Args, Debug)]
pub struct MeshArgs {
    /// Members of the mesh, the one that joins last included.
    #[arg(long, default_value_t = 100)]
    members: usize,
    /// Give up after this long (for the first members to settle, and for the join).
    #[arg(long, default_value = "300s", value_parser = humantime::parse_duration)]
    timeout: Duration,
    /// How often the members' answers are read.
    #[arg(long, default_value = "50ms", value_parser = humantime::parse_duration)]
    poll: Duration,
    /// The fort-handler binary (default: next to fort-bench).
    #[arg(long)]
    handler_bin: Option<PathBuf>,
}

const CAP: &str = "mesh";
const NEED: &str = "mesh/wg0";

/// The public keys in a member's delivered answer: its own, and its peers'.
fn answer_keys(path: &std::path::Path) -> Option<(String, BTreeSet<String>)> {
    let v: Value = serde_json::from_slice(&std::fs::read(path).ok()?).ok()?;
    let own = v["public_key"].as_str()?.to_owned();
    let peers = v["peers"]
        .as_array()?
        .iter()
        .filter_map(|p| p["public_key"].as_str().map(str::to_owned))
        .collect();
    Some((own, peers))
}

pub async fn run(args: MeshArgs, json_out: bool) -> Result<()> {
    if args.members < 2 || args.members > 400 {
        bail!("--members must be 2 to 400 (a mesh has at most 400 members)");
    }
    let handler = util::handler_bin(args.handler_bin.clone())?;
    let mut fleet = util::new_fleet();
    let members: Vec<String> = (0..args.members).map(|i| format!("m{i:03}")).collect();
    let coordinator = "coord";
    fleet.host(coordinator);
    for m in &members {
        fleet.host(m);
    }
    let config = fleet.dir.path().join("mesh.json");
    std::fs::write(
        &config,
        json!({
            "name": "bench",
            "state_file": fleet.dir.path().join("mesh-state.json"),
            "hosts_file": fleet.host_dir(coordinator).join("hosts.json"),
            "ipv4": "10.77.0.0/20",
            "ipv6": "fd77:77::/64",
            "max_members": args.members,
        })
        .to_string(),
    )?;
    fleet.capability(
        coordinator,
        CAP,
        json!({"handler": handler, "args": ["mesh", "--config", config], "mode": "async"}),
    );
    let base = fleet.dir.path().to_owned();
    let answer_of = |m: &str| base.join(format!("{m}-answer.json"));
    let specs: Vec<(String, Value)> = members
        .iter()
        .map(|m| {
            let key = fleet.dir.path().join(format!("{m}-wg.key"));
            (
                m.clone(),
                json!({
                    "request": {"public_key": {"$fort_key": "wg"}},
                    "nag_seconds": 600,
                    "keys": {"wg": {"type": "wireguard", "path": key, "certificate": "/public_key"}},
                    "files": [{"name": "answer", "path": answer_of(m), "pointer": ""}],
                }),
            )
        })
        .collect();
    for (m, spec) in specs {
        fleet.need(&m, NEED, coordinator, spec);
    }
    fleet.write_files();

    let mut up = vec![AgentProc::spawn(&fleet, coordinator)?];
    util::wait_listening(&mut up, Duration::from_secs(30))?;
    let coord = up.pop().expect("one");
    let (first, joiner) = members.split_at(args.members - 1);
    let joiner = &joiner[0];
    let t_settle = Instant::now();
    let mut agents = Vec::new();
    for m in first {
        agents.push(AgentProc::spawn(&fleet, m)?);
    }
    // The first N−1 settle: every one holds every other as a peer.
    let want = first.len() - 1;
    let settled = loop {
        let done = first
            .iter()
            .filter(|m| answer_keys(&answer_of(m)).is_some_and(|(_, p)| p.len() == want))
            .count();
        if done == first.len() {
            break t_settle.elapsed();
        }
        if t_settle.elapsed() > args.timeout {
            bail!(
                "the first {} members did not settle within {:?}: {done} hold all their peers",
                first.len(),
                args.timeout
            );
        }
        tokio::time::sleep(args.poll).await;
    };
    // Quiet: the runs and callbacks of the settling are over before the join is timed.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = util::status(&coord.socket())?;
    let (_, _, runs_before, writes_before) = util::provider_counts(&before, CAP);
    let coord_cpu_before = util::proc_cpu_with_children(coord.pid()).unwrap_or_default();
    let member_cpu_before: u64 = agents
        .iter()
        .filter_map(|a| util::proc_cpu(a.pid()).map(|d| d.as_millis() as u64))
        .sum();

    let t0 = Instant::now();
    agents.push(AgentProc::spawn(&fleet, joiner)?);
    let mut reached_at: Vec<Option<Duration>> = vec![None; first.len()];
    let mut joiner_key: Option<String> = None;
    let mut joiner_done: Option<Duration> = None;
    let elapsed = loop {
        if joiner_key.is_none() || joiner_done.is_none() {
            if let Some((own, peers)) = answer_keys(&answer_of(joiner)) {
                joiner_key = Some(own);
                if peers.len() == first.len() && joiner_done.is_none() {
                    joiner_done = Some(t0.elapsed());
                }
            }
        }
        if let Some(key) = &joiner_key {
            for (i, m) in first.iter().enumerate() {
                if reached_at[i].is_none()
                    && answer_keys(&answer_of(m)).is_some_and(|(_, p)| p.contains(key))
                {
                    reached_at[i] = Some(t0.elapsed());
                }
            }
        }
        if joiner_done.is_some() && reached_at.iter().all(Option::is_some) {
            break t0.elapsed();
        }
        if t0.elapsed() > args.timeout {
            bail!(
                "the join reached {} of {} members within {:?} (the newcomer {} its peers)",
                reached_at.iter().filter(|r| r.is_some()).count(),
                first.len(),
                args.timeout,
                if joiner_done.is_some() {
                    "holds"
                } else {
                    "does not hold"
                }
            );
        }
        tokio::time::sleep(args.poll).await;
    };
    let after = util::status(&coord.socket())?;
    let (entries, _, runs_after, writes_after) = util::provider_counts(&after, CAP);
    let runs = runs_after.saturating_sub(runs_before);
    let last_run = &after["provider"]["capabilities"][CAP]["last_run"];
    let callbacks = last_run["callbacks"].as_u64().unwrap_or(0);
    let run_ms = last_run["duration_ms"].as_u64().unwrap_or(0);
    let coord_cpu = util::proc_cpu_with_children(coord.pid())
        .unwrap_or_default()
        .saturating_sub(coord_cpu_before);
    let member_cpu_after: u64 = agents[..first.len()]
        .iter()
        .filter_map(|a| util::proc_cpu(a.pid()).map(|d| d.as_millis() as u64))
        .sum();
    let mut reached: Vec<u64> = reached_at
        .iter()
        .map(|r| r.map_or(0, |d| d.as_millis() as u64))
        .collect();
    let (first_ms, median_ms, last_ms) = util::spread(&mut reached);

    let mut r = Report::new("mesh", json_out);
    r.line("members", args.members, args.members);
    r.line("coordinator_entries", entries, entries);
    r.line(
        "settle_ms",
        ms(settled),
        format!(
            "{:.0} ms for the first {} members to hold each other (cold start)",
            ms(settled),
            first.len()
        ),
    );
    r.line(
        "join_reaches_all_ms",
        ms(elapsed),
        format!(
            "{:.0} ms from starting member {} to every member's delivered answer naming its key (polled every {:?})",
            ms(elapsed),
            args.members,
            args.poll
        ),
    );
    r.line(
        "join_reached_ms_first_median_last",
        json!([first_ms, median_ms, last_ms]),
        format!("{first_ms} / {median_ms} / {last_ms} ms (the other members)"),
    );
    if let Some(d) = joiner_done {
        r.line(
            "newcomer_holds_all_ms",
            ms(d),
            format!(
                "{:.0} ms for the newcomer to hold all {} peers",
                ms(d),
                first.len()
            ),
        );
    }
    r.line(
        "handler_runs",
        runs,
        format!("{runs} coordinator handler run(s) for the join"),
    );
    r.line(
        "callbacks_last_run",
        callbacks,
        format!(
            "{callbacks} callbacks by the last run ({run_ms} ms), one per member whose answer changed"
        ),
    );
    r.line(
        "coordinator_state_writes",
        writes_after.saturating_sub(writes_before),
        writes_after.saturating_sub(writes_before),
    );
    r.line(
        "coordinator_cpu_ms",
        ms(coord_cpu),
        format!(
            "{:.0} ms (agent and handler, during the join)",
            ms(coord_cpu)
        ),
    );
    r.line(
        "members_cpu_ms",
        member_cpu_after.saturating_sub(member_cpu_before),
        format!(
            "{} ms (the {} other members together, during the join)",
            member_cpu_after.saturating_sub(member_cpu_before),
            first.len()
        ),
    );
    r.target(
        "join reaches every member < 10 s",
        elapsed < Duration::from_secs(10),
    );
    r.target(
        "one callback per member whose answer changed",
        callbacks as usize >= first.len(),
    );
    r.finish();
    drop(agents);
    drop(coord);
    Ok(())
}
