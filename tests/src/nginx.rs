//! nginx as the proxy capability's tests run it: an unprivileged master process in the
//! foreground (`-p DIR -c DIR/nginx.conf -g 'daemon off;'`) on 127.0.0.1 and a free port,
//! with a default server that answers 404 and an include directory for vhosts; the test
//! and reload commands the handler is configured with; small HTTP upstreams to forward to.
//! It runs in a process group of its own and is stopped gracefully (SIGQUIT: the master
//! waits for its workers), then the group is killed (crate::cleanup).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::cleanup::Running;
use crate::dns::find_program;
use fort_core::process::Stop;

/// A running nginx, stopped on drop.
pub struct Nginx {
    pub dir: tempfile::TempDir,
    pub program: PathBuf,
    pub addr: SocketAddr,
    master: Option<Running>,
    /// What every nginx command runs under (`unshare` for a private `/etc/hosts`).
    wrap: Vec<String>,
}

impl Nginx {
    /// Starts nginx; `Err` says why it cannot run here (not installed).
    pub fn start() -> Result<Nginx, String> {
        Nginx::start_wrapped(Vec::new())
    }

    /// Starts nginx with every command of it (the server, its test and its reload)
    /// resolving host names through `hosts` in place of `/etc/hosts` (bind-mounted in a
    /// mount namespace of its own): a test changes what an upstream name resolves to by
    /// rewriting `hosts` in place. `Err` when that cannot be done here (not root, no
    /// `unshare`).
    pub fn start_resolving(hosts: &std::path::Path) -> Result<Nginx, String> {
        let unshare = find_program("unshare").ok_or("no unshare (util-linux)")?;
        let wrap: Vec<String> = vec![
            unshare.display().to_string(),
            "--mount".into(),
            "sh".into(),
            "-c".into(),
            r#"mount --bind "$0" /etc/hosts && exec "$@""#.into(),
            hosts.display().to_string(),
        ];
        let probe = Command::new(&wrap[0])
            .args(&wrap[1..])
            .arg("true")
            .output()
            .map_err(|e| format!("cannot run unshare: {e}"))?;
        if !probe.status.success() {
            return Err(format!(
                "cannot give nginx a hosts file of its own (needs root): {}",
                String::from_utf8_lossy(&probe.stderr).trim()
            ));
        }
        Nginx::start_wrapped(wrap)
    }

    fn start_wrapped(wrap: Vec<String>) -> Result<Nginx, String> {
        let program = find_program("nginx").ok_or("nginx is not installed (nginx-light)")?;
        let dir = tempfile::tempdir().expect("tempdir");
        let addr = crate::free_addr("127.0.0.1");
        let d = dir.path().display().to_string();
        std::fs::create_dir(dir.path().join("vhosts")).expect("mkdir");
        std::fs::write(
            dir.path().join("nginx.conf"),
            format!(
                "pid {d}/nginx.pid;\nerror_log {d}/error.log;\nworker_processes 1;\n\
                 events {{ worker_connections 256; }}\n\
                 http {{\n  access_log {d}/access.log;\n  client_body_temp_path {d}/t1;\n  proxy_temp_path {d}/t2;\n  fastcgi_temp_path {d}/t3;\n  uwsgi_temp_path {d}/t4;\n  scgi_temp_path {d}/t5;\n\
                 server_names_hash_bucket_size 128;\n  server_names_hash_max_size 65536;\n\
                 server {{ listen {addr} default_server; return 404; }}\n\
                 include {d}/vhosts/*.conf;\n}}\n"
            ),
        )
        .expect("write nginx.conf");
        let mut nginx = Nginx {
            dir,
            program,
            addr,
            master: None,
            wrap,
        };
        // Wrapped, the process is still nginx's master: `unshare` and `sh` exec it.
        let argv = nginx.command(&["-g", "daemon off;"]);
        let master = Running::spawn(
            Command::new(&argv[0])
                .args(&argv[1..])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
            Stop::QUIT,
        )
        .map_err(|e| format!("cannot start nginx: {e}"))?;
        nginx.master = Some(master);
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(addr).is_err() {
            if let Some(status) = nginx.master.as_mut().and_then(Running::exited) {
                return Err(format!("nginx exited ({status}): {}", nginx.error_log()));
            }
            if Instant::now() > deadline {
                return Err(format!("nginx did not listen: {}", nginx.error_log()));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(nginx)
    }

    fn base_args(&self) -> Vec<String> {
        let d = self.dir.path().display();
        vec![
            "-p".into(),
            d.to_string(),
            "-c".into(),
            format!("{d}/nginx.conf"),
            "-e".into(),
            format!("{d}/error.log"),
        ]
    }

    fn command(&self, tail: &[&str]) -> Vec<String> {
        let mut argv = self.wrap.clone();
        argv.push(self.program.display().to_string());
        argv.extend(self.base_args());
        argv.extend(tail.iter().map(|s| s.to_string()));
        argv
    }

    /// `nginx … -t -q`, as the handler's `test_command`.
    pub fn test_command(&self) -> Vec<String> {
        self.command(&["-t", "-q"])
    }

    /// `nginx … -s reload`, as the handler's `reload_command`.
    pub fn reload_command(&self) -> Vec<String> {
        self.command(&["-s", "reload"])
    }

    /// The directory nginx.conf includes.
    pub fn vhosts(&self) -> PathBuf {
        self.dir.path().join("vhosts")
    }

    pub fn error_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("error.log")).unwrap_or_default()
    }

