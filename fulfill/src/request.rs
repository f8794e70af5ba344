//! Asking a provider for one need (§6.1): alone, or in its capability's next batch
//! (§11.8), and what each answer means for the need: accepted, answered at once (rpc),
//! refused, busy (come back after `Retry-After`), or not reached (back off).

use std::sync::Arc;
use std::time::Duration;

use fort_core::client::Target;
use fort_core::names::NeedKey;
use fort_core::text::printable;
use fort_core::wire::{unix_now, AsyncBody, Delivered};
use tokio::sync::Semaphore;

use crate::batch::{Destination, Outcome};
use crate::fulfiller::nag;
use crate::schedule::{backoff, jittered};
use crate::state::Phase;
use crate::Fulfiller;

impl Fulfiller {
    pub(crate) async fn request(
        &self,
        key: &NeedKey,
        resolved: serde_json::Value,
        resolved_hash: String,
        renew: bool,
    ) {
        let Some(spec) = self.spec(key) else { return };
        let spec = &spec;
        let registry = self.inner.view.lock().registry.clone();
        // Only the home is ever asked (§11.13).
        let home = crate::home::home_of(spec, &self.state(key)).to_owned();
        let Some(peer) = registry.get(&home) else {
            return;
        };
        let Some(address) = peer.address.as_deref() else {
            return;
        };
        // A failing home of needs with several providers is probed by one request per
        // probe interval; this need's is held back, and counts as failed with the home's
        // last error (§11.13). A need naming one provider asks as it always did.
        if spec.from.several() {
            if let Err(error) = self.may_ask(&home, nag(spec)) {
                return self.transport_failure(key, spec, &home, error).await;
            }
        }
        let batched =
            self.inner.opts.batches && self.inner.batcher.takes_batches(&home, key.kind());
        // One of the provider's slots per request in flight: a batch takes it when it is
        // sent (batch.rs), a request going alone takes it here.
        let limit = {
            let mut p = self.inner.providers.lock();
            p.entry(home.clone())
                .or_insert_with(|| {
                    Arc::new(Semaphore::new(
                        self.inner.opts.per_provider_concurrency.max(1),
                    ))
                })
                .clone()
        };
        let _slot = if batched {
            None
        } else {
            Some(limit.acquire().await.expect("semaphore open"))
        };
        // Changed while waiting for a slot: the next attendance builds the new request.
        if self.spec(key).as_ref() != Some(spec) {
            self.schedule(key, Some(Duration::ZERO));
            return;
        }
        self.inner.view.lock().unsent.remove(key);
        let body = serde_json::to_vec(&AsyncBody {
            need: key.to_string(),
            request: Some(resolved),
            release: false,
            renew,
        })
        .expect("body serialises");
        // A callback that arrives while this request is out (its number moves on) is newer
        // than any verdict the answer carries.
        let sent_seq = self.state(key).seq;
        let sent_at = unix_now();
        self.update_lazy(key, |st| {
            st.last_sought = Some(sent_at);
            st.attempts += 1;
            if renew {
                st.renewal_sought_at = Some(sent_at);
            }
            true
        });
        let destination = Destination {
            provider: home.clone(),
            address: address.to_owned(),
            keys: peer.keys.clone(),
            capability: key.kind().to_owned(),
            slots: limit.clone(),
        };
        let outcome = if batched {
            self.inner
                .batcher
                .submit(
                    &self.inner.client,
                    &self.inner.tasks,
                    self.inner.opts.request_timeout,
                    destination.clone(),
                    body.clone(),
                )
                .await
        } else {
            Outcome::NotTaken
        };
        let outcome = match outcome {
            Outcome::Reply(r) => Ok(Ok(r)),
            Outcome::Failed(e) => Ok(Err(e)),
            Outcome::NotTaken => {
                let _slot = if batched {
                    Some(limit.acquire().await.expect("semaphore open"))
                } else {
                    None
                };
                let target = Target {
                    name: &destination.provider,
                    address: &destination.address,
                    keys: &destination.keys,
                };
                let path = format!("/agent/capabilities/{}", key.kind());
                tokio::time::timeout(
                    self.inner.opts.request_timeout,
                    self.inner.client.post(&target, &path, body),
                )
                .await
                .map(|r| r.map_err(|e| e.to_string()))
            }
        };
        if self.superseded(key) {
            // Changed while in flight: this outcome is about the old request.
            self.schedule(key, Some(Duration::ZERO));
            return;
        }
        let reply = match outcome {
            Err(_) => {
                return self
                    .transport_failure(key, spec, &home, "timeout".into())
                    .await
            }
            Ok(Err(e)) => return self.transport_failure(key, spec, &home, e).await,
            Ok(Ok(r)) => r,
        };
        if reply.status < 500 || reply.retry_after.is_some() {
            // Busy or refusing is answering: the home is up (§11.13).
            self.provider_answered(&home);
        }
        // Busy or over its share: it said when to come back; that is when it is asked,
        // with a little spread so a fleet does not come back in step.
        if matches!(reply.status, 429 | 503) {
            if let Some(after) = reply.retry_after {
                let after = after.min(spec.nag_seconds).max(1);
                let wait = Duration::from_secs(after)
                    + Duration::from_millis(rand::random::<u64>() % 1000);
                tracing::debug!(need = %key, from = %home, status = reply.status, retry_in = ?wait, "provider asked to come back later");
                self.record_reason(
                    key,
                    format!("provider busy ({}); asking again in {after}s", reply.status),
                );
                self.schedule(key, Some(wait));
                return;
            }
        }
        if reply.status >= 500 {
            let error = format!("provider answered {}", reply.status);
            return self.transport_failure(key, spec, &home, error).await;
        }
        self.inner.view.lock().failures.remove(key);
        // A signed 2xx from the home: it serves this need (§11.13, `served_by`).
        let confirms = (200..300).contains(&reply.status) && reply.verified();
        match reply.status {
            202 => {
                tracing::debug!(need = %key, from = %home, "request accepted");
                // The provider's handler already has a verdict on this very request
                // (§11.9): it is what the callback would have said.
                let accepted: fort_core::wire::Accepted =
                    serde_json::from_slice(&reply.body).unwrap_or_default();
                let verdict = if let Some(reason) = &accepted.refused {
                    Some(Delivered::Refused(reason))
                } else {
                    accepted.pending.as_deref().map(Delivered::Pending)
                };
                if self.state(key).seq != sent_seq {
                    // The callback already said what became of the need.
                    self.update_lazy(key, |st| {
                        st.sent_sha256 = Some(resolved_hash.clone());
                        st.home_confirmed |= confirms && st.from == home;
                        true
                    });
                    return;
                }
                if let Some(verdict) = verdict.filter(|_| reply.verified()) {
                    self.update_lazy(key, |st| {
                        st.sent_sha256 = Some(resolved_hash.clone());
                        st.home_confirmed |= confirms && st.from == home;
                        true
                    });
                    if let Err(e) = self.deliver(key, &home, verdict).await {
                        tracing::warn!(need = %key, error = %e, "verdict not recorded");
                    }
                    return;
                }
                self.update_lazy(key, |st| {
                    st.sent_sha256 = Some(resolved_hash);
                    st.home_confirmed |= confirms && st.from == home;
                    if matches!(st.phase, Phase::Failed | Phase::Waiting) {
                        st.phase = Phase::Pending;
                        st.since = sent_at;
                    }
                    if st.phase == Phase::Pending {
                        st.last_error = None;
                    }
                    true
                });
                self.schedule(key, Some(jittered(nag(spec))));
            }
            200..=299 if reply.verified() => {
                // An rpc-mode capability answers at once: treat the body as a callback.
                self.update_lazy(key, |st| {
                    st.sent_sha256 = Some(resolved_hash);
                    st.home_confirmed |= confirms && st.from == home;
                    true
                });
                if let Err(e) = self
                    .deliver(key, &home, Delivered::Payload(&reply.body))
                    .await
                {
                    tracing::warn!(need = %key, error = %e, "rpc reply not recorded; asking again");
                    self.schedule(key, Some(self.inner.opts.backoff));
                }
            }
            200..=299 => {
                self.set_phase(
                    key,
                    Phase::Failed,
                    Some(format!(
                        "response signature not verified ({:?})",
                        reply.auth
                    )),
                );
                self.schedule(key, Some(jittered(nag(spec))));
            }
            status => {
                let detail = serde_json::from_slice::<fort_core::wire::ErrorBody>(&reply.body)
                    .ok()
                    .and_then(|b| b.message.or(Some(b.error)))
                    .unwrap_or_default();
                // Quoted from a peer: made printable and bounded before it is stored.
                let mut error = format!(
                    "provider answered {status}: {}",
                    printable(&detail, crate::deliver::PROVIDER_REASON_CHARS)
                );
                if let Some(server) = reply.server_time {
                    error = format!("clock skew: provider time {server}, ours {}", unix_now());
                }
                tracing::warn!(need = %key, from = %home, %error, "request refused");
                self.set_phase(key, Phase::Failed, Some(error));
                self.schedule(key, Some(jittered(nag(spec))));
            }
        }
    }

