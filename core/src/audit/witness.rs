//! Witnesses (docs/protocol.md §12.3a): a provider's latest checkpoint travels with its
//! callbacks, signed over its own line alone so that it verifies without the trail, and
//! each consumer records the ones it receives. Held against the provider's trail later,
//! they show a trail cut short or rewritten after its consumers saw it.

use std::path::{Path, PathBuf};

use ssh_key::PublicKey;

use super::NAMESPACE;
use crate::canonical::sha256_hex;

/// The header a provider's callbacks carry its latest checkpoint in.
pub const HEADER: &str = "x-fort-audit-checkpoint";

/// The longest header value taken: the fields and a base64 ed25519 SSHSIG with room.
pub const HEADER_MAX: usize = 512;

/// The line a checkpoint's `witness` signs (§12.3a).
pub fn witness_line(host: &str, count: u64, head: &str, at: u64) -> String {
    format!("fort-audit-witness {host} {count} {head} {at}\n")
}

/// A checkpoint as it travels: `<count> <head> <at> <witness>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Witnessed {
    pub count: u64,
    pub head: String,
    pub at: u64,
    pub witness: String,
}

impl Witnessed {
    /// The header's value.
    pub fn header(&self) -> String {
        format!("{} {} {} {}", self.count, self.head, self.at, self.witness)
    }

    /// Parses a header value; anything off the grammar is `None`.
    pub fn parse(value: &str) -> Option<Witnessed> {
        if value.len() > HEADER_MAX {
            return None;
        }
        let mut parts = value.split(' ');
        let (count, head, at, witness) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() {
            return None;
        }
        let number = |t: &str| {
            (!t.is_empty() && t.len() <= 20 && t.bytes().all(|b| b.is_ascii_digit()))
                .then(|| t.parse::<u64>().ok())
                .flatten()
        };
        let hex = head.len() == 64 && head.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        let base64 = !witness.is_empty()
            && witness
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'/' | b'='));
        (hex && base64).then_some(())?;
        Some(Witnessed {
            count: number(count)?,
            head: head.to_owned(),
            at: number(at)?,
            witness: witness.to_owned(),
        })
    }

    /// Whether `witness` is `host`'s signature (one of `keys`) over the witness line.
    pub fn verifies(&self, host: &str, keys: &[PublicKey]) -> bool {
        let line = witness_line(host, self.count, &self.head, self.at);
        crate::sign::verify_in(NAMESPACE, &self.witness, keys, line.as_bytes()).is_ok()
    }
}

/// What holding a host's trail against the checkpoints its consumers witnessed found.
#[derive(Debug, Clone, Default)]
pub struct Held {
    /// Witnessed checkpoints of the host that were checked against its trail.
    pub checked: u64,
    /// Witnessed checkpoints the trail contradicts: the host's trail is at fault.
    pub problems: Vec<String>,
    /// Records of the copies that do not verify with the host's key: the copy is at fault
    /// (or the key changed since), which says nothing against the host's trail.
    pub unverified: Vec<String>,
    /// Witnessed checkpoints older than the trail's first kept record, proven its
    /// ancestors by the checkpoint index (§12.3b).
    pub predating: u64,
    pub notes: Vec<String>,
}

