//! The run's agent processes: started (in the host's network namespace when there is
//! one, with the binary and environment a fault asks for), waited for until they answer,
//! killed with `kill -9` (the agent's group and every handler it runs, as systemd's
//! control group would end them), stopped with SIGTERM, hung with SIGSTOP, and sampled
//! for CPU and memory. Every process is killed when the run ends, however it ends
//! (fort_tests::cleanup, and PR_SET_PDEATHSIG should the run itself be killed).

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fort_core::process::Stop;
use fort_tests::cleanup::Running;
use serde_json::json;

use crate::util;

/// How long a start may take before it counts as failed: generous, the machine is busy.
pub const START_DEADLINE: Duration = Duration::from_secs(90);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Down,
    Starting,
    Up,
    Hung,
}

pub struct Host {
    pub name: String,
    pub dir: PathBuf,
    pub addr: SocketAddr,
    pub netns: Option<PathBuf>,
    /// Another release's agent (a rollback), or the tree's.
    pub binary: Option<PathBuf>,
    /// Extra environment (a clock off: libfaketime).
    pub env: Vec<(String, String)>,
    pub state: State,
    proc: Option<Running>,
    pid: u32,
    cpu_last: Duration,
    pub cpu_done: Duration,
    pub rss_max_kb: u64,
    rss_sum_kb: u64,
    rss_samples: u64,
    pub starts: u32,
}

pub struct Procs {
    pub hosts: BTreeMap<String, Host>,
    agent_bin: PathBuf,
}

/// SIGKILL when the thread that started it ends (the run's runtime threads live as long
/// as the run), so no agent outlives a run that was itself killed.
#[allow(unsafe_code)]
fn die_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: between fork and exec, only prctl(2), which is async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong);
            Ok(())
        });
    }
}

#[allow(unsafe_code)]
pub fn signal(pid: u32, sig: i32) {
    if pid > 1 {
        // SAFETY: kill(2) on a child's pid, still unreaped (its owner holds it).
        unsafe {
            libc::kill(pid as libc::pid_t, sig);
        }
    }
}

/// Every descendant of `pid` now (children of children…), from /proc.
pub fn descendants(pid: u32) -> Vec<u32> {
    let mut parent_of: Vec<(u32, u32)> = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(p) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else {
            continue;
        };
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        if let Some(pp) = rest.split_whitespace().nth(1).and_then(|v| v.parse().ok()) {
            parent_of.push((p, pp));
        }
    }
    let mut out = Vec::new();
    let mut todo = vec![pid];
    while let Some(p) = todo.pop() {
        for (c, pp) in &parent_of {
            if *pp == p && !out.contains(c) {
                out.push(*c);
                todo.push(*c);
            }
        }
    }
    out
}

impl Procs {
    pub fn new(agent_bin: PathBuf) -> Procs {
        Procs {
            hosts: BTreeMap::new(),
            agent_bin,
        }
    }

    pub fn add(&mut self, name: &str, dir: PathBuf, addr: SocketAddr, netns: Option<PathBuf>) {
        self.hosts.insert(
            name.to_owned(),
            Host {
                name: name.to_owned(),
                dir,
                addr,
                netns,
                binary: None,
                env: Vec::new(),
                state: State::Down,
                proc: None,
                pid: 0,
                cpu_last: Duration::ZERO,
                cpu_done: Duration::ZERO,
                rss_max_kb: 0,
                rss_sum_kb: 0,
                rss_samples: 0,
                starts: 0,
            },
        );
    }

