//! Every entry in, every answer out: per entry, the repository it may reach with the key
//! its consumer made, within its caller's quota; released repositories lose their key at
//! once and their data after the retention.
//!
//! Decided without touching the disk for an entry that did not change: the directory is
//! made for a new entry (and looked at again on `initialize`, `systemd` and `manual`
//! runs), and the `authorized_keys` file is written by the caller of [`reconcile`] from
//! the state it leaves.

use std::collections::{BTreeMap, BTreeSet};

use fort_core::names::parse_entry_key;
use serde_json::{json, Value};

use super::access::{self, Owner};
use super::config::Config;
use super::request::Request;
use super::size::Size;
use super::state::{Repo, State};
use crate::common::entries::payload_sha256;
use crate::common::{Entry, Output};

/// What one run did, for the log.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub kept: usize,
    pub created: usize,
    /// A new key, a new quota or access, or a renewal.
    pub changed: usize,
    pub refused: usize,
    pub pending: usize,
    pub released: usize,
    /// Released repositories whose retention passed: their data removed.
    pub removed: usize,
}

/// What the provider's policy makes of one request, before the disk is touched.
struct Wanted {
    request: Request,
    quota: u64,
}

/// The policy's decision for one entry: what it may have, or why not.
fn wanted(config: &Config, entry: &Entry) -> Result<Wanted, String> {
    let request = Request::parse(&entry.request)?;
    let id = entry.need.id();
    if !request.append_only && !config.full_access.permits(&entry.origin, id) {
        return Err(format!(
            "{} may not have full access (append_only = false) to repository {id} ({}); its key may only add archives",
            entry.origin,
            config.full_access.describe(&entry.origin)
        ));
    }
    let quota = request.quota.unwrap_or(config.quota.0);
    if quota > config.max_quota() {
        return Err(format!(
            "quota {} is above the {} one repository may have",
            Size(quota),
            Size(config.max_quota())
        ));
    }
    if quota < Size::MIN_QUOTA {
        return Err(format!("quota {} is below borg's least, 10M", Size(quota)));
    }
    Ok(Wanted { request, quota })
}

/// The quota one caller's repositories may add up to, and what they hold so far.
struct Budget {
    cap: u64,
    used: BTreeMap<String, u64>,
}

impl Budget {
    /// `Err` when `quota` more for `origin` would pass its cap.
    fn take(&mut self, origin: &str, quota: u64) -> Result<(), String> {
        let used = self.used.entry(origin.to_owned()).or_default();
        let total = used.saturating_add(quota);
        if total > self.cap {
            return Err(format!(
                "the quotas of {origin}'s repositories, the released ones still kept included, would add up to {}, more than the {} one caller may have",
                Size(total),
                Size(self.cap)
            ));
        }
        *used = total;
        Ok(())
    }
}

/// The entries the provider's policy refuses, decided from the config alone (no state,
/// no disk): what the fleet check holds requests against.
pub fn vet(config: &Config, entries: &[Entry]) -> crate::Refusals {
    let mut budget = Budget {
        cap: config.quota_per_caller(),
        used: BTreeMap::new(),
    };
    let keys = shared_keys(entries);
    let mut out = crate::Refusals::new();
    for e in entries {
        let decided = wanted(config, e).and_then(|w| {
            if keys.contains(&w.request.public_key) {
                return Err(SHARED_KEY.into());
            }
            budget.take(&e.origin, w.quota)
        });
        if let Err(why) = decided {
            out.insert(e.key.clone(), why);
        }
    }
    out
}

/// sshd takes the first line with a key, so a key reaches one repository only.
const SHARED_KEY: &str = "public_key is another repository's key (or a kept one's)";

/// Keys more than one entry asks with.
fn shared_keys(entries: &[Entry]) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut shared = BTreeSet::new();
    for e in entries {
        if let Ok(r) = Request::parse(&e.request) {
            if !seen.insert(r.public_key.clone()) {
                shared.insert(r.public_key);
            }
        }
    }
    shared
}

/// The run's inputs besides the entries.
pub struct Run<'a> {
    pub config: &'a Config,
    /// The server's known_hosts lines, in every response.
    pub known_hosts: &'a str,
    pub owner: &'a Owner,
    pub now: u64,
    /// Look at every repository's directory (a run that reconciles with the disk).
    pub look: bool,
}

