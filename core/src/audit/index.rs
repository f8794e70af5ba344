//! The checkpoint index (docs/protocol.md §12.3b): one line per checkpoint the trail ever
//! signed, never rotated, each holding the hash of the line before it, and each
//! checkpoint record holding the hash of the index line before its own. Rotation removes
//! records; the index keeps the chain of their checkpoints, so a checkpoint a consumer
//! witnessed long ago is proven an ancestor of the trail kept now, and a trail begun
//! afresh (rewritten) cannot claim that its older records were merely rotated away.

use std::io::Write;
use std::path::{Path, PathBuf};

use super::GENESIS;
use crate::canonical::sha256_hex;

/// The index's file in the trail's directory.
pub const INDEX_FILE: &str = "checkpoints.jsonl";

/// The largest index read (a line per checkpoint, under 200 bytes: a checkpoint every
/// five minutes for a century is well under it).
const MAX_INDEX_BYTES: u64 = 1 << 30;

/// One line of the index, exactly: `{"count":C,"head":"H","at":T,"prev":"P"}\n`.
pub fn index_line(count: u64, head: &str, at: u64, prev: &str) -> String {
    format!("{{\"count\":{count},\"head\":\"{head}\",\"at\":{at},\"prev\":\"{prev}\"}}\n")
}

/// A line of the index as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexEntry {
    pub count: u64,
    pub head: String,
    pub at: u64,
    pub prev: String,
    /// SHA-256 of the line, its `\n` included: the next line's `prev`.
    pub hash: String,
    /// 1-based.
    pub line: usize,
}

/// The index of a trail's directory, read and its chain checked.
#[derive(Debug, Clone, Default)]
pub struct Index {
    pub entries: Vec<IndexEntry>,
    /// What is wrong with the index itself: a line that is not one, a broken link.
    pub problems: Vec<String>,
    /// The last line was cut short (a crash while it was written): not a problem.
    pub torn: bool,
}

impl Index {
    /// Reads `dir`'s index; `None` when there is none.
    pub fn read(dir: &Path) -> std::io::Result<Option<Index>> {
        let path = dir.join(INDEX_FILE);
        let bytes = match crate::fsx::read_regular(&path, MAX_INDEX_BYTES) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let mut index = Index::default();
        let mut prev = GENESIS.to_owned();
        let mut last_count: Option<u64> = None;
        let mut rest: &[u8] = &bytes;
        let mut number = 0;
        while !rest.is_empty() {
            number += 1;
            let Some(end) = rest.iter().position(|b| *b == b'\n') else {
                index.torn = true;
                break;
            };
            let (text, next) = (&rest[..end], &rest[end + 1..]);
            rest = next;
            let shown = format!("{}:{number}", path.display());
            let Some(e) = parse(text, number) else {
                index.problems.push(format!("{shown}: not an index line"));
                continue;
            };
            if e.prev != prev {
                index.problems.push(format!(
                    "{shown}: does not hold the hash of the line before it: the index was changed"
                ));
            }
            if last_count.is_some_and(|c| e.count <= c) {
                index.problems.push(format!(
                    "{shown}: checkpoint {} does not come after checkpoint {}",
                    e.count,
                    last_count.unwrap_or(0)
                ));
            }
            last_count = Some(e.count);
            prev = e.hash.clone();
            index.entries.push(e);
        }
        Ok(Some(index))
    }

    /// The entry for checkpoint `count`.
    pub fn at(&self, count: u64) -> Option<&IndexEntry> {
        self.entries
            .binary_search_by_key(&count, |e| e.count)
            .ok()
            .map(|i| &self.entries[i])
    }
}

/// A checkpoint of the kept trail that links into the index (its `index` member).
pub(super) struct Kept {
    pub count: u64,
    pub head: String,
    pub at: u64,
    pub link: String,
    /// Its position among the trail's lines, for the order of problems.
    pub at_line: usize,
    pub file: PathBuf,
    pub line: usize,
}

