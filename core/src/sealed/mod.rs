//! State files sealed with the state key (docs/at-rest.md): XChaCha20-Poly1305 over the
//! file's plain bytes, with the format label and the file's absolute path as associated
//! data, in a JSON envelope whose `version` (1000) every release before sealing refuses by
//! name instead of misreading.
//!
//! Sealing is a layer around a file's own format: [`read`] gives back the plain bytes
//! whether the file was sealed or not, and says which; [`write`] seals when there is a key.

use std::path::{Path, PathBuf};

use base64::Engine;
use chacha20poly1305::aead::{Aead, AeadCore, KeyInit, OsRng, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use zeroize::Zeroizing;

use crate::compat;

/// The envelope's `version`: above every version of any plain fort state format.
pub const ENVELOPE_VERSION: u64 = 1000;
/// The envelope's `sealed`: how the rest of it is to be read.
pub const FORMAT: &str = "fort-sealed-1";
/// Where a handler finds the path of the state key (set by the agent that runs it).
pub const KEY_FILE_ENV: &str = "FORT_STATE_KEY_FILE";
/// Where a handler notes the sealed files it keeps (set by the agent that runs it to
/// `<state_dir>/sealed-files`): rotation and the start's check find them there, also
/// those outside the state directory (an SSH CA key, a handler state file kept
/// elsewhere).
pub const REGISTRY_ENV: &str = "FORT_SEALED_FILES";
/// The registry's name in the state directory: one absolute path per line.
pub const REGISTRY_FILE: &str = "sealed-files";
mod registry;
pub use registry::{note, noted, sealed_files};

/// The credential name the agent looks for in `$CREDENTIALS_DIRECTORY`.
pub const CREDENTIAL_NAME: &str = "state-key";

/// Every sealed file starts so; a plain state file never does (no plain format uses
/// version 1000), so telling them apart costs a prefix comparison, not a parse.
const PREFIX: &[u8] = b"{\"version\":1000,";

/// Why a state file could not be opened. Each names the file and the way on.
#[derive(Debug, thiserror::Error)]
pub enum SealError {
    #[error("{file}: {source}")]
    Io {
        file: String,
        source: std::io::Error,
    },
    #[error("{file} is sealed with the state key {found}, and this process has no state key. Nothing was read or changed: give the agent its key (state_key_file in agent.toml, or the credential {CREDENTIAL_NAME}), or move the file aside to start without it (the provider then issues again what its consumers need)")]
    NoKey { file: String, found: String },
    #[error("{file} is sealed with the state key {found}, not with this one ({ours}): the key was lost or replaced. Nothing was read or changed: put the key it was sealed with back, or move the file aside to start without it (the provider then issues again what its consumers need)")]
    OtherKey {
        file: String,
        found: String,
        ours: String,
    },
    #[error("{file}: authentication of the sealed contents failed: the file was changed or damaged (or moved from another path). Nothing of it was read, and nothing was changed: restore it from a backup, or move it aside to start without it")]
    Tampered { file: String },
    #[error("{file}: a sealed file this release cannot read ({detail}); written by {written_by}. Nothing was changed")]
    Unreadable {
        file: String,
        detail: String,
        written_by: String,
    },
}

/// The key that seals state files: 32 bytes, kept out of logs and wiped when dropped.
pub struct StateKey {
    key: Zeroizing<[u8; 32]>,
    id: String,
    source: PathBuf,
}

impl std::fmt::Debug for StateKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateKey")
            .field("id", &self.id)
            .field("source", &self.source)
            .finish_non_exhaustive()
    }
}

#[derive(Serialize, Deserialize)]
struct Envelope {
    version: u64,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    written_by: String,
    sealed: String,
    key_id: String,
    nonce: String,
    data: String,
}

