//! The provider side (§6.1, §7, §9): durable entries, one worker per async capability
//! that runs the handler over all active entries, and callbacks to consumers.

pub mod callbacks;
pub mod gc;
pub mod renewals;
pub mod sealing;
mod send;
pub mod state;
pub mod trigger;
mod worker;

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use fort_core::names::{entry_key, NeedKey};
use fort_core::store::{PersistError, Store};
use fort_core::wire::unix_now;
use serde::Serialize;
use serde_json::Value;
use tokio::sync::{oneshot, Notify};

use crate::app::App;
pub use state::{Entry, Notice};

/// Why an entry was not stored.
#[derive(Debug, thiserror::Error)]
pub enum UpsertError {
    #[error(transparent)]
    Persist(#[from] PersistError),
    #[error("the caller already holds {0} entries of this capability")]
    Quota(usize),
}

/// Why a handler run happened (`FORT_TRIGGER`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Trigger {
    Request,
    Initialize,
    Systemd,
    Gc,
    Manual,
    /// The previous run asked for another (`$fort_rerun_after`, §11.9).
    Rerun,
}

impl Trigger {
    pub fn as_str(self) -> &'static str {
        match self {
            Trigger::Request => "request",
            Trigger::Initialize => "initialize",
            Trigger::Systemd => "systemd",
            Trigger::Gc => "gc",
            Trigger::Manual => "manual",
            Trigger::Rerun => "rerun",
        }
    }
}

/// What `status` shows of the provider side. Fields in name order, as the document has
/// always had them; serialised straight into the reply.
#[derive(Debug, Serialize)]
pub struct ProviderSummary {
    pub capabilities: std::collections::BTreeMap<String, CapabilitySummary>,
    pub entries: usize,
    pub state_bytes: u64,
    pub state_writes: u64,
}

/// One capability in [`ProviderSummary`].
#[derive(Debug, Default, Serialize)]
pub struct CapabilitySummary {
    pub entries: usize,
    pub handler_runs: u64,
    pub last_run: Option<RunRecord>,
    pub undelivered: usize,
}

/// The outcome of one handler run, kept for `status`.
#[derive(Debug, Clone, Serialize)]
pub struct RunRecord {
    pub at: u64,
    pub trigger: Trigger,
    pub duration_ms: u64,
    pub ok: bool,
    /// Short reason on failure (`exit_nonzero`, `timeout`, `not_an_object`, …).
    pub error: Option<String>,
    /// What failed, for the operator who asked for the run (`trigger`): how the handler
    /// ended and the last line it wrote on stderr, one printable line of at most 300
    /// characters. Never in `status`, which every known caller may read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    pub entries: usize,
    pub callbacks: usize,
}

/// Work waiting for the next run of one capability's worker. Which requesters are owed
/// a callback is not here but on each entry (`awaiting_response`), so it survives a crash
/// and is not counted twice when a run already saw the entry.
#[derive(Default)]
struct Pending {
    /// The strongest reason queued (a request beats a gc run).
    trigger: Option<Trigger>,
    callback_all: bool,
    force: bool,
    /// Entries whose cached response alone is left out of the next run's input.
    force_entries: std::collections::BTreeSet<String>,
    waiters: Vec<oneshot::Sender<RunRecord>>,
}

#[derive(Default)]
struct WorkerSlot {
    pending: Mutex<Pending>,
    wake: Notify,
    /// When the run a handler asked for (`$fort_rerun_after`) is due; only the earliest
    /// asked for is kept, so a handler asking on every run keeps one timer, not a pile.
    rerun_at: Mutex<Option<tokio::time::Instant>>,
}

#[derive(Default)]
struct CapabilityStats {
    runs: u64,
    last: Option<RunRecord>,
}

pub struct Provider {
    pub store: Store<Entry>,
    workers: Mutex<HashMap<String, Arc<WorkerSlot>>>,
    stats: Mutex<HashMap<String, CapabilityStats>>,
    pub(crate) deliveries: callbacks::Deliveries,
    pub(crate) renewals: renewals::Renewals,
}

impl Provider {
    pub fn new(store: Store<Entry>, callback_concurrency: usize, per_consumer: usize) -> Provider {
        Provider {
            store,
            workers: Mutex::new(HashMap::new()),
            stats: Mutex::new(HashMap::new()),
            deliveries: callbacks::Deliveries::new(callback_concurrency, per_consumer),
            renewals: renewals::Renewals::new(crate::config::defaults::renew_interval()),
        }
    }

