//! The one writer of the trail: chains records, appends them to the current file,
//! signs checkpoints and begins a new file when the current one is full.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{
    checkpoint_trailer, witness_line, Event, Options, Shared, Witnessed, GENESIS, NAMESPACE,
};
use crate::canonical::sha256_hex;
use crate::sign::Signer;

/// How often queued records are written when fewer than a wake-up's worth arrive.
const TICK: Duration = Duration::from_millis(100);

/// The largest queue vector kept for the next round (records, of a few hundred bytes
/// each): a burst that filled a larger one gives its memory back.
const SPARE_KEPT: usize = 8192;

/// How often an unwritable trail is tried again while nothing is queued.
const PROBE: Duration = Duration::from_secs(1);

/// The file records are appended to.
struct Current {
    path: PathBuf,
    /// Bytes written and confirmed: what the file must hold before the next write.
    len: u64,
}

pub(super) struct Writer {
    options: Options,
    signer: Signer,
    shared: Arc<Shared>,
    keyed: super::KeyedHash,
    seq: u64,
    head: String,
    current: Option<Current>,
    /// Chained records not yet written, and the seq of the first of them.
    unsaved: Vec<u8>,
    unsaved_first: u64,
    since_checkpoint: u64,
    last_checkpoint: Instant,
    last_probe: Instant,
    /// Said once per outage, not once per attempt.
    complained: bool,
    /// The remote syslog copy, if one is configured.
    forward: Option<super::forward::Forward>,
    /// The queue's vector from the last round, emptied, for the next.
    spare: Vec<(u64, Event)>,
    /// The checkpoint index (§12.3b); `None` until it can be opened.
    index: Option<super::index::IndexWriter>,
    /// Checkpoints chained but not yet on disk and in the index, oldest first: one whose
    /// write failed (a full disk) is written by a later flush, and indexed then.
    unindexed: Vec<(u64, String, u64, Witnessed)>,
}

/// A file's name: the seq of its first record, so names sort in the chain's order.
pub(super) fn file_name(first_seq: u64) -> String {
    format!("{first_seq:016}.jsonl")
}

impl Writer {
    pub(super) fn open(options: Options, signer: Signer, shared: Arc<Shared>) -> Writer {
        let keyed = super::KeyedHash::new(&super::hash_key(&signer));
        let forward = options
            .syslog
            .clone()
            .map(|t| super::forward::Forward::start(t, &options.host, shared.not_copied.clone()));
        let mut w = Writer {
            options,
            signer,
            shared,
            keyed,
            seq: 0,
            head: GENESIS.to_owned(),
            current: None,
            unsaved: Vec::new(),
            unsaved_first: 1,
            since_checkpoint: 0,
            last_checkpoint: Instant::now(),
            last_probe: Instant::now(),
            complained: false,
            forward,
            spare: Vec::new(),
            index: None,
            unindexed: Vec::new(),
        };
        match w.resume() {
            Ok(torn) => {
                w.shared.writable.store(true, Ordering::Relaxed);
                if torn > 0 {
                    let event = Event::own(super::OwnKind::TornTail)
                        .detail(serde_json::json!({ "bytes": torn }));
                    w.chain(crate::wire::unix_now(), event);
                }
            }
            Err(e) => w.complain(&format!("cannot open the audit trail: {e}")),
        }
        w
    }

