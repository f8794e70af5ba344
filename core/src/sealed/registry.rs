//! Finding the sealed files fort keeps: those under a directory (by their envelope's
//! prefix), and those the handlers noted in the state directory's registry, also outside
//! it, so that rotation and the start's check miss none.

use std::path::{Path, PathBuf};

use super::{is_sealed, PREFIX, REGISTRY_ENV, REGISTRY_FILE};

/// Notes `path` as a sealed file in the registry the agent named in [`REGISTRY_ENV`]
/// (nothing without one). Best effort, appended once: a file not noted is still found
/// when it lies under the state directory, and one whose note is lost is noted again at
/// its next read or write.
pub fn note(path: &Path) {
    use std::io::Write;
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::OpenOptionsExt;
    let Some(registry) = std::env::var_os(REGISTRY_ENV) else {
        return;
    };
    let Ok(abs) = std::path::absolute(path) else {
        return;
    };
    let line_ok = !abs.as_os_str().as_bytes().contains(&b'\n');
    if !line_ok || noted_in(Path::new(&registry)).contains(&abs) {
        return;
    }
    let mut line = std::os::unix::ffi::OsStringExt::into_vec(abs.into_os_string());
    line.push(b'\n');
    let appended = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&registry)
        .and_then(|mut f| f.write_all(&line).and_then(|()| f.sync_data()));
    if let Err(e) = appended {
        tracing::warn!(registry = %Path::new(&registry).display(), error = %e, "cannot note a sealed file; state-key rotate finds it only under --dir");
    }
}

/// The sealed files noted in `state_dir`'s registry that still exist; a torn or foreign
/// line is passed over.
pub fn noted(state_dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = noted_in(&state_dir.join(REGISTRY_FILE))
        .into_iter()
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files.dedup();
    files
}

fn noted_in(registry: &Path) -> Vec<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    let Ok(bytes) = crate::fsx::read_regular(registry, 16 * 1024 * 1024) else {
        return Vec::new();
    };
    bytes
        .split(|b| *b == b'\n')
        .filter(|l| l.first() == Some(&b'/'))
        .map(|l| PathBuf::from(std::ffi::OsStr::from_bytes(l)))
        .collect()
}

/// Every sealed file under `dir`, recursively, as written (the envelope's own prefix);
/// symbolic links are not followed, files moved aside (`set-aside/`) are not the agent's
/// any more, and a temporary file of an atomic write (being written, or left by a process
/// killed before its rename) is never state. What cannot be read below `dir` is passed over: the handler that
/// owns it reports it when it loads it.
pub fn sealed_files(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    use std::io::Read as _;
    let head = |path: &Path| -> std::io::Result<bool> {
        let mut head = [0u8; PREFIX.len()];
        let mut f = std::fs::File::open(path)?;
        let mut got = 0;
        while got < head.len() {
            match f.read(&mut head[got..])? {
                0 => break,
                n => got += n,
            }
        }
        Ok(is_sealed(&head[..got]))
    };
    let mut out = Vec::new();
    let mut todo = vec![dir.to_owned()];
    while let Some(d) = todo.pop() {
        let entries = match std::fs::read_dir(&d) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) if d == dir => return Err(e),
            Err(_) => continue,
        };
        for entry in entries.flatten() {
            let Ok(kind) = entry.file_type() else {
                continue;
            };
            let path = entry.path();
            if kind.is_dir() {
                if entry.file_name() != "set-aside" {
                    todo.push(path);
                }
            } else if kind.is_file()
                && crate::store::temporary_pid(&entry.file_name()).is_none()
                && head(&path).unwrap_or(false)
            {
                out.push(path);
            }
        }
    }
    out.sort();
    Ok(out)
}
