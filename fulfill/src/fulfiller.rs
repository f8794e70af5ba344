//! The fulfiller: asks providers for unsatisfied needs, nags on a timer, backs off on
//! transport failures, runs checks, and turns callbacks into satisfaction.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fort_core::canonical::sha256_hex;
use fort_core::client::{SignedClient, Target};
use fort_core::names::NeedKey;
use fort_core::process::{run, RunSpec};
use fort_core::schema::{NeedSpec, Needs, Registry};
use fort_core::store::{PersistError, Store};
use fort_core::wire::{unix_now, AsyncBody};
use serde::Serialize;
use tokio::sync::{Notify, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::schedule::{backoff, jittered};
use crate::state::NeedState;

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
}

/// How much of a failed handler's stderr goes to the log (never to the state).
const STDERR_IN_LOG: usize = 2048;

/// One row of `fort-agent status`.
#[derive(Debug, Clone, Serialize)]
pub struct NeedStatus {
    pub need: String,
    pub from: String,
    pub satisfied: bool,
    pub satisfied_at: Option<u64>,
    pub last_sought: Option<u64>,
    pub attempts: u32,
    /// Unix seconds of the next planned request or check; `None`: nothing planned.
    pub next_request: Option<u64>,
    pub last_error: Option<String>,
}

#[derive(Default)]
struct View {
    needs: Arc<Needs>,
    registry: Arc<Registry>,
    due: HashMap<NeedKey, Instant>,
    in_flight: HashSet<NeedKey>,
    failures: HashMap<NeedKey, u32>,
    /// Needs whose current request (new, or changed by a reload) has not been sent yet.
    /// A reply or callback arriving meanwhile may answer an older request: it must not
    /// stop the current one from going out at once.
    unsent: HashSet<NeedKey>,
}

struct Inner {
    opts: FulfillOptions,
    store: Store<NeedState>,
    client: SignedClient,
    view: Mutex<View>,
    wake: Notify,
    need_locks: Mutex<HashMap<NeedKey, Arc<tokio::sync::Mutex<()>>>>,
    providers: Mutex<HashMap<String, Arc<Semaphore>>>,
    tasks: TaskTracker,
    shutdown: CancellationToken,
    spawned: std::sync::atomic::AtomicU64,
}

#[derive(Clone)]
pub struct Fulfiller {
    inner: Arc<Inner>,
}

/// A callback or rpc payload could not be recorded.
#[derive(Debug, thiserror::Error)]
pub enum DeliverError {
    #[error("no such need")]
    UnknownNeed,
    #[error(transparent)]
    Persist(#[from] PersistError),
}

fn request_hash(spec: &NeedSpec) -> String {
    sha256_hex(&serde_json::to_vec(&spec.request).expect("request serialises"))
}

fn nag(spec: &NeedSpec) -> Duration {
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
        Fulfiller {
            inner: Arc::new(Inner {
                opts,
                store,
                client,
                view: Mutex::new(View::default()),
                wake: Notify::new(),
                need_locks: Mutex::new(HashMap::new()),
                providers: Mutex::new(HashMap::new()),
                tasks,
                shutdown,
                spawned: Default::default(),
            }),
        }
    }

    pub fn store(&self) -> &Store<NeedState> {
        &self.inner.store
    }

