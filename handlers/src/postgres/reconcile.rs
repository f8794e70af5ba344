//! Every entry in, one answer per entry out: which entries keep their credential without a
//! word to the server, which need server work (new, rotated, back from release, drifted),
//! and which roles this handler made are no longer wanted.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::time::Instant;

use fort_core::names::{is_host_name, is_principal_name};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::config::{Config, OnRelease};
use super::drift::find_drift;
use super::names;
use super::request::Request;
use super::server::{Ensured, Failure, Released, Server};
use crate::common::{Entry, Output, Trigger};

/// The state file's version.
pub const STATE_VERSION: u32 = 1;

/// What this handler made on the server: the proof of ownership that cleanup goes by.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct State {
    /// Role (and database) name → what it is for.
    #[serde(default)]
    pub roles: BTreeMap<String, Made>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Made {
    /// The entry key it was made for; no other entry may have it.
    pub entry: String,
    /// The current password; `None` once released (the role has no `LOGIN`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password: Option<String>,
    /// The request's `rotate` this password answers.
    #[serde(default)]
    pub rotate: u64,
    /// The `CONNECTION LIMIT` it was given (−1: none).
    pub connection_limit: i32,
    /// A new password was asked for (a forced run) and a run's budget ran out before it
    /// was set: the next run sets it, although the entry then looks unchanged.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub owed: bool,
}

/// Why an entry needs the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// No role yet.
    New,
    /// A new password: `--force` (no cached response), `renew`, or a raised `rotate`.
    Rotate,
    /// Released before and asked for again: `LOGIN` again, with a new password.
    Reactivate,
    /// Its connection limit changed: the operator's setting, or its caller's roles came
    /// or went.
    Limit,
    /// The server no longer holds what the state says (found on a reconciling run).
    Repair,
}

#[derive(Debug)]
pub(super) struct Work {
    pub(super) entry: usize,
    pub(super) name: String,
    pub(super) rotate: u64,
    pub(super) why: Why,
    /// The entry was refused this run and its role stays in service: only its limit is
    /// brought in line, and the refusal stays its answer.
    pub(super) refused: bool,
}

/// The decisions that need no server.
#[derive(Debug, Default)]
pub(super) struct Plan {
    pub(super) keep: Vec<(usize, String)>,
    pub(super) work: Vec<Work>,
    /// Kept entries whose role a peer took over since (entry, the peer): this handler
    /// answers no password for them, and takes them back only when asked to renew.
    pub(super) taken: Vec<(usize, String)>,
    /// Roles of the state that no entry wants.
    release: Vec<String>,
    /// Role → its `CONNECTION LIMIT`, for every role in service after this run.
    pub(super) limits: HashMap<String, i32>,
    /// Callers with a role in service after this run.
    callers: usize,
}

/// What a run did, for its notes on stderr (names and counts, never a password).
#[derive(Debug, Default, PartialEq)]
pub struct Counts {
    pub kept: usize,
    pub created: usize,
    pub rotated: usize,
    /// Roles given a new connection limit (their passwords unchanged).
    pub limited: usize,
    pub refused: usize,
    pub pending: usize,
    pub released: usize,
    /// Roles a peer sharing the server made for the entry, taken over (new password).
    pub taken_over: usize,
}

/// The outcome of a run: the output, whether the state changed (save it), and the
/// failure that fails the run (after the state is saved: passwords already set on the
/// server must not be forgotten).
#[derive(Default)]
pub struct Reconciled {
    pub output: Output,
    pub changed: bool,
    pub counts: Counts,
    pub failure: Option<anyhow::Error>,
}