impl StateKey {
    /// Reads a key file: the 32 bytes, or 64 hex digits (a trailing newline allowed).
    pub fn load(path: &Path) -> Result<StateKey, String> {
        let shown = path.display();
        let bytes = Zeroizing::new(
            std::fs::read(path).map_err(|e| format!("cannot read the state key {shown}: {e}"))?,
        );
        let mut key = Zeroizing::new([0u8; 32]);
        if bytes.len() == 32 {
            key.copy_from_slice(&bytes);
        } else {
            let text = std::str::from_utf8(&bytes)
                .ok()
                .map(|t| t.trim_end_matches(['\n', '\r']))
                .filter(|t| t.len() == 64)
                .ok_or_else(|| {
                    format!(
                        "the state key {shown} is {} bytes: it must be 32 bytes, or 64 hex digits (make one with `fort-agent state-key new FILE`)",
                        bytes.len()
                    )
                })?;
            hex::decode_to_slice(text, &mut key[..])
                .map_err(|_| format!("the state key {shown} is not 64 hex digits"))?;
        }
        Ok(StateKey::from_bytes(key, path))
    }

    pub fn from_bytes(key: Zeroizing<[u8; 32]>, source: &Path) -> StateKey {
        let mut h = Sha256::new();
        h.update(b"fort state key id\0");
        h.update(&key[..]);
        let id = hex::encode(&h.finalize()[..8]);
        StateKey {
            key,
            id,
            source: source.to_owned(),
        }
    }

    /// 32 fresh random bytes, as 64 hex digits and a newline (what a key file holds).
    pub fn generate_hex() -> Zeroizing<String> {
        let key = XChaCha20Poly1305::generate_key(&mut OsRng);
        Zeroizing::new(format!("{}\n", hex::encode(key.as_slice())))
    }

    /// Who the key is, without revealing it.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The file the key was read from.
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// The envelope holding `plain`, sealed for the file at `path`.
    pub fn seal(&self, path: &Path, plain: &[u8]) -> Vec<u8> {
        let cipher = XChaCha20Poly1305::new(self.key.as_slice().into());
        let nonce = XChaCha20Poly1305::generate_nonce(&mut OsRng);
        let aad = associated_data(path);
        let data = cipher
            .encrypt(
                &nonce,
                Payload {
                    msg: plain,
                    aad: &aad,
                },
            )
            .expect("XChaCha20-Poly1305 seals any length a file can have");
        let b64 = base64::engine::general_purpose::STANDARD;
        let env = Envelope {
            version: ENVELOPE_VERSION,
            written_by: compat::writer(),
            sealed: FORMAT.to_owned(),
            key_id: self.id.clone(),
            nonce: b64.encode(nonce),
            data: b64.encode(data),
        };
        let out = serde_json::to_vec(&env).expect("the envelope serialises");
        debug_assert!(out.starts_with(PREFIX));
        out
    }

    /// The plain bytes of a sealed file's contents `bytes`, read from `path`.
    pub fn open(&self, path: &Path, bytes: &[u8]) -> Result<Zeroizing<Vec<u8>>, SealError> {
        let file = path.display().to_string();
        let env = envelope(path, bytes)?;
        if env.key_id != self.id {
            return Err(SealError::OtherKey {
                file,
                found: env.key_id,
                ours: self.id.clone(),
            });
        }
        let b64 = base64::engine::general_purpose::STANDARD;
        let unreadable = |detail: &str| SealError::Unreadable {
            file: file.clone(),
            detail: detail.to_owned(),
            written_by: env.written_by.clone(),
        };
        let nonce = b64
            .decode(&env.nonce)
            .ok()
            .filter(|n| n.len() == 24)
            .ok_or_else(|| unreadable("nonce: not 24 bytes of base64"))?;
        let data = b64
            .decode(&env.data)
            .map_err(|_| unreadable("data: not base64"))?;
        let cipher = XChaCha20Poly1305::new(self.key.as_slice().into());
        let aad = associated_data(path);
        cipher
            .decrypt(
                XNonce::from_slice(&nonce),
                Payload {
                    msg: &data,
                    aad: &aad,
                },
            )
            .map(Zeroizing::new)
            .map_err(|_| SealError::Tampered { file })
    }
}

