//! The demo's nginx step: when nginx is installed, the demo starts one on loopback
//! (unprivileged, in the foreground) and beacon also serves `vhost` with `fort-handler
//! proxy`; app asks for a virtual host forwarding to a small web server of its own, and
//! an HTTP request to nginx by the vhost's name reaches it. Without nginx the step says
//! so and the vhost of the steps above is the example handler's text file. The same nginx
//! answers the ACME CA's HTTP-01 challenges (acme.rs) from a webroot of its default
//! server. It runs in a process group of its own and is stopped gracefully: the master
//! waits for its workers, which a SIGKILL of the master would leave running.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use fort_core::process::{Server, Stop};
use serde_json::json;

use super::fleet::{CapDecl, Fleet, NeedDecl};
use super::steps::{need_row, Wait};
use crate::admin::AdminRequest;

pub(super) const NEED: &str = "vhost/wiki";
/// The walkthrough step that adds [`NEED`].
pub(super) const STEP: usize = 8;
const NAME: &str = "www.demo.test";
const GREETING: &str = "hello from app's own web server";

/// An nginx the demo started; stopped, workers and all, when dropped.
pub(super) struct DemoNginx {
    master: Server,
    program: PathBuf,
    dir: PathBuf,
    pub(super) addr: SocketAddr,
    /// What its default server serves under `/.well-known/acme-challenge/`: readable by
    /// its workers (user `nobody` when the demo runs as root), so not under the demo's
    /// private directory; removed with it.
    webroot: tempfile::TempDir,
}

