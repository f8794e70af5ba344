//! Who can cause each kind of record, and so within which budget it is written
//! (docs/protocol.md §12.2a): this host's own events, and those a remote party's request,
//! callback or call causes, each kind with its budget per origin.

/// An event this host records on its own account (a start, a reload, a checkpoint): no
/// remote party's request or callback can cause it.
#[derive(Debug, Clone, Copy, Default)]
pub struct Own;

/// An event a remote party can cause (its request, its callback, its operator call):
/// recorded only through [`Audit::record_caused_by`], within that party's budget for the
/// kind, so that no kind, this one or one added later, can be recorded past it.
#[derive(Debug, Clone, Copy, Default)]
pub struct Caused;

/// The kinds of [`Own`] events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OwnKind {
    Start,
    Stop,
    Reload,
    ReloadRefused,
    Checkpoint,
    TornTail,
    Lost,
    Suppressed,
    /// Consumer side: a need no longer declared was released.
    Released,
}

impl OwnKind {
    pub const ALL: [OwnKind; 9] = [
        OwnKind::Start,
        OwnKind::Stop,
        OwnKind::Reload,
        OwnKind::ReloadRefused,
        OwnKind::Checkpoint,
        OwnKind::TornTail,
        OwnKind::Lost,
        OwnKind::Suppressed,
        OwnKind::Released,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            OwnKind::Start => "start",
            OwnKind::Stop => "stop",
            OwnKind::Reload => "reload",
            OwnKind::ReloadRefused => "reload_refused",
            OwnKind::Checkpoint => "checkpoint",
            OwnKind::TornTail => "torn_tail",
            OwnKind::Lost => "lost",
            OwnKind::Suppressed => "suppressed",
            OwnKind::Released => "released",
        }
    }
}

/// The kinds of [`Caused`] events, each with the budget of its records per origin. The
/// match in [`CausedKind::budget`] is exhaustive: a kind added here says its budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CausedKind {
    /// Provider: a request stored for its entry (origin: the caller).
    Accepted,
    /// Provider: a request refused before it reached an entry (origin: the caller).
    Denied,
    /// Every host: an operator call answered (origin: the caller, `local` on the socket).
    Operator,
    /// Every host: an operator call refused (403, 400): recorded without its parameters.
    OperatorRefused,
    /// Provider, per entry (origin: the entry's consumer): what a run did to it, what GC
    /// did, what the consumer acknowledged or released.
    Kept,
    Issued,
    Renewed,
    Refused,
    Pending,
    Revoked,
    Released,
    Collected,
    Delivered,
    VerdictDelivered,
    RevocationDelivered,
    /// Consumer, per need (origin: the provider whose callback it was).
    Applied,
    ApplyFailed,
    NeedRefused,
    NeedRevoked,
    Witnessed,
}

impl CausedKind {
    pub const ALL: [CausedKind; 20] = [
        CausedKind::Accepted,
        CausedKind::Denied,
        CausedKind::Operator,
        CausedKind::OperatorRefused,
        CausedKind::Kept,
        CausedKind::Issued,
        CausedKind::Renewed,
        CausedKind::Refused,
        CausedKind::Pending,
        CausedKind::Revoked,
        CausedKind::Released,
        CausedKind::Collected,
        CausedKind::Delivered,
        CausedKind::VerdictDelivered,
        CausedKind::RevocationDelivered,
        CausedKind::Applied,
        CausedKind::ApplyFailed,
        CausedKind::NeedRefused,
        CausedKind::NeedRevoked,
        CausedKind::Witnessed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            CausedKind::Accepted => "accepted",
            CausedKind::Denied => "denied",
            CausedKind::Operator | CausedKind::OperatorRefused => "operator",
            CausedKind::Kept => "kept",
            CausedKind::Issued => "issued",
            CausedKind::Renewed => "renewed",
            CausedKind::Refused | CausedKind::NeedRefused => "refused",
            CausedKind::Pending => "pending",
            CausedKind::Revoked | CausedKind::NeedRevoked => "revoked",
            CausedKind::Released => "released",
            CausedKind::Collected => "collected",
            CausedKind::Delivered => "delivered",
            CausedKind::VerdictDelivered => "verdict_delivered",
            CausedKind::RevocationDelivered => "revocation_delivered",
            CausedKind::Applied => "applied",
            CausedKind::ApplyFailed => "apply_failed",
            CausedKind::Witnessed => "witnessed",
        }
    }

    /// How many records of this kind one origin may cause.
    pub fn budget(self) -> Budget {
        match self {
            CausedKind::Accepted => ACCEPTED_BUDGET,
            CausedKind::Denied | CausedKind::OperatorRefused => DENIED_BUDGET,
            CausedKind::Operator => OPERATOR_BUDGET,
            CausedKind::Kept
            | CausedKind::Issued
            | CausedKind::Renewed
            | CausedKind::Refused
            | CausedKind::Pending
            | CausedKind::Revoked
            | CausedKind::Released
            | CausedKind::Collected
            | CausedKind::Delivered
            | CausedKind::VerdictDelivered
            | CausedKind::RevocationDelivered => ENTRY_BUDGET,
            CausedKind::Applied
            | CausedKind::ApplyFailed
            | CausedKind::NeedRefused
            | CausedKind::NeedRevoked => CALLBACK_BUDGET,
            CausedKind::Witnessed => WITNESSED_BUDGET,
        }
    }
}

/// How many records of one kind one remote caller may cause: a burst of `burst`, then
/// `per_minute`. Past it they are counted, and the count is recorded (`suppressed`)
/// with the caller's next record that fits: a hostile caller cannot push the rest of
/// the trail out of its bounded files, nor other callers' records out of the queue.
#[derive(Debug, Clone, Copy)]
pub struct Budget {
    pub burst: u32,
    pub per_minute: u32,
}

/// Refused requests (`denied`): a caller that keeps asking for what it may not have.
pub const DENIED_BUDGET: Budget = Budget {
    burst: 64,
    per_minute: 64,
};

/// Requests stored (`accepted`): a host's whole fleet of needs at once, then the pace of
/// a caller that changes its requests all the time.
pub const ACCEPTED_BUDGET: Budget = Budget {
    burst: 4096,
    per_minute: 1024,
};

/// Operator calls answered: a script polling a fleet's status with entries, a burst of
/// rotations; more is a caller writing the trail, not reading the host.
pub const OPERATOR_BUDGET: Budget = Budget {
    burst: 256,
    per_minute: 120,
};

/// What runs, GC and deliveries record about one consumer's entries: a host's whole
/// fleet of needs at once, then the pace of a caller that changes its requests all the
/// time.
pub const ENTRY_BUDGET: Budget = Budget {
    burst: 4096,
    per_minute: 1024,
};

/// What one provider's callbacks make a consumer record (applied, refused, revoked).
pub const CALLBACK_BUDGET: Budget = Budget {
    burst: 1024,
    per_minute: 256,
};

/// Checkpoints one provider's callbacks have witnessed (`witnessed`): its checkpoints
/// come every few minutes and at each full file, so more is a provider making them up.
pub const WITNESSED_BUDGET: Budget = Budget {
    burst: 32,
    per_minute: 12,
};
