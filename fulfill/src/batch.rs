//! Batched requests (docs/protocol.md §11.8): needs that come due together and go to the
//! same capability of the same provider travel in one signed request, so a consumer with
//! thousands of needs pays one signature, one reply check and one round trip per batch
//! instead of per need. Each need still gets its own outcome, exactly what the single
//! endpoint would have answered, and handles it as before.
//!
//! A lane (provider, capability) has at most [`SENDERS_PER_LANE`] batches in flight, and
//! every batch takes one of the provider's `per_provider_concurrency` slots, as a request
//! sent alone does; whatever comes due meanwhile waits for the next batch, and a request
//! due alone goes alone, to the capability's own path. A provider that answers a batch
//! with `404` (one that predates batches, or a capability that takes none) or `413` (a
//! smaller body limit) is sent that capability's needs one by one for [`REFUSAL_MEMORY`].

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use parking_lot::Mutex;
use std::time::Duration;

use bytes::Bytes;
use fort_core::client::{Reply, SignedClient, Target};
use fort_core::wire::{
    batch_body, BatchResults, BATCH_BODY_TARGET, BATCH_SUFFIX, CAPABILITIES_PREFIX, MAX_BATCH_ITEMS,
};
use ssh_key::PublicKey;
use tokio::sync::{oneshot, Semaphore};
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

const SENDERS_PER_LANE: usize = 2;
const REFUSAL_MEMORY: Duration = Duration::from_secs(600);
/// Turns of the runtime a lone request waits for company before it goes alone.
const LONE_WAITS: usize = 8;

/// Where a lane's batches go.
#[derive(Clone)]
pub(crate) struct Destination {
    pub provider: String,
    pub address: String,
    pub keys: Vec<PublicKey>,
    pub capability: String,
    /// The provider's share of requests in flight (`per_provider_concurrency`): a batch
    /// takes one, as a request sent alone does.
    pub slots: Arc<Semaphore>,
}

/// What became of one need's request in a batch.
pub(crate) enum Outcome {
    /// The provider's answer for this item, as if it had been sent alone.
    Reply(Reply),
    /// The batch did not get an answer (transport, timeout, a malformed reply).
    Failed(String),
    /// Send it alone: it was the only one due, or the provider takes no batches for
    /// this capability.
    NotTaken,
}

struct Waiting {
    body: Vec<u8>,
    reply: oneshot::Sender<Outcome>,
}

#[derive(Default)]
struct Lane {
    waiting: VecDeque<Waiting>,
    senders: usize,
}

type LaneKey = (String, String);

#[derive(Default)]
pub(crate) struct Batcher {
    lanes: Mutex<HashMap<LaneKey, Lane>>,
    refused: Mutex<HashMap<LaneKey, Instant>>,
}

impl Batcher {
    /// Whether requests to this provider's capability go in batches now.
    pub fn takes_batches(&self, provider: &str, capability: &str) -> bool {
        let mut refused = self.refused.lock();
        let key = (provider.to_owned(), capability.to_owned());
        match refused.get(&key) {
            Some(until) if *until > Instant::now() => false,
            Some(_) => {
                refused.remove(&key);
                true
            }
            None => true,
        }
    }

    /// Sends one need's request body (a §6.1 object) in the lane's next batch and waits
    /// for its outcome.
    pub async fn submit(
        self: &Arc<Self>,
        client: &SignedClient,
        tasks: &TaskTracker,
        timeout: Duration,
        to: Destination,
        body: Vec<u8>,
    ) -> Outcome {
        let (reply, outcome) = oneshot::channel();
        let lane_key = (to.provider.clone(), to.capability.clone());
        let start_sender = {
            let mut lanes = self.lanes.lock();
            let lane = lanes.entry(lane_key).or_default();
            lane.waiting.push_back(Waiting { body, reply });
            let start = lane.senders < SENDERS_PER_LANE;
            if start {
                lane.senders += 1;
            }
            start
        };
        if start_sender {
            tasks.spawn(self.clone().drain(client.clone(), to, timeout));
        }
        outcome
            .await
            .unwrap_or_else(|_| Outcome::Failed("the batch was dropped".into()))
    }

