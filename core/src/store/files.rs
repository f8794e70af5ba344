//! The files behind a [`super::Store`]: a JSON snapshot (`<name>.json`, the format
//! operators read and older agents wrote) and numbered append-only logs
//! (`<name>.log.<generation>`), one checksummed JSON record per line.
//!
//! A log line is `<crc32 of the JSON, 8 hex digits> <{"k": key, "v": value or null}>\n`.
//! Recovery reads the snapshot, then replays every log whose generation is at least the
//! snapshot's `next_log`, in order. Within one log, an invalid line followed only by
//! invalid lines is a torn tail (a write cut short by a crash or a full disk) and is
//! dropped; an invalid line followed by a valid one is corruption, and nothing starts.
//!
//! Across releases (docs/compatibility.md): members a record has that this release does
//! not know are kept and written back, so does the snapshot's own; a record whose
//! checksum holds but which this release cannot read (another release's format) is a
//! refusal naming the file, the field and the release that wrote it, never a torn tail.

use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::{Path, PathBuf};

use std::collections::HashMap;

use serde::de::DeserializeOwned;
use serde::ser::SerializeMap;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::seal::{sealed_opening, tampered, Opening, Seal, Sealing};
use crate::compat::{self, Unknown};

/// A snapshot larger than this is refused rather than read (no state fort writes comes
/// near it: 10,000 entries take tens of megabytes).
const MAX_SNAPSHOT_BYTES: u64 = 16 << 30;

/// The snapshot's version; version 1 (a whole-state file, no logs) is read as is. A
/// change an older release cannot read raises it, and is written only once the operator
/// says the fleet has moved (docs/compatibility.md): the release before refuses a higher
/// version by name instead of misreading it.
pub const SNAPSHOT_VERSION: u32 = 2;
/// The snapshot's version when a part of each record is sealed with the state key
/// (docs/at-rest.md): written only with a key, so that without one nothing changes for
/// the release before, and with one it refuses the file by name instead of misreading it.
pub const SEALED_SNAPSHOT_VERSION: u32 = 3;
/// The versions a store that may be sealed reads (provider-state.json).
pub const SNAPSHOT_READS: [u32; 3] = [1, 2, 3];
/// The versions a store that is never sealed reads (fulfillment-state.json).
pub const PLAIN_SNAPSHOT_READS: [u32; 2] = [1, 2];

/// The members of a sealed snapshot that say how: the format of its sealed values and
/// the id of the key they are sealed with.
pub(super) const SEALED: &str = "sealed";
pub(super) const KEY_ID: &str = "key_id";

/// The snapshot's own members; any other (a later release's) is kept as it is.
const OWN_MEMBERS: [&str; 5] = ["version", "next_log", compat::WRITTEN_BY, SEALED, KEY_ID];

/// Why state could not be read; the agent refuses to start rather than overwrite it.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{file}: {source}")]
    Io {
        file: String,
        source: std::io::Error,
    },
    #[error("{file}: unreadable: {detail}. The agent will not start and overwrite it: restore it from a backup, or move it aside to start with an empty state")]
    Corrupt { file: String, detail: String },
    /// Well-formed, but in a form this release cannot read: another release wrote it.
    #[error("{file}: {field}: {problem}; written by {written_by}, which this release (fort {release}) cannot read. The agent will not start on it, and nothing was changed", release = compat::RELEASE)]
    Refused {
        file: String,
        /// Where in the file: `version`, `needs.oidc/wiki.phase`, `line 3: v.phase`.
        field: String,
        problem: String,
        written_by: String,
    },
    /// Sealed with another key, or none is given, or a sealed value does not open.
    #[error("{0}")]
    Sealed(#[from] crate::sealed::SealError),
}

impl LoadError {
    /// Whether a recovering start can get past it (what it can read, it keeps).
    pub fn recoverable(&self) -> bool {
        !matches!(self, LoadError::Io { .. })
    }
}

/// How [`load`] treats what it cannot use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The agent is about to append: torn tails are cut off; anything else stops it.
    Strict,
    /// A read-only look: torn tails are skipped, not cut.
    View,
    /// A recovering start, on files already moved aside: every record it cannot read is
    /// skipped and listed, the rest is kept.
    Lenient,
}