    /// Processes started by the fulfiller (handlers and checks) since start.
    pub fn processes_spawned(&self) -> u64 {
        self.inner
            .spawned
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Installs a new set of needs (at start and on every reload). New needs, unsatisfied
    /// needs and needs whose request changed are asked at once; removed needs are
    /// released at their provider and forgotten. Returns once the state is durable.
    pub async fn reload(&self, needs: Needs, registry: Arc<Registry>) -> Result<(), PersistError> {
        let now = Instant::now();
        let (removed, fresh) = {
            let ((removed, fresh), ticket) = self.inner.store.change(|c| {
                let mut removed = Vec::new();
                let mut fresh = Vec::new();
                for key in c.keys() {
                    let keep = NeedKey::parse(&key).is_some_and(|k| needs.contains_key(&k));
                    if !keep {
                        let from = c.get(&key).map(|st| st.from.clone()).unwrap_or_default();
                        c.remove(&key);
                        removed.push((key, from));
                    }
                }
                for (key, spec) in &needs {
                    let hash = request_hash(spec);
                    let st = c.get(&key.to_string()).cloned().unwrap_or_default();
                    if st.request_hash != hash || st.from != spec.from {
                        // Moving to another provider releases the entry at the old one.
                        if !st.from.is_empty() && st.from != spec.from {
                            removed.push((key.to_string(), st.from.clone()));
                        }
                        fresh.push(key.clone());
                        c.put(
                            key.to_string(),
                            NeedState {
                                from: spec.from.clone(),
                                request_hash: hash,
                                ..Default::default()
                            },
                        );
                    }
                }
                (removed, fresh)
            })?;
            self.inner.store.wait(ticket).await?;
            (removed, fresh)
        };
        let satisfied: HashSet<String> = self.inner.store.read(|states| {
            states
                .iter()
                .filter(|(_, st)| st.satisfied)
                .map(|(k, _)| k.clone())
                .collect()
        });
        {
            let mut view = self.inner.view.lock().expect("view lock");
            view.due.clear();
            for (key, spec) in &needs {
                if !satisfied.contains(&key.to_string()) {
                    view.due.insert(key.clone(), now);
                } else if spec.check.is_some() || spec.never_satisfied {
                    view.due.insert(key.clone(), now + jittered(nag(spec)));
                }
            }
            view.unsent.retain(|k| needs.contains_key(k));
            view.unsent.extend(fresh);
            view.needs = Arc::new(needs);
            view.registry = registry.clone();
        }
        for (key, from) in removed {
            let me = self.clone();
            let registry = registry.clone();
            self.inner
                .tasks
                .spawn(async move { me.release(&key, &from, &registry).await });
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
        let path = format!("/agent/capabilities/{}", need.kind);
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
        let view = self.inner.view.lock().expect("view lock");
        view.needs.keys().map(|k| k.to_string()).collect()
    }

    pub fn spec(&self, need: &NeedKey) -> Option<NeedSpec> {
        self.inner
            .view
            .lock()
            .expect("view lock")
            .needs
            .get(need)
            .cloned()
    }

    /// The scheduler loop: until shutdown, start whatever is due, then sleep until the
    /// next due time or a wake-up.
    pub async fn run(self) {
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
    /// one is due. Cheap when nothing is due: no I/O, no process, no allocation per need.
    pub fn run_due(&self) -> Option<Instant> {
        let now = Instant::now();
        let mut start = Vec::new();
        let next = {
            let mut view = self.inner.view.lock().expect("view lock");
            let mut next: Option<Instant> = None;
            let View { due, in_flight, .. } = &mut *view;
            for (key, at) in due.iter() {
                if *at <= now && !in_flight.contains(key) {
                    start.push(key.clone());
                } else if !in_flight.contains(key) {
                    next = Some(next.map_or(*at, |n| n.min(*at)));
                }
            }
            for key in &start {
                view.in_flight.insert(key.clone());
                view.due.remove(key);
            }
            next
        };
        for key in start {
            let me = self.clone();
            self.inner.tasks.spawn(async move {
                me.attend(&key).await;
                me.inner
                    .view
                    .lock()
                    .expect("view lock")
                    .in_flight
                    .remove(&key);
                me.inner.wake.notify_one();
            });
        }
        next
    }

    /// Plans the next request or check of `key` in `after` (`None`: nothing planned).
    /// An earlier plan wins: a reload may have made the need due at once meanwhile.
    fn schedule(&self, key: &NeedKey, after: Option<Duration>) {
        let mut view = self.inner.view.lock().expect("view lock");
        match after {
            Some(d) => {
                let at = Instant::now() + d;
                let slot = view.due.entry(key.clone()).or_insert(at);
                *slot = (*slot).min(at);
            }
            None => {
                view.due.remove(key);
            }
        }
        drop(view);
        self.inner.wake.notify_one();
    }

    fn satisfied(&self, key: &NeedKey) -> bool {
        self.inner
            .store
            .read(|states| states.get(&key.to_string()).is_some_and(|st| st.satisfied))
    }

    /// A due need: a satisfied one with a check is checked; anything else is requested.
    async fn attend(&self, key: &NeedKey) {
        let Some(spec) = self.spec(key) else { return };
        if self.satisfied(key) && !spec.never_satisfied && !self.superseded(key) {
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
                        self.schedule(key, Some(jittered(nag(&spec))));
                        return;
                    }
                    Err(e) => {
                        tracing::info!(need = %key, error = %e.summary(), stderr = e.stderr_excerpt(STDERR_IN_LOG).unwrap_or_default(), "check failed; need is unsatisfied");
                        let _ = self
                            .set_outcome(key, false, Some(format!("check failed: {}", e.summary())))
                            .await;
                    }
                }
            } else {
                return;
            }
        }
        self.request(key).await;
    }

