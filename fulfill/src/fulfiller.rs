//! The fulfiller: asks providers for this host's needs, nags on a timer, backs off on
//! transport failures and honours `Retry-After`, holds needs until what they refer to is
//! satisfied, renews payloads before they expire, and turns callbacks into satisfaction
//! (asking lives in `request.rs` and `batch.rs`, the payload side in `deliver.rs`, a new
//! set of needs in `reload.rs`).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use parking_lot::Mutex;
use std::time::Duration;

use fort_core::canonical::sha256_hex;
use fort_core::client::SignedClient;
use fort_core::names::NeedKey;
use fort_core::process::{run, RunSpec};
use fort_core::schema::refs::{extract, resolve};
use fort_core::schema::{NeedSpec, Needs, Registry};
use fort_core::store::{PersistError, Store};
use fort_core::wire::unix_now;
use tokio::sync::{watch, Notify, Semaphore};
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
    /// The program that encrypts files delivered as encrypted credentials
    /// (`systemd-creds`, §11.3).
    pub systemd_creds: std::path::PathBuf,
    /// Send requests that come due together in batches (§11.8).
    pub batches: bool,
    /// Where keys made for needs wait for their certificate (§11.10): the agent's own.
    pub key_dir: std::path::PathBuf,
    /// Where deliveries applied, failed, revoked and refused, and releases, are recorded.
    pub audit: fort_core::audit::Audit,
}

/// Payloads with files or a handler applied at once, across all needs: as many as two
/// providers' shares of callbacks (`[callbacks] per_consumer`) bring at once.
const APPLIERS: usize = 8;

/// The furthest ahead anything is planned: a far expiry (or a hostile one) is looked at
/// again then, and no deadline arithmetic can overflow.
pub(crate) const MAX_PLAN: Duration = Duration::from_secs(30 * 24 * 3600);

/// `now + after`, never overflowing, never further than [`MAX_PLAN`].
pub(crate) fn deadline(now: Instant, after: Duration) -> Instant {
    now.checked_add(after.min(MAX_PLAN)).unwrap_or(now)
}

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
    pub(crate) dependents: HashMap<NeedKey, Vec<NeedKey>>,
    /// Needs whose payload other needs' requests are built from (it is kept).
    pub referenced: HashSet<NeedKey>,
    /// Needs templates read (§11.14): their payload is kept too.
    pub(crate) template_inputs: HashSet<NeedKey>,
    /// Needs whose applier runs (`apply.rs`).
    pub(crate) applying: HashSet<NeedKey>,
    /// Providers failing, and needs that moved (§11.13).
    pub(crate) homes: crate::home::Homes,
}

