//! `POST /agent/capabilities/trigger` and `/agent/capabilities/resend`, principals in
//! `[access] trigger` only (docs/protocol.md §5a): rotate one entry at a provider, or have
//! a consumer send one need's request again, from an operator's workstation.

use std::sync::Arc;

use fort_core::names::{is_host_name, is_principal_name, parse_entry_key, NeedKey};
use http::StatusCode;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::app::App;
use crate::auth::Caller;
use crate::error::{ApiError, Reply};
use crate::provider::trigger::{TriggerAsk, TriggerError};
use crate::provider::Trigger;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TriggerBody {
    capability: String,
    #[serde(default)]
    entry: Option<String>,
    #[serde(default)]
    force: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AskBody {
    need: String,
}

fn parse<T: serde::de::DeserializeOwned>(params: &Value, expected: &str) -> Result<T, ApiError> {
    T::deserialize(params)
        .map_err(|e| ApiError::BadRequest(format!("the body is not {expected}: {e}")))
}

/// Runs the capability's handler and answers once the run is over.
pub async fn trigger(app: &Arc<App>, caller: &Caller, params: &Value) -> Result<Reply, ApiError> {
    let body: TriggerBody = parse(
        params,
        r#"{"capability": "<name>", "entry": "<origin>:<type>/<id>", "force": true|false}"#,
    )?;
    if let Some(e) = &body.entry {
        // A name that breaks §1 never reaches the state or the log.
        let valid = parse_entry_key(e)
            .is_some_and(|(origin, _)| is_host_name(origin) || is_principal_name(origin));
        if !valid {
            return Err(ApiError::BadRequest(
                "entry is not an entry key <origin>:<type>/<id>".into(),
            ));
        }
    }
    tracing::info!(origin = %caller.origin, capability = %body.capability, entry = body.entry.as_deref().unwrap_or("(all)"), force = body.force, "trigger requested");
    let ask = TriggerAsk {
        capability: body.capability,
        entry: body.entry,
        force: body.force,
        trigger: Trigger::Manual,
    };
    match app.provider.trigger(app, ask).await {
        Ok(outcome) => Ok(Reply::json(StatusCode::OK, &outcome)),
        Err(e) if e.is_not_found() => Err(ApiError::NotFound(e.to_string())),
        Err(e @ TriggerError::ShuttingDown) => Err(ApiError::Overloaded(e.to_string(), 5)),
        Err(e) => Err(ApiError::Internal(e.to_string())),
    }
}

/// Plans the need's request at once and answers with its state now.
pub fn resend(app: &Arc<App>, caller: &Caller, params: &Value) -> Result<Reply, ApiError> {
    let body: AskBody = parse(params, r#"{"need": "<type>/<id>"}"#)?;
    let key = NeedKey::parse(&body.need)
        .ok_or_else(|| ApiError::BadRequest("need is not a need key <type>/<id>".into()))?;
    let Some(row) = app.fulfiller.ask_now(&key) else {
        return Err(ApiError::NotFound(format!(
            "{} declares no need {key}",
            app.config.host
        )));
    };
    tracing::info!(origin = %caller.origin, need = %key, "resend requested");
    Ok(Reply::json(StatusCode::OK, &resend_reply(&row)))
}

/// The `resend` reply: the need as it stands once its request is planned.
pub fn resend_reply(row: &fort_fulfill::NeedStatus) -> Value {
    json!({
        "need": row.need,
        "from": row.from,
        "state": row.state,
        "reason": row.reason,
    })
}
