//! Records partly sealed with the state key (docs/at-rest.md): what a store seals, how a
//! sealed snapshot is opened (with its key, left sealed for a look, skipped when
//! recovering), and the whole state sealed again with another key.

use std::path::Path;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::files::{self, io_err, LoadError, Mode, KEY_ID, SEALED, SEALED_SNAPSHOT_VERSION};
use super::write_atomic_at;

/// Seals a part of each record on disk (a provider entry's cached response), the rest
/// staying plain so that what needs no secret reads the file without the key; memory
/// holds the records opened. Made for one file: what it seals opens only there.
pub trait Seal<V>: Send + Sync {
    /// The id of the key it seals with, recorded in the snapshot.
    fn key_id(&self) -> &str;
    /// `value`, the record of `key`, as written.
    fn seal(&self, key: &str, value: &V) -> V;
    /// `value`, the record of `key` as read, its sealed parts opened; `Err` names the
    /// member that does not open (changed, or moved from another record or file).
    fn open(&self, key: &str, value: V) -> Result<V, String>;
}

/// Whether and how a store's records are sealed.
pub enum Sealing<V> {
    /// Never: the store reads the plain versions only.
    Never,
    /// Sealed when there is a key, and there is none: a sealed file is refused.
    WithoutKey,
    /// Sealed with this key.
    With(std::sync::Arc<dyn Seal<V>>),
}

impl<V> Clone for Sealing<V> {
    fn clone(&self) -> Self {
        match self {
            Sealing::Never => Sealing::Never,
            Sealing::WithoutKey => Sealing::WithoutKey,
            Sealing::With(s) => Sealing::With(s.clone()),
        }
    }
}

impl<V> Sealing<V> {
    pub fn seal(&self) -> Option<&dyn Seal<V>> {
        match self {
            Sealing::With(s) => Some(&**s),
            _ => None,
        }
    }
}

/// What [`load`] does with the sealed parts of records.
pub(super) enum Opening<'a, V> {
    /// A plain file: nothing to open.
    Plain,
    /// Opened with the store's key.
    Open(&'a dyn Seal<V>),
    /// Left as they are ([`Mode::View`] without the key: what needs no secret reads on).
    AsSealed,
    /// Skipped and listed ([`Mode::Lenient`] without the key).
    Skip,
}

impl<V> Clone for Opening<'_, V> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<V> Copy for Opening<'_, V> {}

impl<V> Opening<'_, V> {
    /// `v`, the record of `key`, opened as this says; `Ok(None)`: skipped.
    pub(super) fn apply(
        &self,
        key: &str,
        v: V,
        at: &dyn Fn() -> String,
    ) -> Result<Option<V>, String> {
        match self {
            Opening::Plain | Opening::AsSealed => Ok(Some(v)),
            Opening::Open(s) => s
                .open(key, v)
                .map(Some)
                .map_err(|member| format!("{}.{member}", at())),
            Opening::Skip => Ok(None),
        }
    }
}

/// The key the snapshot at `path` is sealed with: `None` without a snapshot, `Some(None)`
/// for a plain one.
pub(super) fn sealed_key_id(path: &Path) -> Result<Option<Option<String>>, LoadError> {
    #[derive(Deserialize)]
    struct Head {
        #[serde(default)]
        version: u64,
        #[serde(default)]
        key_id: Option<String>,
    }
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(path)(e)),
    };
    let head: Head = serde_json::from_slice(&bytes).map_err(|e| LoadError::Corrupt {
        file: path.display().to_string(),
        detail: e.to_string(),
    })?;
    Ok(Some(head.key_id.filter(|_| {
        head.version == u64::from(SEALED_SNAPSHOT_VERSION)
    })))
}

