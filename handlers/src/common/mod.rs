//! What every capability shares: the entries in and answers out, the names a caller may
//! claim, the fleet registry, the handler's own state file and its config.

pub mod allow;
pub mod config;
pub mod entries;
pub mod hosts;
pub mod state;

pub use allow::Allowances;
pub use entries::{parse_input, Answer, Entry, Output, Trigger};
