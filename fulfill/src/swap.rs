//! A need's files replaced together (docs/protocol.md §11.3): when every file and key of a
//! need lives in one directory of its own, the new set is built complete in a directory
//! beside it, `.<dir>.fort-dir`, and exchanged with it in one
//! `renameat2(RENAME_EXCHANGE)`. A reader that opens the files by their paths then finds
//! every old file or every new one, never a new key with the old certificate; a crash
//! leaves either the old directory or the new one in place, and at worst the other one
//! as `.<dir>.fort-dir` beside it, removed at the next start or replacement. Only the
//! need's own applier (one at a time) replaces its own directory, so that one name is
//! never used by two replacements at once.
//!
//! Anything this cannot do (the directory holds something else, the file system cannot
//! exchange, the parent is read-only) returns `None`, and the files are written one by
//! one as before.

use std::ffi::{OsStr, OsString};
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use rustix::fs::{self as rfs, AtFlags, FileType, Mode, OFlags, RenameFlags};
use rustix::io::Errno;

use crate::files::{write_new, Outcome, Planned};
use crate::safe_path::{holds, open_parent, open_regular};

fn dir_flags() -> OFlags {
    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC
}

/// The name the new set is built under, and the old one removed from.
fn temp_name(dir: &OsStr) -> OsString {
    let mut name = OsString::from(".");
    name.push(dir);
    name.push(".fort-dir");
    name
}

/// A temporary file a per-file write leaves behind when interrupted (`files`).
fn is_file_temp(name: &OsStr) -> bool {
    let name = name.as_bytes();
    name.starts_with(b".") && name.windows(10).any(|w| w == b".fort-tmp.")
}

/// The entries of a directory, without `.` and `..`, and whether each is a directory.
fn entries(dir: impl AsFd) -> io::Result<Vec<(OsString, bool)>> {
    let dir = dir.as_fd();
    let mut out = Vec::new();
    for entry in rfs::Dir::read_from(dir)? {
        let entry = entry?;
        let name = OsStr::from_bytes(entry.file_name().to_bytes());
        if name == "." || name == ".." {
            continue;
        }
        let is_dir = match entry.file_type() {
            FileType::Directory => true,
            FileType::Unknown => rfs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW)
                .is_ok_and(|st| FileType::from_raw_mode(st.st_mode) == FileType::Directory),
            _ => false,
        };
        out.push((name.to_owned(), is_dir));
    }
    Ok(out)
}

/// Removes `name` in `parent`: its files (never a directory inside it), then itself.
fn remove_dir(parent: &OwnedFd, name: &OsStr) -> io::Result<()> {
    let dir = rfs::openat(parent, name, dir_flags(), Mode::empty())?;
    for (entry, is_dir) in entries(&dir)? {
        if !is_dir {
            rfs::unlinkat(&dir, entry.as_os_str(), AtFlags::empty())?;
        }
    }
    rfs::unlinkat(parent, name, AtFlags::REMOVEDIR)?;
    Ok(())
}

/// Removes what a replacement of `dir` (a name in `parent`) that was interrupted left
/// beside it: it may hold a private key.
fn sweep_in(parent: &OwnedFd, dir: &OsStr) {
    let temp = temp_name(dir);
    match remove_dir(parent, &temp) {
        Ok(()) => tracing::info!(
            directory = %temp.to_string_lossy(),
            "removed a directory an interrupted replacement of a need's files left"
        ),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
        Err(e) => tracing::warn!(
            directory = %temp.to_string_lossy(),
            error = %e,
            "cannot remove a directory an interrupted replacement of a need's files left"
        ),
    }
}

/// At start, before any payload is applied: removes what replacements of `dirs`
/// interrupted by a crash left beside them.
pub(crate) fn sweep<'a>(dirs: impl IntoIterator<Item = &'a Path>) {
    for dir in dirs {
        if let Ok((parent, name)) = open_parent(dir, false) {
            sweep_in(&parent, name);
        }
    }
}

/// Writes `planned` (every file and key of one need, all directly in `dir`) by building
/// the new set beside `dir` and exchanging the two. `None`: not done, nothing changed;
/// write the files one by one instead.
pub(crate) fn write(dir: &Path, planned: &[Planned]) -> Option<Vec<Outcome>> {
    match try_write(dir, planned) {
        Ok(done) => done,
        Err(e) => {
            tracing::debug!(directory = %dir.display(), error = %e, "files not replaced together; writing them one by one");
            None
        }
    }
}

