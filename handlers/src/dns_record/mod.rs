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

use std::future::Future;
use std::sync::Arc;

use crate::common::hosts::Fleet;
use crate::common::isolate::{self, Attempt, Budget};
use crate::common::state::StateFile;
use crate::common::{Entry, Output, Trigger};
use crate::dns::{DnsError, DnsName, Kind, Outcome, Primary, RecordSet, Update};
use crate::{Capability, RunFuture};

use config::{Checked, Config};
use reconcile::{Drift, Plan, State, STATE_VERSION};
use request::{response, Policy};

pub const CAPABILITY: Capability = Capability {
    name: "dns-record",
    about: "A/AAAA/CNAME/TXT records by RFC 2136 updates signed with TSIG",
    check,
    run,
    vet,
    answers: &["name", "type", "values", "ttl"],
    failover: crate::Failover::OneProvider(
        "its providers would share one DNS primary, and a standby does not adopt the records another provider made there",
    ),
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

fn vet(path: &Path, fleet: &Fleet, entries: &[Entry]) -> anyhow::Result<crate::Refusals> {
    let (config, zone) = Config::load_policy(path)?;
    let policy = Policy {
        zone: &zone,
        allow: &config.allow,
        default_ttl: config.default_ttl,
        max_ttl: config.max_ttl,
    };
    Ok(reconcile::plan(entries, &BTreeMap::new(), &policy, |o| fleet.ip_of(o)).refused)
}

fn run(path: &Path, entries: Vec<Entry>, trigger: Trigger) -> RunFuture<'_> {
    Box::pin(async move {
        let checked = Config::load(path)?;
        reconcile_all(&checked, entries, trigger).await
    })
}

/// What happened to one entry's message.
enum Sent<R> {
    Done(R),
    /// The budget ran out before it was sent.
    Skipped,
    /// It failed alone while the primary answered: this entry's own, with the reason.
    Failed(String),
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
    primary: Option<Arc<Primary>>,
}

impl Lazy<'_> {
    async fn get(&mut self) -> Result<Arc<Primary>, DnsError> {
        if self.primary.is_none() {
            self.primary = Some(Arc::new(Primary::connect(&self.checked.server).await?));
        }
        Ok(self.primary.clone().expect("just connected"))
    }

    /// A new connection, in place of one a message may have broken.
    async fn fresh(&mut self) -> Result<Arc<Primary>, DnsError> {
        self.primary = None;
        self.get().await
    }

    /// Each entry's share of the run: as long as the primary may take for two messages.
    fn budget(&self, deadline: Instant, in_flight: usize) -> Budget {
        Budget {
            deadline,
            per_entry: self.checked.server.timeout * 2,
            in_flight,
        }
    }
}

/// Sends every entry's message (an update, or a lookup for a drift check), each under its
/// own time share, `IN_FLIGHT` at a time and none started after `deadline`. When some fail
/// without an answer, the primary is probed on a fresh connection: if it does not answer,
/// it is down and the run fails (`Err`, nothing is answered); if it does, each failed
/// message is sent once more alone, so that a message that breaks the connection takes no
/// other entry's change with it, and what fails again is that entry's own.
async fn send_all<J, R, F, Fut>(
    lazy: &mut Lazy<'_>,
    jobs: Vec<(String, J)>,
    deadline: Instant,
    send: F,
) -> Result<Vec<(String, Sent<R>)>, DnsError>
where
    J: Clone,
    F: Fn(Arc<Primary>, J) -> Fut,
    Fut: Future<Output = Result<R, DnsError>>,
{
    if jobs.is_empty() {
        return Ok(Vec::new());
    }
    let mut by_key: BTreeMap<String, J> = jobs.iter().cloned().collect();
    let primary = lazy.get().await?;
    let first = isolate::each(jobs, lazy.budget(deadline, IN_FLIGHT), |job| {
        send(primary.clone(), job)
    })
    .await;
    let mut out = Vec::with_capacity(first.len());
    let mut again = Vec::new();
    for (key, attempt) in first {
        match attempt {
            Attempt::Done(Ok(r)) => out.push((key, Sent::Done(r))),
            Attempt::NotStarted => out.push((key, Sent::Skipped)),
            Attempt::Done(Err(_)) | Attempt::TimedOut(_) => {
                let job = by_key.remove(&key).expect("every key has its job");
                again.push((key, job));
            }
            Attempt::Panicked(_) => {
                let why = attempt.reason("the handler").unwrap_or_default();
                out.push((key, Sent::Failed(why)));
            }
        }
    }
    if again.is_empty() {
        return Ok(out);
    }
    let primary = lazy.fresh().await?;
    primary.probe().await?;
    let second = isolate::each(again, lazy.budget(deadline, 1), |job| {
        send(primary.clone(), job)
    })
    .await;
    for (key, attempt) in second {
        let sent = match attempt {
            Attempt::Done(Ok(r)) => Sent::Done(r),
            Attempt::NotStarted => Sent::Skipped,
            Attempt::Done(Err(e)) => Sent::Failed(e.to_string()),
            other => Sent::Failed(other.reason("the DNS primary").unwrap_or_default()),
        };
        out.push((key, sent));
    }
    Ok(out)
}