/// Every `witnessed` record of `host` in the trails `witness_dirs`, held against `host`'s
/// trail in `dir` (§12.3a): its witness must verify with one of `keys`, and the trail must
/// hold record `count` with that `head`.
pub fn hold(
    dir: &Path,
    host: &str,
    keys: &[PublicKey],
    witness_dirs: &[PathBuf],
) -> std::io::Result<Held> {
    let mut hashes = std::collections::HashMap::new();
    let (mut first, mut last) = (u64::MAX, 0u64);
    // The first kept record's `prev`: the hash of the record before it, rotated away.
    let mut first_prev: Option<String> = None;
    for l in super::read_lines(dir)?.iter().filter(|l| !l.torn) {
        let Some(r) = &l.record else { continue };
        if let Some(seq) = r["seq"].as_u64() {
            hashes.insert(seq, sha256_hex(&[&l.bytes[..], b"\n"].concat()));
            if seq < first {
                first = seq;
                first_prev = r["prev"].as_str().map(str::to_owned);
            }
            last = last.max(seq);
        }
    }
    let index = super::Index::read(dir)?;
    let mut held = Held::default();
    for wdir in witness_dirs {
        for l in super::read_lines(wdir)? {
            let Some(r) = &l.record else { continue };
            if r["event"] != "witnessed" || r["provider"] != host {
                continue;
            }
            let place = format!("{}:{}", l.file.display(), l.line);
            let w = (|| {
                Some(Witnessed {
                    count: r["count"].as_u64()?,
                    head: r["head"].as_str()?.to_owned(),
                    at: r["detail"]["at"].as_u64()?,
                    witness: r["signature"].as_str()?.to_owned(),
                })
            })();
            let Some(w) = w.filter(|w| w.verifies(host, keys)) else {
                held.unverified.push(format!(
                    "{place}: a checkpoint witnessed as {host}'s that {host}'s key in hosts.json did not sign; not held against the trail"
                ));
                continue;
            };
            held.checked += 1;
            let head = crate::text::printable(&w.head, 64);
            match hashes.get(&w.count) {
                Some(h) if *h == w.head => {}
                Some(h) => held.problems.push(format!(
                    "{place}: {host} signed record {} with head {head}; its trail now holds {h} there: the trail was rewritten",
                    w.count
                )),
                None if w.count > last => held.problems.push(format!(
                    "{place}: {host} signed record {} (head {head}), but its trail ends at record {last}: the trail was cut short",
                    w.count
                )),
                // The record just before the kept trail is still held by the first
                // kept record's `prev`.
                None if w.count.checked_add(1) == Some(first) => {
                    if first_prev.as_deref() != Some(w.head.as_str()) {
                        held.problems.push(format!(
                            "{place}: {host} signed record {} with head {head}; the trail's first kept record follows another: the trail was rewritten",
                            w.count
                        ));
                    }
                }
                // Rotated away: the index must hold it, or the trail was begun afresh.
                None if w.count < first => match index.as_ref().and_then(|i| i.at(w.count)) {
                    Some(e) if e.head == w.head => held.predating += 1,
                    Some(e) => held.problems.push(format!(
                        "{place}: {host} signed record {} with head {head}; its checkpoint index holds {} there: the trail was rewritten",
                        w.count, e.head
                    )),
                    None => held.problems.push(format!(
                        "{place}: {host} signed record {} (head {head}), before the trail's first kept record {first}, and its checkpoint index does not hold that checkpoint: the trail was rewritten (or its index removed)",
                        w.count
                    )),
                },
                None => held.problems.push(format!(
                    "{place}: {host} signed record {}, which its trail no longer holds",
                    w.count
                )),
            }
        }
    }
    Ok(held)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn travels_and_verifies_only_for_its_host() {
        let signer = crate::sign::Signer::generate();
        let head = "ab".repeat(32);
        let witness = signer.sign_in(NAMESPACE, witness_line("forge", 7, &head, 99).as_bytes());
        let w = Witnessed {
            count: 7,
            head: head.clone(),
            at: 99,
            witness,
        };
        let parsed = Witnessed::parse(&w.header()).expect("its own header parses");
        assert_eq!(parsed, w);
        let keys = [signer.public_key().clone()];
        assert!(parsed.verifies("forge", &keys));
        assert!(!parsed.verifies("edge", &keys), "another host's name");
        let other = crate::sign::Signer::generate();
        assert!(!parsed.verifies("forge", &[other.public_key().clone()]));
        let moved = Witnessed { count: 8, ..w };
        assert!(!moved.verifies("forge", &keys), "another count");
    }

    #[test]
    fn off_grammar_is_refused() {
        let head = "ab".repeat(32);
        for bad in [
            String::new(),
            format!("7 {head} 99"),
            format!("7 {head} 99 c2ln extra"),
            format!("-7 {head} 99 c2ln"),
            format!("7 {} 99 c2ln", "AB".repeat(32)),
            format!("7 {head} 99 c2l\u{e9}"),
            format!("7  {head} 99 c2ln"),
            format!("99999999999999999999999 {head} 99 c2ln"),
            format!("7 {head} 99 {}", "A".repeat(HEADER_MAX)),
        ] {
            assert_eq!(Witnessed::parse(&bad), None, "{bad:?}");
        }
        assert!(Witnessed::parse(&format!("7 {head} 99 c2ln")).is_some());
    }
}
