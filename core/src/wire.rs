//! Header names, paths and JSON bodies of the wire protocol (docs/protocol.md §2–§8).

use serde::{Deserialize, Serialize};

pub const H_ORIGIN: &str = "x-fort-origin";
pub const H_TIMESTAMP: &str = "x-fort-timestamp";
pub const H_NONCE: &str = "x-fort-nonce";
pub const H_SIGNATURE: &str = "x-fort-signature";
pub const H_SERVER_TIME: &str = "x-fort-server-time";

pub const CAPABILITIES_PREFIX: &str = "/agent/capabilities/";
pub const NEEDS_PREFIX: &str = "/agent/needs/";
pub const NEEDS_PATH: &str = "/agent/needs";
/// Batched callbacks (§11.8).
pub const CALLBACKS_PATH: &str = "/agent/callbacks";
/// Appended to a capability's path for batched requests (§11.8).
pub const BATCH_SUFFIX: &str = "/batch";

/// Items in one batch at most (§11.8).
pub const MAX_BATCH_ITEMS: usize = 256;
/// A sender stops adding items once a batch body reaches this size, well inside the
/// receiver's 1 MiB body limit; an item that alone is larger goes on its own.
pub const BATCH_BODY_TARGET: usize = 512 * 1024;

/// The one body every `401` carries.
pub const UNAUTHORIZED_BODY: &str = r#"{"error":"unauthorized"}"#;

/// `{"error":"<code>","message":"<text>"}`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ErrorBody {
    pub error: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
}

/// An async-mode request or release (§6.1).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AsyncBody {
    pub need: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub release: bool,
    /// The consumer's payload is about to expire: issue a new one (§11.4).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub renew: bool,
}

/// `POST /agent/capabilities/<capability>/batch` body (§11.8): each item is checked on
/// its own as an [`AsyncBody`], so one bad item does not refuse the others.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RequestBatch {
    pub requests: Vec<serde_json::Value>,
}

/// A batch body, `{"<field>":[<item>,...]}`, written around items that are already JSON
/// (each was sized as encoded when the batch was filled), so nothing is encoded twice.
pub fn batch_body<'a>(field: &str, items: impl Iterator<Item = &'a [u8]> + Clone) -> Vec<u8> {
    let size: usize = items.clone().map(|i| i.len() + 1).sum();
    let mut body = Vec::with_capacity(size + field.len() + 8);
    body.extend_from_slice(b"{\"");
    body.extend_from_slice(field.as_bytes());
    body.extend_from_slice(b"\":[");
    for (i, item) in items.enumerate() {
        if i > 0 {
            body.push(b',');
        }
        body.extend_from_slice(item);
    }
    body.extend_from_slice(b"]}");
    body
}

/// `POST /agent/callbacks` body (§11.8).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CallbackBatch {
    pub callbacks: Vec<CallbackItem>,
}

/// One callback of a batch: the payload bytes of §7 as text (they are always UTF-8: a
/// string's content or compact JSON; empty is a revocation), or a handler's verdict
/// (§11.9). Exactly one of the three is present.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CallbackItem {
    pub need: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending: Option<String>,
}

/// What a callback carries to a need (§7, §11.9).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delivered<'a> {
    /// Payload bytes; empty is a revocation.
    Payload(&'a [u8]),
    /// The provider's handler refused the need's request, and why.
    Refused(&'a str),
    /// The provider is working on it, and on what.
    Pending(&'a str),
}

impl CallbackItem {
    /// What the item carries; `None` unless exactly one of payload, refused, pending.
    pub fn delivered(&self) -> Option<Delivered<'_>> {
        match (&self.payload, &self.refused, &self.pending) {
            (Some(p), None, None) => Some(Delivered::Payload(p.as_bytes())),
            (None, Some(r), None) => Some(Delivered::Refused(r)),
            (None, None, Some(r)) => Some(Delivered::Pending(r)),
            _ => None,
        }
    }
}

/// The `202` body of an async request (§6.1); it carries the entry's verdict when it holds
/// one for exactly this request (§11.9).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Accepted {
    pub status: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending: Option<String>,
}

/// The reply to either batch: one result per item, in the items' order.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BatchResults {
    pub results: Vec<ItemResult>,
}

/// What the single endpoint would have answered for this item: its status, its JSON
/// body and its `Retry-After`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ItemResult {
    pub status: u16,
    pub body: serde_json::Value,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<u64>,
}

/// `/agent/needs` reply (§8).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct NeedsList {
    pub needs: Vec<String>,
    /// Per need that names several providers, the one serving it (§11.13). Left out when
    /// empty: a host whose needs each name one provider answers as before.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub served_by: std::collections::BTreeMap<String, String>,
}

/// Callback reply (§7).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CallbackReply {
    pub need: String,
    pub satisfied: bool,
    /// Recorded, and still being applied (files, the need's handler) when the reply was
    /// sent; the outcome shows in the need's state.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub applying: bool,
}

/// Payload bytes for a provider response value (§7): a JSON string travels as its
/// content, anything else as compact JSON.
pub fn payload_bytes(value: &serde_json::Value) -> Vec<u8> {
    match value {
        serde_json::Value::String(s) => s.as_bytes().to_vec(),
        other => serde_json::to_vec(other).expect("JSON value serialises"),
    }
}

/// Payload bytes for a response kept as JSON text: the same bytes as [`payload_bytes`]
/// gives for the parsed value.
pub fn payload_bytes_raw(raw: &serde_json::value::RawValue) -> Vec<u8> {
    let text = raw.get();
    if text.starts_with('"') {
        if let Ok(s) = serde_json::from_str::<String>(text) {
            return s.into_bytes();
        }
    }
    // Compact already: it was written by serde_json from a value.
    text.as_bytes().to_vec()
}

/// How deeply a stored request may nest. serde_json refuses to parse past 128 levels; a
/// request must stay far below that once it sits inside a state file (entry, map, file),
/// or a caller could make the provider's own state unreadable.
pub const MAX_REQUEST_DEPTH: usize = 32;

/// The nesting depth of a JSON value (a scalar is 1, `{"a":[1]}` is 3), computed without
/// recursion so a hostile value cannot exhaust the stack.
pub fn json_depth(v: &serde_json::Value) -> usize {
    let mut deepest = 0;
    let mut stack = vec![(v, 1usize)];
    while let Some((v, d)) = stack.pop() {
        deepest = deepest.max(d);
        match v {
            serde_json::Value::Object(m) => stack.extend(m.values().map(|c| (c, d + 1))),
            serde_json::Value::Array(a) => stack.extend(a.iter().map(|c| (c, d + 1))),
            _ => {}
        }
    }
    deepest
}

/// Current unix time in whole seconds.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depth() {
        assert_eq!(json_depth(&serde_json::json!(1)), 1);
        assert_eq!(json_depth(&serde_json::json!({"a": [1]})), 3);
        let mut v = serde_json::json!(0);
        for _ in 0..1000 {
            v = serde_json::json!([v]);
        }
        assert_eq!(json_depth(&v), 1001);
    }

    #[test]
    fn payloads() {
        assert_eq!(
            payload_bytes(&serde_json::json!("-----BEGIN")),
            b"-----BEGIN"
        );
        assert_eq!(payload_bytes(&serde_json::json!({"a": 1})), br#"{"a":1}"#);
        for v in [
            serde_json::json!("pem\n\"x\""),
            serde_json::json!({"a": [1, "b"]}),
        ] {
            let raw = serde_json::value::to_raw_value(&v).unwrap();
            assert_eq!(payload_bytes_raw(&raw), payload_bytes(&v));
        }
    }
}
