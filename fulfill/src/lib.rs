//! The consumer side (PROTOCOL.md §6, §7, §10): the needs this host declares, their
//! fulfilment state, the nag scheduler that asks providers, and callback handling.
//! One in-process owner keeps the state; callbacks and the scheduler both go through it.

mod fulfiller;
mod schedule;
pub mod state;

pub use fulfiller::{DeliverError, FulfillOptions, Fulfiller, NeedStatus};
