//! A handler's own state: one JSON document in the handler's state directory, replaced
//! atomically (temporary file, fsync, rename, fsync of the directory; mode 0600), with a
//! `version` so a later release can upgrade it. It records what the handler created, so
//! cleanup removes only that (never "everything not in this run").
//!
//! With a state key (docs/at-rest.md; the agent names its file in `FORT_STATE_KEY_FILE`),
//! the document is sealed: a plain one from an earlier release is sealed in place on the
//! first load, a sealed one under another key or changed on disk is refused whole. Every
//! capability keeps its state here, so every capability's state is sealed.
//!
//! Across releases (docs/compatibility.md): members this release does not know, in the
//! state or around it, are kept and written back; a version above the one it writes is
//! refused with the file, the version and the release that wrote it.

use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use fort_core::compat::{self, Unknown};
use fort_core::sealed::{self, StateKey};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{Map, Value};

/// A versioned state document at `path`.
pub struct StateFile {
    path: PathBuf,
    /// The key that seals it: `Err` when one was named and cannot be used (every load
    /// and save then fails with why), `None` for plain state.
    key: Result<Option<Arc<StateKey>>, String>,
    /// What the last [`StateFile::load`] read that this release does not know: members of
    /// the state, and of the document around it.
    kept: RefCell<(Unknown, Map<String, Value>)>,
}

/// The document's own members besides the state.
const OWN_MEMBERS: [&str; 3] = ["version", "state", compat::WRITTEN_BY];

