//! `fulfillment-state.json` (and its log): per need, whether it is satisfied and how
//! asking went. Written only by the agent, through one [`fort_core::store::Store`].

use serde::{Deserialize, Serialize};

/// The file, and the field of the snapshot that holds the needs.
pub const FILE: &str = "fulfillment-state.json";
pub const FIELD: &str = "needs";

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NeedState {
    /// The provider, kept so a need removed from needs.json can still be released.
    pub from: String,
    pub satisfied: bool,
    pub satisfied_at: Option<u64>,
    /// Unix seconds of the last request sent.
    pub last_sought: Option<u64>,
    /// SHA-256 of the canonical request JSON; a change resets satisfaction.
    pub request_hash: String,
    /// Requests sent since the need was last satisfied.
    pub attempts: u32,
    pub last_error: Option<String>,
}
