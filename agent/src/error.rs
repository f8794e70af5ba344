//! The one HTTP error type. It owns the mapping to status codes; the detail goes to the
//! log, the client gets a short JSON body (and every 401 the same one).

use bytes::Bytes;
use fort_core::wire::{ErrorBody, UNAUTHORIZED_BODY};
use http::StatusCode;

/// A reply body and status before the response signature is added.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: StatusCode,
    pub body: Bytes,
    pub json: bool,
    /// `Retry-After` seconds: when a refused caller should come back.
    pub retry_after: Option<u64>,
}

impl Reply {
    pub fn json(status: StatusCode, value: &impl serde::Serialize) -> Reply {
        // Most replies (a status document, a callback's answer) fit in 1 KiB: one
        // allocation rather than a growing series.
        let mut body = Vec::with_capacity(1024);
        serde_json::to_writer(&mut body, value).expect("reply serialises");
        Reply {
            status,
            body: Bytes::from(body),
            json: true,
            retry_after: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("unauthorized: {0}")]
    Unauthorized(String),
    #[error("forbidden: {0}")]
    Forbidden(String),
    #[error("not found: {0}")]
    NotFound(String),
    #[error("bad request: {0}")]
    BadRequest(String),
    /// 400 with code `unsupported_protocol`: the caller announced a later protocol major
    /// (docs/protocol.md §11.12).
    #[error("unsupported protocol: {0}")]
    UnsupportedProtocol(String),
    #[error("method not allowed")]
    MethodNotAllowed,
    #[error("body over {0} bytes")]
    TooLarge(usize),
    #[error("timeout: {0}")]
    Timeout(String),
    /// 503: busy now; come back after the given seconds.
    #[error("overloaded: {0}")]
    Overloaded(String, u64),
    /// 429: this caller used its share (nonces, entries); come back after the seconds.
    #[error("too many: {0}")]
    TooMany(String, u64),
    /// 400 with code `invalid_request`: the request breaks the capability's schema.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("handler failed: {detail}")]
    HandlerFailed { exit_code: i32, detail: String },
    #[error("internal: {0}")]
    Internal(String),
}

impl ApiError {
    /// A body that does not parse as `expected`. serde's messages quote the offending
    /// values, so only where the body is wrong is named.
    pub fn body_shape(expected: &str, e: &serde_json::Error) -> ApiError {
        ApiError::BadRequest(format!(
            "the body is not {expected} ({:?} at line {}, column {})",
            e.classify(),
            e.line(),
            e.column()
        ))
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::BadRequest(_) | ApiError::UnsupportedProtocol(_) => StatusCode::BAD_REQUEST,
            ApiError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Timeout(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::Overloaded(..) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::TooMany(..) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::InvalidRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::HandlerFailed { .. } | ApiError::Internal(_) => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        }
    }

    /// The body the caller sees.
    pub fn reply(&self) -> Reply {
        let (code, message, exit_code) = match self {
            ApiError::Unauthorized(_) => {
                return Reply {
                    status: self.status(),
                    body: Bytes::from_static(UNAUTHORIZED_BODY.as_bytes()),
                    json: true,
                    retry_after: None,
                }
            }
            ApiError::Forbidden(m) => ("forbidden", m.clone(), None),
            ApiError::NotFound(m) => ("not_found", m.clone(), None),
            ApiError::BadRequest(m) => ("bad_request", m.clone(), None),
            ApiError::UnsupportedProtocol(m) => ("unsupported_protocol", m.clone(), None),
            ApiError::MethodNotAllowed => ("method_not_allowed", "only POST".into(), None),
            ApiError::TooLarge(n) => ("too_large", format!("body over {n} bytes"), None),
            ApiError::Timeout(m) => ("timeout", m.clone(), None),
            ApiError::Overloaded(m, after) => {
                let mut r = Reply::json(
                    self.status(),
                    &ErrorBody {
                        error: "overloaded".into(),
                        message: Some(m.clone()),
                        exit_code: None,
                    },
                );
                r.retry_after = Some(*after);
                return r;
            }
            ApiError::TooMany(m, after) => {
                let mut r = Reply::json(
                    self.status(),
                    &ErrorBody {
                        error: "too_many".into(),
                        message: Some(m.clone()),
                        exit_code: None,
                    },
                );
                r.retry_after = Some(*after);
                return r;
            }
            ApiError::InvalidRequest(m) => ("invalid_request", m.clone(), None),
            ApiError::HandlerFailed { exit_code, .. } => {
                return Reply::json(
                    self.status(),
                    &ErrorBody {
                        error: "handler_failed".into(),
                        message: None,
                        exit_code: Some(*exit_code),
                    },
                )
            }
            ApiError::Internal(_) => (
                "internal",
                "internal error; see the agent's log".into(),
                None,
            ),
        };
        Reply::json(
            self.status(),
            &ErrorBody {
                error: code.into(),
                message: Some(message),
                exit_code,
            },
        )
    }
}
