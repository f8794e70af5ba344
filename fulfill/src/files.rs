//! Files written from a payload (docs/protocol.md §11.3): the content is the payload or
//! the value at a JSON pointer in it; each file is written atomically with its owner,
//! group and mode already set when it appears; and an unchanged file is not touched at
//! all, so nothing restarts for a payload that did not change. Every directory on the way
//! is reached without following links (`safe_path`), so a local user cannot redirect
//! where these writes, reads and removals land.

/// For `fort-agent check`: a delivery path a local user could redirect.
pub use crate::safe_path::unsafe_parent;
/// Owners and groups by name, as every file fort writes for another account needs.
pub use fort_core::accounts::account_id;
use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{OsStr, OsString};
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStringExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use fort_core::canonical::sha256_hex;
use fort_core::schema::FileSpec;
use rustix::fs::{self as rfs, Mode, OFlags};

use crate::credentials::{CredentialRecord, Sealed};
use crate::safe_path::{holds, open_parent, open_regular, sha256_of, MAX_COMPARE_BYTES};

/// What writing a payload's files did.
#[derive(Debug, Default)]
pub struct Written {
    /// path → SHA-256 of the content now there.
    pub files: BTreeMap<String, String>,
    /// Whether any file's content changed (the units restart only then).
    pub changed: bool,
    /// Whether a file was made where there was none before (its first delivery).
    pub created: bool,
    /// `credential_for` units of files whose content was replaced: restarted.
    pub credentials_replaced: BTreeSet<String>,
    /// Keys installed from the need's next keys (§11.10), forgotten as next keys once
    /// the outcome is recorded.
    pub installed_keys: Vec<String>,
    /// `credential_for` units of files that did not exist: not running without them,
    /// and started by their path unit now that they appear (§11.3, step 5).
    pub credentials_created: BTreeSet<String>,
    /// path → what was encrypted into each encrypted file, and what was written.
    pub credentials: BTreeMap<String, CredentialRecord>,
}

impl Written {
    /// The units to restart when this payload's files changed: the need's
    /// `restart_units` and the credential units of replaced files, without the credential
    /// units of files it created (otherwise a first delivery would start such a service
    /// twice: its path unit, then this restart).
    pub fn restarts(&self, restart_units: &[String]) -> Vec<String> {
        let mut units: Vec<String> = restart_units.to_vec();
        units.extend(self.credentials_replaced.iter().cloned());
        units.retain(|u| !self.credentials_created.contains(u));
        units.sort();
        units.dedup();
        units
    }
}

/// The content one file gets from a payload.
pub fn content(payload: &[u8], pointer: &str) -> Result<Vec<u8>, String> {
    if pointer.is_empty() {
        return Ok(payload.to_vec());
    }
    let json: serde_json::Value = serde_json::from_slice(payload)
        .map_err(|_| format!("the payload is not JSON, so pointer {pointer} cannot apply"))?;
    match json.pointer(pointer) {
        None => Err(format!("the payload has nothing at {pointer}")),
        Some(serde_json::Value::String(s)) => Ok(s.as_bytes().to_vec()),
        Some(other) => Ok(serde_json::to_vec(other).expect("JSON value serialises")),
    }
}

/// One file to write: where, what, and whose.
pub(crate) struct Planned {
    pub file: FileSpec,
    pub data: Vec<u8>,
    pub uid: u32,
    pub gid: u32,
    pub mode: u32,
}