    /// When the response `key` holds expires, as its consumer reads it (§11.4).
    fn held_expiry(&self, key: &str) -> Option<u64> {
        let response = self
            .store
            .read(|m| m.get(key).and_then(|e| e.response.clone()))?;
        fort_fulfill::expiry::expiry(&fort_core::wire::payload_bytes_raw(&response))
    }

    /// The least time between two renewals of one entry (`renew_interval`).
    pub fn with_renew_interval(mut self, interval: std::time::Duration) -> Provider {
        self.renewals = renewals::Renewals::new(interval);
        self
    }

    /// Stores (or refreshes) `origin:need` durably, then queues a run. Returns once the
    /// entry is on disk: the 202 may be sent. With `quota`, `origin` may hold at most that
    /// many entries of this capability; a new one past it is refused and nothing stored.
    pub async fn upsert(
        &self,
        app: &Arc<App>,
        origin: &str,
        need: &NeedKey,
        request: Value,
        renew: bool,
        quota: Option<usize>,
    ) -> Result<Option<Notice>, UpsertError> {
        let key = entry_key(origin, need);
        let request = state::raw(&request);
        // Renewed too recently, and not yet due: stored as a plain request; the consumer
        // asks again.
        let renew = renew
            && (self
                .renewals
                .allows(&key, self.held_expiry(&key), unix_now())
                || {
                    app.metrics
                        .renewals_held
                        .inc(&[("capability", need.kind())]);
                    false
                });
        let prefix = format!("{origin}:{}/", need.kind());
        let now = unix_now();
        let mut verdict = None;
        let mut stored = false;
        let (admitted, ticket) = self.store.change(|c| {
            let existing = c.get(&key).cloned();
            if existing.is_none() && quota.is_some_and(|q| c.count_prefix(&prefix) >= q) {
                return false;
            }
            // The handler's verdict on this very request, for the answer (§11.9).
            verdict = existing
                .as_ref()
                .filter(|e| e.request.get() == request.get())
                .and_then(|e| e.notice.clone());
            // Asked again for what it already awaits: nothing to write, nothing to run
            // that is not already queued. (A caller repeating itself costs no fsyncs.)
            if existing.as_ref().is_some_and(|e| {
                e.awaiting_response
                    && e.request.get() == request.get()
                    && (e.renew || !renew)
                    && e.absent_since.is_none()
            }) {
                return true;
            }
            let mut entry = existing.unwrap_or_else(|| Entry {
                request: request.clone(),
                response: None,
                response_hash: None,
                created_at: now,
                requested_at: now,
                absent_since: None,
                awaiting_response: true,
                delivery: Default::default(),
                renew: false,
                notice: None,
            });
            entry.request = request.clone();
            entry.requested_at = now;
            entry.absent_since = None;
            entry.awaiting_response = true;
            entry.renew |= renew;
            c.put(key.clone(), entry);
            stored = true;
            true
        })?;
        if !admitted {
            return Err(UpsertError::Quota(quota.unwrap_or(0)));
        }
        self.store.wait(ticket).await?;
        if stored {
            let mut event = fort_core::audit::Event::caused(fort_core::audit::CausedKind::Accepted)
                .caller(origin)
                .entry(&key)
                .request(request);
            if renew {
                event = event.detail(serde_json::json!({"renew": true}));
            }
            app.audit.record_caused_by(origin, event);
        }
        drop(self.enqueue(app, need.kind(), Trigger::Request, false, false));
        Ok(verdict)
    }

    /// Drops `origin:need` at once, as a GC sweep would, and lets the handler clean up.
    pub async fn release(
        &self,
        app: &Arc<App>,
        origin: &str,
        need: &NeedKey,
    ) -> Result<bool, PersistError> {
        let key = entry_key(origin, need);
        let (removed, held) = self
            .store
            .change_durable(|c| {
                let held = c.get(&key).and_then(Entry::current_hash);
                (c.remove(&key), held)
            })
            .await?;
        if removed {
            tracing::info!(entry = %key, "entry released");
            app.audit.record_caused_by(
                origin,
                fort_core::audit::Event::caused(fort_core::audit::CausedKind::Released)
                    .caller(origin)
                    .entry(&key)
                    .previous(held),
            );
            drop(self.enqueue(app, need.kind(), Trigger::Gc, false, false));
        }
        Ok(removed)
    }

