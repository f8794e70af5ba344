//! Callback delivery (§7): signed, bounded in concurrency, the consumer's signed reply
//! verified, retried with backoff for a bounded time, and recorded on the entry. One
//! delivery per entry at a time, and a delivery that has been superseded by a newer
//! response stops, so a consumer never ends up holding an older payload.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fort_core::client::Target;
use fort_core::names::parse_entry_key;
use fort_core::wire::{payload_bytes, unix_now};
use serde_json::Value;
use tokio::sync::Semaphore;

use super::state::payload_hash;
use crate::app::App;

pub struct Deliveries {
    limit: Arc<Semaphore>,
    /// Deliveries in flight to one consumer. Taken before a global slot, so a consumer
    /// that accepts connections and never answers holds at most its own share, and the
    /// other consumers' callbacks are not queued behind its timeouts.
    per_consumer: usize,
    consumers: Mutex<HashMap<String, Arc<Semaphore>>>,
    per_entry: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Delivery tasks alive per entry, so a redelivery sweep does not double up.
    active: Mutex<HashMap<String, usize>>,
}

/// Counts one live delivery task for an entry; uncounted when the task ends.
struct ActiveDelivery {
    app: Arc<App>,
    key: String,
}

impl Drop for ActiveDelivery {
    fn drop(&mut self) {
        let mut active = self
            .app
            .provider
            .deliveries
            .active
            .lock()
            .expect("active lock");
        if let Some(n) = active.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                active.remove(&self.key);
            }
        }
    }
}

impl Deliveries {
    pub fn new(concurrency: usize, per_consumer: usize) -> Deliveries {
        Deliveries {
            limit: Arc::new(Semaphore::new(concurrency.max(1))),
            per_consumer: per_consumer.max(1),
            consumers: Mutex::new(HashMap::new()),
            per_entry: Mutex::new(HashMap::new()),
            active: Mutex::new(HashMap::new()),
        }
    }

    fn consumer_slots(&self, origin: &str) -> Arc<Semaphore> {
        let mut m = self.consumers.lock().expect("consumers lock");
        // Bounded by the registry's hosts; forget idle ones now and then all the same.
        if m.len() > 4096 {
            m.retain(|_, s| Arc::strong_count(s) > 1);
        }
        m.entry(origin.to_owned())
            .or_insert_with(|| Arc::new(Semaphore::new(self.per_consumer)))
            .clone()
    }

    fn entry_lock(&self, key: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut m = self.per_entry.lock().expect("deliveries lock");
        // Forget locks nobody holds, so the map does not grow with every entry ever seen.
        if m.len() > 4096 {
            m.retain(|_, l| Arc::strong_count(l) > 1);
        }
        m.entry(key.to_owned()).or_default().clone()
    }
}

pub fn spawn_delivery(app: &Arc<App>, key: String, response: Option<Value>) {
    *app.provider
        .deliveries
        .active
        .lock()
        .expect("active lock")
        .entry(key.clone())
        .or_insert(0) += 1;
    let guard = ActiveDelivery {
        app: app.clone(),
        key: key.clone(),
    };
    let app2 = app.clone();
    app.tasks.spawn(async move {
        let _counted = guard;
        deliver(&app2, key, response).await
    });
}

/// Starts a delivery for every host entry whose consumer has not acknowledged its
/// current payload and that has no delivery under way: what a crash interrupted, and
/// what gave up after its retries (a rotated credential must not wait for a nag that a
/// satisfied consumer never sends). Returns how many were started.
pub fn redeliver_undelivered(app: &Arc<App>) -> usize {
    let loaded = app.loaded.load_full();
    let owed: Vec<(String, Option<Value>)> = app.provider.store.read(|entries| {
        entries
            .iter()
            .filter(|(k, e)| {
                e.undelivered()
                    && parse_entry_key(k).is_some_and(|(o, _)| loaded.registry.is_host(o))
            })
            .map(|(k, e)| (k.clone(), e.response.clone()))
            .collect()
    });
    let active = app
        .provider
        .deliveries
        .active
        .lock()
        .expect("active lock")
        .clone();
    let mut started = 0;
    for (key, response) in owed {
        if !active.contains_key(&key) {
            spawn_delivery(app, key, response);
            started += 1;
        }
    }
    if started > 0 {
        tracing::info!(started, "redelivering unacknowledged callbacks");
    }
    started
}

