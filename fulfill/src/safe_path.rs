//! Reaching a delivered file's directory without trusting the file system on the way
//! (docs/protocol.md §11.3): every component is opened from `/` with `O_NOFOLLOW` and
//! `O_DIRECTORY`, so a local user who swaps a parent directory for a symbolic link cannot
//! redirect where root writes, what it reads, or what it deletes. Reads are bounded and
//! never block (a FIFO, a device or a huge sparse file in the file's place is "not what
//! was written", not a hang).

use std::ffi::OsStr;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Component, Path};

use rustix::fs::{self as rfs, FileType, Mode, OFlags};
use sha2::{Digest, Sha256};

/// Largest file compared or hashed; anything longer cannot be a payload fort wrote.
pub const MAX_COMPARE_BYTES: u64 = 64 * 1024 * 1024;

fn dir_flags() -> OFlags {
    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC
}

/// Why a path cannot be reached safely.
fn refused(path: &Path, component: &OsStr, e: io::Error) -> io::Error {
    let why = match e.raw_os_error() {
        Some(libc::ELOOP) | Some(libc::ENOTDIR) => {
            "is a symbolic link or not a directory; fort never writes through one".to_owned()
        }
        _ => e.to_string(),
    };
    io::Error::new(
        e.kind(),
        format!(
            "{}: parent {:?} {why}",
            path.display(),
            component.to_string_lossy()
        ),
    )
}

/// The directory that holds `path` (opened without following any link) and the file's
/// name in it. With `create`, missing directories are made mode 0755 whatever the umask
/// (a service must traverse them to reach its own file), owned by the agent's user.
pub fn open_parent(path: &Path, create: bool) -> io::Result<(OwnedFd, &OsStr)> {
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "a path without a name"))?;
    if !path.is_absolute() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is not absolute", path.display()),
        ));
    }
    let mut dir = rfs::openat(rfs::CWD, "/", dir_flags(), Mode::empty())?;
    let parent = path.parent().unwrap_or(Path::new("/"));
    for component in parent.components() {
        let part = match component {
            Component::RootDir => continue,
            Component::Normal(p) => p,
            // needs.json refuses `.` and `..`; refuse them here too rather than resolve.
            _ => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{}: `.` or `..` in the path", path.display()),
                ))
            }
        };
        let next = match rfs::openat(&dir, part, dir_flags(), Mode::empty()) {
            Ok(fd) => fd,
            Err(e) if e == rustix::io::Errno::NOENT && create => {
                match rfs::mkdirat(&dir, part, Mode::from_raw_mode(0o755)) {
                    Ok(()) | Err(rustix::io::Errno::EXIST) => {}
                    Err(e) => return Err(refused(path, part, e.into())),
                }
                let fd = rfs::openat(&dir, part, dir_flags(), Mode::empty())
                    .map_err(|e| refused(path, part, e.into()))?;
                rfs::fchmod(&fd, Mode::from_raw_mode(0o755))?;
                fd
            }
            Err(e) => return Err(refused(path, part, e.into())),
        };
        dir = next;
    }
    Ok((dir, name))
}

/// Opens `name` in `dir` for reading: never through a link, never blocking, regular files
/// only. `Ok(None)`: nothing there, or something that is not a regular file.
pub fn open_regular(dir: impl AsFd, name: &OsStr) -> io::Result<Option<(OwnedFd, rfs::Stat)>> {
    let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC;
    let fd = match rfs::openat(dir, name, flags, Mode::empty()) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::NOENT | rustix::io::Errno::LOOP) => return Ok(None),
        // A FIFO with no writer, a socket, a device we may not open: not ours.
        Err(rustix::io::Errno::NXIO | rustix::io::Errno::ACCESS | rustix::io::Errno::PERM) => {
            return Ok(None)
        }
        Err(e) => return Err(e.into()),
    };
    let stat = rfs::fstat(&fd)?;
    if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile {
        return Ok(None);
    }
    Ok(Some((fd, stat)))
}

/// Whether the open file holds exactly `data` (its size is checked first).
pub fn holds(fd: impl AsFd, stat: &rfs::Stat, data: &[u8]) -> io::Result<bool> {
    if u64::try_from(stat.st_size).ok() != Some(data.len() as u64) {
        return Ok(false);
    }
    let mut buf = vec![0u8; 64 * 1024];
    let mut offset = 0;
    loop {
        let n = rustix::io::read(&fd, &mut buf)?;
        if n == 0 {
            return Ok(offset == data.len());
        }
        if offset + n > data.len() || buf[..n] != data[offset..offset + n] {
            return Ok(false);
        }
        offset += n;
    }
}

/// SHA-256 (lower-case hex) of the open file, reading at most [`MAX_COMPARE_BYTES`];
/// `None` when it is longer.
pub fn sha256_of(fd: impl AsFd, stat: &rfs::Stat) -> io::Result<Option<String>> {
    if u64::try_from(stat.st_size).map_or(true, |s| s > MAX_COMPARE_BYTES) {
        return Ok(None);
    }
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 64 * 1024];
    let mut total: u64 = 0;
    loop {
        let n = rustix::io::read(&fd, &mut buf)?;
        if n == 0 {
            break;
        }
        total += n as u64;
        if total > MAX_COMPARE_BYTES {
            return Ok(None);
        }
        hasher.update(&buf[..n]);
    }
    Ok(Some(hex::encode(hasher.finalize())))
}

/// A parent of `path` that a user other than root (and `owner`) could replace or fill:
/// owned by someone else, or writable by its group (unless root's) or by everyone. Such a
/// directory lets that user choose what the delivered file's directory is.
pub fn unsafe_parent(path: &Path, owner: Option<u32>) -> Option<String> {
    let parent = path.parent()?;
    let mut current = std::path::PathBuf::from("/");
    let mut dir = rfs::openat(rfs::CWD, "/", dir_flags(), Mode::empty()).ok()?;
    let check = |dir: &OwnedFd, shown: &Path| -> Option<String> {
        let st = rfs::fstat(dir).ok()?;
        let mode = st.st_mode & 0o7777;
        let trusted_owner = st.st_uid == 0 || Some(st.st_uid) == owner;
        if !trusted_owner {
            return Some(format!(
                "{} is owned by uid {}, who could replace what is below it",
                shown.display(),
                st.st_uid
            ));
        }
        if mode & 0o002 != 0 || (mode & 0o020 != 0 && st.st_gid != 0) {
            return Some(format!(
                "{} is writable by {}",
                shown.display(),
                if mode & 0o002 != 0 {
                    "everyone".to_owned()
                } else {
                    format!("group {}", st.st_gid)
                }
            ));
        }
        None
    };
    if let Some(why) = check(&dir, &current) {
        return Some(why);
    }
    for component in parent.components() {
        let Component::Normal(part) = component else {
            continue;
        };
        current.push(part);
        match rfs::openat(&dir, part, dir_flags(), Mode::empty()) {
            Ok(fd) => dir = fd,
            Err(rustix::io::Errno::LOOP | rustix::io::Errno::NOTDIR) => {
                return Some(format!(
                    "{} is a symbolic link or not a directory",
                    current.display()
                ))
            }
            // Missing from here down: the agent creates the rest, root-owned and 0755.
            Err(_) => return None,
        }
        if let Some(why) = check(&dir, &current) {
            return Some(why);
        }
    }
    None
}
