//! Installing a new set of needs (at start and on every reload): what changed, what is
//! asked again, what is released; and what identifies a need's declaration.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use fort_core::canonical::sha256_hex;
use fort_core::client::Target;
use fort_core::names::NeedKey;
use fort_core::schema::{NeedSpec, Needs, Registry};
use fort_core::store::PersistError;
use fort_core::wire::{unix_now, AsyncBody};
use tokio::time::Instant;

use crate::fulfiller::{deadline, next_attendance, renewal_phase, Fulfiller};
use crate::state::{NeedState, Phase};

/// What identifies a need's declaration: a change means asking again from scratch.
/// A file's `credential_for` names units to restart, as `restart_units` does: changed
/// in place, without asking again (and without it, a declaration hashes as it did
/// before files had the field). The provider is the need's home: a need with several
/// providers hashes as it would with its home alone, so adding a standby, or turning a
/// single provider into a list that starts with it, asks nothing again (§11.13).
pub(crate) fn declaration_hash(spec: &NeedSpec, home: &str) -> String {
    let mut declared = serde_json::json!({
        "from": home,
        "request": spec.request,
        "files": declared_files(spec),
    });
    // Only when there are keys: declarations made before keys existed hash the same.
    if !spec.keys.is_empty() {
        declared["keys"] = serde_json::json!(spec.keys);
    }
    sha256_hex(&serde_json::to_vec(&declared).expect("declaration serialises"))
}

/// Whether `path` is one of the need's files or keys.
pub(crate) fn declares_path(spec: &NeedSpec, path: &str) -> bool {
    spec.files.iter().any(|f| f.path.to_string_lossy() == path)
        || spec.keys.values().any(|k| k.path.to_string_lossy() == path)
}

/// The directory that holds every file and key of `key`'s need, when they are more than
/// one and no other need has a file or key in it or below it: there the need's files
/// are replaced together (§11.3).
pub(crate) fn own_directory(needs: &Needs, key: &NeedKey, spec: &NeedSpec) -> Option<PathBuf> {
    let paths = need_paths(spec);
    let dir = paths.first()?.parent()?;
    if paths.len() < 2 || dir.parent().is_none() || paths.iter().any(|p| p.parent() != Some(dir)) {
        return None;
    }
    let shared = needs
        .iter()
        .filter(|(other, _)| *other != key)
        .any(|(_, spec)| need_paths(spec).iter().any(|p| p.starts_with(dir)));
    (!shared).then(|| dir.to_path_buf())
}

fn need_paths(spec: &NeedSpec) -> Vec<&Path> {
    spec.files
        .iter()
        .map(|f| f.path.as_path())
        .chain(spec.keys.values().map(|k| k.path.as_path()))
        .collect()
}

/// A need's files without their `credential_for` units.
pub(crate) fn declared_files(spec: &NeedSpec) -> Vec<fort_core::schema::FileSpec> {
    spec.files
        .iter()
        .map(|f| fort_core::schema::FileSpec {
            credential_for: Vec::new(),
            ..f.clone()
        })
        .collect()
}