/// The label of a value sealed alone inside a file that is otherwise plain (a provider
/// entry's cached response, docs/at-rest.md).
pub const VALUE_FORMAT: &str = "fort-sealed-value-1";

/// Seals and opens values inside one file, each bound to that file and to what it belongs
/// to there (its `context`: an entry's key and hash), so that a sealed value copied to
/// another entry, or another file, does not open. Made once per file: the file's part of
/// the associated data and the cipher's key schedule are computed once, not per value.
pub struct ValueSealer {
    cipher: XChaCha20Poly1305,
    aad_prefix: Vec<u8>,
    key_id: String,
}

impl StateKey {
    /// A [`ValueSealer`] for values inside the file at `path`.
    pub fn value_sealer(&self, path: &Path) -> ValueSealer {
        use std::os::unix::ffi::OsStrExt;
        let abs = std::path::absolute(path).unwrap_or_else(|_| path.to_owned());
        let mut aad_prefix = Vec::new();
        aad_prefix.extend_from_slice(VALUE_FORMAT.as_bytes());
        aad_prefix.push(0);
        push_part(&mut aad_prefix, abs.as_os_str().as_bytes());
        ValueSealer {
            cipher: XChaCha20Poly1305::new(self.key.as_slice().into()),
            aad_prefix,
            key_id: self.id.clone(),
        }
    }
}

/// Appends one length-prefixed part: no choice of parts can make two contexts' bytes equal.
fn push_part(out: &mut Vec<u8>, part: &[u8]) {
    out.extend_from_slice(&(part.len() as u64).to_be_bytes());
    out.extend_from_slice(part);
}

impl ValueSealer {
    /// The id of the key it seals with.
    pub fn key_id(&self) -> &str {
        &self.key_id
    }

    fn aad(&self, context: &[&str]) -> Vec<u8> {
        let mut aad = self.aad_prefix.clone();
        for part in context {
            push_part(&mut aad, part.as_bytes());
        }
        aad
    }

    /// `plain` sealed for `context`: base64 of a random 192-bit nonce and the ciphertext.
    pub fn seal(&self, context: &[&str], plain: &[u8]) -> String {
        let nonce = XChaCha20Poly1305::generate_nonce(&mut OsRng);
        let aad = self.aad(context);
        let data = self
            .cipher
            .encrypt(
                &nonce,
                Payload {
                    msg: plain,
                    aad: &aad,
                },
            )
            .expect("XChaCha20-Poly1305 seals any length a value can have");
        let mut out = Vec::with_capacity(nonce.len() + data.len());
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&data);
        base64::engine::general_purpose::STANDARD.encode(out)
    }

    /// The plain bytes of `sealed`, if it was sealed with this key for this file and
    /// `context` and nothing of it changed.
    pub fn open(&self, context: &[&str], sealed: &str) -> Option<Zeroizing<Vec<u8>>> {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(sealed)
            .ok()?;
        if bytes.len() < 24 {
            return None;
        }
        let (nonce, data) = bytes.split_at(24);
        let aad = self.aad(context);
        self.cipher
            .decrypt(
                XNonce::from_slice(nonce),
                Payload {
                    msg: data,
                    aad: &aad,
                },
            )
            .ok()
            .map(Zeroizing::new)
    }
}

/// `fort-sealed-1\0` and the file's absolute path: a sealed file only opens where it was
/// written, under the format it was written in.
fn associated_data(path: &Path) -> Vec<u8> {
    use std::os::unix::ffi::OsStrExt;
    let abs = std::path::absolute(path).unwrap_or_else(|_| path.to_owned());
    let mut aad = Vec::with_capacity(FORMAT.len() + 1 + abs.as_os_str().len());
    aad.extend_from_slice(FORMAT.as_bytes());
    aad.push(0);
    aad.extend_from_slice(abs.as_os_str().as_bytes());
    aad
}

