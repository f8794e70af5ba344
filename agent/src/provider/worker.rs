//! One worker per async capability: at most one handler run at a time; whatever arrives
//! during a run is batched into the next one.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use fort_core::process::{run, RunSpec};
use fort_core::wire::unix_now;
use serde_json::{Map, Value};

use fort_core::text::printable;
use serde_json::value::RawValue;

use super::state::{capability_of, Notice, NOTICE_CHARS};
use super::{Pending, RunRecord, Trigger, WorkerSlot};
use crate::app::App;
use fort_core::audit::{Caused, CausedKind, Event};
use fort_core::schema::Mode;

pub(super) struct Worker {
    pub app: Arc<App>,
    pub capability: String,
    pub slot: Arc<WorkerSlot>,
}

/// One entry as a handler sees it (§9, §11.4): `renew` only when asked, so handlers
/// that predate it see exactly the input they always did.
#[derive(serde::Serialize)]
pub(super) struct InputItem {
    request: Arc<serde_json::value::RawValue>,
    response: Option<Arc<serde_json::value::RawValue>>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    renew: bool,
    /// The hash of the response the entry holds (§11.11), so a handler that recorded
    /// what it answered can keep it without printing it again; none in a forced run.
    #[serde(skip_serializing_if = "Option::is_none")]
    held: Option<String>,
    /// The response the entry held when the run began (whether or not it is passed).
    #[serde(skip)]
    current: Option<Arc<serde_json::value::RawValue>>,
    /// Its requester was owed an answer when the run began.
    #[serde(skip)]
    awaiting: bool,
    /// The verdict it held when the run began.
    #[serde(skip)]
    notice: Option<Notice>,
}

/// What a run decided for one entry (§9, §11.9).
#[derive(Debug)]
enum Verdict {
    /// A response, or none.
    Respond(Option<Arc<RawValue>>),
    /// `$fort_refused`: no response, and why.
    Refuse(String),
    /// `$fort_pending`: the response stays as it is.
    Wait(String),
    /// `$fort_keep` (§11.11): the response stays as it is, as if printed again; `matches`
    /// is false when the hash named is not the one the entry held, and then nothing about
    /// the entry changes.
    Keep { matches: bool },
}

/// The top-level key of a handler's output asking for another run (§11.9).
const RERUN_KEY: &str = "$fort_rerun_after";

impl Verdict {
    /// The verdict on an entry that held the response hashed `held` when the run began.
    fn of(value: Option<&Value>, held: Option<&str>) -> Verdict {
        let marker = value.and_then(Value::as_object).filter(|m| m.len() == 1);
        if let Some((name, Value::String(text))) = marker.and_then(|m| m.iter().next()) {
            match name.as_str() {
                "$fort_refused" => return Verdict::Refuse(printable(text, NOTICE_CHARS)),
                "$fort_pending" => return Verdict::Wait(printable(text, NOTICE_CHARS)),
                "$fort_keep" => {
                    return Verdict::Keep {
                        matches: held == Some(text.as_str()),
                    }
                }
                _ => {}
            }
        }
        Verdict::Respond(value.filter(|v| !v.is_null()).map(super::state::raw))
    }

    /// The verdict the entry holds after this one, given the one it holds now.
    fn notice(&self, current: Option<&Notice>) -> Option<Notice> {
        match self {
            Verdict::Respond(_) | Verdict::Keep { matches: true } => None,
            Verdict::Keep { matches: false } => current.cloned(),
            Verdict::Refuse(r) => Some(Notice::Refused(r.clone())),
            Verdict::Wait(r) => Some(Notice::Pending(r.clone())),
        }
    }

    /// The response the entry holds after this verdict, given the one it holds now.
    fn response(&self, current: Option<&Arc<RawValue>>) -> Option<Arc<RawValue>> {
        match self {
            Verdict::Respond(r) => r.clone(),
            Verdict::Refuse(_) => None,
            Verdict::Wait(_) | Verdict::Keep { .. } => current.cloned(),
        }
    }
}

/// A callback decided by a run: the entry whose current response (or revocation) its
/// consumer must be sent.
pub struct Planned {
    pub key: String,
}

/// Entries whose changes a run stages at once (see [`Worker::apply`]).
const APPLY_CHUNK: usize = 2048;

