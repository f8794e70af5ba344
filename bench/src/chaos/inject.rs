//! Carrying out the plan: each fault as the host would live it (`kill -9`, SIGSTOP,
//! nftables rules, a full tmpfs, libfaketime, a kill in the middle of a handler run or of
//! `fort-agent state-key rotate`, a changed needs.json and SIGHUP, the previous release's
//! binary with the previous generation's files), then undone; and around every kill,
//! whether the restart kept what was acknowledged.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

use super::layout::{PG, SSH, TOK};
use super::net::Link;
use super::plan::{Event, Kind};
use super::procs;
use super::timeline::now;
use super::World;
use crate::util;

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Starts `host`'s agent and waits until it answers; each failed start is a violation
/// (then it is tried again, three times in all).
pub async fn start(w: &Arc<World>, host: &str) -> bool {
    for attempt in 1..=3 {
        let spawned = lock(&w.procs).spawn(host, &w.log_level);
        let result = match spawned {
            Err(e) => Err(e),
            Ok(()) => procs::wait_ready(&w.procs, host).await,
        };
        match result {
            Ok(_) => return true,
            Err(why) => {
                lock(&w.stats).failed_starts += 1;
                lock(&w.timeline).violate(
                    "every agent starts every time",
                    &[host.to_owned()],
                    None,
                    format!("start {attempt} failed: {why}"),
                );
                lock(&w.procs).kill(host);
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
        }
    }
    false
}

/// SIGTERM, as systemd stops it, and waits for it to finish.
pub async fn stop(w: &Arc<World>, host: &str) {
    let p = lock(&w.procs).take_for_stop(host);
    if let Some(p) = p {
        let _ = tokio::task::spawn_blocking(move || procs::stop_taken(p)).await;
    }
}

/// What a host had acknowledged just before a kill.
struct Before {
    at: f64,
    needs: Vec<(String, String, Option<u64>)>,
    entries: BTreeMap<String, bool>,
    signed: Vec<Vec<u8>>,
}

fn status(w: &World, host: &str) -> Option<Value> {
    util::admin(
        &w.fleet.host_dir(host).join("agent.sock"),
        &json!({"cmd": "status", "entries": true}),
        Duration::from_secs(10),
    )
    .ok()
    .map(|mut v| v["status"].take())
}

/// The lines of `host`'s trail covered by a signed checkpoint.
fn signed_lines(w: &World, host: &str) -> Vec<Vec<u8>> {
    fort_core::audit::signed_lines(
        &w.fleet.host_dir(host).join("state/audit"),
        host,
        &w.fleet.hosts[host].keys(),
    )
}

fn snapshot(w: &World, host: &str) -> Option<Before> {
    let s = status(w, host)?;
    let needs = s["needs"]["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| r["state"] == "satisfied" || r["state"] == "expiring")
        .map(|r| {
            (
                r["need"].as_str().unwrap_or("").to_owned(),
                r["state"].as_str().unwrap_or("").to_owned(),
                r["expires_at"].as_u64(),
            )
        })
        .collect();
    let entries = s["entries"]
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(_, e)| e["absent_since"].is_null())
        .map(|(k, e)| (k.clone(), e["response_hash"].is_string()))
        .collect();
    Some(Before {
        at: now(),
        needs,
        entries,
        signed: signed_lines(w, host),
    })
}

/// After the restart: every need satisfied before still holds its payload, every entry
/// held before is still there with its response, every signed trail record is kept.
fn compare(w: &World, host: &str, before: &Before) {
    let mut broken = Vec::new();
    let Some(s) = status(w, host) else {
        return;
    };
    let t = now() as u64;
    for (need, was, expires) in &before.needs {
        let row = s["needs"]["items"]
            .as_array()
            .and_then(|a| a.iter().find(|r| r["need"] == need.as_str()));
        let state = row.and_then(|r| r["state"].as_str()).unwrap_or("gone");
        let ok = matches!(state, "satisfied" | "expiring")
            || (state == "expired" && expires.is_some_and(|e| e <= t));
        if !ok {
            broken.push(format!(
                "need {need} was {was}, is {state} after the restart"
            ));
        }
    }
    let tl = lock(&w.timeline);
    for (key, had_response) in &before.entries {
        let origin = key.split(':').next().unwrap_or("");
        // A consumer's own fault (a reload releasing the need) may remove it meanwhile.
        let moved_on = tl.faults.iter().any(|f| {
            f.hosts.iter().any(|h| h == origin) && f.end.is_none_or(|e| e >= before.at - 60.0)
        });
        if moved_on {
            continue;
        }
        match s["entries"].get(key) {
            None => broken.push(format!("entry {key} is gone after the restart")),
            Some(e) if *had_response && !e["response_hash"].is_string() => {
                broken.push(format!("entry {key} lost its response in the restart"))
            }
            _ => {}
        }
    }
    drop(tl);
    let after: std::collections::BTreeSet<Vec<u8>> =
        fort_core::audit::read_lines(&w.fleet.host_dir(host).join("state/audit"))
            .unwrap_or_default()
            .into_iter()
            .map(|l| l.bytes)
            .collect();
    let first_kept = after
        .iter()
        .filter_map(|b| serde_json::from_slice::<Value>(b).ok()?["seq"].as_u64())
        .min()
        .unwrap_or(0);
    if let Some(lost) = before.signed.iter().find(|b| {
        !after.contains(*b)
            && serde_json::from_slice::<Value>(b)
                .ok()
                .and_then(|v| v["seq"].as_u64())
                .is_some_and(|s| s >= first_kept)
    }) {
        broken.push(format!(
            "a signed trail record is gone: {}",
            String::from_utf8_lossy(lost)
        ));
    }
    for b in broken {
        lock(&w.timeline).violate(
            "a restart keeps what was acknowledged",
            &[host.to_owned()],
            None,
            b,
        );
    }
}

fn capability_of(w: &World, host: &str) -> &'static str {
    if w.layout.cas.iter().any(|c| c == host) {
        SSH
    } else if w.layout.pgs.iter().any(|c| c == host) {
        PG
    } else {
        TOK
    }
}

