//! Capabilities every agent serves itself (§5a): `status`, `manifest` and `needs` to every
//! known caller; `journal`, `systemd`, `trigger`, `resend` and `audit` only to the
//! principals listed in `[access]`.

use std::sync::Arc;

use bytes::Bytes;
use fort_core::process::run;
use fort_core::schema::PeerKind;
use http::StatusCode;
use serde_json::{json, Value};

use crate::app::App;
use crate::auth::{json_body, Caller};
use crate::error::{ApiError, Reply};

pub mod audit;
mod journal;
mod systemd;

/// A bad parameter of `journal` or `systemd`, reported to the caller as 400.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{0}")]
pub struct ParamError(pub String);

use fort_core::names::is_unit_name;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Builtin {
    Status,
    Manifest,
    Needs,
    Journal,
    Systemd,
    Trigger,
    Resend,
    Audit,
}

impl Builtin {
    pub fn from_name(name: &str) -> Option<Builtin> {
        Some(match name {
            "status" => Builtin::Status,
            "manifest" => Builtin::Manifest,
            "needs" => Builtin::Needs,
            "journal" => Builtin::Journal,
            "systemd" => Builtin::Systemd,
            "trigger" => Builtin::Trigger,
            "resend" => Builtin::Resend,
            "audit" => Builtin::Audit,
            _ => return None,
        })
    }
}

/// Serves a built-in; every operator call (`journal`, `systemd`, `trigger`, `resend`,
/// `audit`, `status` with entries), answered or refused, is in the audit trail with the
/// caller's key.
pub async fn handle(
    app: &Arc<App>,
    caller: &Caller,
    which: Builtin,
    body: Bytes,
) -> Result<Reply, ApiError> {
    let call = match which {
        Builtin::Journal => "journal",
        Builtin::Systemd => "systemd",
        Builtin::Trigger => "trigger",
        Builtin::Resend => "resend",
        Builtin::Audit => "audit",
        Builtin::Status => "status",
        Builtin::Manifest | Builtin::Needs => return serve(app, caller, which, &body).await,
    };
    let result = serve(app, caller, which, &body).await;
    let status = match &result {
        Ok(reply) => reply.status,
        Err(e) => e.status(),
    };
    // `status` is an operator call only when it showed (or withheld) the entries: decided
    // from the request as `serve` parsed it, never from its bytes (`"\u0065ntries"` is
    // `"entries"`).
    let shown = which != Builtin::Status || asks_for_entries(&body);
    if shown {
        let event = operator_event(caller, call, &body, status.as_u16());
        app.audit.record_caused_by(caller.origin.as_str(), event);
    }
    result
}

/// Whether a `status` body asks for the entries, as [`serve`] reads it.
fn asks_for_entries(body: &Bytes) -> bool {
    json_body(body).is_ok_and(|v| v.get("entries") == Some(&Value::Bool(true)))
}

/// An operator call as the audit trail keeps it: who (and with which key), what, its
/// parameters (bounded; they name units, entries and times, never secrets) and the
/// status it was answered with. A refused call is kept without its parameters, within
/// the tighter budget of refusals: what a caller without the grant sends is not worth
/// the trail's room.
pub fn operator_event(
    caller: &Caller,
    call: &str,
    body: &[u8],
    status: u16,
) -> fort_core::audit::Event<fort_core::audit::Caused> {
    use fort_core::audit::{CausedKind, Event};
    if !(200..300).contains(&status) {
        return Event::caused(CausedKind::OperatorRefused)
            .caller(caller.origin.as_str())
            .key(caller.fingerprint())
            .status(status)
            .detail(json!({"call": call, "params": format!("{} bytes", body.len())}));
    }
    let params = serde_json::from_slice::<Value>(body)
        .ok()
        .filter(|_| body.len() <= 1024)
        .unwrap_or_else(|| json!(format!("{} bytes", body.len())));
    Event::caused(CausedKind::Operator)
        .caller(caller.origin.as_str())
        .key(caller.fingerprint())
        .status(status)
        .detail(json!({"call": call, "params": params}))
}

