//! The audit trail (docs/protocol.md §12): what happened on this host, as JSON lines each
//! carrying the hash of the one before, with checkpoints signed by the host key (SSHSIG,
//! namespace `fort-audit`) that `ssh-keygen -Y verify` checks. Records are handed to one
//! writer thread through a bounded queue, so no request waits on the disk.

mod forward;
mod index;
mod kinds;
mod line;
mod read;
mod witness;
mod writer;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hmac::{Hmac, Mac};
use parking_lot::{Condvar, Mutex};
use serde::Serialize;
use serde_json::value::RawValue;
use serde_json::Value;
use sha2::Sha256;

use crate::sign::Signer;

pub use forward::Target as SyslogTarget;
pub use index::{index_line, Index, IndexEntry, INDEX_FILE};
pub use kinds::{
    Budget, Caused, CausedKind, Own, OwnKind, ACCEPTED_BUDGET, CALLBACK_BUDGET, DENIED_BUDGET,
    ENTRY_BUDGET, OPERATOR_BUDGET, WITNESSED_BUDGET,
};
pub use read::{files, read_lines, short_hash, signed_lines, verify, AuditLine, Problem, Verified};
pub use witness::{
    hold, witness_line, Held, Witnessed, HEADER as CHECKPOINT_HEADER,
    HEADER_MAX as CHECKPOINT_HEADER_MAX,
};

/// The SSHSIG namespace of checkpoints: a checkpoint can never pass for a request.
pub const NAMESPACE: &str = "fort-audit";

/// The `prev` of the first record of a chain.
pub const GENESIS: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// The line a checkpoint signs after the records it covers (§12).
pub fn checkpoint_trailer(host: &str, count: u64, head: &str, at: u64) -> String {
    format!("fort-audit-checkpoint {host} {count} {head} {at}\n")
}

/// One thing that happened, as its record names it. Never a secret: payloads and
/// requests appear as hashes only (a request as a keyed hash, see [`Event::request`]).
/// A record's line writes these fields in this order (`line.rs`, whose test holds it to
/// this derived `Serialize`): a field added here is added there too. `C` says who can
/// cause it: [`Own`] or [`Caused`].
#[derive(Debug, Clone, Default, Serialize)]
pub struct Event<C = Own> {
    pub event: &'static str,
    /// Who asked: the verified origin of a request, an operator, `local` (admin socket).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub caller: Option<String>,
    /// The caller's key, as `ssh-keygen -l` prints it (`SHA256:…`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// Provider side: the host (or principal) an entry belongs to.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub consumer: Option<String>,
    /// Consumer side: the host a need is from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub need: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub capability: Option<String>,
    /// HMAC-SHA-256 of the request's compact JSON, keyed from the host key.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request: Option<String>,
    /// SHA-256 of the payload bytes (§7): the same on provider and consumer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub response: Option<String>,
    /// The response held before (a rotation or renewal replaces it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub previous: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<u64>,
    /// One printable line: why (a refusal, a failure).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The HTTP status an operator call or a refused request was answered with.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// What else the event names (an operator call's parameters, a release's version).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<Value>,
    /// A checkpoint's count, head and signature.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub count: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub head: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub signature: Option<String>,
    /// A checkpoint's signature of its own line alone, which travels (§12.3a).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub witness: Option<String>,
    /// A checkpoint's link into the checkpoint index (§12.3b): the hash of the index's
    /// line before its own.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<String>,
    /// The request, hashed by the writer (off the request's path) into `request`.
    #[serde(skip)]
    pub request_text: Option<Arc<RawValue>>,
    /// A handler run's `trigger` and `force`, written as the `detail` object
    /// `{"force":…,"trigger":…}` (see [`Event::run`]) when `detail` is not set.
    #[serde(skip)]
    pub run: Option<(&'static str, bool)>,
    /// The kind of a [`Caused`] event, whose budget it is recorded within.
    #[serde(skip)]
    caused: Option<CausedKind>,
    #[serde(skip)]
    cause: std::marker::PhantomData<C>,
}

impl Event<Own> {
    /// An event of this host's own.
    pub fn own(kind: OwnKind) -> Event<Own> {
        Event {
            event: kind.as_str(),
            ..Event::default()
        }
    }
}

impl Event<Own> {
    /// Any event by its name, for tests of how records are written.
    #[cfg(test)]
    pub(crate) fn named(event: &'static str) -> Event<Own> {
        Event {
            event,
            ..Event::default()
        }
    }
}

impl Event<Caused> {
    /// An event a remote party can cause: recorded with [`Audit::record_caused_by`].
    pub fn caused(kind: CausedKind) -> Event<Caused> {
        Event {
            event: kind.as_str(),
            caused: Some(kind),
            ..Event::default()
        }
    }

