//! What a need's provider sends (a callback, an rpc reply, a verdict in a `202`), turned
//! into the need's state (docs/protocol.md §7, §11.9): a payload for a need with files or
//! a handler is recorded and applied in the consumer's own time (`apply.rs`); a payload
//! for a side-effect-only need, a revocation and a verdict are decided at once. Whatever is
//! decided is on disk before the provider is answered, so an acknowledged callback
//! survives `kill -9`.

use std::time::Duration;

use fort_core::canonical::sha256_hex;
use fort_core::names::NeedKey;
use fort_core::text::printable;
use fort_core::wire::{unix_now, Delivered};

use crate::files::Written;
use crate::fulfiller::{nag, next_attendance};
use crate::schedule::{backoff, jittered};
use crate::state::Phase;
use crate::{DeliverError, Fulfiller};

/// Longest reason from a provider the state keeps (§11.9).
pub(crate) const PROVIDER_REASON_CHARS: usize = 200;

impl Fulfiller {
    /// What the need's provider sent. Returns whether the need is satisfied now, or
    /// `None` for a payload still being applied (it is applied all the same).
    pub async fn deliver(
        &self,
        key: &NeedKey,
        origin: &str,
        what: Delivered<'_>,
    ) -> Result<Option<bool>, DeliverError> {
        let spec = self.spec(key).ok_or(DeliverError::UnknownNeed)?;
        let decided = match what {
            Delivered::Payload([]) => self.revoked(key, &spec, origin).await,
            Delivered::Payload(payload) if self.side_effect_only(key, &spec) => {
                self.side_effect(key, &spec, origin, payload).await
            }
            Delivered::Payload(payload) => {
                let (recorded, encrypted) = match self.recordable(&spec, payload).await {
                    Ok(recorded) => recorded,
                    Err(reason) => {
                        return self
                            .unrecordable(key, &spec, origin, payload, reason)
                            .await
                            .map(Some)
                    }
                };
                let seq = self
                    .accept(key, origin, &recorded, encrypted)
                    .await?
                    .ok_or(DeliverError::UnknownNeed)?;
                tracing::debug!(need = %key, from = origin, bytes = payload.len(), "payload recorded");
                return Ok(self.outcome_of(key, seq).await);
            }
            Delivered::Refused(reason) => self.refused(key, &spec, origin, reason).await,
            Delivered::Pending(reason) => self.waiting_on(key, &spec, origin, reason).await,
        };
        decided.map(Some)
    }

    /// A revocation: the files stay (the last good credential keeps serving); a payload
    /// still waiting to be applied is dropped.
    async fn revoked(
        &self,
        key: &NeedKey,
        spec: &fort_core::schema::NeedSpec,
        origin: &str,
    ) -> Result<bool, DeliverError> {
        self.supersede(key, Phase::Pending, "revoked by the provider".into())
            .await?;
        tracing::info!(need = %key, from = origin, "payload revoked");
        self.inner.opts.audit.record_caused_by(
            origin,
            fort_core::audit::Event::caused(fort_core::audit::CausedKind::NeedRevoked)
                .need(key.to_string())
                .provider(origin),
        );
        self.after(key, Some(jittered(nag(spec))));
        Ok(false)
    }

    /// A payload for a need with an encrypted file that could not be encrypted to be
    /// recorded: nothing of it is kept, the need is `failed` with the reason (its files
    /// stay as they are), and it is asked again after a back-off.
    async fn unrecordable(
        &self,
        key: &NeedKey,
        spec: &fort_core::schema::NeedSpec,
        origin: &str,
        payload: &[u8],
        reason: String,
    ) -> Result<bool, DeliverError> {
        let digest = sha256_hex(payload);
        tracing::warn!(need = %key, from = origin, bytes = payload.len(), payload_sha256 = %digest, reason = %reason, "payload not applied");
        self.inner.opts.audit.record_caused_by(
            origin,
            fort_core::audit::Event::caused(fort_core::audit::CausedKind::ApplyFailed)
                .need(key.to_string())
                .provider(origin)
                .response(Some(digest))
                .reason(&reason),
        );
        self.supersede(key, Phase::Failed, reason).await?;
        let failures = {
            let mut view = self.inner.view.lock();
            let f = view.failures_mut(key);
            *f += 1;
            *f
        };
        self.after(
            key,
            Some(backoff(self.inner.opts.backoff, failures, nag(spec))),
        );
        Ok(false)
    }

    /// The provider's handler refused the need's request (§11.9): `failed`, with its
    /// reason, asked again after a nag interval; the files stay.
    async fn refused(
        &self,
        key: &NeedKey,
        spec: &fort_core::schema::NeedSpec,
        origin: &str,
        reason: &str,
    ) -> Result<bool, DeliverError> {
        let reason = format!(
            "refused by {origin}: {}",
            printable(reason, PROVIDER_REASON_CHARS)
        );
        tracing::warn!(need = %key, from = origin, reason = %reason, "request refused by the provider's handler");
        self.inner.opts.audit.record_caused_by(
            origin,
            fort_core::audit::Event::caused(fort_core::audit::CausedKind::NeedRefused)
                .need(key.to_string())
                .provider(origin)
                .reason(&reason),
        );
        self.supersede(key, Phase::Failed, reason).await?;
        self.after(key, Some(jittered(nag(spec))));
        Ok(false)
    }