/// The longest a run waits after the previous one (see [`Worker::run`]).
const MAX_PACE: std::time::Duration = std::time::Duration::from_secs(5);

impl Worker {
    /// Runs the handler whenever there is work. A run waits after the previous one as
    /// long as that one took (at most [`MAX_PACE`]): a handler always reads every entry,
    /// so under a steady stream of requests back-to-back runs would spend all their time
    /// re-reading what did not change; this way runs take at most half the time and each
    /// answers twice as many requests. An idle provider still answers at once.
    pub async fn run(self) {
        let mut earliest = Instant::now();
        loop {
            tokio::select! {
                _ = self.slot.wake.notified() => {}
                _ = self.app.shutdown.cancelled() => return,
            }
            tokio::select! {
                _ = tokio::time::sleep_until(earliest.into()) => {}
                _ = self.app.shutdown.cancelled() => return,
            }
            let pending = std::mem::take(&mut *self.slot.pending.lock());
            if pending.trigger.is_none() {
                continue;
            }
            let waiters = pending.waiters.len();
            let began = Instant::now();
            let record = self.run_once(&pending).await;
            earliest = Instant::now() + began.elapsed().min(MAX_PACE);
            tracing::debug!(capability = %self.capability, waiters, ok = record.ok, "handler run done");
            for w in pending.waiters {
                let _ = w.send(record.clone());
            }
        }
    }

