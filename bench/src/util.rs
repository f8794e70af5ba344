//! Shared pieces: finding and running `fort-agent` processes (killed on drop, and with
//! the bench if it dies), the admin socket, per-process CPU and memory from `/proc`, our
//! own CPU time from `getrusage`, percentiles, and the printed report.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use fort_tests::Fleet;
use serde_json::{json, Value};

static AGENT_BIN: OnceLock<PathBuf> = OnceLock::new();
static AGENT_LOG: OnceLock<String> = OnceLock::new();
static KEEP: OnceLock<bool> = OnceLock::new();

/// With `--keep`: the fleet directory (configs, state, agent logs) outlives the run.
pub fn set_keep(keep: bool) {
    let _ = KEEP.set(keep);
}

/// Whether `--keep` was given.
pub fn keeping() -> bool {
    KEEP.get().copied().unwrap_or(false)
}

/// A fresh fleet directory, kept after the run with `--keep`.
pub fn new_fleet() -> Fleet {
    let mut fleet = Fleet::new();
    if KEEP.get().copied().unwrap_or(false) {
        fleet.dir.disable_cleanup(true);
        eprintln!("fort-bench: keeping {}", fleet.dir.path().display());
    }
    fleet
}

/// The fort-agent binary the benchmarks start (set by [`init_agent_bin`]).
pub fn agent_bin() -> Result<PathBuf> {
    AGENT_BIN
        .get()
        .cloned()
        .ok_or_else(|| anyhow!("the fort-agent binary is not set"))
}

/// Finds `fort-agent`: `--agent-bin`, then `$FORT_BIN_FORT_AGENT`, then next to this exe
/// (both built into the same target dir).
pub fn init_agent_bin(explicit: Option<PathBuf>, log_level: &str) -> Result<PathBuf> {
    let path = match explicit.or_else(|| std::env::var_os("FORT_BIN_FORT_AGENT").map(PathBuf::from))
    {
        Some(p) => p,
        None => std::env::current_exe()
            .context("current exe")?
            .parent()
            .ok_or_else(|| anyhow!("exe has no directory"))?
            .join("fort-agent"),
    };
    if !path.is_file() {
        bail!(
            "{} not found: build it next to fort-bench (`cargo build --release -p fort-agent -p fort-bench`) or pass --agent-bin",
            path.display()
        );
    }
    let path = std::path::absolute(&path)?;
    let _ = AGENT_BIN.set(path.clone());
    let _ = AGENT_LOG.set(log_level.to_owned());
    Ok(path)
}

pub fn require_jq() -> Result<()> {
    let ok = Command::new("jq")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !ok {
        bail!("jq is needed for the provider's handler script and is not on PATH");
    }
    Ok(())
}

/// A provider handler that answers `"OK"` for every entry (a side-effect-only need is
/// satisfied by it without any consumer process), optionally only for keys ending in
/// `only_suffix`.
pub fn ok_handler(fleet: &Fleet, only_suffix: Option<&str>) -> PathBuf {
    let expr = match only_suffix {
        None => r#"with_entries(.value = "OK")"#.to_owned(),
        Some(s) => {
            format!(
                r#"with_entries(.value = (if (.key | endswith("{s}")) then "OK" else null end))"#
            )
        }
    };
    fleet.script("ok-handler", &format!("exec jq -c '{expr}'"))
}

/// Asks the kernel to SIGKILL the child when the thread that spawned it dies (even on
/// `panic = "abort"`), so no agent outlives the bench. Spawn only from the main thread.
#[allow(unsafe_code)]
fn die_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs between fork and exec and only calls prctl(2), which is
    // async-signal-safe; it allocates nothing.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong);
            Ok(())
        });
    }
}

