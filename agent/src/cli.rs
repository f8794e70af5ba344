//! The `fort` operator CLI: signed calls to any host, and the fleet view. Also the table
//! renderers shared with `fort-agent status`.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::PathBuf;
use std::sync::Arc;

use fort_core::client::{ClientOptions, Reply, ResponseAuth, SignedClient, Target};
use fort_core::schema::Registry;
use fort_core::sign::Signer;
use serde_json::{json, Value};

/// Where to find the registry and who to sign as.
pub struct Identity {
    pub hosts: PathBuf,
    pub key: PathBuf,
    pub origin: String,
    /// Accept `http://` addresses (only on a network that already encrypts).
    pub plaintext: bool,
}

/// Exit codes: 0 on 2xx, 2 on 401/403 or signing trouble, 1 otherwise.
pub const EXIT_OK: u8 = 0;
pub const EXIT_FAIL: u8 = 1;
pub const EXIT_AUTH: u8 = 2;

pub struct Session {
    pub registry: Arc<Registry>,
    pub client: SignedClient,
}

impl Session {
    pub fn open(id: &Identity) -> Result<Session, (u8, String)> {
        let registry = Registry::load(&id.hosts).map_err(|e| (EXIT_FAIL, e.to_string()))?;
        let signer = Signer::from_file(&id.key).map_err(|e| (EXIT_AUTH, e.to_string()))?;
        if registry.get(&id.origin).is_none() {
            return Err((
                EXIT_AUTH,
                format!("origin {:?} is not in {}", id.origin, id.hosts.display()),
            ));
        }
        let client = SignedClient::new(
            &id.origin,
            signer,
            &ClientOptions {
                allow_plaintext: id.plaintext,
                ..ClientOptions::default()
            },
        );
        Ok(Session {
            registry: Arc::new(registry),
            client,
        })
    }

    /// Signs and sends `body` to `host`'s capability.
    pub async fn call(
        &self,
        host: &str,
        capability: &str,
        body: Vec<u8>,
    ) -> Result<Reply, (u8, String)> {
        let peer = self
            .registry
            .get(host)
            .ok_or_else(|| (EXIT_FAIL, format!("{host:?} is not a host in hosts.json")))?;
        let address = peer
            .address
            .as_deref()
            .ok_or_else(|| (EXIT_FAIL, format!("{host:?} is a principal, not a host")))?;
        let target = Target {
            name: host,
            address,
            keys: &peer.keys,
        };
        self.client
            .post(&target, &format!("/agent/capabilities/{capability}"), body)
            .await
            .map_err(|e| (EXIT_FAIL, e.to_string()))
    }
}

/// `fort pin HOST`: the curl pins (`--pinnedpubkey`) of every key `hosts.json` lists for
/// `host`, one per line. Needs no key of one's own.
pub fn pins(hosts: &std::path::Path, host: &str) -> Result<Vec<String>, (u8, String)> {
    let registry = Registry::load(hosts).map_err(|e| (EXIT_FAIL, e.to_string()))?;
    let peer = registry
        .get(host)
        .filter(|p| p.address.is_some())
        .ok_or_else(|| {
            (
                EXIT_FAIL,
                format!("{host:?} is not a host in {}", hosts.display()),
            )
        })?;
    peer.keys
        .iter()
        .map(|k| fort_core::tls::pin(k).map_err(|e| (EXIT_FAIL, e.to_string())))
        .collect()
}

/// Turns a reply into (exit code, stdout text, stderr note).
pub fn judge(reply: &Reply, pretty: bool) -> (u8, String, Option<String>) {
    let body = if pretty {
        serde_json::from_slice::<Value>(&reply.body)
            .ok()
            .and_then(|v| serde_json::to_string_pretty(&v).ok())
            .unwrap_or_else(|| String::from_utf8_lossy(&reply.body).into_owned())
    } else {
        String::from_utf8_lossy(&reply.body).into_owned()
    };
    if (300..400).contains(&reply.status) {
        let to = reply.location.clone().unwrap_or_default();
        return (
            EXIT_FAIL,
            String::new(),
            Some(format!(
                "HTTP {}: redirect to {to:?} not followed",
                reply.status
            )),
        );
    }
    match reply.status {
        401 | 403 => {
            let mut note = format!("HTTP {}", reply.status);
            if let Some(t) = reply.server_time {
                let _ = write!(
                    note,
                    " (clock skew? server time {t}, ours {})",
                    fort_core::wire::unix_now()
                );
            }
            (EXIT_AUTH, body, Some(note))
        }
        s if (200..300).contains(&s) => match &reply.auth {
            ResponseAuth::Verified => (EXIT_OK, body, None),
            other => (
                EXIT_FAIL,
                body,
                Some(format!(
                    "response signature NOT verified: {other:?}; not trusting this reply"
                )),
            ),
        },
        s => (EXIT_FAIL, body, Some(format!("HTTP {s}"))),
    }
}

