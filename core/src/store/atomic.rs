//! Writing files so that a kill at any instant leaves the old file or the new one:
//! atomic replacement (a temporary file, fsync, rename, fsync of the directory), logs
//! opened for appending, and the temporary files a killed writer leaves, which are never
//! state and are removed once their writer is gone.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

/// Replaces `path` with `bytes`: a crash leaves either the old file or the new one (and
/// perhaps a temporary file, which no reader takes for state: [`temporary_pid`]).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    write_atomic_at(path, bytes, None)
}

/// [`write_atomic`] with crash points after the temporary file is synced and after the
/// rename (docs/crash-points.md).
pub fn write_atomic_at(
    path: &Path,
    bytes: &[u8],
    crash_at: Option<crate::crash::Replace>,
) -> std::io::Result<()> {
    write_atomic_mode(path, bytes, 0o600, crash_at)
}

/// [`write_atomic_at`] for a file another program reads (sshd's `authorized_keys`,
/// Prometheus' targets): its mode set on the temporary file, whatever the umask, so the
/// file never appears with fewer or more permissions than `mode`.
pub fn write_atomic_mode(
    path: &Path,
    bytes: &[u8],
    mode: u32,
    crash_at: Option<crate::crash::Replace>,
) -> std::io::Result<()> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("state");
    let tmp = dir.join(format!(
        ".{name}{TEMP_MARK}{}.{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let result = (|| {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)?;
        if mode != 0o600 {
            use std::os::unix::fs::PermissionsExt;
            file.set_permissions(std::fs::Permissions::from_mode(mode))?;
        }
        file.write_all(bytes)?;
        file.sync_all()?;
        drop(file);
        if let Some(at) = crash_at {
            crate::crash::point(at.temp);
        }
        std::fs::rename(&tmp, path)?;
        if let Some(renamed) = crash_at.and_then(|at| at.renamed) {
            crate::crash::point(renamed);
        }
        std::fs::File::open(dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// What marks a temporary file of [`write_atomic`]: `.<file>.tmp.<pid>.<n>`.
const TEMP_MARK: &str = ".tmp.";

/// The pid of the process that wrote the temporary file `name` (`.<file>.tmp.<pid>.<n>`),
/// or `None` when `name` is not one. Such a file is never state: it is either being
/// written right now, or was left by a process killed before its rename.
pub fn temporary_pid(name: &std::ffi::OsStr) -> Option<u32> {
    let name = name.to_str()?;
    let rest = name.strip_prefix('.')?;
    let at = rest.rfind(TEMP_MARK)?;
    let (pid, n) = rest[at + TEMP_MARK.len()..].split_once('.')?;
    (at > 0 && n.bytes().all(|b| b.is_ascii_digit()) && !n.is_empty())
        .then(|| pid.parse().ok())
        .flatten()
}

/// Whether process `pid` is alive (on this host's /proc).
fn alive(pid: u32) -> bool {
    pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists()
}

/// Removes the temporary files beside `path` that [`write_atomic`] left when its process
/// was killed (their writer is gone); a live writer's are left alone. The number removed.
pub fn remove_stale_temporaries_of(path: &Path) -> usize {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name().and_then(|n| n.to_str())) else {
        return 0;
    };
    let prefix = format!(".{name}{TEMP_MARK}");
    let Ok(entries) = std::fs::read_dir(if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    }) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.filter_map(Result::ok) {
        let file = e.file_name();
        let stale = file.to_str().is_some_and(|f| f.starts_with(&prefix))
            && temporary_pid(&file).is_some_and(|pid| pid != std::process::id() && !alive(pid));
        if stale && std::fs::remove_file(e.path()).is_ok() {
            tracing::info!(file = %e.path().display(), "removed a temporary file a killed process left");
            removed += 1;
        }
    }
    removed
}

/// Opens (creating, mode 0600, never through a symlink) a log for appending.
pub fn open_log(path: &Path) -> std::io::Result<std::fs::File> {
    let file = crate::fsx::open_append(path)?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(file)
}

/// [`remove_stale_temporaries`] in `dir` and every directory below it (not `set-aside/`,
/// whose files are no longer the agent's): the number removed.
pub fn remove_stale_temporaries_below(dir: &Path) -> usize {
    let mut removed = 0;
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        removed += remove_stale_temporaries(&d);
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) && e.file_name() != "set-aside" {
                todo.push(e.path());
            }
        }
    }
    removed
}

