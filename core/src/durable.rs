//! State files with one in-process owner: mutations happen in memory under one lock,
//! and a single flusher task replaces the file atomically (temp, fsync, rename, fsync
//! dir). Everyone who mutated waits for a flush that includes their change, so a burst
//! of a thousand changes shares a handful of writes (group commit) and no update is lost.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::{watch, Notify};
use tokio_util::sync::CancellationToken;

/// The longest a lazy change waits for its write.
pub const LAZY_FLUSH: Duration = Duration::from_millis(500);

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

/// Reads a JSON state file. A missing file is `T::default()`; a file that does not parse
/// (torn, foreign, or from a newer version) is moved aside loudly and replaced by the
/// default, so a bad file never makes the agent crash in a loop. A file that exists but
/// cannot be read (EIO, EACCES) is an error: starting empty would overwrite it.
pub fn load_or_quarantine<T: DeserializeOwned + Default>(path: &Path) -> std::io::Result<T> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(T::default()),
        Err(e) => return Err(e),
    };
    match serde_json::from_slice(&bytes) {
        Ok(v) => Ok(v),
        Err(e) => {
            let aside = path.with_extension(format!("corrupt-{}", crate::wire::unix_now()));
            let moved = std::fs::rename(path, &aside);
            tracing::error!(
                file = %path.display(),
                moved_to = %aside.display(),
                moved = moved.is_ok(),
                error = %e,
                "STATE FILE UNREADABLE: moved aside, starting from an empty state"
            );
            // Not moved aside means the next write would destroy it: refuse instead.
            moved?;
            Ok(T::default())
        }
    }
}

/// A flush failed; the change is in memory and will be retried, but is not durable yet.
#[derive(Debug, Clone, thiserror::Error)]
#[error("state file {file} not written: {message}")]
pub struct PersistError {
    pub file: String,
    pub message: String,
}

#[derive(Debug, Clone, Default)]
struct Flushed {
    generation: u64,
    failed: Option<(u64, String)>,
}

struct Inner<T> {
    state: Mutex<(T, u64)>,
    path: PathBuf,
    dirty: Notify,
    /// Changes nobody waits for (delivery records, attempt counters): written with the
    /// next flush, or within [`LAZY_FLUSH`], so a burst of them is one write, not one each.
    lazy_dirty: std::sync::atomic::AtomicBool,
    flushed: watch::Sender<Flushed>,
    writes: AtomicU64,
}

/// Proof that a mutation happened; wait on it for durability.
#[derive(Debug, Clone, Copy)]
#[must_use = "a mutation is not durable until its ticket is waited on"]
pub struct Ticket(u64);

/// A value whose only writer is this process, persisted to one JSON file.
pub struct Durable<T> {
    inner: Arc<Inner<T>>,
}

impl<T> Clone for Durable<T> {
    fn clone(&self) -> Self {
        Durable {
            inner: self.inner.clone(),
        }
    }
}