/// The path of a file kept beside the state file `state`: `<state><suffix>`.
pub fn beside(state: &Path, suffix: &str) -> PathBuf {
    let mut name = state.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

impl StateFile {
    /// The state file at `path`, sealed with the key the agent named in
    /// `FORT_STATE_KEY_FILE` (plain when it named none).
    pub fn new(path: impl Into<PathBuf>) -> StateFile {
        StateFile::with_key(path, handler_key())
    }

    /// The state file at `path`, sealed with `key` (plain with `Ok(None)`).
    pub fn with_key(
        path: impl Into<PathBuf>,
        key: Result<Option<Arc<StateKey>>, String>,
    ) -> StateFile {
        StateFile {
            path: path.into(),
            key,
            kept: RefCell::default(),
        }
    }

    fn key(&self) -> anyhow::Result<Option<&StateKey>> {
        match &self.key {
            Ok(k) => Ok(k.as_deref()),
            Err(why) => anyhow::bail!("{}: not read or written: {why}", self.path.display()),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The state, or `T::default()` when there is no file yet. A file of another version
    /// or that does not parse is an error: guessing could forget what was created.
    pub fn load<T: DeserializeOwned + Serialize + Default>(
        &self,
        version: u32,
    ) -> anyhow::Result<T> {
        let shown = self.path.display();
        let key = self.key()?;
        // A save cut short by a kill (the handler timeout, a crash) left its temporary
        // file: never state, and gone before it can be mistaken for any.
        fort_core::store::remove_stale_temporaries_of(&self.path);
        let Some(read) = sealed::read(&self.path, key)? else {
            return Ok(T::default());
        };
        let bytes = &read.plain;
        let mut doc: Map<String, Value> = serde_json::from_slice(bytes)
            .map_err(|e| anyhow::anyhow!("{shown} does not parse: {e}"))?;
        let found = doc.get("version").and_then(Value::as_u64);
        if found != Some(u64::from(version)) {
            let found = found.map_or_else(|| "no version".to_owned(), |v| format!("version {v}"));
            let newer = doc
                .get("version")
                .and_then(Value::as_u64)
                .is_some_and(|v| v > u64::from(version));
            if newer {
                anyhow::bail!(
                    "{shown}: version: {found}, written by {}; this fort-handler (fort {}) reads version {version}. Nothing was changed: run the release that wrote it, or restore the file from before it was upgraded",
                    compat::written_by(&doc),
                    compat::RELEASE
                );
            }
            anyhow::bail!("{shown} is {found}, this handler reads version {version}");
        }
        let state = doc.remove("state").unwrap_or(Value::Null);
        let (value, unknown) = compat::read::<T>(&state).map_err(|e| {
            anyhow::anyhow!(
                "{shown}: state.{}: {}; written by {}, which this fort-handler (fort {}) cannot read. Nothing was changed",
                e.path,
                e.message,
                compat::written_by(&doc),
                compat::RELEASE
            )
        })?;
        doc.retain(|k, _| !OWN_MEMBERS.contains(&k.as_str()));
        *self.kept.borrow_mut() = (unknown, doc);
        if let (Some(key), true) = (key, read.was_plain) {
            // Plain state from an earlier release, or from before the key: the same
            // bytes, sealed in place (atomically) before anything else happens.
            sealed::write_at(
                &self.path,
                bytes,
                Some(key),
                Some(fort_core::crash::replace_temp("store.seal.temp")),
            )
            .map_err(|e| anyhow::anyhow!("cannot seal {shown}: {e}"))?;
            tracing::info!(file = %shown, key = key.id(), "sealed plain state with the state key");
        }
        Ok(value)
    }

    /// [`StateFile::load`] for a file whose loss costs only work done again (a cache, a
    /// log of recent issuances beside the state): one that cannot be read starts empty,
    /// and the run's stderr says so and what is `forgotten`.
    pub fn load_or_forget<T: DeserializeOwned + Serialize + Default>(
        &self,
        version: u32,
        capability: &str,
        forgotten: &str,
    ) -> T {
        self.load(version).unwrap_or_else(|e| {
            eprintln!("{capability}: {e:#}; {forgotten}");
            T::default()
        })
    }

    /// [`StateFile::save`] for such a file: a failure is reported on stderr and costs
    /// only what the file would have remembered, never the run.
    pub fn save_or_report<T: Serialize>(&self, version: u32, state: &T, capability: &str) {
        if let Err(e) = self.save(version, state) {
            eprintln!("{capability}: {e:#}");
        }
    }

    /// Replaces the state, with what [`StateFile::load`] read and did not know. Creates
    /// the directory (0700) when missing.
    pub fn save<T: Serialize>(&self, version: u32, state: &T) -> anyhow::Result<()> {
        if let Some(dir) = self.path.parent() {
            create_private_dir(dir)?;
        }
        let kept = self.kept.borrow();
        let mut doc = kept.1.clone();
        doc.insert("version".into(), Value::from(version));
        // Version 1 documents are read by releases that refuse members they do not know
        // (fort 0.1.0): the writer is recorded from version 2 on, which they refuse anyway.
        if version >= 2 {
            doc.insert(compat::WRITTEN_BY.into(), Value::from(compat::writer()));
        }
        doc.insert("state".into(), compat::to_value(state, &kept.0)?);
        let bytes = zeroize::Zeroizing::new(serde_json::to_vec(&doc)?);
        sealed::write_at(
            &self.path,
            &bytes,
            self.key()?,
            Some(fort_core::crash::replace(
                "handler.state.temp",
                "handler.state.renamed",
            )),
        )
        .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", self.path.display()))
    }
}

/// The state key of this handler process, read once from the file the agent named in
/// `FORT_STATE_KEY_FILE`; `None` when it named none.
pub fn handler_key() -> Result<Option<Arc<StateKey>>, String> {
    static KEY: OnceLock<Result<Option<Arc<StateKey>>, String>> = OnceLock::new();
    KEY.get_or_init(|| match std::env::var_os(sealed::KEY_FILE_ENV) {
        None => Ok(None),
        Some(path) => StateKey::load(Path::new(&path)).map(|k| Some(Arc::new(k))),
    })
    .clone()
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
        // Written by a later release: members it added, in the state and around it, are
        // kept; a later version is refused with who wrote it.
        std::fs::write(
            f.path(),
            r#"{"version":1,"state":{"entries":{"a":{"n":1,"since":4}},"next":true},"lease":9}"#,
        )
        .unwrap();
        #[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
        struct S {
            entries: BTreeMap<String, E>,
        }
        #[derive(Debug, serde::Serialize, serde::Deserialize)]
        struct E {
            n: u32,
        }
        let f = StateFile::new(f.path());
        let mut s: S = f.load(1).unwrap();
        s.entries.get_mut("a").unwrap().n = 2;
        f.save(1, &s).unwrap();
        let back: Value = serde_json::from_slice(&std::fs::read(f.path()).unwrap()).unwrap();
        assert_eq!(
            back,
            serde_json::json!({"version": 1, "lease": 9,
                "state": {"entries": {"a": {"n": 2, "since": 4}}, "next": true}})
        );
        std::fs::write(
            f.path(),
            r#"{"version":2,"written_by":"fort 0.3.0","state":{}}"#,
        )
        .unwrap();
        let e = f.load::<S>(1).unwrap_err().to_string();
        assert!(e.contains("version 2, written by fort 0.3.0"), "{e}");
        use std::os::unix::fs::MetadataExt;
        assert_eq!(std::fs::metadata(f.path()).unwrap().mode() & 0o777, 0o600);
    }
}
