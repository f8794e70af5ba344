//! Whatever a test starts is stopped however the test ends. A normal end and a panic
//! drop the servers, whose `Drop` stops them; a signal (Ctrl-C's SIGINT, the SIGTERM
//! nextest sends a test past its timeout, SIGHUP) runs no destructor, so every server
//! also registers here, and the first such signal stops every registered one before the
//! process dies of it.
//!
//! And for tests of that promise: [`adopt_orphans`] and [`leftovers`] find what a program
//! left running after it ended.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Once};

type Action = Arc<dyn Fn() + Send + Sync>;

static ACTIONS: Mutex<BTreeMap<u64, Action>> = Mutex::new(BTreeMap::new());
static NEXT: AtomicU64 = AtomicU64::new(0);
static WATCHER: Once = Once::new();

/// Runs its action on a signal until dropped (when the server it stops is stopped).
pub struct OnSignal(u64);

impl Drop for OnSignal {
    fn drop(&mut self) {
        actions().remove(&self.0);
    }
}

fn actions() -> std::sync::MutexGuard<'static, BTreeMap<u64, Action>> {
    // A panic elsewhere while the lock was held leaves the map as it was: still usable.
    ACTIONS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs `stop` when this process gets SIGINT, SIGTERM or SIGHUP, as long as the returned
/// guard lives.
pub fn on_signal(stop: impl Fn() + Send + Sync + 'static) -> OnSignal {
    WATCHER.call_once(watch_signals);
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    actions().insert(id, Arc::new(stop));
    OnSignal(id)
}

/// [`on_signal`] for a [`fort_core::process::Server`]: its handle's stop.
pub fn stop_on_signal(server: &fort_core::process::Server) -> OnSignal {
    let handle = server.handle();
    on_signal(move || handle.stop())
}

/// A thread with its own runtime waits for the signals; the handlers are installed before
/// this returns, so a signal right after a server started is not missed.
fn watch_signals() {
    let (ready, installed) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("fort-tests-signals".into())
        .spawn(move || {
            use tokio::signal::unix::{signal, SignalKind};
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime for the signal watcher");
            let signal = runtime.block_on(async move {
                let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
                let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
                let mut hup = signal(SignalKind::hangup()).expect("SIGHUP handler");
                let _ = ready.send(());
                tokio::select! {
                    _ = int.recv() => libc::SIGINT,
                    _ = term.recv() => libc::SIGTERM,
                    _ = hup.recv() => libc::SIGHUP,
                }
            });
            let pending: Vec<Action> = actions().values().cloned().collect();
            for stop in pending {
                stop();
            }
            die_of(signal);
        })
        .expect("spawn the signal watcher");
    installed.recv().expect("the signal watcher starts");
}

/// Ends the process as the signal would have without a handler, so that whoever started
/// it sees that signal as the cause.
#[allow(unsafe_code)]
fn die_of(signal: i32) -> ! {
    // SAFETY: signal(2) and raise(3) take integers only; restoring the default action and
    // raising the signal terminates the process.
    unsafe {
        libc::signal(signal, libc::SIG_DFL);
        libc::raise(signal);
    }
    std::process::exit(128 + signal);
}

/// Makes this process the reaper of orphans its descendants leave
/// (`PR_SET_CHILD_SUBREAPER`): a process that outlives the program that started it
/// becomes this process's child instead of init's, where [`leftovers`] finds it.
pub fn adopt_orphans() {
    fort_core::process::become_child_subreaper().expect("PR_SET_CHILD_SUBREAPER");
}

/// This process's living children other than `except` (pid and command line), which
/// after [`adopt_orphans`] include everything a finished program left running. Each is
/// then SIGKILLed and reaped, so a failing check leaves nothing behind either.
pub fn leftovers(except: &[u32]) -> Vec<(u32, String)> {
    let me = std::process::id();
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // `pid (comm) state ppid …`; comm may hold anything, so split at its last `)`.
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let mut fields = rest.split_whitespace();
        let (state, ppid) = (fields.next(), fields.next().and_then(|p| p.parse().ok()));
        if ppid != Some(me) || except.contains(&pid) {
            continue;
        }
        if !matches!(state, Some("Z" | "X")) {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            found.push((pid, cmdline.trim().to_owned()));
        }
        kill_and_reap(pid);
    }
    found
}

#[allow(unsafe_code)]
fn kill_and_reap(pid: u32) {
    let pid = pid as libc::pid_t;
    // SAFETY: kill(2) and waitpid(2) on a child of this process (its parent is us, so the
    // pid cannot be reused before it is reaped here); waitpid writes only the local.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
        let mut status = 0;
        libc::waitpid(pid, &mut status, 0);
    }
}

/// A server the harness started: stopped, group and all, when dropped or when a signal
/// ends the test.
pub struct Running {
    // Declared first, dropped first: stopped before its signal action goes away.
    server: fort_core::process::Server,
    _on_signal: OnSignal,
}

impl Running {
    /// Spawns `command` in a process group of its own (see [`fort_core::process::server`]).
    pub fn spawn(
        command: &mut std::process::Command,
        stop: fort_core::process::Stop,
    ) -> std::io::Result<Running> {
        let server = fort_core::process::Server::spawn(command, stop)?;
        let on_signal = stop_on_signal(&server);
        Ok(Running {
            server,
            _on_signal: on_signal,
        })
    }

    pub fn id(&self) -> u32 {
        self.server.id()
    }

    /// `Some(status)` once it has exited (then reaped, its group killed).
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.server.exited()
    }

    pub fn stop(&mut self) {
        self.server.stop();
    }

    /// `kill -9` of its whole group.
    pub fn kill(&mut self) {
        self.server.kill();
    }

    pub fn child_mut(&mut self) -> &mut std::process::Child {
        self.server.child_mut()
    }
}
