//! The agent's shared state (`Arc<App>` through axum's `State`), its start-up, reload and
//! the set of background tasks it owns.

use std::sync::Arc;

use parking_lot::Mutex;
use std::time::Instant;

use arc_swap::ArcSwap;
use fort_core::client::{ClientOptions, SignedClient};
use fort_core::schema::Mode;
use fort_core::sign::Signer;
use fort_core::store::{Sealing, Store};
use fort_core::wire::unix_now;
use fort_fulfill::{FulfillOptions, Fulfiller};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::Config;
use crate::limits::Budgets;
use crate::loaded::{LoadError, Loaded};
use crate::logging::Quiet;
use crate::metrics::Metrics;
use crate::nonce::NonceStore;
use crate::provider::gc::SweepReport;
use crate::provider::{Provider, Trigger};

pub struct App {
    pub config: Config,
    pub signer: Signer,
    pub loaded: ArcSwap<Loaded>,
    pub nonces: NonceStore,
    pub limiter: Arc<Semaphore>,
    /// Request schema checks running at once (off the runtime's threads).
    pub schema_checks: Arc<Semaphore>,
    /// Each origin's share of `limiter`, taken before it.
    origin_slots: Mutex<std::collections::HashMap<String, Arc<Semaphore>>>,
    /// Connections and unverified body bytes of the control plane, per peer address.
    pub budgets: Arc<Budgets>,
    /// `None`: this host serves plain HTTP (`plaintext = true` and an `http://` address).
    pub tls: Option<tokio_rustls::TlsAcceptor>,
    /// Aggregated logging of what strangers can trigger at will.
    pub quiet: Arc<Quiet>,
    /// Outgoing signed calls: callbacks and GC enumerations.
    pub client: SignedClient,
    pub provider: Provider,
    pub fulfiller: Fulfiller,
    /// Seals the handlers' state (they get its file in `FORT_STATE_KEY_FILE`); `None`:
    /// state is kept in plaintext.
    pub state_key: Option<Arc<fort_core::sealed::StateKey>>,
    pub metrics: Metrics,
    pub started: Instant,
    pub shutdown: CancellationToken,
    /// Stops the state flushers. Separate from `shutdown` and cancelled only once the
    /// HTTP server has drained: a request finishing during the drain still gets its
    /// change on disk before it is answered.
    pub flush_stop: CancellationToken,
    pub tasks: TaskTracker,
    pub last_gc: Mutex<Option<SweepReport>>,
    /// Requests served since start (for housekeeping: was there a burst to clean up?).
    pub served: std::sync::atomic::AtomicU64,
    /// The signed audit trail (docs/protocol.md §12).
    pub audit: fort_core::audit::Audit,
}

/// Schema checks at once: as many as cores (at most 8), for what is CPU work only; a
/// check past its budget keeps its slot until it ends, so these bound the CPU it takes.
fn schema_checks() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get().clamp(1, 8))
}