/// Holds the kept trail's checkpoints against the index: each must be the index line its
/// record names, the index must chain, and name no checkpoint after the trail's end.
/// Problems go at the end of the trail's (`after`).
pub(super) fn check(
    dir: &Path,
    kept: &[Kept],
    last_seq: Option<u64>,
    after: usize,
    problems: &mut Vec<(usize, super::Problem)>,
    notes: &mut Vec<String>,
) -> std::io::Result<()> {
    let index = Index::read(dir)?;
    let path = dir.join(INDEX_FILE);
    let at_index = |line: usize, what: String| super::Problem {
        file: path.clone(),
        line,
        seq: None,
        what,
    };
    let Some(index) = index else {
        if let Some(k) = kept.first() {
            problems.push((
                k.at_line,
                super::Problem {
                    file: k.file.clone(),
                    line: k.line,
                    seq: Some(k.count + 1),
                    what: format!(
                        "the checkpoint links into the checkpoint index, but there is no {INDEX_FILE}: what came before the kept files cannot be proven"
                    ),
                },
            ));
        }
        return Ok(());
    };
    for what in &index.problems {
        problems.push((after, at_index(0, what.clone())));
    }
    if index.torn {
        notes.push(format!(
            "{}: the last line was cut short (the agent stopped while writing it); the agent removes it when it starts",
            path.display()
        ));
    }
    for (n, k) in kept.iter().enumerate() {
        let line = index_line(k.count, &k.head, k.at, &k.link);
        let hash = sha256_hex(line.as_bytes());
        match index.at(k.count) {
            Some(e) if e.hash == hash => {}
            // The newest checkpoint, synced a moment before its index line: a copy taken
            // in between, or a crash the next start repairs.
            None if n + 1 == kept.len()
                && index.entries.last().is_none_or(|e| e.hash == k.link) =>
            {
                notes.push(format!(
                    "checkpoint {} is not in the index yet (the agent adds it when it next starts)",
                    k.count
                ))
            }
            found => problems.push((
                k.at_line,
                super::Problem {
                    file: k.file.clone(),
                    line: k.line,
                    seq: Some(k.count + 1),
                    what: match found {
                        Some(e) => format!(
                            "the checkpoint index holds another checkpoint {} (line {}): the trail or its index was rewritten",
                            k.count, e.line
                        ),
                        None => format!(
                            "checkpoint {} is not in the checkpoint index: the trail or its index was rewritten",
                            k.count
                        ),
                    },
                },
            )),
        }
    }
    if let (Some(last), Some(e)) = (last_seq, index.entries.last()) {
        if e.count >= last {
            problems.push((
                after,
                at_index(
                    e.line,
                    format!(
                        "the index names checkpoint {} (of record {}), but the trail ends at record {last}: the trail was cut short",
                        e.count + 1,
                        e.count
                    ),
                ),
            ));
        }
    }
    Ok(())
}

/// A line, as only [`index_line`] writes it: anything else (other spacing, other members)
/// is not an index line.
fn parse(text: &[u8], line: usize) -> Option<IndexEntry> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Raw {
        count: u64,
        head: String,
        at: u64,
        prev: String,
    }
    let raw: Raw = serde_json::from_slice(text).ok()?;
    let hex = |s: &str| s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    (hex(&raw.head) && hex(&raw.prev)).then_some(())?;
    let canonical = index_line(raw.count, &raw.head, raw.at, &raw.prev);
    (canonical.as_bytes()[..canonical.len() - 1] == *text).then_some(())?;
    Some(IndexEntry {
        hash: sha256_hex(canonical.as_bytes()),
        count: raw.count,
        head: raw.head,
        at: raw.at,
        prev: raw.prev,
        line,
    })
}

/// The writer's end of the index: the hash of its last line (the next checkpoint's
/// `index`), counting lines not yet written, which go with the next append.
pub(super) struct IndexWriter {
    path: PathBuf,
    pub(super) head: String,
    pub(super) last_count: Option<u64>,
    /// Lines whose write failed (a full disk), in order: written before the next one.
    pending: Vec<String>,
}

