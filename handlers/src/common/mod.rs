//! What every capability shares: the entries in and answers out, the names a caller may
//! claim, the fleet registry, the handler's own state file and its config, and running
//! one entry's backend work so that its failure stays its own.

pub mod allow;
pub mod config;
pub mod entries;
pub mod files;
pub mod hosts;
pub mod isolate;
pub mod state;

pub use allow::Allowances;
pub use entries::{parse_input, Answer, Entry, Output, Trigger};
