//! `fort-agent check`: validate the config and every file it names, without starting.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use anyhow::bail;

use crate::app::check_own_key;
use crate::config::Config;
use crate::loaded::Loaded;

/// What to leave out, for checks away from the host that will run the agent.
#[derive(Debug, Clone, Copy, Default)]
pub struct CheckOptions {
    /// The host key is a runtime secret (a build has none).
    pub skip_key: bool,
    /// Handlers live where the files are deployed, not where they are checked.
    pub skip_handlers: bool,
}

/// What a passing check says: one summary line, and warnings worth a look.
#[derive(Debug, Clone)]
pub struct Checked {
    pub summary: String,
    pub warnings: Vec<String>,
}

/// `n thing` or `n things`.
fn count(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// Why `path` cannot run as a handler, if it cannot.
fn not_runnable(path: &Path) -> Option<String> {
    match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Some("does not exist".into()),
        Err(e) => Some(format!("cannot be read: {e}")),
        Ok(m) if m.is_dir() => Some("is a directory".into()),
        Ok(m) if m.permissions().mode() & 0o111 == 0 => Some(format!(
            "is not executable (mode {:04o})",
            m.permissions().mode() & 0o7777
        )),
        Ok(_) => None,
    }
}

/// A needs or capabilities file the config names must exist: the agent would take a
/// missing one as empty, and a path that is wrong would silently drop every need.
fn named_file_exists(key: &str, path: Option<&Path>, absent_means: &str) -> anyhow::Result<()> {
    if let Some(p) = path {
        if !p.exists() {
            bail!(
                "{key} = {:?}: no such file. {absent_means}",
                p.display().to_string()
            );
        }
    }
    Ok(())
}

/// Returns a summary, or a precise error naming every problem found.
pub fn check(config_path: &Path, options: CheckOptions) -> anyhow::Result<Checked> {
    let config = Config::load(config_path)?;
    named_file_exists(
        "needs",
        config.needs.as_deref(),
        "A host with no needs leaves `needs` out of agent.toml, or names a file holding {}.",
    )?;
    named_file_exists(
        "capabilities",
        config.capabilities.as_deref(),
        "A host that serves only the built-in capabilities leaves `capabilities` out of agent.toml, or names a file holding {}.",
    )?;
    let loaded = Loaded::load(&config)?;
    if !options.skip_handlers {
        let mut problems = Vec::new();
        let needs_file = config.needs.as_deref().unwrap_or(Path::new("needs.json"));
        for (key, spec) in &loaded.needs {
            for (field, path) in [("handler", &spec.handler), ("check", &spec.check)] {
                if let Some(why) = path.as_deref().and_then(not_runnable) {
                    problems.push(format!(
                        "{}: need {:?}: {field} {} {why}",
                        needs_file.display(),
                        key.as_str(),
                        path.as_deref().unwrap_or(Path::new("")).display()
                    ));
                }
            }
        }
        let caps_file = config
            .capabilities
            .as_deref()
            .unwrap_or(Path::new("capabilities.json"));
        for (name, spec) in &loaded.capabilities {
            if let Some(why) = not_runnable(&spec.handler) {
                problems.push(format!(
                    "{}: capability {name:?}: handler {} {why}",
                    caps_file.display(),
                    spec.handler.display()
                ));
            }
        }
        if !problems.is_empty() {
            bail!("{}", problems.join("\n"));
        }
    }
    if !options.skip_key {
        let signer = fort_core::sign::Signer::from_file(&config.host_key)?;
        check_own_key(&config, &loaded, &signer)?;
        // Every rule the start applies to the state key: where it comes from, its mode,
        // owner and directories, and that every sealed file opens with it. Like the host
        // key, it exists only on the host (a build checks with --skip-key).
        crate::state_key::load_and_check(&config).map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    let mut warnings = Vec::new();
    if !options.skip_handlers {
        // On the host itself: a delivery directory another user could swap or fill. The
        // agent never follows a symlink there, but such a user still decides what lies
        // beside the secret; the path is worth moving.
        for (key, spec) in &loaded.needs {
            for unused in fort_core::schema::keys::unused_keys(&spec.keys, &spec.request) {
                warnings.push(format!(
                    "need {:?}: key {unused:?} is not used by the request (no $fort_key names it): no certificate will ever be for it",
                    key.as_str()
                ));
            }
            let files = spec.files.iter().map(|f| ("file", &f.path, &f.owner));
            let keys = spec.keys.values().map(|k| ("key", &k.path, &k.owner));
            for (what, path, owner) in files.chain(keys) {
                let owner = fort_fulfill::files::account_id(owner, false).ok();
                if let Some(why) = fort_fulfill::files::unsafe_parent(path, owner) {
                    warnings.push(format!(
                        "need {:?}: {what} {}: unsafe directory: {why}",
                        key.as_str(),
                        path.display()
                    ));
                }
            }
        }
    }
    if config.plaintext {
        warnings.push(
            "plaintext = true: requests and replies travel unencrypted over http:// (still signed); use it only where the network already encrypts, such as WireGuard".to_owned(),
        );
    }
    let summary = format!(
        "{}: ok: host {}, {}, {}, {}, {}",
        config_path.display(),
        config.host,
        count(loaded.registry.hosts().count(), "host", "hosts"),
        count(
            loaded.registry.principals().count(),
            "principal",
            "principals"
        ),
        count(loaded.needs.len(), "need", "needs"),
        count(loaded.capabilities.len(), "capability", "capabilities")
    );
    Ok(Checked { summary, warnings })
}
