//! One booted systemd: the lane's root under a private overlay (the cached root is never
//! written), booted by `systemd-nspawn --boot`, in a network namespace it may share with
//! other machines. Commands run inside through `nsenter`. Everything a machine starts is
//! stopped when it is dropped, and also when the test process dies (a watchdog reading
//! a pipe from the test kills the container's PID 1 when the pipe closes).

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use super::net::Net;
use super::root::Root;

/// PATH inside the machine for commands run through `exec`.
const PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// A container booted from the lane's root. Build it, install files and binaries, boot,
/// then drive it as a NixOS VM test drives a machine.
pub struct Machine {
    /// The host name inside.
    pub name: String,
    root: PathBuf,
    netns: PathBuf,
    dir: tempfile::TempDir,
    binds: Vec<(PathBuf, String)>,
    running: Option<Running>,
    boots: u32,
}

struct Running {
    nspawn: Child,
    /// Kills `leader` when its stdin closes: when the test process dies.
    watchdog: Child,
    leader: u32,
}

impl Machine {
    /// A machine named `name` (its host name) in `net`; nothing runs until `boot`.
    pub fn new(root: &Root, net: &Net, name: &str) -> Machine {
        let dir = tempfile::Builder::new()
            .prefix(&format!("fort-lane-{name}-"))
            .tempdir()
            .expect("scratch dir");
        for sub in ["upper", "work", "merged"] {
            std::fs::create_dir(dir.path().join(sub)).expect("mkdir");
        }
        let m = Machine {
            name: name.to_owned(),
            root: root.path.clone(),
            netns: net.path(),
            dir,
            binds: Vec::new(),
            running: None,
            boots: 0,
        };
        // A container shares the host's boot id, so `journalctl -b` cannot tell its boots
        // apart; a journal kept in /run starts empty at each boot instead.
        m.write(
            "/etc/systemd/journald.conf.d/lane.conf",
            "[Journal]\nStorage=volatile\n",
            0o644,
        );
        m
    }

    /// The PID of the machine's systemd (PID 1 inside), while it runs.
    pub fn leader(&self) -> Option<u32> {
        self.running.as_ref().map(|r| r.leader)
    }

    // ------------------------------------------------------------------ files
    /// Writes a file inside the machine (parents created 0755), replacing it atomically
    /// when the machine runs. Before `boot` the file lands in the overlay's upper layer.
    pub fn write(&self, path: &str, data: impl AsRef<[u8]>, mode: u32) {
        if self.running.is_some() {
            let script = r#"set -e; mkdir -p -- "$(dirname -- "$1")"; cat >"$1.lane-tmp"; chmod "$2" "$1.lane-tmp"; mv -f -- "$1.lane-tmp" "$1""#;
            let out = self.exec_input(
                &["sh", "-c", script, "lane-write", path, &format!("{mode:o}")],
                data.as_ref(),
            );
            assert!(
                out.status.success(),
                "{}: write {path}: {}",
                self.name,
                text(&out)
            );
            return;
        }
        let host = self.upper_path(path);
        std::fs::write(&host, data).unwrap_or_else(|e| panic!("write {path}: {e}"));
        std::fs::set_permissions(&host, std::fs::Permissions::from_mode(mode)).expect("chmod");
    }

    /// A symbolic link inside the machine (replacing what is there).
    pub fn symlink(&self, path: &str, target: &str) {
        if self.running.is_some() {
            let script = r#"set -e; mkdir -p -- "$(dirname -- "$2")"; ln -sfn -- "$1" "$2.lane-tmp"; mv -Tf -- "$2.lane-tmp" "$2""#;
            let out = self.exec(&["sh", "-c", script, "lane-link", target, path]);
            assert!(
                out.status.success(),
                "{}: link {path}: {}",
                self.name,
                text(&out)
            );
            return;
        }
        let host = self.upper_path(path);
        let _ = std::fs::remove_file(&host);
        std::os::unix::fs::symlink(target, &host).unwrap_or_else(|e| panic!("link {path}: {e}"));
    }

    /// Copies a tree (as `nixos-module/tests/lane/render.sh` writes them) into `/`: its
    /// `etc/` and `nix/` with their modes and links. Other top-level files of the tree
    /// (packages.json, dry-activate.sh) are for the test, not the machine.
    pub fn install_tree(&self, tree: &Path) {
        for top in ["etc", "nix"] {
            if tree.join(top).is_dir() {
                self.walk_tree(&tree.join(top), &format!("/{top}"));
            }
        }
    }

