//! The one subprocess helper every handler run goes through (provider and consumer
//! handlers, checks, the built-in `journalctl` / `systemctl` calls).
//!
//! # What a handler gets
//!
//! - **Environment**: cleared, then `PATH` (the agent's own, or
//!   `/run/current-system/sw/bin:/usr/bin:/bin` when the agent has none), then exactly the
//!   variables the caller put on the [`RunSpec`] (`FORT_HOST`, `FORT_NEED`, configured
//!   extras, ...; a `PATH` there replaces the default), then `FORT_RUN_ID`, an opaque
//!   per-run marker the handler must leave alone (it cannot be overridden). Nothing else
//!   of the agent's environment leaks: not `NOTIFY_SOCKET`, not `CREDENTIALS_DIRECTORY`,
//!   not `HOME`, not a secret someone exported to the service.
//! - **Working directory**: `/` unless `RunSpec::cwd` says otherwise.
//! - **stdin**: the input, then closed. Not reading it is not an error.
//! - **stdout**: the answer, at most [`RunSpec::max_stdout`] bytes; one byte more kills
//!   the run ([`RunError::OutputTooLarge`]): output is data, and truncated data is wrong.
//! - **stderr**: for the log, kept up to [`RunSpec::max_stderr`] bytes; the rest is read
//!   and dropped.
//! - **Lifetime**: the run is the handler process (the *leader*) and everything it starts.
//!   When the leader exits, the run is over: stdout and stderr get [`EXIT_GRACE`] to reach
//!   EOF, then every process the run started that is still there is SIGKILLed, and the
//!   leader's exit status decides the outcome. A run that outlives its timeout, overflows
//!   stdout, or whose future is dropped (cancellation) is SIGKILLed whole the same way.
//!   **Anything that must outlive the handler has to be started by systemd**
//!   (`systemctl start`, `systemd-run`), never with `&`, `nohup`, `setsid` or a
//!   double fork.
//!
//! # How "the whole tree" is found
//!
//! A process group alone is not enough (a `setsid` child leaves it), and the parent
//! links alone are not enough (an orphan is reparented away from the run). A process
//! belongs to a run if, in a scan of `/proc`, it started no earlier than the leader and
//!
//! - it is in the leader's process group, or
//! - its parent chain leads to the leader or to another member, or
//! - its environment carries this run's `FORT_RUN_ID` (inherited across fork, exec,
//!   setsid and reparenting; 128 random bits, never reused).
//!
//! Killing a run SIGKILLs the group, then scans and kills members until a scan finds no
//! new living member (a process that forks while being killed is caught by the next
//! scan; a process with a pending SIGKILL cannot fork any more). A handler that both
//! clears its environment and detaches from the session and the parent chain escapes
//! this; containing that takes a cgroup (run such work through `systemd-run`).
//!
//! Races, and why they are closed:
//!
//! - **The leader's pid and group id** are only used while the leader is unreaped: its
//!   exit is observed through a pidfd (or `waitid(WNOWAIT)`), the tree is killed, and
//!   only then is the leader reaped (by tokio). Until then neither its pid nor its group
//!   id can be reused, so `kill(-pgid)` cannot hit a stranger.
//! - **Any other pid** is signalled through a pidfd opened first and checked against the
//!   start time seen in the scan, so a process that exited and whose pid was reused
//!   between scan and kill is not touched.
//! - **Reaping** (see below) only ever uses `waitpid(pid, WNOHANG)` on a pid that is
//!   verified, under one lock, to be a child of this process, with the expected start
//!   time, and not the leader of a registered run: tokio's children are never stolen,
//!   and `waitpid(-1)` is never used.
//!
//! # Orphans and the agent as subreaper
//!
//! The agent should call [`become_child_subreaper`] once at start. Orphans of a run are
//! then reparented to the agent instead of init, which keeps them findable, and makes
//! the agent responsible for reaping them: tokio only waits for the children it spawned.
//! A run reaps the orphans it killed before [`run`] returns; [`reap_orphans`], meant to
//! be called periodically (it costs a few reads of `/proc/self/task/*/children` when
//! there is nothing to do), kills and reaps orphans whose run is over and reaps orphans
//! that died unseen.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Read;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, RwLock};
use std::time::{Duration, Instant};

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, Command};

/// The per-run marker variable every process of a run inherits.
pub const RUN_ID_VAR: &str = "FORT_RUN_ID";

/// `PATH` for handlers when the agent itself has none.
pub const DEFAULT_PATH: &str = "/run/current-system/sw/bin:/usr/bin:/bin";

/// How long, once the leader has exited, stdout and stderr may stay open (a child still
/// flushing) before the rest of the run is killed.
pub const EXIT_GRACE: Duration = Duration::from_millis(200);

/// How long, after the rest of the run has been killed, to keep reading what it had
/// already written. Only a process that escaped the kill holds a pipe open longer.
const DRAIN: Duration = Duration::from_millis(200);

/// How long a run waits for the orphans it killed to become reapable before leaving
/// them to [`reap_orphans`]. SIGKILLed processes die in microseconds unless stuck in
/// the kernel.
const REAP_PATIENCE: Duration = Duration::from_millis(500);

/// Upper bound on kill passes over `/proc` for one run (each pass kills every member it
/// finds; more than a handful means something forks faster than we can scan).
const MAX_KILL_PASSES: usize = 64;

/// What to run and how.
#[derive(Debug, Clone)]
pub struct RunSpec {
    pub program: PathBuf,
    pub args: Vec<String>,
    pub stdin: Vec<u8>,
    /// The handler's whole environment besides `PATH` and `FORT_RUN_ID`.
    pub env: Vec<(String, String)>,
    /// Working directory (`/` by default).
    pub cwd: PathBuf,
    pub timeout: Duration,
    /// More stdout than this kills the run: output is data, and truncated data is wrong.
    pub max_stdout: usize,
    /// Stderr beyond this is read and dropped: it is only for the log.
    pub max_stderr: usize,
}