impl IndexWriter {
    /// Opens `dir`'s index, cutting off a line a crash left half written.
    pub(super) fn open(dir: &Path) -> std::io::Result<IndexWriter> {
        let path = dir.join(INDEX_FILE);
        let mut w = IndexWriter {
            path: path.clone(),
            head: GENESIS.to_owned(),
            last_count: None,
            pending: Vec::new(),
        };
        let bytes = match crate::fsx::read_regular(&path, MAX_INDEX_BYTES) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(w),
            Err(e) => return Err(e),
        };
        let complete = bytes.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
        if complete < bytes.len() {
            let f = crate::fsx::open_regular_for_write(&path)?;
            f.set_len(complete as u64)?;
            f.sync_data()?;
        }
        if let Some(last) = bytes[..complete.saturating_sub(1)]
            .rsplit(|b| *b == b'\n')
            .next()
            .filter(|l| !l.is_empty())
        {
            w.head = sha256_hex(&[last, b"\n"].concat());
            w.last_count = parse(last, 0).map(|e| e.count);
        }
        Ok(w)
    }

    /// Adds checkpoint `count` and writes (and syncs) what is not yet written. The head
    /// moves on even when the write fails: the line stays pending, and the checkpoint
    /// record that names it is what a restart rebuilds it from.
    pub(super) fn append(&mut self, count: u64, head: &str, at: u64) -> std::io::Result<()> {
        let line = index_line(count, head, at, &self.head);
        self.head = sha256_hex(line.as_bytes());
        self.last_count = Some(count);
        self.pending.push(line);
        self.write_pending()
    }

    fn write_pending(&mut self) -> std::io::Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let text = self.pending.concat();
        let mut f = crate::fsx::open_append(&self.path)?;
        let before = f.metadata()?.len();
        let half = text.len() / 2;
        let written = f
            .write_all(&text.as_bytes()[..half])
            .and_then(|()| {
                crate::crash::point("audit.index.appended");
                f.write_all(&text.as_bytes()[half..])
            })
            .and_then(|()| f.sync_data());
        match written {
            Ok(()) => {
                self.pending.clear();
                Ok(())
            }
            Err(e) => {
                // Cut back what the failed write left, so no half line sits before the next.
                let _ = f.set_len(before);
                Err(e)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_chain_and_a_changed_one_shows() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = IndexWriter::open(dir.path()).unwrap();
        w.append(3, &"ab".repeat(32), 100).unwrap();
        w.append(9, &"cd".repeat(32), 200).unwrap();
        let index = Index::read(dir.path()).unwrap().unwrap();
        assert!(index.problems.is_empty(), "{:?}", index.problems);
        assert_eq!(index.entries.len(), 2);
        assert_eq!(index.entries[1].prev, index.entries[0].hash);
        assert_eq!(index.at(9).unwrap().head, "cd".repeat(32));
        assert!(index.at(4).is_none());

        // Reopened, it goes on from its last line; a torn line is cut first.
        let path = dir.path().join(INDEX_FILE);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes.extend_from_slice(b"{\"count\":12,\"he");
        std::fs::write(&path, &bytes).unwrap();
        assert!(Index::read(dir.path()).unwrap().unwrap().torn);
        let mut w = IndexWriter::open(dir.path()).unwrap();
        assert_eq!(w.last_count, Some(9));
        w.append(12, &"ef".repeat(32), 300).unwrap();
        let index = Index::read(dir.path()).unwrap().unwrap();
        assert!(index.problems.is_empty() && !index.torn);

        // A line changed (its head) breaks the link of the line after it.
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::write(&path, text.replacen(&"cd".repeat(32), &"ce".repeat(32), 1)).unwrap();
        let index = Index::read(dir.path()).unwrap().unwrap();
        assert_eq!(index.problems.len(), 1, "{:?}", index.problems);
    }
}
