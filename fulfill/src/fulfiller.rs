//! The fulfiller: asks providers for this host's needs, nags on a timer, backs off on
//! transport failures and honours `Retry-After`, holds needs until what they refer to is
//! satisfied, renews payloads before they expire, and turns callbacks into satisfaction
//! (asking lives in `request.rs` and `batch.rs`, the payload side in `deliver.rs`).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use parking_lot::Mutex;
use std::time::Duration;

use fort_core::canonical::sha256_hex;
use fort_core::client::{SignedClient, Target};
use fort_core::names::NeedKey;
use fort_core::process::{run, RunSpec};
use fort_core::schema::refs::{extract, resolve};
use fort_core::schema::{NeedSpec, Needs, Registry};
use fort_core::store::{PersistError, Store};
use fort_core::wire::{unix_now, AsyncBody};
use tokio::sync::{Notify, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::batch::Batcher;
use crate::schedule::{jittered, Due};
use crate::state::{NeedState, Phase};
use crate::units::Units;

#[derive(Debug, Clone)]
pub struct FulfillOptions {
    /// This host's name (`FORT_HOST` for handlers).
    pub host: String,
    pub handler_timeout: Duration,
    pub per_provider_concurrency: usize,
    pub backoff: Duration,
    pub request_timeout: Duration,
    /// Extra variables every handler and check gets (`handler_environment`).
    pub handler_environment: Vec<(String, String)>,
    /// The program that restarts and reloads units for delivered files.
    pub systemctl: std::path::PathBuf,
    /// Send requests that come due together in batches (§11.8).
    pub batches: bool,
}

/// Batched callbacks with files or a handler applied at once, across all batches: as
/// many as two providers' shares of single callbacks (`[callbacks] per_consumer`) bring.
const BATCH_APPLIERS: usize = 8;

/// How much of a failed handler's stderr goes to the log (never to the state).
pub(crate) const STDERR_IN_LOG: usize = 2048;

impl View {
    pub(crate) fn failures_mut(&mut self, key: &NeedKey) -> &mut u32 {
        self.failures.entry(key.clone()).or_insert(0)
    }

    pub(crate) fn clear_failures(&mut self, key: &NeedKey) {
        self.failures.remove(key);
    }

    pub(crate) fn is_unsent(&self, key: &NeedKey) -> bool {
        self.unsent.contains(key)
    }
}

#[derive(Default)]
pub(crate) struct View {
    pub needs: Arc<Needs>,
    pub registry: Arc<Registry>,
    pub due: Due,
    in_flight: HashSet<NeedKey>,
    /// Came due while in flight: attended again once the current attendance ends.
    deferred: HashSet<NeedKey>,
    pub(crate) failures: HashMap<NeedKey, u32>,
    /// Needs whose current request (new, or changed by a reload) has not been sent yet.
    /// A reply or callback arriving meanwhile may answer an older request: it must not
    /// stop the current one from going out at once.
    pub(crate) unsent: HashSet<NeedKey>,
    /// need → the needs that refer to it or come after it.
    dependents: HashMap<NeedKey, Vec<NeedKey>>,
    /// Needs whose payload other needs' requests are built from (it is kept).
    pub referenced: HashSet<NeedKey>,
}

pub(crate) struct Inner {
    pub opts: FulfillOptions,
    pub store: Store<NeedState>,
    pub(crate) client: SignedClient,
    pub view: Mutex<View>,
    wake: Notify,
    pub need_locks: Mutex<HashMap<NeedKey, Arc<tokio::sync::Mutex<()>>>>,
    pub(crate) providers: Mutex<HashMap<String, Arc<Semaphore>>>,
    pub(crate) batcher: Arc<Batcher>,
    /// Batched callbacks that write files or run a handler, applied at once (all batches
    /// together): a batch must not turn one request slot into dozens of processes.
    batch_appliers: Semaphore,
    pub tasks: TaskTracker,
    shutdown: CancellationToken,
    pub spawned: std::sync::atomic::AtomicU64,
    pub units: Units,
    started: std::sync::atomic::AtomicBool,
}

#[derive(Clone)]
pub struct Fulfiller {
    pub(crate) inner: Arc<Inner>,
}

/// A callback or rpc payload could not be recorded.
#[derive(Debug, thiserror::Error)]
pub enum DeliverError {
    #[error("no such need")]
    UnknownNeed,
    #[error("the need's handler is still busy with an earlier payload")]
    Busy,
    #[error(transparent)]
    Persist(#[from] PersistError),
}

/// What identifies a need's declaration: a change means asking again from scratch.
pub(crate) fn declaration_hash(spec: &NeedSpec) -> String {
    let declared = serde_json::json!({
        "from": spec.from,
        "request": spec.request,
        "files": spec.files,
    });
    sha256_hex(&serde_json::to_vec(&declared).expect("declaration serialises"))
}

pub(crate) fn nag(spec: &NeedSpec) -> Duration {
    Duration::from_secs(spec.nag_seconds)
}

impl Fulfiller {
    pub fn new(
        opts: FulfillOptions,
        store: Store<NeedState>,
        client: SignedClient,
        tasks: TaskTracker,
        shutdown: CancellationToken,
    ) -> Fulfiller {
        let units = Units::new(
            opts.systemctl.clone(),
            opts.handler_timeout,
            opts.handler_environment.clone(),
        );
        Fulfiller {
            inner: Arc::new(Inner {
                opts,
                store,
                client,
                view: Mutex::new(View::default()),
                wake: Notify::new(),
                need_locks: Mutex::new(HashMap::new()),
                providers: Mutex::new(HashMap::new()),
                batcher: Default::default(),
                batch_appliers: Semaphore::new(BATCH_APPLIERS),
                tasks,
                shutdown,
                spawned: Default::default(),
                units,
                started: Default::default(),
            }),
        }
    }

    /// Slots for applying batched callbacks that write files or run a handler.
    pub fn batch_appliers(&self) -> &Semaphore {
        &self.inner.batch_appliers
    }

    pub fn store(&self) -> &Store<NeedState> {
        &self.inner.store
    }

    /// Unit restarts, reloads and `systemctl` runs issued for delivered files.
    pub fn unit_counts(&self) -> (u64, u64, u64) {
        self.inner.units.counts()
    }

    /// Processes started by the fulfiller (handlers and checks) since start.
    pub fn processes_spawned(&self) -> u64 {
        self.inner
            .spawned
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Installs a new set of needs (at start and on every reload). New needs, unsatisfied
    /// needs and needs whose declaration changed are asked at once; removed needs are
    /// released at their provider, then their files removed. At start, a satisfied need
    /// whose files are gone (a reboot empties `/run`) is asked again. Returns once the
    /// state is durable.
    pub async fn reload(&self, needs: Needs, registry: Arc<Registry>) -> Result<(), PersistError> {
        let now = unix_now();
        let first = !self
            .inner
            .started
            .swap(true, std::sync::atomic::Ordering::Relaxed);
        let ((removed, fresh), ticket) = self.inner.store.change(|c| {
            let mut removed = Vec::new();
            let mut fresh = Vec::new();
            for key in c.keys() {
                let keep = NeedKey::parse(&key).is_some_and(|k| needs.contains_key(&k));
                if !keep {
                    let st = c.get(&key).cloned().unwrap_or_default();
                    c.remove(&key);
                    removed.push((key, st.from, st.files.into_keys().collect::<Vec<_>>()));
                }
            }
            for (key, spec) in &needs {
                let hash = declaration_hash(spec);
                let mut st = c.get(key.as_str()).cloned().unwrap_or_default();
                if st.request_hash != hash || st.from != spec.from {
                    // Moving to another provider releases the entry at the old one;
                    // files the new declaration no longer names go with it.
                    let stale: Vec<String> = st
                        .files
                        .keys()
                        .filter(|p| !spec.files.iter().any(|f| f.path.to_string_lossy() == **p))
                        .cloned()
                        .collect();
                    if !st.from.is_empty() && st.from != spec.from {
                        removed.push((key.to_string(), st.from.clone(), stale));
                    } else {
                        crate::files::remove_all(&stale);
                    }
                    fresh.push(key.clone());
                    st = NeedState {
                        from: spec.from.clone(),
                        request_hash: hash,
                        since: now,
                        ..Default::default()
                    };
                    c.put(key.to_string(), st);
                } else if first && st.satisfied {
                    if let Some(path) = crate::files::missing(&st.files) {
                        st.satisfied = false;
                        st.satisfied_at = None;
                        st.phase = Phase::Pending;
                        st.since = now;
                        st.last_error = Some(format!("{path} is gone (a reboot?); asking again"));
                        c.put(key.to_string(), st);
                    }
                }
            }
            (removed, fresh)
        })?;
        self.inner.store.wait(ticket).await?;
        let states = self.inner.store.read(|s| s.clone());
        {
            let mut view = self.inner.view.lock();
            let at = Instant::now();
            view.due.clear();
            for (key, spec) in &needs {
                let st = states.get(key.as_str()).cloned().unwrap_or_default();
                if let Some(delay) = next_attendance(spec, &st, now) {
                    view.due.set(key, at + delay);
                }
            }
            view.unsent.retain(|k| needs.contains_key(k));
            view.unsent.extend(fresh);
            view.dependents.clear();
            view.referenced.clear();
            for (key, spec) in &needs {
                for dep in spec.dependencies() {
                    view.dependents.entry(dep).or_default().push(key.clone());
                }
                for r in spec.references() {
                    view.referenced.insert(r.need);
                }
            }
            view.needs = Arc::new(needs);
            view.registry = registry.clone();
        }
        for (key, from, files) in removed {
            let me = self.clone();
            let registry = registry.clone();
            self.inner.tasks.spawn(async move {
                me.release(&key, &from, &registry).await;
                // Declared again meanwhile: the files are the new declaration's.
                let again = NeedKey::parse(&key).is_some_and(|k| me.spec(&k).is_some());
                if !again {
                    crate::files::remove_all(&files);
                }
            });
        }
        self.inner.wake.notify_one();
        Ok(())
    }

    async fn release(&self, key: &str, from: &str, registry: &Registry) {
        let Some(need) = NeedKey::parse(key) else {
            return;
        };
        let Some(peer) = registry.get(from) else {
            tracing::info!(need = %key, from, "need removed; its provider is gone too, nothing to release");
            return;
        };
        let Some(address) = peer.address.as_deref() else {
            return;
        };
        let body = serde_json::to_vec(&AsyncBody {
            need: key.to_owned(),
            request: None,
            release: true,
            renew: false,
        })
        .expect("body serialises");
        let target = Target {
            name: from,
            address,
            keys: &peer.keys,
        };
        let path = format!("/agent/capabilities/{}", need.kind());
        for attempt in 1..=3u32 {
            // Declared again at the same provider (a roll-back) since the removal: the
            // entry is wanted, and a late release would delete it under the consumer.
            if self.spec(&need).is_some_and(|s| s.from == from) {
                tracing::info!(need = %key, from, "need declared again; release cancelled");
                return;
            }
            match self.inner.client.post(&target, &path, body.clone()).await {
                Ok(r) if r.is_success() => {
                    tracing::info!(need = %key, from, "need removed; released at its provider");
                    return;
                }
                Ok(r) => {
                    tracing::warn!(need = %key, from, status = r.status, attempt, "release refused")
                }
                Err(e) => tracing::warn!(need = %key, from, error = %e, attempt, "release failed"),
            }
            tokio::select! {
                _ = tokio::time::sleep(self.inner.opts.backoff * attempt) => {}
                _ = self.inner.shutdown.cancelled() => return,
            }
        }
        tracing::warn!(need = %key, from, "release gave up; the provider's GC will collect the entry");
    }

    /// Sorted keys of the needs declared now (`/agent/needs`).
    pub fn declared(&self) -> Vec<String> {
        let view = self.inner.view.lock();
        view.needs.keys().map(|k| k.to_string()).collect()
    }

    pub fn spec(&self, need: &NeedKey) -> Option<NeedSpec> {
        self.inner.view.lock().needs.get(need).cloned()
    }

    pub(crate) fn state(&self, key: &NeedKey) -> NeedState {
        self.inner
            .store
            .read(|s| s.get(key.as_str()).cloned().unwrap_or_default())
    }

    /// The scheduler loop, and the unit rounds: until shutdown, start whatever is due,
    /// then sleep until the next due time or a wake-up.
    pub async fn run(self) {
        self.inner
            .tasks
            .spawn(self.inner.units.clone().run(self.inner.shutdown.clone()));
        loop {
            let next = self.run_due();
            let sleep = async {
                match next {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = sleep => {}
                _ = self.inner.wake.notified() => {}
                _ = self.inner.shutdown.cancelled() => return,
            }
        }
    }

    /// One scheduler pass: starts every due request or check and returns when the next
    /// one is due. Costs the number of due needs, not of all needs.
    pub fn run_due(&self) -> Option<Instant> {
        let now = Instant::now();
        let mut start = Vec::new();
        let next = {
            let mut view = self.inner.view.lock();
            for key in view.due.take_due(now) {
                if view.in_flight.contains(&key) {
                    view.deferred.insert(key);
                } else {
                    view.in_flight.insert(key.clone());
                    start.push(key);
                }
            }
            view.due.next()
        };
        for key in start {
            let me = self.clone();
            self.inner.tasks.spawn(async move {
                me.attend(&key).await;
                let again = {
                    let mut view = me.inner.view.lock();
                    view.in_flight.remove(&key);
                    view.deferred.remove(&key)
                };
                if again {
                    me.schedule(&key, Some(Duration::ZERO));
                } else {
                    me.inner.wake.notify_one();
                }
            });
        }
        next
    }

    /// Plans the next request or check of `key` in `after` (`None`: nothing planned).
    /// An earlier plan wins: a reload may have made the need due at once meanwhile.
    pub(crate) fn schedule(&self, key: &NeedKey, after: Option<Duration>) {
        let mut view = self.inner.view.lock();
        match after {
            Some(d) => view.due.plan_earliest(key, Instant::now() + d),
            None => view.due.remove(key),
        }
        drop(view);
        self.inner.wake.notify_one();
    }

    /// Plans `key` exactly at `after` from now, replacing any plan.
    pub(crate) fn reschedule(&self, key: &NeedKey, after: Option<Duration>) {
        let mut view = self.inner.view.lock();
        match after {
            Some(d) => view.due.set(key, Instant::now() + d),
            None => view.due.remove(key),
        }
        drop(view);
        self.inner.wake.notify_one();
    }

    /// Wakes the needs that refer to `key` or come after it.
    pub(crate) fn wake_dependents(&self, key: &NeedKey) {
        let dependents = self
            .inner
            .view
            .lock()
            .dependents
            .get(key)
            .cloned()
            .unwrap_or_default();
        for d in dependents {
            self.schedule(&d, Some(Duration::ZERO));
        }
    }

    /// The needs `spec` waits for that are not satisfied, named for the reason line.
    fn unmet(&self, spec: &NeedSpec) -> Vec<String> {
        let deps = spec.dependencies();
        if deps.is_empty() {
            return Vec::new();
        }
        self.inner.store.read(|states| {
            deps.iter()
                .filter_map(|d| {
                    let st = states.get(d.as_str());
                    let ready = st.is_some_and(|s| s.satisfied && s.phase != Phase::Expired);
                    (!ready)
                        .then(|| format!("{d} ({})", st.map_or("pending", |s| s.phase.as_str())))
                })
                .collect()
        })
    }

    /// The request with every reference replaced by the referenced payload.
    fn resolved(&self, spec: &NeedSpec) -> Result<serde_json::Value, String> {
        if spec.references().is_empty() {
            return Ok(spec.request.clone());
        }
        let states = self.inner.store.read(|s| s.clone());
        resolve(&spec.request, &mut |r| {
            let payload = states
                .get(r.need.as_str())
                .and_then(|s| s.payload.as_deref())
                .and_then(|b| {
                    use base64::Engine;
                    base64::engine::general_purpose::STANDARD.decode(b).ok()
                })
                .ok_or_else(|| format!("{} has no payload yet", r.need))?;
            extract(&payload, &r.pointer).map_err(|e| format!("{r}: {e}"))
        })
    }

    /// Whether a reload changed the need's request after this one was sent.
    pub(crate) fn superseded(&self, key: &NeedKey) -> bool {
        self.inner.view.lock().unsent.contains(key)
    }

    /// Sets the phase (and `since` when it changes) and the reason, lazily.
    pub(crate) fn set_phase(&self, key: &NeedKey, phase: Phase, reason: Option<String>) {
        let now = unix_now();
        self.update_lazy(key, |st| {
            let changed = st.phase != phase || st.last_error != reason;
            if st.phase != phase {
                st.since = now;
            }
            st.phase = phase;
            st.last_error = reason;
            changed
        });
    }

    /// A due need: held while what it needs is not there; renewed before it expires;
    /// checked when satisfied; asked again when its resolved request changed; asked for
    /// when not satisfied.
    async fn attend(&self, key: &NeedKey) {
        let Some(spec) = self.spec(key) else { return };
        let unmet = self.unmet(&spec);
        if !unmet.is_empty() {
            // Not sent; the needs it waits for wake it when they are satisfied.
            self.set_phase(
                key,
                Phase::Waiting,
                Some(format!("waiting for {}", unmet.join(", "))),
            );
            return;
        }
        let st = self.state(key);
        let now = unix_now();
        let renewal = renewal_phase(&spec, &st, now);
        if let Some(phase) = renewal {
            let reason = match (phase, st.expires_at) {
                (Phase::Expired, Some(at)) => format!("expired at {at}; asking for a new one"),
                (_, Some(at)) => format!("expires at {at}; asking for a new one"),
                _ => "renewing".into(),
            };
            if st.phase != phase {
                tracing::info!(need = %key, state = phase.as_str(), "{reason}");
            }
            self.set_phase(key, phase, Some(reason));
        }
        let resolved = match self.resolved(&spec) {
            Ok(r) => r,
            Err(e) => {
                tracing::info!(need = %key, error = %e, "request cannot be built yet");
                self.set_phase(
                    key,
                    Phase::Failed,
                    Some(format!("cannot build the request: {e}")),
                );
                self.schedule(key, Some(jittered(nag(&spec))));
                return;
            }
        };
        let resolved_hash = sha256_hex(&serde_json::to_vec(&resolved).expect("serialises"));
        let refs_changed = !spec.references().is_empty()
            && st.sent_sha256.as_deref() != Some(resolved_hash.as_str());
        if st.satisfied
            && !spec.never_satisfied
            && !self.superseded(key)
            && renewal.is_none()
            && !refs_changed
        {
            if let Some(check) = &spec.check {
                self.inner
                    .spawned
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let run_spec = RunSpec::new(check, Vec::new(), self.inner.opts.handler_timeout)
                    .env("FORT_HOST", self.inner.opts.host.clone())
                    .env("FORT_NEED", key.to_string())
                    .envs(self.inner.opts.handler_environment.clone());
                match run(&run_spec).await {
                    Ok(_) => {
                        self.schedule(key, next_attendance(&spec, &st, now));
                        return;
                    }
                    Err(e) => {
                        tracing::info!(need = %key, error = %e.summary(), stderr = e.stderr_excerpt(STDERR_IN_LOG).unwrap_or_default(), "check failed; need is unsatisfied");
                        let _ = self
                            .set_outcome(
                                key,
                                false,
                                Phase::Pending,
                                Some(format!("check failed: {}", e.summary())),
                            )
                            .await;
                    }
                }
            } else {
                self.schedule(key, next_attendance(&spec, &st, now));
                return;
            }
        }
        self.request(key, resolved, resolved_hash, renewal.is_some())
            .await;
    }

    /// Bookkeeping nobody waits on: `f` edits the need's state and says whether it changed.
    pub(crate) fn update_lazy(&self, key: &NeedKey, f: impl FnOnce(&mut NeedState) -> bool) {
        let key = key.to_string();
        self.inner.store.change_lazy(|c| {
            if let Some(mut st) = c.get(&key).cloned() {
                if f(&mut st) {
                    c.put(key.clone(), st);
                }
            }
        });
    }

    /// Records an outcome durably: satisfied or not, the phase and its reason.
    pub(crate) async fn set_outcome(
        &self,
        key: &NeedKey,
        satisfied: bool,
        phase: Phase,
        reason: Option<String>,
    ) -> Result<(), PersistError> {
        let key = key.to_string();
        let now = unix_now();
        self.inner
            .store
            .change_durable(|c| {
                if let Some(mut st) = c.get(&key).cloned() {
                    if satisfied && !st.satisfied {
                        st.satisfied_at = Some(now);
                        st.attempts = 0;
                    }
                    if !satisfied && st.satisfied {
                        st.satisfied_at = None;
                    }
                    if st.phase != phase {
                        st.since = now;
                    }
                    st.satisfied = satisfied;
                    st.phase = phase;
                    st.last_error = reason;
                    c.put(key.clone(), st);
                }
            })
            .await
    }
}

/// When a need is next due, given where it stands (`None`: only a callback or a
/// dependency wakes it).
pub(crate) fn next_attendance(spec: &NeedSpec, st: &NeedState, now: u64) -> Option<Duration> {
    if !st.satisfied {
        return Some(Duration::ZERO);
    }
    let mut next = (spec.check.is_some() || spec.never_satisfied).then(|| jittered(nag(spec)));
    if let Some(at) = st.expires_at {
        // Renewal from `renew_before` ahead of the expiry; an expired payload shows as
        // such the moment it expires either way.
        let renew_at = spec
            .renew_before_seconds
            .map_or(at, |before| at.saturating_sub(before));
        for moment in [renew_at, at] {
            if moment >= now {
                let d = Duration::from_secs(moment - now);
                next = Some(next.map_or(d, |n| n.min(d)));
            } else if moment == renew_at && spec.renew_before_seconds.is_some() {
                next = Some(Duration::ZERO);
            }
        }
    }
    next
}

/// `Expiring` or `Expired` when a satisfied need's payload must be renewed now.
pub(crate) fn renewal_phase(spec: &NeedSpec, st: &NeedState, now: u64) -> Option<Phase> {
    let at = st.expires_at?;
    if !st.satisfied {
        return None;
    }
    if now >= at {
        return Some(Phase::Expired);
    }
    let before = spec.renew_before_seconds?;
    (now >= at.saturating_sub(before)).then_some(Phase::Expiring)
}
