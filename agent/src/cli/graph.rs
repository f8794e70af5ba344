//! `fort fleet --graph`: the fleet as a Graphviz digraph. Hosts are nodes, each need an
//! edge from its consumer to its provider coloured by the need's state (§11.7);
//! unreachable hosts are dashed, hosts not running what was built are outlined red.

use std::collections::BTreeSet;
use std::fmt::Write;

use super::fleet::{Expected, FleetRow};
use super::table::need_state;

/// Edge colour per need state.
fn colour(state: &str) -> &'static str {
    match state {
        "satisfied" => "green4",
        "pending" | "waiting" => "grey50",
        "failed" => "red",
        "expiring" => "orange",
        "expired" => "darkred",
        _ => "black",
    }
}

/// A DOT quoted string: only `"` and `\` need escaping; newlines become `\n`.
fn quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c if c.is_control() => {}
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

pub fn fleet_graph(rows: &[FleetRow], expected: Option<&Expected>) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "digraph fort {{");
    let _ = writeln!(out, "  rankdir=LR;");
    let _ = writeln!(
        out,
        "  node [shape=box, style=rounded, fontname=\"sans-serif\"];"
    );
    let _ = writeln!(out, "  edge [fontname=\"sans-serif\", fontsize=10];");
    let listed: BTreeSet<&str> = rows.iter().map(|r| r.host.as_str()).collect();
    let mut providers_elsewhere = BTreeSet::new();
    for r in rows {
        let mut label = r.host.clone();
        let mut attrs = Vec::new();
        match &r.status {
            Ok(s) => {
                let _ = write!(
                    label,
                    "\n{}/{} needs satisfied",
                    s["needs"]["satisfied"], s["needs"]["total"]
                );
            }
            Err(e) => {
                let _ = write!(label, "\nunreachable");
                attrs.push("style=\"rounded,dashed\"".to_owned());
                attrs.push(format!("tooltip={}", quote(e)));
            }
        }
        if let (Some(e), Ok(s)) = (expected, &r.status) {
            let running = s["manifest_sha256"].as_str();
            match e.get(&r.host) {
                Some(want) if Some(want.as_str()) == running => {}
                Some(_) => {
                    label.push_str("\nDRIFT");
                    attrs.push("color=red, penwidth=2".to_owned());
                }
                None => {
                    label.push_str("\nnot in build");
                    attrs.push("color=red, penwidth=2".to_owned());
                }
            }
        }
        attrs.insert(0, format!("label={}", quote(&label)));
        let _ = writeln!(out, "  {} [{}];", quote(&r.host), attrs.join(", "));
    }
    for r in rows {
        let Ok(s) = &r.status else { continue };
        for n in s["needs"]["items"].as_array().into_iter().flatten() {
            let from = n["from"].as_str().unwrap_or("");
            if !listed.contains(from) {
                providers_elsewhere.insert(from.to_owned());
            }
            let state = need_state(n);
            let need = n["need"].as_str().unwrap_or("");
            let mut attrs = vec![
                format!("label={}", quote(&format!("{need}\n{state}"))),
                format!("color={}", colour(state)),
                format!("fontcolor={}", colour(state)),
            ];
            if let Some(reason) = n["reason"].as_str() {
                attrs.push(format!("tooltip={}", quote(reason)));
            }
            let _ = writeln!(
                out,
                "  {} -> {} [{}];",
                quote(&r.host),
                quote(from),
                attrs.join(", ")
            );
        }
    }
    // A provider hosts.json does not list: the consumer's files name a host this
    // registry does not know.
    for p in providers_elsewhere {
        let _ = writeln!(
            out,
            "  {} [label={}, style=\"rounded,dotted\"];",
            quote(&p),
            quote(&format!("{p}\nnot in hosts.json"))
        );
    }
    let _ = writeln!(out, "}}");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotes_escape_what_dot_would_read_as_syntax() {
        assert_eq!(quote("a\"b\\c\nd"), r#""a\"b\\c\nd""#);
    }
}