    /// The home did not answer: back off, or move the need to another of its providers
    /// once the home has failed long enough (§11.13), and ask the new home at once.
    async fn transport_failure(
        &self,
        key: &NeedKey,
        spec: &fort_core::schema::NeedSpec,
        home: &str,
        error: String,
    ) {
        let error = printable(&error, 300);
        if let Some(next) = self.home_failed(key, spec, home, &error).await {
            tracing::info!(need = %key, from = %next, "asking the new home");
            self.schedule(key, Some(Duration::ZERO));
            return;
        }
        let failures = {
            let mut view = self.inner.view.lock();
            let f = view.failures.entry(key.clone()).or_insert(0);
            *f += 1;
            *f
        };
        let delay = backoff(self.inner.opts.backoff, failures, nag(spec));
        tracing::info!(need = %key, from = %home, error = %error, retry_in = ?delay, "request failed");
        self.record_reason(key, error);
        self.schedule(key, Some(delay));
    }

    /// Records why asking did not work, keeping the phase (a transport failure leaves a
    /// satisfied need satisfied and a pending one pending).
    fn record_reason(&self, key: &NeedKey, reason: String) {
        self.update_lazy(key, |st| {
            // What is running out stays in the reason: an operator reading "cannot
            // connect" must still learn that the credential expires (or has).
            let reason = match (st.phase, st.expires_at) {
                (Phase::Expired, Some(at)) => {
                    format!("expired at {}; {reason}", crate::status::when(at))
                }
                (Phase::Expiring, Some(at)) => {
                    format!("expires at {}; {reason}", crate::status::when(at))
                }
                _ => reason,
            };
            let changed = st.last_error.as_deref() != Some(reason.as_str());
            st.last_error = Some(reason);
            changed
        });
    }
}