async fn serve(
    app: &Arc<App>,
    caller: &Caller,
    which: Builtin,
    body: &Bytes,
) -> Result<Reply, ApiError> {
    let body = body.clone();
    let access = &app.config.access;
    let operator_list = match which {
        Builtin::Journal => Some((&access.journal, "journal")),
        Builtin::Systemd => Some((&access.systemd, "systemd")),
        Builtin::Trigger | Builtin::Resend => Some((&access.trigger, "trigger")),
        Builtin::Audit => Some((&access.audit, "audit")),
        _ => None,
    };
    let name = match which {
        Builtin::Resend => "resend",
        _ => operator_list.map_or("", |(_, key)| key),
    };
    if let Some((list, key)) = operator_list {
        if caller.kind != PeerKind::Principal {
            return Err(ApiError::Forbidden(format!(
                "{name} is for principals (operators); hosts never get it"
            )));
        }
        if !list.contains(&caller.origin) {
            // The operator reading this is the one who can fix it: name the key.
            return Err(ApiError::Forbidden(format!(
                "{origin} may not call {name} on {host}: {grant}",
                origin = caller.origin,
                host = app.config.host,
                grant = grant(&caller.origin, key),
            )));
        }
    }
    // Permission before parsing (§3 step 8: 403 before 400).
    let params = json_body(&body)?;
    match which {
        Builtin::Status => {
            let entries = match params.get("entries") {
                Some(Value::Bool(true)) => {
                    if caller.kind == PeerKind::Principal && access.trigger.contains(&caller.origin)
                    {
                        Entries::Shown
                    } else {
                        Entries::Withheld(format!(
                            "{origin} may not see the entries of {host}: {grant}",
                            origin = caller.origin,
                            host = app.config.host,
                            grant = if caller.kind == PeerKind::Principal {
                                grant(&caller.origin, "trigger")
                            } else {
                                "entries are for principals (operators); hosts never see them"
                                    .to_owned()
                            },
                        ))
                    }
                }
                _ => Entries::NotAsked,
            };
            Ok(Reply::json(StatusCode::OK, &status(app, entries)))
        }
        Builtin::Trigger => crate::rotate::trigger(app, caller, &params).await,
        Builtin::Resend => crate::rotate::resend(app, caller, &params),
        Builtin::Audit => serve_audit(app, &params).await,
        Builtin::Manifest => Ok(Reply::json(StatusCode::OK, &manifest(app))),
        Builtin::Needs => Ok(Reply::json(
            StatusCode::OK,
            &fort_core::wire::NeedsList {
                needs: app.fulfiller.declared(),
                served_by: app.fulfiller.served_by(),
            },
        )),
        Builtin::Journal => {
            let spec = journal::command(&params, app.config.handler_timeout)
                .map_err(|e| ApiError::BadRequest(e.0))?;
            let out = run(&spec).await;
            let out = out.map(|mut ok| {
                let text = String::from_utf8_lossy(&ok.stdout).into_owned();
                ok.stdout = serde_json::to_vec(&json!({"lines": text.lines().collect::<Vec<_>>()}))
                    .expect("serialises");
                ok
            });
            crate::routes::run_output(app, "journal", out)
        }
        Builtin::Systemd => {
            let (action, spec) = systemd::command(&params, app.config.handler_timeout)
                .map_err(|e| ApiError::BadRequest(e.0))?;
            tracing::info!(origin = %caller.origin, ?action, "systemd action requested");
            match run(&spec).await {
                Ok(ok) => Ok(Reply::json(
                    StatusCode::OK,
                    &json!({"exit_code": 0, "output": String::from_utf8_lossy(&ok.stdout)}),
                )),
                // `systemctl status` exits 3 for an inactive unit: that is an answer, not a failure.
                Err(fort_core::process::RunError::Exit { code, stdout, .. })
                    if action == systemd::Action::Status =>
                {
                    Ok(Reply::json(
                        StatusCode::OK,
                        &json!({"exit_code": code, "output": stdout}),
                    ))
                }
                Err(e) => crate::routes::run_output(app, "systemd", Err(e)),
            }
        }
    }
}