    /// Whether a reload changed the need's request after this one was sent.
    fn superseded(&self, key: &NeedKey) -> bool {
        self.inner
            .view
            .lock()
            .expect("view lock")
            .unsent
            .contains(key)
    }

    async fn request(&self, key: &NeedKey) {
        let Some(spec) = self.spec(key) else { return };
        let spec = &spec;
        let registry = self.inner.view.lock().expect("view lock").registry.clone();
        let Some(peer) = registry.get(&spec.from) else {
            return;
        };
        let Some(address) = peer.address.as_deref() else {
            return;
        };
        let limit = {
            let mut p = self.inner.providers.lock().expect("providers lock");
            p.entry(spec.from.clone())
                .or_insert_with(|| {
                    Arc::new(Semaphore::new(
                        self.inner.opts.per_provider_concurrency.max(1),
                    ))
                })
                .clone()
        };
        let _slot = limit.acquire().await.expect("semaphore open");
        // The spec as it is now, after waiting for a slot; from here on it is sent.
        let Some(spec) = self.spec(key) else { return };
        let spec = &spec;
        self.inner
            .view
            .lock()
            .expect("view lock")
            .unsent
            .remove(key);
        let body = serde_json::to_vec(&AsyncBody {
            need: key.to_string(),
            request: Some(spec.request.clone()),
            release: false,
            renew: false,
        })
        .expect("body serialises");
        let target = Target {
            name: &spec.from,
            address,
            keys: &peer.keys,
        };
        let path = format!("/agent/capabilities/{}", key.kind);
        let sent_at = unix_now();
        self.update_lazy(key, |st| {
            st.last_sought = Some(sent_at);
            st.attempts += 1;
            true
        });
        let outcome = tokio::time::timeout(
            self.inner.opts.request_timeout,
            self.inner.client.post(&target, &path, body),
        )
        .await;
        let transport_failure = |me: &Self, error: String| {
            let failures = {
                let mut view = me.inner.view.lock().expect("view lock");
                let f = view.failures.entry(key.clone()).or_insert(0);
                *f += 1;
                *f
            };
            let delay = backoff(me.inner.opts.backoff, failures, nag(spec));
            tracing::info!(need = %key, from = %spec.from, error = %error, retry_in = ?delay, "request failed");
            me.record_error(key, error);
            me.schedule(key, Some(delay));
        };
        if self.superseded(key) {
            // Changed while in flight: this outcome is about the old request.
            self.schedule(key, Some(Duration::ZERO));
            return;
        }
        let reply = match outcome {
            Err(_) => return transport_failure(self, "timeout".into()),
            Ok(Err(e)) => return transport_failure(self, e.to_string()),
            Ok(Ok(r)) => r,
        };
        if reply.status >= 500 {
            return transport_failure(self, format!("provider answered {}", reply.status));
        }
        self.inner
            .view
            .lock()
            .expect("view lock")
            .failures
            .remove(key);
        match reply.status {
            202 => {
                tracing::debug!(need = %key, from = %spec.from, "request accepted");
                self.record_error_opt(key, None);
                self.schedule(key, Some(jittered(nag(spec))));
            }
            200..=299 if reply.verified() => {
                // An rpc-mode capability answers at once: treat the body as a callback.
                if let Err(e) = self.deliver(key, &spec.from, &reply.body).await {
                    tracing::warn!(need = %key, error = %e, "rpc reply not recorded; asking again");
                    self.schedule(key, Some(self.inner.opts.backoff));
                }
            }
            200..=299 => {
                self.record_error(
                    key,
                    format!("response signature not verified ({:?})", reply.auth),
                );
                self.schedule(key, Some(jittered(nag(spec))));
            }
            status => {
                let mut error = format!(
                    "provider answered {status}: {}",
                    String::from_utf8_lossy(&reply.body)
                        .chars()
                        .take(200)
                        .collect::<String>()
                );
                if let Some(server) = reply.server_time {
                    error = format!("clock skew: provider time {server}, ours {}", unix_now());
                }
                tracing::warn!(need = %key, from = %spec.from, %error, "request refused");
                self.record_error(key, error);
                self.schedule(key, Some(jittered(nag(spec))));
            }
        }
    }

    fn record_error(&self, key: &NeedKey, error: String) {
        self.record_error_opt(key, Some(error));
    }

