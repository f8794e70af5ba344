//! The `/etc/fort/*.json` files as one validated, immutable view. A reload builds a new
//! view and swaps it in whole, so a request never sees half of an old fleet.

use std::path::Path;

use fort_core::schema::{self, Capabilities, Needs, Registry, SchemaError};

use crate::config::Config;

#[derive(Debug, Clone)]
pub struct Loaded {
    pub registry: Registry,
    pub needs: Needs,
    pub capabilities: Capabilities,
}

/// Why the files cannot be used, file and field named.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Schema(#[from] SchemaError),
    #[error("{0}")]
    Invalid(String),
}

fn optional(path: &Option<std::path::PathBuf>) -> Option<&Path> {
    path.as_deref().filter(|p| p.exists())
}

impl Loaded {
    /// Whether this host serves plain HTTP: only when its own address says so (which
    /// `load` allows only with `plaintext = true`).
    pub fn serves_plaintext(&self, host: &str) -> bool {
        self.registry
            .get(host)
            .and_then(|p| p.address.as_deref())
            .is_some_and(schema::is_plaintext_address)
    }

    pub fn load(config: &Config) -> Result<Loaded, LoadError> {
        let registry = Registry::load(&config.hosts)?;
        if !registry.is_host(&config.host) {
            return Err(LoadError::Invalid(format!(
                "{}: this host {:?} is not in hosts.json",
                config.hosts.display(),
                config.host
            )));
        }
        if !config.plaintext {
            if let Some((name, peer)) = registry.hosts().find(|(_, p)| {
                p.address
                    .as_deref()
                    .is_some_and(schema::is_plaintext_address)
            }) {
                return Err(LoadError::Invalid(format!(
                    "{}: host {name:?} has the plain address {:?}; use https:// (TLS pinned to its key), or set plaintext = true in the agent config if an overlay network already encrypts",
                    config.hosts.display(),
                    peer.address.as_deref().unwrap_or("")
                )));
            }
        }
        let needs = match optional(&config.needs) {
            Some(p) => schema::load_needs(p, &registry)?,
            None => Needs::new(),
        };
        let capabilities = match optional(&config.capabilities) {
            Some(p) => schema::load_capabilities(p, &registry)?,
            None => Capabilities::new(),
        };
        for who in config.access.journal.iter().chain(&config.access.systemd) {
            if registry.get(who).is_none() {
                return Err(LoadError::Invalid(format!(
                    "[access] names {who:?}, which is not in {}",
                    config.hosts.display()
                )));
            }
        }
        Ok(Loaded {
            registry,
            needs,
            capabilities,
        })
    }
}
