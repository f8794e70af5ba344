//! Pebble (Let's Encrypt's ACME test server) on loopback for tests: a CA and a
//! `127.0.0.1` certificate for its own TLS made here (Debian's pebble ships none), free
//! ports for the directory, the management interface and the ports it validates HTTP-01
//! and TLS-ALPN-01 at, names resolved at a DNS server the test runs; stopped on drop. And
//! nginx serving a webroot on the port pebble validates HTTP-01 at. `curl` reads the
//! management interface as a person would (its root, a certificate's status). Both are
//! stopped however the test ends (crate::cleanup).

use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::cleanup::Running;
use crate::dns::find_program;
use fort_core::process::Stop;

/// Where a pebble runs when not in the test's own network namespace.
struct Namespace<'a> {
    netns: PathBuf,
    listen: SocketAddr,
    management: SocketAddr,
    reachable: &'a dyn Fn(SocketAddr) -> bool,
}

/// A running pebble.
pub struct Pebble {
    pub dir: tempfile::TempDir,
    /// `https://127.0.0.1:PORT/dir`.
    pub directory: String,
    pub management: SocketAddr,
    /// Where pebble connects for HTTP-01 (on the address the name resolves to).
    pub http_port: u16,
    /// The CA pebble's own TLS certificate chains to (for the ACME client).
    pub tls_root: PathBuf,
    child: Option<Running>,
}

impl Pebble {
    /// Starts pebble resolving names at `dns` (`-dnsserver`). `Err` says why it cannot run
    /// here (a program missing), for `skip`.
    pub fn start(
        dns: SocketAddr,
        certificate_validity_seconds: Option<u64>,
    ) -> Result<Pebble, String> {
        Pebble::start_with(dns, certificate_validity_seconds, false, None)
    }

    /// Pebble that takes every challenge as valid without looking
    /// (`PEBBLE_VA_ALWAYS_VALID=1`): for benchmarks of the ACME client's side, where no
    /// time should go to validation.
    pub fn start_always_valid() -> Result<Pebble, String> {
        Pebble::start_with(crate::free_addr("127.0.0.1"), None, true, None)
    }

    /// Pebble in the network namespace `netns` (the systemd lane's loopback), its
    /// directory at `listen`, taking every challenge as valid; `reachable` tells whether
    /// an address of that namespace accepts connections.
    pub fn start_in_namespace(
        netns: &Path,
        listen: SocketAddr,
        management: SocketAddr,
        reachable: &dyn Fn(SocketAddr) -> bool,
    ) -> Result<Pebble, String> {
        let within = Namespace {
            netns: netns.to_path_buf(),
            listen,
            management,
            reachable,
        };
        Pebble::start_with(listen, None, true, Some(within))
    }

