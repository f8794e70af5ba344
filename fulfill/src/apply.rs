//! Applying payloads in the consumer's own time (docs/protocol.md §7): a payload for a
//! need with files or a handler is recorded durably (its inbox) and answered at once; one
//! applier per need writes the files and runs the handler, whatever the provider's
//! connection does meanwhile, and records the outcome in the need's state. A payload that
//! arrives while an earlier one is applied replaces it in the inbox (the latest wins); a
//! revocation or a refusal that arrives meanwhile is never overridden by the earlier
//! payload's outcome. After a crash, inboxes are applied at start.

use std::time::Duration;

use base64::Engine;
use fort_core::canonical::sha256_hex;
use fort_core::names::NeedKey;
use fort_core::process::{run, RunSpec};
use fort_core::schema::NeedSpec;
use fort_core::wire::unix_now;

use crate::files::Written;
use crate::fulfiller::{nag, next_attendance, renewal_phase, STDERR_IN_LOG};
use crate::schedule::backoff;
use crate::state::{Inbox, Phase};
use crate::Fulfiller;

/// How long a callback's reply waits for its payload to be applied; past it the reply
/// says `applying` and the apply goes on.
pub(crate) const REPLY_WAIT: Duration = Duration::from_secs(5);

impl Fulfiller {
    /// Records `payload` as `key`'s inbox durably and makes sure an applier runs. Returns
    /// the inbox's sequence number.
    /// `encrypted`: the payload as `recordable` made it for a need with an encrypted
    /// file (its plaintext never reaches the state).
    pub(crate) async fn accept(
        &self,
        key: &NeedKey,
        origin: &str,
        payload: &[u8],
        encrypted: bool,
    ) -> Result<Option<u64>, fort_core::store::PersistError> {
        let encoded = base64::engine::general_purpose::STANDARD.encode(payload);
        let key_s = key.to_string();
        let seq = self
            .inner
            .store
            .change_durable(|c| {
                let mut st = c.get(&key_s).cloned()?;
                st.seq += 1;
                st.inbox = Some(Inbox {
                    seq: st.seq,
                    from: origin.to_owned(),
                    payload: encoded.clone(),
                    encrypted,
                });
                let seq = st.seq;
                c.put(key_s.clone(), st);
                Some(seq)
            })
            .await?;
        // Recorded, not yet applied: the restart applies it from the inbox.
        fort_core::crash::point("deliver.recorded");
        if seq.is_some() {
            self.start_applier(key);
        }
        Ok(seq)
    }

    /// Waits (at most [`REPLY_WAIT`]) until the payload numbered `seq`, or a later one, is
    /// applied; returns whether the need is then satisfied, or `None` if it is still being
    /// applied.
    pub(crate) async fn outcome_of(&self, key: &NeedKey, seq: u64) -> Option<bool> {
        let mut rx = self.applied_watch(key);
        tokio::time::timeout(REPLY_WAIT, async {
            loop {
                let (done, satisfied) = *rx.borrow_and_update();
                if done >= seq {
                    return satisfied;
                }
                if rx.changed().await.is_err() {
                    return false;
                }
            }
        })
        .await
        .ok()
    }

    fn applied_watch(&self, key: &NeedKey) -> tokio::sync::watch::Receiver<(u64, bool)> {
        let mut map = self.inner.applied.lock();
        map.entry(key.clone())
            .or_insert_with(|| tokio::sync::watch::channel((0, false)).0)
            .subscribe()
    }

    pub(crate) fn publish_outcome(&self, key: &NeedKey, seq: u64, satisfied: bool) {
        let map = self.inner.applied.lock();
        if let Some(tx) = map.get(key) {
            tx.send_if_modified(|v| {
                if v.0 < seq {
                    *v = (seq, satisfied);
                    true
                } else {
                    false
                }
            });
        }
    }

    /// Starts `key`'s applier unless one runs; it drains the inbox.
    pub(crate) fn start_applier(&self, key: &NeedKey) {
        if !self.inner.view.lock().applying.insert(key.clone()) {
            return;
        }
        let me = self.clone();
        let key = key.clone();
        self.inner.tasks.spawn(async move {
            tokio::select! {
                _ = me.drain_inbox(&key) => {}
                // The inbox is durable: what shutdown interrupts is applied at the next start.
                _ = me.inner.shutdown.cancelled() => {}
            }
            me.inner.view.lock().applying.remove(&key);
            // Filled between the last look and leaving the set: start again.
            if me.state(&key).inbox.is_some() && !me.inner.shutdown.is_cancelled() {
                me.start_applier(&key);
            }
        });
    }