/// Why the agent cannot start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Key(#[from] fort_core::sign::KeyError),
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error("{0}")]
    Invalid(String),
    #[error("{0}: {1}")]
    Io(String, std::io::Error),
    #[error("TLS: {0}")]
    Tls(#[from] fort_core::tls::TlsError),
    #[error(transparent)]
    State(#[from] StateRefused),
}

/// A state file this release will not start on, with what the operator can do about it.
#[derive(Debug, thiserror::Error)]
#[error("{error}.{advice}")]
pub struct StateRefused {
    pub error: fort_core::store::LoadError,
    advice: String,
}

impl StateRefused {
    fn new(error: fort_core::store::LoadError, config: &Config, file: &str) -> StateRefused {
        let cfg = config.config_file.display();
        let advice = if let fort_core::store::LoadError::Sealed(_) = &error {
            format!(" To move it aside: `fort-agent set-aside --config {cfg} {file}`")
        } else if error.recoverable() {
            format!(
                " To go on: run the release that wrote it again; or start once with `fort-agent serve --recover --config {cfg}`, which moves the file aside (under {dir}/set-aside/) and keeps every record this release can read; or move it aside and start without it: `fort-agent set-aside --config {cfg} {file}`",
                dir = config.state_dir.display()
            )
        } else {
            String::new()
        };
        StateRefused { error, advice }
    }
}

/// Opens one state file; with `--recover`, gets past a refusal keeping what it can read,
/// and says so.
fn open_state<V>(
    path: &std::path::Path,
    field: &'static str,
    config: &Config,
    sealing: Sealing<V>,
) -> Result<Store<V>, StartError>
where
    V: serde::Serialize + serde::de::DeserializeOwned + Clone + Send + Sync + 'static,
{
    let file = path.file_name().and_then(|n| n.to_str()).unwrap_or("state");
    let (store, recovery) = Store::open_with(path, field, config.recover, sealing)
        .map_err(|e| StateRefused::new(e, config, file))?;
    if let Some(r) = recovery {
        tracing::warn!(
            file = %path.display(),
            kept = r.kept,
            skipped = r.skipped.len(),
            moved_to = %r.moved_to.display(),
            refused = %r.refused,
            "recovered: the state this release refused is moved aside; every record it can read is kept"
        );
        for s in &r.skipped {
            tracing::warn!(file = %path.display(), "not kept (it stays in {}): {s}", r.moved_to.display());
        }
    }
    Ok(store)
}

/// The audit trail as `[audit]` says, or none.
fn open_audit(config: &Config, signer: &Signer) -> fort_core::audit::Audit {
    if !config.audit.enable {
        return fort_core::audit::Audit::disabled();
    }
    let a = &config.audit;
    fort_core::audit::Audit::open(
        fort_core::audit::Options {
            dir: config.audit_dir(),
            host: config.host.clone(),
            max_file_bytes: a.max_file_bytes.max(4096),
            max_files: a.max_files.max(2),
            checkpoint_interval: a.checkpoint_interval.max(std::time::Duration::from_secs(1)),
            queue: a.queue,
            journal: a.journal,
            syslog: a.syslog.clone(),
        },
        signer.clone(),
    )
}

/// SHA-256 of agent.toml as read at start (a changed configuration shows in the trail).
fn config_sha256(path: &std::path::Path) -> Option<String> {
    std::fs::read(path)
        .ok()
        .map(|b| fort_core::canonical::sha256_hex(&b))
}

/// Checks that `signer`'s public key is one of this host's keys in hosts.json.
pub fn check_own_key(config: &Config, loaded: &Loaded, signer: &Signer) -> Result<(), StartError> {
    let peer = loaded
        .registry
        .get(&config.host)
        .expect("checked by Loaded::load");
    if !peer
        .keys
        .iter()
        .any(|k| k.key_data() == signer.public_key().key_data())
    {
        return Err(StartError::Invalid(format!(
            "the public key of {} ({}) is not listed for host {:?} in {}; refusing to run",
            config.host_key.display(),
            signer.public_openssh(),
            config.host,
            config.hosts.display()
        )));
    }
    Ok(())
}

/// After a burst, glibc keeps the freed heap (connection buffers, handler I/O) mapped;
/// an idle agent hands it back so its resident size stays small. Checked every 2 s,
/// trimming only when requests were served since the last look and none is in flight.
async fn release_memory_when_idle(app: Arc<App>) {
    use std::sync::atomic::Ordering;
    let mut seen = 0;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(std::time::Duration::from_secs(2)) => {}
            _ = app.shutdown.cancelled() => return,
        }
        let served = app.served.load(Ordering::Relaxed);
        let idle = app.limiter.available_permits() == app.config.max_concurrent_requests.max(1);
        if served != seen && idle {
            seen = served;
            trim_heap();
        }
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
pub(crate) fn trim_heap() {
    // SAFETY: malloc_trim only returns free heap pages to the kernel.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub(crate) fn trim_heap() {}

impl App {
    /// The slots one origin may hold at once: an eighth of all, at least 8. Origins are
    /// verified callers (bounded by the registry), so the map is too.
    pub fn origin_slots(&self, origin: &str) -> Arc<Semaphore> {
        let share = (self.config.max_concurrent_requests / 8).max(8);
        self.origin_slots
            .lock()
            .entry(origin.to_owned())
            .or_insert_with(|| Arc::new(Semaphore::new(share)))
            .clone()
    }

    /// Loads everything and starts the background tasks (flushers, fulfiller, GC,
    /// initialize triggers). The HTTP listeners are started by [`crate::run`].
    pub async fn start(
        config: Config,
        shutdown: CancellationToken,
    ) -> Result<Arc<App>, StartError> {
        let signer = Signer::from_file(&config.host_key)?;
        let loaded = Loaded::load(&config)?;
        check_own_key(&config, &loaded, &signer)?;
        let tls = if loaded.serves_plaintext(&config.host) {
            None
        } else {
            Some(tokio_rustls::TlsAcceptor::from(
                fort_core::tls::server_config(&signer)?,
            ))
        };
        let descriptors = crate::limits::raise_descriptor_limit();
        // The listeners together take at most half the descriptors: state files, handler
        // pipes and outgoing calls must never be the ones that fail with EMFILE.
        let max_connections = config
            .max_connections
            .min((descriptors / 2) as usize)
            .max(16);
        let budgets = Budgets::new(
            max_connections,
            config.max_connections_per_address,
            config.unverified_body_bytes,
            config.unverified_body_bytes_per_address,
        );
        // The state directory holds every entry and the nonce journal: the agent's alone,
        // whatever the umask it was started with.
        {
            use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
            let dir = &config.state_dir;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .and_then(|()| {
                    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
                })
                .map_err(|e| StartError::Io(format!("cannot create {}", dir.display()), e))?;
        }
        // Temporary files of writes a kill cut short (the agent's, a handler's): never
        // state, and their writers are gone, as no handler runs yet.
        let removed = fort_core::store::remove_stale_temporaries_below(&config.state_dir);
        if removed > 0 {
            tracing::info!(removed, dir = %config.state_dir.display(), "removed temporary files that writes cut short by a kill left");
        }
        let state_key = crate::state_key::load_and_check(&config).map_err(StartError::Invalid)?;
        let tasks = TaskTracker::new();
        let audit = open_audit(&config, &signer);

        // A state file that cannot be read stops the start: an empty provider would
        // forget every consumer's entries, and its next write would destroy the evidence.
        let open_store = |file: &str, field: &'static str| {
            let path = config.state_dir.join(file);
            (path.clone(), field)
        };
        let (path, field) = open_store(crate::provider::state::FILE, crate::provider::state::FIELD);
        // Its cached responses are sealed with the state key (docs/at-rest.md).
        let sealing =
            crate::provider::sealing::SealedResponses::sealing(state_key.as_deref(), &path);
        let provider_store = open_state(&path, field, &config, sealing)?;
        let (path, field) = open_store(fort_fulfill::state::FILE, fort_fulfill::state::FIELD);
        // The payloads it keeps (before they are applied, and for references) are
        // sealed with the state key too.
        let sealing = fort_fulfill::sealing::SealedPayloads::sealing(state_key.as_deref(), &path);
        let fulfill_store = open_state(&path, field, &config, sealing)?;
        // What templates last rendered: hashes only, nothing to seal.
        let (path, field) = open_store(
            fort_fulfill::templates::FILE,
            fort_fulfill::templates::FIELD,
        );
        let template_store = open_state(&path, field, &config, Sealing::Never)?;
        let flush_stop = CancellationToken::new();
        tasks.spawn(provider_store.clone().run_flusher(flush_stop.clone()));
        tasks.spawn(fulfill_store.clone().run_flusher(flush_stop.clone()));
        tasks.spawn(template_store.clone().run_flusher(flush_stop.clone()));

        let nonces = NonceStore::open(
            Some(&config.state_dir),
            config.nonce_capacity,
            config.nonce_quota_per_origin,
            config.clock_skew.as_secs(),
            unix_now(),
        )
        .map_err(|e| StartError::Io("cannot open the nonce journal".into(), e))?;
        let client = SignedClient::new(
            &config.host,
            signer.clone(),
            &ClientOptions {
                total_timeout: config.callbacks.timeout.max(config.fulfill.timeout),
                allow_plaintext: config.plaintext,
                local_address: Some(config.listen.ip()).filter(|ip| !ip.is_unspecified()),
                ..ClientOptions::default()
            },
        );
        let fulfiller = Fulfiller::new(
            FulfillOptions {
                host: config.host.clone(),
                handler_timeout: config.handler_timeout,
                per_provider_concurrency: config.fulfill.per_provider_concurrency,
                backoff: config.fulfill.backoff,
                request_timeout: config.fulfill.timeout,
                handler_environment: config
                    .handler_environment
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect(),
                systemctl: config.systemctl.clone(),
                systemd_creds: config.systemd_creds.clone(),
                batches: config.batches,
                key_dir: config.state_dir.join("keys"),
                audit: audit.clone(),
            },
            fulfill_store,
            client.clone(),
            tasks.clone(),
            shutdown.clone(),
        );
        fulfiller.set_template_store(template_store);
        let app = Arc::new(App {
            limiter: Arc::new(Semaphore::new(config.max_concurrent_requests.max(1))),
            schema_checks: Arc::new(Semaphore::new(schema_checks())),
            origin_slots: Mutex::new(Default::default()),
            budgets,
            tls,
            quiet: Arc::new(Quiet::default()),
            provider: Provider::new(
                provider_store,
                config.callbacks.concurrency,
                config.callbacks.per_consumer,
            )
            .with_renew_interval(config.renew_interval),
            signer,
            loaded: ArcSwap::from_pointee(loaded.clone()),
            nonces,
            client,
            fulfiller: fulfiller.clone(),
            state_key,
            metrics: Metrics::default(),
            started: Instant::now(),
            shutdown: shutdown.clone(),
            flush_stop,
            tasks: tasks.clone(),
            last_gc: Mutex::new(None),
            served: Default::default(),
            audit,
            config,
        });
        app.audit.record(
            fort_core::audit::Event::own(fort_core::audit::OwnKind::Start).detail(
                serde_json::json!({
                    "release": fort_core::VERSION,
                    "protocol": fort_core::compat::PROTOCOL,
                    "config_sha256": config_sha256(&app.config.config_file),
                    "manifest_sha256": loaded.manifest_sha256,
                }),
            ),
        );
        fulfiller
            .reload(loaded.needs.clone(), Arc::new(loaded.registry.clone()))
            .await
            .map_err(|e| StartError::Invalid(e.to_string()))?;
        fulfiller.set_templates(loaded.templates.clone());
        tasks.spawn(fulfiller.run());
        tasks.spawn(crate::provider::gc::run_periodic(app.clone()));
        crate::provider::callbacks::start(&app);
        tasks.spawn(crate::provider::callbacks::run_redelivery(app.clone()));
        tasks.spawn(release_memory_when_idle(app.clone()));
        // Capabilities with requesters still owed a response (accepted just before a
        // crash) run at once; `initialize` ones run anyway and call everyone back. In the
        // background: the agent serves while the handlers run.
        let owed: std::collections::BTreeSet<String> = app.provider.store.read(|entries| {
            entries
                .iter()
                .filter(|(_, e)| e.awaiting_response)
                .filter_map(|(k, _)| crate::provider::state::capability_of(k).map(str::to_owned))
                .collect()
        });
        for (name, cap) in &loaded.capabilities {
            if cap.mode != Mode::Async {
                continue;
            }
            if cap.triggers.initialize {
                drop(
                    app.provider
                        .enqueue(&app, name, Trigger::Initialize, true, false),
                );
            } else if owed.contains(name) {
                drop(
                    app.provider
                        .enqueue(&app, name, Trigger::Request, false, false),
                );
            }
        }
        Ok(app)
    }

    /// Re-reads the JSON files (SIGHUP, admin `reload`). A broken file keeps the old view.
    pub async fn reload(self: &Arc<App>) -> Result<(), String> {
        let loaded = Loaded::load(&self.config).map_err(|e| {
            self.audit.record(
                fort_core::audit::Event::own(fort_core::audit::OwnKind::ReloadRefused)
                    .reason(e.to_string()),
            );
            e.to_string()
        })?;
        check_own_key(&self.config, &loaded, &self.signer).map_err(|e| e.to_string())?;
        let before = self.loaded.load().manifest_sha256.clone();
        self.audit.record(
            fort_core::audit::Event::own(fort_core::audit::OwnKind::Reload).detail(
                serde_json::json!({
                    "manifest_sha256": loaded.manifest_sha256,
                    "previous_manifest_sha256": before,
                    "changed": before != loaded.manifest_sha256,
                }),
            ),
        );
        self.loaded.store(Arc::new(loaded.clone()));
        self.fulfiller
            .reload(loaded.needs, Arc::new(loaded.registry))
            .await
            .map_err(|e| e.to_string())?;
        self.fulfiller.set_templates(loaded.templates);
        tracing::info!("configuration reloaded");
        Ok(())
    }
}
