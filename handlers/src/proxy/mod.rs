//! `proxy`: an nginx vhost per entry, a file in the directory the provider's nginx.conf
//! includes, forwarding the entry's server names to its caller's own address (or a host
//! the provider lets it name), over TLS with a certificate set the provider declared.
//!
//! A run writes every new or changed vhost, removes released ones, and runs the test
//! command once. When the test fails, the changes are taken back, the configuration
//! without them is tested, and the changed entries are tested again in halves (bisection)
//! until the ones that break it are found: those are refused with nginx's reason, the
//! rest is kept, and nginx is reloaded once. Unchanged entries cost no write and no
//! command; a run with nothing to change runs neither.

mod bisect;
pub mod config;
pub mod nginx;
pub mod reconcile;
pub mod request;
mod set_aside;
pub mod vhost;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, Instant};

use crate::common::hosts::Fleet;
use crate::common::state::StateFile;
use crate::common::{Entry, Output, Trigger};
use crate::{Capability, RunFuture};

use config::Config;
use nginx::{Dir, Ran};
use reconcile::{Broken, State, Want, STATE_VERSION};

pub const CAPABILITY: Capability = Capability {
    name: "proxy",
    about: "an nginx vhost per entry, tested with nginx -t before every reload",
    check,
    run,
    vet,
    answers: &["server_names", "upstream", "tls"],
    failover: crate::Failover::OneProvider(
        "two edges serving the same names would each hold the vhost, and a standby does not adopt what another edge made",
    ),
};

/// Past this, no further test is started: the agent kills a run at 60 s.
pub(super) const BUDGET: Duration = Duration::from_secs(40);

fn check(path: &Path) -> anyhow::Result<()> {
    let config = Config::load(path)?;
    Fleet::load(&config.hosts)?;
    Ok(())
}

fn vet(path: &Path, fleet: &Fleet, entries: &[Entry]) -> anyhow::Result<crate::Refusals> {
    let config = Config::load(path)?;
    let none = BTreeSet::new();
    let plan = reconcile::plan(
        &config,
        entries,
        &BTreeMap::new(),
        |o| fleet.host_of(o),
        &none,
    );
    Ok(plan.refused)
}

fn run(path: &Path, entries: Vec<Entry>, trigger: Trigger) -> RunFuture<'_> {
    Box::pin(async move {
        let config = Config::load(path)?;
        reconcile_all(&config, entries, trigger).await
    })
}

/// Counts for the run's notes (stderr).
#[derive(Default)]
pub(super) struct Notes {
    written: usize,
    removed: usize,
    tests: usize,
    reloaded: bool,
    refused: Vec<String>,
}

/// The test command, counted.
pub(super) async fn test(config: &Config, notes: &mut Notes) -> anyhow::Result<Ran> {
    notes.tests += 1;
    nginx::run(&config.test_command, timeout(config)).await
}

fn timeout(config: &Config) -> Duration {
    Duration::from_secs(config.command_timeout_seconds)
}