    /// Queues a run of `capability`'s handler and returns a receiver for its outcome.
    pub fn enqueue(
        &self,
        app: &Arc<App>,
        capability: &str,
        trigger: Trigger,
        callback_all: bool,
        force: bool,
    ) -> oneshot::Receiver<RunRecord> {
        self.enqueue_forced(app, capability, trigger, callback_all, force, None)
    }

    /// As [`Provider::enqueue`], and with `force_entry`, that entry's cached response
    /// is left out of the run's input (the others are passed as usual).
    pub(crate) fn enqueue_forced(
        &self,
        app: &Arc<App>,
        capability: &str,
        trigger: Trigger,
        callback_all: bool,
        force: bool,
        force_entry: Option<String>,
    ) -> oneshot::Receiver<RunRecord> {
        let slot = self.slot(app, capability);
        let (tx, rx) = oneshot::channel();
        {
            let mut p = slot.pending.lock();
            p.trigger = Some(match (p.trigger, trigger) {
                (Some(Trigger::Request), _) | (_, Trigger::Request) => Trigger::Request,
                (Some(old), Trigger::Gc | Trigger::Rerun) => old,
                (_, new) => new,
            });
            p.callback_all |= callback_all;
            p.force |= force;
            p.force_entries.extend(force_entry);
            p.waiters.push(tx);
        }
        slot.wake.notify_one();
        rx
    }

    fn slot(&self, app: &Arc<App>, capability: &str) -> Arc<WorkerSlot> {
        let mut workers = self.workers.lock();
        if let Some(slot) = workers.get(capability) {
            return slot.clone();
        }
        let slot = Arc::new(WorkerSlot::default());
        workers.insert(capability.to_owned(), slot.clone());
        let worker = worker::Worker {
            app: app.clone(),
            capability: capability.to_owned(),
            slot: slot.clone(),
        };
        app.tasks.spawn(worker.run());
        slot
    }

    fn record_run(&self, capability: &str, record: RunRecord) {
        let mut stats = self.stats.lock();
        let s = stats.entry(capability.to_owned()).or_default();
        s.runs += 1;
        s.last = Some(RunRecord {
            reason: None,
            ..record
        });
    }

    /// Entries per capability (no delivery bookkeeping looked at).
    pub fn entry_counts(&self) -> std::collections::BTreeMap<String, usize> {
        let mut out = std::collections::BTreeMap::new();
        self.store.read(|entries| {
            for key in entries.keys() {
                if let Some(cap) = state::capability_of(key) {
                    *out.entry(cap.to_owned()).or_insert(0) += 1;
                }
            }
        });
        out
    }

    /// Every entry as the status document lists it, by entry key (docs/protocol.md §5a).
    /// `is_host` tells host origins from principals.
    pub fn entries(&self, is_host: impl Fn(&str) -> bool) -> serde_json::Map<String, Value> {
        self.store.read(|entries| {
            entries
                .iter()
                .map(|(key, entry)| {
                    let principal = !key.split_once(':').is_some_and(|(o, _)| is_host(o));
                    (key.clone(), entry.view(key, principal))
                })
                .collect()
        })
    }

    /// Per capability: entries, undelivered, runs, last run.
    /// `is_host` tells host origins from principals, which get no callbacks and so are
    /// never counted as undelivered.
    pub fn summary(&self, is_host: impl Fn(&str) -> bool) -> ProviderSummary {
        let mut capabilities: std::collections::BTreeMap<String, CapabilitySummary> =
            Default::default();
        let entries = self.store.read(|entries| {
            for (key, entry) in entries {
                if let Some(cap) = state::capability_of(key) {
                    let c = match capabilities.get_mut(cap) {
                        Some(c) => c,
                        None => capabilities.entry(cap.to_owned()).or_default(),
                    };
                    c.entries += 1;
                    let host = key.split_once(':').is_some_and(|(o, _)| is_host(o));
                    c.undelivered += (host && entry.undelivered()) as usize;
                }
            }
            entries.len()
        });
        for (cap, s) in self.stats.lock().iter() {
            let c = capabilities.entry(cap.clone()).or_default();
            c.handler_runs = s.runs;
            c.last_run = s.last.clone();
        }
        ProviderSummary {
            capabilities,
            entries,
            state_bytes: self.store.disk_bytes(),
            state_writes: self.store.writes(),
        }
    }
}
