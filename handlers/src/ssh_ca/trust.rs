//! What a consumer that lists several `ssh-ca` providers trusts: every listed provider's
//! CA key, `@cert-authority` line and KRL, each kept apart by the provider that sent it
//! (`<krl>.d/<provider>.json`), and installed together: one CA key per provider for
//! `TrustedUserCAKeys`, one `@cert-authority` line per provider for clients, and one KRL
//! that revokes what any of them revokes. A provider that is down keeps its part as last
//! received, so a host goes on trusting a CA that is merely unreachable.

use std::ffi::OsStr;
use std::fs::File;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use base64::Engine;
use serde::{Deserialize, Serialize};

use super::krl;

/// Where trust is installed, and from whom it is taken.
pub struct Targets<'a> {
    /// The combined KRL (`RevokedKeys`); the parts live in `<krl>.d/`.
    pub krl: &'a Path,
    /// The listed providers, in order of preference.
    pub providers: &'a [String],
    /// One CA key line per provider (`TrustedUserCAKeys`), if wanted.
    pub ca_keys: Option<&'a Path>,
    /// One `@cert-authority` line per provider, if wanted.
    pub known_hosts: Option<&'a Path>,
}

/// One provider's part, as its last payload carried it (checked before it is kept).
#[derive(Serialize, Deserialize)]
struct Part {
    ca_public_key: String,
    known_hosts_line: String,
    /// Base64, as in the payload.
    krl: String,
}

/// What the combined files hold after an install.
#[derive(Debug, PartialEq, Eq)]
pub struct Installed {
    /// Providers whose part is in them.
    pub providers: Vec<String>,
    pub krl: krl::Summary,
}

/// Longest line taken from a payload: an RSA CA key with a comment fits many times.
const MAX_LINE: usize = 16 * 1024;

/// Keeps the part of `payload` as `origin`'s (one of the listed providers), drops the
/// parts of providers no longer listed, and rewrites each combined file whose content
/// changes. Installs of several needs may run at once: they take turns on a lock.
pub fn install(payload: &[u8], origin: &str, to: &Targets<'_>) -> anyhow::Result<Installed> {
    if !to.providers.iter().any(|p| p == origin) {
        anyhow::bail!(
            "the payload comes from {origin:?}, which is not one of the providers listed ({})",
            to.providers.join(", ")
        );
    }
    let part = part_of(payload)?;
    let dir = parts_dir(to.krl);
    std::fs::create_dir_all(&dir)
        .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", dir.display()))?;
    let _lock = lock(&dir)?;
    let kept = dir.join(format!("{origin}.json"));
    if !older_than_kept(&part, &kept) {
        write_if_changed(&kept, &serde_json::to_vec(&part)?)?;
    }
    // Providers no longer listed are no longer trusted.
    for entry in std::fs::read_dir(&dir)
        .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", dir.display()))?
    {
        let path = entry?.path();
        let is_part = path.extension() == Some(OsStr::new("json"));
        let listed = path
            .file_stem()
            .and_then(OsStr::to_str)
            .is_some_and(|stem| to.providers.iter().any(|p| p == stem));
        if is_part && !listed {
            std::fs::remove_file(&path)
                .map_err(|e| anyhow::anyhow!("cannot remove {}: {e}", path.display()))?;
        }
    }
    let mut parts = Vec::new();
    for provider in to.providers {
        // A part that cannot be read is left out until its provider sends it again.
        let path = dir.join(format!("{provider}.json"));
        let Ok(bytes) = std::fs::read(&path) else {
            continue;
        };
        match serde_json::from_slice::<Part>(&bytes)
            .map_err(anyhow::Error::from)
            .and_then(|p| checked(p).map(|c| (provider.clone(), c)))
        {
            Ok(part) => parts.push(part),
            Err(e) => eprintln!("left out {}: {e:#}", path.display()),
        }
    }
    let krls: Vec<&[u8]> = parts.iter().map(|(_, c)| c.krl.as_slice()).collect();
    let names: Vec<String> = parts.iter().map(|(p, _)| p.clone()).collect();
    let combined = krl::combine(&krls, &format!("fort ssh-ca: {}", names.join(", ")))
        .map_err(|e| anyhow::anyhow!("krl: {e}"))?;
    write_if_changed(to.krl, &combined)?;
    if let Some(path) = to.ca_keys {
        write_if_changed(path, &lines(parts.iter().map(|(_, c)| &c.ca_public_key)))?;
    }
    if let Some(path) = to.known_hosts {
        write_if_changed(path, &lines(parts.iter().map(|(_, c)| &c.known_hosts_line)))?;
    }
    Ok(Installed {
        providers: names,
        krl: krl::parse(&combined).map_err(|e| anyhow::anyhow!("krl: {e}"))?,
    })
}

