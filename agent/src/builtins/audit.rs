//! `audit` — the host's audit trail as it is on disk, for an operator's copy
//! (docs/protocol.md §5a): the listing of its files, or one chunk of one file from an
//! offset on, cut at the last complete line.

use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use base64::Engine;
use fort_core::audit::INDEX_FILE;
use serde::Deserialize;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::ParamError;

/// The most a chunk holds, and what is handed out when `max_bytes` is not given.
pub const MAX_CHUNK: u64 = 1 << 20;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Params {
    #[serde(default)]
    file: Option<String>,
    #[serde(default)]
    offset: u64,
    #[serde(default)]
    max_bytes: Option<u64>,
    #[serde(default)]
    prefix_sha256: bool,
}

/// What was asked: the listing, or a chunk of one file.
#[derive(Debug, PartialEq, Eq)]
pub enum Ask {
    Listing,
    Chunk {
        name: String,
        offset: u64,
        max_bytes: u64,
        prefix_sha256: bool,
    },
}

/// Whether `name` is one of the trail's own file names: a record file
/// (`0000000000000001.jsonl`) or the checkpoint index. Nothing else is ever opened.
pub fn is_trail_name(name: &str) -> bool {
    name == INDEX_FILE || is_record_file(name)
}

fn is_record_file(name: &str) -> bool {
    name.len() == 22
        && name.ends_with(".jsonl")
        && name.as_bytes()[..16].iter().all(u8::is_ascii_digit)
}

/// The request's parameters, checked: a file name that is not the trail's is refused
/// before anything is opened.
pub fn parse(params: &Value) -> Result<Ask, ParamError> {
    let p: Params =
        serde_json::from_value(params.clone()).map_err(|e| ParamError(format!("audit: {e}")))?;
    let Some(name) = p.file else {
        return Ok(Ask::Listing);
    };
    if !is_trail_name(&name) {
        return Err(ParamError(format!(
            "audit: file {:?} is not a file of the audit trail (0000000000000001.jsonl … or {INDEX_FILE})",
            fort_core::text::printable(&name, 80)
        )));
    }
    Ok(Ask::Chunk {
        name,
        offset: p.offset,
        max_bytes: p.max_bytes.unwrap_or(MAX_CHUNK).min(MAX_CHUNK),
        prefix_sha256: p.prefix_sha256,
    })
}

/// Why a chunk could not be handed out: the caller's mistake (400), a file that is not
/// there (404), or the disk (500).
#[derive(Debug)]
pub enum ReadError {
    Bad(String),
    Missing(String),
    Io(String),
}

/// The listing: the record files oldest first with their lengths, and the index's.
pub fn listing(dir: &Path) -> Result<Value, ReadError> {
    let files = match fort_core::audit::files(dir) {
        Ok(f) => f,
        // No record written yet: an empty trail.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(ReadError::Io(format!("{}: {e}", dir.display()))),
    };
    let mut out = Vec::with_capacity(files.len());
    for path in files {
        // A file rotated away between the listing and its length is left out.
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        out.push(json!({"name": name, "bytes": meta.len()}));
    }
    let index = std::fs::symlink_metadata(dir.join(INDEX_FILE))
        .ok()
        .filter(|m| m.file_type().is_file())
        .map(|m| m.len());
    Ok(json!({"files": out, "index_bytes": index}))
}

/// One chunk of `name` from `offset` on: at most `max_bytes`, ending at the last `\n`
/// among them. The file is opened only as a regular file, never through a link.
pub fn chunk(
    dir: &Path,
    name: &str,
    offset: u64,
    max_bytes: u64,
    prefix_sha256: bool,
) -> Result<Value, ReadError> {
    debug_assert!(is_trail_name(name));
    let path = dir.join(name);
    let mut file = match fort_core::fsx::open_regular(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(ReadError::Missing(format!(
                "audit: the trail holds no file {name} (rotated away, or not begun yet)"
            )))
        }
        Err(e) => return Err(ReadError::Io(format!("{}: {e}", path.display()))),
    };
    let io = |e: std::io::Error| ReadError::Io(format!("{}: {e}", path.display()));
    let size = file.metadata().map_err(io)?.len();
    if offset > size {
        return Err(ReadError::Bad(format!(
            "audit: offset {offset} is beyond the end of {name}, which holds {size} bytes"
        )));
    }
    let mut reply = json!({"name": name, "offset": offset, "size": size});
    if prefix_sha256 {
        // The first `offset` bytes, read as they are now (the file only grows at its end).
        let mut hasher = Sha256::new();
        let copied = std::io::copy(&mut (&mut file).take(offset), &mut HashWriter(&mut hasher))
            .map_err(io)?;
        if copied != offset {
            return Err(ReadError::Io(format!(
                "{}: shorter than {offset} bytes while read",
                path.display()
            )));
        }
        reply["prefix_sha256"] = json!(hex::encode(hasher.finalize()));
    }
    file.seek(SeekFrom::Start(offset)).map_err(io)?;
    let want = max_bytes.min(size - offset);
    let mut data = Vec::with_capacity(usize::try_from(want).unwrap_or(0));
    (&mut file).take(want).read_to_end(&mut data).map_err(io)?;
    let whole = data.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
    let rest = size - offset;
    if whole == 0 && rest > max_bytes && max_bytes > 0 {
        return Err(ReadError::Bad(format!(
            "audit: the line of {name} at offset {offset} is longer than max_bytes ({max_bytes}); ask for more, up to {MAX_CHUNK}"
        )));
    }
    data.truncate(whole);
    reply["eof"] = json!(!has_line_after(&mut file, offset + whole as u64, size));
    reply["data"] = json!(base64::engine::general_purpose::STANDARD.encode(&data));
    Ok(reply)
}

