//! Callback delivery (docs/protocol.md §7): signed, the consumer's signed reply verified,
//! retried with backoff for a bounded time, and recorded on the entry.
//!
//! Deliveries are entry keys in a queue, drained by a fixed pool of workers: a run that
//! calls back 50,000 entries costs 50,000 queued keys, not 50,000 tasks each holding an
//! HTTP request in memory. A delivery always sends what the entry holds when it is sent,
//! so a newer response simply supersedes a queued one, and a consumer never ends up with
//! an older payload. Consumers are served in turn, each within its own share of the
//! workers: one that accepts connections and never answers holds only its share, and the
//! others' callbacks are not queued behind its timeouts.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fort_core::client::Target;
use fort_core::names::parse_entry_key;
use fort_core::wire::{payload_bytes_raw, unix_now};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::app::App;

#[derive(Default)]
struct ConsumerQueue {
    keys: VecDeque<String>,
    active: usize,
    /// Listed in `turn` (at most once).
    in_turn: bool,
}

#[derive(Default)]
struct Queue {
    consumers: HashMap<String, ConsumerQueue>,
    /// Consumers with queued keys, served in turn.
    turn: VecDeque<String>,
    /// Queued keys, and whether each must be sent even if already acknowledged (a run
    /// decided to call it back: its consumer asked again).
    queued: HashMap<String, bool>,
    /// Being sent now; `Some(force)` when it changed meanwhile and must go again.
    in_flight: HashMap<String, Option<bool>>,
    /// Failed attempts so far, per key.
    attempts: HashMap<String, u32>,
    /// Retries waiting for their time.
    retries: BTreeMap<(Instant, u64), String>,
    retry_seq: u64,
}

impl Queue {
    fn take_turn(&mut self, origin: &str) {
        if let Some(c) = self.consumers.get_mut(origin) {
            if !c.in_turn && !c.keys.is_empty() {
                c.in_turn = true;
                self.turn.push_back(origin.to_owned());
            }
        }
    }
}

pub struct Deliveries {
    queue: Mutex<Queue>,
    wake: Notify,
    per_consumer: usize,
    workers: usize,
}

impl Deliveries {
    pub fn new(concurrency: usize, per_consumer: usize) -> Deliveries {
        Deliveries {
            queue: Mutex::new(Queue::default()),
            wake: Notify::new(),
            per_consumer: per_consumer.max(1),
            workers: concurrency.max(1),
        }
    }

    /// Queues a delivery of `key`'s current response. `force`: send it even if the
    /// consumer acknowledged that very payload already.
    pub fn enqueue(&self, key: String, force: bool) {
        let Some((origin, _)) = parse_entry_key(&key) else {
            return;
        };
        let origin = origin.to_owned();
        {
            let mut q = self.queue.lock().expect("delivery queue");
            if let Some(again) = q.in_flight.get_mut(&key) {
                *again = Some(again.unwrap_or(false) | force);
                return;
            }
            if let Some(f) = q.queued.get_mut(&key) {
                *f |= force;
                return;
            }
            q.queued.insert(key.clone(), force);
            q.consumers
                .entry(origin.clone())
                .or_default()
                .keys
                .push_back(key);
            q.take_turn(&origin);
        }
        self.wake.notify_one();
    }

    /// Deliveries queued or being sent.
    pub fn backlog(&self) -> usize {
        let q = self.queue.lock().expect("delivery queue");
        q.queued.len() + q.in_flight.len()
    }

    /// The next key to send, from the next consumer in turn with room in its share.
    fn next(&self) -> Option<(String, bool)> {
        let mut q = self.queue.lock().expect("delivery queue");
        for _ in 0..q.turn.len() {
            let origin = q.turn.pop_front()?;
            let share = self.per_consumer;
            let Some(c) = q.consumers.get_mut(&origin) else {
                continue;
            };
            c.in_turn = false;
            if c.active >= share {
                // Its turn comes again when one of its sends ends (`done`).
                continue;
            }
            let Some(key) = c.keys.pop_front() else {
                continue;
            };
            c.active += 1;
            q.take_turn(&origin);
            let force = q.queued.remove(&key).unwrap_or(false);
            q.in_flight.insert(key.clone(), None);
            return Some((key, force));
        }
        None
    }