pub async fn reconcile_all(
    config: &Config,
    entries: Vec<Entry>,
    trigger: Trigger,
) -> anyhow::Result<Output> {
    let started = Instant::now();
    let fleet = Fleet::load(&config.hosts)?;
    let file = StateFile::new(&config.state_file);
    let mut state: State = file.load(STATE_VERSION)?;
    let mut dir = Dir::new(&config.include_dir);
    let none = BTreeSet::new();
    let mut plan = reconcile::plan(config, &entries, &state.held, |o| fleet.host_of(o), &none);
    // A refused entry whose vhost in place the provider still allows keeps it in service
    // (its names stay reserved for it) until a change of it is accepted.
    let mut stays = BTreeSet::new();
    for e in entries.iter().filter(|e| plan.refused.contains_key(&e.key)) {
        let Some(h) = state.held.get(&e.key) else {
            continue;
        };
        let own = fleet.host_of(&e.origin);
        if dir
            .read(&h.file)?
            .is_some_and(|text| reconcile::still_served(config, e, h, &text, own.as_deref()))
        {
            stays.insert(e.key.clone());
        }
    }
    if !stays.is_empty() {
        plan = reconcile::plan(config, &entries, &state.held, |o| fleet.host_of(o), &stays);
    }
    let mut wanted = plan.wanted;
    let kept = plan.kept;
    let tls_waits = serve_plain_until_certified(config, &mut wanted);
    let mut refused = plan.refused;
    for key in &kept {
        if let Some(why) = refused.get_mut(key) {
            why.push_str("; the vhost it had stays in service");
        }
    }
    let reconciling = trigger.reconciles();
    let mut notes = Notes::default();
    let mut save = false;

    // Vhosts the test refused before, asked for unchanged: refused again without a test.
    let before = state.broken.len();
    state
        .broken
        .retain(|key, b| !reconciling && wanted.get(key).is_some_and(|w| w.digest == b.digest));
    save |= state.broken.len() != before;
    for (key, b) in &state.broken {
        refused.insert(
            key.clone(),
            refusal(&b.reason, state.held.contains_key(key)),
        );
    }

    // New and changed vhosts; on reconciling runs also those changed on disk.
    let mut changes: Vec<String> = Vec::new();
    for (key, want) in &wanted {
        if refused.contains_key(key) {
            continue;
        }
        match state.held.get(key) {
            Some(h) if h.file == want.file && h.digest == want.digest => {
                if reconciling && dir.read(&want.file)?.as_deref() != Some(&want.text) {
                    changes.push(key.clone());
                }
            }
            _ => changes.push(key.clone()),
        }
    }
    // A file that is there must carry this entry's marker: anything else is the admin's.
    let mut foreign = Vec::new();
    for key in &changes {
        let want = &wanted[key];
        if let Some(text) = dir.read(&want.file)? {
            if !vhost::has_marker(&text, Some(key)) {
                foreign.push(key.clone());
            }
        }
    }
    for key in foreign {
        changes.retain(|k| *k != key);
        let path = dir.path_of(&wanted[&key].file);
        refused.insert(
            key.clone(),
            format!(
                "{} was not written by fort; it is left alone",
                path.display()
            ),
        );
        if state.held.remove(&key).is_some() {
            save = true;
        }
    }
    // Files of entries no longer wanted, or refused for what they ask now; on reconciling
    // runs also files with fort's marker that no state records (a run cut short).
    let mut removals: Vec<String> = Vec::new();
    let mut forget: Vec<String> = Vec::new();
    for (key, h) in &state.held {
        if wanted.contains_key(key) || kept.contains(key) {
            continue;
        }
        match dir.read(&h.file)? {
            Some(text) if vhost::has_marker(&text, Some(key)) => removals.push(h.file.clone()),
            _ => {}
        }
        forget.push(key.clone());
    }
    if reconciling {
        removals.extend(orphans(config, &state, &wanted, &mut dir)?);
    }

    if changes.is_empty() && removals.is_empty() && !state.reload_owed {
        for key in forget {
            state.held.remove(&key);
            save = true;
        }
        if save {
            file.save(STATE_VERSION, &state)?;
        }
        return Ok(answer(
            &entries,
            &state,
            &wanted,
            &refused,
            &Waiting {
                untested: &BTreeSet::new(),
                conflicts: &BTreeMap::new(),
                tls: &tls_waits,
            },
            &mut notes,
            started,
        ));
    }

    // Previous contents, to take a change back.
    let mut previous: BTreeMap<String, Option<String>> = BTreeMap::new();
    for f in changes.iter().map(|k| &wanted[k].file).chain(&removals) {
        previous.insert(f.clone(), dir.read(f)?);
    }
    for f in &removals {
        dir.set(f, None)?;
    }
    for key in &changes {
        let w = &wanted[key];
        dir.set(&w.file, Some(&w.text))?;
    }
    let mut accepted: Vec<String> = Vec::new();
    let mut untested: BTreeSet<String> = BTreeSet::new();
    let mut conflicts: BTreeMap<String, String> = BTreeMap::new();
    // Vhosts in place that nginx refuses now on their own: taken out, with the reason.
    let mut taken_out: Vec<(String, String)> = Vec::new();
    if !changes.is_empty() {
        match test(config, &mut notes).await {
            Err(e) => {
                restore(&mut dir, &previous)?;
                return Err(e.context("the vhosts could not be tested; nothing changed"));
            }
            Ok(Ran::Passed) => accepted = changes.clone(),
            Ok(Ran::Failed(output)) => {
                for key in &changes {
                    dir.set(&wanted[key].file, previous[&wanted[key].file].as_deref())?;
                }
                // What bisection takes a failing change back to.
                let mut reset = previous.clone();
                match test(config, &mut notes).await {
                    Ok(Ran::Passed) => {}
                    Ok(Ran::Failed(base)) => {
                        // A vhost in place that fails now on its own is its entry's
                        // failure: taken out, and the others go on.
                        let in_place = set_aside::in_place(&state, &removals, &mut dir)?;
                        let found = set_aside::broken_in_place(
                            config, &mut dir, &in_place, started, &mut notes,
                        )
                        .await;
                        match found {
                            Ok(Some(broken)) => {
                                for (key, reason) in broken {
                                    let v = in_place.iter().find(|v| v.key == key);
                                    let v = v.expect("found among them");
                                    // Restored on a later error, never by bisection.
                                    previous.insert(v.file.clone(), Some(v.text.clone()));
                                    reset.insert(v.file.clone(), None);
                                    taken_out.push((key, reason));
                                }
                            }
                            Ok(None) => {
                                restore(&mut dir, &previous)?;
                                anyhow::bail!(
                                    "the nginx configuration fails its test without any of this \
                                     run's changes, so none is made and nginx is not reloaded: {}",
                                    nginx::reason(&base)
                                );
                            }
                            Err(e) => {
                                restore(&mut dir, &previous)?;
                                return Err(
                                    e.context("the vhosts could not be tested; nothing changed")
                                );
                            }
                        }
                    }
                    Err(e) => {
                        restore(&mut dir, &previous)?;
                        return Err(e.context("the vhosts could not be tested; nothing changed"));
                    }
                }
                let held_files: Vec<String> = state.held.values().map(|h| h.file.clone()).collect();
                let found = bisect::bisect(
                    config,
                    &mut dir,
                    &wanted,
                    &changes,
                    &reset,
                    &held_files,
                    taken_out.is_empty().then_some(output),
                    started,
                    &mut notes,
                )
                .await;
                let found = match found {
                    Ok(f) => f,
                    Err(e) => {
                        restore(&mut dir, &previous)?;
                        return Err(e.context("the vhosts could not be tested; nothing changed"));
                    }
                };
                accepted = found.accepted;
                untested = found.untested;
                for (key, reason) in found.conflicts {
                    conflicts.insert(key, reason);
                }
                for (key, reason) in found.culprits {
                    refused.insert(key.clone(), refusal(&reason, state.held.contains_key(&key)));
                    state.broken.insert(
                        key.clone(),
                        Broken {
                            digest: wanted[&key].digest.clone(),
                            reason,
                        },
                    );
                }
            }
        }
    }

    // The directory now holds what was accepted: flushed, recorded, then loaded.
    dir.sync()?;
    for key in forget {
        state.held.remove(&key);
    }
    for (key, reason) in &taken_out {
        if accepted.contains(key) {
            continue;
        }
        state.held.remove(key);
        refused.insert(
            key.clone(),
            format!("nginx refuses the vhost it had, which is taken out: {reason}"),
        );
    }
    for key in &accepted {
        state.held.insert(key.clone(), wanted[key].held());
        state.broken.remove(key);
    }
    notes.written = accepted.len();
    notes.removed = removals.len() + taken_out.len();
    if !accepted.is_empty() || !removals.is_empty() || !taken_out.is_empty() {
        state.reload_owed = true;
    }
    if state.reload_owed {
        file.save(STATE_VERSION, &state)?;
        match nginx::run(&config.reload_command, timeout(config)).await {
            Ok(Ran::Passed) => state.reload_owed = false,
            Ok(Ran::Failed(out)) => {
                anyhow::bail!(
                    "the reload failed (tried again next run): {}",
                    nginx::reason(&out)
                )
            }
            Err(e) => return Err(e.context("the reload failed (tried again next run)")),
        }
        notes.reloaded = true;
    }
    file.save(STATE_VERSION, &state)?;
    let waiting = Waiting {
        untested: &untested,
        conflicts: &conflicts,
        tls: &tls_waits,
    };
    let mut output = answer(
        &entries, &state, &wanted, &refused, &waiting, &mut notes, started,
    );
    if !taken_out.is_empty() {
        // Tested again soon as a new vhost: what failed may have been passing (a name
        // that did not resolve for a moment); what fails again is remembered as broken.
        output.rerun_within(TAKEN_OUT_RERUN_SECONDS);
    }
    Ok(output)
}

