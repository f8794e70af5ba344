//! The certificate authority's key: loaded from its file (an unencrypted OpenSSH ed25519
//! key that only its owner may read, or that key sealed with the state key), made on the
//! first run when the operator asks for that (sealed when there is a state key), and used to sign host and user certificates with `ssh-key`'s builder.

use std::io::Write;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

use ssh_key::certificate::{Builder, CertType};
use ssh_key::rand_core::OsRng;
use ssh_key::{Algorithm, HashAlg, LineEnding, PrivateKey, PublicKey};

/// What one certificate says.
pub struct CertSpec<'a> {
    pub subject: &'a PublicKey,
    pub kind: CertType,
    pub serial: u64,
    pub key_id: &'a str,
    pub principals: &'a [String],
    pub valid_after: u64,
    pub valid_before: u64,
    /// Extensions (user certificates: `permit-pty`, …), each with empty data.
    pub extensions: &'a [String],
}

/// The CA: its private key and the public forms consumers install.
pub struct Ca {
    key: PrivateKey,
    /// `ssh-ed25519 AAAA… COMMENT`, for `TrustedUserCAKeys` and `@cert-authority`.
    pub public_line: String,
    /// SHA256 fingerprint, recorded in the state to notice a new CA key.
    pub fingerprint: String,
    /// The public key's SSH wire encoding, as a KRL names the CA.
    pub blob: Vec<u8>,
}

impl Ca {
    /// Loads the key at `path`; when it does not exist and `generate` is set, makes an
    /// ed25519 key there first (mode 0400, never replacing a file that appeared
    /// meanwhile). `comment` ends the public line.
    pub fn load(path: &Path, generate: bool, comment: &str) -> anyhow::Result<Ca> {
        // A write of the key cut short by a kill left a temporary file: never the key.
        fort_core::store::remove_stale_temporaries_of(path);
        if generate && !path.exists() {
            generate_key(path)?;
        }
        let meta = std::fs::metadata(path)
            .map_err(|e| anyhow::anyhow!("cannot read the CA key {}: {e}", path.display()))?;
        if !meta.is_file() {
            anyhow::bail!("the CA key {} is not a regular file", path.display());
        }
        if meta.mode() & 0o077 != 0 {
            anyhow::bail!(
                "the CA key {} is readable by others (mode {:04o}); make it 0400",
                path.display(),
                meta.mode() & 0o7777
            );
        }
        // Sealed with the state key when the handler has one (docs/at-rest.md); a key
        // this handler made and finds plain (made before the state key) is sealed in
        // place. A key the operator provides is theirs: read as it is, plain or sealed.
        let state_key = crate::common::state::handler_key()
            .map_err(|why| anyhow::anyhow!("the CA key {} is not read: {why}", path.display()))?;
        let read = fort_core::sealed::read(path, state_key.as_deref())?
            .ok_or_else(|| anyhow::anyhow!("the CA key {} is gone", path.display()))?;
        let text = &read.plain[..];
        let key = PrivateKey::from_openssh(text).map_err(|e| {
            anyhow::anyhow!(
                "the CA key {} is not an OpenSSH private key ({e})",
                path.display()
            )
        })?;
        if key.is_encrypted() {
            anyhow::bail!(
                "the CA key {} is encrypted; the handler needs it unencrypted (protect the file instead)",
                path.display()
            );
        }
        if key.algorithm() != Algorithm::Ed25519 {
            anyhow::bail!(
                "the CA key {} is {}; the CA signs with ed25519 keys only",
                path.display(),
                key.algorithm()
            );
        }
        if let (Some(state_key), true, true) = (&state_key, read.was_plain, generate) {
            fort_core::sealed::write_at(
                path,
                text,
                Some(state_key),
                Some(fort_core::crash::replace_temp("store.seal.temp")),
            )
            .map_err(|e| anyhow::anyhow!("cannot seal the CA key {}: {e}", path.display()))?;
            tracing::info!(path = %path.display(), "sealed the CA key with the state key");
        }
        Ca::from_key(key, comment)
    }

    pub fn from_key(key: PrivateKey, comment: &str) -> anyhow::Result<Ca> {
        let public = PublicKey::new(key.public_key().key_data().clone(), comment);
        Ok(Ca {
            public_line: public.to_openssh()?,
            fingerprint: public.fingerprint(HashAlg::Sha256).to_string(),
            blob: public.to_bytes()?,
            key,
        })
    }

    /// Signs one certificate and returns it as an OpenSSH line (`…-cert-v01@openssh.com
    /// AAAA… KEY_ID`).
    pub fn sign(&self, spec: &CertSpec<'_>) -> anyhow::Result<String> {
        let mut b = Builder::new_with_random_nonce(
            &mut OsRng,
            spec.subject.key_data().clone(),
            spec.valid_after,
            spec.valid_before,
        )?;
        b.serial(spec.serial)?
            .key_id(spec.key_id)?
            .cert_type(spec.kind)?
            .comment(spec.key_id)?;
        for p in spec.principals {
            b.valid_principal(p.as_str())?;
        }
        for e in spec.extensions {
            b.extension(e.as_str(), "")?;
        }
        Ok(b.sign(&self.key)?.to_openssh()?)
    }
}

/// Writes a new ed25519 key to `path`, mode 0400: a temporary file in the same
/// directory, then a hard link to the final name, which fails rather than replace a key.
fn generate_key(path: &Path) -> anyhow::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    crate::common::state::create_private_dir(dir)?;
    let key = PrivateKey::random(&mut OsRng, Algorithm::Ed25519)?;
    let text = key.to_openssh(LineEnding::LF)?;
    let state_key = crate::common::state::handler_key().map_err(|why| anyhow::anyhow!("{why}"))?;
    let bytes = match &state_key {
        Some(k) => zeroize::Zeroizing::new(k.seal(path, text.as_bytes())),
        None => zeroize::Zeroizing::new(text.as_bytes().to_vec()),
    };
    // Named as every atomic write's temporary file is, so that one a kill leaves is never
    // taken for a sealed key (fort_core::store::temporary_pid) and is removed later.
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("ca");
    let tmp = dir.join(format!(".{name}.tmp.{}.0", std::process::id()));
    fort_core::store::remove_stale_temporaries_of(path);
    let _ = std::fs::remove_file(&tmp);
    let result = (|| -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o400)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)?;
        f.write_all(&bytes)?;
        f.sync_all()?;
        fort_core::crash::point("handler.ca-key.temp");
        std::fs::hard_link(&tmp, path)?;
        std::fs::File::open(dir)?.sync_all()
    })();
    let _ = std::fs::remove_file(&tmp);
    match result {
        Ok(()) => {
            tracing::info!(path = %path.display(), "made a new ed25519 CA key");
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && path.exists() => Ok(()),
        Err(e) => anyhow::bail!("cannot write a new CA key to {}: {e}", path.display()),
    }
}
