//! Reading the trail back: its files in chain order, its records, and the check of the
//! chain and of every checkpoint's signature (`fort-agent audit verify`).

use std::path::{Path, PathBuf};

use serde_json::Value;
use ssh_key::PublicKey;

use super::{checkpoint_trailer, GENESIS, NAMESPACE};
use crate::canonical::sha256_hex;

/// The trail's files, oldest first (their names are the seq of their first record).
/// Only regular files: a link or a FIFO named like one is not the trail's.
pub fn files(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .map(|e| e.path())
        .filter(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                n.len() == 22
                    && n.ends_with(".jsonl")
                    && n[..16].bytes().all(|b| b.is_ascii_digit())
            })
        })
        .collect();
    out.sort();
    Ok(out)
}

/// The largest trail file read (the writer closes one at `max_file_bytes`, 16 MiB by
/// default, at most a burst beyond it).
const MAX_FILE_BYTES: u64 = 1 << 32;

/// One line of a file of the trail.
#[derive(Debug, Clone)]
pub struct AuditLine {
    pub file: PathBuf,
    /// 1-based.
    pub line: usize,
    /// The record as parsed; `None`: the line is not a JSON object.
    pub record: Option<Value>,
    /// The line's bytes without its `\n`.
    pub bytes: Vec<u8>,
    /// The line has no `\n`: a record cut short (by a crash while it was written).
    pub torn: bool,
}

/// Every line of every file, oldest first.
pub fn read_lines(dir: &Path) -> std::io::Result<Vec<AuditLine>> {
    let mut out = Vec::new();
    for file in files(dir)? {
        let bytes = crate::fsx::read_regular(&file, MAX_FILE_BYTES)?;
        let mut rest: &[u8] = &bytes;
        let mut line = 0;
        while !rest.is_empty() {
            line += 1;
            let (text, torn, next) = match rest.iter().position(|b| *b == b'\n') {
                Some(i) => (&rest[..i], false, &rest[i + 1..]),
                None => (rest, true, &[][..]),
            };
            out.push(AuditLine {
                file: file.clone(),
                line,
                record: serde_json::from_slice::<Value>(text)
                    .ok()
                    .filter(Value::is_object),
                bytes: text.to_vec(),
                torn,
            });
            rest = next;
        }
    }
    Ok(out)
}

/// The first thing wrong with the trail, and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub file: PathBuf,
    pub line: usize,
    pub seq: Option<u64>,
    pub what: String,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.file.display(), self.line)?;
        if let Some(seq) = self.seq {
            write!(f, " (record {seq})")?;
        }
        write!(f, ": {}", self.what)
    }
}

/// What `verify` found.
#[derive(Debug, Clone, Default)]
pub struct Verified {
    pub records: u64,
    pub checkpoints: u64,
    pub first_seq: Option<u64>,
    pub last_seq: Option<u64>,
    /// The last record a good checkpoint covers.
    pub signed_through: Option<u64>,
    /// Problems in the order of the trail; the first is the first bad record.
    pub problems: Vec<Problem>,
    /// Not problems: the oldest files were rotated away; a last record was cut short.
    pub notes: Vec<String>,
}

struct Seen {
    seq: Option<u64>,
    prev: Option<String>,
    hash: String,
    file: PathBuf,
    line: usize,
}

/// The lines of `host`'s trail in `dir` that a checkpoint signed with one of `keys`
/// covers: what a kill or a rewrite may never take away. None when the trail does not
/// verify or holds no signed checkpoint yet.
pub fn signed_lines(dir: &Path, host: &str, keys: &[PublicKey]) -> Vec<Vec<u8>> {
    let Some(through) = verify(dir, host, keys).ok().and_then(|v| v.signed_through) else {
        return Vec::new();
    };
    read_lines(dir)
        .unwrap_or_default()
        .into_iter()
        .filter(|l| {
            l.record
                .as_ref()
                .and_then(|r| r["seq"].as_u64())
                .is_some_and(|s| s <= through)
        })
        .map(|l| l.bytes)
        .collect()
}