/// Decides every entry and does the server work, within the config's time budget.
pub async fn reconcile(
    config: &Config,
    provider: &str,
    state: &mut State,
    entries: &[Entry],
    trigger: Trigger,
) -> Reconciled {
    let started = Instant::now();
    let budget = config.run_budget;
    let mut out = Reconciled::default();
    let mut plan = plan(config, state, entries, &mut out);
    // With peers on the server, a kept role may have been taken over by one of them
    // since: each run reads its kept roles (one query) rather than answer a password
    // that no longer works.
    let reconciling = (trigger.reconciles() || !config.peers.is_empty()) && !plan.keep.is_empty();
    if plan.work.is_empty() && plan.release.is_empty() && !reconciling {
        respond_kept(config, state, entries, &plan.keep, &mut out);
        return out;
    }
    let server = match Server::connect(config).await {
        Ok(s) => s,
        Err(e) => {
            out.failure = Some(e);
            return out;
        }
    };
    note_capacity(config, &server, &plan).await;
    if reconciling {
        if let Err(e) = find_drift(config, provider, state, entries, &server, &mut plan).await {
            out.failure = Some(e);
            return out;
        }
        for (i, peer) in std::mem::take(&mut plan.taken) {
            out.counts.pending += 1;
            out.output.pending(
                &entries[i],
                format!("{peer} took this database over (it shares the server); asked to renew, this provider takes it back"),
            );
        }
    }
    respond_kept(config, state, entries, &plan.keep, &mut out);
    // Every caller's first entry before anyone's second, and a caller whose entry made
    // the server wait (a lock its consumer holds) gets no more server work this run: one
    // caller costs the others at most one wait per run, however many entries it has.
    let work = by_turns(plan.work, |w| entries[w.entry].origin.as_str());
    let mut slow: HashSet<String> = HashSet::new();
    let mut left: Vec<&Work> = Vec::new();
    let mut deferred = 0usize;
    for work in &work {
        let entry = &entries[work.entry];
        if work.refused && (slow.contains(&entry.origin) || started.elapsed() >= budget) {
            // Its limit comes in a later run; the entry's answer is its refusal.
            continue;
        }
        if slow.contains(&entry.origin) {
            out.output.pending(
                entry,
                format!(
                    "another entry of {} waited for a lock this run; this one comes in a later run",
                    entry.origin
                ),
            );
            deferred += 1;
            owe_rotation(state, work, &mut out);
            continue;
        }
        if started.elapsed() >= budget {
            left.push(work);
            continue;
        }
        let password = match (work.why, state.roles.get(&work.name)) {
            (
                Why::Limit | Why::Repair,
                Some(Made {
                    password: Some(p), ..
                }),
            ) => p.clone(),
            _ => names::new_password(),
        };
        let marker = names::marker(provider, &entry.key);
        let adopt = names::peer_markers(&config.peers, &entry.key);
        let limit = plan.limits.get(&work.name).copied().unwrap_or(1);
        let outcome = server
            .ensure(&work.name, &marker, &adopt, &password, limit)
            .await;
        if work.refused {
            match outcome {
                Ok(_) => {
                    if let Some(m) = state.roles.get_mut(&work.name) {
                        m.connection_limit = limit;
                        out.counts.limited += 1;
                        out.changed = true;
                    }
                }
                Err(Failure::Down(e)) if !server.alive().await => {
                    out.failure = Some(e);
                    return out;
                }
                Err(Failure::Waited(why)) => {
                    tracing::warn!("{}: its limit is set in a later run: {why}", work.name);
                    slow.insert(entry.origin.clone());
                    out.output.rerun_within(DEFERRED_RERUN_SECONDS);
                }
                Err(Failure::Refused(why)) => {
                    tracing::warn!("{}: its limit is set in a later run: {why}", work.name);
                }
                Err(Failure::Down(e)) => {
                    tracing::warn!("{}: its limit is set in a later run: {e:#}", work.name);
                }
            }
            continue;
        }
        match outcome {
            Ok(ensured) => {
                if ensured == Ensured::TakenOver {
                    tracing::info!(
                        "{}: taken over from the peer that made it for {}, with a new password",
                        work.name,
                        entry.key
                    );
                    out.counts.taken_over += 1;
                }
                let response = response(config, &work.name, &password);
                state.roles.insert(
                    work.name.clone(),
                    Made {
                        entry: entry.key.clone(),
                        password: Some(password),
                        rotate: work.rotate,
                        connection_limit: limit,
                        owed: false,
                    },
                );
                out.changed = true;
                match work.why {
                    Why::New | Why::Reactivate => out.counts.created += 1,
                    Why::Limit => out.counts.limited += 1,
                    Why::Rotate | Why::Repair => out.counts.rotated += 1,
                }
                out.output.respond(entry, response);
            }
            Err(Failure::Refused(reason)) => {
                tracing::warn!("{}: refused: {reason}", entry.key);
                out.counts.refused += 1;
                out.output.refuse(entry, reason);
            }
            Err(Failure::Waited(reason)) => {
                tracing::warn!("{}: {reason}; tried again in a later run", entry.key);
                slow.insert(entry.origin.clone());
                deferred += 1;
                owe_rotation(state, work, &mut out);
                out.output.pending(
                    entry,
                    format!(
                        "{reason} (a session holds a lock on its role or database); tried again in a later run"
                    ),
                );
            }
            Err(Failure::Down(e)) if server.alive().await => {
                // The server answers: what failed was this entry's alone.
                tracing::warn!("{}: {e:#}; tried again next run", entry.key);
                slow.insert(entry.origin.clone());
                out.counts.pending += 1;
                out.output
                    .pending(entry, format!("the server failed this entry: {e:#}"));
            }
            Err(Failure::Down(e)) => {
                out.failure = Some(e);
                return out;
            }
        }
    }
    if deferred > 0 {
        out.counts.pending += deferred;
        // Not at once: the lock is its consumer's, and may be held for long.
        out.output.rerun_within(DEFERRED_RERUN_SECONDS);
    }
    if !left.is_empty() {
        // Later runs go on where this one stopped; meanwhile each keeps what it had.
        let n = left.len();
        for work in left {
            owe_rotation(state, work, &mut out);
            out.output.pending(
                &entries[work.entry],
                format!("{n} databases are being set up; this one comes in a later run"),
            );
        }
        out.counts.pending += n;
        out.output.rerun_within(1);
    }
    for name in &plan.release {
        let made = state.roles[name].clone();
        let origin = made.entry.split(':').next().unwrap_or_default().to_owned();
        if slow.contains(&origin) {
            continue;
        }
        if started.elapsed() >= budget {
            out.output.rerun_within(1);
            break;
        }
        let drop = config.on_release == OnRelease::Drop;
        let marker = names::marker(provider, &made.entry);
        match server.release(name, &marker, drop).await {
            Ok(Released::Done) => {
                out.counts.released += 1;
                if drop {
                    state.roles.remove(name);
                } else if let Some(m) = state.roles.get_mut(name) {
                    m.password = None;
                }
            }
            Ok(found @ (Released::Gone | Released::NotOurs)) => {
                tracing::warn!("{name}: {found:?} on the server; forgotten, not touched");
                state.roles.remove(name);
            }
            Err(Failure::Refused(reason)) => {
                tracing::warn!("{name}: cannot release: {reason}; tried again next run");
                continue;
            }
            Err(Failure::Waited(reason)) => {
                tracing::warn!("{name}: cannot release: {reason}; tried again next run");
                slow.insert(origin);
                out.output.rerun_within(DEFERRED_RERUN_SECONDS);
                continue;
            }
            Err(Failure::Down(e)) if server.alive().await => {
                tracing::warn!("{name}: cannot release: {e:#}; tried again next run");
                continue;
            }
            Err(Failure::Down(e)) => {
                out.failure = Some(e);
                return out;
            }
        }
        out.changed = true;
    }
    out
}

