//! What the backup-repo handler remembers between runs: every repository it made, the
//! key that reaches it, and, once released, since when its data is kept.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The version of the state document; a later release upgrades from it.
pub const VERSION: u32 = 1;

#[derive(Debug, Default, Serialize, Deserialize)]
pub struct State {
    /// Entry key → its repository, reachable or kept after its release.
    pub repos: BTreeMap<String, Repo>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Repo {
    /// The directory it made (`<repositories_dir>/<origin>/<need id>`): the only one it
    /// ever removes.
    pub path: PathBuf,
    /// The key that reaches it, `<type> <base64>`.
    pub key: String,
    /// When that key was authorized (or last renewed): `expires_at` counts from it.
    pub key_since: u64,
    /// Its storage quota in bytes.
    pub quota: u64,
    pub append_only: bool,
    /// Since when it is released: no key reaches it, and its data is removed once the
    /// retention has passed from then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released_at: Option<u64>,
}

impl State {
    /// The repositories a key reaches now, in entry key order.
    pub fn reachable(&self) -> impl Iterator<Item = (&String, &Repo)> {
        self.repos.iter().filter(|(_, r)| r.released_at.is_none())
    }
}
