//! The agent as child subreaper: adopting the orphans of runs, and reaping them
//! without ever taking a child tokio waits for.

use std::collections::HashSet;
use std::io::Read;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::sys;
use super::tree::{
    environ_marker, kill_verified, read_stat, registered_leaders, runs, scan, SPAWN_REAP,
};

static SUBREAPER: AtomicBool = AtomicBool::new(false);

/// Makes this process the reaper of its orphaned descendants
/// (`prctl(PR_SET_CHILD_SUBREAPER)`), so that a handler's double-forked or `setsid`
/// children stay below the agent, where a run's kill finds them, instead of going to
/// init. Call once at agent start, then call [`reap_orphans`] periodically.
///
/// Contract that comes with it: every child of this process that [`run`](super::run)
/// did not spawn is taken for an orphan of some run. Code that spawns children
/// elsewhere must keep them in the agent's process group (the default), whose zombies
/// [`reap_orphans`] leaves alone.
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
        let _reaping = SPAWN_REAP.write();
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

/// Reaps the given orphans (pid, start time) as they die, for at most `patience`. Each
/// is checked, under the reaping lock, to still be our child with that start time and
/// not a registered leader before `waitpid(pid, WNOHANG)`.
pub(super) fn reap_adopted(mut pending: Vec<(i32, u64)>, patience: Duration) {
    let me = std::process::id() as i32;
    let until = Instant::now() + patience;
    let mut buf = Vec::with_capacity(512);
    loop {
        {
            let _reaping = SPAWN_REAP.write();
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
