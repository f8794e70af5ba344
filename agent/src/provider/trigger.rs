//! An operator's run of a capability's handler (`fort-agent trigger`, the `trigger`
//! built-in, docs/protocol.md §5a): for every entry, or for one, with or without the
//! cached responses.

use std::sync::Arc;

use fort_core::schema::Mode;
use serde::Serialize;

use super::state::capability_of;
use super::{Provider, RunRecord, Trigger};
use crate::app::App;

/// What an operator asked for.
#[derive(Debug, Clone)]
pub struct TriggerAsk {
    pub capability: String,
    /// One entry key of the capability; `None`: every entry.
    pub entry: Option<String>,
    /// Leave cached responses out of the handler's input: the entry's alone when `entry`
    /// is set, else every entry's.
    pub force: bool,
    pub trigger: Trigger,
}

/// How the run went, and what became of the entry asked about.
#[derive(Debug, Clone, Serialize)]
pub struct TriggerOutcome {
    pub capability: String,
    pub entry: Option<String>,
    pub force: bool,
    pub run: RunRecord,
    /// SHA-256 of the entry's response payload before and after the run (`None`: no
    /// response, or no entry asked about).
    pub before: Option<String>,
    pub after: Option<String>,
}

/// Why nothing ran.
#[derive(Debug, thiserror::Error)]
pub enum TriggerError {
    #[error("no capability {0} on this host")]
    NoCapability(String),
    #[error("{0} is an rpc capability; it has no entries and no runs to trigger")]
    Rpc(String),
    #[error("{entry} is not an entry of {capability}: entry keys are <origin>:{capability}/<id>")]
    WrongCapability { entry: String, capability: String },
    #[error("no entry {entry} in {capability}{known}")]
    NoEntry {
        entry: String,
        capability: String,
        known: String,
    },
    #[error("the entry could not be marked as asked for: {0}")]
    Persist(#[from] fort_core::store::PersistError),
    #[error("the agent is shutting down")]
    ShuttingDown,
}

impl TriggerError {
    /// Whether the thing asked for does not exist (404), rather than failed (500).
    pub fn is_not_found(&self) -> bool {
        !matches!(self, TriggerError::Persist(_) | TriggerError::ShuttingDown)
    }
}

/// A few entry keys of `capability`, for a message about a mistyped one.
fn some_entries(provider: &Provider, capability: &str) -> String {
    let keys: Vec<String> = provider.store.read(|entries| {
        entries
            .keys()
            .filter(|k| capability_of(k) == Some(capability))
            .take(5)
            .cloned()
            .collect()
    });
    if keys.is_empty() {
        format!(" ({capability} holds no entries)")
    } else {
        format!(" (entries include {})", keys.join(", "))
    }
}

impl Provider {
    /// Runs `ask.capability`'s handler and returns once the run is over. With an entry,
    /// that entry counts as asked for again (its consumer is called back after the run,
    /// changed or not), and `force` hides only its cached response; the others keep
    /// theirs, so only this entry is issued a new response.
    pub async fn trigger(
        &self,
        app: &Arc<App>,
        ask: TriggerAsk,
    ) -> Result<TriggerOutcome, TriggerError> {
        let cap = &ask.capability;
        match app.loaded.load().capabilities.get(cap) {
            Some(c) if c.mode == Mode::Async => {}
            Some(_) => return Err(TriggerError::Rpc(cap.clone())),
            None => return Err(TriggerError::NoCapability(cap.clone())),
        }
        let mut before = None;
        if let Some(entry) = &ask.entry {
            if capability_of(entry) != Some(cap.as_str()) {
                return Err(TriggerError::WrongCapability {
                    entry: entry.clone(),
                    capability: cap.clone(),
                });
            }
            // Owed its response after the run, as if its consumer had asked again; on
            // disk, so a restart before the run still owes it.
            let found = self
                .store
                .change_durable(|c| match c.get(entry).cloned() {
                    Some(mut e) => {
                        let hash = e.current_hash();
                        if !e.awaiting_response {
                            e.awaiting_response = true;
                            c.put(entry.clone(), e);
                        }
                        Some(hash)
                    }
                    None => None,
                })
                .await?;
            match found {
                Some(hash) => before = hash,
                None => {
                    return Err(TriggerError::NoEntry {
                        entry: entry.clone(),
                        capability: cap.clone(),
                        known: some_entries(self, cap),
                    })
                }
            }
        }
        let (force_all, force_entry) = match (&ask.entry, ask.force) {
            (_, false) => (false, None),
            (None, true) => (true, None),
            (Some(e), true) => (false, Some(e.clone())),
        };
        let rx = self.enqueue_forced(app, cap, ask.trigger, false, force_all, force_entry);
        let run = rx.await.map_err(|_| TriggerError::ShuttingDown)?;
        let after = ask.entry.as_ref().and_then(|e| {
            self.store
                .read(|entries| entries.get(e).and_then(|e| e.current_hash()))
        });
        Ok(TriggerOutcome {
            capability: ask.capability,
            entry: ask.entry,
            force: ask.force,
            run,
            before,
            after,
        })
    }
}
