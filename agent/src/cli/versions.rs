//! Releases side by side in one fleet: each host's fort release and protocol as its status
//! document says them (an agent before protocol 1.2 says its release only), and whether
//! the fleet spans more than two consecutive releases, the most it may mix.

use std::collections::BTreeMap;

use serde_json::Value;

use fort_core::text::printable;

/// What a status document says of its agent's release and protocol.
pub fn of(status: &Value) -> (String, String) {
    let release = status["version"]
        .as_str()
        .filter(|r| fort_core::compat::is_release_text(r))
        .map_or_else(|| "?".to_owned(), |r| printable(r, 64));
    let protocol = match status["protocol"].as_str() {
        Some(p) => match fort_core::compat::parse_protocol(p) {
            Some((major, minor)) => format!("{major}.{minor}"),
            None => "?".to_owned(),
        },
        // Announcing began with 1.2: an agent that does not is a 1.1 agent.
        None => "1.1".to_owned(),
    };
    (release, protocol)
}

/// `major.minor.patch` of a release; pre-release and build suffixes are ignored.
fn numbers(release: &str) -> Option<(u64, u64, u64)> {
    let core = release.split(['-', '+']).next()?;
    let mut parts = core.split('.').map(|p| p.parse::<u64>().ok());
    Some((
        parts.next()??,
        parts.next()??,
        parts.next().flatten().unwrap_or(0),
    ))
}

/// Releases in use, oldest first, with their hosts.
pub fn spread<'a>(
    hosts: impl Iterator<Item = (&'a str, &'a Value)>,
) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (host, status) in hosts {
        out.entry(of(status).0).or_default().push(host.to_owned());
    }
    out
}

/// A warning when the releases in use are more than two consecutive ones: a release
/// line is `major.minor` (every release raises one of them), and the next one after
/// `x.y` is `x.(y+1)` or `(x+1).0`.
pub fn warning(spread: &BTreeMap<String, Vec<String>>) -> Option<String> {
    let mut lines: Vec<((u64, u64), &str)> = spread
        .keys()
        .filter_map(|r| numbers(r).map(|(a, b, _)| ((a, b), r.as_str())))
        .collect();
    lines.sort();
    let ((old, oldest), (new, newest)) = (*lines.first()?, *lines.last()?);
    let consecutive =
        old == new || (old.0 == new.0 && new.1 == old.1 + 1) || (new.0 == old.0 + 1 && new.1 == 0);
    if consecutive {
        return None;
    }
    let hosts = |r: &str| spread.get(r).map(|h| h.join(", ")).unwrap_or_default();
    Some(format!(
        "the fleet runs fort {oldest} ({}) and fort {newest} ({}): more than two consecutive releases, which is all one fleet may mix. Upgrade the oldest hosts before going on (README: Upgrades, mixed fleets and rollback)",
        hosts(oldest),
        hosts(newest)
    ))
}

/// What a deploy of this binary does to the state formats of the agent now running
/// (`fort-agent plan`): per file whose format this release writes differently, what the
/// running release writes and what this one will. A running agent that does not announce
/// its formats is a release before 0.2.0, whose formats are known.
pub fn format_changes(running: &Value) -> Value {
    let (release, _) = of(running);
    let announced = running["state_formats"].as_object();
    let mut changes = Vec::new();
    for f in fort_core::compat::FORMATS {
        let before = match announced {
            Some(a) => a
                .get(f.file)
                .and_then(|v| v["writes"].as_u64())
                .and_then(|v| u32::try_from(v).ok()),
            None => fort_core::compat::formats_before_announcing(f.file),
        };
        if before != Some(f.writes) {
            changes.push(serde_json::json!({
                "file": f.file,
                "from": before,
                "to": f.writes,
                // Whether the running release could read it again after a rollback.
                "rollback_reads": announced
                    .and_then(|a| a.get(f.file))
                    .and_then(|v| v["reads"].as_array())
                    .and_then(|r| Some((r.first()?.as_u64()?, r.last()?.as_u64()?)))
                    .is_some_and(|(lo, hi)| (lo..=hi).contains(&u64::from(f.writes))),
            }));
        }
    }
    serde_json::json!({
        "running": release,
        "new": fort_core::compat::RELEASE,
        "changed": changes,
    })
}

/// [`format_changes`] as the lines `fort-agent plan` prints.
pub fn format_text(formats: &Value) -> String {
    let running = printable(formats["running"].as_str().unwrap_or("?"), 64);
    let new = fort_core::compat::RELEASE;
    let changed = formats["changed"].as_array().map_or(&[][..], Vec::as_slice);
    if changed.is_empty() {
        return format!(
            "state formats: unchanged (fort {running} → fort {new}): a rollback reads what this release writes\n"
        );
    }
    let mut out = format!("state formats that change (fort {running} → fort {new}):\n");
    for c in changed {
        out.push_str(&format!(
            "  {}: version {} → {}{}\n",
            printable(c["file"].as_str().unwrap_or("?"), 64),
            c["from"].as_u64().map_or("?".into(), |v| v.to_string()),
            c["to"],
            if c["rollback_reads"] == true {
                ""
            } else {
                " (the running release cannot read it: a rollback refuses it, README: Upgrades, mixed fleets and rollback)"
            }
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn releases_and_their_spread() {
        assert_eq!(
            of(&json!({"version": "0.1.0"})),
            ("0.1.0".into(), "1.1".into())
        );
        assert_eq!(
            of(&json!({"version": "0.2.0", "protocol": "1.2"})),
            ("0.2.0".into(), "1.2".into())
        );
        assert_eq!(of(&json!({"version": "\u{1b}[2J", "protocol": "x"})).1, "?");
        let fleet = |pairs: &[(&str, &str)]| {
            let docs: Vec<(String, Value)> = pairs
                .iter()
                .map(|(h, r)| (h.to_string(), json!({"version": r})))
                .collect();
            spread(docs.iter().map(|(h, v)| (h.as_str(), v)))
        };
        assert_eq!(warning(&fleet(&[("a", "0.1.0"), ("b", "0.2.0")])), None);
        assert_eq!(warning(&fleet(&[("a", "0.9.1"), ("b", "1.0.0")])), None);
        assert_eq!(warning(&fleet(&[("a", "0.2.0"), ("b", "0.2.3")])), None);
        let w = warning(&fleet(&[("a", "0.1.0"), ("b", "0.2.0"), ("c", "0.3.0")])).unwrap();
        assert!(w.contains("fort 0.1.0 (a) and fort 0.3.0 (c)"), "{w}");
        assert!(warning(&fleet(&[("a", "0.1.0"), ("b", "1.1.0")])).is_some());
    }

    #[test]
    fn plan_names_formats_that_change() {
        // fort 0.1.0 announced nothing, and wrote what this release writes.
        let f = format_changes(&json!({"version": "0.1.0"}));
        assert_eq!(f["changed"], json!([]));
        assert!(format_text(&f).starts_with("state formats: unchanged (fort 0.1.0 → fort"));
        // A running release that writes an older provider-state.json.
        let mut formats = fort_core::compat::formats_json();
        formats["provider-state.json"] = json!({"writes": 1, "reads": [1, 1]});
        let f = format_changes(
            &json!({"version": "0.0.9", "protocol": "1.2", "state_formats": formats}),
        );
        assert_eq!(f["changed"][0]["file"], "provider-state.json");
        assert_eq!(f["changed"][0]["rollback_reads"], false);
        assert!(format_text(&f)
            .contains("provider-state.json: version 1 → 2 (the running release cannot read it"));
    }
}