    /// Copies one part of a tree (`"etc/fort"`, `"nix/store"`) into the same place
    /// inside: a new generation's files, without touching the rest.
    pub fn install_tree_part(&self, tree: &Path, part: &str) {
        let from = tree.join(part);
        assert!(from.is_dir(), "{} has no {part}", tree.display());
        self.walk_tree(&from, &format!("/{part}"));
    }

    fn walk_tree(&self, dir: &Path, inside: &str) {
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.expect("entry"))
            .collect();
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let name = e.file_name().to_string_lossy().into_owned();
            let path = format!("{inside}/{name}");
            let meta = std::fs::symlink_metadata(e.path()).expect("metadata");
            if meta.file_type().is_symlink() {
                let target = std::fs::read_link(e.path()).expect("readlink");
                self.symlink(&path, &target.to_string_lossy());
            } else if meta.is_dir() {
                self.walk_tree(&e.path(), &path);
            } else {
                let data = std::fs::read(e.path()).expect("read");
                self.write(&path, data, meta.mode() & 0o7777);
            }
        }
    }

    /// Creates a directory (and its parents) inside the machine.
    pub fn mkdir(&self, path: &str, mode: u32) {
        if self.running.is_some() {
            self.succeed(&format!("mkdir -p -m {mode:o} '{path}'"));
            return;
        }
        let host = self.upper_path(&format!("{path}/.lane-mkdir"));
        let dir = host.parent().expect("parent");
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode)).expect("chmod");
    }

    /// Puts the store paths a tree's `packages.json` names in place: `"fort"` gets the
    /// workspace's binaries just built (bind-mounted read-only: the host and the root
    /// are the same Debian release), `"system"` links `bin` and `sbin` to the machine's
    /// own. Before `boot`.
    pub fn provide_packages(&mut self, tree: &Path) {
        let text = std::fs::read_to_string(tree.join("packages.json")).expect("packages.json");
        let packages: BTreeMap<String, String> =
            serde_json::from_str(&text).expect("packages.json is an object of strings");
        for (path, kind) in packages {
            match kind.as_str() {
                "fort" => {
                    for bin in ["fort-agent", "fort", "fort-handler"] {
                        self.bind_ro(&crate::bin(bin), &format!("{path}/bin/{bin}"));
                    }
                }
                "system" => {
                    self.symlink(&format!("{path}/bin"), "/usr/bin");
                    self.symlink(&format!("{path}/sbin"), "/usr/sbin");
                }
                other => panic!("packages.json: unknown kind {other:?} for {path}"),
            }
        }
    }

    /// Bind-mounts a host file or directory read-only at `inside` (at the next boot).
    pub fn bind_ro(&mut self, host: &Path, inside: &str) {
        self.binds.push((host.to_path_buf(), inside.to_owned()));
    }

    /// Where `inside` lives in the upper layer, its parents created with the root's
    /// modes and owners (an upper directory hides the lower one's attributes). A parent
    /// that is a symbolic link in the root (/lib, /bin on merged /usr) would be hidden by
    /// a directory: name the path it points to instead.
    fn upper_path(&self, inside: &str) -> PathBuf {
        assert!(inside.starts_with('/'), "{inside}: an absolute path");
        let rel = Path::new(inside.trim_start_matches('/'));
        let (mut lower, mut upper) = (self.root.clone(), self.dir.path().join("upper"));
        for c in rel.parent().expect("a file").components() {
            lower.push(c);
            upper.push(c);
            let below = std::fs::symlink_metadata(&lower).ok();
            if below.as_ref().is_some_and(|m| m.file_type().is_symlink()) {
                panic!(
                    "{inside}: {} is a symbolic link in the root",
                    lower.display()
                );
            }
            if !upper.exists() {
                std::fs::create_dir(&upper).expect("mkdir in upper layer");
                let (mode, uid, gid) = below
                    .map(|m| (m.mode() & 0o7777, m.uid(), m.gid()))
                    .unwrap_or((0o755, 0, 0));
                std::fs::set_permissions(&upper, std::fs::Permissions::from_mode(mode))
                    .expect("chmod");
                std::os::unix::fs::chown(&upper, Some(uid), Some(gid)).expect("chown");
            }
        }
        upper.join(rel.file_name().expect("a file name"))
    }

    // ------------------------------------------------------------ lifecycle
    /// Boots the machine and waits until systemd says startup finished (`running`, or
    /// `degraded` when a unit failed). `Err` when no container can start here at all
    /// (systemd-nspawn gave up before the container's systemd ran); a boot that starts
    /// and then goes wrong panics.
    pub fn boot(&mut self) -> Result<(), String> {
        assert!(self.running.is_none(), "{} is running", self.name);
        self.boots += 1;
        let d = self.dir.path();
        let console_path = d.join(format!("console.{}.log", self.boots));
        let console = std::fs::File::create(&console_path).expect("console log");
        // The overlay is mounted in a mount namespace of its own, so it disappears with
        // the container, whatever happens to the test.
        let mount = r#"set -e; mount -t overlay overlay -o "lowerdir=$1,upperdir=$2,workdir=$3" "$4"; root=$4; shift 4; exec systemd-nspawn -D "$root" "$@""#;
        let mut cmd = Command::new("unshare");
        cmd.args([
            "--mount",
            "--propagation",
            "private",
            "--",
            "sh",
            "-c",
            mount,
            "lane-boot",
        ])
        .arg(&self.root)
        .arg(d.join("upper"))
        .arg(d.join("work"))
        .arg(d.join("merged"))
        .args(["--boot", "--register=no", "--keep-unit"])
        .args(["--console=read-only", "--link-journal=no"])
        .arg(format!("--hostname={}", self.name))
        .arg(format!(
            "--machine=lane-{}-{}",
            std::process::id(),
            d.file_name()
                .expect("name")
                .to_string_lossy()
                .replace('.', "")
        ))
        .arg(format!("--network-namespace-path={}", self.netns.display()));
        for (host, inside) in &self.binds {
            cmd.arg(format!("--bind-ro={}:{inside}", host.display()));
        }
        cmd.env_clear()
            .env("PATH", PATH)
            // cgroup v2 only inside, as NixOS runs (and systemd 256 expects), even on a
            // host that mounts the v1 hierarchies too.
            .env("SYSTEMD_NSPAWN_UNIFIED_HIERARCHY", "1")
            .stdin(Stdio::null())
            .stdout(console.try_clone().expect("log"))
            .stderr(console);
        let mut nspawn = cmd
            .spawn()
            .map_err(|e| format!("cannot run unshare: {e}"))?;
        let deadline = Instant::now() + Duration::from_secs(30);
        let leader = loop {
            if let Some(pid) = child_named(nspawn.id(), "systemd") {
                break pid;
            }
            if let Ok(Some(status)) = nspawn.try_wait() {
                return Err(format!(
                    "systemd-nspawn exited ({status}) before the container's systemd ran: {}",
                    tail(
                        &std::fs::read_to_string(&console_path).unwrap_or_default(),
                        8
                    )
                ));
            }
            if Instant::now() > deadline {
                let _ = nspawn.kill();
                let _ = nspawn.wait();
                return Err("the container's systemd did not start within 30 s".into());
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let watchdog = Command::new("sh")
            .args(["-c", r#"cat >/dev/null; kill -KILL "$1""#, "lane-watchdog"])
            .arg(leader.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("watchdog");
        self.running = Some(Running {
            nspawn,
            watchdog,
            leader,
        });
        // Until PID 1 listens on its private socket, systemctl cannot ask it anything.
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let out = self.exec(&["timeout", "90", "systemctl", "is-system-running", "--wait"]);
            let state = String::from_utf8_lossy(&out.stdout).trim().to_owned();
            if state == "running" || state == "degraded" {
                return Ok(());
            }
            assert!(
                Instant::now() < deadline && (state.is_empty() || state == "offline"),
                "{}: the boot ended in state {state:?}: {}",
                self.name,
                text(&out)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Shuts the machine down as `poweroff` does (services stopped in order), waiting up
    /// to 60 s before killing it.
    pub fn poweroff(&mut self) {
        let Some(mut r) = self.running.take() else {
            return;
        };
        // SIGRTMIN+4: systemd's poweroff.target, as systemd-nspawn sends on its own stop.
        #[allow(unsafe_code)]
        // SAFETY: kill(2) on the container's PID 1, which this machine started.
        unsafe {
            libc::kill(r.leader as i32, libc::SIGRTMIN() + 4);
        }
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(60) {
            if let Ok(Some(_)) = r.nspawn.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        if r.nspawn.try_wait().ok().flatten().is_none() {
            eprintln!("{}: no poweroff within 60 s; killed", self.name);
        }
        kill_running(r);
    }

    /// A reboot: power off (services stopped, `/run` gone with the container), boot again
    /// on the same disk.
    pub fn reboot(&mut self) -> Result<(), String> {
        self.poweroff();
        self.boot()
    }

    // ------------------------------------------------------------- commands
    fn command(&self, args: &[&str]) -> Command {
        let leader = self
            .leader()
            .unwrap_or_else(|| panic!("{} is not running", self.name));
        let mut cmd = Command::new("nsenter");
        cmd.arg("-t")
            .arg(leader.to_string())
            .args(["-a", "--", "env", "-i"])
            .arg(format!("PATH={PATH}"))
            .args(["LANG=C.UTF-8", "SYSTEMD_COLORS=0", "SYSTEMD_PAGER="])
            .args(args);
        cmd.stdin(Stdio::null());
        cmd
    }

    /// Runs a command inside the machine (all its namespaces, a clean environment).
    pub fn exec(&self, args: &[&str]) -> Output {
        self.command(args).output().expect("run nsenter")
    }

    /// The same, with `input` on stdin.
    pub fn exec_input(&self, args: &[&str], input: &[u8]) -> Output {
        let mut child = self
            .command(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run nsenter");
        let mut stdin = child.stdin.take().expect("stdin");
        let input = input.to_vec();
        let writer = std::thread::spawn(move || {
            let _ = stdin.write_all(&input);
        });
        let out = child.wait_with_output().expect("wait nsenter");
        let _ = writer.join();
        out
    }

    /// `sh -c script` inside; its output when it succeeds, else a panic with both streams.
    pub fn succeed(&self, script: &str) -> String {
        let out = self.exec(&["sh", "-c", script]);
        assert!(
            out.status.success(),
            "{}: `{script}` failed ({}):\n{}",
            self.name,
            out.status,
            text(&out)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `sh -c script` inside, expected to fail; its stdout and stderr.
    pub fn fail(&self, script: &str) -> String {
        let out = self.exec(&["sh", "-c", script]);
        assert!(
            !out.status.success(),
            "{}: `{script}` succeeded:\n{}",
            self.name,
            text(&out)
        );
        text(&out)
    }
}

impl Drop for Machine {
    fn drop(&mut self) {
        if std::thread::panicking() && self.running.is_some() {
            let failed = self.exec(&["systemctl", "--failed", "--no-legend"]);
            eprintln!(
                "----- {}: failed units -----\n{}",
                self.name,
                String::from_utf8_lossy(&failed.stdout)
            );
            let journal = self.exec(&["journalctl", "-b", "-q", "--no-pager", "-n", "60"]);
            eprintln!(
                "----- {}: last journal lines -----\n{}",
                self.name,
                String::from_utf8_lossy(&journal.stdout)
            );
        }
        if let Some(r) = self.running.take() {
            kill_running(r);
        }
    }
}

/// Kills a container: the watchdog first (so it never kills a reused PID), then PID 1,
/// which takes every process of the container with it, then reaps systemd-nspawn.
fn kill_running(mut r: Running) {
    let _ = r.watchdog.kill();
    let _ = r.watchdog.wait();
    if r.nspawn.try_wait().ok().flatten().is_none() {
        #[allow(unsafe_code)]
        // SAFETY: kill(2) on the container's PID 1; its parent (systemd-nspawn, our
        // child) has not been reaped, so the PID is still that process.
        unsafe {
            libc::kill(r.leader as i32, libc::SIGKILL);
        }
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = r.nspawn.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = r.nspawn.kill();
    let _ = r.nspawn.wait();
}

/// A child of `parent` whose command name is `name`.
fn child_named(parent: u32, name: &str) -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        let (comm, rest) = stat.split_once(" (")?.1.rsplit_once(") ")?;
        let ppid: u32 = rest.split_whitespace().nth(1)?.parse().ok()?;
        (ppid == parent && comm == name).then_some(pid)
    })
}

pub(super) fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join(" | ")
}