pub(crate) struct Inner {
    pub opts: FulfillOptions,
    pub store: Store<NeedState>,
    pub(crate) client: SignedClient,
    pub view: Mutex<View>,
    pub(crate) wake: Notify,
    /// Per need, the latest callback whose outcome is recorded, and whether it satisfied
    /// the need: a callback's reply waits on it.
    pub(crate) applied: Mutex<HashMap<NeedKey, watch::Sender<(u64, bool)>>>,
    pub(crate) providers: Mutex<HashMap<String, Arc<Semaphore>>>,
    pub(crate) batcher: Arc<Batcher>,
    /// Payloads being applied at once (files, handlers): callbacks must not turn into
    /// dozens of processes.
    pub(crate) appliers: Semaphore,
    /// Keys made for needs and not installed yet (§11.10).
    pub(crate) keys: crate::keys::KeyStore,
    pub tasks: TaskTracker,
    pub(crate) shutdown: CancellationToken,
    pub spawned: std::sync::atomic::AtomicU64,
    pub units: Units,
    pub(crate) started: std::sync::atomic::AtomicBool,
    /// Files rendered from templates over several needs (§11.14).
    pub(crate) templates: crate::templates::TemplateRoom,
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
    #[error(transparent)]
    Persist(#[from] PersistError),
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
        let keys = crate::keys::KeyStore::new(opts.key_dir.clone());
        Fulfiller {
            inner: Arc::new(Inner {
                keys,
                opts,
                store,
                client,
                view: Mutex::new(View::default()),
                wake: Notify::new(),
                applied: Mutex::new(HashMap::new()),
                providers: Mutex::new(HashMap::new()),
                batcher: Default::default(),
                appliers: Semaphore::new(APPLIERS),
                tasks,
                shutdown,
                spawned: Default::default(),
                units,
                started: Default::default(),
                templates: Default::default(),
            }),
        }
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
            Some(d) => view.due.plan_earliest(key, deadline(Instant::now(), d)),
            None => view.due.remove(key),
        }
        drop(view);
        self.inner.wake.notify_one();
    }

    /// Plans `key` exactly at `after` from now, replacing any plan.
    pub(crate) fn reschedule(&self, key: &NeedKey, after: Option<Duration>) {
        let mut view = self.inner.view.lock();
        match after {
            Some(d) => view.due.set(key, deadline(Instant::now(), d)),
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
    fn resolved(
        &self,
        key: &NeedKey,
        spec: &NeedSpec,
        renewal: bool,
    ) -> Result<serde_json::Value, String> {
        if !spec.resolved_at_send() {
            return Ok(spec.request.clone());
        }
        let request = if spec.keys.is_empty() {
            spec.request.clone()
        } else {
            self.with_keys(key, spec, renewal)?
        };
        if spec.references().is_empty() {
            return Ok(request);
        }
        let states = self.inner.store.read(|s| s.clone());
        resolve(&request, &mut |r| {
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

    /// The request with its `$fort_key` references replaced (§11.10): by the next key,
    /// the installed one, or a key made now.
    fn with_keys(
        &self,
        key: &NeedKey,
        spec: &NeedSpec,
        renewal: bool,
    ) -> Result<serde_json::Value, String> {
        let st = self.state(key);
        // A payload that came already inside its renewal window (a certificate living
        // less than renew_before) is renewed with the key in use: a new key every time
        // would order a new certificate at every nag.
        let arrived_renewing = match (st.received_at, st.expires_at) {
            (Some(received), Some(expires)) => {
                received >= expires.saturating_sub(spec.renew_before_seconds.unwrap_or(0))
            }
            _ => false,
        };
        let new_key = renewal && !arrived_renewing;
        let materials = crate::keys::for_request(&self.inner.keys, key, spec, &st.files, new_key)?;
        let mut records = st.keys.clone();
        let request = fort_core::schema::keys::resolve_keys(&spec.request, &mut |r| {
            let (Some(k), Some(m)) = (spec.keys.get(&r.key), materials.get(&r.key)) else {
                return Err(format!("no key {:?}", r.key));
            };
            crate::keys::form(&r.key, k, m, r.form, &mut records)
        })?;
        if records != st.keys {
            self.update_lazy(key, |st| {
                st.keys = records;
                true
            });
        }
        Ok(request)
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
            let at = st.expires_at.map(crate::status::when).unwrap_or_default();
            let word = if phase == Phase::Expired {
                "expired at"
            } else {
                "expires at"
            };
            // A renewal goes out at most once per nag interval: a provider that answers it
            // with a payload already inside the window (a CA issuing short lifetimes, a
            // stale cached response) must not be asked again at once, forever.
            if let Some(wait) = renewal_wait(&spec, &st, now) {
                let asked = st.renewal_sought_at.unwrap_or(now);
                let reason = st
                    .last_error
                    .clone()
                    .filter(|r| r.starts_with("the payload received"))
                    .unwrap_or_else(|| {
                        format!(
                            "{word} {at}; asked for a new one {}, asking again {}",
                            crate::status::ago(asked, now),
                            crate::status::in_(wait.as_secs())
                        )
                    });
                self.set_phase(key, phase, Some(reason));
                self.schedule(key, Some(wait));
                return;
            }
            let reason = format!("{word} {at}; asking for a new one");
            if st.phase != phase {
                tracing::info!(need = %key, state = phase.as_str(), "{reason}");
            }
            self.set_phase(key, phase, Some(reason));
        }
        let resolved = match self.resolved(key, &spec, renewal.is_some()) {
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
        let refs_changed =
            spec.resolved_at_send() && st.sent_sha256.as_deref() != Some(resolved_hash.as_str());
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
        let renew = renewal.is_some() || st.renew_at_home;
        self.request(key, resolved, resolved_hash, renew).await;
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
    let mut sooner = |d: Duration| next = Some(next.map_or(d, |n: Duration| n.min(d)));
    if let Some(at) = st.expires_at {
        // Renewal from `renew_before` ahead of the expiry (at the expiry without it); an
        // expired payload shows as such the moment it expires.
        let renew_at = spec
            .renew_before_seconds
            .map_or(at, |before| at.saturating_sub(before));
        if renew_at > now {
            sooner(Duration::from_secs(renew_at - now));
        } else {
            // Due now, or once the last renewal asked is a nag interval old.
            sooner(renewal_wait(spec, st, now).unwrap_or(Duration::ZERO));
        }
        if at > now {
            sooner(Duration::from_secs(at - now));
        }
    }
    next.map(|d| d.min(MAX_PLAN))
}

/// How long a need due for renewal still waits because a renewal was asked less than a
/// nag interval ago (`None`: it may ask now).
pub(crate) fn renewal_wait(spec: &NeedSpec, st: &NeedState, now: u64) -> Option<Duration> {
    let asked = st.renewal_sought_at?;
    let again = asked.saturating_add(spec.nag_seconds);
    (again > now).then(|| Duration::from_secs(again - now))
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