pub(super) fn io_err(file: &Path) -> impl FnOnce(std::io::Error) -> LoadError + '_ {
    move |source| LoadError::Io {
        file: file.display().to_string(),
        source,
    }
}

/// A log record: one key set to a value, or removed (`v: null`). Members of a record
/// other than these (a later release's) are ignored.
#[derive(Serialize, Deserialize)]
pub struct Record<V> {
    pub k: String,
    pub v: Option<V>,
}

/// One encoded log line, proven to read back as written; `unknown`: members of the
/// record as read that this release does not know, written back with it.
pub fn encode_line<V: Serialize + DeserializeOwned>(
    key: &str,
    value: Option<&V>,
    unknown: Option<&Unknown>,
    seal: Option<&dyn Seal<V>>,
) -> Result<Vec<u8>, String> {
    let sealed = match (seal, value) {
        (Some(s), Some(v)) => Some(s.seal(key, v)),
        _ => None,
    };
    let value = sealed.as_ref().or(value);
    #[derive(Serialize)]
    struct Out<'a, V> {
        k: &'a str,
        v: Option<&'a V>,
    }
    let json = match (value, unknown) {
        (Some(v), Some(u)) if !u.is_empty() => {
            let merged = compat::to_value(v, u).map_err(|e| e.to_string())?;
            serde_json::to_vec(&Out {
                k: key,
                v: Some(&merged),
            })
        }
        _ => serde_json::to_vec(&Out { k: key, v: value }),
    }
    .map_err(|e| e.to_string())?;
    // The proof that what is written can be read back (a value nested past the parser's
    // limit, say, would make the whole state unreadable at the next start).
    serde_json::from_slice::<Record<V>>(&json)
        .map_err(|e| format!("the change would not read back: {e}"))?;
    let mut line = format!("{:08x} ", crc32fast::hash(&json)).into_bytes();
    line.extend_from_slice(&json);
    line.push(b'\n');
    Ok(line)
}

/// One line of a log, decoded.
enum Line<V> {
    Record(Record<V>, Unknown),
    /// Torn, mangled or foreign: its checksum does not hold.
    Torn,
    /// Whole (its checksum holds), but not a record this release can read.
    Refused(compat::ReadError),
}

/// Decodes one line (without its `\n`).
fn decode_line<V: DeserializeOwned + Serialize>(line: &[u8]) -> Line<V> {
    let checked = || {
        let (crc, json) = (line.get(..8)?, line.get(9..)?);
        if line.get(8) != Some(&b' ') {
            return None;
        }
        let crc = u32::from_str_radix(std::str::from_utf8(crc).ok()?, 16).ok()?;
        (crc32fast::hash(json) == crc).then_some(json)
    };
    let Some(json) = checked() else {
        return Line::Torn;
    };
    match compat::read_slice::<Record<V>>(json) {
        Ok((record, unknown)) => Line::Record(record, compat::record_unknown(unknown)),
        Err(e) => Line::Refused(e),
    }
}

pub fn snapshot_path(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("{name}.json"))
}

pub fn log_path(dir: &Path, name: &str, generation: u64) -> PathBuf {
    dir.join(format!("{name}.log.{generation}"))
}

/// Generations of the logs present, ascending.
pub fn log_generations(dir: &Path, name: &str) -> Result<Vec<u64>, LoadError> {
    let prefix = format!("{name}.log.");
    let mut out: Vec<u64> = std::fs::read_dir(dir)
        .map_err(io_err(dir))?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            e.file_name()
                .to_str()?
                .strip_prefix(&prefix)?
                .parse::<u64>()
                .ok()
        })
        .collect();
    out.sort_unstable();
    Ok(out)
}

/// What recovery found.
pub struct Loaded<V> {
    pub map: BTreeMap<String, V>,
    /// Per record, the members this release does not know (records without any are absent).
    pub unknown: HashMap<String, Unknown>,
    /// The snapshot's members this release does not know, kept as they are.
    pub extra: Map<String, Value>,
    pub next_log: u64,
    pub logs: Vec<u64>,
    pub snapshot_bytes: u64,
    pub torn_tails: usize,
    /// [`Mode::Lenient`]: what was skipped, one line each (`needs.oidc/wiki.phase: …`).
    pub skipped: Vec<String>,
    /// The id of the key the snapshot is sealed with; `None`: a plain snapshot, or none.
    pub sealed_with: Option<String>,
}

