//! `fort-agent check`: validate the config and every file it names, without starting.

use std::path::Path;

use crate::app::check_own_key;
use crate::config::Config;
use crate::loaded::Loaded;

/// Returns a one-line summary, or a precise error.
pub fn check(config_path: &Path, skip_key: bool) -> anyhow::Result<String> {
    let config = Config::load(config_path)?;
    let loaded = Loaded::load(&config)?;
    if !skip_key {
        let signer = fort_core::sign::Signer::from_file(&config.host_key)?;
        check_own_key(&config, &loaded, &signer)?;
    }
    Ok(format!(
        "{}: ok: host {}, {} peers, {} needs, {} capabilities",
        config_path.display(),
        config.host,
        loaded.registry.peers.len(),
        loaded.needs.len(),
        loaded.capabilities.len()
    ))
}