    /// A send ended; `retry_in`: try again then (a failure within the attempts).
    fn done(&self, key: &str, retry_in: Option<Duration>) {
        let Some((origin, _)) = parse_entry_key(key) else {
            return;
        };
        let again = {
            let mut q = self.queue.lock().expect("delivery queue");
            let again = q.in_flight.remove(key).flatten();
            let gone = q.consumers.get_mut(origin).is_some_and(|c| {
                c.active -= 1;
                c.keys.is_empty() && c.active == 0
            });
            if gone {
                q.consumers.remove(origin);
            } else {
                q.take_turn(origin);
            }
            // Changed while being sent: it goes again as its turn comes; a retry would
            // only duplicate it.
            if let (Some(delay), None) = (retry_in, again) {
                q.retry_seq += 1;
                let seq = q.retry_seq;
                q.retries
                    .insert((Instant::now() + delay, seq), key.to_owned());
            }
            again
        };
        if let Some(force) = again {
            self.enqueue(key.to_owned(), force);
        }
        self.wake.notify_one();
    }

    /// Moves retries whose time has come back into the queue; returns when the next is due.
    fn due_retries(&self) -> Option<Instant> {
        let now = Instant::now();
        let due: Vec<String> = {
            let mut q = self.queue.lock().expect("delivery queue");
            let mut due = Vec::new();
            while let Some(((at, _), _)) = q.retries.first_key_value() {
                if *at > now {
                    break;
                }
                let (_, key) = q.retries.pop_first().expect("peeked");
                due.push(key);
            }
            due
        };
        for key in due {
            self.enqueue(key, true);
        }
        self.queue
            .lock()
            .expect("delivery queue")
            .retries
            .first_key_value()
            .map(|((at, _), _)| *at)
    }
}

/// Starts the delivery workers and the retry timer.
pub fn start(app: &Arc<App>) {
    for _ in 0..app.provider.deliveries.workers {
        app.tasks.spawn(worker(app.clone()));
    }
    app.tasks.spawn(retry_timer(app.clone()));
}

async fn retry_timer(app: Arc<App>) {
    loop {
        let next = app.provider.deliveries.due_retries();
        let sleep = async {
            match next {
                Some(at) => tokio::time::sleep_until(at).await,
                // Woken by any queue change; a new retry is never earlier than a second.
                None => tokio::time::sleep(Duration::from_secs(1)).await,
            }
        };
        tokio::select! {
            _ = sleep => {}
            _ = app.shutdown.cancelled() => return,
        }
    }
}

async fn worker(app: Arc<App>) {
    let d = &app.provider.deliveries;
    loop {
        let next = loop {
            let waiting = d.wake.notified();
            if let Some(n) = d.next() {
                break n;
            }
            tokio::select! {
                _ = waiting => {}
                _ = app.shutdown.cancelled() => return,
            }
        };
        let (key, force) = next;
        let retry = send(&app, &key, force).await;
        d.done(&key, retry);
        if app.shutdown.is_cancelled() {
            return;
        }
    }
}

