//! Built-in operator rpc handlers (`journal`, `systemd`): strict parameter checking and
//! the exact command line they run. The example capability handlers used by the demo
//! and the tests live in `handlers/examples/` as short scripts users can copy.

pub mod examples;
pub mod journal;
pub mod systemd;

/// A bad parameter, reported to the caller as 400.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{0}")]
pub struct ParamError(pub String);

pub use fort_core::names::is_unit_name;
