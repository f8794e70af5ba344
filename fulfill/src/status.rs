//! One row per declared need, for `fort-agent status`, the `status` built-in, the
//! fleet view and the metrics (docs/protocol.md §11.7).

use serde::Serialize;

use fort_core::names::NeedKey;
use fort_core::schema::NeedSpec;

use crate::state::Phase;
use crate::Fulfiller;

#[derive(Debug, Clone, Serialize)]
pub struct NeedStatus {
    pub need: String,
    /// The provider serving the need: its home when it names several (§11.13).
    pub from: String,
    /// The providers as declared, in order (one for a single `from`).
    pub providers: Vec<String>,
    /// Unix seconds of the need's last move to another provider, and why it moved;
    /// `None`: it has never moved (kept across restarts and changes of the need).
    pub home_since: Option<u64>,
    pub moved_because: Option<String>,
    /// Moves since the need was first declared.
    pub moves: u64,
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

/// The need's state as the clock has it: a satisfied need past its renewal line is
/// `expiring`, any need past its expiry `expired`, even before it is next attended.
fn effective_phase(spec: &NeedSpec, st: &crate::state::NeedState, wall: u64) -> Phase {
    crate::fulfiller::renewal_phase(spec, st, wall)
        .filter(|p| st.phase == Phase::Satisfied || *p == Phase::Expired)
        .unwrap_or(st.phase)
}

/// The need's reason, also between the clock crossing an expiry line and the need being
/// attended (which then says the same): a reason recorded while `expiring` reads
/// `expired` once the clock says so.
fn clock_reason(phase: Phase, st: &crate::state::NeedState) -> Option<String> {
    let at = st.expires_at.map(when).unwrap_or_default();
    match (phase, st.last_error.as_deref()) {
        (p, reason) if p == st.phase => reason.map(str::to_owned),
        (Phase::Expired, Some(r)) if r.starts_with("expires ") => {
            Some(format!("expired {}", &r["expires ".len()..]))
        }
        (Phase::Expired, _) => Some(format!("expired at {at}; asking for a new one")),
        (Phase::Expiring, None) => Some(format!("expires at {at}; asking for a new one")),
        (_, reason) => reason.map(str::to_owned),
    }
}

/// A moment for a reason line: `2026-11-25T12:00:00Z`.
pub(crate) fn when(at: u64) -> String {
    let t = std::time::UNIX_EPOCH
        .checked_add(std::time::Duration::from_secs(at.min(253_402_300_799)))
        .unwrap_or(std::time::UNIX_EPOCH);
    humantime::format_rfc3339_seconds(t).to_string()
}

/// A duration rounded to its two largest units: `29d 23h`, `14m 30s`, `5s`.
pub(crate) fn span(seconds: u64) -> String {
    const UNITS: [(u64, &str); 4] = [(86_400, "d"), (3_600, "h"), (60, "m"), (1, "s")];
    let mut parts = Vec::new();
    let mut rest = seconds;
    for (size, unit) in UNITS {
        if rest >= size || (parts.is_empty() && size == 1) {
            parts.push(format!("{}{unit}", rest / size));
            rest %= size;
        }
        if parts.len() == 2 {
            break;
        }
    }
    parts.join(" ")
}

/// `in 14m 30s`.
pub(crate) fn in_(seconds: u64) -> String {
    format!("in {}", span(seconds))
}

/// `3m ago`.
pub(crate) fn ago(at: u64, now: u64) -> String {
    format!("{} ago", span(now.saturating_sub(at)))
}

/// `every 15m 0s` → `every 15m`.
pub(crate) fn every(seconds: u64) -> String {
    format!("every {}", span(seconds).trim_end_matches(" 0s"))
}

impl Fulfiller {
    /// One row per declared need.
    pub fn status(&self) -> Vec<NeedStatus> {
        let (needs, due) = {
            let view = self.inner.view.lock();
            (view.needs.clone(), view.due.clone())
        };
        let moves: std::collections::HashMap<NeedKey, crate::LastMove> = needs
            .keys()
            .filter_map(|k| self.last_move(k).map(|m| (k.clone(), m)))
            .collect();
        let now = tokio::time::Instant::now();
        let wall = fort_core::wire::unix_now();
        self.inner.store.read(|states| {
            needs
                .iter()
                .map(|(key, spec)| {
                    let st = states.get(key.as_str()).cloned().unwrap_or_default();
                    // The clock decides expiry, not the last event the need saw.
                    let phase = effective_phase(spec, &st, wall);
                    let moved = moves.get(key);
                    NeedStatus {
                        need: key.to_string(),
                        from: crate::home::home_of(spec, &st).to_owned(),
                        providers: spec.from.all().to_vec(),
                        home_since: moved.map(|m| m.at),
                        moved_because: moved.map(|m| m.reason.clone()),
                        moves: moved.map_or(0, |m| m.count),
                        state: phase,
                        // Between the clock crossing the line and the need being attended.
                        reason: clock_reason(phase, &st),
                        since: st.since,
                        expires_at: st.expires_at,
                        satisfied: phase == Phase::Satisfied,
                        satisfied_at: st.satisfied_at,
                        received: st.received,
                        received_at: st.received_at,
                        last_sought: st.last_sought,
                        attempts: st.attempts,
                        next_request: due.get(key).map(|at| {
                            wall.saturating_add(at.saturating_duration_since(now).as_secs())
                        }),
                    }
                })
                .collect()
        })
    }

    /// Needs per state, without building the rows: cheap enough for every metrics
    /// scrape and every poll. (The state holds exactly the declared needs: a reload
    /// removes the others.)
    /// Every declared need with its provider and the requests for it in a row that got
    /// no answer from that provider (no connection, TLS, a timeout, a server error); 0
    /// once one is answered.
    pub fn request_failures(&self) -> Vec<(String, String, u32)> {
        let (needs, failures) = {
            let view = self.inner.view.lock();
            (view.needs.clone(), view.failures.clone())
        };
        self.inner.store.read(|states| {
            needs
                .iter()
                .map(|(key, spec)| {
                    let n = failures.get(key).copied().unwrap_or(0);
                    let home = states
                        .get(key.as_str())
                        .map_or(spec.from.first(), |st| crate::home::home_of(spec, st));
                    (key.to_string(), home.to_owned(), n)
                })
                .collect()
        })
    }

    pub fn counts(&self) -> [(Phase, usize); 6] {
        let mut counts = Phase::ALL.map(|p| (p, 0));
        let needs = self.inner.view.lock().needs.clone();
        let wall = fort_core::wire::unix_now();
        self.inner.store.read(|states| {
            for (key, st) in states {
                // As the rows say: the clock decides expiry.
                let phase = NeedKey::parse(key)
                    .and_then(|k| needs.get(&k))
                    .map_or(st.phase, |spec| effective_phase(spec, st, wall));
                counts[phase as usize].1 += 1;
            }
        });
        counts
    }
}
