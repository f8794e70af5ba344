//! The few system calls std does not offer: the only `unsafe` code of the subprocess
//! helper (allowed on the `mod sys` declaration), each call with its SAFETY argument.

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

/// Sends `signal` to `pid` (a negative `pid`: to that process group).
pub fn send(pid: i32, signal: i32) {
    // SAFETY: kill(2) touches no memory.
    unsafe {
        libc::kill(pid, signal);
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