/// Reads the snapshot and replays the logs, as `mode` says.
pub fn load<V: DeserializeOwned + Serialize>(
    dir: &Path,
    name: &str,
    field: &str,
    mode: Mode,
    sealing: &Sealing<V>,
) -> Result<Loaded<V>, LoadError> {
    let path = snapshot_path(dir, name);
    let mut loaded = Loaded {
        map: BTreeMap::new(),
        unknown: HashMap::new(),
        extra: Map::new(),
        next_log: 0,
        logs: Vec::new(),
        snapshot_bytes: 0,
        torn_tails: 0,
        skipped: Vec::new(),
        sealed_with: None,
    };
    let mut written_by = compat::writer();
    let mut opening = Opening::Plain;
    // A store never sealed reads the plain versions only (and refuses a sealed one by its
    // version, as the release before does); a read-only look reads them all.
    let reads: &[u32] = match (sealing, mode) {
        (Sealing::Never, Mode::Strict | Mode::Lenient) => &PLAIN_SNAPSHOT_READS,
        _ => &SNAPSHOT_READS,
    };
    let newest = u64::from(reads[reads.len() - 1]);
    match crate::fsx::read_regular(&path, MAX_SNAPSHOT_BYTES) {
        Ok(bytes) => {
            let file = path.display().to_string();
            let corrupt = |detail: String| LoadError::Corrupt {
                file: file.clone(),
                detail,
            };
            let mut doc: Map<String, Value> =
                serde_json::from_slice(&bytes).map_err(|e| corrupt(e.to_string()))?;
            written_by = compat::written_by(&doc);
            let version = doc.get("version").and_then(Value::as_u64).unwrap_or(0);
            let known = reads.iter().any(|v| u64::from(*v) == version);
            if !known && version > newest && mode != Mode::Lenient {
                return Err(LoadError::Refused {
                    file,
                    field: "version".into(),
                    problem: format!(
                        "format version {version}; this release reads versions {reads:?}"
                    ),
                    written_by,
                });
            }
            if !known && version <= newest {
                return Err(corrupt(format!(
                    "version {version} is not one this agent reads ({reads:?})"
                )));
            }
            if known && version == u64::from(SEALED_SNAPSHOT_VERSION) {
                opening = sealed_opening(&doc, &file, mode, sealing, &written_by)?;
                loaded.sealed_with = doc.get(KEY_ID).and_then(Value::as_str).map(str::to_owned);
            }
            loaded.next_log = doc.get("next_log").and_then(Value::as_u64).unwrap_or(0);
            let records = doc
                .remove(field)
                .unwrap_or(Value::Object(Default::default()));
            let Value::Object(records) = records else {
                return Err(corrupt(format!("{field}: not an object")));
            };
            for (key, value) in records {
                match compat::read::<V>(&value) {
                    Ok((v, unknown)) => {
                        let at = || format!("{file}: {field}.{key}");
                        let v = match opening.apply(&key, v, &at) {
                            Ok(Some(v)) => v,
                            Ok(None) => {
                                loaded.skipped.push(format!(
                                    "{field}.{key}: sealed with a key this process does not have"
                                ));
                                continue;
                            }
                            Err(at) if mode == Mode::Lenient => {
                                loaded.skipped.push(format!("{at}: does not open"));
                                continue;
                            }
                            Err(at) => return Err(tampered(at)),
                        };
                        if !unknown.is_empty() {
                            loaded.unknown.insert(key.clone(), unknown);
                        }
                        loaded.map.insert(key, v);
                    }
                    Err(e) if mode == Mode::Lenient => loaded
                        .skipped
                        .push(format!("{field}.{key}.{}: {}", e.path, e.message)),
                    Err(e) => {
                        return Err(LoadError::Refused {
                            file,
                            field: format!("{field}.{key}.{}", e.path),
                            problem: e.message,
                            written_by,
                        })
                    }
                }
            }
            doc.retain(|k, _| !OWN_MEMBERS.contains(&k.as_str()));
            loaded.extra = doc;
            loaded.snapshot_bytes = bytes.len() as u64;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err(&path)(e)),
    }
    for generation in log_generations(dir, name)? {
        if generation < loaded.next_log {
            continue; // already in the snapshot
        }
        let file = log_path(dir, name, generation);
        if replay(&file, &mut loaded, mode, &written_by, opening)? {
            loaded.torn_tails += 1;
        }
        loaded.logs.push(generation);
    }
    Ok(loaded)
}