#[allow(unsafe_code)]
fn signal(pid: u32, sig: i32) {
    // SAFETY: kill(2) on the pid of a child we own and have not reaped.
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

/// A running `fort-agent serve`; SIGKILLed and reaped on drop.
pub struct AgentProc {
    pub name: String,
    pub addr: SocketAddr,
    pub dir: PathBuf,
    child: Child,
}

impl AgentProc {
    /// Starts `name`'s agent from the files `fleet.write_files()` wrote. Does not wait.
    pub fn spawn(fleet: &Fleet, name: &str) -> Result<AgentProc> {
        let bin = AGENT_BIN
            .get()
            .ok_or_else(|| anyhow!("agent binary not set"))?;
        let spec = fleet
            .hosts
            .get(name)
            .ok_or_else(|| anyhow!("no host {name}"))?;
        let dir = fleet.host_dir(name);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("agent.log"))
            .context("agent log")?;
        let mut cmd = Command::new(bin);
        cmd.arg("serve")
            .arg("--config")
            .arg(dir.join("agent.toml"))
            .env(
                "FORT_LOG",
                AGENT_LOG.get().map(String::as_str).unwrap_or("info"),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        die_with_parent(&mut cmd);
        let child = cmd.spawn().context("spawn fort-agent")?;
        Ok(AgentProc {
            name: name.to_owned(),
            addr: spec.addr,
            dir,
            child,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.join("agent.sock")
    }

    pub fn hup(&self) {
        signal(self.pid(), libc::SIGHUP);
    }

    fn exited(&mut self) -> Option<String> {
        match self.child.try_wait() {
            Ok(Some(status)) => {
                let log = std::fs::read_to_string(self.dir.join("agent.log")).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(10).collect();
                Some(format!(
                    "agent {} exited with {status}; log tail:\n{}",
                    self.name,
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                ))
            }
            _ => None,
        }
    }
}

impl Drop for AgentProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits until every agent is ready: its port accepts connections and its admin socket
/// answers (the port is bound before the agent has loaded its state). Bounded by `timeout`.
pub fn wait_listening(agents: &mut [AgentProc], timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    let mut up = vec![false; agents.len()];
    while up.iter().any(|u| !u) {
        for (i, a) in agents.iter_mut().enumerate() {
            if up[i] {
                continue;
            }
            if let Some(why) = a.exited() {
                bail!(why);
            }
            up[i] = TcpStream::connect_timeout(&a.addr, Duration::from_millis(50)).is_ok()
                && admin(
                    &a.socket(),
                    &json!({"cmd": "status"}),
                    Duration::from_secs(10),
                )
                .is_ok();
        }
        if Instant::now() > deadline {
            let down: Vec<&str> = agents
                .iter()
                .zip(&up)
                .filter(|(_, u)| !**u)
                .map(|(a, _)| a.name.as_str())
                .collect();
            bail!("agents not listening after {timeout:?}: {down:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

/// One admin-socket exchange (a JSON line each way).
pub fn admin(socket: &Path, req: &Value, timeout: Duration) -> Result<Value> {
    let mut s = UnixStream::connect(socket)
        .with_context(|| format!("admin socket {}", socket.display()))?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    let mut line = serde_json::to_vec(req)?;
    line.push(b'\n');
    s.write_all(&line)?;
    let mut reply = String::new();
    BufReader::new(s).read_line(&mut reply)?;
    let v: Value = serde_json::from_str(&reply).context("admin reply")?;
    if v["ok"] != json!(true) {
        bail!("admin {req} failed: {}", v["error"]);
    }
    Ok(v)
}

/// The agent's status document over its admin socket.
pub fn status(socket: &Path) -> Result<Value> {
    Ok(admin(socket, &json!({"cmd": "status"}), Duration::from_secs(30))?["status"].take())
}

/// `(total, satisfied)` needs of an agent, or `None` while its socket is not up. Asks
/// for counts only: polling must not cost the agent a row per need.
pub fn needs_satisfied(socket: &Path) -> Option<(u64, u64)> {
    let c = admin(socket, &json!({"cmd": "counts"}), Duration::from_secs(30)).ok()?;
    let needs = c["needs"].as_object()?;
    let total = needs.values().filter_map(Value::as_u64).sum();
    Some((total, needs.get("satisfied")?.as_u64()?))
}

/// `(entries, undelivered, handler_runs)` of one provider capability, and state writes.
pub fn provider_counts(status: &Value, cap: &str) -> (u64, u64, u64, u64) {
    let c = &status["provider"]["capabilities"][cap];
    (
        c["entries"].as_u64().unwrap_or(0),
        c["undelivered"].as_u64().unwrap_or(0),
        c["handler_runs"].as_u64().unwrap_or(0),
        status["provider"]["state_writes"].as_u64().unwrap_or(0),
    )
}

#[allow(unsafe_code)]
fn clock_ticks() -> u64 {
    // SAFETY: sysconf(3) has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as u64
    } else {
        100
    }
}

/// utime + stime of a process, from `/proc/<pid>/stat` (clock-tick resolution).
pub fn proc_cpu(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    Some(Duration::from_micros(ticks * 1_000_000 / clock_ticks()))
}

/// utime + stime of a process and of the children it has waited for (an agent's handler
/// runs), from `/proc/<pid>/stat`.
pub fn proc_cpu_with_children(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = (11..=14)
        .map(|i| f.get(i)?.parse::<u64>().ok())
        .sum::<Option<u64>>()?;
    Some(Duration::from_micros(ticks * 1_000_000 / clock_ticks()))
}

/// A `kB` field of `/proc/<pid>/status` (`VmRSS`, `VmHWM`).
pub fn proc_kb(pid: u32, field: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// CPU time the whole machine spent busy (all cores, from `/proc/stat`), to tell how
/// much of a run's CPU went to other processes.
pub fn machine_busy() -> Duration {
    let text = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let f: Vec<u64> = text
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal …
    let busy: u64 = f.iter().take(8).sum::<u64>() - f.get(3).unwrap_or(&0) - f.get(4).unwrap_or(&0);
    Duration::from_micros(busy * 1_000_000 / clock_ticks())
}

pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

#[allow(unsafe_code)]
fn rusage(who: libc::c_int) -> Duration {
    // SAFETY: getrusage(2) fills the zeroed struct we pass; `who` is a valid constant.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(who, &mut ru);
        ru
    };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// CPU time of the calling thread (µs resolution).
/// CPU time of this thread, to the nanosecond (`getrusage` counts in scheduler ticks
/// here, 4 ms: too coarse for a batch of signatures).
#[allow(unsafe_code)]
pub fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the call to fill.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return rusage(libc::RUSAGE_THREAD);
    }
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// CPU time of this process's children that have been waited for.
pub fn children_cpu() -> Duration {
    rusage(libc::RUSAGE_CHILDREN)
}

/// CPU time of this whole process.
pub fn self_cpu() -> Duration {
    rusage(libc::RUSAGE_SELF)
}

pub fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

/// Nearest-rank percentile of sorted values.
pub fn percentile<T: Copy + Default>(sorted: &[T], q: f64) -> T {
    if sorted.is_empty() {
        return T::default();
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// `(min, median, max)` of unsorted values.
pub fn spread(values: &mut [u64]) -> (u64, u64, u64) {
    values.sort_unstable();
    (
        percentile(values, 0.0),
        percentile(values, 0.5),
        percentile(values, 1.0),
    )
}

/// Numbers printed as aligned lines, or as one JSON object with `--json`.
/// The figures every capability benchmark gives of its runs over unchanged entries, the
/// same way (`fort-bench unchanged` puts them side by side): the median and slowest of
/// the runs' wall times (a whole process: start, read the input, load the state, answer),
/// and the state the handler keeps for them, in all and per entry.
pub fn unchanged_summary(
    report: &mut Report,
    walls: &[Duration],
    entries: usize,
    state: &std::path::Path,
) {
    let mut walls = walls.to_vec();
    walls.sort_unstable();
    let state_bytes = std::fs::metadata(state).map_or(0, |m| m.len());
    let per_entry = state_bytes / entries.max(1) as u64;
    report.line(
        "unchanged_summary",
        json!({
            "entries": entries,
            "runs": walls.len(),
            "median_ms": ms(percentile(&walls, 0.5)),
            "max_ms": ms(percentile(&walls, 1.0)),
            "state_bytes": state_bytes,
            "state_bytes_per_entry": per_entry,
        }),
        format!(
            "{entries} unchanged entries: median {:.1} ms, max {:.1} ms over {} runs; state {:.1} MiB ({per_entry} bytes per entry)",
            ms(percentile(&walls, 0.5)),
            ms(percentile(&walls, 1.0)),
            walls.len(),
            state_bytes as f64 / (1024.0 * 1024.0)
        ),
    );
}

/// Handler runs over unchanged entries: the wall time of each, and the handler's own
/// count of its time (its first line of notes ends with "<n> ms").
#[derive(Default)]
pub struct UnchangedRuns {
    walls: Vec<Duration>,
    own: Vec<Duration>,
}

impl UnchangedRuns {
    pub fn add(&mut self, wall: Duration, stderr: &str) {
        self.walls.push(wall);
        if let Some(n) = stderr
            .lines()
            .next()
            .and_then(|l| l.strip_suffix(" ms"))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|n| n.parse::<u64>().ok())
        {
            self.own.push(Duration::from_millis(n));
        }
    }

    /// The `unchanged_ms` line and its goal; `why_no_calls` says what made any call to
    /// the server fail.
    pub fn report(
        mut self,
        report: &mut Report,
        entries: usize,
        input_bytes: usize,
        why_no_calls: &str,
        goal: Duration,
        state: &std::path::Path,
    ) {
        unchanged_summary(report, &self.walls, entries, state);
        self.walls.sort_unstable();
        self.own.sort_unstable();
        let median = percentile(&self.walls, 0.5);
        report.line(
            "unchanged_ms",
            ms(median),
            format!(
                "median {:.1} ms, max {:.1} ms per run over {entries} unchanged entries (process start to exit; {:.0} ms inside the handler), {} kB of input, {why_no_calls}",
                ms(median),
                ms(percentile(&self.walls, 1.0)),
                ms(percentile(&self.own, 0.5)),
                input_bytes / 1024
            ),
        );
        report.target(
            &format!("{entries} unchanged < {} ms", goal.as_millis()),
            median < goal,
        );
    }
}

pub struct Report {
    json: bool,
    fields: serde_json::Map<String, Value>,
    targets: serde_json::Map<String, Value>,
}

impl Report {
    pub fn new(title: &str, json: bool) -> Report {
        if !json {
            println!("== fort-bench {title}");
        }
        let mut fields = serde_json::Map::new();
        fields.insert("bench".into(), json!(title));
        let load = loadavg();
        if !json {
            println!("  {:<36} {load} (before the run)", "loadavg");
        }
        fields.insert("loadavg".into(), json!(load));
        Report {
            json,
            fields,
            targets: serde_json::Map::new(),
        }
    }

    /// Records `key = value` and prints `label: shown`.
    /// Whether the agents sent batches (protocol §11.8) or one item per request.
    pub fn batches(&mut self, one_by_one: bool) {
        let shown = if one_by_one { "no (one by one)" } else { "yes" };
        self.line("batches", !one_by_one, shown);
    }

    pub fn line(&mut self, key: &str, value: impl Into<Value>, shown: impl std::fmt::Display) {
        if !self.json {
            println!("  {key:<36} {shown}");
        }
        self.fields.insert(key.to_owned(), value.into());
    }

    pub fn target(&mut self, what: &str, pass: bool) {
        if !self.json {
            println!("  target {what:<29} {}", if pass { "PASS" } else { "FAIL" });
        }
        self.targets.insert(what.to_owned(), json!(pass));
    }

    pub fn note(&self, text: &str) {
        if !self.json {
            println!("  note: {text}");
        }
    }

    pub fn finish(mut self) {
        if self.json {
            self.fields
                .insert("targets".into(), Value::Object(self.targets));
            println!("{}", Value::Object(self.fields));
        }
    }
}

/// The `fort-handler` binary the capability benchmarks run: `--handler-bin`,
/// `FORT_BIN_FORT_HANDLER`, or the one next to `fort-bench`.
pub fn handler_bin(explicit: Option<PathBuf>) -> Result<PathBuf> {
    let path =
        match explicit.or_else(|| std::env::var_os("FORT_BIN_FORT_HANDLER").map(PathBuf::from)) {
            Some(p) => p,
            None => std::env::current_exe()?
                .parent()
                .ok_or_else(|| anyhow!("exe has no directory"))?
                .join("fort-handler"),
        };
    if !path.is_file() {
        bail!(
            "{} not found: build it next to fort-bench (`cargo build --release -p fort-handlers -p fort-bench`) or pass --handler-bin",
            path.display()
        );
    }
    // Agents run it from their own directories: a relative path would name nothing there.
    Ok(std::path::absolute(&path)?)
}

/// Runs a handler as the agent does: `input` written to its stdin by a thread of its own
/// (so that a large input and a large output cannot block each other), its stdout read
/// whole. The wall time from spawn to exit, and its output; a failed run is an error
/// with its stderr, named by `what`.
pub fn run_handler_once(
    cmd: &mut Command,
    input: Vec<u8>,
    what: &str,
) -> Result<(Duration, std::process::Output)> {
    let t = Instant::now();
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("start {what}"))?;
    let mut stdin = child.stdin.take().expect("piped");
    let writer = std::thread::spawn(move || stdin.write_all(&input));
    let out = child.wait_with_output()?;
    let wall = t.elapsed();
    writer
        .join()
        .map_err(|_| anyhow!("stdin writer panicked"))??;
    if !out.status.success() {
        bail!("{what} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok((wall, out))
}

/// `fort-handler <capability> --config CONFIG` run once as the agent runs it (a clean
/// environment, `FORT_TRIGGER=request`, the entries on stdin): its wall time, its output
/// as JSON and its stderr.
pub fn run_capability(
    bin: &Path,
    capability: &str,
    config: &Path,
    input: Vec<u8>,
) -> Result<(Duration, Value, String)> {
    let mut cmd = Command::new(bin);
    cmd.arg(capability)
        .arg("--config")
        .arg(config)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("FORT_TRIGGER", "request")
        .env("FORT_CAPABILITY", capability);
    let (wall, out) = run_handler_once(&mut cmd, input, &format!("fort-handler {capability}"))?;
    let output = serde_json::from_slice(&out.stdout).context("the handler's output")?;
    Ok((
        wall,
        output,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}