/// Decides every entry and changes `state`; true in the second member when the state
/// must be saved. The caller writes the `authorized_keys` file from the state, then the
/// state, then prints the output.
pub fn reconcile(run: &Run, state: &mut State, entries: &[Entry]) -> (Output, Counts, bool) {
    let config = run.config;
    let now = run.now;
    let mut counts = Counts::default();
    let mut changed = false;
    let mut output = Output::default();
    let present: BTreeSet<&str> = entries.iter().map(|e| e.key.as_str()).collect();

    // Released: the key stops reaching the repository now; the data stays.
    for (key, repo) in state.repos.iter_mut() {
        if repo.released_at.is_none() && !present.contains(key.as_str()) {
            repo.released_at = Some(now);
            counts.released += 1;
            changed = true;
            tracing::info!(entry = %key, path = %repo.path.display(), "released: its key no longer reaches the repository; the data is kept");
        }
    }
    // Kept past the retention: removed, unless asked for again.
    let retention = config.retention.as_secs();
    let expired: Vec<String> = state
        .repos
        .iter()
        .filter(|(k, r)| {
            !present.contains(k.as_str())
                && r.released_at
                    .is_some_and(|t| t.saturating_add(retention) <= now)
        })
        .map(|(k, _)| k.clone())
        .collect();
    // Those that cannot be removed are tried again within the hour, not at once.
    let mut stuck = BTreeSet::new();
    for key in expired {
        let path = state.repos[&key].path.clone();
        match access::remove_repository(config, &path) {
            Ok(access::Removal::Done) => {
                state.repos.remove(&key);
                counts.removed += 1;
                changed = true;
                tracing::info!(entry = %key, path = %path.display(), "retention passed: the repository is removed");
            }
            Ok(access::Removal::Partly) => {
                tracing::info!(entry = %key, path = %path.display(), "retention passed: part of the repository is removed, the rest in the next run");
            }
            Err(e) => {
                tracing::warn!(entry = %key, error = %e, "a repository past its retention stays");
                stuck.insert(key);
            }
        }
    }
    if !stuck.is_empty() {
        output.rerun_within(3600);
    }

    // Every caller's quota: what its kept (released) repositories hold first, then its
    // entries that have a repository, then new ones, so that nothing it already has is
    // pushed out by something new.
    let mut budget = Budget {
        cap: config.quota_per_caller(),
        used: BTreeMap::new(),
    };
    for (key, repo) in &state.repos {
        if !present.contains(key.as_str()) {
            if let Some((origin, _)) = parse_entry_key(key) {
                let used = budget.used.entry(origin.to_owned()).or_default();
                *used = used.saturating_add(repo.quota);
            }
        }
    }
    // Who holds a key: a key reaches one repository only (sshd takes the first line
    // that has it), so another entry asking with it is refused; so is a key of a
    // released repository still kept, which its own consumer may still hold.
    let holders: BTreeMap<String, String> = state
        .repos
        .iter()
        .map(|(k, r)| (r.key.clone(), k.clone()))
        .collect();
    let shared = shared_keys(entries);
    let (existing, new): (Vec<&Entry>, Vec<&Entry>) = entries
        .iter()
        .partition(|e| state.repos.contains_key(&e.key));

    for entry in existing.into_iter().chain(new) {
        let decided = wanted(config, entry).and_then(|w| {
            let key = &w.request.public_key;
            match holders.get(key) {
                Some(holder) if holder != &entry.key => return Err(SHARED_KEY.into()),
                None if shared.contains(key) => return Err(SHARED_KEY.into()),
                _ => {}
            }
            budget.take(&entry.origin, w.quota).map(|()| w)
        });
        let w = match decided {
            Ok(w) => w,
            Err(reason) => {
                changed |= refuse(run, state, &mut budget, entry, reason, &mut output);
                counts.refused += 1;
                continue;
            }
        };
        let path = match access::repository_path(config, &entry.origin, entry.need.id()) {
            Ok(p) => p,
            Err(reason) => {
                output.refuse(entry, reason);
                counts.refused += 1;
                continue;
            }
        };
        let old = state.repos.get(&entry.key).cloned();
        let reopened = old.as_ref().is_some_and(|r| r.released_at.is_some());
        if old.is_none() || reopened || run.look {
            if let Err(e) = access::make_repository(config, &path, run.owner) {
                // The disk's or the account's trouble, never the caller's: it waits.
                tracing::warn!(entry = %entry.key, error = %e, "repository not made");
                output.pending(entry, format!("{e}; tried again in a later run"));
                counts.pending += 1;
                continue;
            }
        }
        let rotated = old.as_ref().is_some_and(|r| r.key != w.request.public_key);
        let repo = Repo {
            path,
            key: w.request.public_key.clone(),
            key_since: match &old {
                Some(r) if !rotated && !entry.renew && !reopened => r.key_since,
                _ => now,
            },
            quota: w.quota,
            append_only: w.request.append_only,
            released_at: None,
        };
        match &old {
            None => {
                counts.created += 1;
                tracing::info!(entry = %entry.key, path = %repo.path.display(), quota = repo.quota, append_only = repo.append_only, "repository made");
            }
            Some(o) if *o != repo => {
                counts.changed += 1;
                tracing::info!(entry = %entry.key, rotated, renewed = entry.renew, reopened, "repository access changed");
            }
            Some(_) => counts.kept += 1,
        }
        if old.as_ref() != Some(&repo) {
            changed = true;
            state.repos.insert(entry.key.clone(), repo.clone());
        }
        let response = response(run, &repo);
        let sha = payload_sha256(&response);
        output.respond_hashed(entry, &sha, || response);
    }

    // Run again when the first kept repository's retention ends (the agent clamps it
    // to an hour).
    if let Some(first) = state
        .repos
        .iter()
        .filter(|(k, _)| !stuck.contains(*k))
        .filter_map(|(_, r)| r.released_at)
        .map(|t| t.saturating_add(retention))
        .min()
    {
        output.rerun_within(first.saturating_sub(now).max(1));
    }
    (output, counts, changed)
}

