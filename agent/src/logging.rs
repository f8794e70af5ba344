//! Logging of events that strangers can cause at will (refused requests, failed
//! handshakes, refused connections): per class, the first few lines of every interval are
//! written and the rest only counted, then summarised in one line. A flood of 100,000
//! unsigned requests costs a few dozen log lines; the metrics still count every one.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

/// Lines written per class and interval before the rest are only counted.
const BURST: u32 = 10;
const INTERVAL: Duration = Duration::from_secs(10);

struct Window {
    started: Instant,
    logged: u32,
    suppressed: u64,
}

#[derive(Clone, Copy)]
enum Level {
    Info,
    Warn,
}

#[derive(Default)]
pub struct Quiet {
    windows: Mutex<HashMap<&'static str, Window>>,
}

impl Quiet {
    pub fn info(&self, class: &'static str, message: &str) {
        self.log(Level::Info, class, message);
    }

    pub fn warn(&self, class: &'static str, message: &str) {
        self.log(Level::Warn, class, message);
    }

    fn log(&self, level: Level, class: &'static str, message: &str) {
        let now = Instant::now();
        let summary = {
            let mut windows = self.windows.lock();
            let w = windows.entry(class).or_insert(Window {
                started: now,
                logged: 0,
                suppressed: 0,
            });
            let mut summary = None;
            if now.duration_since(w.started) >= INTERVAL {
                if w.suppressed > 0 {
                    summary = Some((w.suppressed, now.duration_since(w.started)));
                }
                *w = Window {
                    started: now,
                    logged: 0,
                    suppressed: 0,
                };
            }
            if w.logged >= BURST {
                w.suppressed += 1;
                return summarise(class, summary);
            }
            w.logged += 1;
            summary
        };
        summarise(class, summary);
        match level {
            Level::Info => tracing::info!(class, "{message}"),
            Level::Warn => tracing::warn!(class, "{message}"),
        }
    }

    /// Writes the summary of every window that suppressed lines and is over.
    pub fn flush(&self) {
        let now = Instant::now();
        let mut done = Vec::new();
        {
            let mut windows = self.windows.lock();
            windows.retain(|class, w| {
                let over = now.duration_since(w.started) >= INTERVAL;
                if over && w.suppressed > 0 {
                    done.push((*class, w.suppressed, now.duration_since(w.started)));
                }
                !over
            });
        }
        for (class, n, span) in done {
            summarise(class, Some((n, span)));
        }
    }

    /// Flushes summaries every interval until shutdown, so the tail of a flood is told.
    pub async fn run(self: std::sync::Arc<Self>, shutdown: CancellationToken) {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(INTERVAL) => self.flush(),
                _ = shutdown.cancelled() => return,
            }
        }
    }
}

fn summarise(class: &'static str, summary: Option<(u64, Duration)>) {
    if let Some((n, span)) = summary {
        tracing::warn!(
            class,
            suppressed = n,
            "{n} more {class} events in {}s were not logged one by one (see the metrics)",
            span.as_secs()
        );
    }
}
