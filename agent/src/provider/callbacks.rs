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

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::Arc;

use parking_lot::Mutex;
use std::time::Duration;

use fort_core::names::parse_entry_key;
use fort_core::wire::MAX_BATCH_ITEMS;
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
pub(super) struct Queue {
    consumers: HashMap<String, ConsumerQueue>,
    /// Consumers with queued keys, served in turn.
    turn: VecDeque<String>,
    /// Queued keys, and whether each must be sent even if already acknowledged (a run
    /// decided to call it back: its consumer asked again).
    queued: HashMap<String, bool>,
    /// Being sent now; `Some(force)` when it changed meanwhile and must go again.
    in_flight: HashMap<String, Option<bool>>,
    /// Failed attempts so far, per key.
    pub(super) attempts: HashMap<String, u32>,
    /// Retries waiting for their time.
    retries: BTreeMap<(Instant, u64), String>,
    retry_seq: u64,
    /// Consumers that take batched callbacks (§11.8): they sent batched requests, and
    /// have not answered a batch `404` since.
    batching: HashSet<String>,
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
    pub(super) queue: Mutex<Queue>,
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
            let mut q = self.queue.lock();
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
        let q = self.queue.lock();
        q.queued.len() + q.in_flight.len()
    }

    /// A consumer takes batched callbacks from now on.
    pub fn batches_accepted_by(&self, origin: &str) {
        let mut q = self.queue.lock();
        if !q.batching.contains(origin) {
            q.batching.insert(origin.to_owned());
        }
    }

    /// A consumer answered a batch with `404`: it is sent one callback at a time.
    pub fn batches_refused_by(&self, origin: &str) {
        self.queue.lock().batching.remove(origin);
    }

    /// The next keys to send, from the next consumer in turn with room in its share: up
    /// to a batch for a consumer that takes batches, else one.
    fn next(&self) -> Option<(String, Vec<(String, bool)>)> {
        let mut q = self.queue.lock();
        for _ in 0..q.turn.len() {
            let origin = q.turn.pop_front()?;
            let share = self.per_consumer;
            let most = if q.batching.contains(&origin) {
                MAX_BATCH_ITEMS
            } else {
                1
            };
            let Some(c) = q.consumers.get_mut(&origin) else {
                continue;
            };
            c.in_turn = false;
            if c.active >= share {
                // Its turn comes again when one of its sends ends (`done`).
                continue;
            }
            let n = c.keys.len().min(most);
            if n == 0 {
                continue;
            }
            let keys: Vec<String> = c.keys.drain(..n).collect();
            c.active += 1;
            q.take_turn(&origin);
            let mut taken = Vec::with_capacity(keys.len());
            for key in keys {
                let force = q.queued.remove(&key).unwrap_or(false);
                q.in_flight.insert(key.clone(), None);
                taken.push((key, force));
            }
            return Some((origin, taken));
        }
        None
    }

    /// A send to `origin` ended: for each of its keys, when to try again (a failure within
    /// the attempts), if ever.
    fn done(&self, origin: &str, outcomes: Vec<(String, Option<Duration>)>) {
        let again: Vec<(String, bool)> = {
            let mut q = self.queue.lock();
            let gone = q.consumers.get_mut(origin).is_some_and(|c| {
                c.active -= 1;
                c.keys.is_empty() && c.active == 0
            });
            if gone {
                q.consumers.remove(origin);
            } else {
                q.take_turn(origin);
            }
            let mut again = Vec::new();
            for (key, retry_in) in outcomes {
                let changed = q.in_flight.remove(&key).flatten();
                // Changed while being sent: it goes again as its turn comes; a retry
                // would only duplicate it.
                match (retry_in, changed) {
                    (_, Some(force)) => again.push((key, force)),
                    (Some(delay), None) => {
                        q.retry_seq += 1;
                        let seq = q.retry_seq;
                        q.retries.insert((Instant::now() + delay, seq), key);
                    }
                    (None, None) => {}
                }
            }
            again
        };
        for (key, force) in again {
            self.enqueue(key, force);
        }
        self.wake.notify_one();
    }

    /// Moves retries whose time has come back into the queue; returns when the next is due.
    fn due_retries(&self) -> Option<Instant> {
        let now = Instant::now();
        let due: Vec<String> = {
            let mut q = self.queue.lock();
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
        let (origin, keys) = next;
        let outcomes = if keys.len() == 1 {
            let (key, force) = keys.into_iter().next().expect("one key");
            let retry = super::send::one(&app, &key, force).await;
            vec![(key, retry)]
        } else {
            super::send::batch(&app, &origin, keys).await
        };
        d.done(&origin, outcomes);
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
        while let Some((_, keys)) = d.next() {
            order.extend(keys.into_iter().map(|(k, _)| k));
        }
        // Two of the slow consumer's (its share), and the quick one's, not blocked.
        order.sort();
        assert_eq!(order, ["quick:web/a", "slow:web/n0", "slow:web/n1"]);
        d.done("slow", vec![("slow:web/n0".into(), None)]);
        assert_eq!(first(&d).as_deref(), Some("slow:web/n2"));
    }

    #[test]
    fn a_change_during_a_send_sends_again_once() {
        let d = Deliveries::new(8, 2);
        d.enqueue("c:web/x".into(), true);
        let k = first(&d).unwrap();
        d.enqueue(k.clone(), false);
        d.enqueue(k.clone(), false);
        assert!(d.next().is_none(), "not twice at once");
        d.done("c", vec![(k.clone(), None)]);
        assert_eq!(first(&d).as_deref(), Some("c:web/x"));
        d.done("c", vec![(k.clone(), None)]);
        assert!(d.next().is_none());
        assert_eq!(d.backlog(), 0);
    }

    fn first(d: &Deliveries) -> Option<String> {
        d.next().map(|(_, keys)| keys[0].0.clone())
    }

    #[test]
    fn a_consumer_that_takes_batches_gets_its_keys_together_within_its_share() {
        let d = Deliveries::new(8, 1);
        d.batches_accepted_by("b");
        for i in 0..300 {
            d.enqueue(format!("b:web/n{i:03}"), false);
        }
        d.enqueue("one:web/a".into(), false);
        d.enqueue("one:web/b".into(), false);
        let (origin, keys) = d.next().unwrap();
        assert_eq!((origin.as_str(), keys.len()), ("b", MAX_BATCH_ITEMS));
        // The one-at-a-time consumer is next, one key, and the batching consumer has no
        // room left in its share of one send.
        let (origin, keys) = d.next().unwrap();
        assert_eq!((origin.as_str(), keys.len()), ("one", 1));
        assert!(d.next().is_none());
        d.done("b", keys_of(MAX_BATCH_ITEMS, Some(Duration::from_secs(60))));
        let (origin, keys) = d.next().unwrap();
        assert_eq!((origin.as_str(), keys.len()), ("b", 300 - MAX_BATCH_ITEMS));
        d.batches_refused_by("b");
        d.enqueue("b:web/late".into(), false);
        d.done("b", Vec::new());
        let (_, keys) = d.next().unwrap();
        assert_eq!(keys.len(), 1, "one at a time after a refusal");
    }

    fn keys_of(n: usize, retry: Option<Duration>) -> Vec<(String, Option<Duration>)> {
        (0..n).map(|i| (format!("b:web/n{i:03}"), retry)).collect()
    }
}
