//! The files behind a [`super::Store`]: a JSON snapshot (`<name>.json`, the format
//! operators read and older agents wrote) and numbered append-only logs
//! (`<name>.log.<generation>`), one checksummed JSON record per line.
//!
//! A log line is `<crc32 of the JSON, 8 hex digits> <{"k": key, "v": value or null}>\n`.
//! Recovery reads the snapshot, then replays every log whose generation is at least the
//! snapshot's `next_log`, in order. Within one log, an invalid line followed only by
//! invalid lines is a torn tail (a write cut short by a crash or a full disk) and is
//! dropped; an invalid line followed by a valid one is corruption, and nothing starts.

use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The snapshot's version; version 1 (a whole-state file, no logs) is read as is.
pub const SNAPSHOT_VERSION: u32 = 2;

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
}

fn io_err(file: &Path) -> impl FnOnce(std::io::Error) -> LoadError + '_ {
    move |source| LoadError::Io {
        file: file.display().to_string(),
        source,
    }
}

/// A log record: one key set to a value, or removed (`v: null`).
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Record<V> {
    pub k: String,
    pub v: Option<V>,
}

/// One encoded log line, proven to read back as written.
pub fn encode_line<V: Serialize + DeserializeOwned>(
    key: &str,
    value: Option<&V>,
) -> Result<Vec<u8>, String> {
    #[derive(Serialize)]
    struct Out<'a, V> {
        k: &'a str,
        v: Option<&'a V>,
    }
    let json = serde_json::to_vec(&Out { k: key, v: value }).map_err(|e| e.to_string())?;
    // The proof that what is written can be read back (a value nested past the parser's
    // limit, say, would make the whole state unreadable at the next start).
    serde_json::from_slice::<Record<V>>(&json)
        .map_err(|e| format!("the change would not read back: {e}"))?;
    let mut line = format!("{:08x} ", crc32fast::hash(&json)).into_bytes();
    line.extend_from_slice(&json);
    line.push(b'\n');
    Ok(line)
}

/// Decodes one line (without its `\n`); `None` when torn, mangled or foreign.
fn decode_line<V: DeserializeOwned>(line: &[u8]) -> Option<Record<V>> {
    let (crc, json) = (line.get(..8)?, line.get(9..)?);
    if line.get(8) != Some(&b' ') {
        return None;
    }
    let crc = u32::from_str_radix(std::str::from_utf8(crc).ok()?, 16).ok()?;
    if crc32fast::hash(json) != crc {
        return None;
    }
    serde_json::from_slice(json).ok()
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
    pub next_log: u64,
    pub logs: Vec<u64>,
    pub snapshot_bytes: u64,
    pub torn_tails: usize,
}

