//! Sending callbacks (§7): one entry's response in one signed request, or many of one
//! consumer's in a batch (§11.8). Either way a delivery counts only on a verified `200`
//! for that entry, and each entry keeps its own attempts, back-off and delivery record.

use std::sync::Arc;
use std::time::Duration;

use fort_core::audit::{CausedKind, Event};
use fort_core::client::{Reply, Target};
use fort_core::names::parse_entry_key;
use fort_core::wire::{
    batch_body, payload_bytes_raw, unix_now, BatchResults, CallbackItem, BATCH_BODY_TARGET,
    CALLBACKS_PATH,
};
use ssh_key::PublicKey;

use super::state::Notice;
use crate::app::App;

/// What one entry holds for its consumer now: a newer response supersedes what was queued.
struct Owed {
    key: String,
    payload: Vec<u8>,
    hash: Option<String>,
    revocation: bool,
    attempt: u32,
    /// A verdict to send instead of the payload (§11.9).
    notice: Option<Notice>,
}

/// Reads what `key` owes its consumer, unless the consumer acknowledged it already and
/// `force` is off. A payload it has not acknowledged goes before a verdict that keeps it
/// (work under way); a refusal replaces the revocation of the withdrawn response.
fn owed(app: &App, key: &str, force: bool) -> Option<Owed> {
    let (response, hash, payload_owed, notice, notice_owed) =
        app.provider.store.read(|entries| {
            entries.get(key).map(|e| {
                let hash = e.current_hash();
                let refused = matches!(e.notice, Some(Notice::Refused(_)));
                let payload_owed = !refused && e.delivery.delivered_hash != hash;
                (
                    e.response.clone(),
                    hash,
                    payload_owed,
                    e.notice.clone(),
                    e.notice_owed(),
                )
            })
        })?;
    let send_notice = !payload_owed && (notice_owed || force) && notice.is_some();
    if !payload_owed && !send_notice && !force {
        return None;
    }
    let attempt = app
        .provider
        .deliveries
        .queue
        .lock()
        .attempts
        .get(key)
        .copied()
        .unwrap_or(0)
        + 1;
    Some(Owed {
        key: key.to_owned(),
        payload: response
            .as_deref()
            .map(payload_bytes_raw)
            .unwrap_or_default(),
        hash,
        revocation: response.is_none(),
        attempt,
        notice: notice.filter(|_| send_notice),
    })
}

/// The consumer's address and keys; `None` for a principal, which has nowhere to be
/// called back (it polls or uses rpc mode), or a host no longer registered.
fn address_of(app: &App, origin: &str) -> Option<(String, Vec<PublicKey>)> {
    let loaded = app.loaded.load_full();
    let peer = loaded.registry.get(origin)?;
    Some((peer.address.clone()?, peer.keys.clone()))
}

/// One attempt at delivering `key`'s current response. Returns when to try again, if
/// it failed and attempts remain.
pub async fn one(app: &Arc<App>, key: &str, force: bool) -> Option<Duration> {
    let (origin, need) = parse_entry_key(key)?;
    let owed = owed(app, key, force)?;
    if let Some(notice) = &owed.notice {
        let item = notice_item(&need.to_string(), notice);
        return match send_batch(app, origin, vec![item]).await {
            Sent::Results(r) if r[0].status == 200 => {
                acknowledged(app, &owed);
                None
            }
            // Busy: tried again when it says, but as an attempt, so a consumer that
            // never takes it is not called forever.
            Sent::Results(r) if r[0].status == 503 => failed_after(
                app,
                &owed,
                "consumer answered 503 to the verdict",
                Some(busy_for(r[0].retry_after)),
            ),
            Sent::Results(r) => failed(
                app,
                &owed,
                &format!("consumer answered {} to the verdict", r[0].status),
            ),
            Sent::NotTaken(status) => {
                takes_no_verdicts(app, &owed, status);
                None
            }
            Sent::Failed(e) => failed(app, &owed, &e),
        };
    }
    let (address, keys) = address_of(app, origin)?;
    let target = Target {
        name: origin,
        address: &address,
        keys: &keys,
    };
    let path = format!("/agent/needs/{need}");
    let outcome = tokio::time::timeout(
        app.config.callbacks.timeout,
        app.client
            .post_with(&target, &path, owed.payload.clone(), &checkpoint(app)),
    )
    .await;
    let error = match outcome {
        Err(_) => "timeout".to_owned(),
        Ok(Err(e)) => e.to_string(),
        Ok(Ok(reply)) if reply.status == 200 && reply.verified() => {
            acknowledged(app, &owed);
            return None;
        }
        Ok(Ok(reply)) => refusal(&reply),
    };
    failed(app, &owed, &error)
}