    fn record_error_opt(&self, key: &NeedKey, error: Option<String>) {
        self.update_lazy(key, |st| {
            let changed = st.last_error != error;
            st.last_error = error;
            changed
        });
    }

    /// Bookkeeping nobody waits on: `f` edits the need's state and says whether it changed.
    fn update_lazy(&self, key: &NeedKey, f: impl FnOnce(&mut NeedState) -> bool) {
        let key = key.to_string();
        self.inner.store.change_lazy(|c| {
            if let Some(mut st) = c.get(&key).cloned() {
                if f(&mut st) {
                    c.put(key.clone(), st);
                }
            }
        });
    }

    async fn set_outcome(
        &self,
        key: &NeedKey,
        satisfied: bool,
        error: Option<String>,
    ) -> Result<(), PersistError> {
        let now = unix_now();
        let key = key.to_string();
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
                    st.satisfied = satisfied;
                    st.last_error = error;
                    c.put(key.clone(), st);
                }
            })
            .await
    }

    /// A payload from the need's provider (a callback, or an rpc reply). Runs the need's
    /// handler (one run per need at a time) and records the outcome durably before
    /// returning, so an acknowledged callback survives `kill -9`.
    pub async fn deliver(
        &self,
        key: &NeedKey,
        origin: &str,
        payload: &[u8],
    ) -> Result<bool, DeliverError> {
        let spec = self.spec(key).ok_or(DeliverError::UnknownNeed)?;
        let lock = {
            let mut locks = self.inner.need_locks.lock().expect("locks lock");
            locks.entry(key.clone()).or_default().clone()
        };
        let _one_run = lock.lock().await;
        let digest = sha256_hex(payload);
        let (satisfied, error) = if payload.is_empty() {
            (false, Some("revoked by the provider".to_owned()))
        } else if let Some(handler) = &spec.handler {
            self.inner
                .spawned
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let run_spec = RunSpec::new(handler, payload.to_vec(), self.inner.opts.handler_timeout)
                .env("FORT_HOST", self.inner.opts.host.clone())
                .env("FORT_NEED", key.to_string())
                .env("FORT_ORIGIN", origin.to_owned())
                .envs(self.inner.opts.handler_environment.clone());
            match run(&run_spec).await {
                Ok(_) => (true, None),
                Err(e) => {
                    tracing::warn!(need = %key, error = %e.summary(), stderr = e.stderr_excerpt(STDERR_IN_LOG).unwrap_or_default(), "need handler failed");
                    (false, Some(format!("handler failed: {}", e.summary())))
                }
            }
        } else if payload == b"OK" || payload == b"OK\n" {
            (true, None)
        } else {
            // The payload may be a credential sent to the wrong need: only its size and hash
            // ever reach the log and the state.
            let what = format!(
                "the provider sent {} bytes (sha256 {}) instead of OK",
                payload.len(),
                &digest[..16]
            );
            tracing::warn!(need = %key, from = origin, "{what}");
            (false, Some(what))
        };
        self.set_outcome(key, satisfied, error.clone()).await?;
        tracing::info!(need = %key, from = origin, bytes = payload.len(), payload_sha256 = %digest, satisfied, error = ?error, "payload applied");
        let next = if satisfied {
            (spec.check.is_some() || spec.never_satisfied).then(|| jittered(nag(&spec)))
        } else {
            Some(jittered(nag(&spec)))
        };
        // The payload may answer an older request (the protocol cannot say which); the
        // current one must still go out, so it stays due at once.
        if self.superseded(key) {
            self.schedule(key, Some(Duration::ZERO));
        } else {
            self.schedule(key, next);
        }
        Ok(satisfied)
    }

    /// One row per declared need.
    pub fn status(&self) -> Vec<NeedStatus> {
        let (needs, due) = {
            let view = self.inner.view.lock().expect("view lock");
            (view.needs.clone(), view.due.clone())
        };
        let now = Instant::now();
        let wall = unix_now();
        self.inner.store.read(|states| {
            needs
                .iter()
                .map(|(key, spec)| {
                    let st = states.get(&key.to_string()).cloned().unwrap_or_default();
                    NeedStatus {
                        need: key.to_string(),
                        from: spec.from.clone(),
                        satisfied: st.satisfied,
                        satisfied_at: st.satisfied_at,
                        last_sought: st.last_sought,
                        attempts: st.attempts,
                        next_request: due
                            .get(key)
                            .map(|at| wall + at.saturating_duration_since(now).as_secs()),
                        last_error: st.last_error,
                    }
                })
                .collect()
        })
    }
}
