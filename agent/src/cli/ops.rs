//! Lines for people from the replies of operator commands: a trigger's run, a resend, a GC
//! sweep, a reload, a journal.

use std::fmt::Write;

use fort_core::text::printable;
use serde_json::Value;

use super::human::short_hash;
use super::table::{count, peer_text, run_outcome, Table, TEXT_CELL};

/// `trigger` (the built-in's reply, or the admin socket's `trigger` field): the run, and
/// what became of the entry asked about.
pub fn trigger_text(host: &str, t: &Value) -> String {
    let mut out = String::new();
    let cap = peer_text(&t["capability"]);
    let forced = if t["force"] == true {
        match t["entry"].as_str() {
            Some(_) => " (its cached response left out)",
            None => " (no cached responses)",
        }
    } else {
        ""
    };
    let _ = writeln!(
        out,
        "{host}: {cap} handler ran {}{forced}",
        run_outcome(&t["run"])
    );
    if let Some(reason) = t["run"]["reason"].as_str() {
        let _ = writeln!(out, "  why: {}", printable(reason, 300));
    }
    if let Some(entry) = t["entry"].as_str() {
        let entry = printable(entry, TEXT_CELL);
        let (before, after) = (t["before"].as_str(), t["after"].as_str());
        let what = match (before, after) {
            _ if t["run"]["ok"] != true => "unchanged: the run failed".to_owned(),
            (b, a) if b == a => format!(
                "kept its response ({}); its consumer is called back with it",
                short_hash(a)
            ),
            (_, None) => "has no response now; its consumer is told (revoked)".to_owned(),
            (b, Some(a)) => format!(
                "new response ({} → {}); its consumer is called back",
                short_hash(b),
                short_hash(Some(a))
            ),
        };
        let _ = writeln!(out, "  {entry}: {what}");
    }
    out
}

/// `resend`: the need as it stands once its request is planned.
pub fn resend_text(host: &str, a: &Value) -> String {
    let reason = peer_text(&a["reason"]);
    format!(
        "{host} asks {} for {} again now (state {}{})\n",
        peer_text(&a["from"]),
        peer_text(&a["need"]),
        peer_text(&a["state"]),
        if reason.is_empty() {
            String::new()
        } else {
            format!(": {reason}")
        }
    )
}

/// A GC sweep's report (`fort-agent gc`).
pub fn gc_text(r: &Value) -> String {
    let mut out = String::new();
    let dry = r["dry_run"] == true;
    let _ = writeln!(
        out,
        "GC sweep{}: asked {} in {} ms; {} {}, {} absent within the grace period, {} kept without proof",
        if dry { " (dry run: nothing removed)" } else { "" },
        count(&r["origins_asked"], "host", "hosts"),
        r["duration_ms"].as_u64().unwrap_or(0),
        count(&r["removed"].as_array().map_or(0, Vec::len).into(), "entry", "entries"),
        if dry { "would be removed" } else { "removed" },
        r["pending_grace"].as_array().map_or(0, Vec::len),
        r["kept_no_proof"].as_array().map_or(0, Vec::len),
    );
    let mut t = Table::new(&["ENTRY", "ACTION", "REASON"]);
    for list in ["removed", "pending_grace", "kept_no_proof"] {
        for d in r[list].as_array().into_iter().flatten() {
            t.row(vec![
                peer_text(&d["entry"]),
                peer_text(&d["action"]),
                peer_text(&d["reason"]),
            ]);
        }
    }
    if !t.is_empty() {
        out.push('\n');
        t.render(&mut out);
    }
    out
}

/// `journal`'s lines, each made printable (they come from the host's journal, which any
/// local user can write to).
pub fn journal_lines(reply: &Value) -> Option<String> {
    let lines = reply["lines"].as_array()?;
    let mut out = String::new();
    for l in lines {
        let _ = writeln!(out, "{}", printable(l.as_str().unwrap_or(""), 64 * 1024));
    }
    Some(out)
}