    /// Admitted within its origin's budget: from here on it is written as any record.
    fn admitted(self) -> Event<Own> {
        Event {
            event: self.event,
            caller: self.caller,
            key: self.key,
            consumer: self.consumer,
            provider: self.provider,
            need: self.need,
            capability: self.capability,
            request: self.request,
            response: self.response,
            previous: self.previous,
            expires_at: self.expires_at,
            reason: self.reason,
            status: self.status,
            detail: self.detail,
            count: self.count,
            head: self.head,
            signature: self.signature,
            witness: self.witness,
            index: self.index,
            request_text: self.request_text,
            run: self.run,
            caused: None,
            cause: std::marker::PhantomData,
        }
    }
}

impl<C> Event<C> {
    pub fn caller(mut self, v: impl Into<String>) -> Self {
        self.caller = Some(v.into());
        self
    }
    pub fn key(mut self, v: Option<String>) -> Self {
        self.key = v;
        self
    }
    pub fn consumer(mut self, v: impl Into<String>) -> Self {
        self.consumer = Some(v.into());
        self
    }
    pub fn provider(mut self, v: impl Into<String>) -> Self {
        self.provider = Some(v.into());
        self
    }
    pub fn need(mut self, v: impl Into<String>) -> Self {
        self.need = Some(v.into());
        self
    }
    pub fn capability(mut self, v: impl Into<String>) -> Self {
        self.capability = Some(v.into());
        self
    }
    /// The request, kept as a keyed hash.
    pub fn request(mut self, v: Arc<RawValue>) -> Self {
        self.request_text = Some(v);
        self
    }
    pub fn response(mut self, v: Option<String>) -> Self {
        self.response = v;
        self
    }
    pub fn previous(mut self, v: Option<String>) -> Self {
        self.previous = v;
        self
    }
    pub fn expires_at(mut self, v: Option<u64>) -> Self {
        self.expires_at = v;
        self
    }
    pub fn reason(mut self, v: impl AsRef<str>) -> Self {
        self.reason = Some(crate::text::printable(v.as_ref(), 300));
        self
    }
    pub fn status(mut self, v: u16) -> Self {
        self.status = Some(v);
        self
    }
    pub fn detail(mut self, v: Value) -> Self {
        self.detail = Some(v);
        self
    }
    /// The `detail` of a record a handler run made: what triggered it and whether it was
    /// forced. The same bytes as `detail(json!({"trigger": …, "force": …}))`, without
    /// building a map for every entry a run answers.
    pub fn run(mut self, trigger: &'static str, force: bool) -> Self {
        self.run = Some((trigger, force));
        self
    }
    /// `<consumer>:<type>/<id>` split into its consumer and need.
    pub fn entry(self, key: &str) -> Self {
        match key.split_once(':') {
            Some((origin, need)) => self.consumer(origin).need(need),
            None => self.need(key),
        }
    }
}

/// How the trail is kept (`[audit]` in agent.toml).
#[derive(Debug, Clone)]
pub struct Options {
    pub dir: PathBuf,
    pub host: String,
    /// Largest file before the next is begun.
    pub max_file_bytes: u64,
    /// Files kept; the oldest goes when one more is begun.
    pub max_files: usize,
    pub checkpoint_interval: Duration,
    /// Records waiting for the writer; past it they are counted as lost (and the count
    /// recorded) instead of holding up the agent.
    pub queue: usize,
    /// Each record also goes to the agent's log (the journal, under systemd).
    pub journal: bool,
    /// Each record also goes to this syslog server.
    pub syslog: Option<SyslogTarget>,
}

/// Counts for the status document and metrics.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Stats {
    pub records: u64,
    pub lost: u64,
    pub checkpoints: u64,
    pub writable: bool,
    /// Records the remote syslog copy could not send (`None`: no copy configured).
    pub not_copied: Option<u64>,
}

