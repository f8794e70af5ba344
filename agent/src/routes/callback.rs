//! `POST /agent/needs/<type>/<id>` — only the need's providers (`from`): deliver or revoke
//! a response (§7); also each item of a callback batch, which may carry a verdict (§11.9).
//! Only the need's home is heard (§11.13); another of its providers is acknowledged.

use std::sync::Arc;

use bytes::Bytes;
use fort_core::names::NeedKey;
use fort_core::wire::{CallbackReply, Delivered};
use fort_fulfill::DeliverError;
use http::StatusCode;

use crate::app::App;
use crate::auth::Caller;
use crate::error::{ApiError, Reply};

pub async fn handle(
    app: &Arc<App>,
    caller: &Caller,
    need: &NeedKey,
    body: Bytes,
) -> Result<Reply, ApiError> {
    deliver(app, caller, need, Delivered::Payload(&body)).await
}

/// One callback, whether it came alone or in a batch (§11.8).
pub(super) async fn deliver(
    app: &Arc<App>,
    caller: &Caller,
    need: &NeedKey,
    what: Delivered<'_>,
) -> Result<Reply, ApiError> {
    let spec = app
        .fulfiller
        .spec(need)
        .ok_or_else(|| ApiError::NotFound(format!("this host declares no need {need}")))?;
    if !spec.from.names(&caller.origin) {
        return Err(ApiError::Forbidden(format!(
            "{need} is provided by {}, not {}",
            spec.from, caller.origin
        )));
    }
    if app.fulfiller.home(need).as_deref() != Some(caller.origin.as_str()) {
        // A provider the need moved away from (back after an outage, redelivering what it
        // holds, or revoking it in its GC): acknowledged so it stops, and not applied.
        tracing::info!(need = %need, from = %caller.origin, "callback from a provider that no longer serves the need; not applied");
        return Ok(Reply::json(
            StatusCode::OK,
            &CallbackReply {
                need: need.to_string(),
                satisfied: app.fulfiller.is_satisfied(need),
                applying: false,
            },
        ));
    }
    let outcome = app
        .fulfiller
        .deliver(need, &caller.origin, what)
        .await
        .map_err(|e| match e {
            DeliverError::UnknownNeed => {
                ApiError::NotFound(format!("this host declares no need {need}"))
            }
            DeliverError::Persist(p) => {
                ApiError::Overloaded(format!("state not persisted: {p}"), 5)
            }
        })?;
    Ok(Reply::json(
        StatusCode::OK,
        &CallbackReply {
            need: need.to_string(),
            satisfied: outcome == Some(true),
            applying: outcome.is_none(),
        },
    ))
}