    async fn drain_inbox(&self, key: &NeedKey) {
        // After an outcome that could not be recorded (the state cannot be written), the
        // same payload is tried again only after a pause that grows: never in a loop.
        let mut unrecorded_pause = Duration::from_secs(5);
        let mut last_seq = None;
        loop {
            if self.state(key).inbox.is_none() {
                return;
            }
            // A bounded number of payloads is applied at once, across all needs; which
            // needs go first is the order their appliers asked (tokio's semaphore is fair).
            let Ok(_slot) = self.inner.appliers.acquire().await else {
                return;
            };
            // Read only now: a revocation or refusal that came while this waited for a
            // slot has emptied the inbox, and its payload must not be written.
            let Some(inbox) = self.state(key).inbox else {
                return;
            };
            if last_seq == Some(inbox.seq) {
                tokio::time::sleep(unrecorded_pause).await;
                unrecorded_pause = (unrecorded_pause * 2).min(Duration::from_secs(300));
                if self.state(key).inbox.as_ref().map(|i| i.seq) != Some(inbox.seq) {
                    continue;
                }
            }
            last_seq = Some(inbox.seq);
            let recorded = base64::engine::general_purpose::STANDARD
                .decode(&inbox.payload)
                .unwrap_or_default();
            let Some(spec) = self.spec(key) else {
                self.clear_inbox(key, inbox.seq);
                return;
            };
            let payload = match self.recorded_payload(recorded, inbox.encrypted).await {
                Ok(payload) => payload,
                Err(reason) => {
                    self.not_applied(key, &spec, &inbox, "", reason).await;
                    self.publish_outcome(key, inbox.seq, false);
                    continue;
                }
            };
            // The need moved to another provider after this payload was accepted from
            // its old home: the old home's payload must not land after the new one's.
            let home = crate::home::home_of(&spec, &self.state(key)).to_owned();
            if inbox.from != home {
                tracing::info!(need = %key, from = %inbox.from, home = %home, "payload from a provider that no longer serves the need; not applied");
                self.clear_inbox(key, inbox.seq);
                self.publish_outcome(key, inbox.seq, false);
                continue;
            }
            let satisfied = self.apply_inbox(key, &spec, &inbox, &payload).await;
            self.publish_outcome(key, inbox.seq, satisfied);
        }
    }

    fn clear_inbox(&self, key: &NeedKey, seq: u64) {
        self.update_lazy(key, |st| {
            let mine = st.inbox.as_ref().is_some_and(|i| i.seq == seq);
            if mine {
                st.inbox = None;
            }
            mine
        });
    }

    /// Applies one recorded payload and records the outcome, unless a later callback
    /// (another payload, a revocation, a refusal) superseded it meanwhile.
    async fn apply_inbox(
        &self,
        key: &NeedKey,
        spec: &NeedSpec,
        inbox: &Inbox,
        payload: &[u8],
    ) -> bool {
        let digest = sha256_hex(payload);
        let origin = inbox.from.as_str();
        let before = self.state(key);
        match self.apply(key, spec, origin, payload).await {
            Err(reason) => {
                tracing::warn!(need = %key, from = origin, bytes = payload.len(), payload_sha256 = %digest, reason = %reason, "payload not applied");
                self.not_applied(key, spec, inbox, &digest, reason).await;
                false
            }
            Ok(written) => {
                self.record_applied(key, spec, inbox, payload, &digest, &before, written)
                    .await
            }
        }
    }

