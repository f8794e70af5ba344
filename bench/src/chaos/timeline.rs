//! What happened when: every fault the run injected (and every agent that died on its
//! own), with its hosts and its start and end, and every invariant violation found.
//! Whether a fault *concerns* a need decides which deadlines hold for it: a fault
//! concerns the needs of the host it hits and the needs that host provides, and a fault
//! between two hosts the needs one of them asks the other for.

use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

/// Unix time in seconds, fractional.
pub fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[derive(Debug, Clone)]
pub struct Fault {
    pub kind: &'static str,
    pub hosts: Vec<String>,
    /// Between two hosts (only needs between them are concerned).
    pub link: bool,
    pub start: f64,
    pub end: Option<f64>,
    pub detail: String,
}

impl Fault {
    /// Whether it concerns a need of `consumer` naming `providers`.
    pub fn concerns(&self, consumer: &str, providers: &[String]) -> bool {
        if self.link {
            let (a, b) = (&self.hosts[0], &self.hosts[1]);
            (a == consumer && providers.contains(b)) || (b == consumer && providers.contains(a))
        } else {
            self.hosts
                .iter()
                .any(|h| h == consumer || providers.contains(h))
        }
    }

    pub fn describe(&self, t0: f64) -> String {
        let end = self
            .end
            .map_or("still on".to_owned(), |e| format!("{:.0}s", e - t0));
        let hosts = if self.link {
            self.hosts.join("↔")
        } else if self.hosts.len() > 3 {
            format!("all {} hosts", self.hosts.len())
        } else {
            self.hosts.join(", ")
        };
        format!(
            "{} of {hosts} at {:.0}s until {end}{}",
            self.kind,
            self.start - t0,
            if self.detail.is_empty() {
                String::new()
            } else {
                format!(" ({})", self.detail)
            }
        )
    }
}

#[derive(Debug, Clone)]
pub struct Violation {
    pub at: f64,
    pub invariant: &'static str,
    pub hosts: Vec<String>,
    pub need: Option<String>,
    pub detail: String,
}

#[derive(Default)]
pub struct Timeline {
    pub faults: Vec<Fault>,
    pub violations: Vec<Violation>,
    /// When the run's clock started (the figures count from it).
    pub t0: f64,
    pub seed: u64,
}

impl Timeline {
    pub fn begin(
        &mut self,
        kind: &'static str,
        hosts: &[String],
        link: bool,
        detail: String,
    ) -> usize {
        self.faults.push(Fault {
            kind,
            hosts: hosts.to_vec(),
            link,
            start: now(),
            end: None,
            detail,
        });
        self.faults.len() - 1
    }

    pub fn end(&mut self, id: usize) {
        if let Some(f) = self.faults.get_mut(id) {
            f.end.get_or_insert_with(now);
        }
    }

    pub fn note(&mut self, id: usize, detail: &str) {
        if let Some(f) = self.faults.get_mut(id) {
            if !f.detail.is_empty() {
                f.detail.push_str("; ");
            }
            f.detail.push_str(detail);
        }
    }

    /// The latest time at which a fault concerning the need held, each fault counted
    /// until `after` past its end; `None` when none did in `[from, to]`; `+inf` while one
    /// still holds.
    pub fn concerned_within(
        &self,
        consumer: &str,
        providers: &[String],
        from: f64,
        to: f64,
        after: f64,
    ) -> Option<f64> {
        self.faults
            .iter()
            .filter(|f| f.concerns(consumer, providers))
            .filter_map(|f| {
                let until = f.end.map_or(f64::INFINITY, |e| e + after);
                (f.start <= to && until >= from).then_some(until)
            })
            .fold(None, |acc: Option<f64>, u| {
                Some(acc.map_or(u, |a| a.max(u)))
            })
    }

    /// The last fault concerning the need that began before `t`: the likely cause.
    pub fn cause(&self, consumer: &str, providers: &[String], t: f64) -> Option<&Fault> {
        self.faults
            .iter()
            .filter(|f| f.start <= t && f.concerns(consumer, providers))
            .max_by(|a, b| a.start.total_cmp(&b.start))
    }

    pub fn violate(
        &mut self,
        invariant: &'static str,
        hosts: &[String],
        need: Option<&str>,
        detail: String,
    ) {
        let at = now();
        eprintln!(
            "fort-bench chaos: VIOLATION at {:.0}s (seed {}): {invariant}: {} {}: {detail}",
            at - self.t0,
            self.seed,
            hosts.join(","),
            need.unwrap_or("")
        );
        self.violations.push(Violation {
            at,
            invariant,
            hosts: hosts.to_vec(),
            need: need.map(str::to_owned),
            detail,
        });
    }

    pub fn violations_json(&self) -> Value {
        json!(self
            .violations
            .iter()
            .map(
                |v| json!({"seed": self.seed, "at_s": (v.at - self.t0).round(),
                            "invariant": v.invariant, "hosts": v.hosts, "need": v.need,
                            "detail": v.detail})
            )
            .collect::<Vec<_>>())
    }
}