/// Whether a complete line begins at `from` (before `size`): else what follows is a line
/// still being written, and the reader is at the end for now.
fn has_line_after(file: &mut std::fs::File, from: u64, size: u64) -> bool {
    if file.seek(SeekFrom::Start(from)).is_err() {
        return false;
    }
    let mut buf = [0u8; 64 * 1024];
    let mut left = size.saturating_sub(from);
    while left > 0 {
        let want = usize::try_from(left.min(buf.len() as u64)).unwrap_or(buf.len());
        match file.read(&mut buf[..want]) {
            Ok(0) | Err(_) => return false,
            Ok(n) => {
                if buf[..n].contains(&b'\n') {
                    return true;
                }
                left = left.saturating_sub(n as u64);
            }
        }
    }
    false
}

struct HashWriter<'a>(&'a mut Sha256);

impl std::io::Write for HashWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_trails_own_names_are_taken() {
        for bad in [
            "../x",
            "/etc/passwd",
            "0000000000000001.json",
            "000000000000000a.jsonl",
            "../000000000001.jsonl",
            "x/0000000000000001.jsonl",
            "checkpoints.jsonl/",
            "",
        ] {
            assert!(parse(&json!({"file": bad})).is_err(), "{bad}");
        }
        assert_eq!(parse(&json!({})).unwrap(), Ask::Listing);
        assert_eq!(parse(&json!({"file": null})).unwrap(), Ask::Listing);
        assert!(parse(&json!({"file": "checkpoints.jsonl", "bogus": 1})).is_err());
        assert!(parse(&json!({"file": "checkpoints.jsonl", "offset": -1})).is_err());
        assert_eq!(
            parse(&json!({"file": "0000000000000001.jsonl", "offset": u64::MAX, "max_bytes": u64::MAX}))
                .unwrap(),
            Ask::Chunk {
                name: "0000000000000001.jsonl".into(),
                offset: u64::MAX,
                max_bytes: MAX_CHUNK,
                prefix_sha256: false
            }
        );
    }

    #[test]
    fn chunks_end_at_whole_lines() {
        let dir = tempfile::tempdir().unwrap();
        let name = "0000000000000001.jsonl";
        std::fs::write(dir.path().join(name), b"{\"a\":1}\n{\"b\":2}\n{\"c\"").unwrap();
        let c = chunk(dir.path(), name, 0, 12, false).unwrap();
        assert_eq!(
            c["data"],
            base64::engine::general_purpose::STANDARD.encode(b"{\"a\":1}\n")
        );
        assert_eq!(c["eof"], false);
        let c = chunk(dir.path(), name, 8, MAX_CHUNK, true).unwrap();
        assert_eq!(
            c["data"],
            base64::engine::general_purpose::STANDARD.encode(b"{\"b\":2}\n")
        );
        // What follows is a line still being written: nothing more for now.
        assert_eq!(c["eof"], true);
        assert_eq!(
            c["prefix_sha256"],
            hex::encode(Sha256::digest(b"{\"a\":1}\n"))
        );
        assert!(matches!(
            chunk(dir.path(), name, u64::MAX, 10, true),
            Err(ReadError::Bad(_))
        ));
        assert!(matches!(
            chunk(dir.path(), name, 0, 3, false),
            Err(ReadError::Bad(_))
        ));
        let c = chunk(dir.path(), name, 20, 0, false).unwrap();
        assert_eq!(
            (c["data"].as_str(), c["eof"].as_bool()),
            (Some(""), Some(true))
        );
        assert!(matches!(
            chunk(dir.path(), "0000000000000009.jsonl", 0, 10, false),
            Err(ReadError::Missing(_))
        ));
        #[cfg(unix)]
        {
            std::os::unix::fs::symlink("/etc/passwd", dir.path().join(INDEX_FILE)).unwrap();
            assert!(matches!(
                chunk(dir.path(), INDEX_FILE, 0, 10, false),
                Err(ReadError::Io(_))
            ));
        }
    }
}
