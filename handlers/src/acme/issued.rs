//! When each certificate was issued, per entry and per set of names, for the last 7 days,
//! and when each caller's orders were placed, for the last hour: so that no caller spends
//! the CA's rate limits, which every caller of the provider shares
//! (`max_certificates_per_week`, `max_orders_per_caller_per_hour`), and a renewal is only
//! honoured when it is due.
//!
//! A file of its own beside the state file (`<state>.issued`): the state file keeps its
//! form, so the release before this one still reads it. A missing or unreadable file
//! starts empty: it forgets the last week's issuances, never more.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::common::state::StateFile;

const FORM: u32 = 1;
const WEEK: u64 = 7 * 86_400;
const HOUR: u64 = 3600;

#[derive(Default, Serialize, Deserialize)]
struct Times {
    /// Entry key → unix seconds of each certificate issued to it.
    #[serde(default)]
    entries: BTreeMap<String, Vec<u64>>,
    /// The names, sorted and joined by `,` → unix seconds of each certificate for them.
    #[serde(default)]
    names: BTreeMap<String, Vec<u64>>,
    /// Caller → unix seconds of each order placed for its entries (whatever became of
    /// it: a failed validation counts at the CA as much as a certificate).
    #[serde(default)]
    orders: BTreeMap<String, Vec<u64>>,
}

/// The limits `IssueLog::held_back` applies, per 7 days.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// For one entry, and for one set of names.
    pub per_entry: u32,
    /// For every entry of one caller together.
    pub per_caller: u32,
    /// Orders placed for every entry of one caller together, per hour.
    pub orders_per_caller: u32,
}

pub struct IssueLog {
    file: StateFile,
    times: Times,
    changed: bool,
    /// Orders under way (or placed this run), per caller and per set of names: each may
    /// end in a certificate, so each counts as one until it does.
    ordered_by_caller: HashMap<String, usize>,
    ordered_by_names: HashMap<String, usize>,
    /// Orders this run is about to place, per caller: not recorded until they are.
    placing: HashMap<String, usize>,
}

fn path_for(state: &Path) -> PathBuf {
    crate::common::state::beside(state, ".issued")
}

/// The caller of an entry key (`<origin>:<type>/<id>`).
fn caller_of(key: &str) -> &str {
    key.split_once(':').map_or(key, |(origin, _)| origin)
}

fn name_set(names: &[String]) -> String {
    let mut sorted: Vec<&str> = names.iter().map(String::as_str).collect();
    sorted.sort_unstable();
    sorted.dedup();
    sorted.join(",")
}

impl IssueLog {
    pub fn load(state: &Path, now: u64) -> IssueLog {
        let file = StateFile::new(path_for(state));
        let mut times: Times =
            file.load_or_forget(FORM, "acme", "the issuances of the last week are forgotten");
        let count = |t: &Times| t.entries.len() + t.names.len() + t.orders.len();
        let before = count(&times);
        for list in times.entries.values_mut().chain(times.names.values_mut()) {
            list.retain(|t| now.saturating_sub(*t) < WEEK && *t <= now);
        }
        for list in times.orders.values_mut() {
            list.retain(|t| now.saturating_sub(*t) < HOUR && *t <= now);
        }
        times.entries.retain(|_, l| !l.is_empty());
        times.names.retain(|_, l| !l.is_empty());
        times.orders.retain(|_, l| !l.is_empty());
        let changed = before != count(&times);
        IssueLog {
            file,
            times,
            changed,
            ordered_by_caller: HashMap::new(),
            ordered_by_names: HashMap::new(),
            placing: HashMap::new(),
        }
    }

    /// `key` places an order for `names` this run: counted against every limit at once,
    /// so that the orders of one run cannot go past one together.
    pub fn placing(&mut self, key: &str, names: &[String]) {
        *self.placing.entry(caller_of(key).to_owned()).or_default() += 1;
        self.ordered(key, names);
    }