/// The entries the provider's policy refuses, decided from the config alone (no server,
/// no state): what the fleet check holds requests against.
pub fn vet(config: &Config, entries: &[Entry]) -> crate::Refusals {
    let mut out = Reconciled::default();
    plan(config, &State::default(), entries, &mut out);
    out.output.into_refusals()
}

/// Says in the run's notes when the callers' roles may together hold more connections
/// than the server leaves them.
async fn note_capacity(config: &Config, server: &Server, plan: &Plan) {
    let total: i64 = plan.limits.values().map(|n| i64::from(*n)).sum();
    match server.capacity().await {
        Ok(capacity) => {
            if let Some(note) = capacity.shortfall(config, total, plan.callers) {
                tracing::warn!("{note}");
            }
        }
        Err(Failure::Refused(why) | Failure::Waited(why)) => {
            tracing::warn!("cannot read the server's connection settings: {why}");
        }
        Err(Failure::Down(e)) => {
            tracing::warn!("cannot read the server's connection settings: {e:#}");
        }
    }
}

/// How soon to run again when a caller's entries waited for a lock of its own.
const DEFERRED_RERUN_SECONDS: u64 = 30;

/// A rotation asked for (`--force`, `renew`) but not done this run is remembered, so a
/// later run does it although the entry then looks unchanged.
fn owe_rotation(state: &mut State, work: &Work, out: &mut Reconciled) {
    if let Some(m) = state.roles.get_mut(&work.name) {
        if work.why == Why::Rotate && !m.owed {
            m.owed = true;
            out.changed = true;
        }
    }
}