/// Checks the chain (each record's `seq` one more than the one before and its `prev` the
/// SHA-256 of the line before, across files) and every checkpoint (its count and head are
/// the record before it, and its signature verifies with one of `keys`, as `host`, over
/// its file's lines before it and its checkpoint line). A changed record is named as the
/// record that no longer hashes to what the next one holds; a removed or moved one by the
/// break in the sequence.
pub fn verify(dir: &Path, host: &str, keys: &[PublicKey]) -> std::io::Result<Verified> {
    let lines = read_lines(dir)?;
    let mut v = Verified::default();
    let mut seen: Vec<Seen> = Vec::with_capacity(lines.len());
    let mut problems: Vec<(usize, Problem)> = Vec::new();
    // This file's lines so far: what a checkpoint in it signs, before its own line.
    let mut prefix: Vec<u8> = Vec::new();
    let mut file: Option<&Path> = None;
    let last_file = lines.last().map(|l| l.file.clone());
    // Checkpoints that link into the index, to be held against it.
    let mut kept: Vec<super::index::Kept> = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        if file != Some(l.file.as_path()) {
            file = Some(&l.file);
            prefix.clear();
        }
        let seq = l.record.as_ref().and_then(|r| r["seq"].as_u64());
        let problem = |what: String| Problem {
            file: l.file.clone(),
            line: l.line,
            seq,
            what,
        };
        if l.torn {
            if Some(&l.file) == last_file.as_ref() && i + 1 == lines.len() {
                v.notes.push(format!(
                    "{}:{}: the last record was cut short (the agent stopped while writing it); the agent removes it when it starts",
                    l.file.display(),
                    l.line
                ));
                break;
            }
            problems.push((
                i,
                problem("a record cut short in the middle of the trail".into()),
            ));
        }
        let Some(record) = &l.record else {
            problems.push((i, problem("not a JSON record".into())));
            seen.push(Seen {
                seq: None,
                prev: None,
                hash: sha256_hex(&[&l.bytes[..], b"\n"].concat()),
                file: l.file.clone(),
                line: l.line,
            });
            prefix.extend_from_slice(&l.bytes);
            prefix.push(b'\n');
            continue;
        };
        v.records += 1;
        if v.first_seq.is_none() {
            v.first_seq = seq;
        }
        v.last_seq = seq.or(v.last_seq);
        let hash = sha256_hex(&[&l.bytes[..], b"\n"].concat());
        if record["event"] == "checkpoint" {
            v.checkpoints += 1;
            let count = record["count"].as_u64();
            let head = record["head"].as_str();
            let at = record["at"].as_u64();
            if let (Some(count), Some(head), Some(at), Some(link)) =
                (count, head, at, record["index"].as_str())
            {
                kept.push(super::index::Kept {
                    count,
                    head: head.to_owned(),
                    at,
                    link: link.to_owned(),
                    at_line: i,
                    file: l.file.clone(),
                    line: l.line,
                });
            }
            let before = seen.last();
            let bad = match (count, head, at, record["signature"].as_str()) {
                (Some(count), Some(head), Some(at), Some(sig)) => {
                    let trailer = checkpoint_trailer(host, count, head, at);
                    let signed = [&prefix[..], trailer.as_bytes()].concat();
                    if let Some(b) = before.filter(|b| b.seq.is_some()) {
                        if b.seq != Some(count) || b.hash != head {
                            Some(format!(
                                "the checkpoint names record {count} with head {}, but the record before it is {} with head {}",
                                short_hash(head),
                                b.seq.map_or("?".into(), |s| s.to_string()),
                                short_hash(&b.hash)
                            ))
                        } else {
                            signature_problem(sig, keys, &signed)
                        }
                    } else {
                        signature_problem(sig, keys, &signed)
                    }
                    .or_else(|| witness_problem(record, host, count, head, at, keys))
                }
                _ => Some("a checkpoint without count, head, at or signature".into()),
            };
            match bad {
                Some(what) => problems.push((i, problem(what))),
                None => v.signed_through = count,
            }
        }
        seen.push(Seen {
            seq,
            prev: record["prev"].as_str().map(str::to_owned),
            hash,
            file: l.file.clone(),
            line: l.line,
        });
        prefix.extend_from_slice(&l.bytes);
        prefix.push(b'\n');
    }
    chain_problems(&seen, &mut problems, &mut v.notes);
    super::index::check(
        dir,
        &kept,
        v.last_seq,
        lines.len(),
        &mut problems,
        &mut v.notes,
    )?;
    problems.sort_by_key(|(i, _)| *i);
    v.problems = problems.into_iter().map(|(_, p)| p).collect();
    Ok(v)
}