impl Fulfiller {
    /// Installs a new set of needs (at start and on every reload). New needs, unsatisfied
    /// needs and needs whose declaration changed are asked at once; removed needs are
    /// released at their provider, then their files removed. At start, a satisfied need
    /// whose files are gone (a reboot empties `/run`) is asked again. Returns once the
    /// state is durable.
    pub async fn reload(&self, needs: Needs, registry: Arc<Registry>) -> Result<(), PersistError> {
        let now = unix_now();
        let first = !self
            .inner
            .started
            .swap(true, std::sync::atomic::Ordering::Relaxed);
        // Files are looked at outside the state's lock, off the runtime's threads: what a
        // local user put in their place (a FIFO, a huge file) costs a bounded read there,
        // never a stalled agent.
        let lost = if first {
            let satisfied: Vec<(String, std::collections::BTreeMap<String, String>)> =
                self.inner.store.read(|s| {
                    s.iter()
                        .filter(|(_, st)| st.satisfied)
                        .map(|(k, st)| (k.clone(), st.files.clone()))
                        .collect()
                });
            let own: Vec<PathBuf> = needs
                .iter()
                .filter_map(|(key, spec)| own_directory(&needs, key, spec))
                .collect();
            tokio::task::spawn_blocking(move || {
                // A replacement a crash interrupted may have left a directory of private
                // keys beside a need's own.
                crate::swap::sweep(own.iter().map(PathBuf::as_path));
                satisfied
                    .into_iter()
                    .filter_map(|(k, files)| crate::files::missing(&files).map(|p| (k, p)))
                    .collect::<HashMap<String, String>>()
            })
            .await
            .unwrap_or_default()
        } else {
            HashMap::new()
        };
        let mut stale_files = Vec::new();
        let ((removed, fresh), ticket) = self.inner.store.change(|c| {
            let mut removed = Vec::new();
            let mut fresh = Vec::new();
            for key in c.keys() {
                let keep = NeedKey::parse(&key).is_some_and(|k| needs.contains_key(&k));
                if !keep {
                    let st = c.get(&key).cloned().unwrap_or_default();
                    c.remove(&key);
                    removed.push((key, st.from, st.files.into_keys().collect::<Vec<_>>()));
                }
            }
            for (key, spec) in &needs {
                let mut st = c.get(key.as_str()).cloned().unwrap_or_default();
                let home = crate::home::home_of(spec, &st).to_owned();
                let hash = declaration_hash(spec, &home);
                if st.request_hash != hash || st.from != home {
                    // Moving to another provider releases the entry at the old one;
                    // files the new declaration no longer names go with it.
                    let stale: Vec<String> = st
                        .files
                        .keys()
                        .filter(|p| !declares_path(spec, p))
                        .cloned()
                        .collect();
                    if !st.from.is_empty() && st.from != home {
                        removed.push((key.to_string(), st.from.clone(), stale));
                    } else {
                        stale_files.extend(stale);
                    }
                    fresh.push(key.clone());
                    st = NeedState {
                        from: home,
                        request_hash: hash,
                        since: now,
                        // Callbacks keep counting up: an applier still busy with a
                        // payload for the old declaration must never take a new
                        // payload's number for its own.
                        seq: st.seq.saturating_add(1),
                        // Where the need has been served stays its history.
                        moved_at: st.moved_at,
                        moved_because: st.moved_because.take(),
                        moves: st.moves,
                        ..Default::default()
                    };
                    c.put(key.to_string(), st);
                } else if let Some(path) = lost.get(key.as_str()).filter(|_| st.satisfied) {
                    st.satisfied = false;
                    st.satisfied_at = None;
                    st.phase = Phase::Pending;
                    st.since = now;
                    st.last_error = Some(format!(
                        "{path} is gone or no longer what was written (a reboot?); asking again"
                    ));
                    c.put(key.to_string(), st);
                } else if let Some(phase) =
                    renewal_phase(spec, &st, now).filter(|p| *p != st.phase && st.satisfied)
                {
                    // The state follows the clock, not the last event: a payload that
                    // expired while the agent was down shows as expired at once.
                    st.phase = phase;
                    st.since = now;
                    c.put(key.to_string(), st);
                }
            }
            (removed, fresh)
        })?;
        self.inner.store.wait(ticket).await?;
        {
            // Next keys of needs or keys no longer declared (an agent stopped before a
            // release finished leaves them too).
            let (store, declared) = (self.inner.keys.clone(), needs.clone());
            let _ = tokio::task::spawn_blocking(move || store.remove_undeclared(&declared)).await;
        }
        if !stale_files.is_empty() {
            let _ =
                tokio::task::spawn_blocking(move || crate::files::remove_all(&stale_files)).await;
        }
        let states = self.inner.store.read(|s| s.clone());
        {
            let mut view = self.inner.view.lock();
            let at = Instant::now();
            view.due.clear();
            for (key, spec) in &needs {
                let st = states.get(key.as_str()).cloned().unwrap_or_default();
                if let Some(delay) = next_attendance(spec, &st, now) {
                    view.due.set(key, deadline(at, delay));
                }
            }
            view.unsent.retain(|k| needs.contains_key(k));
            view.unsent.extend(fresh);
            view.dependents.clear();
            view.referenced.clear();
            for (key, spec) in &needs {
                for dep in spec.dependencies() {
                    view.dependents.entry(dep).or_default().push(key.clone());
                }
                for r in spec.references() {
                    view.referenced.insert(r.need);
                }
            }
            view.needs = Arc::new(needs);
            view.registry = registry.clone();
        }
        // Payloads recorded before a crash (or a stop) are applied now.
        for (key, st) in &states {
            if st.inbox.is_some() {
                if let Some(need) = NeedKey::parse(key) {
                    self.start_applier(&need);
                }
            }
        }
        for (key, from, files) in removed {
            let me = self.clone();
            let registry = registry.clone();
            self.inner.tasks.spawn(async move {
                me.release(&key, &from, &registry, "need removed").await;
                // Declared again meanwhile: the files are the new declaration's.
                let again = NeedKey::parse(&key).is_some_and(|k| me.spec(&k).is_some());
                if !again {
                    if let Some(need) = NeedKey::parse(&key) {
                        me.inner.keys.remove_need(&need);
                    }
                    let _ =
                        tokio::task::spawn_blocking(move || crate::files::remove_all(&files)).await;
                }
            });
        }
        self.inner.wake.notify_one();
        Ok(())
    }

    /// Releases `key` at `from`, which no longer serves it (`why`: the need was removed,
    /// or moved to another provider).
    pub(crate) async fn release(&self, key: &str, from: &str, registry: &Registry, why: &str) {
        let Some(need) = NeedKey::parse(key) else {
            return;
        };
        let Some(peer) = registry.get(from) else {
            tracing::info!(need = %key, from, "{why}; its provider is gone too, nothing to release");
            return;
        };
        let Some(address) = peer.address.as_deref() else {
            return;
        };
        let body = serde_json::to_vec(&AsyncBody {
            need: key.to_owned(),
            request: None,
            release: true,
            renew: false,
        })
        .expect("body serialises");
        let target = Target {
            name: from,
            address,
            keys: &peer.keys,
        };
        let path = format!("/agent/capabilities/{}", need.kind());
        for attempt in 1..=3u32 {
            // Declared again at the same provider (a roll-back), or moved back to it, since:
            // the entry is wanted, and a late release would delete it under the consumer.
            if self.home(&need).as_deref() == Some(from) {
                tracing::info!(need = %key, from, "{from} serves the need again; release cancelled");
                return;
            }
            match self.inner.client.post(&target, &path, body.clone()).await {
                Ok(r) if r.is_success() => {
                    tracing::info!(need = %key, from, "{why}; released at {from}");
                    self.inner.opts.audit.record(
                        fort_core::audit::Event::own(fort_core::audit::OwnKind::Released)
                            .need(key)
                            .provider(from),
                    );
                    return;
                }
                Ok(r) => {
                    tracing::warn!(need = %key, from, status = r.status, attempt, "release refused")
                }
                Err(e) => tracing::warn!(need = %key, from, error = %e, attempt, "release failed"),
            }
            tokio::select! {
                _ = tokio::time::sleep(self.inner.opts.backoff * attempt) => {}
                _ = self.inner.shutdown.cancelled() => return,
            }
        }
        tracing::warn!(need = %key, from, "{why}; release gave up; the provider's GC will collect the entry");
    }
}
