//! `fort fleet`: every host's status at once, as a table or JSON, and compared with the
//! manifest hashes a build expects (drift, docs/protocol.md §11.7).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::Path;

use serde::Serialize;
use serde_json::{json, Value};

use fort_core::text::printable;

use super::human::span;
use super::table::{from_text, last_run, need_state, peer_text, Table, TEXT_CELL};
use super::Session;

/// One host's row in `fort fleet`.
#[derive(Debug, Clone)]
pub struct FleetRow {
    pub host: String,
    pub status: Result<Value, String>,
}

/// Asks every host for `status`, concurrently, verified.
pub async fn fleet(session: &Session) -> Vec<FleetRow> {
    let hosts: Vec<String> = session.registry.hosts().map(|(n, _)| n.clone()).collect();
    let mut tasks = Vec::new();
    for host in hosts {
        let s = session.clone();
        tasks.push(tokio::spawn(async move {
            let status = match tokio::time::timeout(
                std::time::Duration::from_secs(10),
                s.call(&host, "status", b"{}".to_vec()),
            )
            .await
            {
                Err(_) => Err("timeout".to_owned()),
                Ok(Err((_, e))) => Err(e),
                Ok(Ok(r)) if r.status == 200 && r.verified() => {
                    serde_json::from_slice(&r.body).map_err(|e| format!("bad status JSON: {e}"))
                }
                Ok(Ok(r)) if r.status == 200 => {
                    Err(format!("signature not verified ({:?})", r.auth))
                }
                Ok(Ok(r)) => Err(format!("HTTP {}", r.status)),
            };
            FleetRow { host, status }
        }));
    }
    let mut rows = Vec::new();
    for t in tasks {
        if let Ok(r) = t.await {
            rows.push(r);
        }
    }
    rows
}

/// What a build expects each host to run: `{"<host>": "<manifest sha256>"}`, the
/// NixOS module's `lib.fleetManifest` written out as JSON.
pub type Expected = BTreeMap<String, String>;

pub fn load_expected(path: &Path) -> Result<Expected, String> {
    let shown = path.display();
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {shown}: {e}"))?;
    let map: Expected = serde_json::from_slice(&bytes).map_err(|e| {
        format!("{shown}: expected a JSON object of host name to manifest sha256 (lib.fleetManifest): {e}")
    })?;
    for (host, hash) in &map {
        if hash.len() != 64 || !hash.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return Err(format!(
                "{shown}: {host:?}: {hash:?} is not a lower-case hex SHA-256"
            ));
        }
    }
    Ok(map)
}

/// How a host's loaded files compare with the build.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ManifestState {
    /// It runs what was built.
    Ok,
    /// It runs other files: not deployed yet, deployed but not reloaded, or changed by hand.
    Drift,
    /// It answers, but the build does not know it.
    NotInBuild,
    /// No answer (or not in hosts.json): what it runs is unknown.
    Unreachable,
}