/// How soon a run looks again for a TLS set's certificate that is not there yet.
const TLS_RECHECK_SECONDS: u64 = 30;

/// Vhosts whose TLS set has no certificate or key file yet are written for plain HTTP
/// meanwhile (with the challenge answers, so the certificate can be ordered through
/// them): a set's files often come from a certificate need of this host, which may be
/// answered only after the vhost asks. Returns entry key → why it waits.
fn serve_plain_until_certified(
    config: &Config,
    wanted: &mut BTreeMap<String, reconcile::Want>,
) -> BTreeMap<String, String> {
    let absent = |p: &Path| {
        std::fs::symlink_metadata(p).is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound)
    };
    let mut ready: BTreeMap<String, bool> = BTreeMap::new();
    let mut waits = BTreeMap::new();
    for (key, want) in wanted.iter_mut() {
        let Some(name) = want.vhost.tls.clone() else {
            continue;
        };
        let Some(set) = config.tls.get(&name) else {
            continue;
        };
        let here = *ready
            .entry(name.clone())
            .or_insert_with(|| !absent(&set.certificate) && !absent(&set.key));
        if !here {
            let plain = request::Vhost {
                tls: None,
                ..want.vhost.clone()
            };
            want.text = vhost::render(config, key, &plain);
            want.digest = vhost::digest(&want.text);
            waits.insert(
                key.clone(),
                format!(
                    "served over plain HTTP until the certificate of {name} ({}) is in place",
                    set.certificate.display()
                ),
            );
        }
    }
    waits
}