impl RunSpec {
    pub fn new(program: impl AsRef<Path>, stdin: Vec<u8>, timeout: Duration) -> RunSpec {
        RunSpec {
            program: program.as_ref().to_path_buf(),
            args: Vec::new(),
            stdin,
            env: Vec::new(),
            cwd: PathBuf::from("/"),
            timeout,
            max_stdout: 16 * 1024 * 1024,
            max_stderr: 16 * 1024,
        }
    }

    pub fn env(mut self, key: &str, value: impl Into<String>) -> RunSpec {
        self.env.push((key.to_owned(), value.into()));
        self
    }

    /// Several variables at once (a configured set of extras, say).
    pub fn envs<I, K, V>(mut self, vars: I) -> RunSpec
    where
        I: IntoIterator<Item = (K, V)>,
        K: Into<String>,
        V: Into<String>,
    {
        self.env
            .extend(vars.into_iter().map(|(k, v)| (k.into(), v.into())));
        self
    }

    pub fn arg(mut self, a: impl Into<String>) -> RunSpec {
        self.args.push(a.into());
        self
    }

    pub fn cwd(mut self, dir: impl AsRef<Path>) -> RunSpec {
        self.cwd = dir.as_ref().to_path_buf();
        self
    }
}

/// A run that exited 0.
#[derive(Debug, Clone)]
pub struct Success {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub duration: Duration,
}

/// A run that did not exit 0.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("cannot start {program}: {source}")]
    Spawn {
        program: String,
        source: std::io::Error,
    },
    #[error("exited with code {code}: {stderr}")]
    Exit {
        code: i32,
        stderr: String,
        /// What it printed before failing: some tools (`systemctl status`) answer
        /// through a non-zero exit.
        stdout: String,
    },
    #[error("killed by signal {signal}: {stderr}")]
    Signal { signal: i32, stderr: String },
    #[error("timed out after {0:?}; process tree killed")]
    Timeout(Duration),
    #[error("stdout over {0} bytes; process tree killed")]
    OutputTooLarge(usize),
    #[error("i/o with the handler failed: {0}")]
    Io(std::io::Error),
}

impl RunError {
    /// The exit code reported to rpc callers (`-1` when there is none).
    pub fn exit_code(&self) -> i32 {
        match self {
            RunError::Exit { code, .. } => *code,
            _ => -1,
        }
    }

    /// One word for status pages and metrics.
    pub fn class(&self) -> &'static str {
        match self {
            RunError::Spawn { .. } => "spawn_failed",
            RunError::Exit { .. } => "exit_nonzero",
            RunError::Signal { .. } => "killed",
            RunError::Timeout(_) => "timeout",
            RunError::OutputTooLarge(_) => "output_too_large",
            RunError::Io(_) => "io",
        }
    }
}

// ---------------------------------------------------------------------------------------
// Registry of runs, and the lock that keeps reaping away from tokio's children.

/// Runs whose leader tokio has not reaped yet: marker -> leader pid. An entry is added
/// (under a read lock of [`SPAWN_REAP`]) right after the leader is spawned and removed
/// only after the leader is reaped, so a pid listed here is never ours to `waitpid`.
static RUNS: Mutex<BTreeMap<String, i32>> = Mutex::new(BTreeMap::new());

/// Spawning a leader and registering it holds this for reading; reaping anything that
/// is not a leader holds it for writing. So a reaper never sees a leader that is not
/// registered yet, and two reapers never race for the same pid.
static SPAWN_REAP: RwLock<()> = RwLock::new(());

static SUBREAPER: AtomicBool = AtomicBool::new(false);

fn runs() -> std::sync::MutexGuard<'static, BTreeMap<String, i32>> {
    RUNS.lock().unwrap_or_else(|e| e.into_inner())
}

fn registered_leaders() -> HashSet<i32> {
    runs().values().copied().collect()
}

fn unregister(marker: &str) {
    runs().remove(marker);
}

/// Makes this process the reaper of its orphaned descendants
/// (`prctl(PR_SET_CHILD_SUBREAPER)`), so that a handler's double-forked or `setsid`
/// children stay below the agent, where a run's kill finds them, instead of going to
/// init. Call once at agent start, then call [`reap_orphans`] periodically.
///
/// Contract that comes with it: every child of this process that [`run`] did not spawn
/// is taken for an orphan of some run. Code that spawns children elsewhere must keep
/// them in the agent's process group (the default), whose zombies [`reap_orphans`]
/// leaves alone.
pub fn become_child_subreaper() -> std::io::Result<()> {
    sys::set_child_subreaper()?;
    SUBREAPER.store(true, Ordering::SeqCst);
    Ok(())
}

/// Kills and reaps what runs left behind with this process as their parent (only
/// useful after [`become_child_subreaper`]; a no-op otherwise):
///
/// - a living child that carries a `FORT_RUN_ID` whose run is over is SIGKILLed (and
///   reaped if it dies promptly, else on the next call);
/// - a zombie child that is not a run's leader and not in the agent's own process group
///   (runs start in their own groups; it is an orphan that died before anyone looked) is
///   reaped.
///
/// Children with no marker that are alive are left alone: they are not ours to judge.
/// Cheap when there is nothing to do (reads `/proc/self/task/*/children`); blocking
/// (reads `/proc`). Returns how many processes it killed or reaped.
pub fn reap_orphans() -> usize {
    if !SUBREAPER.load(Ordering::SeqCst) {
        return 0;
    }
    let me = std::process::id() as i32;
    let my_group = sys::getpgrp();
    let mut buf = Vec::with_capacity(1024);
    let mut done = 0;
    let mut killed = Vec::new();
    {
        let _reaping = SPAWN_REAP.write().unwrap_or_else(|e| e.into_inner());
        // Read after taking the lock: every leader alive now is in it.
        let active = runs().clone();
        let leaders: HashSet<i32> = active.values().copied().collect();
        let children = children_of_self().unwrap_or_else(|| {
            scan(&mut buf)
                .into_iter()
                .filter(|p| p.ppid == me)
                .map(|p| p.pid)
                .collect()
        });
        for pid in children {
            if leaders.contains(&pid) {
                continue;
            }
            let Some(p) = read_stat(pid, &mut buf) else {
                continue;
            };
            if p.ppid != me {
                continue;
            }
            if p.is_zombie() {
                // Our child, not tokio's, and no other reaper runs: the pid is stable.
                if p.pgid != my_group && sys::reap(pid) {
                    done += 1;
                }
            } else if let Some(marker) = environ_marker(pid, &mut buf) {
                if !active.contains_key(&marker) {
                    kill_verified(pid, p.start, &mut buf);
                    killed.push((pid, p.start));
                    done += 1;
                }
            }
        }
    }
    if !killed.is_empty() {
        reap_adopted(killed, Duration::from_millis(20));
    }
    done
}

