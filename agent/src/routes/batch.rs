//! Batches (§11.8): many async requests to one capability in one signed request, and
//! many callbacks to one consumer in one signed request. Each item is decided exactly as
//! the single endpoint decides it, and answered with what that endpoint would answer; the
//! items' durable writes share one fsync.
//!
//! A whole-batch `404` means "send these one by one": it is what an agent that predates
//! batches answers, and what this one answers for capabilities that take no batches
//! (unknown, rpc-mode, built-in) and when `batches = false`.

use std::collections::HashSet;
use std::sync::Arc;

use bytes::Bytes;
use fort_core::names::NeedKey;
use fort_core::schema::Mode;
use fort_core::wire::{
    AsyncBody, BatchResults, CallbackBatch, ItemResult, RequestBatch, MAX_BATCH_ITEMS,
};
use http::StatusCode;

use crate::app::App;
use crate::auth::Caller;
use crate::builtins;
use crate::error::{ApiError, Reply};

fn item_result(caller: &Caller, outcome: Result<Reply, ApiError>) -> ItemResult {
    let reply = outcome.unwrap_or_else(|e| {
        tracing::debug!(origin = %caller.origin, error = %e, "batch item refused");
        e.reply()
    });
    ItemResult {
        status: reply.status.as_u16(),
        body: serde_json::from_slice(&reply.body).unwrap_or(serde_json::Value::Null),
        retry_after: reply.retry_after,
    }
}

fn results(results: Vec<ItemResult>) -> Reply {
    Reply::json(StatusCode::OK, &BatchResults { results })
}

fn check_count(n: usize) -> Result<(), ApiError> {
    if n == 0 || n > MAX_BATCH_ITEMS {
        return Err(ApiError::BadRequest(format!(
            "a batch holds 1 to {MAX_BATCH_ITEMS} items, not {n}"
        )));
    }
    Ok(())
}

/// The same need twice in one batch would race with itself.
fn repeated_item() -> ApiError {
    ApiError::BadRequest("this need is already an item of the batch".into())
}

fn not_batched(what: &str) -> ApiError {
    ApiError::NotFound(format!(
        "{what} takes no batches; send the items one by one"
    ))
}

/// `POST /agent/capabilities/<capability>/batch`.
pub async fn requests(
    app: &Arc<App>,
    caller: &Caller,
    name: &str,
    body: Bytes,
) -> Result<Reply, ApiError> {
    if !app.config.batches {
        return Err(not_batched("this agent"));
    }
    if builtins::Builtin::from_name(name).is_some() {
        return Err(not_batched(name));
    }
    let loaded = app.loaded.load_full();
    let spec = match loaded.capabilities.get(name) {
        Some(spec) if spec.mode == Mode::Async => spec,
        _ => return Err(not_batched(name)),
    };
    let batch: RequestBatch = serde_json::from_slice(&body)
        .map_err(|e| ApiError::body_shape(r#"{"requests": [...]}"#, &e))?;
    check_count(batch.requests.len())?;
    // A consumer that batches its requests takes batched callbacks too.
    app.provider.deliveries.batches_accepted_by(&caller.origin);
    let mut seen = HashSet::new();
    let items = batch.requests.into_iter().map(|item| {
        let parsed = serde_json::from_value::<AsyncBody>(item);
        let repeated = matches!(&parsed, Ok(b) if !seen.insert(b.need.clone()));
        async move {
            if repeated {
                return item_result(caller, Err(repeated_item()));
            }
            item_result(
                caller,
                super::capability::async_item(app, caller, name, spec, parsed).await,
            )
        }
    });
    Ok(results(futures_util::future::join_all(items).await))
}

/// `POST /agent/callbacks`.
pub async fn callbacks(app: &Arc<App>, caller: &Caller, body: Bytes) -> Result<Reply, ApiError> {
    if !app.config.batches {
        return Err(not_batched("this agent"));
    }
    let batch: CallbackBatch = serde_json::from_slice(&body)
        .map_err(|e| ApiError::body_shape(r#"{"callbacks": [{"need", "payload"}]}"#, &e))?;
    check_count(batch.callbacks.len())?;
    // Each item is recorded before its result is given, and applied in the consumer's own
    // time: a batch of slow handlers is answered within seconds all the same, and no item
    // waits for the connection to stay open.
    let mut seen = HashSet::new();
    let items = batch.callbacks.into_iter().map(|item| {
        let need = NeedKey::parse(&item.need);
        let repeated = !seen.insert(item.need.clone());
        async move {
            let outcome = match need {
                _ if repeated => Err(repeated_item()),
                None => Err(ApiError::NotFound(format!(
                    "this host declares no need {:?}",
                    item.need
                ))),
                Some(need) => match item.delivered() {
                    Some(what) => super::callback::deliver(app, caller, &need, what).await,
                    None => Err(ApiError::BadRequest(
                        "an item carries exactly one of payload, refused, pending".into(),
                    )),
                },
            };
            item_result(caller, outcome)
        }
    });
    Ok(results(futures_util::future::join_all(items).await))
}