fn refusal(reply: &Reply) -> String {
    if reply.status == 200 {
        format!("reply signature not verified ({:?})", reply.auth)
    } else {
        format!("consumer answered {}", reply.status)
    }
}

/// One attempt at delivering several of `origin`'s entries in one batch. Returns, for
/// every key, when to try it again, if ever. Keys that did not fit, and all of them when
/// the consumer answers the batch with `404` or `413`, are queued again (to go one by one
/// after a refusal); one that is left alone goes alone.
pub async fn batch(
    app: &Arc<App>,
    origin: &str,
    keys: Vec<(String, bool)>,
) -> Vec<(String, Option<Duration>)> {
    let mut outcomes = Vec::with_capacity(keys.len());
    let mut later = Vec::new();
    let mut items: Vec<Vec<u8>> = Vec::new();
    let mut owed_items = Vec::new();
    let mut notices = Vec::new();
    let mut size = 0;
    for (key, force) in keys {
        let Some(owed) = owed(app, &key, force) else {
            outcomes.push((key, None));
            continue;
        };
        let Some((_, need)) = parse_entry_key(&key) else {
            outcomes.push((key, None));
            continue;
        };
        // Verdicts travel in batches of their own: a consumer that predates them refuses
        // the batch, and must still get its payloads.
        if owed.notice.is_some() {
            notices.push((owed, force));
            continue;
        }
        // Payload bytes are a JSON string's content or compact JSON: always UTF-8.
        let Ok(payload) = String::from_utf8(owed.payload.clone()) else {
            let retry = failed(app, &owed, "payload is not UTF-8");
            outcomes.push((key, retry));
            continue;
        };
        // Sized as sent: escaping can make a payload several times longer.
        let item = serde_json::to_vec(&CallbackItem {
            need: need.to_string(),
            payload: Some(payload),
            ..Default::default()
        })
        .expect("item serialises");
        if !items.is_empty() && size + item.len() > BATCH_BODY_TARGET {
            outcomes.push((key.clone(), None));
            later.push((key, force));
            continue;
        }
        size += item.len() + 1;
        items.push(item);
        owed_items.push((owed, force));
    }
    if owed_items.is_empty() {
        // Only verdicts were owed.
    } else if owed_items.len() == 1 {
        let (owed, force) = owed_items.pop().expect("one");
        let retry = one(app, &owed.key, force).await;
        outcomes.push((owed.key, retry));
    } else {
        match send_batch(app, origin, items).await {
            Sent::Results(results) => {
                for ((owed, _), result) in owed_items.into_iter().zip(results) {
                    let retry = item_outcome(app, &owed, &result, "in a batch");
                    outcomes.push((owed.key, retry));
                }
            }
            Sent::NotTaken(status) => {
                app.provider.deliveries.batches_refused_by(origin);
                tracing::info!(consumer = %origin, status, "consumer takes no batched callbacks; sending them one by one");
                for (owed, _) in owed_items {
                    outcomes.push((owed.key.clone(), None));
                    later.push((owed.key, true));
                }
            }
            Sent::Failed(error) => {
                for (owed, _) in owed_items {
                    let retry = failed(app, &owed, &error);
                    outcomes.push((owed.key, retry));
                }
            }
        }
    }
    outcomes.extend(verdicts(app, origin, notices).await);
    // Still in flight, so these go again once this send is done with.
    for (key, force) in later {
        app.provider.deliveries.enqueue(key, force);
    }
    outcomes
}

/// What one item's result in a batch reply means for its entry: acknowledged, or a
/// failed attempt; a busy consumer's (`503` with `retry_after`) is tried again when it
/// says rather than after the back-off, and counts as an attempt all the same.
fn item_outcome(
    app: &App,
    owed: &Owed,
    result: &fort_core::wire::ItemResult,
    what: &str,
) -> Option<Duration> {
    match (result.status, result.retry_after) {
        (200, _) => {
            acknowledged(app, owed);
            None
        }
        (503, Some(after)) => failed_after(
            app,
            owed,
            &format!("consumer answered 503 {what}"),
            Some(busy_for(Some(after))),
        ),
        (status, _) => failed(app, owed, &format!("consumer answered {status} {what}")),
    }
}