// ---------------------------------------------------------------------------------------
// Running.

/// Runs `spec` to completion (see the module documentation for the contract).
pub async fn run(spec: &RunSpec) -> Result<Success, RunError> {
    let started = Instant::now();
    let marker = format!("{:032x}", rand::random::<u128>());
    let mut cmd = Command::new(&spec.program);
    cmd.args(&spec.args)
        .env_clear()
        .env("PATH", handler_path())
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .env(RUN_ID_VAR, &marker)
        .current_dir(&spec.cwd)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    // Registered before the read lock is released: a reaper (write lock) never sees a
    // leader it does not know.
    let (mut child, leader) = {
        let _spawning = SPAWN_REAP.read().unwrap_or_else(|e| e.into_inner());
        let child = cmd.spawn().map_err(|source| RunError::Spawn {
            program: spec.program.display().to_string(),
            source,
        })?;
        let leader = child.id().expect("an unwaited child has a pid") as i32;
        runs().insert(marker.clone(), leader);
        (child, leader)
    };
    let leader_start = read_stat(leader, &mut Vec::new()).map_or(0, |p| p.start);
    let stdin = child.stdin.take().expect("stdin piped");
    let stdout = child.stdout.take().expect("stdout piped");
    let stderr = child.stderr.take().expect("stderr piped");
    let mut guard = RunGuard {
        tree: Tree {
            marker,
            leader,
            leader_start,
        },
        child: Some(child),
        killed: false,
        adopted: Vec::new(),
        registered: true,
    };
    let exit = LeaderExit::new(leader);

    let deadline = tokio::time::Instant::from_std(started) + spec.timeout;
    let mut out = Vec::new();
    let mut err = Vec::new();
    let end = {
        let feed = async move {
            let mut stdin = stdin;
            // A handler that exits without reading its input is not an error of ours.
            let _ = stdin.write_all(&spec.stdin).await;
        };
        let out_read = read_into(stdout, &mut out, spec.max_stdout, true);
        let err_read = read_into(stderr, &mut err, spec.max_stderr, false);
        let exited = exit.wait();
        let timer = tokio::time::sleep_until(deadline);
        tokio::pin!(feed, out_read, err_read, exited, timer);
        let (mut fed, mut out_eof, mut err_eof, mut leader_gone) = (false, false, false, false);
        loop {
            if leader_gone && out_eof && err_eof {
                break End::Exited;
            }
            tokio::select! {
                () = &mut feed, if !fed => fed = true,
                r = &mut out_read, if !out_eof => match r {
                    Ok(true) => out_eof = true,
                    Ok(false) => break End::Overflow,
                    Err(e) => break End::Io(e),
                },
                r = &mut err_read, if !err_eof => match r {
                    Ok(_) => err_eof = true,
                    Err(e) => break End::Io(e),
                },
                () = &mut exited, if !leader_gone => {
                    // Done in time, whatever the deadline says from now on; what it left
                    // holding the pipes gets a grace, then is killed.
                    leader_gone = true;
                    timer.as_mut().reset(tokio::time::Instant::now() + EXIT_GRACE);
                }
                () = &mut timer => {
                    if !leader_gone {
                        break End::Timeout;
                    }
                    if guard.killed {
                        // Killed and drained: whatever still holds a pipe escaped us.
                        break End::Exited;
                    }
                    guard.kill().await;
                    timer.as_mut().reset(tokio::time::Instant::now() + DRAIN);
                }
            }
        }
    };
    // Kills what is left (everything, on timeout and overflow), reaps the leader and the
    // orphans killed, and forgets the run.
    let status = guard.finish().await;
    let status = match end {
        End::Exited => status.map_err(RunError::Io)?,
        End::Timeout => return Err(RunError::Timeout(spec.timeout)),
        End::Overflow => return Err(RunError::OutputTooLarge(spec.max_stdout)),
        End::Io(e) => return Err(RunError::Io(e)),
    };
    let stderr_text = String::from_utf8_lossy(&err).trim().to_owned();
    if let Some(code) = status.code() {
        if code != 0 {
            return Err(RunError::Exit {
                code,
                stderr: stderr_text,
                stdout: String::from_utf8_lossy(&out).into_owned(),
            });
        }
    } else {
        use std::os::unix::process::ExitStatusExt;
        return Err(RunError::Signal {
            signal: status.signal().unwrap_or(0),
            stderr: stderr_text,
        });
    }
    Ok(Success {
        stdout: out,
        stderr: err,
        duration: started.elapsed(),
    })
}

fn handler_path() -> std::ffi::OsString {
    std::env::var_os("PATH")
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| DEFAULT_PATH.into())
}

enum End {
    /// The leader exited (its status decides).
    Exited,
    Timeout,
    Overflow,
    Io(std::io::Error),
}

