//! `postgres`: a database and a login role per entry on the provider's PostgreSQL,
//! answered as `{host, port, dbname, user, password, uri}` (docs/handlers.md).
//!
//! Names come from the caller and its need id, so two hosts never share one; the password
//! is made here, kept only in the handler's state (0600) and sent to the server as its
//! SCRAM verifier; an unchanged entry is answered from the state without a word to the
//! server. Released entries' roles lose `LOGIN` and keep their data, unless the provider
//! asks for them to be dropped. Only roles this handler made (its state and the marker on
//! the role) are ever changed.

pub mod config;
mod drift;
pub mod names;
pub mod reconcile;
pub mod request;
pub mod server;

use std::path::Path;

use crate::common::state::StateFile;
use crate::{Capability, Entry, RunFuture, Trigger};

pub const CAPABILITY: Capability = Capability {
    name: "postgres",
    about: "a database and a login role per entry on the provider's PostgreSQL",
    check,
    run,
    vet,
    answers: &["host", "port", "dbname", "user", "password", "uri"],
    failover: crate::Failover::SharedBackend(backend),
};

/// The server as consumers reach it and the names made there: providers sharing one
/// server give the same, and each lists the others as `peers`.
fn backend(path: &Path) -> anyhow::Result<crate::Backend> {
    let config = config::Config::load_policy(path)?;
    Ok(crate::Backend {
        backend: format!(
            "{}:{} ({}_…)",
            config.host,
            config.public_port(),
            config.name_prefix
        ),
        peers: config.peers,
    })
}

fn check(path: &Path) -> anyhow::Result<()> {
    config::Config::load(path).map(|_| ())
}

fn vet(
    path: &Path,
    _fleet: &crate::common::hosts::Fleet,
    entries: &[Entry],
) -> anyhow::Result<crate::Refusals> {
    let config = config::Config::load_policy(path)?;
    Ok(reconcile::vet(&config, entries))
}

fn run(path: &Path, entries: Vec<Entry>, trigger: Trigger) -> RunFuture<'_> {
    Box::pin(async move {
        let config = config::Config::load(path)?;
        // The marker names the provider, so two providers sharing one server never take
        // each other's roles.
        let provider = std::env::var("FORT_HOST").unwrap_or_else(|_| "an unnamed host".into());
        let file = StateFile::new(&config.state_file);
        let mut state: reconcile::State = file.load(reconcile::STATE_VERSION)?;
        let done = reconcile::reconcile(&config, &provider, &mut state, &entries, trigger).await;
        if done.changed {
            file.save(reconcile::STATE_VERSION, &state)?;
        }
        let c = &done.counts;
        tracing::info!(
            "{} entries: {} kept, {} created, {} rotated, {} taken over from peers, {} new connection limits, {} refused, {} pending; {} released",
            entries.len(),
            c.kept,
            c.created,
            c.rotated,
            c.taken_over,
            c.limited,
            c.refused,
            c.pending,
            c.released
        );
        match done.failure {
            Some(e) => Err(e),
            None => Ok(done.output),
        }
    })
}
