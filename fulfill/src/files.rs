//! Files written from a payload (docs/protocol.md §11.3): the content is the payload or
//! the value at a JSON pointer in it; each file is written atomically with its owner,
//! group and mode already set when it appears; and an unchanged file is not touched at
//! all, so nothing restarts for a payload that did not change.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use fort_core::canonical::sha256_hex;
use fort_core::schema::FileSpec;

/// What writing a payload's files did.
#[derive(Debug, Default)]
pub struct Written {
    /// path → SHA-256 of the content now there.
    pub files: BTreeMap<String, String>,
    /// Whether any file's content changed (the units restart only then).
    pub changed: bool,
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

/// Looks a user or group up through NSS (so systemd's dynamic users and directory
/// services count), or takes a numeric id as is.
#[allow(unsafe_code)]
fn account_id(name: &str, group: bool) -> Result<u32, String> {
    if let Ok(id) = name.parse::<u32>() {
        return Ok(id);
    }
    let what = if group { "group" } else { "user" };
    let cname = CString::new(name).map_err(|_| format!("{what} {name:?} is not a name"))?;
    let mut buf = vec![0u8; 4096];
    loop {
        let mut result: *mut libc::c_void = std::ptr::null_mut();
        // SAFETY: getpwnam_r/getgrnam_r write only into `entry` and `buf`, whose sizes are
        // passed; `result` points at `entry` or is null. Strings inside are not read.
        let (rc, id) = unsafe {
            if group {
                let mut entry: libc::group = std::mem::zeroed();
                let rc = libc::getgrnam_r(
                    cname.as_ptr(),
                    &mut entry,
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    (&mut result as *mut *mut libc::c_void).cast(),
                );
                (rc, entry.gr_gid)
            } else {
                let mut entry: libc::passwd = std::mem::zeroed();
                let rc = libc::getpwnam_r(
                    cname.as_ptr(),
                    &mut entry,
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    (&mut result as *mut *mut libc::c_void).cast(),
                );
                (rc, entry.pw_uid)
            }
        };
        if rc == libc::ERANGE && buf.len() < 1 << 20 {
            buf.resize(buf.len() * 4, 0);
            continue;
        }
        if rc != 0 {
            return Err(format!(
                "cannot look up {what} {name}: {}",
                std::io::Error::from_raw_os_error(rc)
            ));
        }
        if result.is_null() {
            return Err(format!("{what} {name} does not exist (yet)"));
        }
        return Ok(id);
    }
}

/// Writes every file of a need from `payload`. Everything that can fail before a byte
/// is written (a pointer, an owner that does not exist yet) is checked for all files
/// first, so a payload is applied to all of its files or to none.
pub fn write_all(files: &[FileSpec], payload: &[u8]) -> Result<Written, String> {
    let mut planned = Vec::with_capacity(files.len());
    for f in files {
        let label = f.label();
        let data = content(payload, &f.pointer).map_err(|e| format!("file {label}: {e}"))?;
        let uid = account_id(&f.owner, false).map_err(|e| format!("file {label}: {e}"))?;
        let gid = account_id(&f.group, true).map_err(|e| format!("file {label}: {e}"))?;
        planned.push((f, data, uid, gid));
    }
    let mut out = Written::default();
    for (f, data, uid, gid) in planned {
        let changed = write_one(&f.path, &data, uid, gid, f.mode_bits())
            .map_err(|e| format!("file {}: cannot write {}: {e}", f.label(), f.path.display()))?;
        out.changed |= changed;
        out.files
            .insert(f.path.display().to_string(), sha256_hex(&data));
    }
    Ok(out)
}

/// Creates the missing directories of `dir` with mode 0755, whatever the umask (the
/// agent runs with 0077): a service must traverse them to reach its own file. Existing
/// directories are left as they are.
fn create_traversable(dir: &Path) -> std::io::Result<()> {
    let missing: Vec<&Path> = dir
        .ancestors()
        .take_while(|d| std::fs::symlink_metadata(d).is_err())
        .collect();
    for d in missing.into_iter().rev() {
        match std::fs::DirBuilder::new().mode(0o755).create(d) {
            Ok(()) => std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755))?,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes one file unless it already holds `data` with this owner and mode; returns
/// whether the content changed.
fn write_one(path: &Path, data: &[u8], uid: u32, gid: u32, mode: u32) -> std::io::Result<bool> {
    let dir = path.parent().unwrap_or(Path::new("/"));
    create_traversable(dir)?;
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if meta.file_type().is_file() && meta.len() == data.len() as u64 {
            let same = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW)
                .open(path)
                .and_then(|mut f| {
                    let mut old = Vec::with_capacity(data.len());
                    std::io::Read::read_to_end(&mut f, &mut old)?;
                    Ok((old == data, f))
                });
            if let Ok((true, file)) = same {
                // Same content: only put owner and mode right, through the open file.
                if meta.uid() != uid || meta.gid() != gid {
                    std::os::unix::fs::fchown(&file, Some(uid), Some(gid))?;
                }
                if meta.mode() & 0o7777 != mode {
                    file.set_permissions(std::fs::Permissions::from_mode(mode))?;
                }
                return Ok(false);
            }
        }
    }
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = dir.join(format!(
        ".{name}.fort-tmp.{}.{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let result = (|| {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)?;
        file.write_all(data)?;
        // Owner and mode before the file has its name: no reader ever sees it otherwise.
        std::os::unix::fs::fchown(&file, Some(uid), Some(gid))?;
        file.set_permissions(std::fs::Permissions::from_mode(mode))?;
        file.sync_all()?;
        drop(file);
        std::fs::rename(&tmp, path)?;
        std::fs::File::open(dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map(|()| true)
}

/// Whether every file still holds what was written (a reboot empties `/run`).
pub fn missing(files: &BTreeMap<String, String>) -> Option<String> {
    for (path, sha) in files {
        let ok = std::fs::read(path).is_ok_and(|data| sha256_hex(&data) == *sha);
        if !ok {
            return Some(path.clone());
        }
    }
    None
}

/// Removes the files of a need that is gone. Only files: directories may be shared.
pub fn remove_all<'a>(paths: impl IntoIterator<Item = &'a String>) {
    for path in paths {
        match std::fs::remove_file(path) {
            Ok(()) => tracing::info!(file = %path, "removed the file of a need no longer declared"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(file = %path, error = %e, "cannot remove the file of a need no longer declared")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(path: &Path, pointer: &str) -> FileSpec {
        let me = unsafe_free_ids();
        FileSpec {
            name: Some("f".into()),
            path: path.to_path_buf(),
            pointer: pointer.into(),
            owner: me.0.to_string(),
            group: me.1.to_string(),
            mode: "0440".into(),
        }
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
}
