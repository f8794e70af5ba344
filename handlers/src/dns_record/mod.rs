//! `dns-record`: A, AAAA, CNAME and TXT records in one zone, made by RFC 2136 updates
//! signed with TSIG to the zone's primary, one record set per entry, at names the
//! provider allows the caller. The handler records what it created and deletes only that;
//! on `initialize`, `systemd` and `manual` runs it checks that the records are still there.

pub mod config;
pub mod reconcile;
pub mod request;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use futures_util::stream::{self, StreamExt};

use crate::common::hosts::Fleet;
use crate::common::state::StateFile;
use crate::common::{Entry, Output, Trigger};
use crate::dns::{DnsError, Outcome, Primary, RecordSet, Update};
use crate::{Capability, RunFuture};

use config::{Checked, Config};
use reconcile::{Drift, Plan, State, STATE_VERSION};
use request::{response, Policy};

pub const CAPABILITY: Capability = Capability {
    name: "dns-record",
    about: "A/AAAA/CNAME/TXT records by RFC 2136 updates signed with TSIG",
    check,
    run,
};

/// Updates in flight at once on the one connection: enough to hide the round trip, few
/// enough that a primary writing its journal per update is not flooded.
const IN_FLIGHT: usize = 16;
/// Past this, no new message is started: the agent kills a run at 60 s, and a run killed
/// between an update and the state write would forget what it created.
const BUDGET: Duration = Duration::from_secs(30);
/// How soon to be run again when the budget ran out with work left.
const RERUN_SECONDS: u64 = 1;

fn check(path: &Path) -> anyhow::Result<()> {
    let checked = Config::load(path)?;
    Fleet::load(&checked.config.hosts)?;
    Ok(())
}

fn run(path: &Path, entries: Vec<Entry>, trigger: Trigger) -> RunFuture<'_> {
    Box::pin(async move {
        let checked = Config::load(path)?;
        reconcile_all(&checked, entries, trigger).await
    })
}

/// What happened to one message.
enum Sent {
    Done(Outcome),
    /// The budget ran out before it was sent.
    Skipped,
    Failed(DnsError),
}

/// Counts for the run's notes (stderr).
#[derive(Default)]
struct Notes {
    created: usize,
    changed: usize,
    removed: usize,
    checked: usize,
    restored: usize,
    refused: Vec<String>,
    kept: Vec<String>,
}

/// The connection, opened on first use: a run with nothing to change never connects.
struct Lazy<'a> {
    checked: &'a Checked,
    primary: Option<Primary>,
}

impl Lazy<'_> {
    async fn get(&mut self) -> Result<&Primary, DnsError> {
        if self.primary.is_none() {
            self.primary = Some(Primary::connect(&self.checked.server).await?);
        }
        Ok(self.primary.as_ref().expect("just connected"))
    }
}

/// Sends `jobs` (key, update), `IN_FLIGHT` at a time, none started after `deadline`.
async fn send_all(
    primary: &Primary,
    jobs: Vec<(String, Update)>,
    deadline: Instant,
) -> Vec<(String, Sent)> {
    stream::iter(jobs)
        .map(|(key, update)| async move {
            if Instant::now() >= deadline {
                return (key, Sent::Skipped);
            }
            match primary.update(&update).await {
                Ok(outcome) => (key, Sent::Done(outcome)),
                Err(e) => (key, Sent::Failed(e)),
            }
        })
        .buffer_unordered(IN_FLIGHT)
        .collect()
        .await
}