/// Reads to EOF into `kept`, keeping at most `limit` bytes. `Ok(true)` at EOF; with
/// `fail_over`, `Ok(false)` as soon as the limit is passed (the caller kills the run),
/// otherwise the excess is read and dropped. `kept` holds what was read even if the
/// future is dropped midway.
async fn read_into<R: AsyncRead + Unpin>(
    mut reader: R,
    kept: &mut Vec<u8>,
    limit: usize,
    fail_over: bool,
) -> std::io::Result<bool> {
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        let n = reader.read(&mut chunk).await?;
        if n == 0 {
            return Ok(true);
        }
        let room = limit.saturating_sub(kept.len());
        if n > room && fail_over {
            return Ok(false);
        }
        kept.extend_from_slice(&chunk[..n.min(room)]);
    }
}

/// Resolves when the leader has exited, without reaping it (so its pid and process
/// group id stay reserved until the tree is killed): a pidfd becomes readable on exit;
/// where pidfds are missing (Linux < 5.3), `waitid(WNOWAIT)` is polled.
struct LeaderExit {
    pid: i32,
    fd: Option<AsyncFd<OwnedFd>>,
}

impl LeaderExit {
    fn new(pid: i32) -> LeaderExit {
        let fd = sys::pidfd_open(pid)
            .ok()
            .and_then(|fd| sys::readable_fd(fd).ok());
        LeaderExit { pid, fd }
    }

    async fn wait(&self) {
        if let Some(fd) = &self.fd {
            if fd.readable().await.is_ok() && sys::exited_unreaped(self.pid) {
                return;
            }
        }
        while !sys::exited_unreaped(self.pid) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Identifies one run's processes (see the module documentation).
#[derive(Debug, Clone)]
struct Tree {
    marker: String,
    /// Pid and process group id of the leader; only valid while it is unreaped.
    leader: i32,
    /// The leader's start time (clock ticks since boot): no member started earlier.
    leader_start: u64,
}

/// Owns a run until it is cleaned up. Dropping it early (cancellation) kills the tree at
/// once and leaves reaping to a task.
struct RunGuard {
    tree: Tree,
    /// `Some` until the leader is reaped.
    child: Option<Child>,
    /// The tree has been killed (with the leader unreaped).
    killed: bool,
    /// Killed members that are our children (orphans reparented to us): ours to reap.
    adopted: Vec<(i32, u64)>,
    registered: bool,
}

impl RunGuard {
    /// Kills the whole tree once. Only while the leader is unreaped.
    async fn kill(&mut self) {
        if self.killed || self.child.is_none() {
            return;
        }
        let tree = self.tree.clone();
        let found = tokio::task::spawn_blocking(move || kill_tree(&tree))
            .await
            .unwrap_or_default();
        self.adopted.extend(found);
        self.killed = true;
    }

    /// Kills what is left, reaps the leader (returning its status) and the orphans, and
    /// forgets the run. Cancellation at any await leaves a state `Drop` finishes.
    async fn finish(&mut self) -> std::io::Result<ExitStatus> {
        self.kill().await;
        let child = self.child.as_mut().expect("finish runs once");
        let status = child.wait().await;
        self.child = None;
        let adopted = std::mem::take(&mut self.adopted);
        if !adopted.is_empty() {
            let _ = tokio::task::spawn_blocking(move || reap_adopted(adopted, REAP_PATIENCE)).await;
        }
        unregister(&self.tree.marker);
        self.registered = false;
        status
    }
}

impl Drop for RunGuard {
    fn drop(&mut self) {
        if !self.registered {
            return;
        }
        let Some(child) = self.child.take() else {
            // The leader is reaped; orphans still unreaped are left to `reap_orphans`.
            unregister(&self.tree.marker);
            return;
        };
        // Cancelled with the leader unreaped: kill now, synchronously (a few reads of
        // /proc), so that not even a runtime shutting down lets the tree live on.
        if !self.killed {
            let found = kill_tree(&self.tree);
            self.adopted.extend(found);
        }
        let adopted = std::mem::take(&mut self.adopted);
        let marker = self.tree.marker.clone();
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                handle.spawn(async move {
                    let mut child = child;
                    let _ = child.wait().await;
                    if !adopted.is_empty() {
                        let _ = tokio::task::spawn_blocking(move || {
                            reap_adopted(adopted, REAP_PATIENCE)
                        })
                        .await;
                    }
                    unregister(&marker);
                });
            }
            // No runtime: tokio's orphan queue reaps the leader some time; the run stays
            // registered so that nothing else ever reaps that pid.
            Err(_) => drop(child),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Finding and killing a tree.

/// One process as `/proc/<pid>/stat` shows it.
#[derive(Debug, Clone, Copy)]
struct Proc {
    pid: i32,
    ppid: i32,
    pgid: i32,
    state: u8,
    /// Start time, clock ticks since boot.
    start: u64,
}

impl Proc {
    fn is_zombie(&self) -> bool {
        matches!(self.state, b'Z' | b'X')
    }
}

fn parse_stat(pid: i32, data: &[u8]) -> Option<Proc> {
    // `pid (comm) state ppid pgrp session ...`; comm may contain anything, even ')'.
    let close = data.iter().rposition(|&b| b == b')')?;
    let rest = std::str::from_utf8(&data[close + 1..]).ok()?;
    let mut fields = rest.split_ascii_whitespace();
    let state = fields.next()?.bytes().next()?;
    let ppid = fields.next()?.parse().ok()?;
    let pgid = fields.next()?.parse().ok()?;
    // Fields 6 to 21 skipped; field 22 is the start time.
    let start = fields.nth(16)?.parse().ok()?;
    Some(Proc {
        pid,
        ppid,
        pgid,
        state,
        start,
    })
}

fn read_proc_file(path: &str, buf: &mut Vec<u8>) -> bool {
    buf.clear();
    match std::fs::File::open(path) {
        Ok(mut f) => f.read_to_end(buf).is_ok(),
        Err(_) => false,
    }
}

fn read_stat(pid: i32, buf: &mut Vec<u8>) -> Option<Proc> {
    if !read_proc_file(&format!("/proc/{pid}/stat"), buf) {
        return None;
    }
    parse_stat(pid, buf)
}

/// Every process, as far as a pass over `/proc` sees them.
fn scan(buf: &mut Vec<u8>) -> Vec<Proc> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|pid| read_stat(pid, buf))
        .collect()
}

/// Our children, from `/proc/self/task/*/children` (an orphan is reparented to one of
/// our threads); `None` where the kernel lacks that file.
fn children_of_self() -> Option<Vec<i32>> {
    let mut kids = Vec::new();
    let mut text = String::new();
    for task in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        let mut path = task.path();
        path.push("children");
        text.clear();
        match std::fs::File::open(&path) {
            Ok(mut f) => {
                if f.read_to_string(&mut text).is_err() {
                    continue;
                }
            }
            // The thread exited meanwhile: its children went to another thread.
            Err(_) if !task.path().exists() => continue,
            Err(_) => return None,
        }
        kids.extend(
            text.split_ascii_whitespace()
                .filter_map(|p| p.parse::<i32>().ok()),
        );
    }
    Some(kids)
}