/// Redelivery at start and then every `interval`, until shutdown.
pub async fn run_redelivery(app: Arc<App>) {
    let interval = app.config.callbacks.redeliver_interval;
    loop {
        redeliver_undelivered(&app);
        if interval.is_zero() {
            return;
        }
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = app.shutdown.cancelled() => return,
        }
    }
}

/// Whether the entry still wants exactly this payload delivered.
fn still_current(app: &App, key: &str, hash: &Option<String>) -> bool {
    app.provider
        .store
        .read(|entries| entries.get(key).is_some_and(|e| e.current_hash() == *hash))
}

async fn deliver(app: &Arc<App>, key: String, response: Option<Value>) {
    let Some((origin, need)) = parse_entry_key(&key) else {
        return;
    };
    let origin = origin.to_owned();
    let hash = payload_hash(response.as_ref());
    let payload = response.as_ref().map(payload_bytes).unwrap_or_default();
    let path = format!("/agent/needs/{need}");
    let cfg = app.config.callbacks.clone();
    let lock = app.provider.deliveries.entry_lock(&key);
    let mut delay = cfg.backoff;
    for attempt in 1..=cfg.attempts.max(1) {
        // Held for one attempt, not across the backoff sleep, so a newer response for
        // this entry is never stuck behind an older one's retries.
        let _one_at_a_time = lock.lock().await;
        if app.shutdown.is_cancelled() || !still_current(app, &key, &hash) {
            return;
        }
        let loaded = app.loaded.load_full();
        let Some(peer) = loaded.registry.get(&origin) else {
            return;
        };
        let Some(address) = peer.address.clone() else {
            // A principal has nowhere to be called back; it polls or uses rpc mode.
            return;
        };
        let keys = peer.keys.clone();
        drop(loaded);
        let outcome = {
            let consumer = app.provider.deliveries.consumer_slots(&origin);
            let _own = consumer.acquire().await.expect("semaphore open");
            let _slot = app
                .provider
                .deliveries
                .limit
                .acquire()
                .await
                .expect("semaphore open");
            let target = Target {
                name: &origin,
                address: &address,
                keys: &keys,
            };
            tokio::time::timeout(
                cfg.timeout,
                app.client.post(&target, &path, payload.clone()),
            )
            .await
        };
        let error = match outcome {
            Err(_) => "timeout".to_owned(),
            Ok(Err(e)) => e.to_string(),
            Ok(Ok(reply)) if reply.status == 200 && reply.verified() => {
                let acked = hash.clone();
                app.provider.store.change_lazy(|c| {
                    if let Some(mut e) = c.get(&key).cloned() {
                        e.delivery.delivered_hash = acked;
                        e.delivery.delivered_at = Some(unix_now());
                        e.delivery.last_error = None;
                        e.delivery.attempts = attempt;
                        c.put(key.clone(), e);
                    }
                });
                app.metrics.callbacks.inc(&[("outcome", "sent")]);
                tracing::info!(
                    entry = %key,
                    bytes = payload.len(),
                    revocation = response.is_none(),
                    payload_sha256 = %hash.as_deref().unwrap_or("-"),
                    "callback delivered"
                );
                return;
            }
            Ok(Ok(reply)) if reply.status == 200 => {
                format!("reply signature not verified ({:?})", reply.auth)
            }
            Ok(Ok(reply)) => format!("consumer answered {}", reply.status),
        };
        app.metrics.callbacks.inc(&[("outcome", "failed")]);
        tracing::warn!(entry = %key, attempt, error = %error, "callback failed");
        app.provider.store.change_lazy(|c| {
            if let Some(mut e) = c.get(&key).cloned() {
                e.delivery.last_error = Some(error.clone());
                e.delivery.attempts = attempt;
                c.put(key.clone(), e);
            }
        });
        drop(_one_at_a_time);
        if attempt < cfg.attempts {
            app.metrics.callbacks.inc(&[("outcome", "retried")]);
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = app.shutdown.cancelled() => return,
            }
            delay = (delay * 2).min(Duration::from_secs(300));
        }
    }
    tracing::warn!(entry = %key, "callback gave up; the consumer's nag will ask again");
}