/// How long to wait after a consumer's `503`: its `Retry-After`, within 1 s to 1 min.
fn busy_for(retry_after: Option<u64>) -> Duration {
    Duration::from_secs(retry_after.unwrap_or(5).clamp(1, 60))
}

/// The verdicts owed to `origin`, sent now in one batch of their own (a lone one through
/// [`one`]). Sending them later instead would hand them back to the queue, which would
/// hand them straight back here: a loop that never sends.
async fn verdicts(
    app: &Arc<App>,
    origin: &str,
    mut notices: Vec<(Owed, bool)>,
) -> Vec<(String, Option<Duration>)> {
    if notices.len() <= 1 {
        let mut outcomes = Vec::new();
        if let Some((owed, force)) = notices.pop() {
            let retry = one(app, &owed.key, force).await;
            outcomes.push((owed.key, retry));
        }
        return outcomes;
    }
    let items = notices
        .iter()
        .filter_map(|(owed, _)| {
            let (_, need) = parse_entry_key(&owed.key)?;
            Some(notice_item(&need.to_string(), owed.notice.as_ref()?))
        })
        .collect();
    match send_batch(app, origin, items).await {
        Sent::Results(results) if results.len() == notices.len() => notices
            .into_iter()
            .zip(results)
            .map(|((owed, _), result)| {
                let retry = item_outcome(app, &owed, &result, "to the verdict");
                (owed.key, retry)
            })
            .collect(),
        Sent::Results(_) => notices
            .into_iter()
            .map(|(owed, _)| {
                let retry = failed(app, &owed, "consumer answered a different number of items");
                (owed.key, retry)
            })
            .collect(),
        Sent::NotTaken(status) => notices
            .into_iter()
            .map(|(owed, _)| {
                takes_no_verdicts(app, &owed, status);
                (owed.key, None)
            })
            .collect(),
        Sent::Failed(error) => notices
            .into_iter()
            .map(|(owed, _)| {
                let retry = failed(app, &owed, &error);
                (owed.key, retry)
            })
            .collect(),
    }
}

enum Sent {
    /// A verified `200` with one result per item.
    Results(Vec<fort_core::wire::ItemResult>),
    /// The whole batch answered `404` (the consumer takes no batches) or `413` (its body
    /// limit is smaller than a batch).
    NotTaken(u16),
    Failed(String),
}

async fn send_batch(app: &Arc<App>, origin: &str, items: Vec<Vec<u8>>) -> Sent {
    if items.is_empty() {
        return Sent::Results(Vec::new());
    }
    let Some((address, keys)) = address_of(app, origin) else {
        return Sent::Failed(format!("{origin} has no address"));
    };
    let n = items.len();
    let body = batch_body("callbacks", items.iter().map(Vec::as_slice));
    let target = Target {
        name: origin,
        address: &address,
        keys: &keys,
    };
    let outcome = tokio::time::timeout(
        app.config.callbacks.timeout,
        app.client
            .post_with(&target, CALLBACKS_PATH, body, &checkpoint(app)),
    )
    .await;
    match outcome {
        Err(_) => Sent::Failed("timeout".into()),
        Ok(Err(e)) => Sent::Failed(e.to_string()),
        // 400: an agent from before verdicts cannot parse an item that carries one.
        Ok(Ok(reply)) if matches!(reply.status, 400 | 404 | 413) => Sent::NotTaken(reply.status),
        Ok(Ok(reply)) if reply.status == 200 && reply.verified() => {
            match serde_json::from_slice::<BatchResults>(&reply.body) {
                Ok(r) if r.results.len() == n => Sent::Results(r.results),
                _ => Sent::Failed(format!("the consumer's batch reply is not {n} results")),
            }
        }
        Ok(Ok(reply)) => Sent::Failed(refusal(&reply)),
    }
}

/// A verdict as a callback item (§11.9).
fn notice_item(need: &str, notice: &Notice) -> Vec<u8> {
    let (refused, pending) = match notice {
        Notice::Refused(r) => (Some(r.clone()), None),
        Notice::Pending(r) => (None, Some(r.clone())),
    };
    serde_json::to_vec(&CallbackItem {
        need: need.to_owned(),
        refused,
        pending,
        ..Default::default()
    })
    .expect("item serialises")
}

