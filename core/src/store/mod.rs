//! State with one in-process owner, kept as an append-only log of changes plus a JSON
//! snapshot (the `files` module describes the formats and recovery).
//!
//! Why a log: rewriting the whole state file for every durable change made one change cost
//! as much as the whole state (a provider with 50,000 entries rewrote megabytes per
//! request). Now a change is one line, appended and fsynced together with every other
//! change that arrived meanwhile (group commit); the log is folded into a new snapshot
//! once it is as large as the snapshot, so the cost per change stays constant however
//! many entries exist. The snapshot keeps the format the files always had, so operators
//! can still read it, and a state directory from before the log existed loads as is.
//!
//! Changes are computed against the durable state plus the changes not yet written, but
//! applied to the durable state only once they are on disk: a write that fails (a full
//! disk) leaves memory exactly as it was, and every change that was waiting for it fails
//! with it rather than being kept half-applied.

mod atomic;
mod files;
mod seal;

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::{watch, Notify};
use tokio_util::sync::CancellationToken;

pub use atomic::{
    open_log, remove_stale_temporaries, remove_stale_temporaries_below,
    remove_stale_temporaries_of, temporary_pid, write_atomic, write_atomic_at, write_atomic_mode,
};
pub use files::{
    set_aside, LoadError, PLAIN_SNAPSHOT_READS, SEALED_SNAPSHOT_VERSION, SNAPSHOT_READS,
    SNAPSHOT_VERSION,
};
pub use seal::{reseal, Resealed, Seal, Sealing};

use crate::compat::Unknown;

/// Where a snapshot write can be cut short (docs/crash-points.md).
const SNAPSHOT_CRASH: crate::crash::Replace =
    crate::crash::replace("store.snapshot.temp", "store.snapshot.renamed");

/// The longest a lazy change waits for its write.
pub const LAZY_FLUSH: Duration = Duration::from_millis(500);

/// The log is folded into a snapshot once it is larger than the snapshot, but not before
/// it holds this much (a small state would otherwise be rewritten all the time).
const MIN_COMPACTION_BYTES: u64 = 1024 * 1024;

/// A change is not durable: it was not written (and is not in memory either).
#[derive(Debug, Clone, thiserror::Error)]
#[error("state file {file} not written: {message}")]
pub struct PersistError {
    pub file: String,
    pub message: String,
}

/// Proof that a change was accepted for writing; wait on it for durability.
#[derive(Debug, Clone, Copy)]
#[must_use = "a change is not durable until its ticket is waited on"]
pub struct Ticket(u64);

struct Pending<V> {
    ticket: u64,
    key: String,
    value: Option<V>,
    line: Vec<u8>,
}

struct State<V> {
    /// What is on disk.
    map: BTreeMap<String, V>,
    /// Per record, members another release wrote that this one does not know: written
    /// back with the record whenever it changes, dropped with it.
    unknown: HashMap<String, Unknown>,
    /// The latest not-yet-written value of each key changed since, with its ticket.
    pending: HashMap<String, (u64, Option<V>)>,
    /// Encoded changes waiting for the flusher, in ticket order.
    batch: Vec<Pending<V>>,
    last_ticket: u64,
}

#[derive(Debug, Clone, Default)]
struct Flushed {
    ok_upto: u64,
    /// Ticket ranges that failed (bounded: only the recent past has waiters).
    failed: VecDeque<(u64, u64, String)>,
}

impl Flushed {
    fn failure(&self, t: u64) -> Option<&str> {
        self.failed
            .iter()
            .find(|(from, to, _)| (*from..=*to).contains(&t))
            .map(|(_, _, m)| m.as_str())
    }
}

/// The flusher's own: the open log and the sizes that decide compaction.
struct Writer {
    log: Option<std::fs::File>,
    generation: u64,
    log_bytes: u64,
    snapshot_bytes: u64,
    /// Compaction failed at this log size; try again only well past it.
    compaction_failed_at: Option<u64>,
}

