//! Files delivered as systemd encrypted credentials (docs/protocol.md §11.3, *Encrypted
//! files*; docs/at-rest.md): the content is encrypted on this host by `systemd-creds`,
//! from a pipe to a pipe, so its plaintext never reaches a file; and a payload waiting to
//! be applied for such a need is recorded encrypted the same way. Whether a file changed
//! is decided from a digest of its content, since every encryption gives other bytes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use fort_core::canonical::sha256_hex;
use fort_core::process::{run, RunSpec};
use fort_core::schema::{CredentialKey, FileSpec, NeedSpec};
use fort_core::text::printable;
use serde::{Deserialize, Serialize};

use crate::Fulfiller;

/// The credential name a recorded payload is encrypted under: it decrypts as nothing else.
pub(crate) const PAYLOAD_CREDENTIAL: &str = "fort-payload";

/// How long one `systemd-creds` run may take (a TPM2 can be slow, never this slow).
const CREDS_TIMEOUT: Duration = Duration::from_secs(30);

/// How much of what `systemd-creds` says goes into a need's reason: it names what is
/// missing (a TPM2, the host secret), and never echoes its input.
const REASON_CHARS: usize = 160;

/// What the consumer keeps of an encrypted file it wrote: enough to know an unchanged
/// content without keeping it, and to know that the file at the path is still the one
/// it wrote (a plain file put there, by hand or by another release, never matches).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct CredentialRecord {
    /// [`digest`] of the content encrypted.
    pub digest: String,
    /// SHA-256 of the ciphertext written.
    pub sealed_sha256: String,
}

/// An encrypted file's bytes, ready to be written: new ciphertext, or the ciphertext
/// already at its path when the content has not changed.
#[derive(Debug, Clone)]
pub(crate) struct SealedFile {
    pub ciphertext: Vec<u8>,
    pub digest: String,
}

/// path → the encrypted file's bytes, for every encrypted file of one payload.
pub(crate) type Sealed = BTreeMap<PathBuf, SealedFile>;

/// SHA-256 over the credential's name, the key it is bound to and the content: another
/// name or key encrypts again, as does another content.
pub(crate) fn digest(f: &FileSpec, with: CredentialKey, content: &[u8]) -> String {
    let mut pre = b"fort credential\0".to_vec();
    pre.extend_from_slice(f.name.as_deref().unwrap_or_default().as_bytes());
    pre.push(0);
    pre.extend_from_slice(with.as_str().as_bytes());
    pre.push(0);
    pre.extend_from_slice(content);
    sha256_hex(&pre)
}

/// The key a need's recorded payload is encrypted with: that of its first encrypted
/// file, `None` for a need without one (its payload is recorded as it came).
pub(crate) fn payload_key(spec: &NeedSpec) -> Option<CredentialKey> {
    spec.files.iter().find_map(|f| f.encrypt)
}

/// How `systemd-creds` is run: which program, with what environment.
pub(crate) struct Creds<'a> {
    pub program: &'a Path,
    pub env: &'a [(String, String)],
}

impl Creds<'_> {
    /// `plaintext`, encrypted under `name` and bound to `with`; `Err` is the reason.
    pub async fn encrypt(
        &self,
        name: &str,
        with: CredentialKey,
        plaintext: &[u8],
    ) -> Result<Vec<u8>, String> {
        let spec = RunSpec::new(self.program, plaintext.to_vec(), CREDS_TIMEOUT)
            .arg("encrypt")
            .arg(format!("--name={name}"))
            .arg(format!("--with-key={}", with.as_str()))
            .arg("-")
            .arg("-")
            .envs(self.env.iter().cloned());
        let out = run(&spec).await.map_err(|e| {
            format!(
                "cannot encrypt with systemd-creds (--with-key={}): {}",
                with.as_str(),
                said(&e)
            )
        })?;
        if out.stdout.is_empty() {
            return Err(format!(
                "cannot encrypt with systemd-creds (--with-key={}): it printed nothing",
                with.as_str()
            ));
        }
        Ok(out.stdout)
    }

    /// `ciphertext` decrypted, refused unless it was encrypted under `name`.
    pub async fn decrypt(&self, name: &str, ciphertext: &[u8]) -> Result<Vec<u8>, String> {
        let spec = RunSpec::new(self.program, ciphertext.to_vec(), CREDS_TIMEOUT)
            .arg("decrypt")
            .arg(format!("--name={name}"))
            .arg("-")
            .arg("-")
            .envs(self.env.iter().cloned());
        let out = run(&spec)
            .await
            .map_err(|e| format!("cannot decrypt with systemd-creds: {}", said(&e)))?;
        Ok(out.stdout)
    }
}