    /// Sends the lane's waiting requests, a batch at a time, until none wait.
    async fn drain(self: Arc<Self>, client: SignedClient, to: Destination, timeout: Duration) {
        let lane_key = (to.provider.clone(), to.capability.clone());
        let mut lone_waits = 0;
        loop {
            // Needs that came due in the same scheduler pass join this batch.
            tokio::task::yield_now().await;
            let batch = {
                let mut lanes = self.lanes.lock();
                let Some(lane) = lanes.get_mut(&lane_key) else {
                    return;
                };
                let mut batch = Vec::new();
                let mut size = 0;
                while let Some(next) = lane.waiting.front() {
                    let fits = batch.is_empty()
                        || (batch.len() < MAX_BATCH_ITEMS
                            && size + next.body.len() < BATCH_BODY_TARGET);
                    if !fits {
                        break;
                    }
                    size += next.body.len() + 1;
                    batch.push(lane.waiting.pop_front().expect("peeked"));
                }
                // One alone may be the first of many still on their way: they get a few
                // more turns of the runtime to join it.
                if batch.len() == 1 && lone_waits < LONE_WAITS {
                    lone_waits += 1;
                    lane.waiting.extend(batch);
                    continue;
                }
                lone_waits = 0;
                if batch.is_empty() {
                    lane.senders -= 1;
                    if lane.senders == 0 {
                        lanes.remove(&lane_key);
                    }
                    return;
                }
                batch
            };
            // Alone, a request goes as protocol 1.1 has it, to the capability's own path.
            let outcomes = if batch.len() == 1 {
                vec![Outcome::NotTaken]
            } else {
                let _slot = to.slots.acquire().await.ok();
                self.send(&client, &to, timeout, &batch).await
            };
            for (waiting, outcome) in batch.into_iter().zip(outcomes) {
                let _ = waiting.reply.send(outcome);
            }
        }
    }

    async fn send(
        &self,
        client: &SignedClient,
        to: &Destination,
        timeout: Duration,
        batch: &[Waiting],
    ) -> Vec<Outcome> {
        let n = batch.len();
        let body = batch_body("requests", batch.iter().map(|w| w.body.as_slice()));
        let path = format!("{CAPABILITIES_PREFIX}{}{BATCH_SUFFIX}", to.capability);
        let target = Target {
            name: &to.provider,
            address: &to.address,
            keys: &to.keys,
        };
        let all = |f: &dyn Fn() -> Outcome| (0..n).map(|_| f()).collect::<Vec<_>>();
        let reply = match tokio::time::timeout(timeout, client.post(&target, &path, body)).await {
            Err(_) => return all(&|| Outcome::Failed("timeout".into())),
            Ok(Err(e)) => {
                let e = e.to_string();
                return all(&|| Outcome::Failed(e.clone()));
            }
            Ok(Ok(reply)) => reply,
        };
        // 404: no batches here; 413: this provider's body limit is smaller than a batch.
        if matches!(reply.status, 404 | 413) {
            tracing::info!(provider = %to.provider, capability = %to.capability, status = reply.status, "provider takes no batched requests; sending them one by one");
            self.refused.lock().insert(
                (to.provider.clone(), to.capability.clone()),
                Instant::now() + REFUSAL_MEMORY,
            );
            return all(&|| Outcome::NotTaken);
        }
        if reply.status != 200 || !reply.verified() {
            // Refused as a whole (a clock skew, busy, an unverified reply): every item
            // takes the answer, as it would have alone.
            return all(&|| Outcome::Reply(reply.clone()));
        }
        match serde_json::from_slice::<BatchResults>(&reply.body) {
            Ok(r) if r.results.len() == n => r
                .results
                .into_iter()
                .map(|item| {
                    Outcome::Reply(Reply {
                        status: item.status,
                        body: Bytes::from(
                            serde_json::to_vec(&item.body).expect("value serialises"),
                        ),
                        auth: reply.auth.clone(),
                        content_type: Some("application/json".into()),
                        location: None,
                        server_time: None,
                        retry_after: item.retry_after,
                    })
                })
                .collect(),
            _ => all(&|| Outcome::Failed(format!("the provider's batch reply is not {n} results"))),
        }
    }
}