/// Whether file contents are a sealed envelope (or claim to be one): as written, or with
/// its members reordered by a tool (which must not make it pass for a plain file).
pub fn is_sealed(bytes: &[u8]) -> bool {
    if bytes.starts_with(PREFIX) {
        return true;
    }
    #[derive(Deserialize)]
    struct Probe {
        sealed: Option<serde::de::IgnoredAny>,
    }
    memchr::memmem::find(bytes, FORMAT.as_bytes()).is_some()
        && serde_json::from_slice::<Probe>(bytes).is_ok_and(|p| p.sealed.is_some())
}

/// The key a sealed file's contents name, or `None` for a plain file.
pub fn key_id_of(bytes: &[u8]) -> Option<String> {
    if !is_sealed(bytes) {
        return None;
    }
    serde_json::from_slice::<Envelope>(bytes)
        .ok()
        .map(|e| e.key_id)
}

fn envelope(path: &Path, bytes: &[u8]) -> Result<Envelope, SealError> {
    let file = path.display().to_string();
    let doc: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(bytes).map_err(|e| SealError::Unreadable {
            file: file.clone(),
            detail: format!("does not parse: {e}"),
            written_by: "an unknown release".to_owned(),
        })?;
    let written_by = compat::written_by(&doc);
    let env: Envelope = serde_json::from_value(serde_json::Value::Object(doc)).map_err(|e| {
        SealError::Unreadable {
            file: file.clone(),
            detail: e.to_string(),
            written_by: written_by.clone(),
        }
    })?;
    if env.sealed != FORMAT {
        return Err(SealError::Unreadable {
            file,
            detail: format!("sealed: {:?}; this release reads {FORMAT:?}", env.sealed),
            written_by,
        });
    }
    Ok(env)
}

/// What [`read`] found.
pub struct Read {
    pub plain: Zeroizing<Vec<u8>>,
    /// The file was plain: a writer with a key seals it.
    pub was_plain: bool,
}

/// The plain contents of the file at `path`, sealed or not; `None` when there is none.
pub fn read(path: &Path, key: Option<&StateKey>) -> Result<Option<Read>, SealError> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(SealError::Io {
                file: path.display().to_string(),
                source,
            })
        }
    };
    open_bytes(path, bytes, key).map(Some)
}

/// [`read`] for contents already read from `path`.
pub fn open_bytes(path: &Path, bytes: Vec<u8>, key: Option<&StateKey>) -> Result<Read, SealError> {
    if !is_sealed(&bytes) {
        return Ok(Read {
            plain: Zeroizing::new(bytes),
            was_plain: true,
        });
    }
    match key {
        Some(k) => {
            let plain = k.open(path, &bytes)?;
            note(path);
            Ok(Read {
                plain,
                was_plain: false,
            })
        }
        None => Err(SealError::NoKey {
            file: path.display().to_string(),
            found: envelope(path, &bytes)?.key_id,
        }),
    }
}

/// Replaces the file at `path` atomically (mode 0600) with `plain`, sealed when there is
/// a key.
pub fn write(path: &Path, plain: &[u8], key: Option<&StateKey>) -> std::io::Result<()> {
    write_at(path, plain, key, None)
}

