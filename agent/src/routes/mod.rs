//! Endpoints, one file each. They run only after [`crate::auth::dispatch`] verified the
//! caller, and they receive it as a [`Caller`].

mod batch;
mod callback;
mod capability;
pub use capability::run_output;
mod needs;

use std::sync::Arc;

use bytes::Bytes;

use crate::app::App;
use crate::auth::{Caller, Route};
use crate::error::{ApiError, Reply};

pub async fn handle(
    app: &Arc<App>,
    caller: &Caller,
    route: Route,
    body: Bytes,
) -> Result<Reply, ApiError> {
    match route {
        Route::Capability(name) => capability::handle(app, caller, &name, body).await,
        Route::Callback(need) => callback::handle(app, caller, &need, body).await,
        Route::NeedsList => needs::handle(app, caller, body).await,
        Route::CapabilityBatch(name) => batch::requests(app, caller, &name, body).await,
        Route::CallbackBatch => batch::callbacks(app, caller, body).await,
    }
}