struct Inner<V> {
    dir: PathBuf,
    name: String,
    field: &'static str,
    /// The snapshot's members another release wrote, kept as they are.
    extra: serde_json::Map<String, serde_json::Value>,
    /// Seals a part of each record as it is written (docs/at-rest.md).
    seal: Option<Arc<dyn Seal<V>>>,
    state: Mutex<State<V>>,
    writer: tokio::sync::Mutex<Writer>,
    dirty: Notify,
    flushed: watch::Sender<Flushed>,
    appends: AtomicU64,
    snapshots: AtomicU64,
    /// Snapshot plus log, as last written.
    disk_bytes: AtomicU64,
}

/// A map of records whose only writer is this process, persisted as a log + snapshot.
pub struct Store<V> {
    inner: Arc<Inner<V>>,
}

impl<V> Clone for Store<V> {
    fn clone(&self) -> Self {
        Store {
            inner: self.inner.clone(),
        }
    }
}

/// The changes one [`Store::change`] makes: reads see the latest values (written or not),
/// writes are staged and become records when the closure returns.
pub struct Changes<'a, V> {
    base: &'a BTreeMap<String, V>,
    pending: &'a HashMap<String, (u64, Option<V>)>,
    staged: BTreeMap<String, Option<V>>,
    /// The latest ticket of an unwritten value this change has read: a change that writes
    /// nothing still waits for it, so no answer rests on a value that may never be written.
    read_pending: std::cell::Cell<u64>,
}

impl<V> Changes<'_, V> {
    pub fn get(&self, key: &str) -> Option<&V> {
        if let Some(v) = self.staged.get(key) {
            return v.as_ref();
        }
        if let Some((ticket, v)) = self.pending.get(key) {
            self.read_pending.set(self.read_pending.get().max(*ticket));
            return v.as_ref();
        }
        self.base.get(key)
    }

    pub fn put(&mut self, key: impl Into<String>, value: V) {
        self.staged.insert(key.into(), Some(value));
    }

    /// Removes `key`; returns whether it existed.
    pub fn remove(&mut self, key: &str) -> bool {
        let existed = self.get(key).is_some();
        if existed {
            self.staged.insert(key.to_owned(), None);
        }
        existed
    }

    /// How many keys starting with `prefix` are present now (staged and unwritten
    /// changes counted): a quota check that concurrent changes cannot slip past.
    pub fn count_prefix(&self, prefix: &str) -> usize {
        let mut n = self
            .base
            .range::<str, _>((
                std::ops::Bound::Included(prefix),
                std::ops::Bound::Unbounded,
            ))
            .take_while(|(k, _)| k.starts_with(prefix))
            .count() as isize;
        let mut seen = BTreeSet::new();
        let latest = self
            .staged
            .iter()
            .map(|(k, v)| (k, v.is_some()))
            .chain(self.pending.iter().map(|(k, (_, v))| (k, v.is_some())));
        for (k, present) in latest {
            if !k.starts_with(prefix) || !seen.insert(k) {
                continue; // staged comes first: it is the latest
            }
            match (self.base.contains_key(k), present) {
                (false, true) => n += 1,
                (true, false) => n -= 1,
                _ => {}
            }
        }
        n.max(0) as usize
    }

    /// Every key present now, in order.
    pub fn keys(&self) -> BTreeSet<String> {
        let mut keys: BTreeSet<String> = self.base.keys().cloned().collect();
        for (k, (_, v)) in self.pending {
            if v.is_some() {
                keys.insert(k.clone());
            } else {
                keys.remove(k);
            }
        }
        for (k, v) in &self.staged {
            if v.is_some() {
                keys.insert(k.clone());
            } else {
                keys.remove(k);
            }
        }
        keys
    }
}