impl DemoNginx {
    /// Starts nginx under `root/nginx` with a default server answering ACME challenges
    /// from its webroot and 404 to everything else, and an include directory for vhosts;
    /// `Ok(None)` when nginx is not installed.
    pub(super) fn start(root: &Path) -> anyhow::Result<Option<DemoNginx>> {
        let Some(program) = super::acme::find("nginx") else {
            return Ok(None);
        };
        let dir = root.join("nginx");
        std::fs::create_dir_all(dir.join("vhosts"))?;
        let webroot = tempfile::Builder::new()
            .prefix("fort-demo-webroot-")
            .tempdir_in(webroot_parent()?)?;
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(webroot.path(), std::fs::Permissions::from_mode(0o755))?;
        }
        let addr = TcpListener::bind("127.0.0.1:0")?.local_addr()?;
        let d = dir.display();
        let w = webroot.path().display();
        std::fs::write(
            dir.join("nginx.conf"),
            format!(
                "pid {d}/nginx.pid;\nerror_log {d}/error.log;\nworker_processes 1;\n\
                 events {{ worker_connections 64; }}\n\
                 http {{\n  access_log {d}/access.log;\n  client_body_temp_path {d}/t1;\n  proxy_temp_path {d}/t2;\n  fastcgi_temp_path {d}/t3;\n  uwsgi_temp_path {d}/t4;\n  scgi_temp_path {d}/t5;\n\
                 server {{\n    listen {addr} default_server;\n    location /.well-known/acme-challenge/ {{ root {w}; }}\n    location / {{ return 404; }}\n  }}\n\
                 include {d}/vhosts/*.conf;\n}}\n"
            ),
        )?;
        let mut me = DemoNginx {
            master: Server::spawn(
                Command::new(&program)
                    .args(base_args(&dir))
                    .args(["-g", "daemon off;"])
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null()),
                Stop::QUIT,
            )
            .context("cannot start nginx")?,
            program,
            dir,
            addr,
            webroot,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(addr).is_err() {
            if let Some(status) = me.master.exited() {
                bail!(
                    "nginx exited ({status}); see {}",
                    me.dir.join("error.log").display()
                );
            }
            if Instant::now() > deadline {
                bail!("nginx did not listen within 10s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(Some(me))
    }

    /// Challenges nginx refused (403) so far: its workers could not read the webroot.
    pub(super) fn refused_challenges(&self) -> usize {
        self.access_log()
            .lines()
            .filter(|l| l.contains("/.well-known/acme-challenge/") && l.contains("\" 403 "))
            .count()
    }

    /// Where nginx logs what it served.
    pub(super) fn access_log_path(&self) -> std::path::PathBuf {
        self.dir.join("access.log")
    }

    /// What nginx served so far (its access log).
    pub(super) fn access_log(&self) -> String {
        std::fs::read_to_string(self.dir.join("access.log")).unwrap_or_default()
    }

    /// The webroot whose `.well-known/acme-challenge/` the default server serves.
    pub(super) fn webroot(&self) -> &Path {
        self.webroot.path()
    }

    fn command(&self, tail: &[&str]) -> Vec<String> {
        let mut argv = vec![self.program.display().to_string()];
        argv.extend(base_args(&self.dir));
        argv.extend(tail.iter().map(|s| s.to_string()));
        argv
    }

    /// beacon's `vhost` capability (`fort-handler proxy` for this nginx) and app's need
    /// for a virtual host, added by the step (its port is set then).
    pub(super) fn declarations(&self, root: &Path) -> anyhow::Result<(CapDecl, NeedDecl)> {
        let handler = std::env::current_exe()?.with_file_name("fort-handler");
        if !handler.is_file() {
            bail!("{} is not built", handler.display());
        }
        let config = self.dir.join("proxy.json");
        std::fs::write(
            &config,
            json!({
                "include_dir": self.dir.join("vhosts"),
                "state_file": root.join("beacon/state/proxy-vhosts.json"),
                "hosts": root.join("hosts.json"),
                "test_command": self.command(&["-t", "-q"]),
                "reload_command": self.command(&["-s", "reload"]),
                "listen": [self.addr.to_string()],
                "allow": {"app": [NAME]},
            })
            .to_string(),
        )?;
        let cap = CapDecl {
            host: "beacon",
            name: "vhost",
            handler: "",
            command: Some((
                handler,
                vec![
                    "proxy".into(),
                    "--config".into(),
                    config.display().to_string(),
                ],
            )),
            cache_response: true,
            description: "nginx virtual hosts, each checked with nginx -t",
        };
        let need = NeedDecl {
            consumer: "app",
            key: NEED,
            from: "beacon",
            request: json!({"server_names": [NAME], "port": 1}),
            handler: None,
            files: vec![("vhost.json", "", "0444")],
            more: json!({}),
            added_in: Some(STEP),
            released_in: None,
        };
        Ok((cap, need))
    }

    /// `GET /` with `Host: name`: the status line and the body.
    fn get(&self, name: &str) -> anyhow::Result<(String, String)> {
        let mut s = TcpStream::connect(self.addr)?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        write!(
            s,
            "GET / HTTP/1.1\r\nHost: {name}\r\nConnection: close\r\n\r\n"
        )?;
        let mut text = String::new();
        s.take(64 * 1024).read_to_string(&mut text)?;
        let status = text.lines().next().unwrap_or("").to_owned();
        let body = text.split("\r\n\r\n").nth(1).unwrap_or("").to_owned();
        Ok((status, body))
    }
}

fn base_args(dir: &Path) -> Vec<String> {
    let d = dir.display();
    vec![
        "-p".into(),
        d.to_string(),
        "-c".into(),
        format!("{d}/nginx.conf"),
        "-e".into(),
        format!("{d}/error.log"),
    ]
}

/// A web server on app's own address, answering every request with [`GREETING`] (a thread
/// that lives as long as the demo).
fn app_web_server(ip: std::net::IpAddr) -> anyhow::Result<u16> {
    let listener = TcpListener::bind((ip, 0)).context("app's web server")?;
    let port = listener.local_addr()?.port();
    std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            let _ = conn.set_read_timeout(Some(Duration::from_secs(2)));
            let mut buf = [0u8; 4096];
            let _ = conn.read(&mut buf);
            let _ = write!(
                conn,
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{GREETING}",
                GREETING.len()
            );
        }
    });
    Ok(port)
}

