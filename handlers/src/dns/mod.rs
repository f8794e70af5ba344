//! A DNS dynamic update client (RFC 2136) signed with TSIG (RFC 8945), on hickory: the
//! record sets fort manages, the key, and one connection to a zone's primary. The
//! `dns-record` capability builds on it, and ACME DNS-01 validation uses its TXT API
//! (`Primary::set_txt`, `delete_txt`, `answers_txt`).

pub mod key;
pub mod name;
pub mod primary;
pub mod record;

pub use key::{Algorithm, TsigKey};
pub use name::DnsName;
pub use primary::{DnsError, Outcome, Primary, Server, Update};
pub use record::{Kind, RecordSet};