impl<V: Serialize + DeserializeOwned + Clone + Send + Sync + 'static> Store<V> {
    /// Opens the state at `path` (`<dir>/<name>.json`, its logs beside it), whose records
    /// live under `field` in the snapshot. Replays the logs, cuts torn tails, and folds
    /// everything into a fresh snapshot. A damaged file, or one in a form this release
    /// cannot read, is an error, never an empty state.
    pub fn open(path: &Path, field: &'static str) -> Result<Store<V>, LoadError> {
        Self::open_with(path, field, false, Sealing::Never).map(|(store, _)| store)
    }

    /// Like [`Store::open`]; with `recover`, a state it would refuse is moved aside
    /// ([`set_aside`]) and what can be read of it is kept: every record this release
    /// reads, in the snapshot and the logs, and nothing else. The [`Recovery`] says what
    /// was skipped and where the files went. With a key in `sealing`, what the file
    /// holds plain is sealed before the start goes on (a sealed file is refused by the
    /// release before, so nothing sealed is written behind a plain snapshot).
    pub fn open_with(
        path: &Path,
        field: &'static str,
        recover: bool,
        sealing: Sealing<V>,
    ) -> Result<(Store<V>, Option<Recovery>), LoadError> {
        let dir = path.parent().unwrap_or(Path::new(".")).to_path_buf();
        let name = path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("state")
            .to_owned();
        let removed = remove_stale_temporaries(&dir);
        if removed > 0 {
            tracing::info!(dir = %dir.display(), removed, "removed temporary files a previous run left behind");
        }
        let (loaded, recovery) =
            match files::load::<V>(&dir, &name, field, files::Mode::Strict, &sealing) {
                Ok(loaded) => (loaded, None),
                Err(refused) if recover && refused.recoverable() => {
                    let Some(moved_to) = set_aside(&dir, &name)? else {
                        return Err(refused);
                    };
                    let loaded =
                        files::load::<V>(&moved_to, &name, field, files::Mode::Lenient, &sealing)?;
                    let recovery = Recovery {
                        refused: refused.to_string(),
                        moved_to,
                        kept: loaded.map.len(),
                        skipped: loaded.skipped.clone(),
                    };
                    (loaded, Some(recovery))
                }
                Err(e) => return Err(e),
            };
        let generation = loaded
            .logs
            .last()
            .map_or(loaded.next_log, |g| g + 1)
            .max(loaded.next_log)
            .max(1);
        let mut snapshot_bytes = loaded.snapshot_bytes;
        let seal = match sealing {
            Sealing::With(s) => Some(s),
            _ => None,
        };
        // Plain on disk, sealed from now on: the plain snapshot is replaced by a sealed
        // one before anything sealed is appended behind it.
        let sealing_in_place = seal
            .as_ref()
            .is_some_and(|s| loaded.sealed_with.as_deref() != Some(s.key_id()));
        // Everything replayed goes into one snapshot, so the next start reads one file.
        // Best effort: on a full disk the logs stay and are replayed again next time.
        let folded = files::encode_snapshot(
            field,
            generation,
            &loaded.map,
            &loaded.unknown,
            &loaded.extra,
            seal.as_deref(),
        )
        .and_then(|bytes| {
            write_atomic_at(
                &files::snapshot_path(&dir, &name),
                &bytes,
                Some(SNAPSHOT_CRASH),
            )
            .map(|()| bytes.len() as u64)
            .map_err(|e| e.to_string())
        });
        match folded {
            Ok(n) => {
                snapshot_bytes = n;
                crate::crash::point("store.fold.logs");
                for g in files::log_generations(&dir, &name)? {
                    if g < generation {
                        let _ = std::fs::remove_file(files::log_path(&dir, &name, g));
                    }
                }
                if sealing_in_place && !loaded.map.is_empty() {
                    tracing::info!(file = %path.display(), records = loaded.map.len(), "sealed in place: the secrets its records hold are sealed with the state key");
                }
            }
            Err(e) if sealing_in_place => {
                return Err(LoadError::Io {
                    file: path.display().to_string(),
                    source: std::io::Error::other(format!(
                        "cannot seal it in place ({e}); nothing was changed"
                    )),
                });
            }
            Err(e) if recovery.is_some() => {
                // The files were moved aside: starting without writing what was kept
                // would start empty.
                return Err(LoadError::Io {
                    file: path.display().to_string(),
                    source: std::io::Error::other(e),
                });
            }
            Err(e) => {
                tracing::warn!(file = %path.display(), error = %e, "cannot write a fresh snapshot at start; the logs are kept")
            }
        }
        if !loaded.unknown.is_empty() || !loaded.extra.is_empty() {
            tracing::info!(file = %path.display(), records = loaded.unknown.len(), "state holds members a later release wrote; they are kept as they are");
        }
        let store = Store {
            inner: Arc::new(Inner {
                dir,
                name,
                field,
                extra: loaded.extra,
                seal,
                state: Mutex::new(State {
                    map: loaded.map,
                    unknown: loaded.unknown,
                    pending: HashMap::new(),
                    batch: Vec::new(),
                    last_ticket: 0,
                }),
                writer: tokio::sync::Mutex::new(Writer {
                    log: None,
                    generation,
                    log_bytes: 0,
                    snapshot_bytes,
                    compaction_failed_at: None,
                }),
                dirty: Notify::new(),
                flushed: watch::channel(Flushed::default()).0,
                appends: AtomicU64::new(0),
                snapshots: AtomicU64::new(0),
                disk_bytes: AtomicU64::new(snapshot_bytes),
            }),
        };
        Ok((store, recovery))
    }

    /// The durable records (what is on disk), read-only. `field` as in [`Store::open`].
    pub fn view(path: &Path, field: &str) -> Result<BTreeMap<String, V>, LoadError> {
        let dir = path.parent().unwrap_or(Path::new("."));
        let name = path.file_stem().and_then(|s| s.to_str()).unwrap_or("state");
        Ok(files::load::<V>(dir, name, field, files::Mode::View, &Sealing::Never)?.map)
    }

    pub fn path(&self) -> PathBuf {
        files::snapshot_path(&self.inner.dir, &self.inner.name)
    }

    /// Durable writes (log appends, each one fsync) since start.
    pub fn writes(&self) -> u64 {
        self.inner.appends.load(Ordering::Relaxed)
    }

    /// Bytes the state takes on disk (snapshot and log).
    pub fn disk_bytes(&self) -> u64 {
        self.inner.disk_bytes.load(Ordering::Relaxed)
    }

    /// Snapshots written since start (compactions).
    pub fn snapshots(&self) -> u64 {
        self.inner.snapshots.load(Ordering::Relaxed)
    }

    /// Reads the durable records.
    pub fn read<R>(&self, f: impl FnOnce(&BTreeMap<String, V>) -> R) -> R {
        let guard = self.inner.state.lock();
        f(&guard.map)
    }

    /// Stages changes; they reach memory once written. `Err` when a change would not
    /// read back (nothing is staged then).
    pub fn change<R>(
        &self,
        f: impl FnOnce(&mut Changes<'_, V>) -> R,
    ) -> Result<(R, Ticket), PersistError> {
        let (r, ticket) = self.stage(f).map_err(|Staged(_, e)| e)?;
        if ticket.0 != 0 {
            self.inner.dirty.notify_one();
        }
        Ok((r, ticket))
    }

    /// Like [`Store::change`], for bookkeeping nobody waits on (delivery records, attempt
    /// counters): written with the next flush, at most [`LAZY_FLUSH`] later.
    pub fn change_lazy<R>(&self, f: impl FnOnce(&mut Changes<'_, V>) -> R) -> R {
        match self.stage(f) {
            Ok((r, _)) => r,
            Err(Staged(r, e)) => {
                tracing::warn!(error = %e, "bookkeeping change not recorded");
                r
            }
        }
    }

    /// `change` then `wait`.
    pub async fn change_durable<R>(
        &self,
        f: impl FnOnce(&mut Changes<'_, V>) -> R,
    ) -> Result<R, PersistError> {
        let (r, ticket) = self.change(f)?;
        self.wait(ticket).await?;
        Ok(r)
    }

    fn stage<R>(&self, f: impl FnOnce(&mut Changes<'_, V>) -> R) -> Result<(R, Ticket), Staged<R>> {
        let mut st = self.inner.state.lock();
        let (r, staged, read_pending) = {
            let mut ch = Changes {
                base: &st.map,
                pending: &st.pending,
                staged: BTreeMap::new(),
                read_pending: std::cell::Cell::new(0),
            };
            let r = f(&mut ch);
            (r, ch.staged, ch.read_pending.get())
        };
        if staged.is_empty() {
            // Nothing to write, but what was read may not be on disk yet.
            return Ok((r, Ticket(read_pending)));
        }
        let mut lines = Vec::with_capacity(staged.len());
        for (k, v) in &staged {
            match files::encode_line(k, v.as_ref(), st.unknown.get(k), self.inner.seal.as_deref()) {
                Ok(line) => lines.push(line),
                Err(message) => {
                    return Err(Staged(
                        r,
                        PersistError {
                            file: self.path().display().to_string(),
                            message,
                        },
                    ))
                }
            }
        }
        st.last_ticket += 1;
        let ticket = st.last_ticket;
        for ((key, value), line) in staged.into_iter().zip(lines) {
            st.pending.insert(key.clone(), (ticket, value.clone()));
            st.batch.push(Pending {
                ticket,
                key,
                value,
                line,
            });
        }
        Ok((r, Ticket(ticket)))
    }

    /// Waits until the change behind `ticket` is on disk (and in memory).
    pub async fn wait(&self, ticket: Ticket) -> Result<(), PersistError> {
        if ticket.0 == 0 {
            return Ok(());
        }
        let mut rx = self.inner.flushed.subscribe();
        let seen = rx
            .wait_for(|f| f.ok_upto >= ticket.0 || f.failure(ticket.0).is_some())
            .await
            .map(|f| f.clone())
            .unwrap_or_default();
        match seen.failure(ticket.0) {
            Some(message) => Err(PersistError {
                file: self.path().display().to_string(),
                message: message.to_owned(),
            }),
            None => Ok(()),
        }
    }

    /// Writes what is staged, once. On failure, every staged change is dropped and its
    /// waiters get the error; memory keeps the last durable state.
    pub async fn flush_once(&self) -> Result<(), PersistError> {
        let mut writer = self.inner.writer.lock().await;
        let batch = std::mem::take(&mut self.inner.state.lock().batch);
        let Some(upto) = batch.last().map(|p| p.ticket) else {
            return Ok(());
        };
        let mut bytes = Vec::with_capacity(batch.iter().map(|p| p.line.len()).sum());
        for p in &batch {
            bytes.extend_from_slice(&p.line);
        }
        let path = files::log_path(&self.inner.dir, &self.inner.name, writer.generation);
        let log = writer.log.take();
        let (log, written, damaged) =
            tokio::task::spawn_blocking(move || atomic::append(log, &path, &bytes))
                .await
                .unwrap_or_else(|e| (None, Err(std::io::Error::other(e.to_string())), false));
        writer.log = log;
        if damaged {
            // A partial record could not be cut off: appending after it would put good
            // records behind damage, which recovery refuses. The damage stays the torn
            // tail of this log; writing goes on in the next one.
            writer.generation += 1;
            writer.log_bytes = 0;
        }
        let file = self.path().display().to_string();
        match written {
            Ok(n) => {
                writer.log_bytes += n;
                self.inner
                    .disk_bytes
                    .store(writer.snapshot_bytes + writer.log_bytes, Ordering::Relaxed);
                {
                    let mut st = self.inner.state.lock();
                    for p in batch {
                        match p.value {
                            Some(v) => {
                                st.map.insert(p.key.clone(), v);
                            }
                            None => {
                                st.map.remove(&p.key);
                                st.unknown.remove(&p.key);
                            }
                        }
                        if st.pending.get(&p.key).is_some_and(|(t, _)| *t <= upto) {
                            st.pending.remove(&p.key);
                        }
                    }
                }
                self.inner.appends.fetch_add(1, Ordering::Relaxed);
                self.inner
                    .flushed
                    .send_modify(|f| f.ok_upto = f.ok_upto.max(upto));
                self.maybe_compact(&mut writer).await;
                Ok(())
            }
            Err(e) => {
                let message = e.to_string();
                tracing::error!(file = %file, error = %message, "state write failed; the changes waiting for it are refused and memory keeps the last written state");
                let (from, to) = {
                    let mut st = self.inner.state.lock();
                    // Later changes were computed on top of the failed ones: they go too.
                    st.pending.clear();
                    st.batch.clear();
                    (batch[0].ticket, st.last_ticket)
                };
                self.inner.flushed.send_modify(|f| {
                    f.failed.push_back((from, to, message.clone()));
                    while f.failed.len() > 256 {
                        f.failed.pop_front();
                    }
                });
                Err(PersistError { file, message })
            }
        }
    }

    /// Folds the log into a new snapshot once it outgrows the snapshot.
    async fn maybe_compact(&self, writer: &mut Writer) {
        let threshold = writer.snapshot_bytes.max(MIN_COMPACTION_BYTES);
        let retry_floor = writer.compaction_failed_at.map_or(0, |at| at * 2);
        if writer.log_bytes < threshold || writer.log_bytes < retry_floor {
            return;
        }
        let next = writer.generation + 1;
        // Under the state lock: the map now holds exactly what the logs up to this
        // generation hold; what is staged will go to the next log.
        let encoded = {
            let st = self.inner.state.lock();
            files::encode_snapshot(
                self.inner.field,
                next,
                &st.map,
                &st.unknown,
                &self.inner.extra,
                self.inner.seal.as_deref(),
            )
        };
        let (dir, name, path) = (self.inner.dir.clone(), self.inner.name.clone(), self.path());
        let old = writer.generation;
        let done = tokio::task::spawn_blocking(move || {
            let bytes = encoded.map_err(std::io::Error::other)?;
            write_atomic_at(&path, &bytes, Some(SNAPSHOT_CRASH))?;
            crate::crash::point("store.fold.logs");
            for g in files::log_generations(&dir, &name).unwrap_or_default() {
                if g <= old {
                    let _ = std::fs::remove_file(files::log_path(&dir, &name, g));
                }
            }
            Ok::<u64, std::io::Error>(bytes.len() as u64)
        })
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
        match done {
            Ok(n) => {
                writer.log = None;
                writer.generation = next;
                writer.log_bytes = 0;
                writer.snapshot_bytes = n;
                writer.compaction_failed_at = None;
                self.inner.disk_bytes.store(n, Ordering::Relaxed);
                self.inner.snapshots.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                tracing::warn!(file = %self.path().display(), error = %e, "snapshot not written; the log keeps growing until it can be");
                writer.compaction_failed_at = Some(writer.log_bytes);
            }
        }
    }

    /// The flusher: the only code that writes the files. Runs until `shutdown`, then
    /// writes what is left.
    pub async fn run_flusher(self, shutdown: CancellationToken) {
        let mut backoff = Duration::from_millis(50);
        loop {
            tokio::select! {
                _ = self.inner.dirty.notified() => {}
                _ = tokio::time::sleep(LAZY_FLUSH) => {}
                _ = shutdown.cancelled() => break,
            }
            if self.flush_once().await.is_err() {
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = shutdown.cancelled() => break,
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
            } else {
                backoff = Duration::from_millis(50);
            }
        }
        let _ = self.flush_once().await;
    }
}

/// What a recovering start did: the refusal it got past, where the files it could not
/// use whole went, and what it kept and skipped.
#[derive(Debug, Clone)]
pub struct Recovery {
    pub refused: String,
    pub moved_to: PathBuf,
    pub kept: usize,
    pub skipped: Vec<String>,
}

/// A change that could not be staged; the closure's result is still handed back.
struct Staged<R>(R, PersistError);

#[cfg(test)]
mod sealed_tests;
#[cfg(test)]
mod tests;
