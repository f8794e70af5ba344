//! Counters for the optional Prometheus endpoint. Labelled counters live in one small
//! map each; the hot path touches one mutex for a few nanoseconds.

use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::fmt::Write;

#[derive(Default)]
pub struct Counter(Mutex<BTreeMap<Vec<(&'static str, String)>, f64>>);

impl Counter {
    pub fn add(&self, labels: &[(&'static str, &str)], v: f64) {
        let key = labels.iter().map(|(k, v)| (*k, (*v).to_owned())).collect();
        *self.0.lock().entry(key).or_insert(0.0) += v;
    }

    pub fn inc(&self, labels: &[(&'static str, &str)]) {
        self.add(labels, 1.0);
    }

    fn render(&self, name: &str, help: &str, kind: &str, out: &mut String) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (labels, v) in self.0.lock().iter() {
            let l: Vec<String> = labels
                .iter()
                .map(|(k, v)| format!("{k}=\"{}\"", v.replace('\\', "\\\\").replace('"', "\\\"")))
                .collect();
            let _ = writeln!(out, "{name}{{{}}} {v}", l.join(","));
        }
    }
}

/// A gauge computed at scrape time: name, help, (labels, value) pairs.
pub type Gauge<'a> = (&'a str, &'a str, Vec<(String, f64)>);

#[derive(Default)]
pub struct Metrics {
    pub requests: Counter,
    pub auth_failures: Counter,
    pub handler_runs: Counter,
    pub handler_seconds: Counter,
    pub callbacks: Counter,
    pub gc: Counter,
    pub renewals_held: Counter,
}

impl Metrics {
    /// Prometheus text exposition; `gauges` are computed by the caller at scrape time.
    pub fn render(&self, gauges: &[Gauge<'_>]) -> String {
        let mut out = String::new();
        self.requests.render(
            "fort_requests_total",
            "Requests by capability or endpoint and status.",
            "counter",
            &mut out,
        );
        self.auth_failures.render(
            "fort_auth_failures_total",
            "Refused requests by reason.",
            "counter",
            &mut out,
        );
        self.handler_runs.render(
            "fort_handler_runs_total",
            "Handler runs by capability and outcome.",
            "counter",
            &mut out,
        );
        self.handler_seconds.render(
            "fort_handler_seconds_total",
            "Seconds spent in handlers by capability.",
            "counter",
            &mut out,
        );
        self.callbacks.render(
            "fort_callbacks_total",
            "Callback deliveries by outcome (sent, failed, retried).",
            "counter",
            &mut out,
        );
        self.gc.render(
            "fort_gc_total",
            "GC decisions (removed, kept_no_proof) by reason.",
            "counter",
            &mut out,
        );
        self.renewals_held.render(
            "fort_renewals_held_total",
            "Renewals asked for sooner than renew_interval after the entry's last one, not passed to the handler, by capability.",
            "counter",
            &mut out,
        );
        for (name, help, values) in gauges {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
            for (labels, v) in values {
                let _ = writeln!(out, "{name}{labels} {v}");
            }
        }
        out
    }
}