    /// Starts `name`'s agent; [`wait_ready`] then waits until it answers.
    pub fn spawn(&mut self, name: &str, log_level: &str) -> Result<(), String> {
        let agent_bin = self.agent_bin.clone();
        let h = self.hosts.get_mut(name).ok_or("no such host")?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(h.dir.join("agent.log"))
            .map_err(|e| format!("agent log: {e}"))?;
        let binary = h.binary.clone().unwrap_or(agent_bin);
        let mut cmd = fort_tests::command_in(h.netns.as_deref(), &binary);
        cmd.arg("serve")
            .arg("--config")
            .arg(h.dir.join("agent.toml"))
            .env("FORT_LOG", log_level)
            .envs(h.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        die_with_parent(&mut cmd);
        // Stopped by a signal to the run: at once. A graceful stop is stop_taken's.
        let running = Running::spawn(&mut cmd, Stop::KILL).map_err(|e| format!("spawn: {e}"))?;
        h.pid = running.id();
        h.proc = Some(running);
        h.state = State::Starting;
        h.cpu_last = Duration::ZERO;
        h.starts += 1;
        Ok(())
    }

    /// `Some(why)` when `name`'s agent has exited (by itself: a crash).
    pub fn exited(&mut self, name: &str) -> Option<String> {
        let h = self.hosts.get_mut(name)?;
        let status = h.proc.as_mut()?.exited()?;
        h.proc = None;
        h.state = State::Down;
        h.cpu_done += h.cpu_last;
        Some(format!("exit status {status}\n{}", log_tail(&h.dir, 25)))
    }

    /// `kill -9` of `name`'s agent, its group and every process its handlers started.
    pub fn kill(&mut self, name: &str) {
        let Some(h) = self.hosts.get_mut(name) else {
            return;
        };
        if let Some(mut p) = h.proc.take() {
            sample_one(h);
            let children = descendants(h.pid);
            p.kill();
            for c in children {
                signal(c, libc::SIGKILL);
            }
            h.cpu_done += h.cpu_last;
        }
        h.state = State::Down;
    }

    /// Takes `name`'s process out for a graceful stop ([`stop_taken`]) outside the lock.
    pub fn take_for_stop(&mut self, name: &str) -> Option<Running> {
        let h = self.hosts.get_mut(name)?;
        sample_one(h);
        h.cpu_done += h.cpu_last;
        h.state = State::Down;
        h.proc.take()
    }

    pub fn hang(&mut self, name: &str, hung: bool) {
        if let Some(h) = self.hosts.get_mut(name) {
            if h.proc.is_some() {
                signal(h.pid, if hung { libc::SIGSTOP } else { libc::SIGCONT });
                h.state = if hung { State::Hung } else { State::Up };
            }
        }
    }

    pub fn pid(&self, name: &str) -> Option<u32> {
        let h = self.hosts.get(name)?;
        h.proc.as_ref().map(|_| h.pid)
    }

    pub fn is(&self, name: &str, state: State) -> bool {
        self.hosts.get(name).is_some_and(|h| h.state == state)
    }

    pub fn set_up(&mut self, name: &str) {
        if let Some(h) = self.hosts.get_mut(name) {
            if h.proc.is_some() {
                h.state = State::Up;
            }
        }
    }

    /// CPU and memory of every running agent, for the figures.
    pub fn sample(&mut self) {
        for h in self.hosts.values_mut() {
            if h.proc.is_some() {
                sample_one(h);
            }
        }
    }

    /// (CPU of every agent and its handlers, mean RSS, largest RSS).
    pub fn usage(&self) -> (Duration, u64, u64) {
        let cpu = self
            .hosts
            .values()
            .map(|h| {
                h.cpu_done
                    + if h.proc.is_some() {
                        h.cpu_last
                    } else {
                        Duration::ZERO
                    }
            })
            .sum();
        let (sum, n) = self
            .hosts
            .values()
            .fold((0, 0), |(s, n), h| (s + h.rss_sum_kb, n + h.rss_samples));
        let max = self.hosts.values().map(|h| h.rss_max_kb).max().unwrap_or(0);
        (cpu, sum / n.max(1), max)
    }

    /// Kills every agent (the end of the run).
    pub fn kill_all(&mut self) {
        let names: Vec<String> = self.hosts.keys().cloned().collect();
        for n in names {
            self.hang(&n, false);
            self.kill(&n);
        }
    }
}

fn sample_one(h: &mut Host) {
    if let Some(cpu) = util::proc_cpu_with_children(h.pid) {
        h.cpu_last = cpu;
    }
    if let Some(rss) = util::proc_kb(h.pid, "VmRSS") {
        h.rss_max_kb = h.rss_max_kb.max(rss);
        h.rss_sum_kb += rss;
        h.rss_samples += 1;
    }
}

/// SIGTERM, as systemd stops it, and up to 20 s to finish; then SIGKILL of what is
/// left (blocking).
pub fn stop_taken(mut p: Running) {
    let children = descendants(p.id());
    signal(p.id(), libc::SIGTERM);
    let deadline = Instant::now() + Duration::from_secs(20);
    while p.exited().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    p.kill();
    for c in children {
        signal(c, libc::SIGKILL);
    }
}

/// The last `n` lines of `dir`'s agent log.
pub fn log_tail(dir: &Path, n: usize) -> String {
    let log = std::fs::read_to_string(dir.join("agent.log")).unwrap_or_default();
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Waits until `name`'s agent answers on its port and its admin socket; `Err` with its
/// log when it exits first or does not answer within [`START_DEADLINE`].
pub async fn wait_ready(procs: &std::sync::Mutex<Procs>, name: &str) -> Result<Duration, String> {
    let started = Instant::now();
    let (addr, dir) = {
        let p = procs.lock().expect("procs");
        let h = &p.hosts[name];
        (h.addr, h.dir.clone())
    };
    loop {
        if let Some(why) = procs.lock().expect("procs").exited(name) {
            return Err(why);
        }
        let answers = TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
            && util::admin(
                &dir.join("agent.sock"),
                &json!({"cmd": "status"}),
                Duration::from_secs(5),
            )
            .is_ok();
        if answers {
            procs.lock().expect("procs").set_up(name);
            return Ok(started.elapsed());
        }
        if started.elapsed() > START_DEADLINE {
            return Err(format!(
                "did not answer within {START_DEADLINE:?}\n{}",
                log_tail(&dir, 25)
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