/// Removes temporary files a killed process left behind in `dir` (`.<file>.tmp.<pid>.<n>`
/// whose writer is gone; see [`temporary_pid`]).
pub fn remove_stale_temporaries(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.filter_map(Result::ok) {
        let stale = temporary_pid(&e.file_name())
            .is_some_and(|pid| pid != std::process::id() && !alive(pid));
        if stale
            && e.file_type().is_ok_and(|t| t.is_file())
            && std::fs::remove_file(e.path()).is_ok()
        {
            removed += 1;
        }
    }
    removed
}

/// Appends `bytes` to the log (opening it if needed) and syncs it. On failure the file
/// is cut back to its length before, so a partial write never sits between good records;
/// the third value says when even that failed (the log then ends in damage).
pub(super) fn append(
    log: Option<std::fs::File>,
    path: &Path,
    bytes: &[u8],
) -> (Option<std::fs::File>, std::io::Result<u64>, bool) {
    let mut file = match log {
        Some(f) => f,
        None => match open_log(path) {
            Ok(f) => f,
            Err(e) => return (None, Err(e), false),
        },
    };
    let before = match file.metadata() {
        Ok(m) => m.len(),
        Err(e) => return (None, Err(e), false),
    };
    let written = write_with_crash_points(&mut file, bytes).and_then(|()| file.sync_data());
    match written {
        Ok(()) => (Some(file), Ok(bytes.len() as u64), false),
        Err(e) => match file.set_len(before).and_then(|()| file.sync_data()) {
            Ok(()) => (Some(file), Err(e), false),
            Err(_) => (None, Err(e), true),
        },
    }
}

/// Writes `bytes` whole, with the crash points of a log append: half of it written (a
/// torn record), and all of it written but not yet synced.
fn write_with_crash_points(file: &mut std::fs::File, bytes: &[u8]) -> std::io::Result<()> {
    let half = bytes.len() / 2;
    file.write_all(&bytes[..half])?;
    crate::crash::point("store.log.torn");
    file.write_all(&bytes[half..])?;
    crate::crash::point("store.log.appended");
    Ok(())
}

#[cfg(test)]
mod temporary_tests {
    use super::*;
    use std::ffi::OsStr;

    #[test]
    fn temporary_names_are_told_from_state() {
        assert_eq!(
            temporary_pid(OsStr::new(".state.json.tmp.123.4")),
            Some(123)
        );
        assert_eq!(temporary_pid(OsStr::new(".ca.tmp.9.0")), Some(9));
        for name in [
            "state.json",
            ".state.json",
            ".tmp.1.2",
            ".a.tmp.x.2",
            ".a.tmp.1.",
            ".a.tmp.1",
        ] {
            assert_eq!(temporary_pid(OsStr::new(name)), None, "{name}");
        }
    }

    #[test]
    fn only_a_dead_writers_temporaries_go() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state.json");
        std::fs::write(&state, "{}").unwrap();
        // No process has pid 4194304 + 1 (beyond the kernel's pid_max).
        let dead = dir.path().join(".state.json.tmp.4194305.0");
        let live = dir
            .path()
            .join(format!(".state.json.tmp.{}.7", std::process::id()));
        let other = dir.path().join(".other.json.tmp.4194305.0");
        for f in [&dead, &live, &other] {
            std::fs::write(f, "x").unwrap();
        }
        assert_eq!(remove_stale_temporaries_of(&state), 1);
        assert!(!dead.exists() && live.exists() && other.exists() && state.exists());
    }
}