/// Whether `part` carries an older KRL of the same CA than the part kept at `kept`: a
/// late redelivery (another need's payload from the same provider, sent before its
/// latest revocation) must never take a revocation back. The provider's KRL version
/// only grows.
fn older_than_kept(part: &Part, kept: &Path) -> bool {
    let version = |p: &Part| {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(p.krl.as_bytes())
            .ok()?;
        krl::parse(&bytes).ok().map(|s| s.version)
    };
    let Some(old) = std::fs::read(kept)
        .ok()
        .and_then(|b| serde_json::from_slice::<Part>(&b).ok())
    else {
        return false;
    };
    old.ca_public_key == part.ca_public_key && version(&old) > version(part)
}

/// `<krl>.d`, beside the combined KRL.
pub fn parts_dir(krl: &Path) -> PathBuf {
    let mut name = krl.file_name().unwrap_or_default().to_os_string();
    name.push(".d");
    krl.with_file_name(name)
}

/// A part as checked: the KRL decoded.
struct Checked {
    ca_public_key: String,
    known_hosts_line: String,
    krl: Vec<u8>,
}

/// The part an `ssh-ca` payload carries (a certificate's response or a `ca` one).
fn part_of(payload: &[u8]) -> anyhow::Result<Part> {
    let part: Part = serde_json::from_slice(payload).map_err(|e| {
        anyhow::anyhow!("the payload is not an ssh-ca response with ca_public_key, known_hosts_line and krl: {e}")
    })?;
    checked(part).map(|c| Part {
        ca_public_key: c.ca_public_key,
        known_hosts_line: c.known_hosts_line,
        krl: base64::engine::general_purpose::STANDARD.encode(&c.krl),
    })
}

/// The part's fields as they may be installed: one printable line each, a CA key that is
/// an OpenSSH public key, a known hosts line for exactly that key, a KRL OpenSSH reads.
fn checked(part: Part) -> anyhow::Result<Checked> {
    let line = |field: &str, value: &str| {
        if value.is_empty()
            || value.len() > MAX_LINE
            || !value.bytes().all(|b| (b' '..=b'~').contains(&b))
        {
            anyhow::bail!("{field} is not one printable line of at most {MAX_LINE} bytes");
        }
        Ok(())
    };
    line("ca_public_key", &part.ca_public_key)?;
    line("known_hosts_line", &part.known_hosts_line)?;
    let key = ssh_key::PublicKey::from_openssh(&part.ca_public_key)
        .map_err(|_| anyhow::anyhow!("ca_public_key is not an OpenSSH public key line"))?;
    let blob = key.to_openssh()?;
    let key_part: String = blob.split(' ').take(2).collect::<Vec<_>>().join(" ");
    let mut fields = part.known_hosts_line.split(' ');
    let names_key = (fields.next(), fields.next(), fields.next(), fields.next());
    let for_key = match names_key {
        (Some("@cert-authority"), Some(patterns), Some(kind), Some(data)) => {
            !patterns.is_empty() && format!("{kind} {data}") == key_part
        }
        _ => false,
    };
    if !for_key {
        anyhow::bail!("known_hosts_line is not an @cert-authority line for ca_public_key");
    }
    let krl = base64::engine::general_purpose::STANDARD
        .decode(part.krl.as_bytes())
        .map_err(|e| anyhow::anyhow!("krl is not base64: {e}"))?;
    krl::parse(&krl).map_err(|e| anyhow::anyhow!("krl: {e}"))?;
    Ok(Checked {
        ca_public_key: part.ca_public_key,
        known_hosts_line: part.known_hosts_line,
        krl,
    })
}

/// One line each, the same line once.
fn lines<'a>(values: impl Iterator<Item = &'a String>) -> Vec<u8> {
    let mut seen = Vec::new();
    let mut out = Vec::new();
    for v in values {
        if !seen.contains(&v) {
            seen.push(v);
            out.extend_from_slice(v.as_bytes());
            out.push(b'\n');
        }
    }
    out
}

/// Replaces `path` atomically (mode 0644: keys, lines and serials are public, and sshd
/// and clients read them) unless it holds exactly `bytes`.
fn write_if_changed(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    if std::fs::read(path).is_ok_and(|old| old == bytes) {
        return Ok(());
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)
            .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", dir.display()))?;
    }
    fort_core::store::write_atomic(path, bytes)
        .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644))
        .map_err(|e| anyhow::anyhow!("cannot chmod {}: {e}", path.display()))
}