/// Refuses `entry` for `reason`. A repository it has stays reachable with its key while
/// the provider would still give it what it has (a refused change keeps what works);
/// else its key stops reaching it, and its data is kept for the retention. True when
/// the state changed.
fn refuse(
    run: &Run,
    state: &mut State,
    budget: &mut Budget,
    entry: &Entry,
    reason: String,
    output: &mut Output,
) -> bool {
    let config = run.config;
    let Some(repo) = state.repos.get_mut(&entry.key) else {
        output.refuse(entry, reason);
        return false;
    };
    if repo.released_at.is_some() {
        output.refuse(
            entry,
            format!(
                "{reason}; the repository released earlier is kept until {}",
                until(repo.released_at.unwrap_or(run.now), config)
            ),
        );
        return false;
    }
    let still = (repo.append_only || config.full_access.permits(&entry.origin, entry.need.id()))
        && repo.quota <= config.max_quota()
        && budget.take(&entry.origin, repo.quota).is_ok();
    if still {
        output.refuse(
            entry,
            format!(
                "{reason}; the repository stays reachable with the key it had (quota {}{})",
                Size(repo.quota),
                if repo.append_only {
                    ", append-only"
                } else {
                    ""
                }
            ),
        );
        return false;
    }
    repo.released_at = Some(run.now);
    tracing::info!(entry = %entry.key, %reason, "refused, and the provider no longer gives what it had: its key no longer reaches the repository");
    output.refuse(
        entry,
        format!(
            "{reason}; its key no longer reaches the repository, whose data is kept until {}",
            until(run.now, config)
        ),
    );
    true
}

fn until(released_at: u64, config: &Config) -> humantime::Rfc3339Timestamp {
    let t = released_at.saturating_add(config.retention.as_secs());
    humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + std::time::Duration::from_secs(t))
}

/// What the consumer gets: where the repository is, how to trust the server, the key
/// that reaches it (the consumer installs its key only once it reads its own here), and
/// the terms: quota, access, how long released data is kept, when to rotate the key.
fn response(run: &Run, repo: &Repo) -> Value {
    let config = run.config;
    json!({
        "repo": format!("{}{}", config.url_prefix(), repo.path.display()),
        "path": repo.path,
        "known_hosts": run.known_hosts,
        "public_key": repo.key,
        "append_only": repo.append_only,
        "quota": repo.quota,
        "retention_seconds": config.retention.as_secs(),
        "expires_at": repo.key_since.saturating_add(config.key_lifetime.as_secs()),
    })
}