/// Whether `pid`'s environment holds exactly the entry `needle` (`FORT_RUN_ID=...`).
fn environ_has(pid: i32, needle: &[u8], buf: &mut Vec<u8>) -> bool {
    read_proc_file(&format!("/proc/{pid}/environ"), buf)
        && buf.split(|&b| b == 0).any(|entry| entry == needle)
}

/// The run marker in `pid`'s environment, if any.
fn environ_marker(pid: i32, buf: &mut Vec<u8>) -> Option<String> {
    if !read_proc_file(&format!("/proc/{pid}/environ"), buf) {
        return None;
    }
    let prefix = format!("{RUN_ID_VAR}=");
    buf.split(|&b| b == 0)
        .find_map(|entry| entry.strip_prefix(prefix.as_bytes()))
        .map(|m| String::from_utf8_lossy(m).into_owned())
}

/// The members of `tree` among `procs` (see the module documentation).
fn members<'a>(
    tree: &Tree,
    me: i32,
    procs: &'a [Proc],
    needle: &[u8],
    buf: &mut Vec<u8>,
) -> Vec<&'a Proc> {
    // Nothing of the run is older than its leader: the start time filter spares the rest
    // of the system (and most environ reads).
    let candidates: Vec<&Proc> = procs
        .iter()
        .filter(|p| p.pid != me && p.pid > 1 && p.start >= tree.leader_start)
        .collect();
    let mut children: HashMap<i32, Vec<i32>> = HashMap::new();
    for p in &candidates {
        children.entry(p.ppid).or_default().push(p.pid);
    }
    let mut member: HashSet<i32> = candidates
        .iter()
        .filter(|p| p.pgid == tree.leader || (p.pid == tree.leader && p.start == tree.leader_start))
        .map(|p| p.pid)
        .collect();
    close_over_children(&mut member, &children);
    let marked: Vec<i32> = candidates
        .iter()
        .filter(|p| !member.contains(&p.pid) && !p.is_zombie())
        .filter(|p| environ_has(p.pid, needle, buf))
        .map(|p| p.pid)
        .collect();
    if !marked.is_empty() {
        member.extend(marked);
        close_over_children(&mut member, &children);
    }
    candidates
        .into_iter()
        .filter(|p| member.contains(&p.pid))
        .collect()
}

fn close_over_children(member: &mut HashSet<i32>, children: &HashMap<i32, Vec<i32>>) {
    let mut todo: Vec<i32> = member.iter().copied().collect();
    while let Some(pid) = todo.pop() {
        for &kid in children.get(&pid).into_iter().flatten() {
            if member.insert(kid) {
                todo.push(kid);
            }
        }
    }
}

/// SIGKILLs every process of the run, passing over `/proc` until a pass finds no living
/// member it had not signalled yet. Must be called while the leader is unreaped. Returns
/// the members that are our own children besides the leader (orphans reparented to us),
/// which are ours to reap.
fn kill_tree(tree: &Tree) -> Vec<(i32, u64)> {
    let me = std::process::id() as i32;
    // The leader is unreaped, so this group id is still the run's.
    sys::kill_group(tree.leader);
    let needle = format!("{RUN_ID_VAR}={}", tree.marker).into_bytes();
    let mut buf = Vec::with_capacity(4096);
    let mut signalled: HashSet<(i32, u64)> = HashSet::new();
    let mut adopted: Vec<(i32, u64)> = Vec::new();
    for _ in 0..MAX_KILL_PASSES {
        let procs = scan(&mut buf);
        let mut fresh = 0;
        for p in members(tree, me, &procs, &needle, &mut buf) {
            let id = (p.pid, p.start);
            if p.ppid == me && p.pid != tree.leader && !adopted.contains(&id) {
                adopted.push(id);
            }
            if !p.is_zombie() && signalled.insert(id) {
                fresh += 1;
                kill_verified(p.pid, p.start, &mut buf);
            }
        }
        if fresh == 0 {
            break;
        }
    }
    adopted
}

/// SIGKILLs `pid` if it is still the process that started at `start`: the pidfd pins the
/// process, the start time proves it is the one the scan saw.
fn kill_verified(pid: i32, start: u64, buf: &mut Vec<u8>) {
    let same = |buf: &mut Vec<u8>| read_stat(pid, buf).is_some_and(|p| p.start == start);
    match sys::pidfd_open(pid) {
        Ok(fd) => {
            if same(buf) {
                sys::pidfd_kill(&fd);
            }
        }
        Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {
            if same(buf) {
                sys::kill(pid);
            }
        }
        Err(_) => {} // gone
    }
}

