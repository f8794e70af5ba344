//! One row per declared need, for `fort-agent status`, the `status` built-in, the
//! fleet view and the metrics (docs/protocol.md §11.7).

use serde::Serialize;

use crate::state::Phase;
use crate::Fulfiller;

#[derive(Debug, Clone, Serialize)]
pub struct NeedStatus {
    pub need: String,
    pub from: String,
    /// `pending`, `waiting`, `satisfied`, `failed`, `expiring` or `expired`.
    pub state: Phase,
    /// Why it is in that state, in one line (never payload bytes); `None` when satisfied.
    pub reason: Option<String>,
    /// Unix seconds of the last change of `state`.
    pub since: u64,
    /// When the payload it holds expires.
    pub expires_at: Option<u64>,
    /// `state == satisfied`.
    pub satisfied: bool,
    pub satisfied_at: Option<u64>,
    /// Payloads applied since the need was declared (an unchanged one counts too), and
    /// unix seconds of the last.
    pub received: u64,
    pub received_at: Option<u64>,
    pub last_sought: Option<u64>,
    pub attempts: u32,
    /// Unix seconds of the next planned request or check; `None`: nothing planned.
    pub next_request: Option<u64>,
}

impl Fulfiller {
    /// One row per declared need.
    pub fn status(&self) -> Vec<NeedStatus> {
        let (needs, due) = {
            let view = self.inner.view.lock();
            (view.needs.clone(), view.due.clone())
        };
        let now = tokio::time::Instant::now();
        let wall = fort_core::wire::unix_now();
        self.inner.store.read(|states| {
            needs
                .iter()
                .map(|(key, spec)| {
                    let st = states.get(key.as_str()).cloned().unwrap_or_default();
                    NeedStatus {
                        need: key.to_string(),
                        from: spec.from.clone(),
                        state: st.phase,
                        reason: st.last_error,
                        since: st.since,
                        expires_at: st.expires_at,
                        satisfied: st.phase == Phase::Satisfied,
                        satisfied_at: st.satisfied_at,
                        received: st.received,
                        received_at: st.received_at,
                        last_sought: st.last_sought,
                        attempts: st.attempts,
                        next_request: due
                            .get(key)
                            .map(|at| wall + at.saturating_duration_since(now).as_secs()),
                    }
                })
                .collect()
        })
    }

    /// Needs per state, without building the rows: cheap enough for every metrics
    /// scrape and every poll. (The state holds exactly the declared needs: a reload
    /// removes the others.)
    pub fn counts(&self) -> [(Phase, usize); 6] {
        let mut counts = Phase::ALL.map(|p| (p, 0));
        self.inner.store.read(|states| {
            for st in states.values() {
                counts[st.phase as usize].1 += 1;
            }
        });
        counts
    }
}
