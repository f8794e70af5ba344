//! `scrape`: the provider's Prometheus scrapes every entry's exporter. Per caller, one
//! `file_sd` target file in a directory Prometheus watches; a target's address is always
//! its caller's own from the fleet registry (no request names one, so no caller can make
//! the monitor scrape somewhere else), on a port and with labels the provider allows that
//! caller, and labelled with the caller and the need (`fort_host`, `fort_need`), which no
//! request can set (docs/handlers.md).

pub mod config;
pub mod reconcile;
pub mod request;
#[cfg(test)]
mod tests;

use std::path::Path;

use crate::common::hosts::Fleet;
use crate::common::state::StateFile;
use crate::{Capability, Entry, Output, RunFuture, Trigger};

pub const CAPABILITY: Capability = Capability {
    name: "scrape",
    about: "a Prometheus target per entry, at the caller's own address",
    check,
    run,
    vet,
    answers: &["target", "job", "path", "labels"],
    failover: crate::Failover::Independent,
};

fn check(path: &Path) -> anyhow::Result<()> {
    let config = config::Config::load(path)?;
    // At build time the registry is not there yet: read it when it is.
    if config.hosts_file.exists() {
        Fleet::load(&config.hosts_file)?;
    }
    Ok(())
}

fn vet(path: &Path, fleet: &Fleet, entries: &[Entry]) -> anyhow::Result<crate::Refusals> {
    let config = config::Config::load(path)?;
    Ok(reconcile::vet(&config, fleet, entries))
}

fn run(path: &Path, entries: Vec<Entry>, trigger: Trigger) -> RunFuture<'_> {
    // Files in one directory: nothing to wait for, so the run is synchronous.
    Box::pin(async move { run_now(path, &entries, trigger.reconciles()) })
}

/// One run; `look`: write every target file again where it differs from what it must
/// be (one changed by hand is put back).
pub fn run_now(path: &Path, entries: &[Entry], look: bool) -> anyhow::Result<Output> {
    let config = config::Config::load(path)?;
    let hosts = Fleet::load(&config.hosts_file)?;
    let file = StateFile::new(&config.state_file);
    let mut state: reconcile::State = file.load(reconcile::VERSION)?;
    let (output, counts, mut changed, files) =
        reconcile::reconcile(&config, &hosts, &mut state, entries);
    let (files_changed, written) = reconcile::write_files(&config, &mut state, &files, look)?;
    changed |= files_changed;
    if changed {
        file.save(reconcile::VERSION, &state)?;
    }
    tracing::info!(
        entries = entries.len(),
        kept = counts.kept,
        added = counts.added,
        changed = counts.changed,
        refused = counts.refused,
        released = counts.released,
        callers = files.len(),
        files_written = written,
        "scrape run"
    );
    Ok(output)
}