/// How soon vhosts taken out are tried again.
const TAKEN_OUT_RERUN_SECONDS: u64 = 60;

/// The reason an entry whose vhost failed the test gets.
fn refusal(reason: &str, has_previous: bool) -> String {
    if has_previous {
        format!("nginx refuses the new vhost, the previous one stays: {reason}")
    } else {
        format!("nginx refuses the vhost: {reason}")
    }
}

/// Puts every file back as it was before the run.
fn restore(dir: &mut Dir, previous: &BTreeMap<String, Option<String>>) -> anyhow::Result<()> {
    for (f, text) in previous {
        dir.set(f, text.as_deref())?;
    }
    dir.sync()
}

/// Files named and marked as the handler's that no state records and no entry wants.
fn orphans(
    config: &Config,
    state: &State,
    wanted: &BTreeMap<String, Want>,
    dir: &mut Dir,
) -> anyhow::Result<Vec<String>> {
    let known: BTreeSet<&str> = state
        .held
        .values()
        .map(|h| h.file.as_str())
        .chain(wanted.values().map(|w| w.file.as_str()))
        .collect();
    let listing = match std::fs::read_dir(&config.include_dir) {
        Ok(l) => l,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => anyhow::bail!("cannot list {}: {e}", config.include_dir.display()),
    };
    let mut out = Vec::new();
    for item in listing.flatten() {
        let Ok(name) = item.file_name().into_string() else {
            continue;
        };
        if !vhost::is_ours_by_name(&name) || known.contains(name.as_str()) {
            continue;
        }
        if dir
            .read(&name)?
            .is_some_and(|t| vhost::has_marker(&t, None))
        {
            out.push(name);
        }
    }
    Ok(out)
}

/// Entries left waiting by this run, and why.
struct Waiting<'a> {
    /// Not tested within the budget.
    untested: &'a BTreeSet<String>,
    /// Served over plain HTTP until their TLS set's certificate is in place.
    tls: &'a BTreeMap<String, String>,
    /// Held: they clash with another vhost.
    conflicts: &'a BTreeMap<String, String>,
}

/// One answer per entry, and the run's notes.
fn answer(
    entries: &[Entry],
    state: &State,
    wanted: &BTreeMap<String, Want>,
    refused: &BTreeMap<String, String>,
    waiting: &Waiting,
    notes: &mut Notes,
    started: Instant,
) -> Output {
    let mut output = Output::default();
    let mut pending = 0;
    for e in entries {
        if let Some(why) = refused.get(&e.key) {
            output.refuse(e, why);
            notes.refused.push(format!("{}: {why}", e.key));
        } else if let Some(why) = waiting.tls.get(&e.key).filter(|_| {
            // Its plain vhost is in place (written now or before).
            state
                .held
                .get(&e.key)
                .zip(wanted.get(&e.key))
                .is_some_and(|(h, w)| h.digest == w.digest)
        }) {
            // Looked at again soon: the certificate comes by another need.
            output.pending(e, why);
            output.rerun_within(TLS_RECHECK_SECONDS);
            pending += 1;
        } else if let Some(why) = waiting.conflicts.get(&e.key) {
            // Tried again when a run comes, not sooner: a clash does not pass by itself.
            output.pending(e, why);
            pending += 1;
        } else if waiting.untested.contains(&e.key) {
            output.pending(e, "waiting for its turn at nginx's test");
            output.rerun_within(1);
            pending += 1;
        } else if let Some(w) = wanted
            .get(&e.key)
            .filter(|w| state.held.get(&e.key).is_some_and(|h| h.digest == w.digest))
        {
            output.respond(e, reconcile::response(&w.vhost));
        }
    }
    eprintln!(
        "proxy: {} entries: {} vhosts written, {} removed, {} refused, {pending} waiting; {} tests, {}; {} ms",
        entries.len(),
        notes.written,
        notes.removed,
        notes.refused.len(),
        notes.tests,
        if notes.reloaded { "reloaded" } else { "no reload" },
        started.elapsed().as_millis()
    );
    for line in notes.refused.iter().take(20) {
        eprintln!("proxy: refused {line}");
    }
    output
}
