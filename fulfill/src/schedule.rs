//! Pacing rules of the nag scheduler, as pure functions so they are easy to test.

use std::time::Duration;

/// A little spread so a fleet restarted together does not nag in step: up to a tenth of
/// the interval, at most a minute.
pub fn jittered(nag: Duration) -> Duration {
    let spread = (nag / 10).min(Duration::from_secs(60)).as_millis() as u64;
    if spread == 0 {
        return nag;
    }
    nag + Duration::from_millis(rand::random::<u64>() % spread)
}

/// Retry delay after `failures` consecutive transport failures: doubling from `base`,
/// never longer than the nag interval.
pub fn backoff(base: Duration, failures: u32, nag: Duration) -> Duration {
    let factor = 1u32 << failures.saturating_sub(1).min(16);
    (base * factor).min(nag)
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
    fn jitter_stays_small() {
        for _ in 0..100 {
            let j = jittered(Duration::from_secs(900));
            assert!(j >= Duration::from_secs(900) && j < Duration::from_secs(960));
        }
        assert_eq!(jittered(Duration::from_millis(5)), Duration::from_millis(5));
    }
}
