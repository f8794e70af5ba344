//! `ssh-ca`: an SSH certificate authority. Hosts ask for a host certificate for their own
//! host key, services and people for user certificates; the principals each caller may
//! have are the provider's to declare. Every response carries the CA's public key (for
//! `TrustedUserCAKeys` and `@cert-authority` lines) and a KRL of what was revoked (for
//! `RevokedKeys`); released entries' certificates go into it.

pub mod ca;
pub mod config;
pub mod install;
pub mod issue_log;
pub mod krl;
pub mod reconcile;
pub mod request;
pub mod state;
pub mod trust;

use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::common::hosts::Fleet;
use crate::common::state::StateFile;
use crate::common::{Entry, Output, Trigger};
use crate::{Capability, RunFuture};

pub const CAPABILITY: Capability = Capability {
    name: "ssh-ca",
    about: "SSH host and user certificates from a CA key, with a KRL of released ones",
    check,
    run,
    vet,
    answers: &[
        "kind",
        "certificate",
        "serial",
        "key_id",
        "principals",
        "valid_after",
        "valid_before",
        "expires_at",
        "krl",
        "ca_public_key",
        "known_hosts_line",
    ],
    failover: crate::Failover::Independent,
};

fn check(path: &Path) -> anyhow::Result<()> {
    let config = config::Config::load(path)?;
    // At build time the key and the registry are not there yet: check them when they are.
    if config.ca_key_file.exists() {
        ca::Ca::load(&config.ca_key_file, false, "")?;
    } else if !config.generate_ca_key {
        eprintln!(
            "note: the CA key {} does not exist here; runs fail until it does",
            config.ca_key_file.display()
        );
    }
    if config.hosts_file.exists() {
        Fleet::load(&config.hosts_file)?;
    }
    Ok(())
}

fn vet(path: &Path, fleet: &Fleet, entries: &[Entry]) -> anyhow::Result<crate::Refusals> {
    let config = config::Config::load(path)?;
    Ok(reconcile::vet(&config, fleet, entries, unix_now()))
}

fn run<'a>(path: &'a Path, entries: Vec<Entry>, _trigger: Trigger) -> RunFuture<'a> {
    // Signing is microseconds per certificate and there is no server to wait for: the
    // run is synchronous inside the handler's runtime.
    Box::pin(async move { run_now(path, entries, unix_now()) })
}

/// One run at `now` (unix seconds).
pub fn run_now(path: &Path, entries: Vec<Entry>, now: u64) -> anyhow::Result<Output> {
    let config = config::Config::load(path)?;
    let hosts = Fleet::load(&config.hosts_file)?;
    let comment = match std::env::var("FORT_HOST") {
        Ok(h) if !h.is_empty() && h.bytes().all(|b| b.is_ascii_graphic()) => {
            format!("fort-ssh-ca@{h}")
        }
        _ => "fort-ssh-ca".to_owned(),
    };
    let ca = ca::Ca::load(&config.ca_key_file, config.generate_ca_key, &comment)?;
    let file = StateFile::new(&config.state_file);
    let mut state: state::State = file.load(state::VERSION)?;
    let mut log = issue_log::IssueLog::load(&config.state_file, now);
    let total = entries.len();
    let (output, counts) =
        reconcile::reconcile(&config, &ca, &hosts, &mut state, &mut log, entries, now)?;
    if counts.changed {
        file.save(state::VERSION, &state)?;
    }
    log.save();
    tracing::info!(
        entries = total,
        kept = counts.kept,
        issued = counts.issued,
        refused = counts.refused,
        held = counts.held,
        released = counts.released,
        revoked = counts.revoked,
        krl_version = state.krl_version,
        "ssh-ca run"
    );
    Ok(output)
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
