//! Everything two fort programs must agree on: names, wire types, canonical signing bytes,
//! SSHSIG signing and verification, the `/etc/fort/*.json` schemas and a signed client;
//! plus the runtime pieces every crate shares (durable state files, the subprocess helper).

pub mod accounts;
pub mod audit;
pub mod canonical;
pub mod client;
pub mod compat;
pub mod crash;
pub mod fsx;
pub mod names;
pub mod process;
pub mod schema;
pub mod sealed;
pub mod sign;
pub mod store;
pub mod text;
pub mod tls;
pub mod wire;

/// The crate version, reported by the `status` capability and `--version`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