/// The consumer cannot take verdicts in callbacks (`batches = false`, or an agent that
/// predates them): it learns them from the answer to its next request instead, so this
/// one is not tried again.
fn takes_no_verdicts(app: &App, owed: &Owed, status: u16) {
    let key = &owed.key;
    tracing::info!(entry = %key, status, "consumer takes no verdicts in callbacks; it gets this one with its next answer");
    let hash = owed.notice.as_ref().map(Notice::hash);
    app.provider.store.change_lazy(|c| {
        if let Some(mut e) = c.get(key).cloned() {
            e.delivery.delivered_notice = hash.clone();
            e.delivery.last_error = Some(format!(
                "the consumer answered {status} to a verdict; it learns it with its next answer"
            ));
            c.put(key.to_owned(), e);
        }
    });
    app.provider.deliveries.queue.lock().attempts.remove(key);
}

/// A verified `200` for this entry: recorded lazily (a lost record only means one more
/// delivery of the same payload). A verdict owed after the payload is queued next.
fn acknowledged(app: &App, owed: &Owed) {
    let key = &owed.key;
    let notice_next = app.provider.store.change_lazy(|c| {
        let mut e = c.get(key).cloned()?;
        match &owed.notice {
            Some(n) => e.delivery.delivered_notice = Some(n.hash()),
            None => {
                e.delivery.delivered_hash = owed.hash.clone();
                e.delivery.delivered_at = Some(unix_now());
            }
        }
        e.delivery.last_error = None;
        e.delivery.attempts = owed.attempt;
        let next = owed.notice.is_none() && e.notice_owed();
        c.put(key.to_owned(), e);
        Some(next)
    });
    if notice_next == Some(true) {
        app.provider.deliveries.enqueue(key.clone(), false);
    }
    app.provider.deliveries.queue.lock().attempts.remove(key);
    app.metrics.callbacks.inc(&[("outcome", "sent")]);
    let event = match &owed.notice {
        Some(notice) => Event::caused(CausedKind::VerdictDelivered).reason(notice.reason()),
        None if owed.revocation => Event::caused(CausedKind::RevocationDelivered),
        None => Event::caused(CausedKind::Delivered).response(owed.hash.clone()),
    };
    app.audit.record_for_entry(key, event.entry(key));
    match &owed.notice {
        Some(notice) => tracing::info!(entry = %key, verdict = ?notice, "verdict delivered"),
        None => tracing::info!(
            entry = %key,
            bytes = owed.payload.len(),
            revocation = owed.revocation,
            payload_sha256 = %owed.hash.as_deref().unwrap_or("-"),
            "callback delivered"
        ),
    }
}

/// A failed attempt: recorded on the entry; returns when to try again, if attempts remain.
fn failed(app: &App, owed: &Owed, error: &str) -> Option<Duration> {
    failed_after(app, owed, error, None)
}

/// A failed attempt, tried again after `wait` (a busy consumer's word) instead of the
/// back-off, if attempts remain.
fn failed_after(app: &App, owed: &Owed, error: &str, wait: Option<Duration>) -> Option<Duration> {
    let key = &owed.key;
    let attempt = owed.attempt;
    let cfg = &app.config.callbacks;
    app.metrics.callbacks.inc(&[("outcome", "failed")]);
    app.quiet.warn(
        "callback_failed",
        &format!("callback to {key} failed (attempt {attempt}): {error}"),
    );
    app.provider.store.change_lazy(|c| {
        if let Some(mut e) = c.get(key).cloned() {
            e.delivery.last_error = Some(error.to_owned());
            e.delivery.attempts = attempt;
            c.put(key.to_owned(), e);
        }
    });
    let mut q = app.provider.deliveries.queue.lock();
    if attempt < cfg.attempts.max(1) {
        q.attempts.insert(key.to_owned(), attempt);
        app.metrics.callbacks.inc(&[("outcome", "retried")]);
        let delay = cfg
            .backoff
            .saturating_mul(2u32.saturating_pow(attempt - 1).min(64));
        Some(wait.unwrap_or(delay).min(Duration::from_secs(300)))
    } else {
        q.attempts.remove(key);
        tracing::warn!(entry = %key, "callback gave up; the redelivery sweep and the consumer's nag will try again");
        None
    }
}

/// The header that hands the consumer this host's latest audit checkpoint to witness
/// (docs/protocol.md §12.3a); none before the first.
fn checkpoint(app: &App) -> Vec<(&'static str, String)> {
    app.audit
        .latest_checkpoint()
        .map(|value| (fort_core::audit::CHECKPOINT_HEADER, value))
        .into_iter()
        .collect()
}