/// [`write`] with crash points (docs/crash-points.md).
pub fn write_at(
    path: &Path,
    plain: &[u8],
    key: Option<&StateKey>,
    crash_at: Option<crate::crash::Replace>,
) -> std::io::Result<()> {
    match key {
        Some(k) => {
            note(path);
            crate::store::write_atomic_at(path, &k.seal(path, plain), crash_at)
        }
        None => crate::store::write_atomic_at(path, plain, crash_at),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(byte: u8) -> StateKey {
        StateKey::from_bytes(Zeroizing::new([byte; 32]), Path::new("test"))
    }

    #[test]
    fn seals_opens_and_refuses() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        let k = key(1);
        let secret = br#"{"version":1,"state":{"password":"hunter2-hunter2"}}"#;
        write(&path, secret, Some(&k)).unwrap();
        let on_disk = std::fs::read(&path).unwrap();
        assert!(is_sealed(&on_disk));
        assert!(!on_disk.windows(7).any(|w| w == b"hunter2"));
        let back = read(&path, Some(&k)).unwrap().unwrap();
        assert_eq!(&back.plain[..], secret);
        assert!(!back.was_plain);

        // Another key, no key, another path, a flipped byte: each refused by its reason.
        let e = read(&path, Some(&key(2))).err().unwrap();
        assert!(matches!(e, SealError::OtherKey { .. }), "{e}");
        let e = read(&path, None).err().unwrap();
        assert!(matches!(e, SealError::NoKey { .. }), "{e}");
        let moved = dir.path().join("other.json");
        std::fs::copy(&path, &moved).unwrap();
        let e = read(&moved, Some(&k)).err().unwrap();
        assert!(matches!(e, SealError::Tampered { .. }), "{e}");
        let mut doc: serde_json::Value = serde_json::from_slice(&on_disk).unwrap();
        let data = doc["data"].as_str().unwrap().to_owned();
        let flipped = if data.starts_with('A') { "B" } else { "A" };
        doc["data"] = format!("{flipped}{}", &data[1..]).into();
        // Reordered members (serde_json sorts them) are still a sealed file.
        std::fs::write(&path, serde_json::to_vec(&doc).unwrap()).unwrap();
        assert!(!std::fs::read(&path).unwrap().starts_with(PREFIX));
        let e = read(&path, Some(&k)).err().unwrap();
        assert!(matches!(e, SealError::Tampered { .. }), "{e}");
        let e = read(&path, None).err().unwrap();
        assert!(matches!(e, SealError::NoKey { .. }), "{e}");

        // A plain file reads as it is, and says so.
        std::fs::write(&path, secret).unwrap();
        assert!(read(&path, Some(&k)).unwrap().unwrap().was_plain);
    }

    #[test]
    fn values_open_only_where_they_were_sealed() {
        let k = key(1);
        let here = k.value_sealer(Path::new("/state/provider-state.json"));
        let sealed = here.seal(&["app:oidc/wiki", "5b0c"], b"{\"secret\":\"s3cr3t\"}");
        assert!(!sealed.contains("s3cr3t"));
        let back = here.open(&["app:oidc/wiki", "5b0c"], &sealed).unwrap();
        assert_eq!(&back[..], b"{\"secret\":\"s3cr3t\"}");
        // Another entry, another hash, another file, another key: none opens it.
        assert!(here.open(&["app:oidc/wik", "i5b0c"], &sealed).is_none());
        assert!(here.open(&["app:oidc/wiki", "5b0d"], &sealed).is_none());
        let there = k.value_sealer(Path::new("/state/other.json"));
        assert!(there.open(&["app:oidc/wiki", "5b0c"], &sealed).is_none());
        let other = key(2).value_sealer(Path::new("/state/provider-state.json"));
        assert!(other.open(&["app:oidc/wiki", "5b0c"], &sealed).is_none());
        assert!(here.open(&["app:oidc/wiki", "5b0c"], "AAAA").is_none());
    }

    #[test]
    fn key_files() {
        let dir = tempfile::tempdir().unwrap();
        let hex_file = dir.path().join("hex");
        std::fs::write(&hex_file, StateKey::generate_hex().as_bytes()).unwrap();
        let a = StateKey::load(&hex_file).unwrap();
        let raw_file = dir.path().join("raw");
        std::fs::write(&raw_file, &a.key[..]).unwrap();
        assert_eq!(StateKey::load(&raw_file).unwrap().id(), a.id());
        std::fs::write(&raw_file, b"short").unwrap();
        let e = StateKey::load(&raw_file).unwrap_err();
        assert!(e.contains("5 bytes"), "{e}");
    }
}
