//! SSHSIG signing and strict verification, byte-compatible with `ssh-keygen -Y sign`.

use std::path::Path;

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use ssh_encoding::{Decode, Encode, Reader};
use ssh_key::{Algorithm, HashAlg, LineEnding, PrivateKey, PublicKey, SshSig};

use crate::canonical::NAMESPACE;

/// The first line of an OpenSSH private key file.
pub const OPENSSH_ARMOR: &str = "-----BEGIN OPENSSH PRIVATE KEY-----";

/// The longest `X-Fort-Signature` value accepted (§3).
pub const MAX_SIGNATURE_LEN: usize = 2048;

/// Why a signature was refused. Goes to the log, never to the caller.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum VerifyError {
    #[error("signature is not strict base64")]
    Base64,
    #[error("signature blob does not decode as SSHSIG")]
    Decode,
    #[error("signature blob has trailing bytes")]
    TrailingBytes,
    #[error("SSHSIG version {0} is not 1")]
    Version(u32),
    #[error("namespace {0:?} is not the expected one")]
    Namespace(String),
    #[error("hash {0} is not sha512")]
    Hash(String),
    #[error("key type {0} is not ssh-ed25519")]
    KeyType(String),
    #[error("embedded key is not one of the origin's keys")]
    UnknownKey,
    #[error("signature does not verify")]
    Invalid,
}

/// Why a key could not be loaded.
///
/// Causes are part of the message and not `#[source]`s, so that a chain of causes
/// (anyhow's `{:#}`) does not print them twice.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("cannot read key {path}: {error}")]
    Read { path: String, error: std::io::Error },
    #[error("key {path} is not an OpenSSH private key (expected a file starting with {OPENSSH_ARMOR}){hint}")]
    NotOpenSsh { path: String, hint: &'static str },
    #[error("key {path} is not a usable OpenSSH private key: {error}")]
    Parse { path: String, error: ssh_key::Error },
    #[error("key {path} is encrypted; fort needs an unencrypted key")]
    Encrypted { path: String },
    #[error("key {path} is {algorithm}; fort signs with ssh-ed25519 only")]
    Algorithm { path: String, algorithm: String },
}

/// A private key and the name it signs as.
#[derive(Clone)]
pub struct Signer {
    key: PrivateKey,
    /// The key already expanded for signing. ssh-key would rebuild it (a hash and a scalar
    /// multiplication) for every signature, doubling the cost of each; the signature
    /// itself is still made by ed25519-dalek and wrapped by ssh-key.
    expanded: std::sync::Arc<Expanded>,
}

struct Expanded {
    signing: ed25519_dalek::SigningKey,
    public: ssh_key::public::KeyData,
}

impl ed25519_dalek::ed25519::signature::Signer<ssh_key::Signature> for Expanded {
    fn try_sign(
        &self,
        msg: &[u8],
    ) -> Result<ssh_key::Signature, ed25519_dalek::ed25519::signature::Error> {
        let sig = self.signing.sign(msg);
        ssh_key::Signature::new(Algorithm::Ed25519, sig.to_bytes().to_vec())
            .map_err(|_| ed25519_dalek::ed25519::signature::Error::new())
    }
}

impl ssh_key::SigningKey for Expanded {
    fn public_key(&self) -> ssh_key::public::KeyData {
        self.public.clone()
    }
}

impl Signer {
    /// Wraps an ed25519 key (callers check the algorithm; [`Signer::from_file`] does).
    pub fn new(key: PrivateKey) -> Signer {
        let seed = key
            .key_data()
            .ed25519()
            .map(|k| k.private.to_bytes())
            .expect("an ed25519 key");
        let expanded = Expanded {
            signing: ed25519_dalek::SigningKey::from_bytes(&seed),
            public: key.public_key().key_data().clone(),
        };
        Signer {
            key,
            expanded: std::sync::Arc::new(expanded),
        }
    }