    /// `key` has an order for `names` under way, or places one now: counted against the
    /// caller's and the names' limits as if issued, so that the orders of one run cannot
    /// go past them together.
    pub fn ordered(&mut self, key: &str, names: &[String]) {
        *self
            .ordered_by_caller
            .entry(caller_of(key).to_owned())
            .or_default() += 1;
        *self.ordered_by_names.entry(name_set(names)).or_default() += 1;
    }

    /// Why `key` may not get another certificate for `names` now (a limit of `limits` is
    /// reached for the entry, its caller or the names), with when it may; `None`: it may.
    /// `renewing`: the entry holds a certificate for exactly these names that is due for
    /// renewal (or expired). Only such a renewal may take the names' last certificate of
    /// the week: every caller allowed these names shares their limit, and another one's
    /// new certificates must not leave a holder unable to renew.
    pub fn held_back(
        &self,
        key: &str,
        names: &[String],
        limits: Limits,
        renewing: bool,
        now: u64,
    ) -> Option<String> {
        let check = |count: usize, oldest: Option<u64>, max: u32, whose: &str, setting: &str| {
            (count >= max as usize).then(|| {
                let wait = (oldest.unwrap_or(now) + WEEK).saturating_sub(now);
                format!(
                    "{count} certificates were issued{} for {whose} in the last 7 days, the \
                     most {setting} allows; the next in {} h",
                    if whose == "this entry" {
                        ""
                    } else {
                        " or ordered"
                    },
                    wait.div_ceil(3600)
                )
            })
        };
        let of = |list: Option<&Vec<u64>>| {
            list.map_or((0, None), |l| (l.len(), l.iter().min().copied()))
        };
        let (n, oldest) = of(self.times.entries.get(key));
        let entry = check(
            n,
            oldest,
            limits.per_entry,
            "this entry",
            "max_certificates_per_week",
        );
        // Every entry of the caller, those it released included: a new id starts no
        // new count.
        let caller = caller_of(key);
        let prefix = format!("{caller}:");
        let (n, oldest) = self
            .times
            .entries
            .range(prefix.clone()..)
            .take_while(|(k, _)| k.starts_with(&prefix))
            .flat_map(|(_, l)| l)
            .fold((0, None::<u64>), |(n, o), t| {
                (n + 1, Some(o.map_or(*t, |o| o.min(*t))))
            });
        let n = n + self.ordered_by_caller.get(caller).copied().unwrap_or(0);
        let by_caller = || {
            check(
                n,
                oldest,
                limits.per_caller,
                &format!("{caller}'s entries"),
                "max_certificates_per_caller_per_week",
            )
        };
        let set = name_set(names);
        let (n, oldest) = of(self.times.names.get(&set));
        let n = n + self.ordered_by_names.get(&set).copied().unwrap_or(0);
        let by_names = || {
            let reserved = usize::from(!renewing && limits.per_entry > 1);
            let max = limits.per_entry as usize - reserved;
            check(
                n,
                oldest,
                limits.per_entry,
                "these names (by any caller)",
                "max_certificates_per_week",
            )
            .or_else(|| {
                (n >= max).then(|| {
                    format!(
                        "{n} certificates were issued or ordered for these names (by any caller) \
                         in the last 7 days, and the last one max_certificates_per_week allows \
                         is kept for a certificate of them that is due for renewal"
                    )
                })
            })
        };
        let by_orders = || {
            let orders = self.times.orders.get(caller);
            let n = orders.map_or(0, Vec::len) + self.placing.get(caller).copied().unwrap_or(0);
            (n >= limits.orders_per_caller as usize).then(|| {
                let oldest = orders.and_then(|o| o.iter().min().copied());
                let wait = (oldest.unwrap_or(now) + HOUR).saturating_sub(now);
                format!(
                    "{n} orders were placed for {caller}'s entries in the last hour, the most \
                     max_orders_per_caller_per_hour allows; the next in {} min",
                    wait.div_ceil(60)
                )
            })
        };
        entry
            .or_else(by_caller)
            .or_else(by_names)
            .or_else(by_orders)
    }