#[derive(Default)]
struct Queue {
    events: Vec<(u64, Event)>,
    lost: u64,
    stopping: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    wake: Condvar,
    capacity: usize,
    writable: AtomicBool,
    records: AtomicU64,
    lost: AtomicU64,
    checkpoints: AtomicU64,
    /// Records the syslog copy dropped (a full queue, a server that did not answer).
    not_copied: Arc<AtomicU64>,
    copies: bool,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Records a remote caller's requests cause, per caller and kind: see [`Budget`].
    budgets: Mutex<std::collections::HashMap<(String, CausedKind), Bucket>>,
    /// This host's latest checkpoint, as its callbacks carry it.
    latest: Mutex<Option<Witnessed>>,
    /// Per provider, the `(count, head)` last recorded as witnessed.
    witnessed: Mutex<std::collections::HashMap<String, (u64, String)>>,
}

/// Callers whose budgets are tracked at once; more (a registry of that many hosts and
/// principals) start afresh, which costs the trail nothing it would have kept.
const BUDGETS_TRACKED: usize = 16_384;

#[derive(Debug)]
struct Bucket {
    tokens: f64,
    last: std::time::Instant,
    suppressed: u64,
}

/// The handle every part of the agent records through; cheap to clone. A disabled one
/// records nothing.
#[derive(Clone, Default)]
pub struct Audit {
    shared: Option<Arc<Shared>>,
}

impl std::fmt::Debug for Audit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Audit")
            .field("enabled", &self.enabled())
            .finish()
    }
}

/// A queue this long wakes the writer at once instead of at its next tick.
const WAKE_AT: usize = 1024;

impl Audit {
    /// No trail: every call is a no-op.
    pub fn disabled() -> Audit {
        Audit { shared: None }
    }

