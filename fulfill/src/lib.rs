//! The consumer side (docs/protocol.md §6, §7, §10): the needs this host declares, their
//! fulfilment state, the nag scheduler that asks providers, and callback handling.
//! One in-process owner keeps the state; callbacks and the scheduler both go through it.

mod apply;
mod ask;
mod batch;
mod certs;
pub mod credentials;
mod deliver;
pub mod expiry;
pub mod files;
mod fulfiller;
mod home;
pub mod keys;
mod preview;
mod reload;
mod request;
mod safe_path;
mod schedule;
pub mod sealing;
pub mod state;
mod status;
mod swap;
pub mod templates;
mod units;
mod wireguard_key;

pub use fulfiller::{DeliverError, FulfillOptions, Fulfiller};
pub use home::LastMove;
pub use preview::{NeedChange, NeedFile, NeedsPreview};
pub use state::Phase;
pub use status::NeedStatus;
