//! The network the machines of one test share: a namespace of its own whose only
//! interface is loopback, up.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A network namespace with only a loopback interface, up: machines that share it
/// reach each other on 127.0.0.0/8 and nothing else, and tests running side by side
/// cannot collide on ports. Held by a process that exits when dropped or when the test
/// process dies (its stdin is a pipe from the test).
pub struct Net {
    holder: Child,
}

impl Net {
    pub fn new() -> Result<Net, String> {
        let mut holder = Command::new("unshare")
            .args(["--net", "--", "cat"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot run unshare: {e}"))?;
        let ours = std::fs::read_link("/proc/self/ns/net").map_err(|e| e.to_string())?;
        let path = PathBuf::from(format!("/proc/{}/ns/net", holder.id()));
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::fs::read_link(&path).ok().is_none_or(|ns| ns == ours) {
            if let Ok(Some(status)) = holder.try_wait() {
                return Err(format!("unshare --net exited ({status})"));
            }
            if Instant::now() > deadline {
                let _ = holder.kill();
                return Err("unshare --net did not enter a new network namespace".into());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let net = Net { holder };
        loopback_up(&net.path()).map_err(|e| format!("cannot bring up loopback: {e}"))?;
        Ok(net)
    }

    /// The namespace, for `systemd-nspawn --network-namespace-path`.
    pub fn path(&self) -> PathBuf {
        PathBuf::from(format!("/proc/{}/ns/net", self.holder.id()))
    }

    /// Whether `addr` accepts a TCP connection inside the namespace (a server the test
    /// started there, such as an ACME CA).
    #[allow(unsafe_code)]
    pub fn reachable(&self, addr: std::net::SocketAddr) -> bool {
        use std::os::fd::AsRawFd;
        let Ok(ns) = std::fs::File::open(self.path()) else {
            return false;
        };
        std::thread::spawn(move || {
            // SAFETY: setns moves only this thread, which ends here.
            if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return false;
            }
            std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_ok()
        })
        .join()
        .unwrap_or(false)
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        drop(self.holder.stdin.take());
        let _ = self.holder.kill();
        let _ = self.holder.wait();
    }
}

/// `ip link set lo up` inside `ns`, from a thread that enters it and then ends.
#[allow(unsafe_code)]
fn loopback_up(ns: &Path) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let ns = std::fs::File::open(ns)?;
    std::thread::spawn(move || -> std::io::Result<()> {
        let fail = || Err(std::io::Error::last_os_error());
        // SAFETY: setns moves only this thread, which ends here; the socket and the
        // zeroed ifreq are local, and the ioctls write only into `req`.
        unsafe {
            if libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                return fail();
            }
            let sock = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
            if sock < 0 {
                return fail();
            }
            let mut req: libc::ifreq = std::mem::zeroed();
            for (d, s) in req.ifr_name.iter_mut().zip(b"lo\0") {
                *d = *s as libc::c_char;
            }
            let mut rc = libc::ioctl(sock, libc::SIOCGIFFLAGS, &mut req);
            if rc == 0 {
                req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
                rc = libc::ioctl(sock, libc::SIOCSIFFLAGS, &req);
            }
            let result = if rc == 0 { Ok(()) } else { fail() };
            libc::close(sock);
            result
        }
    })
    .join()
    .map_err(|_| std::io::Error::other("the loopback thread panicked"))?
}