    /// The provider works on it (§11.9): state and payload stay; the reason says why it
    /// waits, and the need is asked again after a nag interval.
    async fn waiting_on(
        &self,
        key: &NeedKey,
        spec: &fort_core::schema::NeedSpec,
        origin: &str,
        reason: &str,
    ) -> Result<bool, DeliverError> {
        let note = format!(
            "{origin} is working on it: {}",
            printable(reason, PROVIDER_REASON_CHARS)
        );
        let key_s = key.to_string();
        let satisfied = self
            .inner
            .store
            .change_durable(|c| {
                let mut st = c.get(&key_s).cloned()?;
                // What is running out stays in front: the operator must still see it.
                let reason = match (st.phase, st.expires_at) {
                    (Phase::Expiring | Phase::Expired, Some(at)) => {
                        format!("{} {}; {note}", st.phase.as_str(), crate::status::when(at))
                    }
                    _ => note.clone(),
                };
                st.last_error = Some(reason);
                let satisfied = st.satisfied;
                c.put(key_s.clone(), st);
                Some(satisfied)
            })
            .await?
            .ok_or(DeliverError::UnknownNeed)?;
        tracing::info!(need = %key, from = origin, note = %note, "provider is working on it");
        self.after(key, Some(jittered(nag(spec))));
        Ok(satisfied)
    }

    /// Records an outcome that supersedes any payload still waiting or being applied.
    async fn supersede(
        &self,
        key: &NeedKey,
        phase: Phase,
        reason: String,
    ) -> Result<(), DeliverError> {
        let key_s = key.to_string();
        let now = unix_now();
        let seq = self
            .inner
            .store
            .change_durable(|c| {
                let mut st = c.get(&key_s).cloned()?;
                st.seq += 1;
                st.inbox = None;
                if st.satisfied {
                    st.satisfied_at = None;
                }
                if st.phase != phase {
                    st.since = now;
                }
                st.satisfied = false;
                st.phase = phase;
                st.last_error = Some(reason.clone());
                let seq = st.seq;
                c.put(key_s.clone(), st);
                Some(seq)
            })
            .await?
            .ok_or(DeliverError::UnknownNeed)?;
        self.publish_outcome(key, seq, false);
        Ok(())
    }

    /// A side-effect-only need: `OK` satisfies it; nothing can take long, so it is
    /// decided at once.
    async fn side_effect(
        &self,
        key: &NeedKey,
        spec: &fort_core::schema::NeedSpec,
        origin: &str,
        payload: &[u8],
    ) -> Result<bool, DeliverError> {
        let digest = sha256_hex(payload);
        let before = self.state(key);
        let ok = payload == b"OK" || payload == b"OK\n";
        let now = unix_now();
        let key_s = key.to_string();
        let state = self
            .inner
            .store
            .change_durable(|c| {
                let mut st = c.get(&key_s).cloned()?;
                st.seq += 1;
                st.inbox = None;
                if ok {
                    self.record_satisfied(&mut st, spec, now, None, &digest, &Written::default());
                } else {
                    if st.phase != Phase::Failed {
                        st.since = now;
                    }
                    if st.satisfied {
                        st.satisfied_at = None;
                    }
                    st.satisfied = false;
                    st.phase = Phase::Failed;
                    // The payload may be a credential sent to the wrong need: only its
                    // size and hash ever reach the log and the state.
                    st.last_error = Some(format!(
                        "the provider sent {} bytes (sha256 {}) instead of OK",
                        payload.len(),
                        &digest[..16]
                    ));
                }
                c.put(key_s.clone(), st.clone());
                Some(st)
            })
            .await?
            .ok_or(DeliverError::UnknownNeed)?;
        self.publish_outcome(key, state.seq, ok);
        if ok {
            self.inner.view.lock().clear_failures(key);
            tracing::info!(need = %key, from = origin, "payload applied");
            self.inner.opts.audit.record_caused_by(
                origin,
                fort_core::audit::Event::caused(fort_core::audit::CausedKind::Applied)
                    .need(key.to_string())
                    .provider(origin)
                    .response(Some(digest.clone())),
            );
            if before.payload_sha256.as_deref() != Some(digest.as_str()) || !before.satisfied {
                self.wake_dependents(key);
            }
            self.after(key, next_attendance(spec, &state, now));
        } else {
            tracing::warn!(need = %key, from = origin, bytes = payload.len(), payload_sha256 = %digest, "payload not applied: not OK");
            self.inner.opts.audit.record_caused_by(
                origin,
                fort_core::audit::Event::caused(fort_core::audit::CausedKind::ApplyFailed)
                    .need(key.to_string())
                    .provider(origin)
                    .response(Some(digest.clone()))
                    .reason("the payload is not OK"),
            );
            let failures = {
                let mut view = self.inner.view.lock();
                let f = view.failures_mut(key);
                *f += 1;
                *f
            };
            self.after(
                key,
                Some(backoff(self.inner.opts.backoff, failures, nag(spec))),
            );
        }
        Ok(ok)
    }

    /// Plans what comes after a payload. The payload may answer an older request (the
    /// protocol cannot say which); a request changed since must still go out at once.
    pub(crate) fn after(&self, key: &NeedKey, next: Option<Duration>) {
        let superseded = self.inner.view.lock().is_unsent(key);
        if superseded {
            self.schedule(key, Some(Duration::ZERO));
        } else {
            self.reschedule(key, next);
        }
    }
}