impl<T: Serialize + Send + 'static> Durable<T> {
    pub fn new(path: PathBuf, value: T) -> Durable<T> {
        Durable {
            inner: Arc::new(Inner {
                state: Mutex::new((value, 0)),
                path,
                dirty: Notify::new(),
                lazy_dirty: std::sync::atomic::AtomicBool::new(false),
                flushed: watch::channel(Flushed::default()).0,
                writes: AtomicU64::new(0),
            }),
        }
    }

    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// How many times the file has been written since start.
    pub fn writes(&self) -> u64 {
        self.inner.writes.load(Ordering::Relaxed)
    }

    pub fn read<R>(&self, f: impl FnOnce(&T) -> R) -> R {
        let guard = self.inner.state.lock().expect("state lock");
        f(&guard.0)
    }

    /// Applies `f` in memory. `f` returns whether it changed anything; no change, no write.
    pub fn mutate<R>(&self, f: impl FnOnce(&mut T) -> (R, bool)) -> (R, Ticket) {
        let mut guard = self.inner.state.lock().expect("state lock");
        let (r, changed) = f(&mut guard.0);
        if changed {
            guard.1 += 1;
        }
        let ticket = Ticket(guard.1);
        drop(guard);
        if changed {
            self.inner.dirty.notify_one();
        }
        (r, ticket)
    }

    /// Applies `f` in memory like [`Durable::mutate`], for bookkeeping nobody waits on: it
    /// reaches the disk with the next flush, at most [`LAZY_FLUSH`] later.
    pub fn mutate_lazy<R>(&self, f: impl FnOnce(&mut T) -> (R, bool)) -> R {
        let mut guard = self.inner.state.lock().expect("state lock");
        let (r, changed) = f(&mut guard.0);
        if changed {
            guard.1 += 1;
            self.inner.lazy_dirty.store(true, Ordering::Relaxed);
        }
        r
    }

    /// Waits until a flush covering `ticket` has reached the disk.
    pub async fn wait(&self, ticket: Ticket) -> Result<(), PersistError> {
        let mut rx = self.inner.flushed.subscribe();
        let seen = rx
            .wait_for(|f| {
                f.generation >= ticket.0 || matches!(&f.failed, Some((g, _)) if *g >= ticket.0)
            })
            .await
            .map(|f| f.clone())
            .unwrap_or_default();
        if seen.generation >= ticket.0 {
            return Ok(());
        }
        Err(PersistError {
            file: self.inner.path.display().to_string(),
            message: seen.failed.map(|(_, m)| m).unwrap_or_default(),
        })
    }

    /// `mutate` then `wait`.
    pub async fn mutate_durable<R>(
        &self,
        f: impl FnOnce(&mut T) -> (R, bool),
    ) -> Result<R, PersistError> {
        let (r, ticket) = self.mutate(f);
        self.wait(ticket).await?;
        Ok(r)
    }

    fn snapshot(&self) -> (Vec<u8>, u64) {
        let guard = self.inner.state.lock().expect("state lock");
        // Compact: a 1,000-entry file is written many times in a burst; `jq .` reads it.
        let bytes = serde_json::to_vec(&guard.0).expect("state serialises");
        (bytes, guard.1)
    }

    /// Writes the current state once if it is newer than the file.
    pub async fn flush_once(&self) -> Result<(), PersistError> {
        let (bytes, generation) = self.snapshot();
        if generation <= self.inner.flushed.borrow().generation {
            return Ok(());
        }
        let path = self.inner.path.clone();
        let written = tokio::task::spawn_blocking(move || write_atomic(&path, &bytes))
            .await
            .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
        match written {
            Ok(()) => {
                self.inner.writes.fetch_add(1, Ordering::Relaxed);
                self.inner.flushed.send_modify(|f| {
                    f.generation = generation;
                    f.failed = None;
                });
                Ok(())
            }
            Err(e) => {
                let message = e.to_string();
                tracing::error!(file = %self.inner.path.display(), error = %message, "state write failed; will retry");
                self.inner
                    .flushed
                    .send_modify(|f| f.failed = Some((generation, message.clone())));
                Err(PersistError {
                    file: self.inner.path.display().to_string(),
                    message,
                })
            }
        }
    }

    /// The flusher: the only code that writes the file. Runs until `shutdown`, then
    /// flushes what is left.
    pub async fn run_flusher(self, shutdown: CancellationToken) {
        let mut backoff = Duration::from_millis(50);
        loop {
            tokio::select! {
                _ = self.inner.dirty.notified() => {}
                _ = tokio::time::sleep(LAZY_FLUSH) => {
                    if !self.inner.lazy_dirty.swap(false, Ordering::Relaxed) {
                        continue;
                    }
                }
                _ = shutdown.cancelled() => break,
            }
            if self.flush_once().await.is_err() {
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = shutdown.cancelled() => break,
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
                self.inner.dirty.notify_one();
            } else {
                backoff = Duration::from_millis(50);
            }
        }
        let _ = self.flush_once().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[tokio::test]
    async fn group_commit_loses_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.json");
        let store: Durable<BTreeMap<u32, u32>> = Durable::new(path.clone(), BTreeMap::new());
        let token = CancellationToken::new();
        let flusher = tokio::spawn(store.clone().run_flusher(token.clone()));
        let mut tasks = Vec::new();
        for i in 0..500u32 {
            let s = store.clone();
            tasks.push(tokio::spawn(async move {
                s.mutate_durable(|m| (m.insert(i, i), true)).await.unwrap();
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        let on_disk: BTreeMap<u32, u32> =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(on_disk.len(), 500);
        assert!(store.writes() < 500, "writes {}", store.writes());
        token.cancel();
        flusher.await.unwrap();
    }

    #[test]
    fn torn_file_is_moved_aside() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.json");
        std::fs::write(&path, b"{\"a\": ").unwrap();
        let v: BTreeMap<String, u32> = load_or_quarantine(&path).unwrap();
        assert!(v.is_empty());
        assert!(!path.exists());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
