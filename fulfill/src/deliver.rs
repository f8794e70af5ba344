//! Applying a payload from a need's provider (a callback, or an rpc reply): files first
//! (docs/protocol.md §11.3), then the handler, or the `OK` rule for side-effect-only needs
//! (§7); the outcome is durable before the provider is answered, so an acknowledged
//! callback survives `kill -9`. Units restart once per round, only for changed files.

use std::time::Duration;

use base64::Engine;
use fort_core::canonical::sha256_hex;
use fort_core::names::NeedKey;
use fort_core::process::{run, RunSpec};
use fort_core::wire::unix_now;

use crate::files::Written;
use crate::fulfiller::{nag, next_attendance, renewal_phase, STDERR_IN_LOG};
use crate::schedule::{backoff, jittered};
use crate::state::Phase;
use crate::{DeliverError, Fulfiller};

impl Fulfiller {
    /// A payload from the need's provider. Returns whether the need is now satisfied.
    pub async fn deliver(
        &self,
        key: &NeedKey,
        origin: &str,
        payload: &[u8],
    ) -> Result<bool, DeliverError> {
        let spec = self.spec(key).ok_or(DeliverError::UnknownNeed)?;
        let lock = {
            let mut locks = self.inner.need_locks.lock();
            locks.entry(key.clone()).or_default().clone()
        };
        // One run per need at a time. A provider sending callbacks faster than the
        // handler runs is told to come back, rather than holding request slots.
        let Ok(_one_run) = tokio::time::timeout(Duration::from_secs(5), lock.lock()).await else {
            return Err(DeliverError::Busy);
        };
        let digest = sha256_hex(payload);
        let before = self.state(key);
        if payload.is_empty() {
            // A revocation: the files stay (the last good credential keeps serving).
            self.set_outcome(
                key,
                false,
                Phase::Pending,
                Some("revoked by the provider".into()),
            )
            .await?;
            tracing::info!(need = %key, from = origin, "payload revoked");
            self.after(key, &spec, Some(jittered(nag(&spec))));
            return Ok(false);
        }
        match self.apply(key, &spec, origin, payload).await {
            Err(reason) => {
                self.set_outcome(key, false, Phase::Failed, Some(reason.clone()))
                    .await?;
                tracing::warn!(need = %key, from = origin, bytes = payload.len(), payload_sha256 = %digest, reason = %reason, "payload not applied");
                let failures = {
                    let mut view = self.inner.view.lock();
                    let f = view.failures_mut(key);
                    *f += 1;
                    *f
                };
                self.after(
                    key,
                    &spec,
                    Some(backoff(self.inner.opts.backoff, failures, nag(&spec))),
                );
                Ok(false)
            }
            Ok(written) => {
                let now = unix_now();
                let expires_at = crate::expiry::expiry(payload);
                let keep_payload = self.inner.view.lock().referenced.contains(key);
                let key_s = key.to_string();
                let state = self
                    .inner
                    .store
                    .change_durable(|c| {
                        let mut st = c.get(&key_s).cloned()?;
                        if !st.satisfied {
                            st.satisfied_at = Some(now);
                            st.attempts = 0;
                        }
                        st.satisfied = true;
                        st.expires_at = expires_at;
                        let phase = renewal_phase(&spec, &st, now).unwrap_or(Phase::Satisfied);
                        if st.phase != phase {
                            st.since = now;
                        }
                        st.phase = phase;
                        st.last_error = match (phase, expires_at) {
                            (Phase::Expired, Some(at)) => {
                                Some(format!("the payload received expired at {at}"))
                            }
                            (Phase::Expiring, Some(at)) => {
                                Some(format!("the payload received expires at {at}"))
                            }
                            _ => None,
                        };
                        st.payload_sha256 = Some(digest.clone());
                        st.received += 1;
                        st.received_at = Some(now);
                        st.files = written.files.clone();
                        st.payload = keep_payload
                            .then(|| base64::engine::general_purpose::STANDARD.encode(payload));
                        c.put(key_s.clone(), st.clone());
                        Some(st)
                    })
                    .await?;
                let Some(state) = state else {
                    return Err(DeliverError::UnknownNeed);
                };
                self.inner.view.lock().clear_failures(key);
                tracing::info!(need = %key, from = origin, bytes = payload.len(), payload_sha256 = %digest, files_changed = written.changed, state = state.phase.as_str(), "payload applied");
                if written.changed {
                    self.inner
                        .units
                        .request(&spec.restart_units, &spec.reload_units);
                }
                if before.payload_sha256.as_deref() != Some(digest.as_str()) || !before.satisfied {
                    self.wake_dependents(key);
                }
                self.after(key, &spec, next_attendance(&spec, &state, now));
                Ok(true)
            }
        }
    }

    /// Files, then the handler or the `OK` rule. `Err` is the one-line reason.
    async fn apply(
        &self,
        key: &NeedKey,
        spec: &fort_core::schema::NeedSpec,
        origin: &str,
        payload: &[u8],
    ) -> Result<Written, String> {
        let written = if spec.files.is_empty() {
            Written::default()
        } else {
            let files = spec.files.clone();
            let data = payload.to_vec();
            tokio::task::spawn_blocking(move || crate::files::write_all(&files, &data))
                .await
                .map_err(|e| format!("writing files failed: {e}"))??
        };
        if let Some(handler) = &spec.handler {
            self.inner
                .spawned
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let run_spec = RunSpec::new(handler, payload.to_vec(), self.inner.opts.handler_timeout)
                .env("FORT_HOST", self.inner.opts.host.clone())
                .env("FORT_NEED", key.to_string())
                .env("FORT_ORIGIN", origin.to_owned())
                .envs(self.inner.opts.handler_environment.clone());
            if let Err(e) = run(&run_spec).await {
                tracing::warn!(need = %key, error = %e.summary(), stderr = e.stderr_excerpt(STDERR_IN_LOG).unwrap_or_default(), "need handler failed");
                return Err(format!("handler failed: {}", e.summary()));
            }
        } else if spec.side_effect_only() && payload != b"OK" && payload != b"OK\n" {
            // The payload may be a credential sent to the wrong need: only its size and
            // hash ever reach the log and the state.
            return Err(format!(
                "the provider sent {} bytes (sha256 {}) instead of OK",
                payload.len(),
                &sha256_hex(payload)[..16]
            ));
        }
        Ok(written)
    }

    /// Plans what comes after a payload. The payload may answer an older request (the
    /// protocol cannot say which); a request changed since must still go out at once.
    fn after(&self, key: &NeedKey, _spec: &fort_core::schema::NeedSpec, next: Option<Duration>) {
        let superseded = self.inner.view.lock().is_unsent(key);
        if superseded {
            self.schedule(key, Some(Duration::ZERO));
        } else {
            self.reschedule(key, next);
        }
    }
}
