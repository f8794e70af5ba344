//! `backup-repo`: a borg repository per entry on the provider's backup server, reached
//! over SSH with the key the consumer's agent made (its request carries the public half
//! only), restricted to `borg serve` on that repository alone, append-only unless the
//! provider grants more, under a quota bounded per caller (docs/handlers.md).
//!
//! The handler writes one `authorized_keys` file of its own, whole, and the repository
//! directories; borg itself makes the repository on the consumer's `borg init`, with a
//! passphrase that never leaves the consumer. A released entry's key stops reaching its
//! repository at once; its data is removed only after the retention the config states.

pub mod access;
pub mod config;
pub mod reconcile;
pub mod request;
pub mod size;
pub mod state;
#[cfg(test)]
mod tests;

use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::common::state::StateFile;
use crate::{Capability, Entry, Output, RunFuture, Trigger};

pub const CAPABILITY: Capability = Capability {
    name: "backup-repo",
    about: "a borg repository per entry, reached over SSH with the consumer's own key",
    check,
    run,
    vet,
    answers: &[
        "repo",
        "path",
        "known_hosts",
        "public_key",
        "append_only",
        "quota",
        "retention_seconds",
        "expires_at",
    ],
    failover: crate::Failover::OneProvider(
        "a backup's archives are in the repository it wrote them to: a standby holds none of them, and borg deduplicates against the repository it writes to; a second backup host is a second need (its own repository), not a standby",
    ),
};

fn check(path: &Path) -> anyhow::Result<()> {
    let config = config::Config::load(path)?;
    // At build time the host keys are not there yet: read them when they are.
    if config.host_key_files.iter().all(|f| f.exists()) {
        access::known_hosts(&config)?;
    }
    Ok(())
}

fn vet(
    path: &Path,
    _fleet: &crate::common::hosts::Fleet,
    entries: &[Entry],
) -> anyhow::Result<crate::Refusals> {
    let config = config::Config::load(path)?;
    Ok(reconcile::vet(&config, entries))
}

fn run(path: &Path, entries: Vec<Entry>, trigger: Trigger) -> RunFuture<'_> {
    // Directories and one file: nothing to wait for, so the run is synchronous.
    Box::pin(async move { run_now(path, &entries, trigger.reconciles(), unix_now()) })
}

/// One run at `now` (unix seconds); `look`: look at every repository's directory.
pub fn run_now(path: &Path, entries: &[Entry], look: bool, now: u64) -> anyhow::Result<Output> {
    let config = config::Config::load(path)?;
    // The server's host keys, in every response: a run without them changes nothing.
    let known_hosts = access::known_hosts(&config)?;
    let file = StateFile::new(&config.state_file);
    let mut state: state::State = file.load(state::VERSION)?;
    let owner = access::Owner::default();
    let run = reconcile::Run {
        config: &config,
        known_hosts: &known_hosts,
        owner: &owner,
        now,
        look,
    };
    let (output, counts, changed) = reconcile::reconcile(&run, &mut state, entries);
    // The keys first: a crash before the state is saved leaves a file the next run
    // writes again from the same decisions.
    let content = access::authorized_keys(&config, state.reachable());
    let wrote = access::write_authorized_keys(&config, &content)?;
    if changed {
        file.save(state::VERSION, &state)?;
    }
    tracing::info!(
        entries = entries.len(),
        kept = counts.kept,
        created = counts.created,
        changed = counts.changed,
        refused = counts.refused,
        pending = counts.pending,
        released = counts.released,
        removed = counts.removed,
        authorized_keys_written = wrote,
        "backup-repo run"
    );
    Ok(output)
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