    /// Opens the trail in `options.dir` (made 0700 if missing), continues its chain and
    /// starts the writer thread. A directory that cannot be made or read is not fatal:
    /// the trail reports itself unwritable and keeps trying.
    pub fn open(options: Options, signer: Signer) -> Audit {
        let copies = options.syslog.is_some();
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue::default()),
            wake: Condvar::new(),
            capacity: options.queue.max(16),
            writable: AtomicBool::new(false),
            records: AtomicU64::new(0),
            lost: AtomicU64::new(0),
            checkpoints: AtomicU64::new(0),
            not_copied: Arc::new(AtomicU64::new(0)),
            copies,
            thread: Mutex::new(None),
            budgets: Mutex::new(std::collections::HashMap::new()),
            latest: Mutex::new(None),
            witnessed: Mutex::new(std::collections::HashMap::new()),
        });
        let writer = writer::Writer::open(options, signer, shared.clone());
        let handle = std::thread::Builder::new()
            .name("fort-audit".into())
            .spawn(move || writer.run())
            .expect("a thread for the audit writer");
        *shared.thread.lock() = Some(handle);
        Audit {
            shared: Some(shared),
        }
    }

    pub fn enabled(&self) -> bool {
        self.shared.is_some()
    }

    /// Hands `event`, one of this host's own, to the writer, stamped now. Never waits
    /// for the disk; a full queue counts it as lost.
    pub fn record(&self, event: Event<Own>) {
        let Some(s) = &self.shared else { return };
        let at = crate::wire::unix_now();
        let mut q = s.queue.lock();
        if q.stopping {
            return;
        }
        if q.events.len() >= s.capacity {
            q.lost += 1;
            s.lost.fetch_add(1, Ordering::Relaxed);
            return;
        }
        q.events.push((at, event));
        if q.events.len() == WAKE_AT {
            s.wake.notify_one();
        }
    }

    /// [`Audit::record`] for a record `caller` caused (its request, its callback, its
    /// call; for a provider's entry, the entry's consumer), within `caller`'s budget for
    /// records of its kind. Whether the record was queued (not past the budget).
    pub fn record_caused_by(&self, caller: &str, event: Event<Caused>) -> bool {
        let Some(s) = &self.shared else { return false };
        let now = std::time::Instant::now();
        let caused = event.caused.unwrap_or(CausedKind::Denied);
        let budget = caused.budget();
        let kind = caused.as_str();
        let suppressed = {
            let mut budgets = s.budgets.lock();
            if budgets.len() >= BUDGETS_TRACKED
                && !budgets.contains_key(&(caller.to_owned(), caused))
            {
                budgets.clear();
            }
            let bucket = budgets
                .entry((caller.to_owned(), caused))
                .or_insert(Bucket {
                    tokens: f64::from(budget.burst),
                    last: now,
                    suppressed: 0,
                });
            let refill =
                now.duration_since(bucket.last).as_secs_f64() * f64::from(budget.per_minute) / 60.0;
            bucket.tokens = (bucket.tokens + refill).min(f64::from(budget.burst));
            bucket.last = now;
            if bucket.tokens < 1.0 {
                bucket.suppressed += 1;
                return false;
            }
            bucket.tokens -= 1.0;
            std::mem::take(&mut bucket.suppressed)
        };
        if suppressed > 0 {
            self.record(
                Event::own(OwnKind::Suppressed)
                    .caller(caller)
                    .detail(serde_json::json!({"event": kind, "records": suppressed})),
            );
        }
        self.record(event.admitted());
        true
    }

    /// [`Audit::record_caused_by`] for a record about a provider's entry
    /// (`<consumer>:<type>/<id>`), within its consumer's budget: whatever made the record
    /// (its request, a run, GC, its acknowledgement), the consumer's own records are what
    /// it can fill the trail with.
    pub fn record_for_entry(&self, entry: &str, event: Event<Caused>) -> bool {
        let origin = entry.split_once(':').map_or(entry, |(origin, _)| origin);
        self.record_caused_by(origin, event)
    }

    /// This host's latest signed checkpoint, for the header its callbacks carry
    /// (§12.3a); `None` before the first.
    pub fn latest_checkpoint(&self) -> Option<String> {
        self.shared
            .as_ref()
            .and_then(|s| s.latest.lock().as_ref().map(Witnessed::header))
    }

    /// A checkpoint `provider` sent with a callback (§12.3a): recorded as `witnessed` when
    /// it is well formed, verifies with one of `keys`, and is newer than the last one
    /// recorded for that provider (a higher count) or contradicts it (the same count with
    /// another head); within [`WITNESSED_BUDGET`] per provider. An older one sent again
    /// records nothing, so replaying them cannot spend the provider's budget.
    pub fn witness(&self, provider: &str, keys: &[ssh_key::PublicKey], header: &str) {
        let Some(s) = &self.shared else { return };
        let Some(w) = Witnessed::parse(header) else {
            tracing::debug!(
                provider,
                "an audit checkpoint header off its grammar; not recorded"
            );
            return;
        };
        let wanted = |last: Option<&(u64, String)>| {
            last.is_none_or(|(count, head)| {
                w.count > *count || (w.count == *count && w.head != *head)
            })
        };
        if !wanted(s.witnessed.lock().get(provider)) {
            return;
        }
        // Verified off the lock; debug only: a provider sending bad ones on every callback
        // must not fill the log.
        if !w.verifies(provider, keys) {
            tracing::debug!(
                provider,
                count = w.count,
                "an audit checkpoint that does not verify with the provider's key; not recorded"
            );
            return;
        }
        let mut last = s.witnessed.lock();
        if !wanted(last.get(provider)) {
            return;
        }
        let mut event = Event::caused(CausedKind::Witnessed)
            .provider(provider)
            .detail(serde_json::json!({ "at": w.at }));
        event.count = Some(w.count);
        event.head = Some(w.head.clone());
        event.signature = Some(w.witness.clone());
        // Marked as seen only once it is recorded: one past the budget is taken later.
        if self.record_caused_by(provider, event) {
            if last.len() >= BUDGETS_TRACKED && !last.contains_key(provider) {
                last.clear();
            }
            last.insert(provider.to_owned(), (w.count, w.head));
        }
    }

    /// Whether the last write (or probe) of the trail succeeded. A disabled trail is
    /// never unwritable.
    pub fn writable(&self) -> bool {
        self.shared
            .as_ref()
            .is_none_or(|s| s.writable.load(Ordering::Relaxed))
    }

    pub fn stats(&self) -> Option<Stats> {
        self.shared.as_ref().map(|s| Stats {
            records: s.records.load(Ordering::Relaxed),
            lost: s.lost.load(Ordering::Relaxed),
            checkpoints: s.checkpoints.load(Ordering::Relaxed),
            writable: s.writable.load(Ordering::Relaxed),
            not_copied: s.copies.then(|| s.not_copied.load(Ordering::Relaxed)),
        })
    }

    /// Writes what is queued, a last checkpoint, syncs and stops the writer; gives the
    /// syslog copy a moment to send what it still holds. Blocks.
    pub fn close(&self) {
        let Some(s) = &self.shared else { return };
        s.queue.lock().stopping = true;
        s.wake.notify_one();
        let handle = s.thread.lock().take();
        if let Some(h) = handle {
            let _ = h.join();
        }
    }
}

