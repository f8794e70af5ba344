//! When each caller's certificates for new or changed requests were issued, for the last
//! hour: so that one caller cannot change every other consumer's payload at will. Every
//! response carries the KRL; a changed request revokes the certificate it replaces, and a
//! released entry revokes what it held, so each such certificate changes (or later
//! changes) the KRL every consumer installs. At most `max_new_certificates_per_caller_per_hour`
//! of them per caller; renewals of an unchanged request revoke nothing and are not counted.
//!
//! A file of its own beside the state file (`<state>.issued`): the state file keeps its
//! form, so the release before this one still reads it. A missing or unreadable file
//! starts empty: it forgets the last hour's certificates, never more.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::common::state::StateFile;

const FORM: u32 = 1;
const HOUR: u64 = 3600;

#[derive(Default, Serialize, Deserialize)]
struct Times {
    /// Caller → unix seconds of each certificate issued for a new or changed request of
    /// its entries.
    #[serde(default)]
    callers: BTreeMap<String, Vec<u64>>,
}

pub struct IssueLog {
    file: StateFile,
    times: Times,
    changed: bool,
}

fn path_for(state: &Path) -> PathBuf {
    crate::common::state::beside(state, ".issued")
}

impl IssueLog {
    /// The log beside the state file `state`, with what is older than an hour at `now`
    /// forgotten.
    pub fn load(state: &Path, now: u64) -> IssueLog {
        let file = StateFile::new(path_for(state));
        let mut times: Times = file.load_or_forget(
            FORM,
            "ssh-ca",
            "the certificates of the last hour are forgotten",
        );
        let before: usize = times.callers.values().map(Vec::len).sum();
        for list in times.callers.values_mut() {
            list.retain(|t| now.saturating_sub(*t) < HOUR && *t <= now);
        }
        times.callers.retain(|_, l| !l.is_empty());
        let after: usize = times.callers.values().map(Vec::len).sum();
        IssueLog {
            file,
            times,
            changed: before != after,
        }
    }

    /// Why `caller` may not have another certificate for a new or changed request now
    /// (`max` were issued for its entries in the last hour), and in how many seconds it
    /// may; `None`: it may.
    pub fn held_back(&self, caller: &str, max: u32, now: u64) -> Option<(String, u64)> {
        let list = self.times.callers.get(caller)?;
        if list.len() < max as usize {
            return None;
        }
        // The oldest leaves the hour first; past the limit (a lower limit since), the
        // count must fall below it.
        let mut sorted = list.clone();
        sorted.sort_unstable();
        let leaving = sorted[list.len() - max as usize];
        let wait = (leaving + HOUR).saturating_sub(now).max(1);
        Some((
            format!(
                "{} certificates were issued for {caller}'s new or changed requests in the \
                 last hour, the most max_new_certificates_per_caller_per_hour allows",
                list.len()
            ),
            wait,
        ))
    }

    /// `caller` got a certificate for a new or changed request at `now`.
    pub fn record(&mut self, caller: &str, now: u64) {
        self.times
            .callers
            .entry(caller.to_owned())
            .or_default()
            .push(now);
        self.changed = true;
    }

    /// Writes the file when anything changed; a failure is reported and costs only the
    /// memory of the last hour's certificates.
    pub fn save(self) {
        if self.changed {
            self.file.save_or_report(FORM, &self.times, "ssh-ca");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_hour_of_certificates_per_caller() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("ssh-ca.json");
        let t0 = 1_800_000_000;
        let mut log = IssueLog::load(&state, t0);
        for i in 0..3 {
            assert!(log.held_back("app", 3, t0 + i).is_none());
            log.record("app", t0 + i * 600);
        }
        log.save();
        let log = IssueLog::load(&state, t0 + 1300);
        let (why, wait) = log.held_back("app", 3, t0 + 1300).unwrap();
        assert!(
            why.contains("3 certificates") && why.contains("app's"),
            "{why}"
        );
        assert_eq!(wait, HOUR - 1300);
        // Another caller, and one whose name begins like it, are not counted with it.
        assert!(log.held_back("web", 3, t0 + 1300).is_none());
        assert!(log.held_back("apple", 3, t0 + 1300).is_none());
        // A lower limit: the count must fall below it.
        let (_, wait) = log.held_back("app", 1, t0 + 1300).unwrap();
        assert_eq!(wait, HOUR + 1200 - 1300);
        // An hour after the first, one may again.
        let later = IssueLog::load(&state, t0 + HOUR);
        assert!(later.held_back("app", 3, t0 + HOUR).is_none());
        // Times from the future (a clock set back) are forgotten, not held against it.
        let back = IssueLog::load(&state, t0 - 10);
        assert!(back.held_back("app", 1, t0 - 10).is_none());
        // A broken file starts empty.
        std::fs::write(path_for(&state), "{").unwrap();
        assert!(IssueLog::load(&state, t0 + 1300)
            .held_back("app", 1, t0 + 1300)
            .is_none());
    }
}