/// An exclusive lock on `<dir>/.lock`, held until the file is dropped.
fn lock(dir: &Path) -> anyhow::Result<File> {
    let path = dir.join(".lock");
    let file = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| anyhow::anyhow!("cannot open {}: {e}", path.display()))?;
    rustix::fs::flock(&file, rustix::fs::FlockOperation::LockExclusive)
        .map_err(|e| anyhow::anyhow!("cannot lock {}: {e}", path.display()))?;
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ssh_key::rand_core::OsRng;

    fn payload(ca: &ssh_key::PrivateKey, serials: &[u64]) -> Vec<u8> {
        versioned(ca, serials, serials.len() as u64)
    }

    fn versioned(ca: &ssh_key::PrivateKey, serials: &[u64], version: u64) -> Vec<u8> {
        let public = ca.public_key().to_openssh().unwrap();
        let krl = krl::Krl {
            version,
            generated: 1,
            comment: String::new(),
            serials: [(ca.public_key().to_bytes().unwrap(), serials.to_vec())].into(),
        };
        serde_json::to_vec(&serde_json::json!({
            "kind": "ca",
            "ca_public_key": public,
            "known_hosts_line": format!("@cert-authority * {public}"),
            "krl": base64::engine::general_purpose::STANDARD.encode(krl.to_bytes()),
        }))
        .unwrap()
    }

    fn key() -> ssh_key::PrivateKey {
        ssh_key::PrivateKey::random(&mut OsRng, ssh_key::Algorithm::Ed25519).unwrap()
    }

    #[test]
    fn every_listed_providers_part_is_installed_and_no_other() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (key(), key());
        let providers = vec!["edge1".to_owned(), "edge2".to_owned()];
        let krl_path = dir.path().join("revoked.krl");
        let to = Targets {
            krl: &krl_path,
            providers: &providers,
            ca_keys: Some(&dir.path().join("ca.pub")),
            known_hosts: Some(&dir.path().join("known_hosts")),
        };
        let one = install(&payload(&a, &[7]), "edge1", &to).unwrap();
        assert_eq!(one.providers, ["edge1"]);
        let both = install(&payload(&b, &[3, 4]), "edge2", &to).unwrap();
        assert_eq!(both.providers, ["edge1", "edge2"]);
        assert_eq!(both.krl.revoked_count, 3);
        let ca_keys = std::fs::read_to_string(dir.path().join("ca.pub")).unwrap();
        assert_eq!(ca_keys.lines().count(), 2, "{ca_keys}");
        let known = std::fs::read_to_string(dir.path().join("known_hosts")).unwrap();
        assert!(known
            .lines()
            .all(|l| l.starts_with("@cert-authority * ssh-ed25519 ")));
        assert_eq!(known.lines().count(), 2);
        // edge1 revokes more: its part is replaced, edge2's kept.
        let again = install(&payload(&a, &[7, 8]), "edge1", &to).unwrap();
        assert_eq!(again.krl.revoked_count, 4);
        // A late payload with edge1's older KRL takes nothing back.
        let late = install(&versioned(&a, &[7], 1), "edge1", &to).unwrap();
        assert_eq!(late.krl.revoked_count, 4);
        // Not a listed provider: refused, nothing changes.
        assert!(install(&payload(&key(), &[1]), "edge3", &to).is_err());
        // A mismatched known hosts line, a KRL that is not one: refused.
        let mut bad: serde_json::Value = serde_json::from_slice(&payload(&a, &[])).unwrap();
        bad["known_hosts_line"] =
            format!("@cert-authority * {}", b.public_key().to_openssh().unwrap()).into();
        assert!(install(bad.to_string().as_bytes(), "edge1", &to).is_err());
        bad = serde_json::from_slice(&payload(&a, &[])).unwrap();
        bad["krl"] = "AAAA".into();
        assert!(install(bad.to_string().as_bytes(), "edge1", &to).is_err());
        assert_eq!(
            krl::parse(&std::fs::read(&krl_path).unwrap())
                .unwrap()
                .revoked_count,
            4
        );
        // edge2 no longer listed: its part goes at the next install.
        let only = vec!["edge1".to_owned()];
        let to = Targets {
            providers: &only,
            ..to
        };
        let left = install(&payload(&a, &[7, 8]), "edge1", &to).unwrap();
        assert_eq!(left.providers, ["edge1"]);
        assert_eq!(left.krl.revoked_count, 2);
        assert!(!parts_dir(&krl_path).join("edge2.json").exists());
        let ca_keys = std::fs::read_to_string(dir.path().join("ca.pub")).unwrap();
        assert_eq!(ca_keys.lines().count(), 1);
    }
}
