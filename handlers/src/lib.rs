//! fort's capability handlers: each drives one real server (an ACME CA, an SSH CA, nginx,
//! PostgreSQL, a DNS primary, an OpenID provider, a borg backup server, Prometheus), or
//! coordinates a WireGuard mesh, for every entry of its capability, as docs/handlers.md's
//! contract says: all entries in, one answer per entry out, decided per
//! entry, cleaning up only what it created. One binary serves them all:
//! `fort-handler <capability> --config FILE`.

pub mod acme;
pub mod backup_repo;
pub mod common;
pub mod dns;
pub mod dns_record;
pub mod mesh;
pub mod oidc;
pub mod postgres;
pub mod proxy;
pub mod schema;
pub mod scrape;
pub mod ssh_ca;

use std::future::Future;
use std::path::Path;
use std::pin::Pin;

pub use common::{Answer, Entry, Output, Trigger};

/// A run's future: the output, or an error that fails the whole run (a backend that is
/// down must not revoke anything).
pub type RunFuture<'a> = Pin<Box<dyn Future<Output = anyhow::Result<Output>> + 'a>>;

/// One capability the binary serves.
pub struct Capability {
    /// The subcommand: `fort-handler <name>`.
    pub name: &'static str,
    /// One line for `--help`.
    pub about: &'static str,
    /// Validates the config file (and the files it names) without touching the server.
    pub check: fn(&Path) -> anyhow::Result<()>,
    /// Reconciles every entry.
    pub run: for<'a> fn(&'a Path, Vec<Entry>, Trigger) -> RunFuture<'a>,
    /// The entries the provider's policy refuses, with why, decided from the config and
    /// the fleet's hosts alone (no server, no secret, no state): what `fort-agent check
    /// --fleet` holds every consumer's requests against before a deploy.
    pub vet: fn(&Path, &common::hosts::Fleet, &[Entry]) -> anyhow::Result<Refusals>,
    /// The members every response of it has: a consumer's file pointer must start with
    /// one of them (the fleet check holds it).
    pub answers: &'static [&'static str],
    /// Whether a need may name several providers of it (docs/protocol.md §11.13).
    pub failover: Failover,
}

/// How a capability serves a need that moved to it from another provider.
#[derive(Debug, Clone, Copy)]
pub enum Failover {
    /// Each provider issues on its own (its own ACME account, its own SSH CA, its own
    /// client at the OpenID provider): a standby serves a moved need by issuing anew, and
    /// the old home's GC releases what it issued.
    Independent,
    /// The providers share one backend (a database server): a standby takes over what
    /// another provider of the need made there for that caller and need, and only that,
    /// with a new secret. Each provider's config names the others (`peers`); the function
    /// reads, from a config, which backend it is and who its peers are, so the fleet
    /// check can hold every provider of a need to the same backend and to each other.
    SharedBackend(fn(&Path) -> anyhow::Result<Backend>),
    /// A need names one provider of it: why a standby could not take over.
    OneProvider(&'static str),
}

/// The backend a provider of a [`Failover::SharedBackend`] capability uses, as its
/// config says.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Backend {
    /// What names the backend and the objects' names on it alike for every provider that
    /// shares it (for postgres: `host:port` as consumers reach it, and the name prefix).
    pub backend: String,
    /// The other providers whose objects it takes over.
    pub peers: Vec<String>,
}

/// Entry key → why it is refused.
pub type Refusals = std::collections::BTreeMap<String, String>;

/// Every capability, in `--help` order.
pub const CAPABILITIES: &[Capability] = &[
    acme::CAPABILITY,
    backup_repo::CAPABILITY,
    dns_record::CAPABILITY,
    mesh::CAPABILITY,
    oidc::CAPABILITY,
    postgres::CAPABILITY,
    proxy::CAPABILITY,
    scrape::CAPABILITY,
    ssh_ca::CAPABILITY,
];

/// The capability named `name`.
pub fn capability(name: &str) -> Option<&'static Capability> {
    CAPABILITIES.iter().find(|c| c.name == name)
}