/// Queues every host entry whose consumer has not acknowledged its current payload:
/// what a crash interrupted, and what gave up after its retries (a rotated credential
/// must not wait for a nag that a satisfied consumer never sends). Returns how many.
pub fn redeliver_undelivered(app: &Arc<App>) -> usize {
    let loaded = app.loaded.load_full();
    let owed: Vec<String> = app.provider.store.read(|entries| {
        entries
            .iter()
            .filter(|(k, e)| {
                e.undelivered()
                    && parse_entry_key(k).is_some_and(|(o, _)| loaded.registry.is_host(o))
            })
            .map(|(k, _)| k.clone())
            .collect()
    });
    let n = owed.len();
    for key in owed {
        app.provider.deliveries.enqueue(key, false);
    }
    if n > 0 {
        tracing::info!(queued = n, "redelivering unacknowledged callbacks");
    }
    n
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

/// One attempt at delivering `key`'s current response. Returns when to try again, if
/// it failed and attempts remain.
async fn send(app: &Arc<App>, key: &str, force: bool) -> Option<Duration> {
    let (origin, need) = parse_entry_key(key)?;
    // What the entry holds now: a newer response supersedes what was queued.
    let (response, hash, acknowledged) = app.provider.store.read(|entries| {
        entries.get(key).map(|e| {
            let hash = e.current_hash();
            let acked = e.delivery.delivered_hash == hash;
            (e.response.clone(), hash, acked)
        })
    })?;
    if acknowledged && !force {
        return None;
    }
    let loaded = app.loaded.load_full();
    let peer = loaded.registry.get(origin)?;
    // A principal has nowhere to be called back; it polls or uses rpc mode.
    let address = peer.address.clone()?;
    let keys = peer.keys.clone();
    drop(loaded);
    let cfg = &app.config.callbacks;
    let payload = response
        .as_deref()
        .map(payload_bytes_raw)
        .unwrap_or_default();
    let target = Target {
        name: origin,
        address: &address,
        keys: &keys,
    };
    let path = format!("/agent/needs/{need}");
    let attempt = {
        let q = app
            .provider
            .deliveries
            .queue
            .lock()
            .expect("delivery queue");
        q.attempts.get(key).copied().unwrap_or(0) + 1
    };
    let outcome = tokio::time::timeout(
        cfg.timeout,
        app.client.post(&target, &path, payload.clone()),
    )
    .await;
    let error = match outcome {
        Err(_) => "timeout".to_owned(),
        Ok(Err(e)) => e.to_string(),
        Ok(Ok(reply)) if reply.status == 200 && reply.verified() => {
            app.provider.store.change_lazy(|c| {
                if let Some(mut e) = c.get(key).cloned() {
                    e.delivery.delivered_hash = hash.clone();
                    e.delivery.delivered_at = Some(unix_now());
                    e.delivery.last_error = None;
                    e.delivery.attempts = attempt;
                    c.put(key.to_owned(), e);
                }
            });
            app.provider
                .deliveries
                .queue
                .lock()
                .expect("delivery queue")
                .attempts
                .remove(key);
            app.metrics.callbacks.inc(&[("outcome", "sent")]);
            tracing::info!(
                entry = %key,
                bytes = payload.len(),
                revocation = response.is_none(),
                payload_sha256 = %hash.as_deref().unwrap_or("-"),
                "callback delivered"
            );
            return None;
        }
        Ok(Ok(reply)) if reply.status == 200 => {
            format!("reply signature not verified ({:?})", reply.auth)
        }
        Ok(Ok(reply)) => format!("consumer answered {}", reply.status),
    };
    app.metrics.callbacks.inc(&[("outcome", "failed")]);
    app.quiet.warn(
        "callback_failed",
        &format!("callback to {key} failed (attempt {attempt}): {error}"),
    );
    app.provider.store.change_lazy(|c| {
        if let Some(mut e) = c.get(key).cloned() {
            e.delivery.last_error = Some(error.clone());
            e.delivery.attempts = attempt;
            c.put(key.to_owned(), e);
        }
    });
    let mut q = app
        .provider
        .deliveries
        .queue
        .lock()
        .expect("delivery queue");
    if attempt < cfg.attempts.max(1) {
        q.attempts.insert(key.to_owned(), attempt);
        app.metrics.callbacks.inc(&[("outcome", "retried")]);
        let delay = cfg.backoff * 2u32.saturating_pow(attempt - 1).min(64);
        Some(delay.min(Duration::from_secs(300)))
    } else {
        q.attempts.remove(key);
        tracing::warn!(entry = %key, "callback gave up; the redelivery sweep and the consumer's nag will try again");
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consumers_take_turns_within_their_share() {
        let d = Deliveries::new(8, 2);
        for i in 0..5 {
            d.enqueue(format!("slow:web/n{i}"), true);
        }
        d.enqueue("quick:web/a".into(), true);
        let mut order = Vec::new();
        while let Some((k, _)) = d.next() {
            order.push(k);
        }
        // Two of the slow consumer's (its share), and the quick one's, not blocked.
        order.sort();
        assert_eq!(order, ["quick:web/a", "slow:web/n0", "slow:web/n1"]);
        d.done("slow:web/n0", None);
        assert_eq!(d.next().map(|(k, _)| k).as_deref(), Some("slow:web/n2"));
    }

    #[test]
    fn a_change_during_a_send_sends_again_once() {
        let d = Deliveries::new(8, 2);
        d.enqueue("c:web/x".into(), true);
        let (k, _) = d.next().unwrap();
        d.enqueue(k.clone(), false);
        d.enqueue(k.clone(), false);
        assert!(d.next().is_none(), "not twice at once");
        d.done(&k, None);
        assert_eq!(d.next().map(|(k, _)| k).as_deref(), Some("c:web/x"));
        d.done(&k, None);
        assert!(d.next().is_none());
        assert_eq!(d.backlog(), 0);
    }
}
