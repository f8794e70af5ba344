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

/// `^[A-Za-z0-9@._:\\-]{1,255}$`, not starting with `-` (so it can never be an option),
/// and ending in a known unit suffix when it has a dot.
pub fn is_unit_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 255
        && !s.starts_with('-')
        && !s.starts_with('.')
        && s.bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"@._:-".contains(&c))
}