async fn update(primary: Arc<Primary>, update: Update) -> Result<Outcome, DnsError> {
    primary.update(&update).await
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
    // Set when the primary is down: what was done is recorded, nothing is answered.
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
    match send_all(&mut primary, removals, deadline, update).await {
        Err(e) => failure = Some(e),
        Ok(sent) => {
            for (key, sent) in sent {
                match sent {
                    Sent::Done(Outcome::Applied) => {
                        state.held.remove(&key);
                        notes.removed += 1;
                        dirty = true;
                    }
                    // Kept in the state: tried again next run, never forgotten.
                    Sent::Done(Outcome::Rejected(why)) | Sent::Failed(why) => {
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
                }
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
    match send_all(&mut primary, changes, deadline, update).await {
        Err(e) => failure = failure.or(Some(e)),
        Ok(sent) => {
            for (key, sent) in sent {
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
                    Sent::Done(Outcome::Rejected(why)) | Sent::Failed(why) => {
                        let why = match state.held.contains_key(&key) {
                            true => format!("its previous records stay: {why}"),
                            false => why,
                        };
                        refused.insert(key, why);
                    }
                    Sent::Skipped => {
                        pending.insert(key, "waiting for its turn at the DNS primary");
                    }
                }
            }
        }
    }

    // 3. On runs that reconcile with the world: are our records still there?
    if failure.is_none() && trigger.reconciles() && !unchanged.is_empty() {
        notes.checked = unchanged.len();
        match check_drift(&mut primary, &unchanged, &state.held, deadline).await {
            Err(e) => failure = Some(e),
            Ok(fixes) => {
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
                match send_all(&mut primary, jobs, deadline, update).await {
                    Err(e) => failure = Some(e),
                    Ok(sent) => {
                        for (key, sent) in sent {
                            let yielding = yields.contains_key(&key);
                            match sent {
                                Sent::Done(Outcome::Applied) if yielding => {
                                    state.held.remove(&key);
                                    dirty = true;
                                }
                                Sent::Done(Outcome::Applied) => notes.restored += 1,
                                // What is missing could not be put back; what is left is
                                // still ours.
                                Sent::Done(Outcome::Rejected(why)) | Sent::Failed(why)
                                    if !yielding =>
                                {
                                    refused.insert(key, why);
                                }
                                // What is left of ours could not be deleted: it stays
                                // recorded.
                                Sent::Done(Outcome::Rejected(why)) | Sent::Failed(why) => {
                                    notes.kept.push(format!("{key}: {why}"))
                                }
                                Sent::Skipped => {}
                            }
                        }
                    }
                }
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

/// Looks up every unchanged entry's record set at the primary (none started after
/// `deadline`; the rest wait for the next such run). A lookup that fails alone leaves its
/// entry as it is.
async fn check_drift(
    primary: &mut Lazy<'_>,
    keys: &[String],
    held: &BTreeMap<String, RecordSet>,
    deadline: Instant,
) -> Result<Vec<(String, Drift)>, DnsError> {
    let jobs: Vec<(String, (DnsName, Kind))> = keys
        .iter()
        .map(|k| (k.clone(), (held[k].name.clone(), held[k].kind)))
        .collect();
    let looked = send_all(primary, jobs, deadline, |p, (name, kind)| async move {
        p.lookup(&name, kind).await
    })
    .await?;
    Ok(looked
        .into_iter()
        .filter_map(|(key, sent)| match sent {
            Sent::Done(present) => {
                let drift = reconcile::drift(&held[&key], &present, held);
                Some((key, drift))
            }
            Sent::Skipped | Sent::Failed(_) => None,
        })
        .collect())
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
