//! `mesh`: a WireGuard mesh coordinated by fort. Each member asks with the public half of
//! a key its own agent made (`$fort_key`, type `wireguard`) and where it listens; the
//! coordinator gives it a tunnel address derived from the mesh and its host name, and
//! answers every member with every peer it should have: key, endpoint, allowed IPs.
//! Joining, a new key, a new endpoint and leaving change the other members' answers, so
//! one run calls each of them back. Members apply their answer with
//! `fort-handler mesh-wg` (`wg syncconf`: unchanged peers keep their tunnels).

pub mod address;
mod answer;
pub mod apply;
pub mod config;
pub mod reconcile;
#[cfg(test)]
mod reconcile_tests;
pub mod request;

use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::common::hosts::Fleet;
use crate::common::state::StateFile;
use crate::{Capability, Entry, RunFuture, Trigger};

pub const CAPABILITY: Capability = Capability {
    name: "mesh",
    about: "a WireGuard mesh: tunnel addresses and every member's peers, keys made by the members",
    check,
    run,
    vet,
    answers: &[
        "mesh",
        "host",
        "public_key",
        "ipv4",
        "ipv6",
        "listen_port",
        "role",
        "peers",
        "expires_at",
    ],
    failover: crate::Failover::SharedBackend(plan),
};

/// A need may name several coordinators of one mesh: each derives every member's address
/// from the same plan (the mesh's name, prefixes, shape and pins), so the "backend" they
/// share is that plan, and each lists the others as `peers`.
fn plan(path: &Path) -> anyhow::Result<crate::Backend> {
    let config = config::Config::load(path)?;
    Ok(crate::Backend {
        backend: config.plan(),
        peers: config.peers.clone(),
    })
}

fn check(path: &Path) -> anyhow::Result<()> {
    let config = config::Config::load(path)?;
    // At build time the registry is not there yet: check it when it is.
    if config.hosts_file.exists() {
        Fleet::load(&config.hosts_file)?;
    }
    Ok(())
}

fn vet(path: &Path, fleet: &Fleet, entries: &[Entry]) -> anyhow::Result<crate::Refusals> {
    let config = config::Config::load(path)?;
    Ok(reconcile::vet(&config, fleet, entries, unix_now()))
}

fn run(path: &Path, entries: Vec<Entry>, _trigger: Trigger) -> RunFuture<'_> {
    // Deciding and answering is arithmetic over the members: no server to wait for.
    Box::pin(async move { run_now(path, &entries, unix_now()) })
}

/// One run at `now` (unix seconds).
pub fn run_now(path: &Path, entries: &[Entry], now: u64) -> anyhow::Result<crate::Output> {
    let config = config::Config::load(path)?;
    let fleet = Fleet::load(&config.hosts_file)?;
    let file = StateFile::new(&config.state_file);
    let mut state: reconcile::State = file.load(reconcile::STATE_VERSION)?;
    let (output, c, changed) = reconcile::reconcile(&config, &fleet, &mut state, entries, now);
    if changed {
        file.save(reconcile::STATE_VERSION, &state)?;
    }
    tracing::info!(
        "mesh {}: {} members ({} joined, {} changed, {} left); {} answered, {} kept, {} refused, {} waiting",
        config.name,
        c.members,
        c.joined,
        c.changed,
        c.left,
        c.answered,
        c.kept,
        c.refused,
        c.waiting
    );
    Ok(output)
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
