//! A syslog server for tests: Debian's `rsyslogd` in the foreground on a loopback address,
//! listening on TCP and UDP, writing every message it receives to a file as
//! `<host> <program> <msgid> <facility> <message>` lines; stopped on drop, and however the test
//! ends (crate::cleanup).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use fort_core::process::Stop;

use crate::cleanup::Running;

pub struct SyslogServer {
    pub tcp: SocketAddr,
    pub udp: SocketAddr,
    pub received: PathBuf,
    pub dir: tempfile::TempDir,
    program: PathBuf,
    child: Option<Running>,
}

impl SyslogServer {
    /// Starts rsyslogd; `Err` says why it cannot run here (for [`crate::skip`]).
    pub fn start() -> Result<SyslogServer, String> {
        let program = crate::dns::find_program("rsyslogd").ok_or("no rsyslogd (rsyslog)")?;
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let ip = crate::next_ip();
        let tcp = crate::free_addr(&ip);
        let udp = {
            let s = std::net::UdpSocket::bind(format!("{ip}:0")).map_err(|e| e.to_string())?;
            s.local_addr().map_err(|e| e.to_string())?
        };
        let received = dir.path().join("received.log");
        let d = dir.path().display();
        let conf = format!(
            "global(workDirectory=\"{d}\")\n\
             module(load=\"imtcp\")\nmodule(load=\"imudp\")\n\
             input(type=\"imtcp\" address=\"{ip}\" port=\"{tp}\")\n\
             input(type=\"imudp\" address=\"{ip}\" port=\"{up}\")\n\
             template(name=\"seen\" type=\"string\" string=\"%hostname% %app-name% %msgid% %syslogfacility-text% %msg%\\n\")\n\
             *.* action(type=\"omfile\" file=\"{r}\" template=\"seen\")\n",
            tp = tcp.port(),
            up = udp.port(),
            r = received.display(),
        );
        std::fs::write(dir.path().join("rsyslog.conf"), conf).map_err(|e| e.to_string())?;
        let mut server = SyslogServer {
            tcp,
            udp,
            received,
            dir,
            program,
            child: None,
        };
        server.restart()?;
        Ok(server)
    }

    /// Starts it again on the same addresses, after [`SyslogServer::stop`].
    pub fn restart(&mut self) -> Result<(), String> {
        self.stop();
        let d = self.dir.path();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(d.join("server.log"))
            .map_err(|e| e.to_string())?;
        let child = Running::spawn(
            std::process::Command::new(&self.program)
                .arg("-n")
                .arg("-f")
                .arg(d.join("rsyslog.conf"))
                .arg("-i")
                .arg(d.join("rsyslogd.pid"))
                .stdin(Stdio::null())
                .stdout(log.try_clone().map_err(|e| e.to_string())?)
                .stderr(log),
            Stop::TERM,
        )
        .map_err(|e| format!("cannot start rsyslogd: {e}"))?;
        self.child = Some(child);
        // Up once its TCP port answers.
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(self.tcp).is_err() {
            if let Some(status) = self.child.as_mut().and_then(Running::exited) {
                let log = std::fs::read_to_string(d.join("server.log")).unwrap_or_default();
                return Err(format!("rsyslogd exited ({status}): {log}"));
            }
            if Instant::now() > deadline {
                return Err("rsyslogd did not listen within 20 s".into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// What it has received so far, one message a line.
    pub fn lines(&self) -> Vec<String> {
        std::fs::read_to_string(&self.received)
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.stop();
        }
    }
}

impl Drop for SyslogServer {
    fn drop(&mut self) {
        self.stop();
    }
}
