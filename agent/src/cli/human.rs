//! Times and hashes as people read them in tables: `in 29d 23h`, `3m ago`, `now`.

/// A span of seconds in its two largest units: `45s`, `3m 5s`, `5h`, `29d 23h`.
pub fn span(secs: u64) -> String {
    const MINUTE: u64 = 60;
    const HOUR: u64 = 60 * MINUTE;
    const DAY: u64 = 24 * HOUR;
    let (big, big_unit, small, small_unit) = if secs >= DAY {
        (secs / DAY, "d", secs % DAY / HOUR, "h")
    } else if secs >= HOUR {
        (secs / HOUR, "h", secs % HOUR / MINUTE, "m")
    } else if secs >= MINUTE {
        (secs / MINUTE, "m", secs % MINUTE, "s")
    } else {
        return format!("{secs}s");
    };
    if small == 0 {
        format!("{big}{big_unit}")
    } else {
        format!("{big}{big_unit} {small}{small_unit}")
    }
}

/// A moment relative to `now`: `in 5m`, `3m ago`, `now`; `-` for none.
pub fn relative(ts: Option<u64>, now: u64) -> String {
    match ts {
        None => "-".into(),
        Some(t) if t == now => "now".into(),
        Some(t) if t > now => format!("in {}", span(t - now)),
        Some(t) => format!("{} ago", span(now - t)),
    }
}

/// When something planned happens: `in 5m`, or `now` once it is due (a moment in the
/// past is overdue, never `in 0s`); `-` for nothing planned.
pub fn due(ts: Option<u64>, now: u64) -> String {
    match ts {
        None => "-".into(),
        Some(t) if t <= now => "now".into(),
        Some(t) => format!("in {}", span(t - now)),
    }
}

/// The first 12 hex digits of a SHA-256, or `none`.
pub fn short_hash(hash: Option<&str>) -> String {
    hash.map_or_else(|| "none".into(), |h| h.chars().take(12).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans() {
        assert_eq!(span(0), "0s");
        assert_eq!(span(59), "59s");
        assert_eq!(span(60), "1m");
        assert_eq!(span(185), "3m 5s");
        assert_eq!(span(3600), "1h");
        assert_eq!(span(5 * 3600 + 60 * 3 + 7), "5h 3m");
        assert_eq!(span(2_591_975), "29d 23h");
        assert_eq!(span(u64::MAX), "213503982334601d 7h");
    }

    #[test]
    fn relative_and_due() {
        let now = 1_000_000;
        assert_eq!(relative(Some(now + 2_591_975), now), "in 29d 23h");
        assert_eq!(relative(Some(now - 180), now), "3m ago");
        assert_eq!(relative(Some(now), now), "now");
        assert_eq!(relative(None, now), "-");
        assert_eq!(due(Some(now - 5), now), "now");
        assert_eq!(due(Some(now + 5), now), "in 5s");
        assert_eq!(relative(Some(0), now), "11d 13h ago");
    }
}