/// Reads the snapshot and replays the logs. `strict`: torn tails are cut off the files
/// (the agent is about to append); otherwise they are only skipped (a read-only view).
pub fn load<V: DeserializeOwned>(
    dir: &Path,
    name: &str,
    field: &str,
    strict: bool,
) -> Result<Loaded<V>, LoadError> {
    let path = snapshot_path(dir, name);
    let (map, next_log, snapshot_bytes) = match std::fs::read(&path) {
        Ok(bytes) => {
            let corrupt = |detail: String| LoadError::Corrupt {
                file: path.display().to_string(),
                detail,
            };
            let mut doc: serde_json::Map<String, Value> =
                serde_json::from_slice(&bytes).map_err(|e| corrupt(e.to_string()))?;
            let version = doc.get("version").and_then(Value::as_u64).unwrap_or(0);
            if version != 1 && version != u64::from(SNAPSHOT_VERSION) {
                return Err(corrupt(format!(
                    "version {version} is not one this agent reads (1 or {SNAPSHOT_VERSION})"
                )));
            }
            let next_log = doc.get("next_log").and_then(Value::as_u64).unwrap_or(0);
            let map = doc
                .remove(field)
                .unwrap_or(Value::Object(Default::default()));
            let map: BTreeMap<String, V> =
                serde_json::from_value(map).map_err(|e| corrupt(format!("{field}: {e}")))?;
            (map, next_log, bytes.len() as u64)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => (BTreeMap::new(), 0, 0),
        Err(e) => return Err(io_err(&path)(e)),
    };
    let mut loaded = Loaded {
        map,
        next_log,
        logs: Vec::new(),
        snapshot_bytes,
        torn_tails: 0,
    };
    for generation in log_generations(dir, name)? {
        if generation < next_log {
            continue; // already in the snapshot
        }
        let file = log_path(dir, name, generation);
        if replay(&file, &mut loaded.map, strict)? {
            loaded.torn_tails += 1;
        }
        loaded.logs.push(generation);
    }
    Ok(loaded)
}

/// Applies one log's records; returns whether a torn tail was found (and, with
/// `strict`, cut off).
fn replay<V: DeserializeOwned>(
    file: &Path,
    map: &mut BTreeMap<String, V>,
    strict: bool,
) -> Result<bool, LoadError> {
    let f = std::fs::File::open(file).map_err(io_err(file))?;
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
        let record = if complete {
            decode_line::<V>(&line[..line.len() - 1])
        } else {
            None
        };
        match (record, torn_at) {
            (Some(r), None) => match r.v {
                Some(v) => {
                    map.insert(r.k, v);
                }
                None => {
                    map.remove(&r.k);
                }
            },
            (Some(_), Some((_, bad))) => {
                return Err(LoadError::Corrupt {
                    file: file.display().to_string(),
                    detail: format!("line {bad} is damaged but valid records follow it"),
                })
            }
            (None, None) => torn_at = Some((offset, number)),
            (None, Some(_)) => {}
        }
        offset += n as u64;
    }
    if let Some((at, number)) = torn_at {
        tracing::warn!(file = %file.display(), line = number, "state log ends in a torn record (a write cut short); it is dropped");
        if strict {
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(file)
                .map_err(io_err(file))?;
            f.set_len(at).map_err(io_err(file))?;
            f.sync_all().map_err(io_err(file))?;
        }
        return Ok(true);
    }
    Ok(false)
}

/// The snapshot bytes of `map` under `field`, proven to read back.
pub fn encode_snapshot<V: Serialize + DeserializeOwned>(
    field: &str,
    next_log: u64,
    map: &BTreeMap<String, V>,
) -> Result<Vec<u8>, String> {
    #[derive(Serialize)]
    struct Snap<'a, V> {
        version: u32,
        next_log: u64,
        #[serde(flatten)]
        body: BTreeMap<&'a str, &'a BTreeMap<String, V>>,
    }
    let mut body = BTreeMap::new();
    body.insert(field, map);
    // Compact: operators read it with `fort-agent state` or `jq .`.
    let bytes = serde_json::to_vec(&Snap {
        version: SNAPSHOT_VERSION,
        next_log,
        body,
    })
    .map_err(|e| e.to_string())?;
    // Proof that it parses back, without building it again: every record in it was
    // proven readable when it was logged; what remains is the document around them.
    serde_json::from_slice::<serde::de::IgnoredAny>(&bytes)
        .map_err(|e| format!("snapshot would not read back: {e}"))?;
    Ok(bytes)
}

/// Replaces `path` with `bytes`: a crash leaves either the old file or the new one.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("state");
    let tmp = dir.join(format!(
        ".{name}.tmp.{}.{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let result = (|| {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        drop(file);
        std::fs::rename(&tmp, path)?;
        std::fs::File::open(dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Opens (creating, mode 0600, never through a symlink) a log for appending.
pub fn open_log(path: &Path) -> std::io::Result<std::fs::File> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(file)
}

/// Removes temporary files a killed process left behind (`.<file>.tmp.<pid>.<n>`).
pub fn remove_stale_temporaries(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.filter_map(Result::ok) {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        if name.starts_with('.') && name.contains(".tmp.") && std::fs::remove_file(e.path()).is_ok()
        {
            removed += 1;
        }
    }
    removed
}