/// `items` reordered in turns: each key's first item, then each key's second, and so
/// on; keys in the order they first appear, items of one key in their order.
fn by_turns<'a, T>(items: Vec<T>, key: impl Fn(&T) -> &'a str) -> Vec<T> {
    let mut index: HashMap<&'a str, usize> = HashMap::new();
    let mut queues: Vec<Vec<T>> = Vec::new();
    for item in items {
        let next = queues.len();
        let i = *index.entry(key(&item)).or_insert(next);
        if i == next {
            queues.push(Vec::new());
        }
        queues[i].push(item);
    }
    let mut turns: Vec<std::vec::IntoIter<T>> = queues.into_iter().map(Vec::into_iter).collect();
    let mut out = Vec::new();
    loop {
        let before = out.len();
        for q in &mut turns {
            out.extend(q.next());
        }
        if out.len() == before {
            return out;
        }
    }
}

/// Sorts every entry into kept, refused (answered here) and work, and lists the roles no
/// entry wants.
fn plan(config: &Config, state: &State, entries: &[Entry], out: &mut Reconciled) -> Plan {
    let mut plan = Plan::default();
    // Name → the entry that has it in this run.
    let mut wanted: HashMap<String, &str> = HashMap::with_capacity(entries.len());
    // Caller → the names of its roles in service after this run.
    let mut by_caller: HashMap<&str, BTreeSet<String>> = HashMap::new();
    // Entries refused this run whose role stays in service.
    let mut stays: Vec<(usize, String)> = Vec::new();
    for (i, entry) in entries.iter().enumerate() {
        let decided = decide(config, state, entry, &wanted);
        let (name, rotate) = match decided {
            Ok(d) => d,
            Err(reason) => {
                // A refused change leaves the database it had in service (its role keeps
                // its password), while the provider still allows that name.
                let stays_in_service = state.roles.iter().find(|(name, m)| {
                    m.entry == entry.key
                        && m.password.is_some()
                        && !wanted.contains_key(*name)
                        && permitted(config, entry, name)
                });
                let reason = match stays_in_service {
                    Some((name, _)) => {
                        wanted.insert(name.clone(), &entry.key);
                        by_caller
                            .entry(entry.origin.as_str())
                            .or_default()
                            .insert(name.clone());
                        stays.push((i, name.clone()));
                        format!("{reason}; the database it had stays in service")
                    }
                    None => reason,
                };
                out.counts.refused += 1;
                out.output.refuse(entry, reason);
                continue;
            }
        };
        let why = match state.roles.get(&name) {
            None => Some(Why::New),
            Some(Made { password: None, .. }) => Some(Why::Reactivate),
            Some(m) if entry.response.is_none() || entry.renew || m.rotate != rotate || m.owed => {
                Some(Why::Rotate)
            }
            Some(_) => None,
        };
        wanted.insert(name.clone(), &entry.key);
        by_caller
            .entry(entry.origin.as_str())
            .or_default()
            .insert(name.clone());
        match why {
            Some(why) => plan.work.push(Work {
                entry: i,
                name,
                rotate,
                why,
                refused: false,
            }),
            None => plan.keep.push((i, name)),
        }
    }
    // Each caller's share split between its roles: one caller's databases together hold
    // no more of the server's connections, however many it asks for.
    for names in by_caller.values() {
        let limits = config.connection_limits(names.len());
        plan.limits.extend(names.iter().cloned().zip(limits));
    }
    plan.callers = by_caller.len();
    let drifted = |name: &str| {
        state
            .roles
            .get(name)
            .is_some_and(|m| Some(&m.connection_limit) != plan.limits.get(name))
    };
    let (relimit, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut plan.keep)
        .into_iter()
        .partition(|(_, name)| drifted(name));
    plan.keep = keep;
    // Before any other work: a caller's roles in service give up their part of its share
    // before a new role of its takes one.
    let relimit: Vec<Work> = relimit
        .into_iter()
        .map(|k| (false, k))
        .chain(
            stays
                .into_iter()
                .filter(|(_, n)| drifted(n))
                .map(|k| (true, k)),
        )
        .map(|(refused, (i, name))| Work {
            entry: i,
            rotate: state.roles.get(&name).map_or(0, |m| m.rotate),
            name,
            why: Why::Limit,
            refused,
        })
        .collect();
    plan.work.splice(0..0, relimit);
    let drop = config.on_release == OnRelease::Drop;
    plan.release = state
        .roles
        .iter()
        .filter(|(name, m)| wanted.get(name.as_str()) != Some(&m.entry.as_str()))
        .filter(|(_, m)| m.password.is_some() || drop)
        .map(|(name, _)| name.clone())
        .collect();
    plan
}

