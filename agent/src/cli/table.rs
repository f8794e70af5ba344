//! The status document of one host as tables (`fort status`, `fort-agent status`), and
//! the column layout every table of the CLIs shares.

use std::fmt::Write;

use fort_core::text::printable;
use serde_json::Value;

use super::human::{due, relative, short_hash, span};

/// The longest a reason or error from a peer or a handler is shown in a table cell.
pub(crate) const TEXT_CELL: usize = 200;

/// Text that came from another host or a handler, as one printable, bounded cell.
pub(crate) fn peer_text(v: &Value) -> String {
    v.as_str()
        .map(|s| printable(s, TEXT_CELL))
        .unwrap_or_default()
}

/// A need's provider, and when it moved there from another of its providers
/// (docs/protocol.md §11.13): `edge2 (moved 3m ago)`.
pub(crate) fn from_text(need: &Value, now: u64) -> String {
    let from = peer_text(&need["from"]);
    match need["home_since"].as_u64() {
        Some(at) => format!("{from} (moved {})", super::human::relative(Some(at), now)),
        None => from,
    }
}

/// Columns sized to their widest cell; numbers right-aligned; the last column is not
/// padded, so a long reason does not push the others apart.
pub(crate) struct Table {
    header: Vec<&'static str>,
    right: Vec<bool>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// `columns`: names; a name starting with `>` is right-aligned (the `>` is dropped).
    pub fn new(columns: &[&'static str]) -> Table {
        Table {
            header: columns.iter().map(|c| c.trim_start_matches('>')).collect(),
            right: columns.iter().map(|c| c.starts_with('>')).collect(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    pub fn render(&self, out: &mut String) {
        let n = self.header.len();
        let mut widths: Vec<usize> = self.header.iter().map(|h| h.chars().count()).collect();
        for r in &self.rows {
            for (w, c) in widths.iter_mut().zip(r) {
                *w = (*w).max(c.chars().count());
            }
        }
        let header: Vec<String> = self.header.iter().map(|h| h.to_string()).collect();
        for cells in std::iter::once(&header).chain(&self.rows) {
            let mut line = String::new();
            for (i, cell) in cells.iter().enumerate().take(n) {
                let pad = widths[i].saturating_sub(cell.chars().count());
                if i > 0 {
                    line.push_str("  ");
                }
                if self.right[i] {
                    line.extend(std::iter::repeat_n(' ', pad));
                    line.push_str(cell);
                } else {
                    line.push_str(cell);
                    if i + 1 < n {
                        line.extend(std::iter::repeat_n(' ', pad));
                    }
                }
            }
            let _ = writeln!(out, "{}", line.trim_end());
        }
    }
}

/// A need's state (§11.7); an agent that predates states reports only `satisfied`.
pub(crate) fn need_state(n: &Value) -> &str {
    n["state"]
        .as_str()
        .unwrap_or(if n["satisfied"].as_bool() == Some(true) {
            "satisfied"
        } else {
            "pending"
        })
}

fn num(v: &Value) -> String {
    v.as_u64().unwrap_or(0).to_string()
}

/// `1 entry`, `3 entries`.
pub(crate) fn count(v: &Value, one: &str, many: &str) -> String {
    match v.as_u64().unwrap_or(0) {
        1 => format!("1 {one}"),
        n => format!("{n} {many}"),
    }
}

/// How a capability's last handler run went, in one cell.
pub(crate) fn last_run(last: &Value, now: u64) -> String {
    if last.is_null() {
        return "-".to_owned();
    }
    format!(
        "{} {}",
        relative(last["at"].as_u64(), now),
        run_outcome(last)
    )
}

/// A handler run without when it was: `(manual, 212 ms): ok, 3 entries, 1 callback`.
pub(crate) fn run_outcome(last: &Value) -> String {
    let outcome = match last["error"].as_str() {
        Some(e) => format!("FAILED: {}", printable(e, TEXT_CELL)),
        None if last["ok"] == false => "FAILED".to_owned(),
        None => format!(
            "ok, {}, {}",
            count(&last["entries"], "entry", "entries"),
            count(&last["callbacks"], "callback", "callbacks")
        ),
    };
    format!(
        "({}, {} ms): {outcome}",
        last["trigger"].as_str().unwrap_or("?"),
        num(&last["duration_ms"]),
    )
}

/// One provider entry's delivery, in one word or two.
fn entry_state(e: &Value, now: u64) -> String {
    let mut state = if let Some(t) = e["absent_since"].as_u64() {
        format!("absent {}", span(now.saturating_sub(t)))
    } else if e["awaiting_response"] == true {
        "asked".to_owned()
    } else if e["principal"] == true {
        "principal".to_owned()
    } else if e["undelivered"] == true {
        match e["delivery"]["attempts"].as_u64().unwrap_or(0) {
            0 => "undelivered".to_owned(),
            1 => "undelivered (1 try)".to_owned(),
            n => format!("undelivered ({n} tries)"),
        }
    } else if e["response_hash"].is_null() {
        "no response".to_owned()
    } else {
        "delivered".to_owned()
    };
    if e["renew"] == true {
        state.push_str(", renew");
    }
    state
}

/// One host's status: its needs with their state, what it provides, and its entries
/// when the document carries them.
pub fn status_table(status: &Value) -> String {
    let now = fort_core::wire::unix_now();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "host {}  release {}  protocol {}  up {}  manifest {}",
        peer_text(&status["host"]),
        super::versions::of(status).0,
        super::versions::of(status).1,
        status["uptime_seconds"].as_u64().map_or("?".into(), span),
        short_hash(status["manifest_sha256"].as_str()),
    );
    let items = status["needs"]["items"].as_array();
    if items.is_none_or(|i| i.is_empty()) {
        let _ = writeln!(out, "\nNEEDS: none declared");
    } else {
        let _ = writeln!(
            out,
            "\nNEEDS ({} of {} satisfied)",
            num(&status["needs"]["satisfied"]),
            num(&status["needs"]["total"])
        );
        let mut t = Table::new(&[
            "NEED",
            "FROM",
            "STATE",
            "SINCE",
            "EXPIRES",
            ">ATTEMPTS",
            "NEXT",
            "REASON",
        ]);
        for n in items.into_iter().flatten() {
            t.row(vec![
                peer_text(&n["need"]),
                from_text(n, now),
                printable(need_state(n), 20),
                relative(n["since"].as_u64().or(n["satisfied_at"].as_u64()), now),
                relative(n["expires_at"].as_u64(), now),
                num(&n["attempts"]),
                due(n["next_request"].as_u64(), now),
                peer_text(&n["reason"]),
            ]);
        }
        t.render(&mut out);
    }
    let caps = status["provider"]["capabilities"].as_object();
    if let Some(caps) = caps.filter(|c| !c.is_empty()) {
        let _ = writeln!(out, "\nCAPABILITIES");
        let mut t = Table::new(&[
            "CAPABILITY",
            ">ENTRIES",
            ">UNDELIVERED",
            ">RUNS",
            "LAST RUN",
        ]);
        for (name, c) in caps {
            t.row(vec![
                printable(name, 64),
                num(&c["entries"]),
                num(&c["undelivered"]),
                num(&c["handler_runs"]),
                last_run(&c["last_run"], now),
            ]);
        }
        t.render(&mut out);
    }
    let serves = caps.is_some_and(|c| !c.is_empty());
    if let Some(entries) = status["entries"]
        .as_object()
        .filter(|e| serves || !e.is_empty())
    {
        let undelivered = entries
            .values()
            .filter(|e| e["undelivered"] == true)
            .count();
        if entries.is_empty() {
            let _ = writeln!(out, "\nENTRIES: none");
        } else {
            let _ = writeln!(
                out,
                "\nENTRIES ({}, {undelivered} undelivered)",
                entries.len()
            );
            let mut t = Table::new(&[
                "ENTRY",
                "RESPONSE",
                "REQUESTED",
                "DELIVERED",
                "STATE",
                "LAST ERROR",
            ]);
            for (key, e) in entries {
                let d = &e["delivery"];
                t.row(vec![
                    printable(key, 200),
                    short_hash(e["response_hash"].as_str()),
                    relative(e["requested_at"].as_u64(), now),
                    relative(d["delivered_at"].as_u64(), now),
                    entry_state(e, now),
                    peer_text(&d["last_error"]),
                ]);
            }
            t.render(&mut out);
        }
    } else if let Some(why) = status["entries_withheld"].as_str() {
        if serves {
            let _ = writeln!(out, "\nENTRIES: not shown: {}", printable(why, 400));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    /// What another host wrote (a reason, a delivery error, a need name) reaches the
    /// terminal with its escape sequences written out, never as instructions.
    #[test]
    fn peer_text_cannot_drive_the_terminal() {
        let now = fort_core::wire::unix_now();
        let evil = "denied\u{1b}[2K\r\u{1b}]52;c;ZXZpbA==\u{7}\u{9b}31m satisfied";
        let status = json!({
            "host": "p\u{1b}[1A", "version": "0.1.0", "uptime_seconds": 90061,
            "needs": {"total": 1, "satisfied": 0, "items": [{
                "need": "web/x\u{1b}[2J", "from": "p", "state": "failed", "reason": evil,
                "since": now - 180, "expires_at": now + 2_591_975, "attempts": 2,
                "next_request": now - 5,
            }]},
            "provider": {"capabilities": {"web": {"entries": 1, "undelivered": 1,
                "handler_runs": 1, "last_run": {"at": now, "trigger": "request",
                "duration_ms": 5, "ok": false, "error": evil}}}},
            "entries": {"c:web/x": {"origin": "c", "need": "web/x", "principal": false,
                "response_hash": "ab".repeat(32), "requested_at": now, "undelivered": true,
                "awaiting_response": false, "renew": false, "absent_since": null,
                "delivery": {"delivered_at": null, "attempts": 3, "last_error": evil}}},
        });
        let table = super::status_table(&status);
        for c in ['\u{1b}', '\u{7}', '\r', '\u{9b}'] {
            assert!(!table.contains(c), "{c:?} reached the table:\n{table}");
        }
        assert!(
            table.contains("denied\\u{1b}[2K\\r\\u{1b}]52;c;ZXZpbA==\\u{7}\\u{9b}31m satisfied")
        );
        assert!(table.contains("up 1d 1h"), "{table}");
        assert!(table.contains(" 3m ago "), "{table}");
        assert!(table.contains(" in 29d 23h "), "{table}");
        // A request planned in the past is due now, never "in 0s".
        assert!(!table.contains("in 0s"), "{table}");
        assert!(table.contains("undelivered (3 tries)"), "{table}");
        // The fleet view: the same reason under the table, and an unreachable host's error.
        let rows = vec![
            crate::cli::FleetRow {
                host: "p".into(),
                status: Ok(status),
            },
            crate::cli::FleetRow {
                host: "q".into(),
                status: Err(format!("cannot connect: {evil}")),
            },
        ];
        let fleet = crate::cli::fleet_table(&rows, None);
        for c in ['\u{1b}', '\u{7}', '\r', '\u{9b}'] {
            assert!(
                !fleet.contains(c),
                "{c:?} reached the fleet table:\n{fleet}"
            );
        }
        assert!(
            fleet.contains("p:web/x\\u{1b}[2J from p: failed: denied\\u{1b}"),
            "{fleet}"
        );
        assert!(fleet.contains("FAILED HANDLER RUNS"), "{fleet}");
    }
}
