//! Loading a capability's config file (JSON, written by the NixOS module): unknown fields
//! are errors that name the field's path, and secrets are read from the files the config
//! names, never from the config itself.

use std::path::Path;

use serde::de::DeserializeOwned;

/// Reads and parses `path` as `T`; the error names the file and the field path.
pub fn load<T: DeserializeOwned>(path: &Path) -> anyhow::Result<T> {
    let bytes = std::fs::read(path)
        .map_err(|e| anyhow::anyhow!("cannot read the config {}: {e}", path.display()))?;
    let de = &mut serde_json::Deserializer::from_slice(&bytes);
    serde_path_to_error::deserialize(de)
        .map_err(|e| anyhow::anyhow!("{}: at {}: {}", path.display(), e.path(), e.inner()))
}

/// A secret from a file (a token, a password, a TSIG key): trailing newlines trimmed, an
/// empty file refused. The value is never logged.
pub fn read_secret(path: &Path) -> anyhow::Result<String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("cannot read the secret file {}: {e}", path.display()))?;
    let secret = text.trim_end_matches(['\n', '\r']).to_owned();
    if secret.is_empty() {
        anyhow::bail!("the secret file {} is empty", path.display());
    }
    Ok(secret)
}
