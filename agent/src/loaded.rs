//! The `/etc/fort/*.json` files as one validated, immutable view. A reload builds a new
//! view and swaps it in whole, so a request never sees half of an old fleet.

use std::path::{Path, PathBuf};

use fort_core::schema::{self, Capabilities, Needs, Registry, SchemaError, Templates};

use crate::config::Config;

#[derive(Debug, Clone)]
pub struct Loaded {
    pub registry: Registry,
    pub needs: Needs,
    /// Files rendered from templates over several needs (needs.json's `$templates`).
    pub templates: Templates,
    pub capabilities: Capabilities,
    /// §11.7: the hash of the three files' bytes as they were read for this view.
    pub manifest_sha256: String,
}

/// Why the files cannot be used, file and field named.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Schema(#[from] SchemaError),
    #[error("{0}")]
    Invalid(String),
}

/// One file's bytes, read once, and where they came from (for messages).
#[derive(Debug, Clone)]
pub struct FileBytes {
    pub path: PathBuf,
    pub bytes: Vec<u8>,
}

/// The bytes of the three files, each read exactly once: the manifest hash and the
/// parsed view come from the same bytes, whatever replaces the files meanwhile.
#[derive(Debug, Clone)]
pub struct Files {
    pub hosts: FileBytes,
    /// `None`: not configured, or the file does not exist (no needs).
    pub needs: Option<FileBytes>,
    /// `None`: not configured, or the file does not exist (built-ins only).
    pub capabilities: Option<FileBytes>,
}

fn read(path: &Path) -> Result<FileBytes, SchemaError> {
    std::fs::read(path)
        .map(|bytes| FileBytes {
            path: path.to_owned(),
            bytes,
        })
        .map_err(|error| SchemaError::Read {
            file: path.display().to_string(),
            error,
        })
}

/// A file that may be absent: `None` when it does not exist; any other failure to
/// read it is an error (an unreadable needs file is not "no needs").
fn read_optional(path: &Option<PathBuf>) -> Result<Option<FileBytes>, SchemaError> {
    let Some(path) = path else { return Ok(None) };
    match read(path) {
        Ok(f) => Ok(Some(f)),
        Err(SchemaError::Read { error, .. }) if error.kind() == std::io::ErrorKind::NotFound => {
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

impl Files {
    /// Reads the files `config` names.
    pub fn read(config: &Config) -> Result<Files, SchemaError> {
        Ok(Files {
            hosts: read(&config.hosts)?,
            needs: read_optional(&config.needs)?,
            capabilities: read_optional(&config.capabilities)?,
        })
    }

    /// §11.7: hosts, `\n`, needs, `\n`, capabilities; an absent file counts as empty.
    pub fn manifest_sha256(&self) -> String {
        fn bytes(f: &Option<FileBytes>) -> &[u8] {
            f.as_ref().map_or(&[], |f| &f.bytes)
        }
        fort_core::canonical::manifest_sha256(
            &self.hosts.bytes,
            bytes(&self.needs),
            bytes(&self.capabilities),
        )
    }
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
        Loaded::from_files(config, &Files::read(config)?)
    }

    /// Validates files already read, exactly as a start or a reload does (`fort-agent
    /// plan` checks new files with this, without installing them).
    pub fn from_files(config: &Config, files: &Files) -> Result<Loaded, LoadError> {
        let hosts_path = &files.hosts.path;
        let registry = Registry::from_bytes(hosts_path, &files.hosts.bytes)?;
        if !registry.is_host(&config.host) {
            return Err(LoadError::Invalid(format!(
                "{}: this host {:?} is not in hosts.json",
                hosts_path.display(),
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
                    hosts_path.display(),
                    peer.address.as_deref().unwrap_or("")
                )));
            }
        }
        let needs = match &files.needs {
            Some(f) => schema::needs_from_bytes(&f.path, &f.bytes, &registry)?,
            None => Needs::new(),
        };
        let templates = match &files.needs {
            Some(f) => schema::templates_from_bytes(&f.path, &f.bytes, &needs)?,
            None => Templates::new(),
        };
        for (name, t) in &templates {
            fort_fulfill::templates::compile(name, &t.template).map_err(|e| {
                LoadError::Invalid(format!(
                    "{}: $templates.{name}.template: {e}",
                    files
                        .needs
                        .as_ref()
                        .map_or_else(String::new, |f| f.path.display().to_string())
                ))
            })?;
        }
        let capabilities = match &files.capabilities {
            Some(f) => schema::capabilities_from_bytes(&f.path, &f.bytes, &registry)?,
            None => Capabilities::new(),
        };
        let access = &config.access;
        for who in access
            .journal
            .iter()
            .chain(&access.systemd)
            .chain(&access.trigger)
            .chain(&access.audit)
        {
            if registry.get(who).is_none() {
                return Err(LoadError::Invalid(format!(
                    "[access] names {who:?}, which is not in {}",
                    hosts_path.display()
                )));
            }
        }
        Ok(Loaded {
            registry,
            needs,
            templates,
            capabilities,
            manifest_sha256: files.manifest_sha256(),
        })
    }
}