    /// Continues the chain of the newest file: its last complete record gives the seq
    /// and the head. A record cut short by a crash is cut off (it was never complete,
    /// so nothing signed covers it) and the number of bytes is recorded.
    fn resume(&mut self) -> std::io::Result<u64> {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.options.dir)?;
        let files = super::files(&self.options.dir)?;
        for path in files.iter().rev() {
            let mut bytes = read_file(path, self.options.max_file_bytes)?;
            let complete = bytes.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
            let torn = (bytes.len() - complete) as u64;
            if torn > 0 {
                let f = crate::fsx::open_regular_for_write(path)?;
                f.set_len(complete as u64)?;
                f.sync_data()?;
                bytes.truncate(complete);
            }
            let Some(last) = bytes[..complete.saturating_sub(1)]
                .rsplit(|b| *b == b'\n')
                .next()
                .filter(|l| !l.is_empty())
            else {
                continue;
            };
            self.head = sha256_hex(&[last, b"\n"].concat());
            self.seq = serde_json::from_slice::<serde_json::Value>(last)
                .ok()
                .and_then(|v| v["seq"].as_u64())
                .unwrap_or(0);
            if path == files.last().expect("non-empty")
                && (bytes.len() as u64) < self.options.max_file_bytes
            {
                self.current = Some(Current {
                    path: path.clone(),
                    len: bytes.len() as u64,
                });
            }
            self.unsaved_first = self.seq + 1;
            // A file just begun has none yet: the one before it ends with one.
            let latest = latest_checkpoint(&bytes[..complete]).or_else(|| {
                let before = files.iter().rev().skip_while(|f| *f != path).nth(1)?;
                latest_checkpoint(&read_file(before, self.options.max_file_bytes).ok()?)
            });
            *self.shared.latest.lock() = latest;
            self.open_index(&files);
            return Ok(torn);
        }
        self.open_index(&files);
        Ok(0)
    }

    /// Opens the checkpoint index and adds the checkpoints a crash kept from it: those
    /// after its last line whose `index` continues it, newest files read back only as
    /// far as needed.
    fn open_index(&mut self, files: &[PathBuf]) {
        let mut index = match super::index::IndexWriter::open(&self.options.dir) {
            Ok(i) => i,
            Err(e) => {
                self.complain(&format!("cannot open the checkpoint index: {e}"));
                return;
            }
        };
        let mut missing: Vec<(u64, String, u64, String)> = Vec::new();
        'files: for path in files.iter().rev() {
            let Ok(bytes) = read_file(path, self.options.max_file_bytes) else {
                break;
            };
            let mut here = Vec::new();
            let mut reached = false;
            for line in bytes.split(|b| *b == b'\n') {
                if !line.windows(12).any(|w| w == b"\"checkpoint\"") {
                    continue;
                }
                let Ok(v) = serde_json::from_slice::<serde_json::Value>(line) else {
                    continue;
                };
                let fields = (
                    v["count"].as_u64(),
                    v["head"].as_str(),
                    v["at"].as_u64(),
                    v["index"].as_str(),
                );
                let (Some(count), Some(head), Some(at), Some(link)) = fields else {
                    continue;
                };
                if index.last_count.is_some_and(|c| count <= c) {
                    reached = true;
                    continue;
                }
                here.push((count, head.to_owned(), at, link.to_owned()));
            }
            here.append(&mut missing);
            missing = here;
            if reached {
                break 'files;
            }
        }
        for (count, head, at, link) in missing {
            if link != index.head {
                tracing::warn!(count, "a checkpoint does not continue the checkpoint index; the index goes on without it");
                continue;
            }
            if let Err(e) = index.append(count, &head, at) {
                self.complain(&format!("cannot write the checkpoint index: {e}"));
            }
        }
        self.index = Some(index);
    }

    pub(super) fn run(mut self) {
        loop {
            let (mut events, lost, stopping) = {
                let mut q = self.shared.queue.lock();
                if q.events.is_empty() && !q.stopping {
                    self.shared.wake.wait_for(&mut q, TICK);
                }
                if self.unsaved.is_empty() {
                    // The queue goes on in the vector emptied last time: a burst of
                    // records is not queued into one grown from nothing, copy by copy.
                    (
                        std::mem::replace(&mut q.events, std::mem::take(&mut self.spare)),
                        std::mem::take(&mut q.lost),
                        q.stopping,
                    )
                } else {
                    // The last write failed: nothing more is chained until it is written.
                    (Vec::new(), 0, q.stopping)
                }
            };
            let idle = events.is_empty() && lost == 0;
            for (at, event) in events.drain(..) {
                self.append(at, event);
            }
            if events.capacity() <= SPARE_KEPT {
                self.spare = events;
            }
            if lost > 0 {
                let event =
                    Event::own(super::OwnKind::Lost).detail(serde_json::json!({ "records": lost }));
                self.append(crate::wire::unix_now(), event);
            }
            self.flush();
            if idle && self.unsaved.is_empty() && self.last_probe.elapsed() >= PROBE {
                self.probe();
            }
            if self.last_checkpoint.elapsed() >= self.options.checkpoint_interval {
                self.checkpoint();
            }
            if stopping {
                let rest = std::mem::take(&mut self.shared.queue.lock().events);
                for (at, event) in rest {
                    self.append(at, event);
                }
                self.flush();
                self.checkpoint();
                return;
            }
        }
    }

    /// Chains one record, beginning a new file first when the current one is full.
    fn append(&mut self, at: u64, event: Event) {
        // What is chained but not yet written counts too: a burst queued at once, or
        // while the disk was away, must not make one file of any size.
        let written = self.current.as_ref().map_or(0, |c| c.len);
        let begun = self.current.is_some() || !self.unsaved.is_empty();
        let full = begun && written + self.unsaved.len() as u64 >= self.options.max_file_bytes;
        if full {
            self.rotate(at);
        }
        self.chain(at, event);
    }

    fn chain(&mut self, at: u64, mut event: Event) {
        if let Some(text) = event.request_text.take() {
            event.request = Some(self.keyed.of(text.get().as_bytes()));
        }
        if self.unsaved.is_empty() {
            self.unsaved_first = self.seq + 1;
        }
        self.seq += 1;
        let start = self.unsaved.len();
        super::line::write_record(&mut self.unsaved, self.seq, at, &self.head, &event);
        self.unsaved.push(b'\n');
        let line = &self.unsaved[start..];
        self.head = sha256_hex(line);
        self.since_checkpoint += 1;
        self.shared.records.fetch_add(1, Ordering::Relaxed);
        if self.options.journal || self.forward.is_some() {
            let text = String::from_utf8_lossy(&line[..line.len() - 1]);
            if self.options.journal {
                tracing::info!(target: "fort_audit", "{text}");
            }
            if let Some(f) = &self.forward {
                f.send(&text);
            }
        }
    }

    /// Writes the chained records; on failure keeps them for the next try. Checkpoints
    /// among them go into the index once they are on disk.
    fn flush(&mut self) -> bool {
        if !self.unsaved.is_empty() {
            if let Err(e) = self.write_unsaved() {
                self.complain(&format!("cannot write the audit trail: {e}"));
                return false;
            }
            self.unsaved.clear();
            self.recovered();
        }
        self.index_written()
    }

    /// Syncs the file and adds the checkpoints written to it to the index, in order;
    /// false while one is left (the next checkpoint links to the index after it).
    /// Handed to consumers only once it is on disk, and in the index: a crash must not
    /// leave them holding a checkpoint the trail does not.
    fn index_written(&mut self) -> bool {
        if self.unindexed.is_empty() {
            return true;
        }
        let Some(c) = &self.current else {
            return false;
        };
        let synced = crate::fsx::open_regular(&c.path).and_then(|f| f.sync_data());
        crate::crash::point("audit.checkpoint.written");
        if let Err(e) = synced {
            self.complain(&format!("cannot sync the audit trail: {e}"));
            return false;
        }
        for (count, head, at, witnessed) in std::mem::take(&mut self.unindexed) {
            match self.index.as_mut().map(|i| i.append(count, &head, at)) {
                Some(Err(e)) => self.complain(&format!("cannot write the checkpoint index: {e}")),
                _ => *self.shared.latest.lock() = Some(witnessed),
            }
        }
        true
    }

    fn write_unsaved(&mut self) -> std::io::Result<()> {
        let dir = self.options.dir.clone();
        let created = self.current.is_none();
        let path = match &self.current {
            Some(c) => c.path.clone(),
            None => dir.join(file_name(self.unsaved_first)),
        };
        let mut f = crate::fsx::open_append(&path)?;
        if created {
            sync_dir(&dir);
            crate::crash::point("audit.rotate.created");
        }
        // A file of that name already there (a chain whose seq could not be read back)
        // is appended to, never cut.
        let current = match self.current.take() {
            Some(c) => self.current.insert(c),
            None => {
                let len = std::fs::metadata(&path)?.len();
                self.current.insert(Current { path, len })
            }
        };
        // What a failed write left of itself is cut off before the records go again.
        if f.metadata()?.len() > current.len {
            f.set_len(current.len)?;
        }
        let half = self.unsaved.len() / 2;
        f.write_all(&self.unsaved[..half])?;
        crate::crash::point("audit.append.torn");
        f.write_all(&self.unsaved[half..])?;
        crate::crash::point("audit.append.written");
        current.len += self.unsaved.len() as u64;
        Ok(())
    }

    /// Signs the head: this file's bytes so far followed by the checkpoint line (§12),
    /// read back from the file (bounded by `max_file_bytes`), so that what is signed is
    /// what a verifier will read.
    fn checkpoint(&mut self) {
        self.last_checkpoint = Instant::now();
        if self.since_checkpoint == 0 || !self.flush() {
            return;
        }
        let Some(current) = &self.current else { return };
        let at = crate::wire::unix_now();
        let trailer = checkpoint_trailer(&self.options.host, self.seq, &self.head, at);
        let mut signed = match read_prefix(&current.path, current.len) {
            Ok(bytes) => bytes,
            Err(e) => {
                self.complain(&format!("cannot read the audit trail back to sign it: {e}"));
                return;
            }
        };
        signed.extend_from_slice(trailer.as_bytes());
        let mut event = Event::own(super::OwnKind::Checkpoint);
        event.count = Some(self.seq);
        event.head = Some(self.head.clone());
        event.signature = Some(self.signer.sign_in(NAMESPACE, &signed));
        drop(signed);
        let line = witness_line(&self.options.host, self.seq, &self.head, at);
        let witnessed = Witnessed {
            count: self.seq,
            head: self.head.clone(),
            at,
            witness: self.signer.sign_in(NAMESPACE, line.as_bytes()),
        };
        event.witness = Some(witnessed.witness.clone());
        if self.index.is_none() {
            let files = super::files(&self.options.dir).unwrap_or_default();
            self.open_index(&files);
        }
        event.index = self.index.as_ref().map(|i| i.head.clone());
        let (count, head) = (self.seq, self.head.clone());
        self.chain(at, event);
        self.unindexed.push((count, head, at, witnessed));
        if self.flush() {
            self.since_checkpoint = 0;
            self.shared.checkpoints.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Closes the current file with a checkpoint and begins the next; the oldest files
    /// past `max_files` go.
    fn rotate(&mut self, _at: u64) {
        self.checkpoint();
        if !self.unsaved.is_empty() || !self.unindexed.is_empty() {
            return;
        }
        self.current = None;
        let Ok(files) = super::files(&self.options.dir) else {
            return;
        };
        // The new file is one more.
        let excess = (files.len() + 1).saturating_sub(self.options.max_files.max(2));
        for old in files.iter().take(excess) {
            if let Err(e) = std::fs::remove_file(old) {
                tracing::warn!(file = %old.display(), error = %e, "cannot remove an old audit file");
            }
        }
    }

    /// Whether the trail could be written now, when there is nothing to write.
    fn probe(&mut self) {
        self.last_probe = Instant::now();
        let path = match &self.current {
            Some(c) => crate::fsx::open_append(&c.path).map(drop),
            None => std::fs::read_dir(&self.options.dir).map(drop),
        };
        match path {
            Ok(()) => self.recovered(),
            Err(e) => self.complain(&format!("the audit trail cannot be written: {e}")),
        }
    }

    fn complain(&mut self, message: &str) {
        self.shared.writable.store(false, Ordering::Relaxed);
        if !self.complained {
            self.complained = true;
            tracing::error!(dir = %self.options.dir.display(), "{message}");
        }
    }

    fn recovered(&mut self) {
        self.shared.writable.store(true, Ordering::Relaxed);
        if std::mem::take(&mut self.complained) {
            tracing::info!(dir = %self.options.dir.display(), "the audit trail is written again");
        }
    }
}

/// The newest checkpoint among `lines` that carries a witness signature, as it travels
/// (§12.3a): what this host's callbacks carry until it signs the next.
fn latest_checkpoint(lines: &[u8]) -> Option<Witnessed> {
    lines.rsplit(|b| *b == b'\n').find_map(|line| {
        if !line.windows(12).any(|w| w == b"\"checkpoint\"") {
            return None;
        }
        let v: serde_json::Value = serde_json::from_slice(line).ok()?;
        (v["event"] == "checkpoint").then_some(())?;
        let w = Witnessed {
            count: v["count"].as_u64()?,
            head: v["head"].as_str()?.to_owned(),
            at: v["at"].as_u64()?,
            witness: v["witness"].as_str()?.to_owned(),
        };
        // What goes on the wire keeps to its grammar, whatever the file holds.
        Witnessed::parse(&w.header())
    })
}

/// The first `len` bytes of `path`: what this writer wrote there.
fn read_prefix(path: &Path, len: u64) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut bytes = Vec::with_capacity(usize::try_from(len).unwrap_or(0) + 256);
    crate::fsx::open_regular(path)?
        .take(len)
        .read_to_end(&mut bytes)?;
    if (bytes.len() as u64) < len {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "the file is shorter than what was written to it",
        ));
    }
    Ok(bytes)
}

/// A file of the trail, bounded: a file larger than the writer ever makes (its limit and
/// a last burst) is not read whole.
fn read_file(path: &Path, max_file_bytes: u64) -> std::io::Result<Vec<u8>> {
    crate::fsx::read_regular(path, max_file_bytes.saturating_mul(4).max(64 << 20))
}

fn sync_dir(dir: &Path) {
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
}
