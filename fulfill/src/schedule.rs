//! Pacing rules of the nag scheduler (pure functions, easy to test) and the index of
//! when each need is next due.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use fort_core::names::NeedKey;
use tokio::time::Instant;

/// When each need is next due, ordered by time: finding what is due costs the number of
/// due needs, not the number of needs (a consumer with 20,000 needs wakes up often).
#[derive(Default, Clone)]
pub struct Due {
    by_time: BTreeSet<(Instant, NeedKey)>,
    at: HashMap<NeedKey, Instant>,
}

impl Due {
    /// Plans `key` at `at`; an earlier plan already there wins.
    pub fn plan_earliest(&mut self, key: &NeedKey, at: Instant) {
        match self.at.get(key) {
            Some(existing) if *existing <= at => {}
            _ => self.set(key, at),
        }
    }

    /// Plans `key` at `at`, replacing any plan.
    pub fn set(&mut self, key: &NeedKey, at: Instant) {
        if let Some(old) = self.at.insert(key.clone(), at) {
            self.by_time.remove(&(old, key.clone()));
        }
        self.by_time.insert((at, key.clone()));
    }

    pub fn remove(&mut self, key: &NeedKey) {
        if let Some(old) = self.at.remove(key) {
            self.by_time.remove(&(old, key.clone()));
        }
    }

    pub fn clear(&mut self) {
        self.by_time.clear();
        self.at.clear();
    }

    pub fn get(&self, key: &NeedKey) -> Option<Instant> {
        self.at.get(key).copied()
    }

    /// Takes every need due at or before `now`, earliest first.
    pub fn take_due(&mut self, now: Instant) -> Vec<NeedKey> {
        let mut out = Vec::new();
        while let Some((at, _)) = self.by_time.first() {
            if *at > now {
                break;
            }
            let (_, key) = self.by_time.pop_first().expect("peeked");
            self.at.remove(&key);
            out.push(key);
        }
        out
    }

    /// When the next need is due.
    pub fn next(&self) -> Option<Instant> {
        self.by_time.first().map(|(at, _)| *at)
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.at.is_empty()
    }
}

/// A little spread so a fleet restarted together does not nag in step: up to a tenth of
/// the interval, at most a minute.
pub fn jittered(nag: Duration) -> Duration {
    let spread = (nag / 10).min(Duration::from_secs(60)).as_millis() as u64;
    if spread == 0 {
        return nag;
    }
    nag.saturating_add(Duration::from_millis(rand::random::<u64>() % spread))
}

/// Retry delay after `failures` consecutive transport failures: doubling from `base`,
/// never longer than the nag interval.
pub fn backoff(base: Duration, failures: u32, nag: Duration) -> Duration {
    let factor = 1u32 << failures.saturating_sub(1).min(16);
    base.saturating_mul(factor).min(nag)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_caps() {
        let b = Duration::from_secs(2);
        let nag = Duration::from_secs(60);
        assert_eq!(backoff(b, 1, nag), Duration::from_secs(2));
        assert_eq!(backoff(b, 2, nag), Duration::from_secs(4));
        assert_eq!(backoff(b, 5, nag), Duration::from_secs(32));
        assert_eq!(backoff(b, 6, nag), nag);
        assert_eq!(backoff(b, 60, nag), nag);
    }

    #[test]
    fn due_index() {
        let now = Instant::now();
        let k = |s: &str| NeedKey::parse(s).unwrap();
        let mut d = Due::default();
        d.set(&k("a/x"), now + Duration::from_secs(5));
        d.set(&k("a/y"), now);
        d.plan_earliest(&k("a/x"), now + Duration::from_secs(9));
        assert_eq!(d.get(&k("a/x")), Some(now + Duration::from_secs(5)));
        d.plan_earliest(&k("a/x"), now + Duration::from_secs(1));
        assert_eq!(d.take_due(now), vec![k("a/y")]);
        assert_eq!(d.next(), Some(now + Duration::from_secs(1)));
        assert_eq!(d.take_due(now + Duration::from_secs(2)), vec![k("a/x")]);
        assert!(d.is_empty());
    }

    #[test]
    fn jitter_stays_small() {
        for _ in 0..100 {
            let j = jittered(Duration::from_secs(900));
            assert!(j >= Duration::from_secs(900) && j < Duration::from_secs(960));
        }
        assert_eq!(jittered(Duration::from_millis(5)), Duration::from_millis(5));
    }
}
