//! `fort-agent plan` for a person: grouped, one line per item, `no changes` when nothing
//! would change.

use std::fmt::Write;

use super::Plan;

/// The first 12 hex digits: enough to tell manifests apart at a glance.
fn short(hash: &str) -> &str {
    hash.get(..12).unwrap_or(hash)
}

/// Writes `title` and its lines, unless there are none.
fn group(out: &mut String, title: &str, lines: impl IntoIterator<Item = String>) {
    let lines: Vec<String> = lines.into_iter().collect();
    if lines.is_empty() {
        return;
    }
    let _ = writeln!(out, "\n{title}:");
    for l in lines {
        let _ = writeln!(out, "  {l}");
    }
}

pub fn text(plan: &Plan) -> String {
    let mut out = String::new();
    let m = &plan.manifest_sha256;
    let manifest = if m.current == m.new {
        format!("manifest {} (unchanged)", short(&m.current))
    } else {
        format!("manifest {} → {}", short(&m.current), short(&m.new))
    };
    if !plan.changes {
        let _ = writeln!(out, "{}: no changes ({manifest})", plan.host);
        return out;
    }
    let _ = writeln!(
        out,
        "{}: loading these files would change the following ({manifest})",
        plan.host
    );
    let n = &plan.needs;
    group(
        &mut out,
        "needs added (asked for at once)",
        n.added
            .iter()
            .map(|c| format!("+ {} from {}", c.need, c.from)),
    );
    group(
        &mut out,
        "needs removed (released at their provider, their files deleted)",
        n.removed
            .iter()
            .map(|c| format!("- {} from {}", c.need, c.from)),
    );
    group(
        &mut out,
        "needs changed (sent again: their declaration changed)",
        n.changed.iter().map(|c| {
            let moved = c
                .was_from
                .as_ref()
                .map(|w| format!(", released at {w}"))
                .unwrap_or_default();
            format!(
                "~ {} from {}{moved} ({})",
                c.need,
                c.from,
                c.fields.join(", ")
            )
        }),
    );
    group(
        &mut out,
        "needs updated in place (not sent again)",
        n.updated
            .iter()
            .map(|c| format!("~ {} ({})", c.need, c.fields.join(", "))),
    );
    group(
        &mut out,
        "files written when their payload arrives",
        n.files_written
            .iter()
            .map(|f| format!("+ {} ({})", f.path, f.need)),
    );
    group(
        &mut out,
        "files deleted",
        n.files_removed
            .iter()
            .map(|f| format!("- {} ({})", f.path, f.need)),
    );
    group(
        &mut out,
        "units restarted when the files of needs sent again change",
        n.units_restarted
            .iter()
            .map(|(u, needs)| format!("{u} ({})", needs.join(", "))),
    );
    group(
        &mut out,
        "units reloaded when the files of needs sent again change",
        n.units_reloaded
            .iter()
            .map(|(u, needs)| format!("{u} ({})", needs.join(", "))),
    );
    let c = &plan.capabilities;
    group(
        &mut out,
        "capabilities added",
        c.added.iter().map(|n| format!("+ {n}")),
    );
    group(
        &mut out,
        "capabilities removed (requests get 404; entries stay until GC proves their consumers no longer declare them)",
        c.removed
            .iter()
            .map(|r| format!("- {} ({} entries)", r.capability, r.entries)),
    );
    group(
        &mut out,
        "capabilities changed",
        c.changed
            .iter()
            .map(|ch| format!("~ {} ({})", ch.capability, ch.fields.join(", "))),
    );
    group(
        &mut out,
        "callers of capabilities (host: need ids)",
        c.callers.iter().map(|ch| {
            let mut ids: Vec<String> = ch.added.iter().map(|i| format!("+{i}")).collect();
            ids.extend(ch.removed.iter().map(|i| format!("-{i}")));
            format!("{} ← {}: {}", ch.capability, ch.host, ids.join(" "))
        }),
    );
    let r = &plan.registry;
    group(
        &mut out,
        "hosts.json",
        r.hosts_added
            .iter()
            .map(|h| format!("+ host {h}"))
            .chain(r.hosts_removed.iter().map(|h| format!("- host {h}")))
            .chain(
                r.principals_added
                    .iter()
                    .map(|p| format!("+ principal {p}")),
            )
            .chain(
                r.principals_removed
                    .iter()
                    .map(|p| format!("- principal {p}")),
            )
            .chain(r.keys_changed.iter().map(|k| {
                format!("~ {k}: keys change (requests signed with a key no longer listed get 401)")
            }))
            .chain(
                r.addresses_changed
                    .iter()
                    .map(|a| format!("~ {}: address {} → {}", a.host, a.from, a.to)),
            ),
    );
    let e = &plan.entries;
    group(
        &mut out,
        "provider entries the next GC sweep drops (their origin is no longer in hosts.json)",
        e.dropped.iter().map(|d| format!("- {}", d.entry)),
    );
    group(
        &mut out,
        "provider entries no longer allowed",
        e.refused
            .iter()
            .map(|d| format!("- {}: {}", d.entry, d.reason)),
    );
    let a = &plan.access;
    group(
        &mut out,
        "access lost",
        a.lost
            .iter()
            .map(|x| format!("- {} → {}: {}", x.who, x.to, x.why)),
    );
    group(
        &mut out,
        "access granted",
        a.granted
            .iter()
            .map(|x| format!("+ {} → {}: {}", x.who, x.to, x.why)),
    );
    group(
        &mut out,
        "agent.toml keys that change (they take effect on a restart; the JSON files reload on SIGHUP)",
        plan.config.changed_keys.iter().map(|k| format!("~ {k}")),
    );
    out
}