/// What went wrong with a `systemd-creds` run, with what it said about it.
fn said(e: &fort_core::process::RunError) -> String {
    match e.stderr_excerpt(REASON_CHARS * 2) {
        Some(stderr) => format!("{}: {}", e.summary(), printable(&stderr, REASON_CHARS)),
        None => e.summary(),
    }
}

impl Fulfiller {
    pub(crate) fn creds(&self) -> Creds<'_> {
        Creds {
            program: &self.inner.opts.systemd_creds,
            env: &self.inner.opts.handler_environment,
        }
    }

    /// The payload as a need's inbox records it: encrypted when the need has an
    /// encrypted file (its plaintext must not reach the state), as it came otherwise.
    /// Returns the bytes and whether they are encrypted.
    pub(crate) async fn recordable(
        &self,
        spec: &NeedSpec,
        payload: &[u8],
    ) -> Result<(Vec<u8>, bool), String> {
        match payload_key(spec) {
            None => Ok((payload.to_vec(), false)),
            Some(with) => {
                let sealed = self
                    .creds()
                    .encrypt(PAYLOAD_CREDENTIAL, with, payload)
                    .await
                    .map_err(|e| format!("the payload cannot be recorded: {e}"))?;
                Ok((sealed, true))
            }
        }
    }

    /// A recorded payload back as it came.
    pub(crate) async fn recorded_payload(
        &self,
        bytes: Vec<u8>,
        encrypted: bool,
    ) -> Result<Vec<u8>, String> {
        if !encrypted {
            return Ok(bytes);
        }
        self.creds()
            .decrypt(PAYLOAD_CREDENTIAL, &bytes)
            .await
            .map_err(|e| format!("the recorded payload cannot be read: {e}"))
    }

    /// Every encrypted file of `spec` for `payload`: the ciphertext already at its path
    /// when its content is unchanged, else the content encrypted now. The first failure
    /// is the payload's: then no file is written.
    pub(crate) async fn seal_files(
        &self,
        spec: &NeedSpec,
        recorded: &crate::state::NeedState,
        payload: &[u8],
    ) -> Result<Sealed, String> {
        let mut sealed = Sealed::new();
        for f in &spec.files {
            let Some(with) = f.encrypt else { continue };
            let label = f.label();
            let content = crate::files::content(payload, &f.pointer)
                .map_err(|e| format!("file {label}: {e}"))?;
            let digest = digest(f, with, &content);
            let path = f.path.to_string_lossy();
            let kept = recorded
                .credentials
                .get(path.as_ref())
                .filter(|r| r.digest == digest)
                .map(|r| r.sealed_sha256.clone());
            let unchanged = match kept {
                Some(sha) => {
                    let at = f.path.clone();
                    tokio::task::spawn_blocking(move || crate::files::read_if_holds(&at, &sha))
                        .await
                        .ok()
                        .flatten()
                }
                None => None,
            };
            let ciphertext = match unchanged {
                Some(bytes) => bytes,
                None => {
                    let name = f.name.as_deref().unwrap_or_default();
                    self.creds()
                        .encrypt(name, with, &content)
                        .await
                        .map_err(|e| format!("file {label}: {e}"))?
                }
            };
            sealed.insert(f.path.clone(), SealedFile { ciphertext, digest });
        }
        Ok(sealed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(name: &str) -> FileSpec {
        serde_json::from_value(serde_json::json!({
            "name": name, "path": "/c.cred", "encrypt": "auto"
        }))
        .unwrap()
    }

    #[test]
    fn the_digest_binds_name_key_and_content() {
        let base = digest(&file("token"), CredentialKey::Auto, b"s3cret");
        assert_eq!(base, digest(&file("token"), CredentialKey::Auto, b"s3cret"));
        assert_ne!(base, digest(&file("other"), CredentialKey::Auto, b"s3cret"));
        assert_ne!(base, digest(&file("token"), CredentialKey::Host, b"s3cret"));
        assert_ne!(
            base,
            digest(&file("token"), CredentialKey::Auto, b"s3cret2")
        );
        // Not the plain SHA-256 of the secret, which a copy of any other state would
        // share.
        assert_ne!(base, sha256_hex(b"s3cret"));
    }

    #[tokio::test]
    async fn a_missing_systemd_creds_is_a_reason_not_a_plaintext() {
        let creds = Creds {
            program: Path::new("/nonexistent/systemd-creds"),
            env: &[],
        };
        let err = creds
            .encrypt("token", CredentialKey::Tpm2, b"s3cret")
            .await
            .unwrap_err();
        assert!(
            err.starts_with("cannot encrypt with systemd-creds (--with-key=tpm2): cannot start /nonexistent/systemd-creds"),
            "{err}"
        );
        assert!(!err.contains("s3cret"), "{err}");
        let err = creds.decrypt("token", b"x").await.unwrap_err();
        assert!(err.contains("cannot decrypt with systemd-creds"), "{err}");
    }
}
