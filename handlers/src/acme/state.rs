//! What the `acme` handler keeps between runs (its state file, 0600, replaced
//! atomically): the ACME account with its key, and per entry the certificate issued, the
//! order under way with the challenge answers it published (so they are removed, and only
//! they), and the back-off after a failure.

use std::collections::BTreeMap;

use instant_acme::AccountCredentials;
use serde::{Deserialize, Serialize};

pub const STATE_VERSION: u32 = 1;

#[derive(Default, Serialize, Deserialize)]
pub struct State {
    /// The account, for the directory it was made at.
    #[serde(default)]
    pub account: Option<AccountRecord>,
    #[serde(default)]
    pub entries: BTreeMap<String, EntryState>,
    /// Challenge answers of orders that ended, still to be removed (kept until they are).
    #[serde(default)]
    pub orphans: Vec<Published>,
}

#[derive(Serialize, Deserialize)]
pub struct AccountRecord {
    pub directory: String,
    /// instant-acme's credentials: the account URL and its private key (PKCS#8).
    pub credentials: AccountCredentials,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct EntryState {
    /// The certificate the entry holds (the last one issued).
    #[serde(default)]
    pub issued: Option<Issued>,
    /// The order under way.
    #[serde(default)]
    pub order: Option<OrderRecord>,
    /// After a failure: no order before `until` (unix seconds).
    #[serde(default)]
    pub backoff: Option<Backoff>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Issued {
    /// SHA-256 of the CSR it was issued for, and its names.
    pub csr_sha256: String,
    pub names: Vec<String>,
    pub certificate: String,
    pub chain: String,
    pub not_after: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OrderRecord {
    pub url: String,
    pub csr_sha256: String,
    pub names: Vec<String>,
    /// Unix seconds.
    pub placed_at: u64,
    /// Challenge answers published for it, removed when the order ends.
    pub published: Vec<Published>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "snake_case")]
pub enum Published {
    /// `<webroot>/.well-known/acme-challenge/<token>`.
    HttpFile { token: String },
    /// A TXT value at `_acme-challenge.<name>`.
    DnsTxt { name: String, value: String },
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Backoff {
    pub until: u64,
    pub failures: u32,
    pub reason: String,
    /// A refusal (the CA will not issue for this request) rather than a wait.
    #[serde(default)]
    pub refused: bool,
    /// The CSR it applies to: a new CSR is tried at once.
    pub csr_sha256: String,
}