pub async fn reconcile_all(
    checked: &Checked,
    entries: Vec<Entry>,
    trigger: Trigger,
) -> anyhow::Result<Output> {
    let started = Instant::now();
    let deadline = started + BUDGET;
    let config = &checked.config;
    let fleet = Fleet::load(&config.hosts)?;
    let file = StateFile::new(&config.state);
    let mut state: State = file.load(STATE_VERSION)?;
    match &state.zone {
        Some(zone) if *zone != checked.zone && !state.held.is_empty() => anyhow::bail!(
            "{} holds records fort made in the zone {zone}, and the config now names {}: \
             delete those records by hand and remove the state file, or keep the zone",
            file.path().display(),
            checked.zone
        ),
        _ => state.zone = Some(checked.zone.clone()),
    }
    let policy = Policy {
        zone: &checked.zone,
        allow: &config.allow,
        default_ttl: config.default_ttl,
        max_ttl: config.max_ttl,
    };
    let Plan {
        wanted,
        mut refused,
    } = reconcile::plan(&entries, &state.held, &policy, |o| fleet.ip_of(o));
    let mut notes = Notes::default();
    let mut pending: BTreeMap<String, &'static str> = BTreeMap::new();
    let mut primary = Lazy {
        checked,
        primary: None,
    };
    let mut failure: Option<DnsError> = None;
    let mut dirty = false;

    // 1. Records of entries that are gone, refused, or moved to another name or type.
    let mut removals: Vec<(String, Update)> = Vec::new();
    let mut shared_only: Vec<String> = Vec::new();
    for (key, holding) in &state.held {
        if wanted.get(key).is_some_and(|w| w.same_slot(holding)) {
            continue;
        }
        match reconcile::removal(key, holding, &state.held, &wanted) {
            Some(update) => removals.push((key.clone(), update)),
            // Every value is another entry's too: nothing to delete, only to forget.
            None => shared_only.push(key.clone()),
        }
    }
    for key in shared_only {
        state.held.remove(&key);
        dirty = true;
    }
    if !removals.is_empty() {
        let p = primary.get().await?;
        for (key, sent) in send_all(p, removals, deadline).await {
            match sent {
                Sent::Done(Outcome::Applied) => {
                    state.held.remove(&key);
                    notes.removed += 1;
                    dirty = true;
                }
                Sent::Done(Outcome::Rejected(why)) => {
                    // Kept in the state: tried again next run, never forgotten.
                    notes.kept.push(format!("{key}: {why}"));
                    if wanted.contains_key(&key) {
                        refused.insert(key, format!("its previous records stay: {why}"));
                    }
                }
                Sent::Skipped => {
                    if wanted.contains_key(&key) {
                        pending.insert(key, "waiting for its turn at the DNS primary");
                    }
                }
                Sent::Failed(e) => failure = failure.or(Some(e)),
            }
        }
    }

    // 2. Entries whose record set is new or changed.
    let mut unchanged: Vec<String> = Vec::new();
    let mut changes: Vec<(String, Update)> = Vec::new();
    if failure.is_none() {
        for (key, want) in &wanted {
            if refused.contains_key(key) || pending.contains_key(key) {
                continue;
            }
            let holding = state.held.get(key);
            if holding == Some(want) {
                unchanged.push(key.clone());
                continue;
            }
            let update = reconcile::change(key, holding, want, &state.held, &wanted);
            changes.push((key.clone(), update));
        }
    }
    if !changes.is_empty() {
        let p = primary.get().await?;
        for (key, sent) in send_all(p, changes, deadline).await {
            match sent {
                Sent::Done(Outcome::Applied) => {
                    let want = wanted[&key].clone();
                    if state.held.insert(key, want).is_some() {
                        notes.changed += 1;
                    } else {
                        notes.created += 1;
                    }
                    dirty = true;
                }
                Sent::Done(Outcome::Rejected(why)) => {
                    refused.insert(key, why);
                }
                Sent::Skipped => {
                    pending.insert(key, "waiting for its turn at the DNS primary");
                }
                Sent::Failed(e) => failure = failure.or(Some(e)),
            }
        }
    }

    // 3. On runs that reconcile with the world: are our records still there?
    if failure.is_none() && trigger.reconciles() && !unchanged.is_empty() {
        let p = primary.get().await?;
        let (fixes, failed) = check_drift(p, &unchanged, &state.held, deadline).await;
        notes.checked = unchanged.len();
        failure = failed;
        let mut jobs = Vec::new();
        let mut yields = BTreeMap::new();
        for (key, drift) in fixes {
            match drift {
                Drift::InPlace => {}
                Drift::Restore(update) => jobs.push((key, update)),
                Drift::Yield(update, why) => {
                    refused.insert(key.clone(), why.clone());
                    match update {
                        Some(update) => {
                            jobs.push((key.clone(), update));
                            yields.insert(key, why);
                        }
                        None => {
                            state.held.remove(&key);
                            dirty = true;
                        }
                    }
                }
            }
        }
        for (key, sent) in send_all(p, jobs, deadline).await {
            let yielding = yields.contains_key(&key);
            match sent {
                Sent::Done(Outcome::Applied) if yielding => {
                    state.held.remove(&key);
                    dirty = true;
                }
                Sent::Done(Outcome::Applied) => notes.restored += 1,
                // What is missing could not be put back; what is left is still ours.
                Sent::Done(Outcome::Rejected(why)) if !yielding => {
                    refused.insert(key, why);
                }
                // What is left of ours could not be deleted: it stays recorded.
                Sent::Done(Outcome::Rejected(why)) => notes.kept.push(format!("{key}: {why}")),
                Sent::Skipped => {}
                Sent::Failed(e) => failure = failure.or(Some(e)),
            }
        }
    }

    // What was created is recorded before anything else can go wrong.
    if dirty {
        file.save(STATE_VERSION, &state)?;
    }
    if let Some(e) = failure {
        return Err(anyhow::anyhow!(e).context("nothing is answered this run"));
    }

    let mut output = Output::default();
    for e in &entries {
        if let Some(why) = refused.get(&e.key) {
            output.refuse(e, why);
            notes.refused.push(format!("{}: {why}", e.key));
        } else if let Some(why) = pending.get(&e.key) {
            output.pending(e, why);
        } else if let Some(set) = state
            .held
            .get(&e.key)
            .filter(|h| wanted.get(&e.key) == Some(*h))
        {
            output.respond(e, response(set));
        }
    }
    if !pending.is_empty() {
        output.rerun_within(RERUN_SECONDS);
    }
    log_notes(&notes, entries.len(), pending.len(), started.elapsed());
    Ok(output)
}

