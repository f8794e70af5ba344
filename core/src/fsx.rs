//! Opening the files fort keeps (state, logs, the audit trail, registries) the one safe
//! way: never through a symbolic link (a link planted in the state directory must not
//! redirect a write, or a cut, to a file outside it), only a regular file (a FIFO named
//! like a state file must not hang a reader or the agent), and reads bounded.

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// `O_NOFOLLOW` refuses a link at the last component; `O_NONBLOCK` makes opening a FIFO
/// return at once instead of waiting for a writer (it changes nothing for a regular file,
/// which is all that is accepted after the open).
const SAFE_FLAGS: i32 = libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC;

fn checked(file: File, path: &Path) -> std::io::Result<File> {
    let kind = file.metadata()?.file_type();
    if kind.is_file() {
        Ok(file)
    } else {
        Err(std::io::Error::other(format!(
            "{} is not a regular file; fort reads and writes only regular files there",
            path.display()
        )))
    }
}

/// Opens an existing regular file for reading.
pub fn open_regular(path: &Path) -> std::io::Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(SAFE_FLAGS)
        .open(path)?;
    checked(file, path)
}

/// Opens an existing regular file for writing in place (cutting a torn tail).
pub fn open_regular_for_write(path: &Path) -> std::io::Result<File> {
    let file = OpenOptions::new()
        .write(true)
        .custom_flags(SAFE_FLAGS)
        .open(path)?;
    checked(file, path)
}

/// Opens a regular file for appending, creating it mode 0600.
pub fn open_append(path: &Path) -> std::io::Result<File> {
    let file = OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .custom_flags(SAFE_FLAGS)
        .open(path)?;
    checked(file, path)
}

/// Opens a regular file for reading and appending, creating it mode 0600.
pub fn open_read_append(path: &Path) -> std::io::Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .create(true)
        .append(true)
        .mode(0o600)
        .custom_flags(SAFE_FLAGS)
        .open(path)?;
    checked(file, path)
}

/// The whole of a regular file, at most `max` bytes (more is an error, not a cut).
pub fn read_regular(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    let file = open_regular(path)?;
    let mut out = Vec::new();
    file.take(max.saturating_add(1)).read_to_end(&mut out)?;
    if out.len() as u64 > max {
        return Err(std::io::Error::other(format!(
            "{} is larger than {max} bytes",
            path.display()
        )));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_fifos_and_large_files_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let outside = dir.path().join("outside");
        std::fs::write(&outside, b"precious").unwrap();
        let link = dir.path().join("state.log.1");
        std::os::unix::fs::symlink(&outside, &link).unwrap();
        assert!(open_regular(&link).is_err());
        assert!(open_regular_for_write(&link).is_err());
        assert!(open_append(&link).is_err());
        assert_eq!(std::fs::read(&outside).unwrap(), b"precious");

        let fifo = dir.path().join("0000000000000001.jsonl");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if made.is_ok_and(|s| s.success()) {
            // Returns at once (no writer is waited for), and is refused.
            let e = open_regular(&fifo).unwrap_err();
            assert!(e.to_string().contains("not a regular file"), "{e}");
            assert!(read_regular(&fifo, 10).is_err());
        }

        let big = dir.path().join("big");
        std::fs::write(&big, vec![b'x'; 11]).unwrap();
        assert!(read_regular(&big, 10).is_err());
        assert_eq!(read_regular(&big, 11).unwrap().len(), 11);
    }
}
