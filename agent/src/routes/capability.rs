//! `POST /agent/capabilities/<capability>` — the capability's `allowed` and `callers`, or
//! anyone known for the built-ins: async requests and releases (§6.1), rpc calls (§6.2).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use fort_core::names::NeedKey;
use fort_core::process::{run, RunSpec};
use fort_core::schema::{CapabilitySpec, Mode};
use fort_core::wire::{json_depth, Accepted, AsyncBody, MAX_REQUEST_DEPTH};
use http::StatusCode;

use crate::app::App;
use crate::auth::{json_body, Caller};
use crate::builtins;
use crate::error::{ApiError, Reply};
use crate::provider::{Notice, UpsertError};

pub async fn handle(
    app: &Arc<App>,
    caller: &Caller,
    name: &str,
    body: Bytes,
) -> Result<Reply, ApiError> {
    if let Some(builtin) = builtins::Builtin::from_name(name) {
        return builtins::handle(app, caller, builtin, body).await;
    }
    // Borrowed from the loaded view, not cloned: a capability's callers list the need
    // ids of every consumer in the fleet.
    let loaded = app.loaded.load_full();
    let spec = loaded
        .capabilities
        .get(name)
        .ok_or_else(|| ApiError::NotFound(format!("no capability {name}")))?;
    match spec.mode {
        Mode::Async => async_request(app, caller, name, spec, body).await,
        Mode::Rpc => {
            if !spec.permits(&caller.origin) {
                return Err(forbidden(caller, name));
            }
            rpc(app, caller, name, spec, body).await
        }
    }
}

fn forbidden(caller: &Caller, name: &str) -> ApiError {
    ApiError::Forbidden(format!(
        "{} may not call {name} (the capability's callers and allowed lists do not name it)",
        caller.origin
    ))
}

/// The longest a request may take to be checked against its schema.
const SCHEMA_BUDGET: Duration = Duration::from_secs(5);

/// Checks a request object against the limits every stored request obeys and against the
/// capability's schema (§11.6). `what` names it in messages. Schemas come from the build,
/// requests from the network: the check runs off the runtime's threads, a few at once,
/// within [`SCHEMA_BUDGET`], so requests built to be costly cannot stall the agent.
async fn check_request(
    app: &Arc<App>,
    spec: &CapabilitySpec,
    request: serde_json::Value,
    what: &'static str,
) -> Result<(), ApiError> {
    if json_depth(&request) > MAX_REQUEST_DEPTH {
        return Err(ApiError::BadRequest(format!(
            "{what} nests deeper than {MAX_REQUEST_DEPTH} levels"
        )));
    }
    let Some(schema) = spec.request_schema.clone() else {
        return Ok(());
    };
    let busy = || {
        ApiError::Overloaded(
            "busy checking other requests against their schemas".into(),
            1,
        )
    };
    let permit = tokio::time::timeout(SCHEMA_BUDGET, app.schema_checks.clone().acquire_owned())
        .await
        .map_err(|_| busy())?
        .map_err(|_| busy())?;
    let check = tokio::task::spawn_blocking(move || {
        let _held = permit;
        schema.check(&request)
    });
    match tokio::time::timeout(SCHEMA_BUDGET, check).await {
        Ok(Ok(Ok(()))) => Ok(()),
        Ok(Ok(Err(m))) => Err(ApiError::InvalidRequest(format!("{what} {m}"))),
        Ok(Err(e)) => Err(ApiError::Internal(format!("schema check failed: {e}"))),
        Err(_) => Err(ApiError::Overloaded(
            format!(
                "{what} took more than {}s to check against the schema",
                SCHEMA_BUDGET.as_secs()
            ),
            5,
        )),
    }
}

async fn async_request(
    app: &Arc<App>,
    caller: &Caller,
    name: &str,
    spec: &CapabilitySpec,
    body: Bytes,
) -> Result<Reply, ApiError> {
    async_item(app, caller, name, spec, serde_json::from_slice(&body)).await
}

/// One async request or release, whether it came alone or in a batch (§11.8). A caller
/// refused what it may not have (`403`, `429`) is in the audit trail.
pub(super) async fn async_item(
    app: &Arc<App>,
    caller: &Caller,
    name: &str,
    spec: &CapabilitySpec,
    parsed: Result<AsyncBody, serde_json::Error>,
) -> Result<Reply, ApiError> {
    let need = parsed.as_ref().ok().map(|b| b.need.clone());
    let result = async_item_checked(app, caller, name, spec, parsed).await;
    if let Err(e @ (ApiError::Forbidden(_) | ApiError::TooMany(..))) = &result {
        let mut event = fort_core::audit::Event::caused(fort_core::audit::CausedKind::Denied)
            .caller(caller.origin.as_str())
            .key(caller.fingerprint())
            .capability(name)
            .status(e.status().as_u16())
            .reason(e.to_string());
        if let Some(need) = need {
            event = event.need(fort_core::text::printable(&need, 200));
        }
        app.audit.record_caused_by(caller.origin.as_str(), event);
    }
    result
}

