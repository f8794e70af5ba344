//! Several providers for one need (docs/protocol.md §11.13): each need is served by its
//! home, kept in the need's state (`from`); a due need moves to the next provider only
//! once its home has failed for the need's `failover_after`, and at most once per that
//! time. Which providers fail is kept in memory: a restart starts with every provider
//! healthy, which can only delay a move. When, why and how often each need moved is kept
//! in its state, across restarts.

use std::collections::{BTreeMap, HashMap};

use fort_core::names::NeedKey;
use fort_core::schema::NeedSpec;
use fort_core::store::PersistError;
use fort_core::wire::unix_now;
use tokio::time::Instant;

use crate::reload::declaration_hash;
use crate::state::NeedState;
use crate::Fulfiller;

/// A provider whose requests got no answer, since its first unanswered one.
struct Failing {
    since: Instant,
    since_unix: u64,
    error: String,
    /// When the last request to it went out, and how many went out since it failed:
    /// while it fails, one request per probe interval is let through (§11.13).
    probed_at: Instant,
    probes: u32,
}

#[derive(Default)]
pub(crate) struct Homes {
    failing: HashMap<String, Failing>,
    /// When each need last moved since the agent started, on the monotonic clock (its
    /// state keeps the wall-clock time, which rules a need moved before a restart).
    moved: HashMap<NeedKey, Instant>,
}

/// How a need's home moved last: unix seconds, why, and how often since it was declared.
#[derive(Debug, Clone, PartialEq)]
pub struct LastMove {
    pub at: u64,
    pub reason: String,
    pub count: u64,
}

/// The provider that serves a need in state `st`: the one it records when the need still
/// names it, else the first one declared.
pub(crate) fn home_of<'a>(spec: &'a NeedSpec, st: &'a NeedState) -> &'a str {
    if spec.from.names(&st.from) {
        &st.from
    } else {
        spec.from.first()
    }
}

/// The provider after `home` in the list (wrapping around): the first one not failing,
/// or the next one when all are.
fn next_provider<'a>(
    spec: &'a NeedSpec,
    home: &'a str,
    failing: &HashMap<String, Failing>,
) -> &'a str {
    let list = spec.from.all();
    let at = list.iter().position(|p| p == home).unwrap_or(0);
    let mut others = (1..list.len()).map(|d| list[(at + d) % list.len()].as_str());
    let healthy = others.clone().find(|p| !failing.contains_key(*p));
    healthy.or_else(|| others.next()).unwrap_or(home)
}

impl Fulfiller {
    /// The provider serving `key` now (`None`: not declared).
    pub fn home(&self, key: &NeedKey) -> Option<String> {
        let spec = self.spec(key)?;
        let st = self.state(key);
        Some(home_of(&spec, &st).to_owned())
    }

    /// Whether `key` is satisfied now.
    pub fn is_satisfied(&self, key: &NeedKey) -> bool {
        self.state(key).satisfied
    }

    /// Per declared need that names several providers, the one serving it (§11.13,
    /// `served_by` of the needs list), when that home is confirmed: it answered a request
    /// for the need or its payload was applied. A need whose home is not confirmed (its
    /// state was lost or set aside, it has just moved) is left out, which a provider reads
    /// as "no proof" and keeps its entry: never as served elsewhere.
    pub fn served_by(&self) -> BTreeMap<String, String> {
        let needs = self.inner.view.lock().needs.clone();
        self.inner.store.read(|states| {
            needs
                .iter()
                .filter(|(_, spec)| spec.from.several())
                .filter_map(|(key, spec)| {
                    let st = states.get(key.as_str())?;
                    let home = home_of(spec, st);
                    (st.home_confirmed && st.from == home)
                        .then(|| (key.to_string(), home.to_owned()))
                })
                .collect()
        })
    }

    /// When and why `key` last moved, and how often it has.
    pub fn last_move(&self, key: &NeedKey) -> Option<LastMove> {
        let st = self.state(key);
        Some(LastMove {
            at: st.moved_at?,
            reason: st.moved_because.unwrap_or_default(),
            count: st.moves,
        })
    }

    /// Whether a request to `provider` may go out now: always while it is not failing;
    /// while it is, one per probe interval (the fulfiller's back-off doubling with each
    /// probe, at most `nag`), so a dead provider is probed, not asked once per need.
    /// `Err` holds the provider's last error, for a request held back.
    pub(crate) fn may_ask(&self, provider: &str, nag: std::time::Duration) -> Result<(), String> {
        let mut view = self.inner.view.lock();
        let Some(f) = view.homes.failing.get_mut(provider) else {
            return Ok(());
        };
        let now = Instant::now();
        let interval = crate::schedule::backoff(self.inner.opts.backoff, f.probes, nag);
        if now.saturating_duration_since(f.probed_at) < interval {
            return Err(f.error.clone());
        }
        f.probed_at = now;
        f.probes = f.probes.saturating_add(1);
        Ok(())
    }

    /// `provider` answered a request: it is not failing (any more).
    pub(crate) fn provider_answered(&self, provider: &str) {
        let mut view = self.inner.view.lock();
        if view.homes.failing.remove(provider).is_some() {
            tracing::info!(provider, "provider answers again");
        }
    }

