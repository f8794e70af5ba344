//! The replay guard (§3 step 7): a bounded set of `(origin, nonce)` pairs, each kept until
//! its timestamp can no longer pass the clock-skew check. Never evicts an unexpired nonce;
//! when full, the caller answers 503.
//!
//! Nonces are also appended to a journal in the state directory (no fsync: it must
//! survive `kill -9`, which page-cache writes do), so a restarted agent still refuses
//! replays of requests it accepted before the restart. The journal is rotated every two
//! windows; by then everything in the older file has expired.

use parking_lot::Mutex;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::fs::File;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

#[derive(Debug, PartialEq, Eq)]
pub enum NonceCheck {
    Fresh,
    Replay,
    /// This origin holds its quota of unexpired nonces; its oldest expires in this many
    /// seconds. The other origins are unaffected.
    OriginFull(u64),
    /// The store holds its capacity; the oldest nonce expires in this many seconds.
    Full(u64),
}

struct Journal {
    path: PathBuf,
    file: File,
    opened_at: u64,
}

/// Origins are interned to small numbers: only verified callers reach the store, so the
/// table is bounded by the registry, and an entry costs ~70 bytes instead of ~165. Each
/// origin has its own expiry queue, so its quota and its wait are its own.
struct Inner {
    origins: HashMap<String, u32>,
    seen: HashSet<(u32, u128)>,
    expiry: Vec<BinaryHeap<Reverse<(u64, u128)>>>,
    journal: Option<Journal>,
    last_sweep: u64,
}

impl Inner {
    fn origin_id(&mut self, origin: &str) -> u32 {
        if let Some(id) = self.origins.get(origin) {
            return *id;
        }
        let id = self.origins.len() as u32;
        self.origins.insert(origin.to_owned(), id);
        self.expiry.push(BinaryHeap::new());
        id
    }

    /// Forgets `origin`'s nonces that expired before `now`.
    fn expire(&mut self, id: u32, now: u64) {
        let heap = &mut self.expiry[id as usize];
        while let Some(Reverse((exp, _))) = heap.peek() {
            if *exp >= now {
                break;
            }
            let Reverse((_, n)) = heap.pop().expect("peeked");
            self.seen.remove(&(id, n));
        }
    }

    fn expire_all(&mut self, now: u64) {
        for id in 0..self.expiry.len() as u32 {
            self.expire(id, now);
        }
        self.last_sweep = now;
    }

    fn insert(&mut self, id: u32, nonce: u128, expires: u64) {
        self.seen.insert((id, nonce));
        self.expiry[id as usize].push(Reverse((expires, nonce)));
    }
}

pub struct NonceStore {
    inner: Mutex<Inner>,
    /// How many nonces are held, as of the last check: `status` reads it without taking
    /// the lock every signed request takes.
    held: std::sync::atomic::AtomicUsize,
    capacity: usize,
    per_origin: usize,
    window: u64,
}

/// Opens a file for appending (and reading its last byte): created 0600, a regular file
/// only, never through a symlink.
fn open_append(path: &Path) -> std::io::Result<File> {
    fort_core::fsx::open_read_append(path)
}

