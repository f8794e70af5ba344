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

mod reap;
pub mod server;
#[allow(unsafe_code)]
mod sys;
mod tree;

pub use reap::{become_child_subreaper, reap_orphans};
pub use server::{Server, ServerHandle, Stop};

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, Command};

use reap::reap_adopted;
use tree::{kill_tree, read_stat, runs, unregister, Tree, SPAWN_REAP};

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

    pub fn args(mut self, args: impl IntoIterator<Item = String>) -> RunSpec {
        self.args.extend(args);
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

impl Success {
    /// What the run printed on stderr, as [`RunError::stderr_excerpt`] gives it.
    pub fn stderr_excerpt(&self, max: usize) -> Option<String> {
        excerpt(&String::from_utf8_lossy(&self.stderr), max)
    }
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

    /// What went wrong, without anything the handler printed: fit for state files and
    /// status pages, where a handler's stderr (which may echo its input, a credential)
    /// must never be kept.
    pub fn summary(&self) -> String {
        match self {
            RunError::Spawn { program, source } => format!("cannot start {program}: {source}"),
            RunError::Exit { code, .. } => format!("exited with code {code}"),
            RunError::Signal { signal, .. } => format!("killed by signal {signal}"),
            RunError::Timeout(d) => format!("timed out after {d:?}"),
            RunError::OutputTooLarge(n) => format!("printed more than {n} bytes"),
            RunError::Io(e) => format!("i/o with the handler failed: {e}"),
        }
    }

    /// The start of what the handler printed on stderr, on one line (control characters
    /// escaped), at most `max` bytes: for the log only.
    pub fn stderr_excerpt(&self, max: usize) -> Option<String> {
        match self {
            RunError::Exit { stderr, .. } | RunError::Signal { stderr, .. } => excerpt(stderr, max),
            _ => None,
        }
    }
}

/// The start of `text` on one line (control characters escaped), at most `max` bytes.
fn excerpt(text: &str, max: usize) -> Option<String> {
    let text = text.trim_end();
    if text.is_empty() {
        return None;
    }
    let mut cut = text.len().min(max);
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    let more = if cut < text.len() { "…" } else { "" };
    Some(format!("{}{more}", text[..cut].escape_debug()))
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
        let _spawning = SPAWN_REAP.read();
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

#[cfg(test)]
mod tests;