    /// Reads an unencrypted OpenSSH ed25519 private key.
    pub fn from_file(path: &Path) -> Result<Signer, KeyError> {
        let shown = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|error| KeyError::Read {
            path: shown.clone(),
            error,
        })?;
        // What the parser would say about anything else ("PEM preamble contains invalid
        // data") does not tell what file was expected.
        let text = std::str::from_utf8(&bytes).unwrap_or("").trim();
        if !text.starts_with(OPENSSH_ARMOR) {
            let hint = if text.starts_with("ssh-") {
                "; this looks like a public key: give the file without .pub"
            } else if text.starts_with("-----BEGIN ") {
                "; this is another PEM format: fort needs an ed25519 key as ssh-keygen -t ed25519 writes it"
            } else {
                ""
            };
            return Err(KeyError::NotOpenSsh { path: shown, hint });
        }
        let key = PrivateKey::from_openssh(text).map_err(|error| KeyError::Parse {
            path: shown.clone(),
            error,
        })?;
        if key.is_encrypted() {
            return Err(KeyError::Encrypted { path: shown });
        }
        if key.algorithm() != Algorithm::Ed25519 {
            return Err(KeyError::Algorithm {
                path: shown,
                algorithm: key.algorithm().to_string(),
            });
        }
        Ok(Signer::new(key))
    }

    /// A fresh random ed25519 key (tests and the demo).
    pub fn generate() -> Signer {
        let key = PrivateKey::random(&mut rand::rngs::OsRng, Algorithm::Ed25519)
            .expect("ed25519 key generation cannot fail");
        Signer::new(key)
    }

    pub fn public_key(&self) -> &PublicKey {
        self.key.public_key()
    }

    /// The 32-byte ed25519 secret, for building the TLS certificate around this key.
    pub fn ed25519_seed(&self) -> Option<[u8; 32]> {
        self.key.key_data().ed25519().map(|k| k.private.to_bytes())
    }

    /// `ssh-ed25519 AAAA...` without a comment.
    pub fn public_openssh(&self) -> String {
        let mut pk = self.key.public_key().clone();
        pk.set_comment("");
        pk.to_openssh().expect("public key encodes")
    }

    /// The private key in OpenSSH PEM form, for writing key files.
    pub fn private_openssh(&self) -> String {
        self.key
            .to_openssh(LineEnding::LF)
            .expect("private key encodes")
            .to_string()
    }

    /// Signs `msg` under `namespace` (another use of the host key than requests, such
    /// as the audit trail's checkpoints): the SSHSIG blob `ssh-keygen -Y sign -n
    /// NAMESPACE` makes, as one-line base64.
    pub fn sign_in(&self, namespace: &str, msg: &[u8]) -> String {
        let sig = SshSig::sign(&*self.expanded, namespace, HashAlg::Sha512, msg)
            .expect("ed25519 signing under a non-empty namespace cannot fail");
        let mut blob = Vec::with_capacity(sig.encoded_len().unwrap_or(128));
        sig.encode(&mut blob).expect("SSHSIG encodes");
        STANDARD.encode(blob)
    }

    /// Signs `msg` and returns the one-line base64 of the binary SSHSIG blob.
    pub fn sign(&self, msg: &[u8]) -> String {
        self.sign_in(NAMESPACE, msg)
    }
}

/// Parses one `ssh-ed25519 AAAA... [comment]` public key line.
pub fn parse_public_key(line: &str) -> Result<PublicKey, String> {
    let key =
        PublicKey::from_openssh(line.trim()).map_err(|e| format!("not an OpenSSH key: {e}"))?;
    if key.algorithm() != Algorithm::Ed25519 {
        return Err(format!(
            "{} keys are not accepted; use ssh-ed25519",
            key.algorithm()
        ));
    }
    Ok(key)
}

/// Verifies a base64 SSHSIG over `msg` made by one of `keys`, checking every field
/// §3 step 6 names before the (comparatively costly) signature check.
pub fn verify(signature_b64: &str, keys: &[PublicKey], msg: &[u8]) -> Result<(), VerifyError> {
    verify_with_key(signature_b64, keys, msg).map(drop)
}

/// As [`verify`], and says which of `keys` made the signature.
pub fn verify_with_key<'k>(
    signature_b64: &str,
    keys: &'k [PublicKey],
    msg: &[u8],
) -> Result<&'k PublicKey, VerifyError> {
    verify_in(NAMESPACE, signature_b64, keys, msg)
}