impl ManifestState {
    fn column(self) -> &'static str {
        match self {
            ManifestState::Ok => "ok",
            ManifestState::Drift => "DRIFT",
            ManifestState::NotInBuild => "NOT IN BUILD",
            ManifestState::Unreachable => "?",
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ManifestCheck {
    pub state: ManifestState,
    pub running: Option<String>,
    pub expected: Option<String>,
}

/// `row` against the build.
fn check(row: &FleetRow, expected: &Expected) -> ManifestCheck {
    let want = expected.get(&row.host).cloned();
    let running = row
        .status
        .as_ref()
        .ok()
        .and_then(|s| s["manifest_sha256"].as_str().map(str::to_owned));
    let state = match (&row.status, &want) {
        (Err(_), _) => ManifestState::Unreachable,
        (Ok(_), None) => ManifestState::NotInBuild,
        (Ok(_), Some(w)) if running.as_ref() == Some(w) => ManifestState::Ok,
        (Ok(_), Some(_)) => ManifestState::Drift,
    };
    ManifestCheck {
        state,
        running,
        expected: want,
    }
}

/// The rows, plus one unreachable row for each host the build expects that hosts.json
/// does not list (the registry used here is older or newer than the build).
pub fn with_expected_hosts(mut rows: Vec<FleetRow>, expected: Option<&Expected>) -> Vec<FleetRow> {
    for host in expected.into_iter().flat_map(|e| e.keys()) {
        if !rows.iter().any(|r| &r.host == host) {
            rows.push(FleetRow {
                host: host.clone(),
                status: Err("not in hosts.json".to_owned()),
            });
        }
    }
    rows.sort_by(|a, b| a.host.cmp(&b.host));
    rows
}

/// Whether the fleet is as it should be: every host answers and, with a build to
/// compare with, runs what was built.
pub fn healthy(rows: &[FleetRow], expected: Option<&Expected>) -> bool {
    rows.iter().all(|r| {
        r.status.is_ok() && expected.is_none_or(|e| check(r, e).state == ManifestState::Ok)
    })
}

pub fn fleet_json(rows: &[FleetRow], expected: Option<&Expected>) -> Value {
    let hosts: BTreeMap<String, Value> = rows
        .iter()
        .map(|r| {
            let mut v = match &r.status {
                Ok(s) => json!({"reachable": true, "status": s}),
                Err(e) => json!({"reachable": false, "error": e}),
            };
            if let Some(e) = expected {
                v["manifest"] = json!(check(r, e));
            }
            (r.host.clone(), v)
        })
        .collect();
    let spread = super::versions::spread(
        rows.iter()
            .filter_map(|r| r.status.as_ref().ok().map(|s| (r.host.as_str(), s))),
    );
    let warning = super::versions::warning(&spread);
    json!({ "hosts": hosts, "releases": spread, "releases_warning": warning })
}

fn short(hash: Option<&String>) -> &str {
    hash.map_or("none", |h| h.get(..12).unwrap_or(h))
}

pub fn fleet_table(rows: &[FleetRow], expected: Option<&Expected>) -> String {
    let now = fort_core::wire::unix_now();
    let mut out = String::new();
    let mut columns = vec![
        "HOST",
        "REACHABLE",
        "RELEASE",
        "PROTOCOL",
        "UP",
        ">NEEDS",
        ">ENTRIES",
        ">UNDELIVERED",
    ];
    if expected.is_some() {
        columns.push("MANIFEST");
    }
    // Why a host did not answer, unlabelled: the rows that answered end with the
    // columns above.
    columns.push("");
    let mut table = Table::new(&columns);
    let mut needs = Vec::new();
    // Needs served by another of their providers than before (docs/protocol.md §11.13).
    let mut moved = Vec::new();
    let mut runs = Vec::new();
    let mut drift = Vec::new();
    for r in rows {
        let checked = expected.map(|e| check(r, e));
        if let Some(c) = &checked {
            match c.state {
                ManifestState::Drift => drift.push(format!(
                    "  {}: runs {}, the build expects {}",
                    r.host,
                    short(c.running.as_ref()),
                    short(c.expected.as_ref())
                )),
                ManifestState::NotInBuild => drift.push(format!(
                    "  {}: runs {}, and the build does not know this host",
                    r.host,
                    short(c.running.as_ref())
                )),
                ManifestState::Ok | ManifestState::Unreachable => {}
            }
        }
        let mut cells = match &r.status {
            Ok(s) => {
                let caps = s["provider"]["capabilities"].as_object();
                let sum = |field: &str| -> u64 {
                    caps.map_or(0, |c| {
                        c.values()
                            .map(|v| v[field].as_u64().unwrap_or(0))
                            .fold(0, u64::saturating_add)
                    })
                };
                for (name, c) in caps.into_iter().flatten() {
                    let last = &c["last_run"];
                    if !last.is_null() && last["ok"] != true {
                        runs.push(format!(
                            "  {}:{} {}",
                            r.host,
                            printable(name, 64),
                            last_run(last, now)
                        ));
                    }
                }
                for n in s["needs"]["items"].as_array().into_iter().flatten() {
                    if n["home_since"].is_u64() {
                        moved.push(format!(
                            "  {}:{} from {}: {}",
                            r.host,
                            peer_text(&n["need"]),
                            from_text(n, now),
                            peer_text(&n["moved_because"])
                        ));
                    }
                    let state = need_state(n);
                    if state != "satisfied" {
                        let reason = peer_text(&n["reason"]);
                        needs.push(format!(
                            "  {}:{} from {}: {}: {}",
                            r.host,
                            peer_text(&n["need"]),
                            from_text(n, fort_core::wire::unix_now()),
                            printable(state, 20),
                            if reason.is_empty() {
                                "no answer yet".to_owned()
                            } else {
                                reason
                            }
                        ));
                    }
                }
                let (release, protocol) = super::versions::of(s);
                vec![
                    r.host.clone(),
                    "yes".to_owned(),
                    release,
                    protocol,
                    s["uptime_seconds"].as_u64().map_or("?".into(), span),
                    format!(
                        "{}/{}",
                        s["needs"]["satisfied"].as_u64().unwrap_or(0),
                        s["needs"]["total"].as_u64().unwrap_or(0)
                    ),
                    sum("entries").to_string(),
                    sum("undelivered").to_string(),
                ]
            }
            Err(_) => vec![
                r.host.clone(),
                "NO".to_owned(),
                "-".to_owned(),
                "-".to_owned(),
                "-".to_owned(),
                "-".to_owned(),
                "-".to_owned(),
                "-".to_owned(),
            ],
        };
        if let Some(c) = &checked {
            cells.push(c.state.column().to_owned());
        }
        cells.push(match &r.status {
            Ok(_) => String::new(),
            Err(e) => printable(e, TEXT_CELL),
        });
        table.row(cells);
    }
    table.render(&mut out);
    let spread = super::versions::spread(
        rows.iter()
            .filter_map(|r| r.status.as_ref().ok().map(|s| (r.host.as_str(), s))),
    );
    if spread.len() > 1 {
        let _ = writeln!(out, "\nRELEASES IN USE");
        for (release, hosts) in &spread {
            let _ = writeln!(out, "  fort {release}: {}", hosts.join(", "));
        }
    }
    if let Some(w) = super::versions::warning(&spread) {
        let _ = writeln!(out, "\nWARNING: {w}");
    }
    if !needs.is_empty() {
        let _ = writeln!(
            out,
            "\nUNSATISFIED NEEDS (host:need from provider: state: reason)"
        );
        for n in needs {
            let _ = writeln!(out, "{n}");
        }
    }
    if !moved.is_empty() {
        let _ = writeln!(
            out,
            "\nMOVED TO ANOTHER PROVIDER (host:need from provider (moved when): why)"
        );
        for m in moved {
            let _ = writeln!(out, "{m}");
        }
    }
    if !runs.is_empty() {
        let _ = writeln!(out, "\nFAILED HANDLER RUNS (host:capability last run)");
        for n in runs {
            let _ = writeln!(out, "{n}");
        }
    }
    if !drift.is_empty() {
        let _ = writeln!(out, "\nNOT RUNNING WHAT WAS BUILT");
        for d in drift {
            let _ = writeln!(out, "{d}");
        }
    }
    out
}