/// `kill -9` of `host` (after starting a handler run, when `in_run`), down for `hold`,
/// started again and held to what it acknowledged.
async fn kill_and_restart(w: &Arc<World>, id: usize, host: &str, hold: Duration, in_run: bool) {
    let wb = w.clone();
    let h = host.to_owned();
    let before = tokio::task::spawn_blocking(move || snapshot(&wb, &h))
        .await
        .ok()
        .flatten();
    if in_run {
        let caught = kill_in_run(w, host).await;
        lock(&w.timeline).note(id, &caught);
        if caught.starts_with("killed during") {
            lock(&w.stats).handler_runs_caught += 1;
        }
    } else {
        lock(&w.procs).kill(host);
    }
    tokio::time::sleep(hold).await;
    if start(w, host).await {
        if let Some(before) = before {
            let wb = w.clone();
            let h = host.to_owned();
            let _ = tokio::task::spawn_blocking(move || compare(&wb, &h, &before)).await;
        }
    }
}

/// Asks for a handler run and kills the agent (and the handler) as soon as the run's
/// process exists; says whether it caught one.
async fn kill_in_run(w: &Arc<World>, host: &str) -> String {
    let cap = capability_of(w, host);
    let Some(pid) = lock(&w.procs).pid(host) else {
        return "not running".into();
    };
    let socket = w.fleet.host_dir(host).join("agent.sock");
    std::thread::spawn(move || {
        let _ = util::admin(
            &socket,
            &json!({"cmd": "trigger", "capability": cap}),
            Duration::from_secs(60),
        );
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut caught = false;
    while std::time::Instant::now() < deadline {
        if !procs::descendants(pid).is_empty() {
            caught = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    lock(&w.procs).kill(host);
    if caught {
        format!("killed during a run of {cap}")
    } else {
        format!("no run of {cap} seen in 10 s; killed anyway")
    }
}

/// One fault of the plan, from its start to its end.
pub async fn fault(w: Arc<World>, e: Event) {
    let link = e.kind.is_link();
    let id = lock(&w.timeline).begin(e.kind.name(), &e.hosts, link, String::new());
    *lock(&w.stats).injected.entry(e.kind.name()).or_default() += 1;
    let host = e.hosts[0].clone();
    match e.kind {
        Kind::Kill => kill_and_restart(&w, id, &host, e.hold, false).await,
        Kind::HandlerKill => kill_and_restart(&w, id, &host, e.hold, true).await,
        Kind::Hang => {
            lock(&w.procs).hang(&host, true);
            tokio::time::sleep(e.hold).await;
            lock(&w.procs).hang(&host, false);
        }
        Kind::Partition | Kind::OneWay | Kind::Slow => {
            let (a, b) = (e.hosts[0].clone(), e.hosts[1].clone());
            let directions: Vec<(String, String, Link)> = match e.kind {
                Kind::Partition => vec![(a.clone(), b.clone(), Link::Drop), (b, a, Link::Drop)],
                Kind::OneWay if e.param.is_multiple_of(2) => vec![(a, b, Link::Drop)],
                Kind::OneWay => vec![(b, a, Link::Drop)],
                _ => vec![(a.clone(), b.clone(), Link::Slow), (b, a, Link::Slow)],
            };
            let detail = directions
                .iter()
                .map(|(f, t, _)| format!("{f}→{t}"))
                .collect::<Vec<_>>()
                .join(", ");
            lock(&w.timeline).note(id, &detail);
            for (f, t, l) in &directions {
                if let Some(net) = lock(&w.net).as_mut() {
                    if let Err(err) = net.add(f, t, *l) {
                        lock(&w.timeline).note(id, &format!("could not apply: {err}"));
                    }
                }
            }
            // A dropping rule is seen to hold: no connection gets through (to an agent
            // that is up; the run's own calls from outside still do).
            if e.kind != Kind::Slow {
                let (f, t, _) = &directions[0];
                let to = w.fleet.hosts[t].addr;
                let blocked = lock(&w.net).as_ref().map(|n| !n.connects(f, to));
                let held = blocked == Some(true);
                *lock(&w.stats).partitions_seen.entry(held).or_default() += 1;
                let seen = if held {
                    "no connection gets through"
                } else {
                    "A CONNECTION STILL GETS THROUGH"
                };
                lock(&w.timeline).note(id, seen);
            }
            tokio::time::sleep(e.hold).await;
            for (f, t, l) in &directions {
                if let Some(net) = lock(&w.net).as_mut() {
                    let _ = net.remove(f, t, *l);
                }
            }
        }
        Kind::DiskFull => {
            let dir = w.fleet.host_dir(&host).join("state");
            match super::disk::fill(&dir) {
                Ok(n) => lock(&w.timeline).note(id, &format!("{} kB filled", n / 1024)),
                Err(err) => lock(&w.timeline).note(id, &format!("fill failed: {err}")),
            }
            tokio::time::sleep(e.hold).await;
            super::disk::unfill(&dir);
        }
        Kind::Clock => clock(&w, id, &host, &e).await,
        Kind::KeyRotation => key_rotation(&w, id, &host, e.param).await,
        Kind::Reload => {
            let detail = w.change_needs(&host, e.param);
            lock(&w.timeline).note(id, &detail);
            if let Some(pid) = lock(&w.procs).pid(&host) {
                procs::signal(pid, libc::SIGHUP);
            }
        }
        Kind::Rollback => {
            let Some(old) = w.previous.clone() else {
                return;
            };
            stop(&w, &host).await;
            w.set_toml(&host, |o| o.previous_generation = true);
            lock(&w.procs).hosts.get_mut(&host).expect("host").binary = Some(old);
            start(&w, &host).await;
            tokio::time::sleep(e.hold).await;
            stop(&w, &host).await;
            w.set_toml(&host, |o| o.previous_generation = false);
            lock(&w.procs).hosts.get_mut(&host).expect("host").binary = None;
            start(&w, &host).await;
        }
    }
    lock(&w.timeline).end(id);
}

/// The host's clock off by one to three minutes (agent and handlers), for `hold`.
async fn clock(w: &Arc<World>, id: usize, host: &str, e: &Event) {
    let Some(lib) = w.faketime.clone() else {
        return;
    };
    let seconds = 60 + (e.param >> 1) % 121;
    let offset = if e.param.is_multiple_of(2) {
        format!("+{seconds}")
    } else {
        format!("-{seconds}")
    };
    lock(&w.timeline).note(id, &format!("{offset} s"));
    stop(w, host).await;
    let env = vec![
        ("LD_PRELOAD".to_owned(), lib.display().to_string()),
        ("FAKETIME".to_owned(), offset.clone()),
        ("FAKETIME_DONT_FAKE_MONOTONIC".to_owned(), "1".to_owned()),
    ];
    w.set_toml(host, |o| o.clock = Some((lib.clone(), offset.clone())));
    lock(&w.procs).hosts.get_mut(host).expect("host").env = env;
    start(w, host).await;
    tokio::time::sleep(e.hold).await;
    stop(w, host).await;
    w.set_toml(host, |o| o.clock = None);
    lock(&w.procs).hosts.get_mut(host).expect("host").env = Vec::new();
    start(w, host).await;
}

/// The provider stopped, its state key rotated with `fort-agent state-key rotate` killed
/// at one of its crash points (or not), run again to finish, and started on the new key.
async fn key_rotation(w: &Arc<World>, id: usize, host: &str, param: u64) {
    let points = [
        None,
        Some("state-key.rotate.temp"),
        Some("state-key.rotate.between"),
        Some("state-key.rotate.snapshot"),
    ];
    let point = points[(param % points.len() as u64) as usize];
    stop(w, host).await;
    let n = lock(&w.stats).rotations;
    lock(&w.stats).rotations += 1;
    let new = w.fleet.dir.path().join(format!("{host}-key-{n}"));
    let agent = w.agent_bin.clone();
    let config = w.fleet.config_path(host);
    let (new_key, cfg) = (new.clone(), config.clone());
    let outcome = tokio::task::spawn_blocking(move || -> Result<String, String> {
        let made = std::process::Command::new(&agent)
            .args(["state-key", "new"])
            .arg(&new_key)
            .output()
            .map_err(|e| e.to_string())?;
        if !made.status.success() {
            return Err(format!("state-key new: {made:?}"));
        }
        let rotate = |point: Option<&str>| {
            let mut cmd = std::process::Command::new(&agent);
            cmd.args(["state-key", "rotate", "--config"])
                .arg(&cfg)
                .arg("--new-key")
                .arg(&new_key);
            if let Some(p) = point {
                cmd.env(fort_core::crash::ENV, format!("{p}=return"));
            }
            cmd.output()
        };
        let first = rotate(point).map_err(|e| e.to_string())?;
        use std::os::unix::process::ExitStatusExt;
        let killed = first.status.signal() == Some(libc::SIGKILL);
        if !killed && !first.status.success() {
            return Err(format!(
                "state-key rotate failed: {}",
                String::from_utf8_lossy(&first.stderr)
            ));
        }
        if killed {
            let again = rotate(None).map_err(|e| e.to_string())?;
            if !again.status.success() {
                return Err(format!(
                    "state-key rotate, run again after a kill at {}, did not finish: {}",
                    point.unwrap_or("?"),
                    String::from_utf8_lossy(&again.stderr)
                ));
            }
            return Ok(format!(
                "killed at {}, finished when run again",
                point.unwrap_or("?")
            ));
        }
        Ok(format!("not killed (armed: {})", point.unwrap_or("none")))
    })
    .await
    .unwrap_or_else(|e| Err(e.to_string()));
    match outcome {
        Ok(detail) => {
            lock(&w.timeline).note(id, &detail);
            lock(&w.keys).insert(host.to_owned(), new);
            w.set_toml(host, |_| {});
        }
        Err(why) => lock(&w.timeline).violate(
            "a key rotation killed at any point finishes when run again",
            &[host.to_owned()],
            None,
            why,
        ),
    }
    start(w, host).await;
}

/// An agent that died by itself: a violation, and it is started again.
pub async fn restart_crashed(w: Arc<World>, host: String, why: String) {
    let id = lock(&w.timeline).begin("crash", std::slice::from_ref(&host), false, String::new());
    lock(&w.timeline).violate(
        "no agent dies by itself",
        std::slice::from_ref(&host),
        None,
        why,
    );
    start(&w, &host).await;
    lock(&w.timeline).end(id);
}

/// The operators' calls of the plan, each at its time from `t0`.
pub async fn operators(w: Arc<World>, ops: Vec<super::plan::OpCall>, t0: tokio::time::Instant) {
    let client = w.fleet.client(super::layout::OPS);
    for op in ops {
        tokio::time::sleep_until(t0 + op.at).await;
        if w.stopping.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        let h = &w.fleet.hosts[&op.host];
        let address = w.fleet.address_of(&op.host);
        let keys = h.keys();
        let target = fort_core::client::Target {
            name: &op.host,
            address: &address,
            keys: &keys,
        };
        let (path, body) = match &op.trigger {
            None => ("/agent/capabilities/status", json!({})),
            Some((cap, entry, force)) => {
                let mut b = json!({"capability": cap, "force": force});
                if let Some(e) = entry {
                    b["entry"] = json!(e);
                }
                ("/agent/capabilities/trigger", b)
            }
        };
        let reply = tokio::time::timeout(
            Duration::from_secs(20),
            client.post(&target, path, serde_json::to_vec(&body).expect("json")),
        )
        .await;
        let status = match reply {
            Ok(Ok(r)) => Some(r.status),
            _ => None,
        };
        let mut s = lock(&w.stats);
        let kind = if op.trigger.is_some() {
            "trigger"
        } else {
            "status"
        };
        let outcome = match status {
            Some(200..=299) => "answered",
            Some(400..=499) => "refused",
            _ => "unanswered",
        };
        *s.ops.entry(format!("{kind} {outcome}")).or_default() += 1;
    }
}