/// Looks up every unchanged entry's record set at the primary (`IN_FLIGHT` at a time,
/// none started after `deadline`; the rest wait for the next such run).
async fn check_drift(
    primary: &Primary,
    keys: &[String],
    held: &BTreeMap<String, RecordSet>,
    deadline: Instant,
) -> (Vec<(String, Drift)>, Option<DnsError>) {
    let results: Vec<_> = stream::iter(keys)
        .map(|key| async move {
            if Instant::now() >= deadline {
                return None;
            }
            let set = &held[key];
            Some((key.clone(), primary.lookup(&set.name, set.kind).await))
        })
        .buffer_unordered(IN_FLIGHT)
        .collect()
        .await;
    let mut out = Vec::new();
    let mut failure = None;
    for (key, answer) in results.into_iter().flatten() {
        match answer {
            Ok(present) => out.push((key.clone(), reconcile::drift(&held[&key], &present, held))),
            Err(e) => failure = failure.or(Some(e)),
        }
    }
    (out, failure)
}

/// The run's notes: counts, and each refusal and kept record on its own line (the agent
/// keeps the first 2 KiB). Names only, never key material.
fn log_notes(notes: &Notes, entries: usize, pending: usize, took: Duration) {
    eprintln!(
        "dns-record: {entries} entries: {} created, {} changed, {} removed, {} refused, {pending} waiting; {} checked at the primary, {} restored; {} ms",
        notes.created,
        notes.changed,
        notes.removed,
        notes.refused.len(),
        notes.checked,
        notes.restored,
        took.as_millis()
    );
    for line in notes.refused.iter().take(20) {
        eprintln!("dns-record: refused {line}");
    }
    for line in notes.kept.iter().take(20) {
        eprintln!("dns-record: could not delete {line}; it stays recorded and is tried again");
    }
}
