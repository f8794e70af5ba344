//! A handler's own state: one JSON document in the handler's state directory, replaced
//! atomically (temporary file, fsync, rename, fsync of the directory; mode 0600), with a
//! `version` so a later release can upgrade it. It records what the handler created, so
//! cleanup removes only that (never "everything not in this run").

use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// A versioned state document at `path`.
pub struct StateFile {
    path: PathBuf,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Envelope<T> {
    version: u32,
    state: T,
}

impl StateFile {
    pub fn new(path: impl Into<PathBuf>) -> StateFile {
        StateFile { path: path.into() }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The state, or `T::default()` when there is no file yet. A file of another version
    /// or that does not parse is an error: guessing could forget what was created.
    pub fn load<T: DeserializeOwned + Default>(&self, version: u32) -> anyhow::Result<T> {
        let bytes = match std::fs::read(&self.path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(T::default()),
            Err(e) => anyhow::bail!("cannot read {}: {e}", self.path.display()),
        };
        let env: Envelope<T> = serde_json::from_slice(&bytes)
            .map_err(|e| anyhow::anyhow!("{} does not parse: {e}", self.path.display()))?;
        if env.version != version {
            anyhow::bail!(
                "{} is version {}, this handler reads version {version}",
                self.path.display(),
                env.version
            );
        }
        Ok(env.state)
    }

    /// Replaces the state. Creates the directory (0700) when missing.
    pub fn save<T: Serialize>(&self, version: u32, state: &T) -> anyhow::Result<()> {
        if let Some(dir) = self.path.parent() {
            create_private_dir(dir)?;
        }
        let bytes = serde_json::to_vec(&Envelope { version, state })?;
        fort_core::store::write_atomic(&self.path, &bytes)
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", self.path.display()))
    }
}

/// Creates `dir` (and its parents) mode 0700 when missing.
pub fn create_private_dir(dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    if dir.is_dir() {
        return Ok(());
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn save_load_and_version() {
        let dir = tempfile::tempdir().unwrap();
        let f = StateFile::new(dir.path().join("deep/state.json"));
        let empty: BTreeMap<String, u32> = f.load(1).unwrap();
        assert!(empty.is_empty());
        f.save(1, &BTreeMap::from([("a".to_owned(), 1u32)]))
            .unwrap();
        let back: BTreeMap<String, u32> = f.load(1).unwrap();
        assert_eq!(back["a"], 1);
        assert!(f.load::<BTreeMap<String, u32>>(2).is_err());
        use std::os::unix::fs::MetadataExt;
        assert_eq!(std::fs::metadata(f.path()).unwrap().mode() & 0o777, 0o600);
    }
}