    async fn run_once(&self, pending: &Pending) -> RunRecord {
        let app = &self.app;
        let trigger = pending.trigger.unwrap_or(Trigger::Manual);
        let started = Instant::now();
        let mut record = RunRecord {
            at: unix_now(),
            trigger,
            duration_ms: 0,
            ok: false,
            error: None,
            reason: None,
            entries: 0,
            callbacks: 0,
        };
        let loaded = app.loaded.load_full();
        let Some(spec) = loaded
            .capabilities
            .get(&self.capability)
            .filter(|c| c.mode == Mode::Async)
        else {
            record.error = Some("not an async capability".into());
            return record;
        };
        // Nothing is issued that the trail cannot record ([audit] required).
        if app.config.audit.required && !app.audit.writable() {
            tracing::warn!(capability = %self.capability, "the audit trail cannot be written and [audit] required is set: the handler does not run; trying again in 5 s");
            record.error = Some("audit_unwritable".into());
            self.rerun_after(5);
            app.provider.record_run(&self.capability, record.clone());
            return record;
        }
        let pass_cached = spec.cache_response && !pending.force;

        // The input: every active entry of this capability (§9), sharing the entries'
        // requests and responses, serialised straight from them.
        let input: BTreeMap<String, InputItem> = app.provider.store.read(|entries| {
            entries
                .iter()
                .filter(|(k, _)| capability_of(k) == Some(self.capability.as_str()))
                .map(|(k, e)| {
                    let forced = pending.force || pending.force_entries.contains(k);
                    let item = InputItem {
                        request: e.request.clone(),
                        response: e.response.clone().filter(|_| pass_cached && !forced),
                        renew: e.renew,
                        held: e.current_hash().filter(|_| !forced),
                        current: e.response.clone(),
                        awaiting: e.awaiting_response,
                        notice: e.notice.clone(),
                    };
                    (k.clone(), item)
                })
                .collect()
        });
        record.entries = input.len();
        let stdin = serde_json::to_vec(&input).expect("input serialises");
        let mut spec_run = RunSpec::new(&spec.handler, stdin, app.config.handler_timeout)
            .args(spec.args.iter().cloned())
            .env("FORT_HOST", app.config.host.clone())
            .env("FORT_CAPABILITY", self.capability.clone())
            .env("FORT_TRIGGER", trigger.as_str())
            .envs(&app.config.handler_environment);
        if let Some(key) = &app.state_key {
            // The path, never the key: a handler reads it through the handler library.
            spec_run = spec_run
                .env(
                    fort_core::sealed::KEY_FILE_ENV,
                    key.source().display().to_string(),
                )
                .env(
                    fort_core::sealed::REGISTRY_ENV,
                    app.config
                        .state_dir
                        .join(fort_core::sealed::REGISTRY_FILE)
                        .display()
                        .to_string(),
                );
        }
        if let Some((name, value)) = fort_core::crash::env_for_children() {
            spec_run = spec_run.env(&name, value);
        }
        spec_run.max_stdout = 64 * 1024 * 1024;
        let outcome = run(&spec_run).await;
        record.duration_ms = started.elapsed().as_millis() as u64;
        app.metrics.handler_seconds.add(
            &[("capability", &self.capability)],
            started.elapsed().as_secs_f64(),
        );

        let output = match outcome {
            Ok(ok) => {
                // A handler explains the entries it refused on stderr: for the operator,
                // bounded (it may echo a request; the log is root's alone).
                if let Some(notes) = ok.stderr_excerpt(2048) {
                    tracing::info!(capability = %self.capability, trigger = trigger.as_str(), stderr = %notes, "handler notes");
                }
                serde_json::from_slice::<Value>(&ok.stdout)
                    .ok()
                    .and_then(|v| match v {
                        Value::Object(m) => Some(m),
                        _ => None,
                    })
                    .ok_or_else(|| "not_an_object".to_owned())
            }
            Err(e) => {
                tracing::warn!(capability = %self.capability, trigger = trigger.as_str(), error = %e.summary(), stderr = e.stderr_excerpt(2048).unwrap_or_default(), "handler failed; nothing changed");
                record.reason = Some(run_reason(&e));
                Err(e.class().to_owned())
            }
        };
        let output = match output {
            Ok(o) => o,
            Err(reason) => {
                if reason == "not_an_object" {
                    tracing::warn!(capability = %self.capability, "handler output is not a JSON object; nothing changed");
                    record.reason =
                        Some("the handler printed something other than a JSON object".into());
                }
                app.metrics
                    .handler_runs
                    .inc(&[("capability", &self.capability), ("outcome", &reason)]);
                record.error = Some(reason);
                app.provider.record_run(&self.capability, record.clone());
                return record;
            }
        };
        for stray in output
            .keys()
            .filter(|k| !input.contains_key(*k) && *k != RERUN_KEY)
        {
            tracing::warn!(capability = %self.capability, key = %printable(stray, 200), "handler returned a key that was not in its input; ignored");
        }
        if let Some(after) = output.get(RERUN_KEY) {
            match after.as_u64() {
                Some(seconds) => self.rerun_after(seconds),
                None => {
                    tracing::warn!(capability = %self.capability, "{RERUN_KEY} is not a non-negative integer; ignored")
                }
            }
        }

        // Apply: store new responses, decide who is called back.
        let persisted = self.apply(&input, &output, pending).await;
        let called_back = match persisted {
            Ok(n) => n,
            Err(e) => {
                tracing::error!(capability = %self.capability, error = %e, "responses not persisted; their callbacks held back");
                record.error = Some("persist_failed".into());
                app.provider.record_run(&self.capability, record.clone());
                return record;
            }
        };
        record.ok = true;
        record.callbacks = called_back;
        app.metrics
            .handler_runs
            .inc(&[("capability", &self.capability), ("outcome", "ok")]);
        tracing::info!(
            capability = %self.capability,
            trigger = trigger.as_str(),
            entries = record.entries,
            callbacks = record.callbacks,
            ms = record.duration_ms,
            "handler run"
        );
        app.provider.record_run(&self.capability, record.clone());
        record
    }