fn try_write(dir: &Path, planned: &[Planned]) -> io::Result<Option<Vec<Outcome>>> {
    let (parent, name) = open_parent(dir, true)?;
    // Only this need's applier replaces this directory: whatever an earlier attempt
    // left is garbage now.
    sweep_in(&parent, name);
    let current = match rfs::openat(&parent, name, dir_flags(), Mode::empty()) {
        Ok(fd) => Some(fd),
        Err(Errno::NOENT) => None,
        Err(e) => return Err(e.into()),
    };
    let names: Vec<&OsStr> = planned
        .iter()
        .map(|p| p.file.path.file_name().unwrap_or_default())
        .collect();
    // Nothing but the need's own files (and what an interrupted write of one left) may be
    // carried away by the exchange.
    if let Some(d) = &current {
        for (entry, is_dir) in entries(d)? {
            if is_dir || !(names.contains(&entry.as_os_str()) || is_file_temp(&entry)) {
                return Ok(None);
            }
        }
    }
    let mut outcomes = Vec::with_capacity(planned.len());
    for (p, file) in planned.iter().zip(&names) {
        let outcome = match &current {
            None => Outcome::Created,
            Some(d) => match open_regular(d, file)? {
                Some((fd, st)) if holds(&fd, &st, &p.data)? => Outcome::Unchanged,
                Some(_) => Outcome::Replaced,
                None if rfs::statat(d, *file, AtFlags::SYMLINK_NOFOLLOW).is_ok() => {
                    Outcome::Replaced
                }
                None => Outcome::Created,
            },
        };
        outcomes.push(outcome);
    }
    // Nothing new: owner and mode are put right in place, one file at a time.
    if outcomes.iter().all(|o| *o == Outcome::Unchanged) {
        return Ok(None);
    }
    let temp = temp_name(name);
    rfs::mkdirat(&parent, temp.as_os_str(), Mode::from_raw_mode(0o700))?;
    let result = (|| {
        let new = rfs::openat(&parent, temp.as_os_str(), dir_flags(), Mode::empty())?;
        for ((p, file), outcome) in planned.iter().zip(&names).zip(&outcomes) {
            // An unchanged file keeps its inode: linked, not copied.
            if *outcome == Outcome::Unchanged {
                if let Some(d) = &current {
                    if rfs::linkat(d, *file, &new, *file, AtFlags::empty()).is_ok() {
                        if let Some((fd, st)) = open_regular(&new, file)? {
                            if st.st_uid != p.uid || st.st_gid != p.gid {
                                rfs::fchown(
                                    &fd,
                                    Some(rfs::Uid::from_raw(p.uid)),
                                    Some(rfs::Gid::from_raw(p.gid)),
                                )?;
                            }
                            if st.st_mode & 0o7777 != p.mode {
                                rfs::fchmod(&fd, Mode::from_raw_mode(p.mode))?;
                            }
                            continue;
                        }
                    }
                }
            }
            write_new(&new, file, &p.data, p.uid, p.gid, p.mode)?;
        }
        // The directory keeps its owner and mode; a new one gets what `open_parent`
        // gives a directory it makes.
        match &current {
            Some(d) => {
                let st = rfs::fstat(d)?;
                rfs::fchown(
                    &new,
                    Some(rfs::Uid::from_raw(st.st_uid)),
                    Some(rfs::Gid::from_raw(st.st_gid)),
                )?;
                rfs::fchmod(&new, Mode::from_raw_mode(st.st_mode & 0o7777))?;
            }
            None => rfs::fchmod(&new, Mode::from_raw_mode(0o755))?,
        }
        rfs::fsync(&new)?;
        fort_core::crash::point("deliver.file.temp");
        let flags = if current.is_some() {
            RenameFlags::EXCHANGE
        } else {
            RenameFlags::NOREPLACE
        };
        rfs::renameat_with(&parent, temp.as_os_str(), &parent, name, flags)?;
        Ok::<(), io::Error>(())
    })();
    // Under the temporary name now: the new set if the exchange failed, the old one if it
    // was made, nothing if the directory was made new.
    if let Err(e) = result {
        if let Err(e) = remove_dir(&parent, &temp) {
            tracing::warn!(directory = %dir.display(), error = %e, "cannot remove an unfinished replacement of a need's files");
        }
        return Err(e);
    }
    if current.is_some() {
        if let Err(e) = remove_dir(&parent, &temp) {
            tracing::warn!(directory = %dir.display(), error = %e, "cannot remove the replaced files of a need; removed at the next start");
        }
    }
    // Done whatever happens now: what the exchange did is reported, not written again.
    if let Err(e) = rfs::fsync(&parent) {
        tracing::warn!(directory = %dir.display(), error = %e, "cannot sync the directory of a need's files");
    }
    Ok(Some(outcomes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    use fort_core::schema::FileSpec;

    #[test]
    fn temporary_files_are_told_apart() {
        assert_eq!(temp_name(OsStr::new("web")), ".web.fort-dir");
        assert!(is_file_temp(OsStr::new(".key.pem.fort-tmp.12.3")));
        assert!(!is_file_temp(OsStr::new("key.pem")));
    }

    fn spec(path: &Path, pointer: &str) -> FileSpec {
        let me = std::fs::metadata("/proc/self").unwrap();
        FileSpec {
            name: None,
            path: path.to_path_buf(),
            pointer: pointer.into(),
            owner: me.uid().to_string(),
            group: me.gid().to_string(),
            mode: "0640".into(),
            credential_for: Vec::new(),
            encrypt: None,
        }
    }

    fn ino(path: &Path) -> u64 {
        std::fs::metadata(path).unwrap().ino()
    }

    #[test]
    fn a_directory_of_its_own_is_exchanged_whole() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("needs/ssl-cert/web");
        let files = [
            spec(&dir.join("key.pem"), "/k"),
            spec(&dir.join("cert.pem"), "/c"),
            spec(&dir.join("chain.pem"), "/ch"),
        ];
        let write = |payload: &str| {
            crate::files::write_all(
                &files,
                payload.as_bytes(),
                Vec::new(),
                Some(&dir),
                &Default::default(),
            )
            .unwrap()
        };
        // Made new: the directory appears with every file in it, 0755.
        let w = write(r#"{"k":"k1","c":"c1","ch":"ca"}"#);
        assert!(w.created && w.changed);
        assert_eq!(std::fs::read_to_string(dir.join("cert.pem")).unwrap(), "c1");
        assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o7777, 0o755);
        assert_eq!(
            std::fs::metadata(dir.join("key.pem")).unwrap().mode() & 0o7777,
            0o640
        );
        // A mode given to the directory by hand is kept across an exchange.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o750)).unwrap();
        let (dir_before, chain_before) = (ino(&dir), ino(&dir.join("chain.pem")));
        let w = write(r#"{"k":"k2","c":"c2","ch":"ca"}"#);
        assert!(w.changed && !w.created);
        assert_ne!(ino(&dir), dir_before, "exchanged");
        assert_eq!(
            ino(&dir.join("chain.pem")),
            chain_before,
            "unchanged: linked"
        );
        assert_eq!(std::fs::read_to_string(dir.join("key.pem")).unwrap(), "k2");
        assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o7777, 0o750);
        // Nothing of the old set is left beside it.
        let beside: Vec<_> = std::fs::read_dir(dir.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(beside, ["web"]);
        // The same payload again: nothing is touched.
        let dir_now = ino(&dir);
        assert!(!write(r#"{"k":"k2","c":"c2","ch":"ca"}"#).changed);
        assert_eq!(ino(&dir), dir_now);
        // What a crash left beside it is removed by the next replacement.
        let leftover = dir.parent().unwrap().join(".web.fort-dir");
        std::fs::create_dir(&leftover).unwrap();
        std::fs::write(leftover.join("key.pem"), "old").unwrap();
        write(r#"{"k":"k3","c":"c3","ch":"ca"}"#);
        assert!(!leftover.exists());
        assert_eq!(std::fs::read_to_string(dir.join("cert.pem")).unwrap(), "c3");
    }

    #[test]
    fn a_directory_with_anything_else_in_it_is_written_file_by_file() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("shared");
        let files = [spec(&dir.join("a"), "/a"), spec(&dir.join("b"), "/b")];
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(dir.join("someone-else"), "theirs").unwrap();
        let before = ino(&dir);
        let w = crate::files::write_all(
            &files,
            br#"{"a":"1","b":"2"}"#,
            Vec::new(),
            Some(&dir),
            &Default::default(),
        )
        .unwrap();
        assert!(w.changed);
        assert_eq!(ino(&dir), before, "not exchanged");
        assert_eq!(
            std::fs::read_to_string(dir.join("someone-else")).unwrap(),
            "theirs"
        );
        assert_eq!(std::fs::read_to_string(dir.join("b")).unwrap(), "2");
    }

    #[test]
    fn only_a_directory_no_other_need_uses_is_a_need_own() {
        use crate::reload::own_directory;
        use fort_core::names::NeedKey;
        use fort_core::schema::{NeedSpec, Needs};
        let spec = |paths: &[&str]| -> NeedSpec {
            let files: Vec<_> = paths
                .iter()
                .map(|p| serde_json::json!({ "path": p }))
                .collect();
            serde_json::from_value(
                serde_json::json!({"from": "p", "request": {}, "nag_seconds": 5, "files": files}),
            )
            .unwrap()
        };
        let (a, b) = (
            NeedKey::parse("t/a").unwrap(),
            NeedKey::parse("t/b").unwrap(),
        );
        let mut needs = Needs::new();
        needs.insert(a.clone(), spec(&["/run/n/a/key", "/run/n/a/cert"]));
        needs.insert(b.clone(), spec(&["/run/n/b/key", "/run/n/b/cert"]));
        let own = |needs: &Needs, k: &NeedKey| own_directory(needs, k, &needs[k]);
        assert_eq!(own(&needs, &a).as_deref(), Some(Path::new("/run/n/a")));
        // Another need's file below it, a single file, files in two directories: none.
        needs.insert(b.clone(), spec(&["/run/n/a/sub/key", "/run/n/b/cert"]));
        assert_eq!(own(&needs, &a), None);
        needs.insert(b.clone(), spec(&["/run/n/b/key", "/run/n/b/cert"]));
        assert!(own(&needs, &a).is_some());
        needs.insert(a.clone(), spec(&["/run/n/a/key"]));
        assert_eq!(own(&needs, &a), None);
        needs.insert(a.clone(), spec(&["/run/n/a/key", "/run/n/c/cert"]));
        assert_eq!(own(&needs, &a), None);
        needs.insert(a.clone(), spec(&["/key", "/cert"]));
        assert_eq!(own(&needs, &a), None, "never /");
    }
}