/// Writes every file of a need from `payload`. Everything that can fail before a byte
/// is written (a pointer, an owner that does not exist yet) is checked for all files
/// first, so a payload is applied to all of its files or to none.
///
/// `extra` are files whose content is not in the payload (keys made here, §11.10),
/// written first, so a service restarted for the payload finds its new key already there.
///
/// `own_dir`: the directory that holds every one of these files and nothing of any other
/// need. There they are replaced together (`swap`): a reader sees all old files or all
/// new ones.
///
/// `sealed`: the bytes of every encrypted file (`credentials`), which get those instead
/// of their content; an encrypted file missing from it is an error, never a plaintext.
pub(crate) fn write_all(
    files: &[FileSpec],
    payload: &[u8],
    extra: Vec<(FileSpec, Vec<u8>)>,
    own_dir: Option<&Path>,
    sealed: &Sealed,
) -> Result<Written, String> {
    let mut contents = extra;
    let mut credentials = BTreeMap::new();
    for f in files {
        let data = content(payload, &f.pointer).map_err(|e| format!("file {}: {e}", f.label()))?;
        if !f.encrypted() {
            contents.push((f.clone(), data));
            continue;
        }
        let s = sealed
            .get(&f.path)
            .ok_or_else(|| format!("file {}: not encrypted", f.label()))?;
        credentials.insert(
            f.path.display().to_string(),
            CredentialRecord {
                digest: s.digest.clone(),
                sealed_sha256: sha256_hex(&s.ciphertext),
            },
        );
        contents.push((f.clone(), s.ciphertext.clone()));
    }
    let mut planned = Vec::with_capacity(contents.len());
    for (f, data) in contents {
        let label = f.label();
        let uid = account_id(&f.owner, false).map_err(|e| format!("file {label}: {e}"))?;
        let gid = account_id(&f.group, true).map_err(|e| format!("file {label}: {e}"))?;
        let mode = f.mode_bits();
        planned.push(Planned {
            file: f,
            data,
            uid,
            gid,
            mode,
        });
    }
    let together = own_dir
        .filter(|dir| {
            planned.len() > 1 && planned.iter().all(|p| p.file.path.parent() == Some(*dir))
        })
        .and_then(|dir| crate::swap::write(dir, &planned));
    let mut out = Written {
        credentials,
        ..Written::default()
    };
    for (i, p) in planned.into_iter().enumerate() {
        if i == 1 && together.is_none() {
            // Some of the payload's files written one by one, not all.
            fort_core::crash::point("deliver.file.swapped");
        }
        let (f, data) = (p.file, p.data);
        let outcome = match &together {
            Some(outcomes) => outcomes[i],
            None => write_one(&f.path, &data, p.uid, p.gid, p.mode).map_err(|e| {
                format!("file {}: cannot write {}: {e}", f.label(), f.path.display())
            })?,
        };
        out.changed |= outcome != Outcome::Unchanged;
        out.created |= outcome == Outcome::Created;
        let credentials = match outcome {
            Outcome::Unchanged => None,
            Outcome::Replaced => Some(&mut out.credentials_replaced),
            Outcome::Created => Some(&mut out.credentials_created),
        };
        if let Some(units) = credentials {
            units.extend(f.credential_for.iter().cloned());
        }
        out.files
            .insert(f.path.display().to_string(), sha256_hex(&data));
    }
    Ok(out)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    Unchanged,
    Replaced,
    Created,
}

/// Writes one file unless it already holds `data`; either way owner and mode end right.
fn write_one(path: &Path, data: &[u8], uid: u32, gid: u32, mode: u32) -> std::io::Result<Outcome> {
    let (dir, name) = open_parent(path, true)?;
    let existing = open_regular(&dir, name)?;
    let mut outcome = Outcome::Created;
    if let Some((fd, stat)) = existing {
        if holds(&fd, &stat, data)? {
            // Same content: only put owner and mode right, through the open file.
            if stat.st_uid != uid || stat.st_gid != gid {
                rfs::fchown(
                    &fd,
                    Some(rfs::Uid::from_raw(uid)),
                    Some(rfs::Gid::from_raw(gid)),
                )?;
            }
            if stat.st_mode & 0o7777 != mode {
                rfs::fchmod(&fd, Mode::from_raw_mode(mode))?;
            }
            return Ok(Outcome::Unchanged);
        }
        outcome = Outcome::Replaced;
    } else if rfs::statat(&dir, name, rfs::AtFlags::SYMLINK_NOFOLLOW).is_ok() {
        // Something that is not a regular file (a link, a FIFO) sits there: replaced.
        outcome = Outcome::Replaced;
    }
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut tmp = OsString::from(".");
    tmp.push(name);
    tmp.push(format!(
        ".fort-tmp.{}.{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let tmp = OsString::from_vec(tmp.into_vec());
    let result = (|| {
        write_new(&dir, &tmp, data, uid, gid, mode)?;
        fort_core::crash::point("deliver.file.temp");
        rfs::renameat(&dir, tmp.as_os_str(), &dir, name)?;
        rfs::fsync(&dir)?;
        Ok::<(), rustix::io::Errno>(())
    })();
    if let Err(e) = result {
        let _ = rfs::unlinkat(&dir, tmp.as_os_str(), rfs::AtFlags::empty());
        return Err(e.into());
    }
    Ok(outcome)
}

/// Makes `name` in `dir` (exclusively, never through a link) holding `data`, with its
/// owner and mode set and its content on disk before anyone can see it by another name.
pub(crate) fn write_new(
    dir: impl AsFd,
    name: &OsStr,
    data: &[u8],
    uid: u32,
    gid: u32,
    mode: u32,
) -> rustix::io::Result<()> {
    let file = rfs::openat(
        dir,
        name,
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )?;
    let mut written = 0;
    while written < data.len() {
        written += rustix::io::write(&file, &data[written..])?;
    }
    // Owner and mode before the file has its name: no reader ever sees it otherwise.
    rfs::fchown(
        &file,
        Some(rfs::Uid::from_raw(uid)),
        Some(rfs::Gid::from_raw(gid)),
    )?;
    rfs::fchmod(&file, Mode::from_raw_mode(mode))?;
    rfs::fsync(&file)
}

/// The first file that no longer holds what was written (a reboot empties `/run`; a local
/// user may have replaced it), if any. Reads are bounded and never block.
pub fn missing(files: &BTreeMap<String, String>) -> Option<String> {
    for (path, sha) in files {
        if !still_holds(Path::new(path), sha) {
            return Some(path.clone());
        }
    }
    None
}

/// The bytes at `path` if they still hash to `sha` (an encrypted file as it was
/// written), read without following links; `None` otherwise.
pub(crate) fn read_if_holds(path: &Path, sha: &str) -> Option<Vec<u8>> {
    let (dir, name) = open_parent(path, false).ok()?;
    let (fd, stat) = open_regular(&dir, name).ok()??;
    if u64::try_from(stat.st_size).map_or(true, |s| s > MAX_COMPARE_BYTES) {
        return None;
    }
    let mut bytes = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = rustix::io::read(&fd, &mut buf).ok()?;
        if n == 0 {
            break;
        }
        bytes.extend_from_slice(&buf[..n]);
        if bytes.len() as u64 > MAX_COMPARE_BYTES {
            return None;
        }
    }
    (sha256_hex(&bytes) == sha).then_some(bytes)
}

fn still_holds(path: &Path, sha: &str) -> bool {
    let Ok((dir, name)) = open_parent(path, false) else {
        return false;
    };
    match open_regular(&dir, name) {
        Ok(Some((fd, stat))) => sha256_of(&fd, &stat).ok().flatten().as_deref() == Some(sha),
        _ => false,
    }
}

/// Removes the files of a need that is gone. Only files (never a directory), and only
/// through their real parent directories.
pub fn remove_all<'a>(paths: impl IntoIterator<Item = &'a String>) {
    for path in paths {
        match remove_one(Path::new(path)) {
            Ok(true) => {
                tracing::info!(file = %path, "removed the file of a need no longer declared")
            }
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(file = %path, error = %e, "cannot remove the file of a need no longer declared")
            }
        }
    }
}