    /// An order was placed for `key` at `now`.
    pub fn placed(&mut self, key: &str, now: u64) {
        self.times
            .orders
            .entry(caller_of(key).to_owned())
            .or_default()
            .push(now);
        self.changed = true;
    }

    /// `key` got a certificate for `names` at `now`.
    pub fn record(&mut self, key: &str, names: &[String], now: u64) {
        self.times
            .entries
            .entry(key.to_owned())
            .or_default()
            .push(now);
        self.times
            .names
            .entry(name_set(names))
            .or_default()
            .push(now);
        self.changed = true;
    }

    /// Writes the file when anything changed; a failure is reported and costs only the
    /// memory of this week's issuances.
    pub fn save(self) {
        if self.changed {
            self.file.save_or_report(FORM, &self.times, "acme");
        }
    }
}

/// Whether a certificate valid from `not_before` to `not_after` is due for renewal at
/// `now`: in the last third of its lifetime, or past its end. A renewal asked for sooner
/// keeps the certificate (the CA would count a duplicate against everyone's limit).
pub fn due(not_before: i64, not_after: i64, now: u64) -> bool {
    let now = i64::try_from(now).unwrap_or(i64::MAX);
    let lifetime = not_after.saturating_sub(not_before).max(0);
    not_after.saturating_sub(now) <= lifetime / 3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_week_of_certificates_per_entry_and_per_names() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("acme.json");
        let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let t0 = 1_800_000_000;
        let two = Limits {
            per_entry: 2,
            per_caller: 100,
            orders_per_caller: 1000,
        };
        let mut log = IssueLog::load(&state, t0);
        for i in 0..2 {
            // The second a renewal that is due: the names' last of the week is for it.
            assert!(log
                .held_back("a:c/x", &names(&["a.test"]), two, i == 1, t0)
                .is_none());
            log.record("a:c/x", &names(&["a.test"]), t0 + i);
        }
        log.save();
        let log = IssueLog::load(&state, t0 + 10);
        let why = log
            .held_back("a:c/x", &names(&["b.test"]), two, false, t0 + 10)
            .unwrap();
        assert!(
            why.contains("for this entry") && why.contains("168 h"),
            "{why}"
        );
        // Another caller asking for the same names (in another order) is held back too.
        let why = log
            .held_back("b:c/y", &names(&["a.test", "a.test"]), two, false, t0 + 10)
            .unwrap();
        assert!(why.contains("these names"), "{why}");
        assert!(log
            .held_back("b:c/y", &names(&["b.test"]), two, false, t0 + 10)
            .is_none());
        // A week on, forgotten.
        let later = IssueLog::load(&state, t0 + WEEK + 2);
        assert!(later
            .held_back("a:c/x", &names(&["a.test"]), two, false, t0 + WEEK + 2)
            .is_none());
        // A broken file starts empty.
        std::fs::write(path_for(&state), "{").unwrap();
        assert!(IssueLog::load(&state, t0)
            .held_back(
                "a:c/x",
                &names(&["a.test"]),
                Limits {
                    per_entry: 1,
                    ..two
                },
                false,
                t0
            )
            .is_none());
    }

    #[test]
    fn a_caller_counts_all_its_entries_released_ones_included() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("acme.json");
        let t0 = 1_800_000_000;
        let limits = Limits {
            per_entry: 5,
            per_caller: 3,
            orders_per_caller: 1000,
        };
        let mut log = IssueLog::load(&state, t0);
        for i in 0..3 {
            let name = vec![format!("n{i}.test")];
            assert!(log
                .held_back(&format!("app:c/e{i}"), &name, limits, false, t0)
                .is_none());
            log.record(&format!("app:c/e{i}"), &name, t0 + i);
        }
        // A new id and new names: the caller's count goes on.
        let why = log
            .held_back(
                "app:c/fresh",
                &["n9.test".to_owned()],
                limits,
                false,
                t0 + 10,
            )
            .unwrap();
        assert!(
            why.contains("app's entries") && why.contains("max_certificates_per_caller_per_week"),
            "{why}"
        );
        // Orders under way count as certificates.
        let mut log = IssueLog::load(&state, t0);
        assert!(log
            .held_back("web:c/a", &["w.test".to_owned()], limits, false, t0)
            .is_none());
        for i in 0..3 {
            log.ordered(&format!("web:c/o{i}"), &[format!("o{i}.test")]);
        }
        assert!(log
            .held_back("web:c/a", &["w.test".to_owned()], limits, false, t0)
            .is_some_and(|why| why.contains("3 certificates")));
        // Another caller, and a caller whose name begins like it, are not counted with it.
        for key in ["ops:c/e0", "apple:c/e0"] {
            assert!(log
                .held_back(key, &["w.test".to_owned()], limits, false, t0 + 10)
                .is_none());
        }
    }

    #[test]
    fn the_names_last_certificate_of_the_week_is_kept_for_a_due_renewal() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("acme.json");
        let t0 = 1_800_000_000;
        let limits = Limits {
            per_entry: 3,
            per_caller: 100,
            orders_per_caller: 1000,
        };
        let names = ["shared.test".to_owned()];
        let mut log = IssueLog::load(&state, t0);
        log.record("holder:c/x", &names, t0);
        // Another caller allowed the same names: one more, not the last.
        assert!(log
            .held_back("other:c/y", &names, limits, false, t0)
            .is_none());
        log.record("other:c/y", &names, t0);
        let why = log
            .held_back("other:c/z", &names, limits, false, t0)
            .unwrap();
        assert!(why.contains("due for renewal"), "{why}");
        // The holder's renewal that is due takes it.
        assert!(log
            .held_back("holder:c/x", &names, limits, true, t0)
            .is_none());
        log.record("holder:c/x", &names, t0);
        assert!(log
            .held_back("holder:c/x", &names, limits, true, t0)
            .is_some());
        // A limit of one keeps nothing back.
        let one = Limits {
            per_entry: 1,
            per_caller: 100,
            orders_per_caller: 1000,
        };
        let fresh = IssueLog::load(&dir.path().join("other.json"), t0);
        assert!(fresh.held_back("a:c/x", &names, one, false, t0).is_none());
    }

    #[test]
    fn a_callers_orders_are_bounded_per_hour_whatever_became_of_them() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("acme.json");
        let t0 = 1_800_000_000;
        let limits = Limits {
            per_entry: 5,
            per_caller: 100,
            orders_per_caller: 2,
        };
        let mut log = IssueLog::load(&state, t0);
        log.placed("app:c/a", t0);
        log.placed("app:c/b", t0 + 60);
        log.save();
        let log = IssueLog::load(&state, t0 + 120);
        let why = log
            .held_back("app:c/new", &["n.test".to_owned()], limits, false, t0 + 120)
            .unwrap();
        assert!(
            why.contains("2 orders") && why.contains("the next in 58 min"),
            "{why}"
        );
        assert!(log
            .held_back("web:c/a", &["w.test".to_owned()], limits, false, t0 + 120)
            .is_none());
        let later = IssueLog::load(&state, t0 + HOUR + 1);
        assert!(later
            .held_back(
                "app:c/new",
                &["n.test".to_owned()],
                limits,
                false,
                t0 + HOUR + 1
            )
            .is_none());
    }

    #[test]
    fn due_in_the_last_third() {
        let (from, to) = (0, 90 * 86_400);
        assert!(!due(from, to, 59 * 86_400));
        assert!(due(from, to, 60 * 86_400));
        assert!(due(from, to, 100 * 86_400));
        assert!(due(from, from, 0), "no lifetime: always due");
    }
}