/// `audit`: the trail's listing or one chunk of one of its files, read off the runtime's
/// threads (a chunk is up to 1 MiB, a prefix hashed up to a whole file).
async fn serve_audit(app: &Arc<App>, params: &Value) -> Result<Reply, ApiError> {
    let ask = audit::parse(params).map_err(|e| ApiError::BadRequest(e.0))?;
    if !app.config.audit.enable {
        return Err(ApiError::NotFound(format!(
            "{} keeps no audit trail ([audit] enable = false in its agent.toml)",
            app.config.host
        )));
    }
    let dir = app.config.audit_dir();
    let read = tokio::task::spawn_blocking(move || match ask {
        audit::Ask::Listing => audit::listing(&dir),
        audit::Ask::Chunk {
            name,
            offset,
            max_bytes,
            prefix_sha256,
        } => audit::chunk(&dir, &name, offset, max_bytes, prefix_sha256),
    })
    .await
    .map_err(|e| ApiError::Internal(format!("audit read: {e}")))?;
    match read {
        Ok(doc) => Ok(Reply::json(StatusCode::OK, &doc)),
        Err(audit::ReadError::Bad(m)) => Err(ApiError::BadRequest(m)),
        Err(audit::ReadError::Missing(m)) => Err(ApiError::NotFound(m)),
        Err(audit::ReadError::Io(m)) => Err(ApiError::Internal(m)),
    }
}

/// How to be granted `key` of `[access]`, for the operator who was refused.
fn grant(origin: &str, key: &str) -> String {
    format!("add \"{origin}\" to [access] {key} in its agent.toml (NixOS: services.fort-agent.settings.access.{key})")
}

/// Whether the status document lists the provider's entries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entries {
    NotAsked,
    Shown,
    /// Asked for by a caller who may not see them: why, and what would grant it.
    Withheld(String),
}

/// The `status` document: what this host needs, what it provides, how it is doing.
/// Reasons are one line and never carry payload bytes or handler output (docs/protocol.md
/// §11.7), so remote callers get the same document as the local admin socket. Entries
/// are listed by their hashes, never their requests or responses.
pub fn status(app: &Arc<App>, entries: Entries) -> StatusDoc {
    let needs = app.fulfiller.status();
    let loaded = app.loaded.load_full();
    let (total, satisfied) = (needs.len(), needs.iter().filter(|n| n.satisfied).count());
    let gc = app.last_gc.lock().as_ref().map(|g| GcSummary {
        at: g.at,
        duration_ms: g.duration_ms,
        kept_no_proof: g.kept_no_proof.len(),
        kept_no_proof_by_class: g.no_proof_classes.clone(),
        origins_asked: g.origins_asked,
        pending_grace: g.pending_grace.len(),
        removed: g.removed.len(),
    });
    // Files rendered from templates (§11.14), by name: hashes and why not, never content.
    let templates = app
        .fulfiller
        .template_states()
        .into_iter()
        .map(|(name, t)| {
            let state = match (&t.reason, &t.rendered_sha256) {
                (None, Some(_)) => "rendered",
                (Some(_), Some(_)) => "stale",
                _ => "waiting",
            };
            let summary = TemplateSummary {
                files: t.files.into_keys().collect(),
                reason: t.reason,
                rendered_at: t.rendered_at,
                rendered_sha256: t.rendered_sha256,
                state,
            };
            (name, summary)
        })
        .collect();
    let (entries, entries_withheld) = match entries {
        Entries::NotAsked => (None, None),
        Entries::Shown => (
            Some(
                app.provider
                    .entries(|origin| loaded.registry.is_host(origin)),
            ),
            None,
        ),
        Entries::Withheld(why) => (None, Some(why)),
    };
    let provider = app
        .provider
        .summary(|origin| loaded.registry.is_host(origin));
    StatusDoc {
        entries,
        entries_withheld,
        gc,
        host: app.config.host.clone(),
        manifest_sha256: loaded.manifest_sha256.clone(),
        memory: memory(app, provider.entries),
        needs: NeedsSummary {
            items: needs,
            satisfied,
            total,
        },
        nonces: app.nonces.len(),
        protocol: fort_core::compat::PROTOCOL,
        provider,
        state_formats: fort_core::compat::formats_json_ref(),
        templates,
        uptime_seconds: app.started.elapsed().as_secs(),
        version: fort_core::VERSION,
    }
}