fn fmt_age(ts: Option<u64>) -> String {
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

/// `fort-agent status` as a table: one row per need, then provider capabilities.
pub fn status_table(status: &Value) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "host {}  version {}  up {}s",
        status["host"].as_str().unwrap_or("?"),
        status["version"].as_str().unwrap_or("?"),
        status["uptime_seconds"]
    );
    let _ = writeln!(
        out,
        "\nNEEDS ({}/{} satisfied)",
        status["needs"]["satisfied"], status["needs"]["total"]
    );
    let _ = writeln!(
        out,
        "{:<28} {:<12} {:<10} {:<12} {:>8} {:<10} LAST ERROR",
        "NEED", "FROM", "SATISFIED", "SINCE", "ATTEMPTS", "NEXT"
    );
    for n in status["needs"]["items"].as_array().into_iter().flatten() {
        let _ = writeln!(
            out,
            "{:<28} {:<12} {:<10} {:<12} {:>8} {:<10} {}",
            n["need"].as_str().unwrap_or(""),
            n["from"].as_str().unwrap_or(""),
            if n["satisfied"].as_bool() == Some(true) {
                "yes"
            } else {
                "NO"
            },
            fmt_age(n["satisfied_at"].as_u64()),
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
        let s = Session {
            registry: session.registry.clone(),
            client: session.client.clone(),
        };
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

pub fn fleet_json(rows: &[FleetRow]) -> Value {
    let hosts: BTreeMap<String, Value> = rows
        .iter()
        .map(|r| {
            (
                r.host.clone(),
                match &r.status {
                    Ok(s) => json!({"reachable": true, "status": s}),
                    Err(e) => json!({"reachable": false, "error": e}),
                },
            )
        })
        .collect();
    json!({ "hosts": hosts })
}

pub fn fleet_table(rows: &[FleetRow]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<20} {:<10} {:>10} {:>8} {:>12}",
        "HOST", "REACHABLE", "NEEDS", "ENTRIES", "UNDELIVERED"
    );
    let mut unsatisfied = Vec::new();
    for r in rows {
        match &r.status {
            Ok(s) => {
                let caps = s["provider"]["capabilities"].as_object();
                let entries: u64 = caps.map_or(0, |c| {
                    c.values().map(|v| v["entries"].as_u64().unwrap_or(0)).sum()
                });
                let undelivered: u64 = caps.map_or(0, |c| {
                    c.values()
                        .map(|v| v["undelivered"].as_u64().unwrap_or(0))
                        .sum()
                });
                let _ = writeln!(
                    out,
                    "{:<20} {:<10} {:>10} {:>8} {:>12}",
                    r.host,
                    "yes",
                    format!("{}/{}", s["needs"]["satisfied"], s["needs"]["total"]),
                    entries,
                    undelivered
                );
                for n in s["needs"]["items"].as_array().into_iter().flatten() {
                    if n["satisfied"].as_bool() != Some(true) {
                        unsatisfied.push(format!(
                            "  {}:{} from {}: {}",
                            r.host,
                            n["need"].as_str().unwrap_or(""),
                            n["from"].as_str().unwrap_or(""),
                            n["reason"].as_str().unwrap_or("waiting for a response")
                        ));
                    }
                }
            }
            Err(e) => {
                let _ = writeln!(
                    out,
                    "{:<20} {:<10} {:>10} {:>8} {:>12}   {e}",
                    r.host, "NO", "-", "-", "-"
                );
            }
        }
    }
    if !unsatisfied.is_empty() {
        let _ = writeln!(out, "\nUNSATISFIED NEEDS");
        for u in unsatisfied {
            let _ = writeln!(out, "{u}");
        }
    }
    out
}
