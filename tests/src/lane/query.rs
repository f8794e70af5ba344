//! What systemd reports about a machine's units: properties, states, and how often a
//! unit was started or reloaded, from systemd's own journal records.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::machine::{text, Machine};

/// systemd's catalogue ids of "Started" and "Reloaded" (a job that finished).
const UNIT_STARTED: &str = "39f53479d3a045ac8e11786248231fbf";
const UNIT_RELOADED: &str = "7b05ebc668384222baa8881179cfda54";

impl Machine {
    /// Properties of a unit, as `systemctl show` reports them.
    pub fn show(&self, unit: &str, props: &[&str]) -> BTreeMap<String, String> {
        let mut args = vec!["systemctl", "show", unit];
        for p in props {
            args.extend(["-p", p]);
        }
        let out = self.exec(&args);
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect()
    }

    /// One property of a unit.
    pub fn prop(&self, unit: &str, prop: &str) -> String {
        self.show(unit, &[prop]).remove(prop).unwrap_or_default()
    }

    /// Waits until `unit` is active, failing at once if it failed.
    pub fn wait_for_unit(&self, unit: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let state = self.prop(unit, "ActiveState");
            if state == "active" {
                return;
            }
            if state == "failed" || Instant::now() > deadline {
                let status = self.exec(&["systemctl", "status", "--no-pager", "-n", "30", unit]);
                panic!(
                    "{}: {unit} is {state}, not active:\n{}",
                    self.name,
                    text(&status)
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Polls `f` every 50 ms until it holds; panics naming `what` after `timeout`.
    pub fn wait_until(&self, what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
        let deadline = Instant::now() + timeout;
        while !f() {
            assert!(
                Instant::now() < deadline,
                "{}: {what} did not happen within {timeout:?}",
                self.name
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// How often `unit` was started (restarts included) since this boot, from
    /// systemd's own journal records of start jobs (not those skipped by a condition).
    pub fn starts(&self, unit: &str) -> usize {
        self.journal_count(unit, UNIT_STARTED)
    }

    /// How often `unit` was reloaded since this boot.
    pub fn reloads(&self, unit: &str) -> usize {
        self.journal_count(unit, UNIT_RELOADED)
    }

    fn journal_count(&self, unit: &str, id: &str) -> usize {
        let out = self.exec(&[
            "journalctl",
            "-b",
            "-q",
            "--no-pager",
            "-o",
            "json",
            &format!("UNIT={unit}"),
            &format!("MESSAGE_ID={id}"),
        ]);
        // A start skipped for an unmet condition is logged under the same id, as a job
        // that was done, but without an invocation.
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|r| r["INVOCATION_ID"].as_str().is_some_and(|i| !i.is_empty()))
            .count()
    }

    /// The last `lines` journal lines of `unit` this boot (systemd's and the unit's own).
    pub fn journal(&self, unit: &str, lines: usize) -> String {
        let out = self.exec(&[
            "journalctl",
            "-b",
            "-q",
            "--no-pager",
            "-n",
            &lines.to_string(),
            "-u",
            unit,
        ]);
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}