/// A checkpoint's `witness` (§12.3a), when it has one, must verify over its own line.
fn witness_problem(
    record: &Value,
    host: &str,
    count: u64,
    head: &str,
    at: u64,
    keys: &[PublicKey],
) -> Option<String> {
    let witness = record.get("witness")?;
    let good = witness.as_str().is_some_and(|w| {
        super::Witnessed {
            count,
            head: head.to_owned(),
            at,
            witness: w.to_owned(),
        }
        .verifies(host, keys)
    });
    (!good).then(|| "the checkpoint's witness signature does not verify over its line".into())
}

fn signature_problem(sig: &str, keys: &[PublicKey], signed: &[u8]) -> Option<String> {
    crate::sign::verify_in(NAMESPACE, sig, keys, signed)
        .err()
        .map(|e| {
            format!("the checkpoint's signature does not verify over the records before it: {e}")
        })
}

/// The first 12 characters of a hash as a file holds it, made printable: a changed file
/// must neither split a character (a byte slice would panic) nor talk to the terminal.
pub fn short_hash(hash: &str) -> String {
    crate::text::printable(&hash.chars().take(12).collect::<String>(), 12)
}

/// Breaks of the chain. A record whose successor's `prev` is not its hash, while the
/// successor itself is intact (the record after it holds the successor's hash), is the
/// changed one; a successor whose `seq` is not one more is where records went missing
/// or out of order.
fn chain_problems(seen: &[Seen], problems: &mut Vec<(usize, Problem)>, notes: &mut Vec<String>) {
    let Some(first) = seen.first() else { return };
    match (first.seq, first.prev.as_deref()) {
        (Some(1), Some(p)) if p != GENESIS => problems.push((
            0,
            Problem {
                file: first.file.clone(),
                line: first.line,
                seq: first.seq,
                what: "the first record does not begin the chain (its prev is not all zeros)"
                    .into(),
            },
        )),
        (Some(n), _) if n > 1 => notes.push(format!(
            "the trail begins at record {n}: older files were removed by rotation"
        )),
        _ => {}
    }
    let index: std::collections::HashMap<u64, usize> = seen
        .iter()
        .enumerate()
        .filter_map(|(i, s)| s.seq.map(|q| (q, i)))
        .collect();
    let mut i = 1;
    while i < seen.len() {
        let (before, this) = (&seen[i - 1], &seen[i]);
        let at = |s: &Seen, what: String| Problem {
            file: s.file.clone(),
            line: s.line,
            seq: s.seq,
            what,
        };
        if let (Some(a), Some(b)) = (before.seq, this.seq) {
            // Numbers from the file: a seq of u64::MAX must not overflow here.
            let next = a.wrapping_add(1);
            if b != next {
                let moved = index.get(&next).map(|j| &seen[*j]);
                let what = if b <= a {
                    format!("record {b} comes after record {a}: records are out of order")
                } else if let Some(m) = moved {
                    format!(
                        "record {b} follows record {a}: records are out of order (record {next} is at {}:{})",
                        m.file.display(),
                        m.line
                    )
                } else {
                    format!(
                        "record {b} follows record {a}: {} missing",
                        if b - a == 2 {
                            format!("record {next} is")
                        } else {
                            format!("records {next} to {} are", b - 1)
                        }
                    )
                };
                problems.push((i, at(this, what)));
                i += 1;
                continue;
            }
        }
        if this.prev.as_deref() != Some(before.hash.as_str()) {
            let next_intact = seen
                .get(i + 1)
                .is_some_and(|n| n.prev.as_deref() == Some(this.hash.as_str()));
            if next_intact || i + 1 == seen.len() {
                problems.push((
                    i - 1,
                    at(
                        before,
                        format!(
                            "changed: its hash is {}, the next record holds {}",
                            short_hash(&before.hash),
                            short_hash(this.prev.as_deref().unwrap_or("nothing"))
                        ),
                    ),
                ));
            } else {
                problems.push((
                    i,
                    at(
                        this,
                        "changed: it does not hold the hash of the record before it, and the record after it does not hold its hash".into(),
                    ),
                ));
            }
        }
        i += 1;
    }
}