/// Applies one log's records; returns whether a torn tail was found (and, in
/// [`Mode::Strict`], cut off).
fn replay<V: DeserializeOwned + Serialize>(
    file: &Path,
    loaded: &mut Loaded<V>,
    mode: Mode,
    written_by: &str,
    opening: Opening<'_, V>,
) -> Result<bool, LoadError> {
    let f = crate::fsx::open_regular(file).map_err(io_err(file))?;
    let mut reader = std::io::BufReader::new(f);
    let mut offset = 0u64;
    let mut torn_at: Option<(u64, usize)> = None;
    let mut line = Vec::new();
    let mut number = 0usize;
    loop {
        line.clear();
        let n = reader.read_until(b'\n', &mut line).map_err(io_err(file))?;
        if n == 0 {
            break;
        }
        number += 1;
        let complete = line.last() == Some(&b'\n');
        let decoded = if complete {
            decode_line::<V>(&line[..line.len() - 1])
        } else {
            Line::Torn
        };
        if let (Some((_, bad)), false) = (torn_at, matches!(decoded, Line::Torn)) {
            if mode != Mode::Lenient {
                return Err(LoadError::Corrupt {
                    file: file.display().to_string(),
                    detail: format!("line {bad} is damaged but valid records follow it"),
                });
            }
            loaded
                .skipped
                .push(format!("{} line {bad}: damaged", file.display()));
            torn_at = None;
        }
        match decoded {
            Line::Record(r, unknown) if torn_at.is_none() => match r.v {
                Some(v) => {
                    let at = || format!("{} line {number}: v", file.display());
                    let v = match opening.apply(&r.k, v, &at) {
                        Ok(Some(v)) => v,
                        Ok(None) => {
                            loaded.skipped.push(format!(
                                "{} line {number}: {}: sealed with a key this process does not have",
                                file.display(),
                                r.k
                            ));
                            loaded.unknown.remove(&r.k);
                            loaded.map.remove(&r.k);
                            offset += n as u64;
                            continue;
                        }
                        Err(at) if mode == Mode::Lenient => {
                            loaded.skipped.push(format!("{at}: does not open"));
                            loaded.unknown.remove(&r.k);
                            loaded.map.remove(&r.k);
                            offset += n as u64;
                            continue;
                        }
                        Err(at) => return Err(tampered(at)),
                    };
                    if unknown.is_empty() {
                        loaded.unknown.remove(&r.k);
                    } else {
                        loaded.unknown.insert(r.k.clone(), unknown);
                    }
                    loaded.map.insert(r.k, v);
                }
                None => {
                    loaded.unknown.remove(&r.k);
                    loaded.map.remove(&r.k);
                }
            },
            Line::Refused(e) if mode == Mode::Lenient => {
                loaded.skipped.push(format!(
                    "{} line {number}: {}: {}",
                    file.display(),
                    e.path,
                    e.message
                ));
            }
            Line::Refused(e) => {
                return Err(LoadError::Refused {
                    file: file.display().to_string(),
                    field: format!("line {number}: {}", e.path),
                    problem: e.message,
                    written_by: written_by.to_owned(),
                })
            }
            Line::Torn if torn_at.is_none() => torn_at = Some((offset, number)),
            _ => {}
        }
        offset += n as u64;
    }
    if let Some((at, number)) = torn_at {
        tracing::warn!(file = %file.display(), line = number, "state log ends in a torn record (a write cut short); it is dropped");
        if mode == Mode::Strict {
            let f = crate::fsx::open_regular_for_write(file).map_err(io_err(file))?;
            f.set_len(at).map_err(io_err(file))?;
            f.sync_all().map_err(io_err(file))?;
        }
        return Ok(true);
    }
    Ok(false)
}

/// The records of a snapshot, each with the members this release does not know put back.
struct Records<'a, V> {
    map: &'a BTreeMap<String, V>,
    unknown: &'a HashMap<String, Unknown>,
    seal: Option<&'a dyn Seal<V>>,
}

