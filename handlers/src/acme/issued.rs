//! When each certificate was issued, per entry and per set of names, for the last 7 days:
//! so that no caller spends the CA's rate limits, which every caller of the provider
//! shares (`max_certificates_per_week`), and a renewal is only honoured when it is due.
//!
//! A file of its own beside the state file (`<state>.issued`): the state file keeps its
//! form, so the release before this one still reads it. A missing or unreadable file
//! starts empty: it forgets the last week's issuances, never more.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::common::state::StateFile;

const FORM: u32 = 1;
const WEEK: u64 = 7 * 86_400;

#[derive(Default, Serialize, Deserialize)]
struct Times {
    /// Entry key → unix seconds of each certificate issued to it.
    #[serde(default)]
    entries: BTreeMap<String, Vec<u64>>,
    /// The names, sorted and joined by `,` → unix seconds of each certificate for them.
    #[serde(default)]
    names: BTreeMap<String, Vec<u64>>,
}

pub struct IssueLog {
    file: StateFile,
    times: Times,
    changed: bool,
}

fn path_for(state: &Path) -> PathBuf {
    let mut name = state.as_os_str().to_owned();
    name.push(".issued");
    PathBuf::from(name)
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
        let mut times: Times = file.load(FORM).unwrap_or_else(|e| {
            eprintln!("acme: {e:#}; the issuances of the last week are forgotten");
            Times::default()
        });
        let before = times.entries.len() + times.names.len();
        for list in times.entries.values_mut().chain(times.names.values_mut()) {
            list.retain(|t| now.saturating_sub(*t) < WEEK && *t <= now);
        }
        times.entries.retain(|_, l| !l.is_empty());
        times.names.retain(|_, l| !l.is_empty());
        let changed = before != times.entries.len() + times.names.len();
        IssueLog {
            file,
            times,
            changed,
        }
    }

    /// Why `key` may not get another certificate for `names` now (the limit `max` is
    /// reached for the entry or for the names), with when it may; `None`: it may.
    pub fn held_back(&self, key: &str, names: &[String], max: u32, now: u64) -> Option<String> {
        let max = max as usize;
        let check = |list: Option<&Vec<u64>>, whose: &str| {
            let list = list?;
            (list.len() >= max).then(|| {
                let oldest = list.iter().min().copied().unwrap_or(now);
                let wait = (oldest + WEEK).saturating_sub(now);
                format!(
                    "{} certificates were issued for {whose} in the last 7 days, the most \
                     max_certificates_per_week allows; the next in {} h",
                    list.len(),
                    wait.div_ceil(3600)
                )
            })
        };
        check(self.times.entries.get(key), "this entry").or_else(|| {
            check(
                self.times.names.get(&name_set(names)),
                "these names (by any caller)",
            )
        })
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
            if let Err(e) = self.file.save(FORM, &self.times) {
                eprintln!("acme: {e:#}");
            }
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
        let mut log = IssueLog::load(&state, t0);
        for i in 0..2 {
            assert!(log.held_back("a:c/x", &names(&["a.test"]), 2, t0).is_none());
            log.record("a:c/x", &names(&["a.test"]), t0 + i);
        }
        log.save();
        let log = IssueLog::load(&state, t0 + 10);
        let why = log
            .held_back("a:c/x", &names(&["b.test"]), 2, t0 + 10)
            .unwrap();
        assert!(
            why.contains("for this entry") && why.contains("168 h"),
            "{why}"
        );
        // Another caller asking for the same names (in another order) is held back too.
        let why = log
            .held_back("b:c/y", &names(&["a.test", "a.test"]), 2, t0 + 10)
            .unwrap();
        assert!(why.contains("these names"), "{why}");
        assert!(log
            .held_back("b:c/y", &names(&["b.test"]), 2, t0 + 10)
            .is_none());
        // A week on, forgotten.
        let later = IssueLog::load(&state, t0 + WEEK + 2);
        assert!(later
            .held_back("a:c/x", &names(&["a.test"]), 2, t0 + WEEK + 2)
            .is_none());
        // A broken file starts empty.
        std::fs::write(path_for(&state), "{").unwrap();
        assert!(IssueLog::load(&state, t0)
            .held_back("a:c/x", &names(&["a.test"]), 1, t0)
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