    /// A recorded payload that could not be applied: audited, the need `failed` with
    /// `reason` (unless a later callback decides it), asked again after a back-off.
    /// `digest`: the payload's SHA-256, empty when it could not be read back.
    async fn not_applied(
        &self,
        key: &NeedKey,
        spec: &NeedSpec,
        inbox: &Inbox,
        digest: &str,
        reason: String,
    ) {
        if digest.is_empty() {
            tracing::warn!(need = %key, from = %inbox.from, reason = %reason, "payload not applied");
        }
        self.inner.opts.audit.record_caused_by(
            inbox.from.as_str(),
            fort_core::audit::Event::caused(fort_core::audit::CausedKind::ApplyFailed)
                .need(key.to_string())
                .provider(inbox.from.as_str())
                .response((!digest.is_empty()).then(|| digest.to_owned()))
                .reason(&reason),
        );
        if self.record_failure(key, inbox.seq, reason).await {
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
    }

    /// The need is `failed` with `reason`, if `seq` is still its latest callback.
    async fn record_failure(&self, key: &NeedKey, seq: u64, reason: String) -> bool {
        let key_s = key.to_string();
        let now = unix_now();
        let result = self
            .inner
            .store
            .change_durable(|c| {
                let Some(mut st) = c.get(&key_s).cloned() else {
                    return false;
                };
                let current = st.seq == seq;
                if st.inbox.as_ref().is_some_and(|i| i.seq == seq) {
                    st.inbox = None;
                }
                if current {
                    if st.satisfied {
                        st.satisfied_at = None;
                    }
                    if st.phase != Phase::Failed {
                        st.since = now;
                    }
                    st.satisfied = false;
                    st.phase = Phase::Failed;
                    st.last_error = Some(reason.clone());
                }
                c.put(key_s.clone(), st);
                current
            })
            .await;
        result.unwrap_or_else(|e| {
            tracing::warn!(need = %key, error = %e, "outcome not recorded; applied again at the next start");
            false
        })
    }

    #[allow(clippy::too_many_arguments)]
    async fn record_applied(
        &self,
        key: &NeedKey,
        spec: &NeedSpec,
        inbox: &Inbox,
        payload: &[u8],
        digest: &str,
        before: &crate::state::NeedState,
        written: Written,
    ) -> bool {
        let now = unix_now();
        let expires_at = crate::expiry::expiry(payload);
        let kept = self.kept_payload(key, spec, payload);
        let key_s = key.to_string();
        let mut restart = written.changed;
        // Units restarted besides the need's own: those reading, as a credential, a file
        // that was there before and whose content differs from the last recorded outcome.
        let mut units = spec.restart_units.clone();
        let recorded = self
            .inner
            .store
            .change_durable(|c| {
                let mut st = c.get(&key_s).cloned()?;
                if st.inbox.as_ref().is_some_and(|i| i.seq == inbox.seq) {
                    st.inbox = None;
                }
                // Whatever came after it decides the need's state; the files it wrote are
                // still recorded so they are found, and removed, with the need.
                if st.seq != inbox.seq {
                    st.files.extend(written.files.clone());
                    st.credentials.extend(written.credentials.clone());
                    c.put(key_s.clone(), st);
                    return Some(None);
                }
                // Files that differ from what the last recorded outcome wrote: changed
                // now, or by an attempt whose outcome a crash kept from being recorded.
                restart |= written
                    .files
                    .iter()
                    .any(|(path, sha)| st.files.get(path) != Some(sha));
                for f in &spec.files {
                    let path = f.path.to_string_lossy();
                    let (Some(now), Some(recorded)) = (
                        written.files.get(path.as_ref()),
                        st.files.get(path.as_ref()),
                    ) else {
                        continue;
                    };
                    if now != recorded {
                        units.extend(f.credential_for.iter().cloned());
                    }
                }
                self.record_satisfied(&mut st, spec, now, expires_at, digest, &written);
                st.payload = kept
                    .as_ref()
                    .map(|p| base64::engine::general_purpose::STANDARD.encode(p));
                c.put(key_s.clone(), st.clone());
                Some(Some(st))
            })
            .await;
        if recorded.is_ok() {
            for name in &written.installed_keys {
                tracing::info!(need = %key, key = name.as_str(), "installed the new key with its certificate");
                self.inner.keys.remove_next(key, name);
            }
        }
        // The files on disk changed whoever decides the need's state now (a later
        // payload with the same content writes nothing and would restart nothing).
        if restart {
            self.inner
                .units
                .request(&written.restarts(&units), &spec.reload_units);
        }
        let state = match recorded {
            Ok(Some(Some(st))) => st,
            Ok(_) => return false,
            Err(e) => {
                tracing::warn!(need = %key, error = %e, "outcome not recorded; applied again at the next start");
                return false;
            }
        };
        self.inner.view.lock().clear_failures(key);
        self.inner.opts.audit.record_caused_by(
            inbox.from.as_str(),
            fort_core::audit::Event::caused(fort_core::audit::CausedKind::Applied)
                .need(key.to_string())
                .provider(inbox.from.as_str())
                .response(Some(digest.to_owned()))
                .previous(before.payload_sha256.clone().filter(|p| p != digest))
                .expires_at(expires_at)
                .detail(serde_json::json!({"files_changed": written.changed})),
        );
        tracing::info!(need = %key, from = %inbox.from, bytes = payload.len(), payload_sha256 = %digest, files_changed = written.changed, state = state.phase.as_str(), "payload applied");
        if before.payload_sha256.as_deref() != Some(digest) || !before.satisfied {
            self.wake_dependents(key);
        }
        if self.inner.view.lock().template_inputs.contains(key) {
            let (me, need) = (self.clone(), key.clone());
            self.inner.tasks.spawn(async move {
                me.render_templates(Some(&need)).await;
            });
        }
        self.after(key, next_attendance(spec, &state, now));
        true
    }

    /// What the state keeps of a payload other needs' requests refer to (§11.5): the
    /// payload, or for a need with an encrypted file only the values referred to (which
    /// reach nothing an encrypted file holds, as the needs' check ensures). `None` for a
    /// need nothing refers to.
    fn kept_payload(&self, key: &NeedKey, spec: &NeedSpec, payload: &[u8]) -> Option<Vec<u8>> {
        let view = self.inner.view.lock();
        // Read by a template: kept whole (a template reads no need with encrypted files).
        if view.template_inputs.contains(key) && !spec.files.iter().any(|f| f.encrypted()) {
            return Some(payload.to_vec());
        }
        if !view.referenced.contains(key) {
            return None;
        }
        if !spec.files.iter().any(|f| f.encrypted()) {
            return Some(payload.to_vec());
        }
        let pointers: Vec<String> = view
            .needs
            .values()
            .flat_map(|s| s.references())
            .filter(|r| r.need == *key)
            .map(|r| r.pointer)
            .collect();
        let pointers: Vec<&str> = pointers.iter().map(String::as_str).collect();
        // A pointer reaching nothing: the dependent's request cannot be built, and says so.
        fort_core::schema::refs::project(payload, &pointers)
    }

    /// Files, then the handler or the `OK` rule. `Err` is the one-line reason.
    pub(crate) async fn apply(
        &self,
        key: &NeedKey,
        spec: &NeedSpec,
        origin: &str,
        payload: &[u8],
    ) -> Result<Written, String> {
        let written = if spec.files.is_empty() && spec.keys.is_empty() {
            Written::default()
        } else {
            // Encrypted first: should systemd-creds fail, no file of the payload is
            // written, and none in plaintext.
            let sealed = self.seal_files(spec, &self.state(key), payload).await?;
            let (me, need, spec, data) =
                (self.clone(), key.clone(), spec.clone(), payload.to_vec());
            tokio::task::spawn_blocking(move || me.write_files(&need, &spec, &data, &sealed))
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
        } else if self.side_effect_only(key, spec) && payload != b"OK" && payload != b"OK\n" {
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

    /// The payload's files, and the keys its certificates are for (§11.10): a
    /// certificate for neither the next key nor the installed one writes nothing.
    fn write_files(
        &self,
        key: &NeedKey,
        spec: &NeedSpec,
        payload: &[u8],
        sealed: &crate::credentials::Sealed,
    ) -> Result<Written, String> {
        let own_dir = {
            let view = self.inner.view.lock();
            crate::reload::own_directory(&view.needs, key, spec)
        };
        let own_dir = own_dir.as_deref();
        if spec.keys.is_empty() {
            return crate::files::write_all(&spec.files, payload, Vec::new(), own_dir, sealed);
        }
        let recorded = self.state(key).files;
        let keys = crate::keys::to_install(&self.inner.keys, key, spec, &recorded, payload)?;
        let installed: Vec<String> = keys
            .iter()
            .filter(|k| k.was_next)
            .map(|k| k.name.clone())
            .collect();
        let extra = keys.into_iter().map(|k| (k.file, k.content)).collect();
        let mut written = crate::files::write_all(&spec.files, payload, extra, own_dir, sealed)?;
        // Forgotten as next keys only once the outcome is recorded (record_applied): until
        // then the recorded files still name the previous key, and after a crash the
        // payload, applied again, must find its key as the next one.
        written.installed_keys = installed;
        Ok(written)
    }

    /// A payload was applied: the need is satisfied (or straight away expiring), its
    /// expiry read, and a renewal that brought a payload outside its window is over.
    pub(crate) fn record_satisfied(
        &self,
        st: &mut crate::state::NeedState,
        spec: &NeedSpec,
        now: u64,
        expires_at: Option<u64>,
        digest: &str,
        written: &Written,
    ) {
        if !st.satisfied {
            st.satisfied_at = Some(now);
            st.attempts = 0;
        }
        st.satisfied = true;
        st.expires_at = expires_at;
        let phase = renewal_phase(spec, st, now).unwrap_or(Phase::Satisfied);
        if st.phase != phase {
            st.since = now;
        }
        st.phase = phase;
        st.last_error = match (phase, expires_at) {
            // Arrived already inside its renewal window (a CA issuing lifetimes shorter
            // than renew_before, a stale cached response): a failed renewal, asked again
            // at most once per nag interval while it persists.
            (Phase::Expired, Some(at)) => Some(format!(
                "the payload received expired at {}; asking again {}",
                crate::status::when(at),
                crate::status::every(spec.nag_seconds)
            )),
            (Phase::Expiring, Some(at)) => Some(format!(
                "the payload received expires at {}, inside the renewal window; asking again {}",
                crate::status::when(at),
                crate::status::every(spec.nag_seconds)
            )),
            _ => None,
        };
        if phase == Phase::Satisfied {
            st.renewal_sought_at = None;
        }
        // Only the home's payloads are applied: the new home has answered.
        st.renew_at_home = false;
        st.home_confirmed = true;
        st.payload_sha256 = Some(digest.to_owned());
        st.received += 1;
        st.received_at = Some(now);
        st.files = written.files.clone();
        st.credentials = written.credentials.clone();
    }
}
