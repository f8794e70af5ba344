//! Restarts and reloads of the units that use delivered files (docs/protocol.md §11.3).
//! Requests are gathered into rounds: whatever needs changed together, each unit is
//! restarted (or reloaded) once per round, and rounds are at least a second apart. A round
//! closes once no request has come for a moment (a provider's callbacks for many needs
//! arrive over a second or more) or when it has gathered for long enough. A unit asked to
//! restart and to reload in one round is restarted.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use std::time::Duration;

use fort_core::process::{run, RunSpec};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// A round closes once this long has passed without a new request: needs delivered in
/// one burst of callbacks land in one round.
const SETTLE: Duration = Duration::from_millis(300);
/// ... or this long after its first request, so a steady trickle of changes cannot hold
/// every restart back.
const GATHER_AT_MOST: Duration = Duration::from_secs(5);
/// The shortest time between two rounds.
const SPACING: Duration = Duration::from_secs(1);

#[derive(Default)]
struct Round {
    restart: BTreeSet<String>,
    reload: BTreeSet<String>,
}

struct Inner {
    systemctl: PathBuf,
    timeout: Duration,
    env: Vec<(String, String)>,
    round: Mutex<Round>,
    wake: Notify,
    restarts: AtomicU64,
    reloads: AtomicU64,
    calls: AtomicU64,
    /// Requests queued since start: a round still gathering sees whether more came.
    requested: AtomicU64,
}

#[derive(Clone)]
pub struct Units {
    inner: Arc<Inner>,
}

impl Units {
    pub fn new(systemctl: PathBuf, timeout: Duration, env: Vec<(String, String)>) -> Units {
        Units {
            inner: Arc::new(Inner {
                systemctl,
                timeout,
                env,
                round: Mutex::new(Round::default()),
                wake: Notify::new(),
                restarts: AtomicU64::new(0),
                reloads: AtomicU64::new(0),
                calls: AtomicU64::new(0),
                requested: AtomicU64::new(0),
            }),
        }
    }

    /// Queues units for the next round.
    pub fn request(&self, restart: &[String], reload: &[String]) {
        if restart.is_empty() && reload.is_empty() {
            return;
        }
        {
            let mut round = self.inner.round.lock();
            round.restart.extend(restart.iter().cloned());
            round.reload.extend(reload.iter().cloned());
        }
        self.inner.requested.fetch_add(1, Ordering::Relaxed);
        self.inner.wake.notify_one();
    }

    /// Unit restarts and reloads issued, and `systemctl` runs, since start.
    pub fn counts(&self) -> (u64, u64, u64) {
        (
            self.inner.restarts.load(Ordering::Relaxed),
            self.inner.reloads.load(Ordering::Relaxed),
            self.inner.calls.load(Ordering::Relaxed),
        )
    }

    /// Runs rounds until shutdown.
    pub async fn run(self, shutdown: CancellationToken) {
        loop {
            tokio::select! {
                _ = self.inner.wake.notified() => {}
                _ = shutdown.cancelled() => return,
            }
            let first = tokio::time::Instant::now();
            loop {
                let seen = self.inner.requested.load(Ordering::Relaxed);
                tokio::time::sleep(SETTLE).await;
                if self.inner.requested.load(Ordering::Relaxed) == seen
                    || first.elapsed() >= GATHER_AT_MOST
                {
                    break;
                }
            }
            let round = std::mem::take(&mut *self.inner.round.lock());
            let reload: Vec<String> = round.reload.difference(&round.restart).cloned().collect();
            let restart: Vec<String> = round.restart.into_iter().collect();
            for (verb, units) in [("restart", restart), ("reload", reload)] {
                if units.is_empty() {
                    continue;
                }
                self.systemctl(verb, &units).await;
            }
            tokio::time::sleep(SPACING.saturating_sub(SETTLE)).await;
        }
    }

    async fn systemctl(&self, verb: &str, units: &[String]) {
        let mut spec = RunSpec::new(&self.inner.systemctl, Vec::new(), self.inner.timeout)
            .arg(verb)
            .arg("--")
            .envs(self.inner.env.clone());
        for u in units {
            spec = spec.arg(u.clone());
        }
        self.inner.calls.fetch_add(1, Ordering::Relaxed);
        let counter = if verb == "restart" {
            &self.inner.restarts
        } else {
            &self.inner.reloads
        };
        counter.fetch_add(units.len() as u64, Ordering::Relaxed);
        match run(&spec).await {
            Ok(_) => tracing::info!(units = %units.join(" "), "{verb}ed for changed files"),
            Err(e) => tracing::warn!(
                units = %units.join(" "),
                error = %e.summary(),
                stderr = e.stderr_excerpt(2048).unwrap_or_default(),
                "systemctl {verb} failed"
            ),
        }
    }
}
