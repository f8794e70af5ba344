//! Files a handler keeps for a server to read (sshd's `authorized_keys`, Prometheus'
//! target files): replaced atomically with their mode already set when they appear, and
//! left alone when they already hold the bytes, so a reader never sees half a file or a
//! window where it may not read it.

use std::path::Path;

/// Replaces `path` with `bytes` (a temporary file of mode `mode` in the same directory,
/// synced, renamed over it, the directory synced), as the agent replaces its state. The
/// temporary files a killed run left beside it are removed first: no server reads them
/// (their names end in digits), but they would pile up. Never follows a link at `path`'s
/// temporary name; the directory must exist.
pub fn replace(path: &Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    fort_core::store::remove_stale_temporaries_of(path);
    fort_core::store::write_atomic_mode(
        path,
        bytes,
        mode,
        Some(fort_core::crash::replace_temp("handler.file.temp")),
    )
}

/// [`replace`] unless `path` already holds exactly `bytes`: true when it wrote.
pub fn replace_if_changed(path: &Path, bytes: &[u8], mode: u32) -> std::io::Result<bool> {
    if std::fs::read(path).is_ok_and(|old| old == bytes) {
        return Ok(false);
    }
    replace(path, bytes, mode).map(|()| true)
}

/// Removes `path`; one that is already gone is fine.
pub fn remove(path: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn replaced_with_its_mode_and_only_when_changed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("targets.json");
        assert!(replace_if_changed(&path, b"[]", 0o644).unwrap());
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o644
        );
        assert!(!replace_if_changed(&path, b"[]", 0o644).unwrap());
        assert!(replace_if_changed(&path, b"[1]", 0o644).unwrap());
        assert_eq!(std::fs::read(&path).unwrap(), b"[1]");
        // Nothing of the temporary files is left.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        remove(&path).unwrap();
        remove(&path).unwrap();
    }
}
