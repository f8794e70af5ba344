//! Long-lived servers that the demo and the tests start (nginx, pebble, a DNS server, an
//! OpenID provider, agents): each runs in a process group of its own and is stopped as a
//! whole. nginx is why: SIGKILL on its master leaves its workers running, adopted by
//! init and still listening, while its graceful stop (SIGQUIT) makes the master wait for
//! them. So a server is asked to stop with its own signal, given a grace period, and then
//! whatever is left of its group is SIGKILLed.
//!
//! The group's id is the leader's pid. It is signalled only while the leader is unreaped
//! (its exit is seen with `waitid(WNOWAIT)`), so the id cannot have been reused by a
//! stranger; the leader is reaped last.

use std::io;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::sys;

/// How a server is asked to stop before its group is killed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stop {
    /// Sent to the leader first.
    pub signal: i32,
    /// How long the leader may take to exit before the group is SIGKILLed.
    pub grace: Duration,
}

impl Stop {
    /// SIGTERM, and 5 s to exit.
    pub const TERM: Stop = Stop {
        signal: libc::SIGTERM,
        grace: Duration::from_secs(5),
    };
    /// SIGQUIT, and 5 s to exit: nginx's graceful stop, where the master exits only
    /// after its workers.
    pub const QUIT: Stop = Stop {
        signal: libc::SIGQUIT,
        grace: Duration::from_secs(5),
    };
    /// SIGKILL to the whole group at once (`kill -9`).
    pub const KILL: Stop = Stop {
        signal: libc::SIGKILL,
        grace: Duration::ZERO,
    };
}

struct Leader {
    pid: i32,
    /// Once reaped, the pid (and group id) may belong to a stranger: never signalled again.
    reaped: bool,
}

/// A running server, stopped (group and all) when dropped.
pub struct Server {
    child: Child,
    leader: Arc<Mutex<Leader>>,
    stop: Stop,
    status: Option<ExitStatus>,
}

/// Stops a [`Server`] from another thread (a signal watcher) without owning it; the
/// owner still reaps it.
#[derive(Clone)]
pub struct ServerHandle {
    leader: Arc<Mutex<Leader>>,
    stop: Stop,
}

impl Server {
    /// Spawns `command` as the leader of a new process group.
    pub fn spawn(command: &mut Command, stop: Stop) -> io::Result<Server> {
        let child = command.process_group(0).spawn()?;
        let pid = i32::try_from(child.id()).map_err(io::Error::other)?;
        Ok(Server {
            child,
            leader: Arc::new(Mutex::new(Leader { pid, reaped: false })),
            stop,
            status: None,
        })
    }

    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// The standard streams the command was given as pipes.
    pub fn child_mut(&mut self) -> &mut Child {
        &mut self.child
    }

    pub fn handle(&self) -> ServerHandle {
        ServerHandle {
            leader: self.leader.clone(),
            stop: self.stop,
        }
    }

    /// `Some(status)` once the leader has exited (by itself or stopped): what is left of
    /// its group is killed and it is reaped. `None` while it runs.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        let mut leader = self.leader.lock();
        if !leader.reaped {
            if !sys::exited_unreaped(leader.pid) {
                return None;
            }
            sys::kill_group(leader.pid);
            self.status = self.child.wait().ok();
            leader.reaped = true;
        }
        self.status
    }

    /// Stops the server as its [`Stop`] says and reaps it; its exit status.
    pub fn stop(&mut self) -> Option<ExitStatus> {
        self.stop_with(self.stop)
    }

    /// `kill -9` of the whole group now.
    pub fn kill(&mut self) -> Option<ExitStatus> {
        self.stop_with(Stop::KILL)
    }

    fn stop_with(&mut self, how: Stop) -> Option<ExitStatus> {
        let mut leader = self.leader.lock();
        if !leader.reaped {
            stop_group(leader.pid, how);
            // Its group was SIGKILLed last: it dies now, if it had not exited before.
            self.status = self.child.wait().ok();
            leader.reaped = true;
        }
        self.status
    }
}

impl ServerHandle {
    /// Stops the server as its [`Stop`] says, leaving the leader for its owner to reap.
    /// Nothing happens when it is already stopped.
    pub fn stop(&self) {
        let leader = self.leader.lock();
        if !leader.reaped {
            stop_group(leader.pid, self.stop);
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Signals the unreaped leader `pid`, waits up to the grace period for it to exit, then
/// SIGKILLs its group (members that outlived it, or everyone when it did not exit).
fn stop_group(pid: i32, how: Stop) {
    if how.signal != libc::SIGKILL && !sys::exited_unreaped(pid) {
        sys::send(pid, how.signal);
        let deadline = Instant::now() + how.grace;
        while !sys::exited_unreaped(pid) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    sys::kill_group(pid);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::BufRead;
    use std::process::Stdio;

    fn alive(pid: i32) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| {
                s.rsplit_once(')')
                    .map(|(_, rest)| rest.trim_start().starts_with(['Z', 'X']))
            })
            == Some(false)
    }

    /// A shell that ignores the stop signal and runs a child: like an nginx master
    /// whose workers outlive it, the child is killed with the group.
    #[test]
    fn a_server_that_ignores_its_signal_is_killed_with_its_children() {
        let mut command = Command::new("sh");
        command
            .args(["-c", "trap '' TERM; sleep 60 & echo $!; wait"])
            .stdout(Stdio::piped());
        let stop = Stop {
            signal: libc::SIGTERM,
            grace: Duration::from_millis(200),
        };
        let mut server = Server::spawn(&mut command, stop).unwrap();
        let mut line = String::new();
        std::io::BufReader::new(server.child_mut().stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let sleeper: i32 = line.trim().parse().unwrap();
        assert!(alive(sleeper));
        assert!(server.exited().is_none());
        let started = Instant::now();
        let status = server.stop().expect("reaped");
        assert!(started.elapsed() >= Duration::from_millis(200), "no grace");
        assert!(!status.success());
        // Adopted by init once its shell is gone, the sleeper is reaped there.
        let deadline = Instant::now() + Duration::from_secs(5);
        while alive(sleeper) {
            assert!(
                Instant::now() < deadline,
                "the child {sleeper} outlived the stop"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        // Stopping again (and dropping) signals nothing.
        assert_eq!(server.stop(), Some(status));
    }

    #[test]
    fn a_server_that_exits_on_its_signal_is_not_waited_for() {
        let mut server = Server::spawn(Command::new("sleep").arg("60"), Stop::TERM).expect("sleep");
        let handle = server.handle();
        let started = Instant::now();
        handle.stop();
        assert!(started.elapsed() < Duration::from_secs(2));
        let status = server.exited().expect("exited");
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGTERM));
        handle.stop();
    }
}