/// The key of the keyed hashes in records: derived from the host key (HKDF-SHA-256 of
/// its ed25519 seed), so it needs no file of its own and only who holds the host key can
/// test a guess.
pub fn hash_key(signer: &Signer) -> [u8; 32] {
    let seed = signer.ed25519_seed().unwrap_or_default();
    let mut key = [0u8; 32];
    hkdf::Hkdf::<Sha256>::new(Some(HASH_KEY_SALT), &seed)
        .expand(HASH_KEY_INFO, &mut key)
        .expect("32 bytes is a valid HKDF-SHA-256 output length");
    key
}

/// HKDF's salt and info for [`hash_key`] (docs/protocol.md §12.2).
const HASH_KEY_SALT: &[u8] = b"fort-audit";
const HASH_KEY_INFO: &[u8] = b"fort-audit keyed hash";

/// HMAC-SHA-256 under a [`hash_key`], keyed once: each hash starts from a copy of the
/// keyed state instead of hashing the key's pads again.
#[derive(Clone)]
pub struct KeyedHash(Hmac<Sha256>);

impl KeyedHash {
    pub fn new(key: &[u8; 32]) -> KeyedHash {
        KeyedHash(Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes any key length"))
    }

    /// HMAC-SHA-256 of `bytes`, lower-case hex.
    pub fn of(&self, bytes: &[u8]) -> String {
        let mut mac = self.0.clone();
        mac.update(bytes);
        crate::canonical::hex_lower(&mac.finalize().into_bytes())
    }
}

/// `SHA256:<base64>` of an OpenSSH public key, as `ssh-keygen -l` prints it.
pub fn fingerprint(key: &ssh_key::PublicKey) -> String {
    key.fingerprint(ssh_key::HashAlg::Sha256).to_string()
}

#[cfg(test)]
mod tests;