    /// A request for `key` to its home got no answer. Starts the home's failing clock,
    /// and moves the need when the clock has run for the need's `failover_after` and the
    /// need has not moved within that time. Returns the new home when it moved.
    pub(crate) async fn home_failed(
        &self,
        key: &NeedKey,
        spec: &NeedSpec,
        home: &str,
        error: &str,
    ) -> Option<String> {
        let now = Instant::now();
        let after = spec.failover_after();
        let (next, reason) = {
            let mut view = self.inner.view.lock();
            let failing = view
                .homes
                .failing
                .entry(home.to_owned())
                .or_insert_with(|| Failing {
                    since: now,
                    since_unix: unix_now(),
                    error: error.to_owned(),
                    probed_at: now,
                    probes: 1,
                });
            failing.error = error.to_owned();
            let failed_for = now.saturating_duration_since(failing.since);
            let reason = format!(
                "{home} failing since {} ({})",
                crate::status::when(failing.since_unix),
                failing.error
            );
            if !spec.from.several() || failed_for < after {
                return None;
            }
            let recently = view
                .homes
                .moved
                .get(key)
                .is_some_and(|at| now.saturating_duration_since(*at) < after);
            if recently {
                return None;
            }
            (
                next_provider(spec, home, &view.homes.failing).to_owned(),
                reason,
            )
        };
        if next == home {
            return None;
        }
        // Moved before a restart: the wall clock says how long ago.
        let moved_at = self.state(key).moved_at;
        if moved_at.is_some_and(|at| unix_now().saturating_sub(at) < after.as_secs()) {
            return None;
        }
        match self.move_home(key, spec, home, &next, &reason).await {
            Ok(true) => {}
            Ok(false) => return None,
            Err(e) => {
                tracing::warn!(need = %key, from = home, to = %next, error = %e, "move not recorded; staying");
                return None;
            }
        }
        {
            let mut view = self.inner.view.lock();
            view.homes.moved.insert(key.clone(), now);
            view.clear_failures(key);
        }
        // No release goes to the old home: it is failing, and learns that it no longer
        // serves the need from the needs list's `served_by` when it is back (§11.13).
        tracing::warn!(need = %key, from = home, to = %next, reason = %reason, "need moved to another provider");
        Some(next)
    }

    /// Records `next` as the need's home, durably, if `home` still is. The request is
    /// sent again to the new home as it stands (nothing the old one accepted counts).
    async fn move_home(
        &self,
        key: &NeedKey,
        spec: &NeedSpec,
        home: &str,
        next: &str,
        reason: &str,
    ) -> Result<bool, PersistError> {
        let key_s = key.to_string();
        let hash = declaration_hash(spec, next);
        let note = format!("moved from {home} to {next}: {reason}");
        self.inner
            .store
            .change_durable(|c| {
                let Some(mut st) = c.get(&key_s).cloned() else {
                    return false;
                };
                if home_of(spec, &st) != home {
                    return false;
                }
                st.from = next.to_owned();
                st.request_hash = hash;
                st.sent_sha256 = None;
                st.renewal_sought_at = None;
                st.attempts = 0;
                st.last_error = Some(note);
                st.moved_at = Some(unix_now());
                st.moved_because = Some(reason.to_owned());
                st.moves = st.moves.saturating_add(1);
                st.renew_at_home = true;
                st.home_confirmed = false;
                c.put(key_s.clone(), st);
                true
            })
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(from: &[&str]) -> NeedSpec {
        serde_json::from_value(serde_json::json!({
            "from": from, "request": {}, "nag_seconds": 10
        }))
        .expect("spec")
    }

    fn failing(hosts: &[&str]) -> HashMap<String, Failing> {
        hosts
            .iter()
            .map(|h| {
                (
                    h.to_string(),
                    Failing {
                        since: Instant::now(),
                        since_unix: 0,
                        error: String::new(),
                        probed_at: Instant::now(),
                        probes: 1,
                    },
                )
            })
            .collect()
    }

    #[test]
    fn the_next_provider_is_the_next_healthy_one_in_order() {
        let s = spec(&["a", "b", "c"]);
        assert_eq!(next_provider(&s, "a", &failing(&["a"])), "b");
        assert_eq!(next_provider(&s, "a", &failing(&["a", "b"])), "c");
        assert_eq!(next_provider(&s, "c", &failing(&["c"])), "a");
        // All failing: simply the next one.
        assert_eq!(next_provider(&s, "b", &failing(&["a", "b", "c"])), "c");
    }

    #[test]
    fn the_home_is_the_recorded_one_while_the_need_names_it() {
        let s = spec(&["a", "b"]);
        let st = |from: &str| NeedState {
            from: from.into(),
            ..Default::default()
        };
        assert_eq!(home_of(&s, &st("b")), "b");
        assert_eq!(home_of(&s, &st("z")), "a");
        assert_eq!(home_of(&s, &st("")), "a");
    }

    #[test]
    fn failover_after_defaults_to_two_nag_intervals() {
        let mut s = spec(&["a", "b"]);
        assert_eq!(s.failover_after().as_secs(), 20);
        s.failover_after_seconds = Some(7);
        assert_eq!(s.failover_after().as_secs(), 7);
    }
}
