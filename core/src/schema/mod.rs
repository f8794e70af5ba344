//! Typed models of `/etc/fort/hosts.json`, `needs.json` and `capabilities.json`
//! (docs/protocol.md §10, §11). Unknown fields are errors, reported with the file and
//! field path; everything a later stage relies on (names, addresses, keys, references,
//! schemas) is checked here, once, at load.

mod capabilities;
mod encrypted;
mod hosts;
pub mod keys;
mod needs;
pub mod refs;
pub mod templates;

use std::path::Path;

pub use capabilities::{
    capabilities_from_bytes, load_capabilities, validate_capabilities, Capabilities,
    CapabilitySpec, Mode, RequestSchema, Triggers,
};
pub use encrypted::CredentialKey;
pub use hosts::{
    is_address, is_plaintext_address, HostEntry, HostsFile, Peer, PeerKind, PrincipalEntry,
    Registry,
};
pub use needs::{
    load_needs, needs_from_bytes, validate_needs, FileSpec, NeedSpec, Needs, Providers,
    MAX_PROVIDERS,
};
pub use templates::{templates_from_bytes, TemplateSpec, Templates};

/// Capabilities every agent serves itself; a user capability may not take these names.
pub const BUILTIN_CAPABILITIES: [&str; 8] = [
    "status", "manifest", "needs", "journal", "systemd", "trigger", "resend", "audit",
];

/// A configuration file that cannot be used, with enough context to fix it.
#[derive(Debug, thiserror::Error)]
pub enum SchemaError {
    // Not a `#[source]`: the message already carries it, and chains of causes
    // (anyhow's `{:#}`) would print it twice.
    #[error("{file}: cannot read: {error}")]
    Read { file: String, error: std::io::Error },
    #[error("{file}: at `{path}`: {message}")]
    Parse {
        file: String,
        path: String,
        message: String,
    },
    #[error("{file}: {message}")]
    Invalid { file: String, message: String },
}

pub(crate) fn invalid(file: &Path, message: String) -> SchemaError {
    SchemaError::Invalid {
        file: file.display().to_string(),
        message,
    }
}

/// Parses JSON with serde, naming the failing field path (`hosts.forge.adress`).
pub fn parse_json<T: serde::de::DeserializeOwned>(
    file: &Path,
    bytes: &[u8],
) -> Result<T, SchemaError> {
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(de).map_err(|e| SchemaError::Parse {
        file: file.display().to_string(),
        path: e.path().to_string(),
        message: e.inner().to_string(),
    })
}

pub(crate) fn read(file: &Path) -> Result<Vec<u8>, SchemaError> {
    std::fs::read(file).map_err(|error| SchemaError::Read {
        file: file.display().to_string(),
        error,
    })
}
