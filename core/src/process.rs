//! The one subprocess helper every handler run goes through: stdin written then closed,
//! stdout and stderr drained concurrently and capped, a timeout, its own process group
//! (killed whole on timeout, overflow or cancellation), and a typed outcome.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;

/// What to run and how.
#[derive(Debug, Clone)]
pub struct RunSpec {
    pub program: PathBuf,
    pub args: Vec<String>,
    pub stdin: Vec<u8>,
    pub env: Vec<(String, String)>,
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
            timeout,
            max_stdout: 16 * 1024 * 1024,
            max_stderr: 16 * 1024,
        }
    }

    pub fn env(mut self, key: &str, value: impl Into<String>) -> RunSpec {
        self.env.push((key.to_owned(), value.into()));
        self
    }

    pub fn arg(mut self, a: impl Into<String>) -> RunSpec {
        self.args.push(a.into());
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
    #[error("timed out after {0:?}; process group killed")]
    Timeout(Duration),
    #[error("stdout over {0} bytes; process group killed")]
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

/// Kills the whole process group when dropped, unless disarmed: covers cancellation of
/// the future that owns the run, which `kill_on_drop` alone would not (it spares
/// grandchildren).
struct GroupGuard(Option<i32>);

impl GroupGuard {
    fn kill(&mut self) {
        if let Some(pgid) = self.0.take() {
            kill_group(pgid);
        }
    }
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        self.kill();
    }
}

#[allow(unsafe_code)]
fn kill_group(pgid: i32) {
    // SAFETY: kill(2) with a negative pid signals a process group; no memory is touched.
    unsafe {
        libc::kill(-pgid, libc::SIGKILL);
    }
}

/// Runs `spec` to completion.
pub async fn run(spec: &RunSpec) -> Result<Success, RunError> {
    let started = Instant::now();
    let mut cmd = Command::new(&spec.program);
    cmd.args(&spec.args)
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    let mut child = cmd.spawn().map_err(|source| RunError::Spawn {
        program: spec.program.display().to_string(),
        source,
    })?;
    let mut guard = GroupGuard(child.id().map(|p| p as i32));
    let mut stdin = child.stdin.take().expect("stdin piped");
    let stdout = child.stdout.take().expect("stdout piped");
    let stderr = child.stderr.take().expect("stderr piped");

    let input = spec.stdin.clone();
    let feed = async move {
        // A handler that exits without reading its input is not an error of ours.
        let _ = stdin.write_all(&input).await;
        drop(stdin);
    };
    let work = async {
        let ((), out, err, status) = tokio::join!(
            feed,
            read_limited(stdout, spec.max_stdout, true),
            read_limited(stderr, spec.max_stderr, false),
            child.wait()
        );
        (out, err, status)
    };
    let (out, err, status) = match tokio::time::timeout(spec.timeout, work).await {
        Ok(done) => done,
        Err(_) => {
            guard.kill();
            let _ = child.wait().await;
            return Err(RunError::Timeout(spec.timeout));
        }
    };
    let stdout = match out {
        Ok(Some(bytes)) => bytes,
        Ok(None) => {
            guard.kill();
            return Err(RunError::OutputTooLarge(spec.max_stdout));
        }
        Err(e) => return Err(RunError::Io(e)),
    };
    let stderr = err.map_err(RunError::Io)?.unwrap_or_default();
    let status = status.map_err(RunError::Io)?;
    // The leader is gone; anything it left in its group is not ours to keep running.
    guard.0 = None;
    let stderr_text = String::from_utf8_lossy(&stderr).trim().to_owned();
    if let Some(code) = status.code() {
        if code != 0 {
            return Err(RunError::Exit {
                code,
                stderr: stderr_text,
                stdout: String::from_utf8_lossy(&stdout).into_owned(),
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
        stdout,
        stderr,
        duration: started.elapsed(),
    })
}

/// Reads to EOF keeping at most `limit` bytes. With `fail_over`, returns `None` as soon
/// as the limit is passed (the caller kills the run); otherwise the excess is dropped.
async fn read_limited<R: AsyncRead + Unpin>(
    mut reader: R,
    limit: usize,
    fail_over: bool,
) -> std::io::Result<Option<Vec<u8>>> {
    let mut kept = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        let n = reader.read(&mut chunk).await?;
        if n == 0 {
            return Ok(Some(kept));
        }
        let room = limit.saturating_sub(kept.len());
        if n > room && fail_over {
            return Ok(None);
        }
        kept.extend_from_slice(&chunk[..n.min(room)]);
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
}
