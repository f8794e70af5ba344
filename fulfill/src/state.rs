//! `fulfillment-state.json` (and its log): per need, where it stands and how asking went.
//! Written only by the agent, through one [`fort_core::store::Store`].

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The file, and the field of the snapshot that holds the needs.
pub const FILE: &str = "fulfillment-state.json";
pub const FIELD: &str = "needs";

/// Where a need stands (docs/protocol.md §11.7).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// Asked for (or about to be); no answer yet, nothing known to be wrong.
    #[default]
    Pending,
    /// Not sent: a need it refers to, or must come after, is not satisfied yet.
    Waiting,
    Satisfied,
    /// The last answer could not be used (a handler, a file, a refusal); asked again.
    Failed,
    /// Satisfied, but the payload expires soon: asked again with `renew`.
    Expiring,
    /// The payload is past its expiry; asked again with `renew`.
    Expired,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Pending => "pending",
            Phase::Waiting => "waiting",
            Phase::Satisfied => "satisfied",
            Phase::Failed => "failed",
            Phase::Expiring => "expiring",
            Phase::Expired => "expired",
        }
    }

    pub const ALL: [Phase; 6] = [
        Phase::Pending,
        Phase::Waiting,
        Phase::Satisfied,
        Phase::Failed,
        Phase::Expiring,
        Phase::Expired,
    ];
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct NeedState {
    /// The provider, kept so a need removed from needs.json can still be released.
    pub from: String,
    /// A payload was applied and nothing has unsatisfied it since (a revocation, a failed
    /// check, a changed request). An expiring need is still satisfied.
    pub satisfied: bool,
    pub satisfied_at: Option<u64>,
    /// Unix seconds of the last request sent.
    pub last_sought: Option<u64>,
    /// SHA-256 of the declared need (provider, request as written, delivery fields);
    /// a change resets everything else.
    pub request_hash: String,
    /// Requests sent since the need was last satisfied.
    pub attempts: u32,
    /// Why the need is not (or no longer) satisfied, in one line; never payload bytes.
    #[serde(alias = "reason")]
    pub last_error: Option<String>,
    #[serde(default)]
    pub phase: Phase,
    /// Unix seconds of the last change of `phase`.
    #[serde(default)]
    pub since: u64,
    /// When the payload stops being valid (a certificate's notAfter, `expires_at`).
    #[serde(default)]
    pub expires_at: Option<u64>,
    /// SHA-256 of the last payload applied.
    #[serde(default)]
    pub payload_sha256: Option<String>,
    /// SHA-256 of the request (references resolved) the provider last accepted.
    #[serde(default)]
    pub sent_sha256: Option<String>,
    /// Files written from the payload: path → SHA-256 of the content. Used to tell an
    /// unchanged payload from a changed one, to find files lost to a reboot (`/run`),
    /// and to remove them when the need goes.
    #[serde(default)]
    pub files: BTreeMap<String, String>,
    /// The payload itself, base64, kept only for needs that other needs refer to: their
    /// requests are built from it, after a restart too. The state directory is the
    /// agent's alone (0700), like the files the payload is written to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload: Option<String>,
    /// Payloads applied since the need was declared, changed or not, and when the last
    /// one came: an operator tells "the provider still answers" from "nothing changed".
    #[serde(default)]
    pub received: u64,
    #[serde(default)]
    pub received_at: Option<u64>,
    /// Callbacks received since the need was declared. A payload applied in the
    /// background records its outcome only if nothing came after it (a revocation, a
    /// refusal, a newer payload).
    #[serde(default)]
    pub seq: u64,
    /// A payload recorded, not yet applied (files, handler): applied in the consumer's
    /// own task, after a restart too. Kept like `payload`, in the agent's own directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inbox: Option<Inbox>,
    /// When a renewal was last asked for (`renew: true`): renewals go out at most once
    /// per nag interval, whatever the provider answers meanwhile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub renewal_sought_at: Option<u64>,
    /// The need's last move to another provider (§11.13): unix seconds, why, and how
    /// many moves since it was first declared; kept across restarts and changes of the
    /// need.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moved_at: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moved_because: Option<String>,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub moves: u64,
    /// The need moved and its new home's payload is not applied yet: its requests ask
    /// for renewal (`renew: true`), so a provider still holding an entry from when it
    /// served the need before issues afresh instead of answering what it held.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub renew_at_home: bool,
    /// The home (`from`) has shown that it serves this need: it answered a request for it
    /// (a signed 2xx) or its payload was applied. Only a confirmed home is named in the
    /// needs list's `served_by` (§11.13): a consumer that lost its state, or has just
    /// moved, must not let another provider conclude that it serves the need elsewhere.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub home_confirmed: bool,
    /// Per key the need declares, the public key and the CSR its requests carry
    /// (§11.10); never a private key.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub keys: BTreeMap<String, crate::keys::KeyRecord>,
    /// Per encrypted file (path), a digest of what was encrypted into it and the
    /// SHA-256 of what was written (§11.3, *Encrypted files*): an unchanged content is
    /// neither encrypted nor written again. Never the content.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub credentials: BTreeMap<String, crate::credentials::CredentialRecord>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// A payload waiting to be applied.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Inbox {
    /// The need's `seq` when it arrived.
    pub seq: u64,
    /// The provider that sent it (`FORT_ORIGIN` for the handler).
    pub from: String,
    /// The payload, base64.
    pub payload: String,
    /// `payload` is the payload encrypted by `systemd-creds` (a need with an encrypted
    /// file), decrypted only to be applied.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub encrypted: bool,
}