    async fn apply(
        &self,
        input: &BTreeMap<String, InputItem>,
        output: &Map<String, Value>,
        pending: &Pending,
    ) -> Result<usize, fort_core::store::PersistError> {
        // Only entries whose response changed, or whose requester was owed an answer, are
        // looked at again: the others are known unchanged from the run's own input, and a
        // run over 50,000 entries must not touch 50,000 of them to change a few.
        let mut kept_unheld = 0usize;
        let candidates: Vec<(&String, &InputItem, Verdict)> = input
            .iter()
            .filter_map(|(key, seen)| {
                let verdict = Verdict::of(output.get(key), seen.held.as_deref());
                // The handler's record and the provider's differ: nothing about the entry
                // changes, and a requester owed an answer stays owed one.
                if matches!(verdict, Verdict::Keep { matches: false }) {
                    kept_unheld += 1;
                    return None;
                }
                let new = verdict.response(seen.current.as_ref());
                let differs = !super::state::same(new.as_deref(), seen.current.as_deref())
                    || verdict.notice(seen.notice.as_ref()) != seen.notice;
                (differs || seen.awaiting || pending.callback_all).then_some((key, seen, verdict))
            })
            .collect();
        if kept_unheld > 0 {
            tracing::warn!(capability = %self.capability, entries = kept_unheld, "handler kept responses the entries do not hold ($fort_keep with another hash); those entries are unchanged");
        }
        // Written in chunks, the next staged while the previous one is flushed: a run that
        // answers 50,000 entries at once holds two chunks of encoded changes in memory,
        // not 50,000. Each entry's change stands alone, so a crash between chunks leaves
        // every entry either answered or still owed an answer, never half of one.
        // A chunk's callbacks are queued once that chunk is durable, so a chunk that cannot
        // be written withholds only its own.
        let mut called_back = 0;
        let mut previous = None;
        for chunk in candidates.chunks(APPLY_CHUNK) {
            let staged = self.apply_chunk(chunk, pending)?;
            if let Some((planned, ticket)) = previous.replace(staged) {
                self.app.provider.store.wait(ticket).await?;
                called_back += self.call_back(planned);
            }
        }
        if let Some((planned, ticket)) = previous {
            self.app.provider.store.wait(ticket).await?;
            called_back += self.call_back(planned);
        }
        Ok(called_back)
    }

    /// Queues the run the handler asked for, unless an earlier one is already due.
    fn rerun_after(&self, seconds: u64) {
        let delay = std::time::Duration::from_secs(seconds.clamp(1, 3600));
        let at = tokio::time::Instant::now() + delay;
        {
            let mut due = self.slot.rerun_at.lock();
            if due.is_some_and(|d| d <= at) {
                return;
            }
            *due = Some(at);
        }
        let app = self.app.clone();
        let slot = self.slot.clone();
        let capability = self.capability.clone();
        self.app.tasks.spawn(async move {
            tokio::select! {
                _ = tokio::time::sleep_until(at) => {}
                _ = app.shutdown.cancelled() => return,
            }
            // Superseded by an earlier request meanwhile: that one's timer runs it.
            let mine = {
                let mut due = slot.rerun_at.lock();
                let mine = *due == Some(at);
                if mine {
                    *due = None;
                }
                mine
            };
            if mine {
                drop(
                    app.provider
                        .enqueue(&app, &capability, Trigger::Rerun, false, false),
                );
            }
        });
    }

    fn call_back(&self, planned: Vec<Planned>) -> usize {
        let n = planned.len();
        for p in planned {
            self.app.provider.deliveries.enqueue(p.key, true);
        }
        n
    }