async fn async_item_checked(
    app: &Arc<App>,
    caller: &Caller,
    name: &str,
    spec: &CapabilitySpec,
    parsed: Result<AsyncBody, serde_json::Error>,
) -> Result<Reply, ApiError> {
    // A release touches only the caller's own entry (the origin is part of the key), so
    // it is honoured from anyone known, even a host no longer among the callers: when
    // both sides of a deploy switch at once, the provider may drop the caller first.
    let release = matches!(&parsed, Ok(b) if b.release);
    if !release && !spec.permits(&caller.origin) {
        return Err(forbidden(caller, name));
    }
    let parsed = parsed
        .map_err(|e| ApiError::body_shape(r#"{"need", "request" | "release", "renew"}"#, &e))?;
    let need = NeedKey::parse(&parsed.need).ok_or_else(|| {
        ApiError::BadRequest(format!("need {:?} is not <type>/<id>", parsed.need))
    })?;
    if need.kind() != name {
        return Err(ApiError::BadRequest(format!(
            "need type {} is not capability {name}",
            need.kind()
        )));
    }
    if release {
        if parsed.request.is_some() || parsed.renew {
            return Err(ApiError::BadRequest(
                "a release carries no request and no renew".into(),
            ));
        }
        app.provider
            .release(app, &caller.origin, &need)
            .await
            .map_err(|e| ApiError::Overloaded(format!("not stored: {e}"), 5))?;
        return Ok(accepted());
    }
    // A host among the callers holds exactly the need ids it declares; anyone else the
    // capability allows holds a bounded number of its own choosing.
    let quota = if spec.declares(&caller.origin, need.id()) {
        None
    } else if spec.allows(&caller.origin) {
        Some(app.config.max_entries_per_origin)
    } else {
        return Err(ApiError::Forbidden(format!(
            "{} does not declare the need {need} (capability {name} lists the need ids each caller declares)",
            caller.origin
        )));
    };
    let request = parsed
        .request
        .filter(|r| r.is_object())
        .ok_or_else(|| ApiError::BadRequest("request must be a JSON object".into()))?;
    // The cheap checks first: a request over the size limit costs no schema work.
    let size = serde_json::to_vec(&request).map_or(usize::MAX, |b| b.len());
    if size > app.config.max_request_bytes {
        return Err(ApiError::TooLarge(app.config.max_request_bytes));
    }
    check_request(app, spec, request.clone(), "request").await?;
    if app.config.audit.required && !app.audit.writable() {
        return Err(ApiError::Overloaded(
            "the audit trail of this provider cannot be written; it issues nothing until it can"
                .into(),
            5,
        ));
    }
    let verdict = app
        .provider
        .upsert(app, &caller.origin, &need, request, parsed.renew, quota)
        .await
        .map_err(|e| match e {
            UpsertError::Quota(n) => ApiError::TooMany(
                format!(
                    "{} holds {n} entries of {name}, the most max_entries_per_origin allows; release one first",
                    caller.origin
                ),
                60,
            ),
            UpsertError::Persist(e) => ApiError::Overloaded(format!("not stored: {e}"), 5),
        })?;
    Ok(accepted_with(verdict))
}

fn accepted() -> Reply {
    accepted_with(None)
}

/// `202`, with the entry's verdict on this request when it has one (§11.9).
fn accepted_with(verdict: Option<Notice>) -> Reply {
    let (refused, pending) = match verdict {
        Some(Notice::Refused(r)) => (Some(r), None),
        Some(Notice::Pending(r)) => (None, Some(r)),
        None => (None, None),
    };
    Reply::json(
        StatusCode::ACCEPTED,
        &Accepted {
            status: "accepted".into(),
            refused,
            pending,
        },
    )
}

async fn rpc(
    app: &Arc<App>,
    caller: &Caller,
    name: &str,
    spec: &CapabilitySpec,
    body: Bytes,
) -> Result<Reply, ApiError> {
    let request = json_body(&body)?;
    check_request(app, spec, request, "body").await?;
    let run_spec = RunSpec::new(&spec.handler, body.to_vec(), app.config.handler_timeout)
        .args(spec.args.iter().cloned())
        .env("FORT_HOST", app.config.host.clone())
        .env("FORT_CAPABILITY", name.to_owned())
        .env("FORT_TRIGGER", "request")
        .env("FORT_ORIGIN", caller.origin.clone())
        .envs(&app.config.handler_environment);
    run_output(app, name, run(&run_spec).await)
}

/// Turns a finished handler run into the rpc reply of §6.2.
pub fn run_output(
    app: &App,
    name: &str,
    outcome: Result<fort_core::process::Success, fort_core::process::RunError>,
) -> Result<Reply, ApiError> {
    match outcome {
        Ok(ok) => {
            app.metrics
                .handler_runs
                .inc(&[("capability", name), ("outcome", "ok")]);
            app.metrics
                .handler_seconds
                .add(&[("capability", name)], ok.duration.as_secs_f64());
            let json = serde_json::from_slice::<serde::de::IgnoredAny>(&ok.stdout).is_ok();
            Ok(Reply {
                status: StatusCode::OK,
                body: Bytes::from(ok.stdout),
                json,
                retry_after: None,
            })
        }
        Err(e) => {
            app.metrics
                .handler_runs
                .inc(&[("capability", name), ("outcome", e.class())]);
            Err(ApiError::HandlerFailed {
                exit_code: e.exit_code(),
                detail: format!(
                    "{name}: {}{}",
                    e.summary(),
                    e.stderr_excerpt(2048)
                        .map(|s| format!("; stderr: {s}"))
                        .unwrap_or_default()
                ),
            })
        }
    }
}
