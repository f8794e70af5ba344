//! `provider-state.json` (and its log): every active entry `<origin>:<type>/<id>` with its
//! request, its last response and what was last delivered. One owner (the
//! [`fort_core::store::Store`]) writes it.

use std::sync::Arc;

use fort_core::canonical::sha256_hex;
use fort_core::wire::payload_bytes_raw;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::Value;

/// The file, and the field of the snapshot that holds the entries.
pub const FILE: &str = "provider-state.json";
pub const FIELD: &str = "entries";

/// Requests and responses are kept as their compact JSON text, shared (`Arc`): the
/// provider never looks inside them, a parsed tree costs ten times the text, an entry is
/// copied on every change, and every entry is handed to each handler run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Entry {
    pub request: Arc<RawValue>,
    /// The handler's last response; `None` when it gave none.
    pub response: Option<Arc<RawValue>>,
    /// Hash of the response's payload bytes, kept beside it so that telling delivered
    /// from undelivered entries (status, redelivery) costs a comparison, not a hash of
    /// every payload. Absent in files from before it existed: computed then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_hash: Option<String>,
    /// Unix seconds of the first and the latest request.
    pub created_at: u64,
    pub requested_at: u64,
    /// Since when GC has proof the consumer no longer declares this need.
    #[serde(default)]
    pub absent_since: Option<u64>,
    /// The requester asked since the last run that planned its callback: it is owed its
    /// response whether or not it changed. Persisted, so a provider killed between the
    /// 202 and the handler run still owes it after a restart.
    #[serde(default)]
    pub awaiting_response: bool,
    #[serde(default)]
    pub delivery: Delivery,
    /// The consumer asked for a new response before its payload expires (§11.4); handed
    /// to the handler until it answers with something different.
    #[serde(default)]
    pub renew: bool,
    /// The handler's verdict on the entry (§11.9): refused, or work under way; kept until
    /// it answers the entry otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub notice: Option<Notice>,
}

/// A handler's verdict on an entry, as the consumer is told it (§11.9).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Notice {
    /// `$fort_refused`: no response, and why.
    Refused(String),
    /// `$fort_pending`: the response stays; why the consumer waits.
    Pending(String),
}

/// Longest reason a verdict keeps (§11.9).
pub const NOTICE_CHARS: usize = 200;

impl Notice {
    /// Identifies the verdict for delivery bookkeeping.
    pub fn hash(&self) -> String {
        sha256_hex(&serde_json::to_vec(self).expect("notice serialises"))
    }

    pub fn reason(&self) -> &str {
        match self {
            Notice::Refused(r) | Notice::Pending(r) => r,
        }
    }
}

/// What the consumer last acknowledged, and how the latest attempt went.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Delivery {
    /// Hash of the payload the consumer acknowledged last (`None`: nothing, or a revocation).
    pub delivered_hash: Option<String>,
    pub delivered_at: Option<u64>,
    pub last_error: Option<String>,
    pub attempts: u32,
    /// Hash of the verdict the consumer acknowledged last (§11.9), or that it cannot take.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delivered_notice: Option<String>,
}

/// Hash identifying a response's payload bytes (§7); `None` for no response.
pub fn payload_hash(response: Option<&RawValue>) -> Option<String> {
    response.map(|v| sha256_hex(&payload_bytes_raw(v)))
}

/// A value as the compact JSON text entries keep.
pub fn raw(value: &Value) -> Arc<RawValue> {
    Arc::from(serde_json::value::to_raw_value(value).expect("a JSON value serialises"))
}

/// Whether two kept texts are the same JSON (texts written by serde_json are canonical:
/// objects are sorted maps, numbers and strings have one form).
pub fn same(a: Option<&RawValue>, b: Option<&RawValue>) -> bool {
    a.map(RawValue::get) == b.map(RawValue::get)
}

impl Entry {
    /// The hash of the current response's payload (`None`: no response).
    pub fn current_hash(&self) -> Option<String> {
        match (&self.response, &self.response_hash) {
            (None, _) => None,
            (Some(_), Some(h)) => Some(h.clone()),
            (Some(r), None) => payload_hash(Some(r)),
        }
    }

    /// Sets the response and its hash together.
    pub fn set_response(&mut self, response: Option<Arc<RawValue>>) {
        self.response_hash = payload_hash(response.as_deref());
        self.response = response;
    }

    /// Whether a verdict is owed to the consumer (it has not acknowledged this one).
    pub fn notice_owed(&self) -> bool {
        self.notice
            .as_ref()
            .is_some_and(|n| self.delivery.delivered_notice.as_deref() != Some(&n.hash()))
    }

    pub fn undelivered(&self) -> bool {
        if self.notice_owed() {
            return true;
        }
        // A refused entry's withdrawn response travels as the refusal, not a revocation.
        if matches!(self.notice, Some(Notice::Refused(_))) {
            return false;
        }
        match (&self.response, &self.response_hash) {
            (None, _) => self.delivery.delivered_hash.is_some(),
            (Some(_), Some(h)) => self.delivery.delivered_hash.as_ref() != Some(h),
            (Some(r), None) => payload_hash(Some(r)) != self.delivery.delivered_hash,
        }
    }
}

impl Entry {
    /// The entry as the status document lists it (docs/protocol.md §5a): the state file's
    /// fields with the request and the response replaced by their SHA-256, so that it
    /// never carries a credential; the delivery error made printable.
    pub fn view(&self, key: &str, principal: bool) -> Value {
        let (origin, need) = key.split_once(':').unwrap_or(("", key));
        let d = &self.delivery;
        serde_json::json!({
            "origin": origin,
            "need": need,
            "principal": principal,
            "request_hash": sha256_hex(self.request.get().as_bytes()),
            "response_hash": self.current_hash(),
            "created_at": self.created_at,
            "requested_at": self.requested_at,
            "absent_since": self.absent_since,
            "awaiting_response": self.awaiting_response,
            "renew": self.renew,
            "undelivered": !principal && self.undelivered(),
            "delivery": {
                "delivered_hash": d.delivered_hash,
                "delivered_at": d.delivered_at,
                "last_error": d.last_error.as_deref().map(|e| fort_core::text::printable(e, 200)),
                "attempts": d.attempts,
            },
        })
    }
}

/// Splits `origin:type/id` into its capability; entries of unknown shape are skipped.
pub fn capability_of(key: &str) -> Option<&str> {
    let (_, need) = key.split_once(':')?;
    need.split_once('/').map(|(t, _)| t)
}