    fn apply_chunk(
        &self,
        candidates: &[(&String, &InputItem, Verdict)],
        pending: &Pending,
    ) -> Result<(Vec<Planned>, fort_core::store::Ticket), fort_core::store::PersistError> {
        let trigger = pending.trigger.unwrap_or(Trigger::Manual).as_str();
        let mut events: Vec<(String, Event<Caused>, Option<Arc<RawValue>>)> = Vec::new();
        let staged = self.app.provider.store.change(|c| {
            let mut planned = Vec::new();
            for (key, seen, verdict) in candidates {
                let (key, seen) = (*key, *seen);
                // Released or collected while the handler ran: gone stays gone.
                let Some(mut entry) = c.get(key).cloned() else {
                    continue;
                };
                // Released and asked for again while the handler ran: what it kept is not
                // what the entry holds now.
                if matches!(verdict, Verdict::Keep { .. })
                    && entry.current_hash().as_deref() != seen.held.as_deref()
                {
                    continue;
                }
                let new = verdict.response(entry.response.as_ref());
                let notice = verdict.notice(entry.notice.as_ref());
                let changed = !super::state::same(new.as_deref(), entry.response.as_deref());
                let notice_changed = notice != entry.notice;
                // Asked again, with another request, while the handler ran: the run that
                // is already queued answers that request, not this one.
                let requester = entry.awaiting_response
                    && (Arc::ptr_eq(&seen.request, &entry.request)
                        || seen.request.get() == entry.request.get());
                let mut changed_any = false;
                let audited = self
                    .app
                    .audit
                    .enabled()
                    .then(|| (entry.current_hash(), entry.renew));
                if changed {
                    entry.set_response(new.clone());
                    // A new response is what a renewal asked for.
                    let renewal = std::mem::take(&mut entry.renew);
                    self.app
                        .provider
                        .renewals
                        .replaced(key, renewal, fort_core::wire::unix_now());
                    changed_any = true;
                }
                if notice_changed {
                    if let Some(n) = &notice {
                        tracing::info!(entry = %key, verdict = ?n, "handler verdict");
                    }
                    entry.notice = notice.clone();
                    changed_any = true;
                }
                if requester {
                    // This run answers the request: whatever it decided is what is owed.
                    entry.awaiting_response = false;
                    changed_any = true;
                }
                let wanted = changed
                    || notice_changed
                    || pending.callback_all
                    || (requester && (new.is_some() || notice.is_some()));
                // A revocation only makes sense if something was delivered before.
                let pointless_revoke = new.is_none()
                    && notice.is_none()
                    && entry.delivery.delivered_hash.is_none()
                    && !changed;
                if let Some((previous, renew)) = audited {
                    let answer = Answer {
                        previous,
                        renewed: renew,
                        changed,
                        notice_changed,
                        requester,
                    };
                    if let Some(event) = answer.event(verdict, entry.current_hash()) {
                        let issued = matches!(event.event, "issued" | "renewed");
                        let force = pending.force || pending.force_entries.contains(key);
                        events.push((
                            key.clone(),
                            event.entry(key).run(trigger, force),
                            new.clone().filter(|_| issued),
                        ));
                    }
                }
                if changed_any {
                    c.put(key.clone(), entry);
                }
                if wanted && !pointless_revoke {
                    planned.push(Planned { key: key.clone() });
                }
            }
            planned
        });
        for (entry, event, issued) in events {
            // The expiry a consumer will read from the payload (§11.4), read off the
            // store's lock.
            let expires = issued.and_then(|r| {
                fort_fulfill::expiry::expiry(&fort_core::wire::payload_bytes_raw(&r))
            });
            self.app
                .audit
                .record_for_entry(&entry, event.expires_at(expires));
        }
        staged
    }
}

/// What a run decided for one entry, as far as the audit trail cares.
struct Answer {
    /// The response hash it held before.
    previous: Option<String>,
    /// Its consumer had asked to renew.
    renewed: bool,
    changed: bool,
    notice_changed: bool,
    requester: bool,
}

impl Answer {
    /// The entry's record (docs/protocol.md §12): a response issued (renewed, when the
    /// consumer asked to renew), revoked, kept for a consumer who asked again, or a
    /// refusal or work under way; `None` when nothing about the entry happened.
    fn event(self, verdict: &Verdict, now: Option<String>) -> Option<Event<Caused>> {
        Some(match verdict {
            Verdict::Refuse(reason) if self.notice_changed || self.changed => {
                Event::caused(CausedKind::Refused)
                    .reason(reason)
                    .previous(self.previous)
            }
            Verdict::Wait(reason) if self.notice_changed => {
                Event::caused(CausedKind::Pending).reason(reason)
            }
            _ if self.changed => match now {
                Some(hash) => Event::caused(if self.renewed {
                    CausedKind::Renewed
                } else {
                    CausedKind::Issued
                })
                .response(Some(hash))
                .previous(self.previous),
                None => Event::caused(CausedKind::Revoked).previous(self.previous),
            },
            _ if self.requester && now.is_some() => Event::caused(CausedKind::Kept).response(now),
            _ => return None,
        })
    }
}

/// Why a handler run failed, for the operator who asked for it: how it ended, and the last
/// line it wrote on stderr (where fort's handlers say what went wrong; a handler writes no
/// secret there), printable, bounded.
fn run_reason(e: &fort_core::process::RunError) -> String {
    let last_line = match e {
        fort_core::process::RunError::Exit { stderr, .. }
        | fort_core::process::RunError::Signal { stderr, .. } => stderr
            .lines()
            .rev()
            .map(str::trim)
            .find(|l| !l.is_empty())
            .map(str::to_owned),
        _ => None,
    };
    let text = match last_line {
        Some(line) => format!("{}: {line}", e.summary()),
        None => e.summary(),
    };
    printable(&text, 300)
}
