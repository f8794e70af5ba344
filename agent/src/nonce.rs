//! The replay guard (§3 step 7): a bounded set of `(origin, nonce)` pairs, each kept until
//! its timestamp can no longer pass the clock-skew check. Never evicts an unexpired nonce;
//! when full, the caller answers 503.
//!
//! Nonces are also appended to a journal in the state directory (no fsync: it must
//! survive `kill -9`, which page-cache writes do), so a restarted agent still refuses
//! replays of requests it accepted before the restart. The journal is rotated every two
//! windows; by then everything in the older file has expired.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

#[derive(Debug, PartialEq, Eq)]
pub enum NonceCheck {
    Fresh,
    Replay,
    Full,
}

struct Journal {
    path: PathBuf,
    file: File,
    opened_at: u64,
}

/// Origins are interned to small numbers: only verified callers reach the store, so the
/// table is bounded by the registry, and an entry costs ~70 bytes instead of ~165.
struct Inner {
    origins: HashMap<String, u32>,
    seen: HashSet<(u32, u128)>,
    expiry: BinaryHeap<Reverse<(u64, u32, u128)>>,
    journal: Option<Journal>,
}

impl Inner {
    fn origin_id(&mut self, origin: &str) -> u32 {
        if let Some(id) = self.origins.get(origin) {
            return *id;
        }
        let id = self.origins.len() as u32;
        self.origins.insert(origin.to_owned(), id);
        id
    }
}

pub struct NonceStore {
    inner: Mutex<Inner>,
    capacity: usize,
    window: u64,
}

impl NonceStore {
    /// A store with a journal under `dir` (`None`: memory only, for tests).
    pub fn open(
        dir: Option<&Path>,
        capacity: usize,
        window: u64,
        now: u64,
    ) -> std::io::Result<NonceStore> {
        let mut inner = Inner {
            origins: HashMap::new(),
            seen: HashSet::new(),
            expiry: BinaryHeap::new(),
            journal: None,
        };
        if let Some(dir) = dir {
            let path = dir.join("nonces.log");
            for file in [path.with_extension("log.old"), path.clone()] {
                let Ok(f) = File::open(&file) else { continue };
                for line in std::io::BufReader::new(f).lines().map_while(Result::ok) {
                    let mut parts = line.split(' ');
                    let (Some(exp), Some(origin), Some(nonce)) =
                        (parts.next(), parts.next(), parts.next())
                    else {
                        continue; // a torn last line from a kill -9
                    };
                    let (Ok(exp), Ok(nonce)) =
                        (exp.parse::<u64>(), u128::from_str_radix(nonce, 16))
                    else {
                        continue;
                    };
                    let id = inner.origin_id(origin);
                    if exp >= now && inner.seen.insert((id, nonce)) {
                        inner.expiry.push(Reverse((exp, id, nonce)));
                    }
                }
            }
            let file = OpenOptions::new().create(true).append(true).open(&path)?;
            inner.journal = Some(Journal {
                path,
                file,
                opened_at: now,
            });
        }
        Ok(NonceStore {
            inner: Mutex::new(inner),
            capacity,
            window,
        })
    }

    /// Records `(origin, nonce)` unless it was seen within the window.
    pub fn check_and_record(
        &self,
        origin: &str,
        nonce_hex: &str,
        timestamp: u64,
        now: u64,
    ) -> NonceCheck {
        let Ok(nonce) = u128::from_str_radix(nonce_hex, 16) else {
            return NonceCheck::Replay;
        };
        let mut inner = self.inner.lock().expect("nonce lock");
        while let Some(Reverse((exp, _, _))) = inner.expiry.peek() {
            if *exp >= now {
                break;
            }
            let Reverse((_, o, n)) = inner.expiry.pop().expect("peeked");
            inner.seen.remove(&(o, n));
        }
        let key = (inner.origin_id(origin), nonce);
        // Past its window the nonce may already be forgotten: such a request can never be
        // fresh, whatever the caller checked before.
        if timestamp + self.window < now {
            return NonceCheck::Replay;
        }
        if inner.seen.contains(&key) {
            return NonceCheck::Replay;
        }
        if inner.seen.len() >= self.capacity {
            return NonceCheck::Full;
        }
        let expires = timestamp + self.window;
        inner.seen.insert(key);
        inner.expiry.push(Reverse((expires, key.0, nonce)));
        let window = self.window;
        if let Some(journal) = inner.journal.as_mut() {
            if now.saturating_sub(journal.opened_at) > 2 * window + 1 {
                rotate(journal, now);
            }
            let line = format!("{expires} {origin} {nonce_hex}\n");
            if let Err(e) = journal.file.write_all(line.as_bytes()) {
                tracing::warn!(error = %e, "nonce journal write failed; replay protection across restarts is degraded");
            }
        }
        NonceCheck::Fresh
    }

    pub fn len(&self) -> usize {
        self.inner.lock().expect("nonce lock").seen.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn rotate(journal: &mut Journal, now: u64) {
    let old = journal.path.with_extension("log.old");
    let reopened = std::fs::rename(&journal.path, &old).and_then(|_| {
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(&journal.path)
    });
    match reopened {
        Ok(file) => {
            journal.file = file;
            journal.opened_at = now;
        }
        Err(e) => tracing::warn!(error = %e, "nonce journal rotation failed"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const N: &str = "00112233445566778899aabbccddeeff";

    #[test]
    fn replay_full_and_expiry() {
        let s = NonceStore::open(None, 2, 300, 1000).unwrap();
        assert_eq!(s.check_and_record("a", N, 1000, 1000), NonceCheck::Fresh);
        assert_eq!(s.check_and_record("a", N, 1000, 1001), NonceCheck::Replay);
        assert_eq!(s.check_and_record("b", N, 1000, 1001), NonceCheck::Fresh);
        assert_eq!(s.check_and_record("c", N, 1000, 1001), NonceCheck::Full);
        // After the window, the old ones are gone and there is room again.
        assert_eq!(s.check_and_record("c", N, 1400, 1400), NonceCheck::Fresh);
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn journal_survives_restart() {
        let dir = tempfile::tempdir().unwrap();
        let s = NonceStore::open(Some(dir.path()), 10, 300, 1000).unwrap();
        assert_eq!(s.check_and_record("a", N, 1000, 1000), NonceCheck::Fresh);
        drop(s);
        let s = NonceStore::open(Some(dir.path()), 10, 300, 1010).unwrap();
        assert_eq!(s.check_and_record("a", N, 1000, 1010), NonceCheck::Replay);
    }
}
