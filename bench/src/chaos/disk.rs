//! A state directory that runs out of space: each host's state directory is a small
//! tmpfs of its own, and the fault fills it with a filler file until a write gets
//! ENOSPC, then removes the filler when the fault ends. Mounting needs root; without it
//! the kind is skipped and the figures say why. The mounts are removed however the run
//! ends.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Each host's state tmpfs.
const SIZE: &str = "64m";
const FILLER: &str = "chaos-filler";

pub struct Mounts {
    dirs: Vec<PathBuf>,
    _on_signal: fort_tests::cleanup::OnSignal,
}

/// Why state directories cannot be made small here, or `None`.
pub fn unavailable() -> Option<String> {
    #[allow(unsafe_code)]
    // SAFETY: geteuid(2) has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    (!root).then(|| "mounting a small tmpfs per state directory needs root".to_owned())
}

fn unmount(dirs: &[PathBuf]) {
    for d in dirs {
        // Lazy: a process still holding a file there (one being killed) cannot keep it.
        let _ = Command::new("umount").arg("-l").arg(d).output();
    }
}

impl Mounts {
    /// A tmpfs over each of `dirs` (empty directories: before the agents first start).
    pub fn over(dirs: Vec<PathBuf>) -> Result<Mounts, String> {
        let on_signal = {
            let dirs = dirs.clone();
            fort_tests::cleanup::on_signal(move || unmount(&dirs))
        };
        let mut mounts = Mounts {
            dirs: Vec::new(),
            _on_signal: on_signal,
        };
        for d in dirs {
            std::fs::create_dir_all(&d).map_err(|e| format!("{}: {e}", d.display()))?;
            let out = Command::new("mount")
                .args(["-t", "tmpfs", "-o", &format!("size={SIZE},mode=0700")])
                .arg("fort-chaos")
                .arg(&d)
                .output()
                .map_err(|e| format!("mount: {e}"))?;
            if !out.status.success() {
                return Err(format!(
                    "mount tmpfs on {}: {}",
                    d.display(),
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
            }
            mounts.dirs.push(d);
        }
        Ok(mounts)
    }
}

impl Drop for Mounts {
    fn drop(&mut self) {
        unmount(&self.dirs);
    }
}

/// Fills `dir`'s file system until a write of even one byte fails; the bytes written.
pub fn fill(dir: &Path) -> std::io::Result<u64> {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(FILLER))?;
    let mut written = 0u64;
    let mut chunk = 1usize << 20;
    let zeros = vec![0u8; chunk];
    while chunk > 0 {
        match f.write(&zeros[..chunk]) {
            Ok(0) => chunk /= 2,
            Ok(n) => written += n as u64,
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => chunk /= 2,
            Err(e) => return Err(e),
        }
    }
    Ok(written)
}

/// Gives the space back.
pub fn unfill(dir: &Path) {
    let _ = std::fs::remove_file(dir.join(FILLER));
}