/// Reaps the given orphans (pid, start time) as they die, for at most `patience`. Each
/// is checked, under the reaping lock, to still be our child with that start time and
/// not a registered leader before `waitpid(pid, WNOHANG)`.
fn reap_adopted(mut pending: Vec<(i32, u64)>, patience: Duration) {
    let me = std::process::id() as i32;
    let until = Instant::now() + patience;
    let mut buf = Vec::with_capacity(512);
    loop {
        {
            let _reaping = SPAWN_REAP.write().unwrap_or_else(|e| e.into_inner());
            let leaders = registered_leaders();
            pending.retain(|&(pid, start)| match read_stat(pid, &mut buf) {
                Some(p) if p.start == start && p.ppid == me && !leaders.contains(&pid) => {
                    !(p.is_zombie() && sys::reap(pid))
                }
                // Gone, reaped by someone else, or not ours.
                _ => false,
            });
        }
        if pending.is_empty() || Instant::now() >= until {
            return;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The few system calls std does not offer.
#[allow(unsafe_code)]
mod sys {
    use std::io;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    use tokio::io::unix::AsyncFd;
    use tokio::io::Interest;

    pub fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
        // SAFETY: pidfd_open(2) takes a pid and flags, touches no memory of ours, and
        // returns a new descriptor or -1.
        let no_flags: libc::c_long = 0;
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, libc::c_long::from(pid), no_flags) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a non-negative result is a fresh descriptor nobody else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
    }

    /// Registers `fd` with the runtime for readability.
    pub fn readable_fd(fd: OwnedFd) -> io::Result<AsyncFd<OwnedFd>> {
        // SAFETY: the `OwnedFd` moves into the `AsyncFd`, which alone owns and closes it;
        // it stays open and the same descriptor for the `AsyncFd`'s whole life.
        unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }.map_err(Into::into)
    }

    pub fn pidfd_kill(fd: &OwnedFd) {
        // SAFETY: pidfd_send_signal(2) with a null siginfo behaves as kill(2) on the
        // process the descriptor pins; no memory is passed.
        let no_flags: libc::c_long = 0;
        unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                libc::c_long::from(fd.as_raw_fd()),
                libc::c_long::from(libc::SIGKILL),
                std::ptr::null::<libc::siginfo_t>(),
                no_flags,
            );
        }
    }

    pub fn kill(pid: i32) {
        // SAFETY: kill(2) touches no memory.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
        }
    }

    pub fn kill_group(pgid: i32) {
        if pgid > 1 {
            // SAFETY: kill(2) with a negative pid signals a process group; no memory.
            unsafe {
                libc::kill(-pgid, libc::SIGKILL);
            }
        }
    }

    /// `waitpid(pid, WNOHANG)`: whether `pid` is reaped now (or was not our child).
    pub fn reap(pid: i32) -> bool {
        let mut status = 0;
        // SAFETY: waitpid(2) writes the status into the local we pass.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        r == pid || (r < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ECHILD))
    }

    /// Whether our child `pid` has exited, leaving it unreaped (`WNOWAIT`).
    pub fn exited_unreaped(pid: i32) -> bool {
        // SAFETY: siginfo_t is plain data; all zeroes is a valid value.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waitid(2) writes into the siginfo we pass and nothing else.
        let r = unsafe {
            libc::waitid(
                libc::P_PID,
                pid as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
            )
        };
        if r < 0 {
            // ECHILD: already reaped, so certainly exited.
            return io::Error::last_os_error().raw_os_error() == Some(libc::ECHILD);
        }
        // SAFETY: after a successful waitid, si_pid is set (0 when nothing has exited).
        unsafe { info.si_pid() != 0 }
    }

    pub fn set_child_subreaper() -> io::Result<()> {
        // SAFETY: prctl(2) PR_SET_CHILD_SUBREAPER takes integers only.
        let (on, unused): (libc::c_ulong, libc::c_ulong) = (1, 0);
        let r = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, on, unused, unused, unused) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    pub fn getpgrp() -> i32 {
        // SAFETY: getpgrp(2) cannot fail and touches no memory.
        unsafe { libc::getpgrp() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str, timeout: Duration) -> RunSpec {
        RunSpec::new("/bin/sh", Vec::new(), timeout)
            .arg("-c")
            .arg(script)
    }

    fn stat(pid: i32) -> Option<Proc> {
        read_stat(pid, &mut Vec::new())
    }

    /// Waits for a pid a handler wrote to `path`.
    fn pid_in(path: &Path) -> i32 {
        for _ in 0..500 {
            if let Some(pid) = std::fs::read_to_string(path)
                .ok()
                .and_then(|s| s.trim().parse().ok())
            {
                return pid;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("no pid in {}", path.display());
    }

    /// Gone or a zombie within a couple of seconds (a SIGKILLed process dies at once;
    /// one left alive lives 300 s).
    fn dies(pid: i32) -> bool {
        for _ in 0..200 {
            if stat(pid).is_none_or(|p| p.is_zombie()) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    /// Living processes whose environment holds `FORT_TEST_TAG=<tag>`.
    fn tagged(tag: &str) -> Vec<i32> {
        let needle = format!("FORT_TEST_TAG={tag}").into_bytes();
        let mut buf = Vec::new();
        scan(&mut buf)
            .into_iter()
            .filter(|p| !p.is_zombie())
            .filter(|p| environ_has(p.pid, &needle, &mut buf))
            .map(|p| p.pid)
            .collect()
    }

    fn tag() -> String {
        format!("{:016x}", rand::random::<u64>())
    }

    #[tokio::test]
    async fn echoes_stdin_and_env() {
        let mut spec = sh("cat; printf %s \"$X\"", Duration::from_secs(5)).env("X", "!");
        spec.stdin = b"hello".to_vec();
        let ok = run(&spec).await.unwrap();
        assert_eq!(ok.stdout, b"hello!");
    }

    #[tokio::test]
    async fn nonzero_exit_is_typed() {
        let err = run(&sh("echo oops >&2; exit 3", Duration::from_secs(5)))
            .await
            .unwrap_err();
        assert_eq!(err.exit_code(), 3);
        assert!(err.to_string().contains("oops"));
    }

    #[tokio::test]
    async fn timeout_kills_the_group() {
        let started = Instant::now();
        // The grandchild keeps stdout open; only a group kill ends the read.
        let err = run(&sh("sleep 30 & sleep 30", Duration::from_millis(300)))
            .await
            .unwrap_err();
        assert!(matches!(err, RunError::Timeout(_)));
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[tokio::test]
    async fn huge_output_is_refused() {
        let mut spec = sh("head -c 50000000 /dev/zero", Duration::from_secs(10));
        spec.max_stdout = 1024 * 1024;
        let err = run(&spec).await.unwrap_err();
        assert!(matches!(err, RunError::OutputTooLarge(_)));
    }

    #[tokio::test]
    async fn huge_stderr_is_capped_and_unread_stdin_is_fine() {
        let mut spec = sh(
            "head -c 5000000 /dev/zero >&2; echo ok",
            Duration::from_secs(10),
        );
        spec.max_stderr = 1000;
        spec.stdin = vec![b'x'; 4 * 1024 * 1024];
        let ok = run(&spec).await.unwrap();
        assert_eq!(ok.stdout, b"ok\n");
        assert_eq!(ok.stderr.len(), 1000);
    }

    #[tokio::test]
    async fn environment_is_clean_and_cwd_is_root() {
        // Edition 2021: set_var is safe; the name is this test's own.
        std::env::set_var("FORT_PROCESS_TEST_LEAK", "secret");
        let spec = sh("pwd; env", Duration::from_secs(5))
            .env("FORT_HOST", "h1")
            .envs([("FORT_NEED", "cert/x"), ("EXTRA", "e")]);
        let ok = run(&spec).await.unwrap();
        let text = String::from_utf8(ok.stdout).unwrap();
        let mut lines = text.lines();
        assert_eq!(lines.next(), Some("/"), "{text}");
        let env: HashMap<&str, &str> = lines.filter_map(|l| l.split_once('=')).collect();
        let path = std::env::var("PATH").unwrap_or_else(|_| DEFAULT_PATH.to_owned());
        assert_eq!(env.get("PATH"), Some(&path.as_str()), "{text}");
        assert_eq!(env.get("FORT_HOST"), Some(&"h1"));
        assert_eq!(env.get("FORT_NEED"), Some(&"cert/x"));
        assert_eq!(env.get("EXTRA"), Some(&"e"));
        assert_eq!(env.get(RUN_ID_VAR).map(|m| m.len()), Some(32));
        assert!(!env.contains_key("FORT_PROCESS_TEST_LEAK"), "{text}");
        // Nothing else but what the shell itself sets.
        let mut keys: Vec<&str> = env.keys().copied().collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            ["EXTRA", "FORT_HOST", "FORT_NEED", RUN_ID_VAR, "PATH", "PWD"],
            "{text}"
        );
    }

    #[tokio::test]
    async fn timeout_kills_setsid_grandchildren() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display();
        // One leaves the session but stays a child; the other (`-f`) is orphaned too.
        let script = format!(
            "setsid sh -c 'echo $$ > {d}/a; exec sleep 300' & \
             setsid -f sh -c 'echo $$ > {d}/b; exec sleep 300'; sleep 300"
        );
        let err = run(&sh(&script, Duration::from_millis(500)))
            .await
            .unwrap_err();
        assert!(matches!(err, RunError::Timeout(_)), "{err}");
        for f in ["a", "b"] {
            let pid = pid_in(&dir.path().join(f));
            assert!(
                dies(pid),
                "setsid grandchild {f} ({pid}) survived the timeout"
            );
        }
    }

    #[tokio::test]
    async fn exit_zero_with_children_holding_stdout_is_done() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display();
        let script = format!(
            "sleep 300 & echo $! > {d}/a; \
             setsid sh -c 'echo $$ > {d}/b; exec sleep 300' & \
             while [ ! -s {d}/b ]; do sleep 0.01; done; echo ok"
        );
        let started = Instant::now();
        let ok = run(&sh(&script, Duration::from_secs(20))).await.unwrap();
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(ok.stdout, b"ok\n");
        for f in ["a", "b"] {
            let pid = pid_in(&dir.path().join(f));
            assert!(dies(pid), "child {f} ({pid}) outlived its handler");
        }
        // And the leader's status still decides.
        let started = Instant::now();
        let err = run(&sh("sleep 300 & echo no; exit 4", Duration::from_secs(20)))
            .await
            .unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(5));
        assert_eq!(err.exit_code(), 4);
    }

    #[tokio::test]
    async fn background_children_with_redirected_output_are_killed_at_exit() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display();
        let script = format!("sleep 300 >/dev/null 2>&1 & echo $! > {d}/a; echo ok");
        let ok = run(&sh(&script, Duration::from_secs(20))).await.unwrap();
        assert_eq!(ok.stdout, b"ok\n");
        let pid = pid_in(&dir.path().join("a"));
        assert!(dies(pid), "background child ({pid}) outlived its handler");
    }

    #[tokio::test]
    async fn cancellation_kills_the_tree() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display();
        let script = format!("setsid sh -c 'echo $$ > {d}/a; exec sleep 300' & sleep 300");
        let spec = sh(&script, Duration::from_secs(60));
        let pid_file = dir.path().join("a");
        let cancelled = tokio::time::timeout(Duration::from_secs(10), async {
            tokio::select! {
                _ = run(&spec) => unreachable!("the run lasts 300 s"),
                () = async {
                    while !pid_file.exists() {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                } => {}
            }
        })
        .await;
        assert!(cancelled.is_ok());
        let pid = pid_in(&pid_file);
        assert!(dies(pid), "setsid grandchild ({pid}) survived cancellation");
    }

    #[tokio::test]
    async fn a_forking_handler_is_killed_entirely() {
        let t = tag();
        // Keeps starting detached children until killed.
        let spec = sh(
            "while :; do setsid sleep 300 & sleep 300 & done",
            Duration::from_millis(500),
        )
        .env("FORT_TEST_TAG", &t);
        let err = run(&spec).await.unwrap_err();
        assert!(matches!(err, RunError::Timeout(_)), "{err}");
        let mut left = tagged(&t);
        for _ in 0..200 {
            if left.is_empty() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
            left = tagged(&t);
        }
        assert!(
            left.is_empty(),
            "{} processes survived: {left:?}",
            left.len()
        );
    }

    #[test]
    fn stat_lines_parse() {
        let line = b"42 (a) b) c) S 7 42 42 0 -1 4194560 97 0 0 0 0 0 0 0 20 0 1 0 12345 2 3";
        let p = parse_stat(42, line).unwrap();
        assert_eq!((p.ppid, p.pgid, p.state, p.start), (7, 42, b'S', 12345));
    }

    /// The subreaper flag is process-wide, so this runs in a fresh copy of the test
    /// binary where nothing else runs.
    #[test]
    fn orphans_are_killed_and_reaped_by_a_subreaper() {
        const FLAG: &str = "FORT_PROCESS_TEST_SUBREAPER";
        let name = "process::tests::orphans_are_killed_and_reaped_by_a_subreaper";
        if std::env::var_os(FLAG).is_none() {
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", name, "--nocapture", "--test-threads=1"])
                .env(FLAG, "1")
                .output()
                .unwrap();
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(out.status.success(), "{text}");
            assert!(text.contains("1 passed"), "{text}");
            return;
        }
        become_child_subreaper().unwrap();
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
            .block_on(subreaper_scenarios());
    }

    async fn subreaper_scenarios() {
        let me = std::process::id() as i32;
        let ours = |pid: i32| stat(pid).is_some_and(|p| p.ppid == me);
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display();

        // A double-forked orphan, alive when its handler exits: killed and reaped by the
        // run itself. The handler checks it was reparented to us.
        let script = format!(
            "( sleep 300 >/dev/null 2>&1 & echo $! > {d}/orphan ); \
             sleep 0.1; cut -d' ' -f4 /proc/$(cat {d}/orphan)/stat > {d}/ppid; echo ok"
        );
        let ok = run(&sh(&script, Duration::from_secs(20))).await.unwrap();
        assert_eq!(ok.stdout, b"ok\n");
        assert_eq!(pid_in(&dir.path().join("ppid")), me, "not reparented to us");
        let orphan = pid_in(&dir.path().join("orphan"));
        assert!(
            !ours(orphan),
            "orphan {orphan} still ours: {:?}",
            stat(orphan)
        );

        // The same on timeout, with the orphan in its own session.
        let script =
            format!("( setsid sh -c 'echo $$ > {d}/orphan2; exec sleep 300' & ); sleep 300");
        let err = run(&sh(&script, Duration::from_millis(500)))
            .await
            .unwrap_err();
        assert!(matches!(err, RunError::Timeout(_)));
        let orphan = pid_in(&dir.path().join("orphan2"));
        assert!(
            !ours(orphan),
            "orphan {orphan} still ours: {:?}",
            stat(orphan)
        );

        // An orphan that left the session and died by itself during the run: no marker
        // left to read; reap_orphans reaps the zombie.
        let script = format!("( setsid sh -c 'echo $$ > {d}/dead; exit 0' & ); sleep 0.3; echo ok");
        run(&sh(&script, Duration::from_secs(20))).await.unwrap();
        let dead = pid_in(&dir.path().join("dead"));
        tokio::task::spawn_blocking(reap_orphans).await.unwrap();
        assert!(!ours(dead), "zombie {dead} not reaped: {:?}", stat(dead));

        // A sweep during a run leaves that run's orphans alone; the run's end kills them.
        let script = format!(
            "( sleep 300 >/dev/null 2>&1 & echo $! > {d}/live ); \
             while [ ! -e {d}/go ]; do sleep 0.02; done; echo ok"
        );
        let spec = sh(&script, Duration::from_secs(20));
        let running = tokio::spawn(async move { run(&spec).await });
        let live = pid_in(&dir.path().join("live"));
        tokio::time::sleep(Duration::from_millis(100)).await;
        tokio::task::spawn_blocking(reap_orphans).await.unwrap();
        assert!(
            stat(live).is_some_and(|p| p.ppid == me && !p.is_zombie()),
            "an active run's orphan was touched: {:?}",
            stat(live)
        );
        std::fs::write(dir.path().join("go"), "").unwrap();
        running.await.unwrap().unwrap();
        assert!(!ours(live), "orphan {live} still ours: {:?}", stat(live));

        // Orphans from outside `run`: one carrying the marker of a run that is over is
        // killed and reaped; one with no marker is left alone.
        let spawn_orphan = |file: &str, marker: Option<&str>| {
            let mut cmd = std::process::Command::new("/bin/sh");
            cmd.arg("-c")
                .arg(format!(
                    "( sleep 300 >/dev/null 2>&1 & echo $! > {d}/{file} )"
                ))
                .env_remove(RUN_ID_VAR);
            if let Some(m) = marker {
                cmd.env(RUN_ID_VAR, m);
            }
            assert!(cmd.status().unwrap().success());
            pid_in(&dir.path().join(file))
        };
        let stale = spawn_orphan("stale", Some("0123456789abcdef0123456789abcdef"));
        let stranger = spawn_orphan("stranger", None);
        assert!(ours(stale) && ours(stranger));
        for _ in 0..100 {
            tokio::task::spawn_blocking(reap_orphans).await.unwrap();
            if !ours(stale) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(!ours(stale), "stale orphan {stale}: {:?}", stat(stale));
        assert!(
            stat(stranger).is_some_and(|p| p.ppid == me && !p.is_zombie()),
            "unmarked orphan touched"
        );
        sys::kill(stranger);
        while !(stat(stranger).is_some_and(|p| p.is_zombie()) && sys::reap(stranger)) {
            std::thread::sleep(Duration::from_millis(5));
        }
        let left = runs().clone();
        assert!(left.is_empty(), "runs left registered: {left:?}");
    }
}
