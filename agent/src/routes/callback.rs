//! `POST /agent/needs/<type>/<id>` — only the need's provider (`from`): deliver or revoke
//! a response (§7).

use std::sync::Arc;

use bytes::Bytes;
use fort_core::names::NeedKey;
use fort_core::wire::CallbackReply;
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
    deliver(app, caller, need, &body).await
}

/// One callback, whether it came alone or in a batch (§11.8).
pub(super) async fn deliver(
    app: &Arc<App>,
    caller: &Caller,
    need: &NeedKey,
    body: &[u8],
) -> Result<Reply, ApiError> {
    let spec = app
        .fulfiller
        .spec(need)
        .ok_or_else(|| ApiError::NotFound(format!("this host declares no need {need}")))?;
    if spec.from != caller.origin {
        return Err(ApiError::Forbidden(format!(
            "{need} is provided by {}, not {}",
            spec.from, caller.origin
        )));
    }
    let satisfied = app
        .fulfiller
        .deliver(need, &caller.origin, body)
        .await
        .map_err(|e| match e {
            DeliverError::UnknownNeed => {
                ApiError::NotFound(format!("this host declares no need {need}"))
            }
            DeliverError::Persist(p) => {
                ApiError::Overloaded(format!("state not persisted: {p}"), 5)
            }
            DeliverError::Busy => ApiError::Overloaded(DeliverError::Busy.to_string(), 5),
        })?;
    Ok(Reply::json(
        StatusCode::OK,
        &CallbackReply {
            need: need.to_string(),
            satisfied,
        },
    ))
}