    fn start_with(
        dns: SocketAddr,
        certificate_validity_seconds: Option<u64>,
        always_valid: bool,
        within: Option<Namespace>,
    ) -> Result<Pebble, String> {
        let program = find_program("pebble").ok_or("pebble is not installed")?;
        find_program("curl").ok_or("curl is not installed")?;
        let dir = tempfile::tempdir().expect("tempdir");
        let ca_key = rcgen::KeyPair::generate().expect("key");
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "fort test pebble TLS CA");
        let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key).expect("CA");
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params =
            rcgen::CertificateParams::new(vec!["localhost".to_owned()]).expect("params");
        params
            .subject_alt_names
            .push(rcgen::SanType::IpAddress("127.0.0.1".parse().unwrap()));
        let cert = params.signed_by(&key, &ca).expect("leaf");
        let tls_root = dir.path().join("tls-root.pem");
        std::fs::write(&tls_root, ca.pem()).expect("write");
        std::fs::write(dir.path().join("cert.pem"), cert.pem()).expect("write");
        std::fs::write(dir.path().join("key.pem"), key.serialize_pem()).expect("write");
        let (listen, management) = match &within {
            Some(n) => (n.listen, n.management),
            None => (crate::free_addr("127.0.0.1"), crate::free_addr("127.0.0.1")),
        };
        let http_port = crate::free_addr("127.0.0.1").port();
        let tls_port = crate::free_addr("127.0.0.1").port();
        let mut config = serde_json::json!({"pebble": {
            "listenAddress": listen.to_string(),
            "managementListenAddress": management.to_string(),
            "certificate": dir.path().join("cert.pem"),
            "privateKey": dir.path().join("key.pem"),
            "httpPort": http_port,
            "tlsPort": tls_port,
            "ocspResponderURL": "",
            "externalAccountBindingRequired": false,
        }});
        if let Some(s) = certificate_validity_seconds {
            config["pebble"]["certificateValidityPeriod"] = s.into();
        }
        let conf = dir.path().join("pebble.json");
        std::fs::write(&conf, config.to_string()).expect("write");
        let log = std::fs::File::create(dir.path().join("pebble.log")).expect("log");
        let mut command = crate::command_in(within.as_ref().map(|n| n.netns.as_path()), program);
        if always_valid {
            command.env("PEBBLE_VA_ALWAYS_VALID", "1");
        }
        let child = Running::spawn(
            command
                .args([
                    "-config",
                    &conf.display().to_string(),
                    "-dnsserver",
                    &dns.to_string(),
                ])
                .env("PEBBLE_VA_NOSLEEP", "1")
                .env("PEBBLE_WFE_NONCEREJECT", "0")
                .env("PEBBLE_AUTHZREUSE", "0")
                .stdin(Stdio::null())
                .stdout(log.try_clone().expect("log"))
                .stderr(log),
            Stop::TERM,
        )
        .expect("spawn pebble");
        let mut p = Pebble {
            dir,
            directory: format!("https://{listen}/dir"),
            management,
            http_port,
            tls_root,
            child: Some(child),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        let reachable = |addr: SocketAddr| match &within {
            Some(n) => (n.reachable)(addr),
            None => TcpStream::connect(addr).is_ok(),
        };
        while !reachable(listen) || !reachable(management) {
            if let Some(status) = p.child.as_mut().and_then(Running::exited) {
                panic!("pebble exited ({status}):\n{}", p.log());
            }
            assert!(
                Instant::now() < deadline,
                "pebble did not listen:\n{}",
                p.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(p)
    }

    /// The pebble process (for its CPU time).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Running::id)
    }

    /// Makes `host` serve `ssl-cert` with `fort-handler acme` against this CA: HTTP-01
    /// through `web`, app allowed app.example.test, revocation on release, reruns every
    /// second. Each host its own config and state, so its own ACME account.
    pub fn serve_ssl_cert(&self, f: &mut crate::Fleet, host: &str, web: &Webroot) {
        let config = f.dir.path().join(format!("acme-{host}.json"));
        std::fs::write(
            &config,
            serde_json::json!({
                "directory": self.directory, "ca_root": self.tls_root,
                "allow": {"app": ["app.example.test"]},
                "http01": {"webroot": web.path()},
                "revoke_on_release": true, "rerun_seconds": 1,
                "state": f.host_dir(host).join("handlers/acme.json"),
            })
            .to_string(),
        )
        .expect("write acme.json");
        f.capability(
            host,
            "ssl-cert",
            serde_json::json!({
                "handler": crate::bin("fort-handler"),
                "args": ["acme", "--config", config],
                "mode": "async",
            }),
        );
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("pebble.log")).unwrap_or_default()
    }

    /// GET on the management interface, trusting only pebble's TLS CA.
    pub fn get(&self, path: &str) -> String {
        let out = Command::new("curl")
            .args(["-sS", "--fail", "--cacert"])
            .arg(&self.tls_root)
            .arg(format!("https://{}{path}", self.management))
            .output()
            .expect("curl");
        assert!(
            out.status.success(),
            "curl {path}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).expect("utf-8")
    }

    /// The root certificate pebble issues under (PEM).
    pub fn root(&self) -> String {
        self.get("/roots/0")
    }

    /// `Valid` or `Revoked`, for a certificate serial in hex.
    pub fn cert_status(&self, serial_hex: &str) -> String {
        let v: serde_json::Value =
            serde_json::from_str(&self.get(&format!("/cert-status-by-serial/{serial_hex}")))
                .expect("status JSON");
        v["Status"].as_str().unwrap_or_default().to_owned()
    }

    /// Stops pebble (a CA that is down).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.stop();
        }
    }
}

impl Drop for Pebble {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let log = self.log();
            let lines: Vec<&str> = log.lines().collect();
            eprintln!(
                "----- pebble log (last 30 lines) -----\n{}",
                lines[lines.len().saturating_sub(30)..].join("\n")
            );
        }
        self.stop();
    }
}

/// nginx serving `root` on 127.0.0.1:`port`, stopped on drop.
pub struct Webroot {
    pub dir: tempfile::TempDir,
    pub root: PathBuf,
    child: Option<Running>,
}

impl Webroot {
    pub fn start(port: u16) -> Result<Webroot, String> {
        let program = find_program("nginx").ok_or("nginx is not installed")?;
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().join("www");
        std::fs::create_dir(&root).expect("mkdir");
        let d = dir.path().display();
        std::fs::write(
            dir.path().join("nginx.conf"),
            format!(
                "daemon off;\nmaster_process off;\npid {d}/nginx.pid;\nerror_log {d}/error.log;\n\
                 events {{ worker_connections 64; }}\n\
                 http {{\n  access_log {d}/access.log;\n  client_body_temp_path {d}/t1;\n  proxy_temp_path {d}/t2;\n  fastcgi_temp_path {d}/t3;\n  uwsgi_temp_path {d}/t4;\n  scgi_temp_path {d}/t5;\n\
                 server {{ listen 127.0.0.1:{port}; root {root}; }}\n}}\n",
                root = root.display()
            ),
        )
        .expect("write");
        let child = Running::spawn(
            Command::new(program)
                .args([
                    "-p",
                    &d.to_string(),
                    "-c",
                    &format!("{d}/nginx.conf"),
                    "-e",
                    &format!("{d}/error.log"),
                ])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
            Stop::QUIT,
        )
        .expect("spawn nginx");
        let w = Webroot {
            dir,
            root,
            child: Some(child),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "nginx did not listen: {}",
                std::fs::read_to_string(w.dir.path().join("error.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(w)
    }

    /// What nginx served (its access log).
    pub fn access_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("access.log")).unwrap_or_default()
    }

    pub fn path(&self) -> &Path {
        &self.root
    }
}

impl Drop for Webroot {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.stop();
        }
    }
}
