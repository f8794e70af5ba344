//! How often one entry may renew (§11.4, `renew_interval`): a consumer asking to renew
//! over and over gets one renewed response per interval, not one per request, so no
//! caller can spend a provider's credentials, or a CA's rate limits that every caller of
//! it shares, by asking.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Past this many remembered entries, those whose interval is over are forgotten.
const PRUNE_AT: usize = 4096;

pub struct Renewals {
    interval: Duration,
    /// Entry key → when it last got a renewed response. In memory: a restarted agent
    /// allows each entry one renewal at once, which a caller cannot cause.
    last: Mutex<HashMap<String, Instant>>,
}

impl Renewals {
    pub fn new(interval: Duration) -> Renewals {
        Renewals {
            interval,
            last: Mutex::new(HashMap::new()),
        }
    }

    /// Whether a renewal `key` asks for now is passed to the handler.
    pub fn allows(&self, key: &str) -> bool {
        let allowed = self
            .last
            .lock()
            .get(key)
            .is_none_or(|at| at.elapsed() >= self.interval);
        if !allowed {
            tracing::debug!(
                entry = key,
                "renewal held back: renewed less than renew_interval ago"
            );
        }
        allowed
    }

    /// `key` got a renewed response now.
    pub fn renewed(&self, key: &str) {
        let mut last = self.last.lock();
        if last.len() >= PRUNE_AT {
            let interval = self.interval;
            last.retain(|_, at| at.elapsed() < interval);
        }
        last.insert(key.to_owned(), Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_renewal_per_interval_and_entry() {
        let r = Renewals::new(Duration::from_millis(200));
        assert!(r.allows("app:t/a"));
        r.renewed("app:t/a");
        assert!(!r.allows("app:t/a"));
        assert!(r.allows("app:t/b"), "another entry is not held back");
        std::thread::sleep(Duration::from_millis(250));
        assert!(r.allows("app:t/a"));
        let none = Renewals::new(Duration::ZERO);
        none.renewed("k");
        assert!(none.allows("k"));
    }
}
