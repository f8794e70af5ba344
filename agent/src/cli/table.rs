//! The status document of one host as a table (`fort status`, `fort-agent status`).

use std::fmt::Write;

use serde_json::Value;

/// `in 5s`, `12s ago`, or `-`.
pub(crate) fn fmt_age(ts: Option<u64>) -> String {
    match ts {
        Some(t) => {
            let now = fort_core::wire::unix_now();
            if t >= now {
                format!("in {}s", t - now)
            } else {
                format!("{}s ago", now - t)
            }
        }
        None => "-".into(),
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

/// One host's status: its needs with their state, then what it provides.
pub fn status_table(status: &Value) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "host {}  version {}  up {}s  manifest {}",
        status["host"].as_str().unwrap_or("?"),
        status["version"].as_str().unwrap_or("?"),
        status["uptime_seconds"],
        status["manifest_sha256"]
            .as_str()
            .map_or("-", |h| h.get(..12).unwrap_or(h))
    );
    let _ = writeln!(
        out,
        "\nNEEDS ({}/{} satisfied)",
        status["needs"]["satisfied"], status["needs"]["total"]
    );
    let _ = writeln!(
        out,
        "{:<28} {:<12} {:<10} {:<10} {:<10} {:>8} {:<10} REASON",
        "NEED", "FROM", "STATE", "SINCE", "EXPIRES", "ATTEMPTS", "NEXT"
    );
    for n in status["needs"]["items"].as_array().into_iter().flatten() {
        let _ = writeln!(
            out,
            "{:<28} {:<12} {:<10} {:<10} {:<10} {:>8} {:<10} {}",
            n["need"].as_str().unwrap_or(""),
            n["from"].as_str().unwrap_or(""),
            need_state(n),
            fmt_age(n["since"].as_u64().or(n["satisfied_at"].as_u64())),
            fmt_age(n["expires_at"].as_u64()),
            n["attempts"].as_u64().unwrap_or(0),
            fmt_age(n["next_request"].as_u64()),
            n["reason"].as_str().unwrap_or("")
        );
    }
    if let Some(caps) = status["provider"]["capabilities"].as_object() {
        if !caps.is_empty() {
            let _ = writeln!(out, "\nCAPABILITIES");
            let _ = writeln!(
                out,
                "{:<20} {:>8} {:>12} {:>6} LAST RUN",
                "CAPABILITY", "ENTRIES", "UNDELIVERED", "RUNS"
            );
            for (name, c) in caps {
                let last = &c["last_run"];
                let last = if last.is_null() {
                    "-".to_owned()
                } else {
                    format!(
                        "{} {} {}ms{}",
                        fmt_age(last["at"].as_u64()),
                        last["trigger"].as_str().unwrap_or(""),
                        last["duration_ms"],
                        last["error"]
                            .as_str()
                            .map(|e| format!(" FAILED: {e}"))
                            .unwrap_or_default()
                    )
                };
                // serde_json::Value ignores width: pad the numbers as numbers.
                let num = |k: &str| c[k].as_u64().unwrap_or(0);
                let _ = writeln!(
                    out,
                    "{:<20} {:>8} {:>12} {:>6} {}",
                    name,
                    num("entries"),
                    num("undelivered"),
                    num("handler_runs"),
                    last
                );
            }
        }
    }
    out
}