/// The step: app's vhost at beacon's nginx forwards to app's own web server by its name;
/// any other name gets nginx's 404.
pub(super) async fn step(fleet: &mut Fleet, nginx: Option<&DemoNginx>) -> anyhow::Result<String> {
    let Some(nginx) = nginx else {
        println!(
            "  nginx is not installed: no web server to configure; the vhost of the steps above"
        );
        println!("  is the example handler's text file.");
        return Ok("skipped: nginx is not installed".into());
    };
    let port = app_web_server(fleet.host("app").addr.ip())?;
    if let Some(need) = fleet.needs.iter_mut().find(|n| n.key == NEED) {
        need.request["port"] = port.into();
    }
    println!(
        "  nginx runs at {} (beacon's, unprivileged); beacon serves vhost with",
        nginx.addr
    );
    println!("  fort-handler proxy. app runs a web server on its own address, port {port}, and");
    println!("  declares {NEED}: {{\"server_names\": [\"{NAME}\"], \"port\": {port}}}.");
    fleet.declare_at("app", STEP)?;
    fleet
        .admin("app", &AdminRequest::Reload)
        .await
        .context("reload app")?;
    let wait = Wait::until("app's vhost is in place at nginx");
    loop {
        if need_row(fleet, NEED).await?["satisfied"] == true {
            break;
        }
        wait.tick().await?;
    }
    // The reload reaches nginx's workers a moment after it is signalled.
    let wait = Wait::until("nginx forwards the vhost's name to app's web server");
    let (status, body) = loop {
        let (status, body) = nginx.get(NAME)?;
        if body == GREETING {
            break (status, body);
        }
        wait.tick().await?;
    };
    let (other, _) = nginx.get("elsewhere.demo.test")?;
    if !other.contains(" 404 ") {
        bail!("a name no vhost has should get nginx's 404, got {other:?}");
    }
    println!("  GET http://{NAME}/ at nginx: {status}: \"{body}\"");
    println!("  GET http://elsewhere.demo.test/ at nginx: {other} (no vhost has that name)");
    Ok("a vhost at a real nginx forwards by name to app's web server".into())
}

/// Where the webroot can go: a directory nginx's workers can reach. Run as root, nginx's
/// workers are user `nobody`, which must be able to pass through every directory above
/// the webroot; `$TMPDIR` under a private directory (mode 0700) would make every challenge
/// a 403 that only nginx's log shows. The temporary directory when others can pass
/// through it, else `/tmp` or `/var/tmp`; none of them: say so and how to fix it.
fn webroot_parent() -> anyhow::Result<std::path::PathBuf> {
    webroot_parent_of(&std::env::temp_dir())
}

fn webroot_parent_of(tmp: &Path) -> anyhow::Result<std::path::PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let root = std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0);
    let tmp = tmp.to_owned();
    if !root {
        return Ok(tmp);
    }
    let passable = |dir: &Path| {
        dir.ancestors()
            .all(|d| std::fs::metadata(d).is_ok_and(|m| m.mode() & 0o001 != 0))
    };
    for candidate in [tmp.as_path(), Path::new("/tmp"), Path::new("/var/tmp")] {
        if candidate.is_dir() && passable(candidate) {
            return Ok(candidate.to_owned());
        }
    }
    bail!(
        "nginx's workers (user nobody) could not read an ACME challenge webroot under {} or /tmp: a directory above it does not let others pass (mode without o+x). Run the demo with TMPDIR set to a directory others can pass through (for example TMPDIR=/tmp)",
        tmp.display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// As root, a `$TMPDIR` under a private directory is passed over for one nginx's
    /// workers can reach.
    #[test]
    fn the_webroot_goes_where_nginx_workers_can_read_it() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        if !std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0) {
            return; // not root: nginx's workers are the demo's own user
        }
        let private = tempfile::tempdir().unwrap();
        std::fs::set_permissions(private.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        let tmp = private.path().join("tmp");
        std::fs::create_dir(&tmp).unwrap();
        let chosen = webroot_parent_of(&tmp).unwrap();
        assert!(!chosen.starts_with(private.path()), "{}", chosen.display());
        std::fs::set_permissions(private.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(webroot_parent_of(&tmp).unwrap(), tmp);
    }
}