/// How the records of a sealed snapshot (`doc`) are opened, given the store's sealing:
/// with the key it names, or left sealed for a look, or skipped when recovering; a key
/// missing or another one refuses the file with the way on.
pub(super) fn sealed_opening<'a, V>(
    doc: &Map<String, Value>,
    file: &str,
    mode: Mode,
    sealing: &'a Sealing<V>,
    written_by: &str,
) -> Result<Opening<'a, V>, LoadError> {
    let refused = |field: &str, problem: String| LoadError::Refused {
        file: file.to_owned(),
        field: field.to_owned(),
        problem,
        written_by: written_by.to_owned(),
    };
    let format = doc.get(SEALED).and_then(Value::as_str).unwrap_or("");
    if format != crate::sealed::VALUE_FORMAT {
        return Err(refused(
            SEALED,
            format!(
                "sealed values in the format {format:?}; this release reads {:?}",
                crate::sealed::VALUE_FORMAT
            ),
        ));
    }
    let Some(found) = doc.get(KEY_ID).and_then(Value::as_str) else {
        return Err(refused(KEY_ID, "missing: no key is named".to_owned()));
    };
    let found = crate::text::printable(found, 64);
    Ok(match (sealing, mode) {
        (Sealing::With(s), _) if s.key_id() == found => Opening::Open(&**s),
        (_, Mode::View) => Opening::AsSealed,
        (_, Mode::Lenient) => Opening::Skip,
        (Sealing::With(s), _) => {
            return Err(crate::sealed::SealError::OtherKey {
                file: file.to_owned(),
                found,
                ours: s.key_id().to_owned(),
            }
            .into())
        }
        _ => {
            return Err(crate::sealed::SealError::NoKey {
                file: file.to_owned(),
                found,
            }
            .into())
        }
    })
}

pub(super) fn tampered(at: String) -> LoadError {
    crate::sealed::SealError::Tampered { file: at }.into()
}

/// What [`reseal`] found and did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resealed {
    /// There is no such state.
    Absent,
    /// It is plain: the agent seals it at its next start with a key.
    Plain,
    /// It already was sealed with the new key (and opens with it).
    Already,
    /// It was sealed with the old key and now is with the new one.
    Resealed,
}

/// The state at `path`, sealed with another key (`fort-agent state-key rotate`, the
/// agent stopped): read whole with `old`, written again as one snapshot sealed with
/// `new`, atomically; logs it folded are removed after. A state already under `new` is
/// opened to prove it and left alone, so a rotation cut short is finished by running it
/// again.
pub fn reseal<V: Serialize + DeserializeOwned>(
    path: &Path,
    field: &str,
    old: Sealing<V>,
    new: Arc<dyn Seal<V>>,
) -> Result<Resealed, LoadError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_stem().and_then(|s| s.to_str()).unwrap_or("state");
    // What a rotation killed before its rename left is never state.
    super::remove_stale_temporaries_of(path);
    let found = match sealed_key_id(path)? {
        None => return Ok(Resealed::Absent),
        Some(None) => return Ok(Resealed::Plain),
        Some(Some(id)) => id,
    };
    if found == new.key_id() {
        files::load::<V>(dir, name, field, files::Mode::Strict, &Sealing::With(new))?;
        return Ok(Resealed::Already);
    }
    let loaded = files::load::<V>(dir, name, field, files::Mode::Strict, &old)?;
    let next = loaded
        .logs
        .last()
        .map_or(loaded.next_log, |g| g + 1)
        .max(loaded.next_log)
        .max(1);
    let bytes = files::encode_snapshot(
        field,
        next,
        &loaded.map,
        &loaded.unknown,
        &loaded.extra,
        Some(&*new),
    )
    .map_err(|e| LoadError::Io {
        file: path.display().to_string(),
        source: std::io::Error::other(e),
    })?;
    write_atomic_at(
        path,
        &bytes,
        Some(crate::crash::replace_temp("state-key.rotate.snapshot")),
    )
    .map_err(|source| LoadError::Io {
        file: path.display().to_string(),
        source,
    })?;
    for g in files::log_generations(dir, name)? {
        if g < next {
            let _ = std::fs::remove_file(files::log_path(dir, name, g));
        }
    }
    Ok(Resealed::Resealed)
}
