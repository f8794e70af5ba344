//! `POST /agent/needs` — any known host or principal: the needs this host declares now (§8).

use std::sync::Arc;

use bytes::Bytes;
use fort_core::wire::NeedsList;
use http::StatusCode;

use crate::app::App;
use crate::auth::{json_body, Caller};
use crate::error::{ApiError, Reply};

pub async fn handle(app: &Arc<App>, _caller: &Caller, body: Bytes) -> Result<Reply, ApiError> {
    if !json_body(&body)?.is_object() {
        return Err(ApiError::BadRequest("body must be a JSON object".into()));
    }
    Ok(Reply::json(
        StatusCode::OK,
        &NeedsList {
            needs: app.fulfiller.declared(),
            served_by: app.fulfiller.served_by(),
        },
    ))
}
