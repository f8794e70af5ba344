//! `POST /agent/capabilities/<capability>` — the capability's `allowed` and `callers`, or
//! anyone known for the built-ins: async requests and releases (§6.1), rpc calls (§6.2).

use std::sync::Arc;

use bytes::Bytes;
use fort_core::names::NeedKey;
use fort_core::process::{run, RunSpec};
use fort_core::schema::{CapabilitySpec, Mode};
use fort_core::wire::AsyncBody;
use http::StatusCode;

use crate::app::App;
use crate::auth::{json_body, Caller};
use crate::builtins;
use crate::error::{ApiError, Reply};

pub async fn handle(
    app: &Arc<App>,
    caller: &Caller,
    name: &str,
    body: Bytes,
) -> Result<Reply, ApiError> {
    if let Some(builtin) = builtins::Builtin::from_name(name) {
        return builtins::handle(app, caller, builtin, body).await;
    }
    let loaded = app.loaded.load_full();
    let spec = loaded
        .capabilities
        .get(name)
        .ok_or_else(|| ApiError::NotFound(format!("no capability {name}")))?
        .clone();
    drop(loaded);
    if !spec.permits(&caller.origin) && !is_release(&spec, &body) {
        return Err(ApiError::Forbidden(format!(
            "{} may not call {name}",
            caller.origin
        )));
    }
    match spec.mode {
        Mode::Async => async_request(app, caller, name, body).await,
        Mode::Rpc => rpc(app, caller, name, &spec, body).await,
    }
}

/// A release touches only the caller's own entry (the origin is part of the key), so it
/// is honoured even from a host no longer among the callers: when both sides of a
/// deploy switch at once, the provider may drop the caller before the caller releases.
fn is_release(spec: &CapabilitySpec, body: &Bytes) -> bool {
    spec.mode == Mode::Async
        && serde_json::from_slice::<AsyncBody>(body).is_ok_and(|b| b.release && b.request.is_none())
}

async fn async_request(
    app: &Arc<App>,
    caller: &Caller,
    name: &str,
    body: Bytes,
) -> Result<Reply, ApiError> {
    let parsed: AsyncBody = serde_json::from_slice(&body)
        .map_err(|e| ApiError::BadRequest(format!("async body: {e}")))?;
    let need = NeedKey::parse(&parsed.need).ok_or_else(|| {
        ApiError::BadRequest(format!("need {:?} is not <type>/<id>", parsed.need))
    })?;
    if need.kind != name {
        return Err(ApiError::BadRequest(format!(
            "need type {} is not capability {name}",
            need.kind
        )));
    }
    let persisted = if parsed.release {
        if parsed.request.is_some() {
            return Err(ApiError::BadRequest("a release carries no request".into()));
        }
        app.provider
            .release(app, &caller.origin, &need)
            .await
            .map(|_| ())
    } else {
        let request = parsed
            .request
            .filter(|r| r.is_object())
            .ok_or_else(|| ApiError::BadRequest("request must be a JSON object".into()))?;
        app.provider
            .upsert(app, &caller.origin, &need, request)
            .await
    };
    persisted.map_err(|e| ApiError::Overloaded(format!("not stored: {e}")))?;
    Ok(Reply::json(
        StatusCode::ACCEPTED,
        &serde_json::json!({"status": "accepted"}),
    ))
}

async fn rpc(
    app: &Arc<App>,
    caller: &Caller,
    name: &str,
    spec: &CapabilitySpec,
    body: Bytes,
) -> Result<Reply, ApiError> {
    json_body(&body)?;
    let run_spec = RunSpec::new(&spec.handler, body.to_vec(), app.config.handler_timeout)
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
            })
        }
        Err(e) => {
            app.metrics
                .handler_runs
                .inc(&[("capability", name), ("outcome", e.class())]);
            Err(ApiError::HandlerFailed {
                exit_code: e.exit_code(),
                detail: format!("{name}: {e}"),
            })
        }
    }
}