fn remove_one(path: &Path) -> std::io::Result<bool> {
    let (dir, name) = match open_parent(path, false) {
        Ok(found) => found,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    match rfs::statat(&dir, name, rfs::AtFlags::SYMLINK_NOFOLLOW) {
        Ok(st) if rfs::FileType::from_raw_mode(st.st_mode) == rfs::FileType::Directory => Ok(false),
        Ok(_) => {
            rfs::unlinkat(&dir, name, rfs::AtFlags::empty())?;
            Ok(true)
        }
        Err(rustix::io::Errno::NOENT) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The payload's files alone, as most tests write them.
    fn write_all(files: &[FileSpec], payload: &[u8]) -> Result<Written, String> {
        super::write_all(files, payload, Vec::new(), None, &Sealed::new())
    }
    use std::os::unix::fs::MetadataExt;

    fn spec(path: &Path, pointer: &str) -> FileSpec {
        let me = unsafe_free_ids();
        FileSpec {
            name: Some("f".into()),
            path: path.to_path_buf(),
            pointer: pointer.into(),
            owner: me.0.to_string(),
            group: me.1.to_string(),
            mode: "0440".into(),
            credential_for: Vec::new(),
            encrypt: None,
        }
    }

    #[test]
    fn credential_units_restart_when_replaced_not_when_created() {
        let dir = tempfile::tempdir().unwrap();
        let mut cred = spec(&dir.path().join("token"), "/t");
        cred.credential_for = vec!["wiki.service".into()];
        let other = spec(&dir.path().join("cert"), "/c");
        let files = [cred, other];
        let restart = vec!["nginx.service".to_owned(), "wiki.service".to_owned()];
        // Created: its path unit starts wiki, even though restart_units names it too.
        let w = write_all(&files, br#"{"t":"1","c":"1"}"#).unwrap();
        assert_eq!(w.restarts(&restart), ["nginx.service"]);
        // Replaced: wiki restarts (once), with the need's own units.
        let w = write_all(&files, br#"{"t":"2","c":"1"}"#).unwrap();
        assert_eq!(w.restarts(&[]), ["wiki.service"]);
        assert_eq!(w.restarts(&restart), ["nginx.service", "wiki.service"]);
        // Only the other file changed: wiki keeps running.
        let w = write_all(&files, br#"{"t":"2","c":"2"}"#).unwrap();
        assert!(w.changed);
        assert_eq!(w.restarts(&[]), Vec::<String>::new());
        // Nothing changed: nothing to restart (the caller restarts only on a change).
        let w = write_all(&files, br#"{"t":"2","c":"2"}"#).unwrap();
        assert!(!w.changed && w.credentials_replaced.is_empty());
        // Gone (a reboot emptied /run) and written again: left to the path unit.
        std::fs::remove_file(dir.path().join("token")).unwrap();
        let w = write_all(&files, br#"{"t":"2","c":"2"}"#).unwrap();
        assert_eq!(w.restarts(&restart), ["nginx.service"]);
    }

    fn unsafe_free_ids() -> (u32, u32) {
        let meta = std::fs::metadata("/proc/self").unwrap();
        (meta.uid(), meta.gid())
    }

    #[test]
    fn pointers_strings_and_json() {
        let p = br#"{"client_secret":"s3","nested":{"a":1}}"#;
        assert_eq!(content(p, "/client_secret").unwrap(), b"s3");
        assert_eq!(content(p, "/nested").unwrap(), br#"{"a":1}"#);
        assert_eq!(content(p, "").unwrap(), p);
        assert!(content(p, "/nope")
            .unwrap_err()
            .contains("nothing at /nope"));
        assert!(content(b"PEM", "/x").unwrap_err().contains("not JSON"));
    }

    #[test]
    fn writes_atomically_and_only_on_change() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("deep/er/secret");
        let files = [spec(&path, "/s")];
        let w = write_all(&files, br#"{"s":"one"}"#).unwrap();
        assert!(w.changed);
        assert_eq!(std::fs::read(&path).unwrap(), b"one");
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(meta.mode() & 0o7777, 0o440);
        assert_eq!(
            std::fs::metadata(dir.path().join("deep")).unwrap().mode() & 0o777,
            0o755
        );
        let ino = meta.ino();
        // The same content again: nothing written.
        assert!(
            !write_all(&files, br#"{"s":"one","other":1}"#)
                .unwrap()
                .changed
        );
        assert_eq!(std::fs::metadata(&path).unwrap().ino(), ino);
        assert!(write_all(&files, br#"{"s":"two"}"#).unwrap().changed);
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        assert!(missing(&write_all(&files, br#"{"s":"two"}"#).unwrap().files).is_none());
    }

    #[test]
    fn an_unknown_owner_writes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let mut f = spec(&dir.path().join("x"), "");
        f.owner = "no-such-user-here".into();
        let err = write_all(&[f], b"payload").unwrap_err();
        assert!(
            err.contains("user no-such-user-here does not exist"),
            "{err}"
        );
        assert!(!dir.path().join("x").exists());
    }

    #[test]
    fn a_symlinked_parent_is_never_written_through_nor_removed_through() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::create_dir(&victim).unwrap();
        std::fs::write(victim.join("secret"), "theirs").unwrap();
        std::fs::create_dir(dir.path().join("shared")).unwrap();
        std::os::unix::fs::symlink(&victim, dir.path().join("shared/sub")).unwrap();
        let path = dir.path().join("shared/sub/secret");
        let err = write_all(&[spec(&path, "")], b"mine").unwrap_err();
        assert!(err.contains("symbolic link"), "{err}");
        assert_eq!(std::fs::read(victim.join("secret")).unwrap(), b"theirs");
        remove_all([&path.display().to_string()]);
        assert!(victim.join("secret").exists());
        assert!(missing(&[(path.display().to_string(), sha256_hex(b"theirs"))].into()).is_some());
    }

    #[test]
    fn fifos_links_and_huge_files_are_not_what_was_written() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let sha = sha256_hex(b"data");
        let files: BTreeMap<String, String> = [(path.display().to_string(), sha)].into();
        assert!(std::process::Command::new("mkfifo")
            .arg(&path)
            .status()
            .unwrap()
            .success());
        assert!(missing(&files).is_some(), "a FIFO");
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &path).unwrap();
        assert!(missing(&files).is_some(), "a link to /dev/zero");
        std::fs::remove_file(&path).unwrap();
        std::fs::File::create(&path)
            .unwrap()
            .set_len(1 << 31)
            .unwrap();
        assert!(missing(&files).is_some(), "a huge sparse file");
        // And a FIFO in the file's place is replaced by the next write, not read.
        std::fs::remove_file(&path).unwrap();
        assert!(std::process::Command::new("mkfifo")
            .arg(&path)
            .status()
            .unwrap()
            .success());
        let w = write_all(&[spec(&path, "")], b"data").unwrap();
        assert!(w.changed);
        assert!(missing(&w.files).is_none());
    }

    #[test]
    fn owner_minus_one_is_refused() {
        assert!(account_id("4294967295", false).is_err());
        assert_eq!(account_id("0", false), Ok(0));
    }
}