    /// `GET path` with `Host: host`: the status and body.
    pub fn get(&self, host: &str, path: &str) -> (u16, String) {
        http_get(self.addr, host, path)
    }

    /// Waits (up to 10 s: a reload starts new workers, and old ones answer with the old
    /// configuration until they are gone) until `GET /` for `host` answers `status`; the
    /// last answer.
    pub fn wait_for(&self, host: &str, status: u16) -> (u16, String) {
        self.answer(self.addr, host, "/", |got| got.0 == status)
    }

    /// Waits as `wait_for` until `GET /` for `host` at another address this nginx listens
    /// on (a vhost's own `listen`) answers `status` with `body`; the last answer.
    pub fn wait_for_at(
        &self,
        addr: SocketAddr,
        host: &str,
        status: u16,
        body: &str,
    ) -> (u16, String) {
        self.answer(addr, host, "/", |got| got.0 == status && got.1 == body)
    }

    /// Waits as `wait_for` until `GET path` for `host` answers `status` with `body`; the
    /// last answer.
    pub fn wait_for_body(&self, host: &str, path: &str, status: u16, body: &str) -> (u16, String) {
        self.answer(self.addr, host, path, |got| {
            got.0 == status && got.1 == body
        })
    }

    fn answer(
        &self,
        addr: SocketAddr,
        host: &str,
        path: &str,
        done: impl Fn(&(u16, String)) -> bool,
    ) -> (u16, String) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let got = http_get(addr, host, path);
            if done(&got) || Instant::now() > deadline {
                return got;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The master process's pid as its pid file says.
    pub fn master_pid(&self) -> Option<u32> {
        std::fs::read_to_string(self.dir.path().join("nginx.pid"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }
}

impl Nginx {
    /// Stops nginx now (master and workers), as dropping it does.
    pub fn stop(&mut self) {
        if let Some(mut master) = self.master.take() {
            master.stop();
        }
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One HTTP/1.0 GET: status and body ((0, error) when nothing answered).
pub fn http_get(addr: SocketAddr, host: &str, path: &str) -> (u16, String) {
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(5)) else {
        return (0, "no connection".into());
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = write!(s, "GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n");
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// An HTTP upstream on `ip` and a free port answering every request with
/// `<name> <path>`; stopped on drop.
pub struct Upstream {
    pub addr: SocketAddr,
    stop: Arc<AtomicBool>,
}

impl Upstream {
    pub fn start(ip: &str, name: &str) -> Upstream {
        let listener = TcpListener::bind(format!("{ip}:0")).expect("bind upstream");
        let addr = listener.local_addr().expect("addr");
        listener.set_nonblocking(true).expect("nonblocking");
        let stop = Arc::new(AtomicBool::new(false));
        let (flag, name) = (stop.clone(), name.to_owned());
        std::thread::spawn(move || {
            while !flag.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((mut s, _)) => {
                        let _ = s.set_nonblocking(false);
                        let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
                        let mut buf = [0u8; 4096];
                        let n = s.read(&mut buf).unwrap_or(0);
                        let head = String::from_utf8_lossy(&buf[..n]);
                        let path = head.split(' ').nth(1).unwrap_or("?").to_owned();
                        let body = format!("{name} {path}");
                        let _ = write!(
                            s,
                            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                            body.len()
                        );
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        });
        Upstream { addr, stop }
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}
