//! What must hold once the faults have stopped: every need satisfied again; after a GC
//! grace, every provider holds exactly the entries its consumers declare and serve there
//! (none leaked, none missing); then, with every agent stopped, every trail verifies
//! with the checkpoints the others witnessed, holds no secret, and no secret is in the
//! clear in a state directory under a state key.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine;
use serde_json::{json, Value};

use super::observe::Observer;
use super::token::CANARY;
use super::World;
use crate::util;

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Each provider's entries that should not be there, and those that should and are not.
fn entry_mismatch(w: &World) -> BTreeMap<String, (Vec<String>, Vec<String>)> {
    let mut expected: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut unknown: BTreeSet<String> = BTreeSet::new();
    for c in &w.layout.consumers {
        let status = util::status(&w.fleet.host_dir(&c.name).join("agent.sock")).ok();
        for (need, spec) in w.declared(&c.name) {
            let key = format!("{}:{need}", c.name);
            let provider = match &spec["from"] {
                Value::String(p) => Some(p.clone()),
                _ => status.as_ref().and_then(|s| {
                    s["needs"]["items"]
                        .as_array()?
                        .iter()
                        .find(|r| r["need"] == need.as_str())?["from"]
                        .as_str()
                        .map(str::to_owned)
                }),
            };
            match provider {
                Some(p) => {
                    expected.entry(p).or_default().insert(key);
                }
                // Its home cannot be told: no provider is held to it.
                None => {
                    unknown.insert(key);
                }
            }
        }
    }
    let mut out = BTreeMap::new();
    for p in w.layout.providers() {
        let Ok(s) = util::admin(
            &w.fleet.host_dir(&p).join("agent.sock"),
            &json!({"cmd": "status", "entries": true}),
            Duration::from_secs(10),
        ) else {
            out.insert(p, (vec!["(status unanswered)".into()], Vec::new()));
            continue;
        };
        let actual: BTreeSet<String> = s["status"]["entries"]
            .as_object()
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default();
        let want = expected.remove(&p).unwrap_or_default();
        let leaked: Vec<String> = actual
            .difference(&want)
            .filter(|k| !unknown.contains(*k))
            .cloned()
            .collect();
        let missing: Vec<String> = want.difference(&actual).cloned().collect();
        if !leaked.is_empty() || !missing.is_empty() {
            out.insert(p, (leaked, missing));
        }
    }
    out
}

/// Polls (the continuous checks go on) until every need is satisfied and every provider
/// holds exactly what it should, or until a GC grace, two sweeps and a recovery have
/// passed; what still differs then is a violation. Returns how long it took.
pub async fn settle(w: &Arc<World>, obs: &mut Observer) -> Duration {
    let t = w.layout.timing;
    let limit = Duration::from_secs(t.gc_grace + 2 * t.gc_interval + 10 + t.recovery())
        + Duration::from_secs_f64(w.slack);
    let started = Instant::now();
    loop {
        let wb = w.clone();
        let mut o = std::mem::take(obs);
        let (o, mismatch) = tokio::task::spawn_blocking(move || {
            let crashed = o.poll(&wb);
            let m = entry_mismatch(&wb);
            (o, (m, crashed))
        })
        .await
        .expect("settle poll");
        *obs = o;
        let (mismatch, crashed) = mismatch;
        for (h, why) in crashed {
            tokio::spawn(super::inject::restart_crashed(w.clone(), h, why));
        }
        if mismatch.is_empty() && obs.bad_now().is_empty() {
            return started.elapsed();
        }
        if started.elapsed() > limit {
            for (p, (leaked, missing)) in mismatch {
                lock(&w.timeline).violate(
                    "after a GC grace, providers hold exactly what consumers declare and serve there",
                    std::slice::from_ref(&p),
                    None,
                    format!("leaked {leaked:?}, missing {missing:?}"),
                );
            }
            return started.elapsed();
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

/// Every spelling of `needle` a file could hold: as it is, and inside base64 at each of
/// the three alignments.
fn spellings(needle: &str) -> Vec<Vec<u8>> {
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut out = vec![needle.as_bytes().to_vec()];
    for offset in 0..3usize {
        let mut data = vec![b'x'; offset];
        data.extend_from_slice(needle.as_bytes());
        let text = b64.encode(&data);
        let skip = (offset * 4).div_ceil(3) + 1;
        out.push(text.as_bytes()[skip..text.len() - 4].to_vec());
    }
    out
}

fn holding(dir: &Path, needles: &[Vec<u8>]) -> Vec<String> {
    fort_tests::files_under(dir)
        .into_iter()
        .filter(|p| {
            std::fs::read(p)
                .is_ok_and(|b| needles.iter().any(|n| fort_tests::contains_bytes(&b, n)))
        })
        .map(|p| p.display().to_string())
        .collect()
}

/// With every agent stopped: the trails, and secrets on disk. Returns (trails verified,
/// witnessed checkpoints checked).
pub fn trails_and_secrets(w: &World, passwords: &BTreeSet<String>) -> (usize, u64) {
    let fort = w.agent_bin.with_file_name("fort");
    let hosts: Vec<String> = w.layout.hosts();
    let audit = |h: &str| w.fleet.host_dir(h).join("state/audit");
    let mut verified = 0;
    let mut witnessed = 0;
    for h in &hosts {
        let mut cmd = std::process::Command::new(&fort);
        cmd.arg("--hosts")
            .arg(w.fleet.host_dir(h).join("hosts.json"))
            .args(["audit", "verify"])
            .arg(audit(h))
            .args(["--signer", h, "--json", "--witnesses"]);
        // Those who talk to it: a provider's consumers, a consumer's providers.
        let peers: BTreeSet<String> = if w.layout.is_provider(h) {
            w.layout
                .consumers
                .iter()
                .filter(|c| {
                    w.layout
                        .needs_of(&c.name)
                        .values()
                        .flatten()
                        .any(|p| p == h)
                })
                .map(|c| c.name.clone())
                .collect()
        } else {
            w.layout.needs_of(h).into_values().flatten().collect()
        };
        for other in &peers {
            cmd.arg(audit(other));
        }
        match cmd.output() {
            Ok(out) if out.status.success() => {
                verified += 1;
                let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
                witnessed += v["witnessed"]["checked"].as_u64().unwrap_or(0);
            }
            Ok(out) => lock(&w.timeline).violate(
                "every trail verifies with witnesses",
                std::slice::from_ref(h),
                None,
                format!(
                    "{}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                ),
            ),
            Err(e) => lock(&w.timeline).violate(
                "every trail verifies with witnesses",
                std::slice::from_ref(h),
                None,
                format!("{}: {e}", fort.display()),
            ),
        }
    }
    let mut needles = spellings(CANARY);
    // A sample of the passwords handed out (each is searched in every spelling).
    for p in passwords.iter().take(64) {
        needles.extend(spellings(p));
    }
    for h in &hosts {
        let found = holding(&audit(h), &needles);
        if !found.is_empty() {
            lock(&w.timeline).violate(
                "no secret in a trail",
                std::slice::from_ref(h),
                None,
                found.join(", "),
            );
        }
        let keyed = lock(&w.keys).contains_key(h);
        if keyed {
            let found = holding(&w.fleet.host_dir(h).join("state"), &needles);
            if !found.is_empty() {
                lock(&w.timeline).violate(
                    "no secret in the clear under a state key",
                    std::slice::from_ref(h),
                    None,
                    found.join(", "),
                );
            }
        }
    }
    (verified, witnessed)
}
