//! Finding and killing one run's process tree: `/proc` scanning and stat parsing, the
//! membership rules (see "How the whole tree is found" in the `process` module
//! documentation), pidfd-verified kills, and the registry of runs in flight.

use parking_lot::{Mutex, RwLock};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Read;

use super::{sys, RUN_ID_VAR};

/// Upper bound on kill passes over `/proc` for one run (each pass kills every member it
/// finds; more than a handful means something forks faster than we can scan).
const MAX_KILL_PASSES: usize = 64;

// ---------------------------------------------------------------------------------------
// Registry of runs, and the lock that keeps reaping away from tokio's children.

/// Runs whose leader tokio has not reaped yet: marker -> leader pid. An entry is added
/// (under a read lock of [`SPAWN_REAP`]) right after the leader is spawned and removed
/// only after the leader is reaped, so a pid listed here is never ours to `waitpid`.
static RUNS: Mutex<BTreeMap<String, i32>> = Mutex::new(BTreeMap::new());

/// Spawning a leader and registering it holds this for reading; reaping anything that
/// is not a leader holds it for writing. So a reaper never sees a leader that is not
/// registered yet, and two reapers never race for the same pid.
pub(super) static SPAWN_REAP: RwLock<()> = RwLock::new(());

pub(super) fn runs() -> parking_lot::MutexGuard<'static, BTreeMap<String, i32>> {
    RUNS.lock()
}

pub(super) fn registered_leaders() -> HashSet<i32> {
    runs().values().copied().collect()
}

pub(super) fn unregister(marker: &str) {
    runs().remove(marker);
}

/// Identifies one run's processes (see the `process` module documentation).
#[derive(Debug, Clone)]
pub(super) struct Tree {
    pub(super) marker: String,
    /// Pid and process group id of the leader; only valid while it is unreaped.
    pub(super) leader: i32,
    /// The leader's start time (clock ticks since boot): no member started earlier.
    pub(super) leader_start: u64,
}

// ---------------------------------------------------------------------------------------
// Finding and killing a tree.

/// One process as `/proc/<pid>/stat` shows it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Proc {
    pub(super) pid: i32,
    pub(super) ppid: i32,
    pub(super) pgid: i32,
    pub(super) state: u8,
    /// Start time, clock ticks since boot.
    pub(super) start: u64,
}

impl Proc {
    pub(super) fn is_zombie(&self) -> bool {
        matches!(self.state, b'Z' | b'X')
    }
}

pub(super) fn parse_stat(pid: i32, data: &[u8]) -> Option<Proc> {
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

pub(super) fn read_stat(pid: i32, buf: &mut Vec<u8>) -> Option<Proc> {
    if !read_proc_file(&format!("/proc/{pid}/stat"), buf) {
        return None;
    }
    parse_stat(pid, buf)
}

/// Every process, as far as a pass over `/proc` sees them.
pub(super) fn scan(buf: &mut Vec<u8>) -> Vec<Proc> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|pid| read_stat(pid, buf))
        .collect()
}

/// Whether `pid`'s environment holds exactly the entry `needle` (`FORT_RUN_ID=...`).
pub(super) fn environ_has(pid: i32, needle: &[u8], buf: &mut Vec<u8>) -> bool {
    read_proc_file(&format!("/proc/{pid}/environ"), buf)
        && buf.split(|&b| b == 0).any(|entry| entry == needle)
}

/// The run marker in `pid`'s environment, if any.
pub(super) fn environ_marker(pid: i32, buf: &mut Vec<u8>) -> Option<String> {
    if !read_proc_file(&format!("/proc/{pid}/environ"), buf) {
        return None;
    }
    let prefix = format!("{RUN_ID_VAR}=");
    buf.split(|&b| b == 0)
        .find_map(|entry| entry.strip_prefix(prefix.as_bytes()))
        .map(|m| String::from_utf8_lossy(m).into_owned())
}

/// The members of `tree` among `procs` (see the `process` module documentation).
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
pub(super) fn kill_tree(tree: &Tree) -> Vec<(i32, u64)> {
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
pub(super) fn kill_verified(pid: i32, start: u64, buf: &mut Vec<u8>) {
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