impl NonceStore {
    /// A store with a journal under `dir` (`None`: memory only, for tests).
    pub fn open(
        dir: Option<&Path>,
        capacity: usize,
        per_origin: usize,
        window: u64,
        now: u64,
    ) -> std::io::Result<NonceStore> {
        let mut inner = Inner {
            origins: HashMap::new(),
            seen: HashSet::new(),
            expiry: Vec::new(),
            journal: None,
            last_sweep: now,
        };
        if let Some(dir) = dir {
            let path = dir.join("nonces.log");
            for file in [path.with_extension("log.old"), path.clone()] {
                let f = match fort_core::fsx::open_regular(&file) {
                    Ok(f) => f,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(e) => {
                        return Err(std::io::Error::new(
                            e.kind(),
                            format!("{}: {e}", file.display()),
                        ))
                    }
                };
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
                    if exp >= now && !inner.seen.contains(&(id, nonce)) {
                        inner.insert(id, nonce, exp);
                    }
                }
            }
            let file = open_append(&path)
                .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
            end_torn_line(&file)
                .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
            inner.journal = Some(Journal {
                path,
                file,
                opened_at: now,
            });
        }
        Ok(NonceStore {
            held: inner.seen.len().into(),
            inner: Mutex::new(inner),
            capacity,
            // Never more than a fair share: with a lowered capacity, one origin must not
            // be able to fill the store by itself and lock every other caller out.
            per_origin: per_origin.min(capacity / 8).max(1),
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
        // Past its window the nonce may already be forgotten: such a request can never be
        // fresh, whatever the caller checked before.
        if timestamp + self.window < now {
            return NonceCheck::Replay;
        }
        let mut inner = self.inner.lock();
        let check = self.check_locked(&mut inner, origin, nonce_hex, nonce, timestamp, now);
        self.held
            .store(inner.seen.len(), std::sync::atomic::Ordering::Relaxed);
        check
    }

    fn check_locked(
        &self,
        inner: &mut Inner,
        origin: &str,
        nonce_hex: &str,
        nonce: u128,
        timestamp: u64,
        now: u64,
    ) -> NonceCheck {
        let id = inner.origin_id(origin);
        inner.expire(id, now);
        if now > inner.last_sweep {
            // Once a second, origins that went quiet give back what expired.
            inner.expire_all(now);
        }
        if inner.seen.contains(&(id, nonce)) {
            return NonceCheck::Replay;
        }
        let wait = |heap: &BinaryHeap<Reverse<(u64, u128)>>| {
            heap.peek()
                .map_or(1, |Reverse((exp, _))| exp.saturating_sub(now) + 1)
        };
        if inner.expiry[id as usize].len() >= self.per_origin {
            return NonceCheck::OriginFull(wait(&inner.expiry[id as usize]));
        }
        if inner.seen.len() >= self.capacity {
            let soonest = inner
                .expiry
                .iter()
                .filter(|h| !h.is_empty())
                .map(wait)
                .min()
                .unwrap_or(1);
            return NonceCheck::Full(soonest);
        }
        let expires = timestamp + self.window;
        inner.insert(id, nonce, expires);
        let window = self.window;
        if let Some(journal) = inner.journal.as_mut() {
            if now.saturating_sub(journal.opened_at) > 2 * window + 1 {
                rotate(journal, now);
            }
            let line = format!("{expires} {origin} {nonce_hex}\n");
            // One write (one syscall, under the lock every signed request takes); in two
            // only under crash points, so the crash lane can leave a torn line.
            let written = if fort_core::crash::armed() {
                let (first, rest) = line.as_bytes().split_at(line.len() / 2);
                journal.file.write_all(first).and_then(|()| {
                    fort_core::crash::point("nonce.journal.torn");
                    journal.file.write_all(rest)
                })
            } else {
                journal.file.write_all(line.as_bytes())
            };
            if let Err(e) = written {
                tracing::warn!(error = %e, "nonce journal write failed; replay protection across restarts is degraded");
            }
        }
        NonceCheck::Fresh
    }

    pub fn len(&self) -> usize {
        self.held.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Ends a line a kill cut short (a torn last record) before anything is appended behind
/// it: the next record must not run on from it, and is then read back whole.
fn end_torn_line(file: &File) -> std::io::Result<()> {
    use std::io::{Read, Seek, SeekFrom};
    let len = file.metadata()?.len();
    if len == 0 {
        return Ok(());
    }
    let mut last = [0u8; 1];
    let mut reader = file;
    reader.seek(SeekFrom::Start(len - 1))?;
    reader.read_exact(&mut last)?;
    if last[0] != b'\n' {
        let mut writer = file;
        writer.write_all(b"\n")?;
    }
    Ok(())
}

fn rotate(journal: &mut Journal, now: u64) {
    let old = journal.path.with_extension("log.old");
    let reopened = std::fs::rename(&journal.path, &old).and_then(|_| open_append(&journal.path));
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
        let s = NonceStore::open(None, 2, 10, 300, 1000).unwrap();
        assert_eq!(s.check_and_record("a", N, 1000, 1000), NonceCheck::Fresh);
        assert_eq!(s.check_and_record("a", N, 1000, 1001), NonceCheck::Replay);
        assert_eq!(s.check_and_record("b", N, 1000, 1001), NonceCheck::Fresh);
        assert_eq!(
            s.check_and_record("c", N, 1000, 1001),
            NonceCheck::Full(300)
        );
        // After the window, the old ones are gone and there is room again.
        assert_eq!(s.check_and_record("c", N, 1400, 1400), NonceCheck::Fresh);
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn one_origin_cannot_fill_the_store_for_the_others() {
        let s = NonceStore::open(None, 100, 3, 300, 1000).unwrap();
        let nonce = |i: u32| format!("{i:032x}");
        for i in 0..3 {
            assert_eq!(
                s.check_and_record("greedy", &nonce(i), 1000, 1000),
                NonceCheck::Fresh
            );
        }
        assert_eq!(
            s.check_and_record("greedy", &nonce(9), 1000, 1010),
            NonceCheck::OriginFull(291)
        );
        assert_eq!(
            s.check_and_record("polite", &nonce(9), 1000, 1010),
            NonceCheck::Fresh
        );
        // Once its nonces expire, the greedy origin may ask again.
        assert_eq!(
            s.check_and_record("greedy", &nonce(9), 1400, 1400),
            NonceCheck::Fresh
        );
    }

    #[test]
    fn journal_survives_restart() {
        let dir = tempfile::tempdir().unwrap();
        let s = NonceStore::open(Some(dir.path()), 10, 10, 300, 1000).unwrap();
        assert_eq!(s.check_and_record("a", N, 1000, 1000), NonceCheck::Fresh);
        drop(s);
        let s = NonceStore::open(Some(dir.path()), 10, 10, 300, 1010).unwrap();
        assert_eq!(s.check_and_record("a", N, 1000, 1010), NonceCheck::Replay);
    }
}