/// The `status` document, serialised straight into the reply (no tree of values built
/// and copied on every call). Fields in name order, as the document has always had them.
#[derive(Debug, serde::Serialize)]
pub struct StatusDoc {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub entries: Option<serde_json::Map<String, Value>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub entries_withheld: Option<String>,
    pub gc: Option<GcSummary>,
    pub host: String,
    pub manifest_sha256: String,
    pub memory: MemorySummary,
    pub needs: NeedsSummary,
    pub nonces: usize,
    pub protocol: &'static str,
    pub provider: crate::provider::ProviderSummary,
    pub state_formats: &'static Value,
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub templates: std::collections::BTreeMap<String, TemplateSummary>,
    pub uptime_seconds: u64,
    pub version: &'static str,
}

#[derive(Debug, serde::Serialize)]
pub struct NeedsSummary {
    pub items: Vec<fort_fulfill::NeedStatus>,
    pub satisfied: usize,
    pub total: usize,
}

/// The last GC sweep, counted.
#[derive(Debug, serde::Serialize)]
pub struct GcSummary {
    pub at: u64,
    pub duration_ms: u64,
    pub kept_no_proof: usize,
    pub kept_no_proof_by_class: std::collections::BTreeMap<String, usize>,
    pub origins_asked: usize,
    pub pending_grace: usize,
    pub removed: usize,
}

/// One template's file: hashes and why not, never content.
#[derive(Debug, serde::Serialize)]
pub struct TemplateSummary {
    pub files: Vec<String>,
    pub reason: Option<String>,
    pub rendered_at: Option<u64>,
    pub rendered_sha256: Option<String>,
    pub state: &'static str,
}

/// What the agent holds in memory, and per provider entry: entries are what grows with
/// a fleet (requests and responses are kept as their JSON text; a stored request is at
/// most `max_request_bytes`).
#[derive(Debug, serde::Serialize)]
pub struct MemorySummary {
    pub max_request_bytes: usize,
    pub provider_entries: u64,
    pub rss_bytes: u64,
    pub rss_per_entry_bytes: Option<u64>,
}

/// `entries`: the provider's, as the summary beside it counted them.
fn memory(app: &Arc<App>, entries: usize) -> MemorySummary {
    let rss_kb = rss_kb();
    let entries = entries as u64;
    MemorySummary {
        max_request_bytes: app.config.max_request_bytes,
        provider_entries: entries,
        rss_bytes: rss_kb * 1024,
        rss_per_entry_bytes: (entries > 0).then(|| rss_kb * 1024 / entries),
    }
}

/// The agent's resident memory in kB, read from /proc at most once a second: reading and
/// parsing /proc/self/status was a tenth of the CPU of a signed `status` call. Kept in
/// atomics, not behind a lock every concurrent status call would queue on; two calls
/// that find it stale at once both read it, which is harmless.
fn rss_kb() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    // Milliseconds since EPOCH, plus one, of the last read; zero: never read.
    static READ_AT_MS: AtomicU64 = AtomicU64::new(0);
    static KB: AtomicU64 = AtomicU64::new(0);
    let now_ms = EPOCH
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_millis() as u64
        + 1;
    let read_at = READ_AT_MS.load(Ordering::Acquire);
    if read_at != 0 && now_ms.saturating_sub(read_at) < 1000 {
        return KB.load(Ordering::Relaxed);
    }
    let kb = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0);
    KB.store(kb, Ordering::Relaxed);
    READ_AT_MS.store(now_ms, Ordering::Release);
    kb
}

/// The `manifest` document: declared needs and capabilities.
pub fn manifest(app: &Arc<App>) -> Value {
    let loaded = app.loaded.load_full();
    let needs: serde_json::Map<String, Value> = loaded
        .needs
        .iter()
        .map(|(k, spec)| {
            (
                k.to_string(),
                json!({"from": spec.from, "nag_seconds": spec.nag_seconds, "has_handler": spec.handler.is_some(), "check": spec.check.is_some(), "never_satisfied": spec.never_satisfied}),
            )
        })
        .collect();
    let caps: serde_json::Map<String, Value> = loaded
        .capabilities
        .iter()
        .map(|(name, c)| {
            (
                name.clone(),
                json!({"mode": c.mode, "cacheResponse": c.cache_response, "allowed": c.allowed, "callers": c.callers, "description": c.description, "triggers": c.triggers}),
            )
        })
        .collect();
    json!({"host": app.config.host, "needs": needs, "capabilities": caps})
}
