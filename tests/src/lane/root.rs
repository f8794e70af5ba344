//! The lane's root file system: Debian bookworm with systemd, built once by `mmdebstrap`
//! from the Debian registry apt uses and cached on the machine, outside the clone, under
//! a name derived from what it holds.

use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use fort_core::canonical::sha256_hex;

/// The release the root is built from: the one the test binaries are built on, so that
/// they run in it as they are (same glibc).
pub const SUITE: &str = "bookworm";

/// Packages besides `minbase`: systemd as PID 1, D-Bus and polkit (an unprivileged
/// agent restarts units through them), procps (`kill` for ExecReload), jq (handlers).
pub const PACKAGES: &[&str] = &["systemd", "dbus", "polkitd", "procps", "jq"];

/// Bumped when the way the root is built changes, so a stale cache is not reused.
const RECIPE: u32 = 1;

/// A root file system to boot; never written to (each machine boots an overlay of it).
#[derive(Debug, Clone)]
pub struct Root {
    pub path: PathBuf,
}

/// Where roots are cached: `$FORT_LANE_CACHE`, else `/var/cache/fort-systemd-lane`.
pub fn cache_dir() -> PathBuf {
    std::env::var_os("FORT_LANE_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/fort-systemd-lane"))
}

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|dir| dir.join(program).is_file()))
}

/// Why the lane cannot run on this machine, if it cannot: it needs root (mounts,
/// namespaces, booting a container) and the tools that build and boot the root.
pub fn unavailable() -> Option<String> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    #[allow(unsafe_code)]
    let euid = unsafe { libc::geteuid() };
    if euid != 0 {
        return Some("the systemd lane boots containers and needs root".into());
    }
    for (program, package) in [
        ("systemd-nspawn", "systemd-container"),
        ("mmdebstrap", "mmdebstrap"),
        ("nsenter", "util-linux"),
        ("unshare", "util-linux"),
    ] {
        if !on_path(program) {
            return Some(format!(
                "{program} not found (Debian: apt-get install {package})"
            ));
        }
    }
    None
}

impl Root {
    /// The cached root, built first if this machine has none: `Err` says why the lane
    /// cannot run here (not root, a tool missing, the registry unreachable).
    pub fn get() -> Result<Root, String> {
        if let Some(why) = unavailable() {
            return Err(why);
        }
        let recipe = format!(
            "recipe {RECIPE}\nsuite {SUITE}\nvariant minbase\npackages {}\n",
            PACKAGES.join(",")
        );
        let cache = cache_dir();
        let path = cache.join(&sha256_hex(recipe.as_bytes())[..16]);
        if path.join("etc/os-release").exists() {
            return Ok(Root { path });
        }
        std::fs::create_dir_all(&cache)
            .map_err(|e| format!("cannot create {}: {e}", cache.display()))?;
        // Parallel test processes: one builds, the others wait for it.
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(cache.join(".lock"))
            .map_err(|e| format!("cannot open the cache lock: {e}"))?;
        // SAFETY: flock on a descriptor this function owns; released when it closes.
        #[allow(unsafe_code)]
        let locked = unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) };
        if locked != 0 {
            return Err(format!(
                "cannot lock the cache: {}",
                std::io::Error::last_os_error()
            ));
        }
        if path.join("etc/os-release").exists() {
            return Ok(Root { path });
        }
        // Whatever a build killed half-way left behind (the lock says nobody builds now).
        if let Ok(entries) = std::fs::read_dir(&cache) {
            for e in entries.flatten() {
                if e.file_name().to_string_lossy().contains(".tmp.") {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        let tmp = cache.join(format!(
            "{}.tmp.{}",
            path.file_name().expect("name").to_string_lossy(),
            std::process::id()
        ));
        build(&tmp)?;
        std::fs::write(tmp.join("etc/fort-lane-recipe"), &recipe)
            .map_err(|e| format!("cannot write the recipe: {e}"))?;
        std::fs::rename(&tmp, &path)
            .map_err(|e| format!("cannot move the root into place: {e}"))?;
        Ok(Root { path })
    }
}

/// The Debian sources apt itself uses on this machine (deb822 or one-line), so the
/// root comes from the same registry; deb.debian.org without them.
fn sources() -> String {
    for file in [
        "/etc/apt/sources.list.d/debian.sources",
        "/etc/apt/sources.list",
    ] {
        if std::fs::read_to_string(file).is_ok_and(|t| t.contains(SUITE)) {
            return file.to_owned();
        }
    }
    "http://deb.debian.org/debian".to_owned()
}

fn build(target: &Path) -> Result<(), String> {
    let started = std::time::Instant::now();
    eprintln!(
        "lane: building the {SUITE} root in {} (once per machine)",
        target.display()
    );
    let out = Command::new("mmdebstrap")
        .args(["--mode=root", "--variant=minbase", "--quiet"])
        .arg(format!("--include={}", PACKAGES.join(",")))
        // Documentation and translations are never read in the lane.
        .args([
            "--dpkgopt=path-exclude=/usr/share/man/*",
            "--dpkgopt=path-exclude=/usr/share/doc/*",
            "--dpkgopt=path-exclude=/usr/share/locale/*",
        ])
        .arg(SUITE)
        .arg(target)
        .arg(sources())
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run mmdebstrap: {e}"))?;
    if !out.status.success() {
        let _ = std::fs::remove_dir_all(target);
        let text = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = text.lines().rev().take(5).collect();
        return Err(format!(
            "mmdebstrap could not build the {SUITE} root (is the Debian registry reachable?): {}",
            tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
        ));
    }
    let _ = writeln!(
        std::io::stderr(),
        "lane: root built in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