/// The entry's name and requested `rotate`, or why it is refused.
fn decide(
    config: &Config,
    state: &State,
    entry: &Entry,
    wanted: &HashMap<String, &str>,
) -> Result<(String, u64), String> {
    if !is_host_name(&entry.origin) && !is_principal_name(&entry.origin) {
        return Err("the caller's name is not a fort host or principal name".into());
    }
    let request = Request::parse(&entry.request, &config.name_prefix)?;
    let name = match request.name {
        Some(name) => {
            if !config.allow.permits(&entry.origin, &name) {
                return Err(format!(
                    "{} may not have the database {name} (the provider's allow list; {})",
                    entry.origin,
                    config.allow.describe(&entry.origin)
                ));
            }
            name
        }
        None => names::derived(&config.name_prefix, &entry.origin, entry.need.id()),
    };
    let held = state.roles.get(&name).map(|m| m.entry.as_str());
    if held.is_some_and(|k| k != entry.key) || wanted.contains_key(&name) {
        return Err(format!("the database {name} belongs to another entry"));
    }
    Ok((name, request.rotate))
}

/// Whether `entry` may have the database `name`: the one derived for it, or one the
/// provider's allow list gives its caller.
fn permitted(config: &Config, entry: &Entry, name: &str) -> bool {
    name == names::derived(&config.name_prefix, &entry.origin, entry.need.id())
        || config.allow.permits(&entry.origin, name)
}

fn respond_kept(
    config: &Config,
    state: &State,
    entries: &[Entry],
    keep: &[(usize, String)],
    out: &mut Reconciled,
) {
    for (i, name) in keep {
        if let Some(Made {
            password: Some(p), ..
        }) = state.roles.get(name)
        {
            out.output.respond(&entries[*i], response(config, name, p));
            out.counts.kept += 1;
        }
    }
}

/// The credential a consumer gets.
pub fn response(config: &Config, name: &str, password: &str) -> Value {
    let port = config.public_port();
    json!({
        "host": config.host,
        "port": port,
        "dbname": name,
        "user": name,
        "password": password,
        "uri": names::uri(&config.host, port, name, password, name),
    })
}

#[cfg(test)]
#[path = "reconcile_tests.rs"]
mod tests;
