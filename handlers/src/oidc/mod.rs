//! `oidc`: an OpenID Connect client per entry at the provider's OpenID provider, registered
//! by RFC 7591 dynamic client registration and managed by RFC 7592, answered as
//! `{client_id, client_secret, issuer}` (docs/handlers.md).
//!
//! Registrations are authorised by the provider's initial access token (read from its
//! file at run time); each client's registration access token is kept only in the
//! handler's state (0600) and is the only thing updates and deletes go by, so a client
//! registered by anyone else is never touched. An unchanged entry is answered from the
//! state without a word to the provider.

pub mod config;
pub mod reconcile;
pub mod request;
pub mod server;

use std::path::Path;

use crate::common::state::StateFile;
use crate::{Capability, Entry, RunFuture, Trigger};

pub const CAPABILITY: Capability = Capability {
    name: "oidc",
    about: "OpenID Connect clients by dynamic registration (RFC 7591/7592)",
    check,
    run,
    vet,
    answers: &["client_id", "client_secret", "issuer"],
    failover: crate::Failover::Independent,
};

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
        let file = StateFile::new(&config.state_file);
        let mut state: reconcile::State = file.load(reconcile::STATE_VERSION)?;
        let done = reconcile::reconcile(&config, &mut state, &entries, trigger).await;
        if done.changed {
            file.save(reconcile::STATE_VERSION, &state)?;
        }
        let c = &done.counts;
        tracing::info!(
            "{} entries: {} kept, {} registered, {} updated, {} rotated, {} refused, {} pending; {} released",
            entries.len(),
            c.kept,
            c.created,
            c.updated,
            c.rotated,
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
