//! `fulfillment-state.json`: per need, whether it is satisfied and how asking went.
//! Written only by the agent, through one [`fort_core::durable::Durable`] owner.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub const STATE_VERSION: u32 = 1;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FulfillState {
    pub version: u32,
    pub needs: BTreeMap<String, NeedState>,
}

impl Default for FulfillState {
    fn default() -> Self {
        FulfillState {
            version: STATE_VERSION,
            needs: BTreeMap::new(),
        }
    }
}

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