impl<V: Serialize> Serialize for Records<'_, V> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut out = s.serialize_map(Some(self.map.len()))?;
        for (k, v) in self.map {
            let sealed = self.seal.map(|s| s.seal(k, v));
            let v = sealed.as_ref().unwrap_or(v);
            match self.unknown.get(k) {
                Some(u) if !u.is_empty() => {
                    let merged = compat::to_value(v, u).map_err(serde::ser::Error::custom)?;
                    out.serialize_entry(k, &merged)?;
                }
                _ => out.serialize_entry(k, v)?,
            }
        }
        out.end()
    }
}

/// The snapshot bytes of `map` under `field`, proven to read back: its records with
/// their `unknown` members, and `extra`, the snapshot's members of another release.
pub fn encode_snapshot<V: Serialize + DeserializeOwned>(
    field: &str,
    next_log: u64,
    map: &BTreeMap<String, V>,
    unknown: &HashMap<String, Unknown>,
    extra: &Map<String, Value>,
    seal: Option<&dyn Seal<V>>,
) -> Result<Vec<u8>, String> {
    struct Snap<'a, V> {
        field: &'a str,
        next_log: u64,
        records: Records<'a, V>,
        extra: &'a Map<String, Value>,
    }
    impl<V: Serialize> Serialize for Snap<'_, V> {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            let mut out = s.serialize_map(None)?;
            match self.records.seal {
                Some(s) => {
                    out.serialize_entry("version", &SEALED_SNAPSHOT_VERSION)?;
                    out.serialize_entry(SEALED, crate::sealed::VALUE_FORMAT)?;
                    out.serialize_entry(KEY_ID, s.key_id())?;
                }
                None => out.serialize_entry("version", &SNAPSHOT_VERSION)?,
            }
            out.serialize_entry("next_log", &self.next_log)?;
            // Read by nothing but messages: an older release ignores it (and drops it
            // when it rewrites the file, which then rightly names no writer).
            out.serialize_entry(compat::WRITTEN_BY, &compat::writer())?;
            for (k, v) in self.extra {
                if k != self.field && !OWN_MEMBERS.contains(&k.as_str()) {
                    out.serialize_entry(k, v)?;
                }
            }
            out.serialize_entry(self.field, &self.records)?;
            out.end()
        }
    }
    // Compact: operators read it with `fort-agent state` or `jq .`.
    let bytes = serde_json::to_vec(&Snap {
        field,
        next_log,
        records: Records { map, unknown, seal },
        extra,
    })
    .map_err(|e| e.to_string())?;
    // Proof that it parses back, without building it again: every record in it was
    // proven readable when it was logged; what remains is the document around them.
    serde_json::from_slice::<serde::de::IgnoredAny>(&bytes)
        .map_err(|e| format!("snapshot would not read back: {e}"))?;
    Ok(bytes)
}

/// Moves `<name>.json` and its logs from `dir` into a new directory
/// `dir/set-aside/<name>.<unix seconds>` (0700), where nothing reads them and nothing is
/// lost; `None` when there was nothing to move.
pub fn set_aside(dir: &Path, name: &str) -> Result<Option<PathBuf>, LoadError> {
    use std::os::unix::fs::DirBuilderExt;
    let mut files = Vec::new();
    let snapshot = snapshot_path(dir, name);
    if snapshot.exists() {
        files.push(snapshot);
    }
    for g in log_generations(dir, name)? {
        files.push(log_path(dir, name, g));
    }
    if files.is_empty() {
        return Ok(None);
    }
    let parent = dir.join("set-aside");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut target = parent.join(format!("{name}.{now}"));
    let mut n = 1;
    while target.exists() {
        target = parent.join(format!("{name}.{now}.{n}"));
        n += 1;
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&target)
        .map_err(io_err(&target))?;
    for f in &files {
        let to = target.join(f.file_name().expect("a file name"));
        std::fs::rename(f, &to).map_err(io_err(f))?;
    }
    for d in [&target, &parent, &dir.to_path_buf()] {
        std::fs::File::open(d)
            .and_then(|f| f.sync_all())
            .map_err(io_err(d))?;
    }
    Ok(Some(target))
}