/// As [`verify_with_key`], for a signature made under `namespace` (see
/// [`Signer::sign_in`]).
pub fn verify_in<'k>(
    namespace: &str,
    signature_b64: &str,
    keys: &'k [PublicKey],
    msg: &[u8],
) -> Result<&'k PublicKey, VerifyError> {
    if signature_b64.len() > MAX_SIGNATURE_LEN {
        return Err(VerifyError::Base64);
    }
    let blob = STANDARD
        .decode(signature_b64)
        .map_err(|_| VerifyError::Base64)?;
    let mut reader: &[u8] = &blob;
    let sig = SshSig::decode(&mut reader).map_err(|_| VerifyError::Decode)?;
    if !reader.is_finished() {
        return Err(VerifyError::TrailingBytes);
    }
    if sig.version() != 1 {
        return Err(VerifyError::Version(sig.version()));
    }
    if sig.namespace() != namespace {
        return Err(VerifyError::Namespace(sig.namespace().to_owned()));
    }
    if sig.hash_alg() != HashAlg::Sha512 {
        return Err(VerifyError::Hash(sig.hash_alg().to_string()));
    }
    if sig.algorithm() != Algorithm::Ed25519 || sig.public_key().algorithm() != Algorithm::Ed25519 {
        return Err(VerifyError::KeyType(sig.algorithm().to_string()));
    }
    let key = keys
        .iter()
        .find(|k| k.key_data() == sig.public_key())
        .ok_or(VerifyError::UnknownKey)?;
    // What ssh-key's `PublicKey::verify` does, with the decompressed key kept: the signed
    // data is SSHSIG's, the check ed25519-dalek's.
    let raw = key.key_data().ed25519().ok_or(VerifyError::Invalid)?.0;
    let verifying = verifying_key(raw).ok_or(VerifyError::Invalid)?;
    let signed =
        SshSig::signed_data(namespace, HashAlg::Sha512, msg).map_err(|_| VerifyError::Invalid)?;
    let signature = ed25519_dalek::Signature::try_from(sig.signature().as_bytes())
        .map_err(|_| VerifyError::Invalid)?;
    use ed25519_dalek::Verifier as _;
    verifying
        .verify(&signed, &signature)
        .map_err(|_| VerifyError::Invalid)?;
    Ok(key)
}

/// Decompressed keys of the known peers (the registry bounds them; the cache is dropped
/// whole if it ever grows past that bound).
fn verifying_key(raw: [u8; 32]) -> Option<ed25519_dalek::VerifyingKey> {
    use parking_lot::RwLock;
    use std::collections::HashMap;
    use std::sync::OnceLock;
    // Read-locked on every verified request, by every worker at once: a reader never
    // waits for another reader.
    static CACHE: OnceLock<RwLock<HashMap<[u8; 32], ed25519_dalek::VerifyingKey>>> =
        OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(k) = cache.read().get(&raw) {
        return Some(*k);
    }
    let key = ed25519_dalek::VerifyingKey::from_bytes(&raw).ok()?;
    let mut map = cache.write();
    if map.len() > 8192 {
        map.clear();
    }
    map.insert(raw, key);
    Some(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_rejections() {
        let a = Signer::generate();
        let b = Signer::generate();
        let sig = a.sign(b"hello");
        let keys = vec![a.public_key().clone()];
        assert_eq!(verify(&sig, &keys, b"hello"), Ok(()));
        assert_eq!(verify(&sig, &keys, b"hellp"), Err(VerifyError::Invalid));
        assert_eq!(
            verify(&sig, &[b.public_key().clone()], b"hello"),
            Err(VerifyError::UnknownKey)
        );
        assert_eq!(verify("!!!", &keys, b"hello"), Err(VerifyError::Base64));
        let long = "A".repeat(MAX_SIGNATURE_LEN + 4);
        assert_eq!(verify(&long, &keys, b"hello"), Err(VerifyError::Base64));
        // Trailing bytes after a valid blob.
        let mut blob = STANDARD.decode(&sig).unwrap();
        blob.push(0);
        assert_eq!(
            verify(&STANDARD.encode(&blob), &keys, b"hello"),
            Err(VerifyError::TrailingBytes)
        );
    }

    #[test]
    fn a_signature_in_another_namespace_is_ssh_keys_and_only_good_there() {
        let a = Signer::generate();
        let keys = vec![a.public_key().clone()];
        let msg = b"many records\n";
        let sig = a.sign_in("fort-audit", msg);
        // ed25519 is deterministic: ssh-key's own SSHSIG over the message is the same.
        let whole = a.key.sign("fort-audit", HashAlg::Sha512, msg).unwrap();
        let mut blob = Vec::new();
        whole.encode(&mut blob).unwrap();
        assert_eq!(sig, STANDARD.encode(blob));
        assert!(verify_in("fort-audit", &sig, &keys, msg).is_ok());
        assert_eq!(
            verify(&sig, &keys, msg).err(),
            Some(VerifyError::Namespace("fort-audit".into()))
        );
        assert_eq!(
            verify_in("fort-audit", &sig, &keys, b"other").err(),
            Some(VerifyError::Invalid)
        );
    }

    #[test]
    fn other_namespace_and_hash_are_refused() {
        let a = Signer::generate();
        let keys = vec![a.public_key().clone()];
        for (ns, hash) in [("git", HashAlg::Sha512), ("fort-agent", HashAlg::Sha256)] {
            let sig = a.key.sign(ns, hash, b"m").unwrap();
            let mut blob = Vec::new();
            sig.encode(&mut blob).unwrap();
            assert!(verify(&STANDARD.encode(blob), &keys, b"m").is_err());
        }
    }
}
