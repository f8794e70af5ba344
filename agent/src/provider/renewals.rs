//! How often one entry may renew (§11.4, `renew_interval`): a consumer asking to renew
//! over and over gets one renewed response per interval, not one per request, so no
//! caller can spend a provider's credentials, or a CA's rate limits that every caller of
//! it shares, by asking. A response past half of its lifetime is renewable whatever the
//! interval: what is due is never held back (a credential living seconds renews every
//! few seconds), and a caller asking all the time gets at most two per lifetime.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Past this many remembered entries, those whose interval is over are forgotten.
const PRUNE_AT: usize = 4096;

/// An entry's last renewal, and when its response was last replaced.
#[derive(Clone, Copy, Default)]
struct Issued {
    renewed: Option<Instant>,
    /// On the wall clock, against which a response's `expires_at` is read.
    replaced_unix: u64,
}

pub struct Renewals {
    interval: Duration,
    /// Entry key → its last renewal and replacement. In memory: a restarted agent allows
    /// each entry one renewal at once, which a caller cannot cause.
    last: Mutex<HashMap<String, Issued>>,
}

impl Renewals {
    pub fn new(interval: Duration) -> Renewals {
        Renewals {
            interval,
            last: Mutex::new(HashMap::new()),
        }
    }

    /// Whether a renewal `key` asks for now is passed to the handler: `renew_interval`
    /// has passed since its response was replaced, or that response (expiring at
    /// `expires_at`, when it says) is past half of its lifetime.
    pub fn allows(&self, key: &str, expires_at: Option<u64>, now_unix: u64) -> bool {
        let issued = self.last.lock().get(key).copied().unwrap_or_default();
        if issued
            .renewed
            .is_none_or(|at| at.elapsed() >= self.interval)
        {
            return true;
        }
        let due = expires_at.is_some_and(|exp| {
            let lifetime = exp.saturating_sub(issued.replaced_unix);
            let left = exp.saturating_sub(now_unix);
            left.saturating_mul(2) <= lifetime
        });
        if !due {
            tracing::debug!(
                entry = key,
                "renewal held back: renewed less than renew_interval ago, and its response is in the first half of its lifetime"
            );
        }
        due
    }

    /// `key` got a new response now; `renewal`: one its consumer asked to renew.
    pub fn replaced(&self, key: &str, renewal: bool, now_unix: u64) {
        let mut last = self.last.lock();
        if last.len() >= PRUNE_AT {
            let interval = self.interval;
            last.retain(|_, i| i.renewed.is_some_and(|at| at.elapsed() < interval));
        }
        let entry = last.entry(key.to_owned()).or_default();
        entry.replaced_unix = now_unix;
        if renewal {
            entry.renewed = Some(Instant::now());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_renewal_per_interval_and_entry() {
        let r = Renewals::new(Duration::from_millis(200));
        assert!(r.allows("app:t/a", None, 1000));
        r.replaced("app:t/a", false, 1000);
        assert!(
            r.allows("app:t/a", None, 1000),
            "a first issue is no renewal"
        );
        r.replaced("app:t/a", true, 1000);
        assert!(!r.allows("app:t/a", None, 1000));
        assert!(
            r.allows("app:t/b", None, 1000),
            "another entry is not held back"
        );
        std::thread::sleep(Duration::from_millis(250));
        assert!(r.allows("app:t/a", None, 1000));
        let none = Renewals::new(Duration::ZERO);
        none.replaced("k", true, 1000);
        assert!(none.allows("k", None, 1000));
    }

    #[test]
    fn a_response_past_half_its_life_is_always_renewable() {
        let r = Renewals::new(Duration::from_secs(600));
        r.replaced("app:t/a", true, 1000);
        // Lives 8 s: held back for its first half, renewable from then on.
        assert!(!r.allows("app:t/a", Some(1008), 1000));
        assert!(!r.allows("app:t/a", Some(1008), 1003));
        assert!(r.allows("app:t/a", Some(1008), 1004));
        assert!(r.allows("app:t/a", Some(1008), 1009), "expired");
        // A response without an expiry waits for the interval.
        assert!(!r.allows("app:t/a", None, 5000));
        // A clock stepped back, or an expiry before the issue, cannot panic.
        let _ = r.allows("app:t/a", Some(900), 10);
        let _ = r.allows("app:t/a", Some(u64::MAX), u64::MAX);
    }
}
