//! Authoritative DNS servers for tests: Knot (`knotd`) or BIND (`named`) on a loopback
//! address and a free port, serving one zone from a scratch directory and accepting RFC
//! 2136 updates signed with one TSIG key; stopped on drop, and however the test ends
//! (crate::cleanup). `dig` and `nsupdate` look and act at them as a person would.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;
use fort_core::process::Stop;

use crate::cleanup::Running;

/// Which server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    Knot,
    Bind,
}

impl Flavor {
    pub fn name(self) -> &'static str {
        match self {
            Flavor::Knot => "knot",
            Flavor::Bind => "bind",
        }
    }

    fn binary(self) -> &'static str {
        match self {
            Flavor::Knot => "knotd",
            Flavor::Bind => "named",
        }
    }
}

/// Where a program is, on PATH or in the sbin directories Debian puts servers in.
pub fn find_program(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/local/sbin"].map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// A running server with one zone.
pub struct DnsServer {
    pub flavor: Flavor,
    pub addr: SocketAddr,
    pub zone: String,
    pub key_name: String,
    /// The key's base64 secret.
    pub secret: String,
    pub dir: tempfile::TempDir,
    /// The network namespace it serves in (the systemd lane's loopback); `None`: the
    /// test's own.
    netns: Option<PathBuf>,
    child: Option<Running>,
}

impl DnsServer {
    /// Starts `flavor` serving `zone` with an SOA, an NS and `records` (zone-file lines,
    /// names relative to the zone). `Err` says why it cannot run here (a program missing),
    /// for `skip`; a server that is installed but fails to start panics with its log.
    pub fn start(flavor: Flavor, zone: &str, records: &str) -> Result<DnsServer, String> {
        DnsServer::start_at(flavor, zone, records, None)
    }

    /// The same in the network namespace `netns`, listening on `addr` there; `dig` and
    /// `nsupdate` run there too.
    pub fn start_in_namespace(
        flavor: Flavor,
        zone: &str,
        records: &str,
        netns: &Path,
        addr: SocketAddr,
    ) -> Result<DnsServer, String> {
        DnsServer::start_at(flavor, zone, records, Some((netns.to_path_buf(), addr)))
    }

    fn start_at(
        flavor: Flavor,
        zone: &str,
        records: &str,
        within: Option<(PathBuf, SocketAddr)>,
    ) -> Result<DnsServer, String> {
        let program = find_program(flavor.binary())
            .ok_or_else(|| format!("{} is not installed", flavor.binary()))?;
        for tool in ["dig", "nsupdate"] {
            find_program(tool)
                .ok_or_else(|| format!("{tool} (bind9-dnsutils) is not installed"))?;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        // named listens only on addresses an interface has (127.0.0.1 of lo's 127/8);
        // knotd binds any loopback address, so each test gets its own.
        let addr = match (&within, flavor) {
            (Some((_, addr)), _) => *addr,
            (None, Flavor::Knot) => crate::free_addr(&crate::next_ip()),
            (None, Flavor::Bind) => crate::free_addr("127.0.0.1"),
        };
        let netns = within.map(|(ns, _)| ns);
        // knotd keeps its journal there and fails every update when it is missing.
        std::fs::create_dir(dir.path().join("db")).expect("mkdir db");
        let mut secret = [0u8; 32];
        getrandom(&mut secret);
        let secret = base64::engine::general_purpose::STANDARD.encode(secret);
        let key_name = "fort-test".to_owned();
        let zone_file = dir.path().join(format!("{zone}.zone"));
        std::fs::write(
            &zone_file,
            format!(
                "$ORIGIN {zone}.\n$TTL 300\n@ IN SOA ns.{zone}. hostmaster.{zone}. 1 3600 600 86400 60\n@ IN NS ns.{zone}.\nns IN A 127.0.0.1\n{records}\n"
            ),
        )
        .expect("write zone");
        let d = dir.path().display();
        let args: Vec<String> = match flavor {
            Flavor::Knot => {
                let conf = dir.path().join("knot.conf");
                std::fs::write(
                    &conf,
                    format!(
                        "server:\n  rundir: \"{d}\"\n  listen: {ip}@{port}\n  udp-workers: 1\n  tcp-workers: 1\n  background-workers: 1\n\
                         log:\n  - target: stderr\n    any: info\n\
                         control:\n  listen: \"{d}/knot.sock\"\n\
                         database:\n  storage: \"{d}/db\"\n\
                         key:\n  - id: {key_name}\n    algorithm: hmac-sha256\n    secret: {secret}\n\
                         acl:\n  - id: fort-update\n    key: {key_name}\n    action: [update, transfer]\n\
                         zone:\n  - domain: {zone}\n    storage: \"{d}\"\n    file: \"{zone}.zone\"\n    acl: fort-update\n",
                        ip = addr.ip(),
                        port = addr.port(),
                    ),
                )
                .expect("write knot.conf");
                vec!["-c".into(), conf.display().to_string()]
            }
            Flavor::Bind => {
                let conf = dir.path().join("named.conf");
                std::fs::write(
                    &conf,
                    format!(
                        "key \"{key_name}\" {{ algorithm hmac-sha256; secret \"{secret}\"; }};\n\
                         controls {{ }};\n\
                         options {{\n  directory \"{d}\";\n  pid-file \"{d}/named.pid\";\n  session-keyfile \"{d}/session.key\";\n  managed-keys-directory \"{d}\";\n  listen-on port {port} {{ {ip}; }};\n  listen-on-v6 {{ none; }};\n  recursion no;\n  notify no;\n  dnssec-validation no;\n}};\n\
                         zone \"{zone}\" {{\n  type primary;\n  file \"{d}/{zone}.zone\";\n  update-policy {{ grant {key_name} zonesub ANY; }};\n  allow-transfer {{ key {key_name}; }};\n}};\n",
                        ip = addr.ip(),
                        port = addr.port(),
                    ),
                )
                .expect("write named.conf");
                vec![
                    "-g".into(),
                    "-n".into(),
                    "1".into(),
                    "-c".into(),
                    conf.display().to_string(),
                ]
            }
        };
        let log = std::fs::File::create(dir.path().join("server.log")).expect("log");
        let child = Running::spawn(
            crate::command_in(netns.as_deref(), &program)
                .args(&args)
                .stdin(Stdio::null())
                .stdout(log.try_clone().expect("log"))
                .stderr(log),
            Stop::TERM,
        )
        .expect("spawn the DNS server");
        let mut server = DnsServer {
            flavor,
            addr,
            zone: zone.to_owned(),
            key_name,
            secret,
            dir,
            netns,
            child: Some(child),
        };
        server.wait_ready();
        Ok(server)
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if !self.dig(&self.zone.clone(), "SOA").is_empty() {
                return;
            }
            if let Some(status) = self.child.as_mut().and_then(Running::exited) {
                panic!(
                    "{} exited ({status}):\n{}",
                    self.flavor.binary(),
                    self.log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "{} did not answer on {}:\n{}",
                self.flavor.binary(),
                self.addr,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The server's own log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
    }

    /// Writes the TSIG secret to `path` (0600), as an operator would for the handler.
    pub fn write_key(&self, path: &Path) {
        std::fs::write(path, format!("{}\n", self.secret)).expect("write key");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    }

    fn dig_with(&self, style: &[&str], name: &str, rtype: &str) -> String {
        let out = self
            .command("dig")
            .arg(format!("@{}", self.addr.ip()))
            .args(["-p", &self.addr.port().to_string()])
            .args(["+norecurse", "+time=1", "+tries=1"])
            .args(style)
            .args([name, rtype])
            .output()
            .expect("run dig");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `dig +short` at this server: the answers, sorted (TXT values in dig's quoting).
    pub fn dig(&self, name: &str, rtype: &str) -> Vec<String> {
        let mut lines: Vec<String> = self
            .dig_with(&["+short"], name, rtype)
            .lines()
            .filter(|l| !l.is_empty() && !l.starts_with(';'))
            .map(str::to_owned)
            .collect();
        lines.sort();
        lines
    }

    /// The answer records of `rtype` at `name` as (TTL, value), sorted.
    pub fn answers(&self, name: &str, rtype: &str) -> Vec<(u32, String)> {
        let mut out: Vec<(u32, String)> = self
            .dig_with(&["+noall", "+answer"], name, rtype)
            .lines()
            .filter_map(|l| {
                let mut f = l.split_whitespace();
                let (_, ttl, _, t) = (f.next()?, f.next()?, f.next()?, f.next()?);
                (t == rtype).then(|| (ttl.parse().ok(), f.collect::<Vec<_>>().join(" ")))
            })
            .filter_map(|(ttl, v)| Some((ttl?, v)))
            .collect();
        out.sort();
        out
    }

    /// Every record of the zone (a transfer signed with the key), as `dig` prints them.
    pub fn zone_records(&self) -> Vec<String> {
        let out = self
            .command("dig")
            .arg(format!("@{}", self.addr.ip()))
            .args(["-p", &self.addr.port().to_string()])
            .args([
                "-y",
                &format!("hmac-sha256:{}:{}", self.key_name, self.secret),
            ])
            .args(["+noall", "+answer", "+time=5", "AXFR", &self.zone])
            .output()
            .expect("run dig");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| !l.is_empty() && !l.starts_with(';'))
            .map(str::to_owned)
            .collect()
    }

    /// Runs `nsupdate` with `commands` (e.g. `update add x.zone. 300 A 192.0.2.9`), signed
    /// with the server's key: what an administrator does by hand. Panics when it fails.
    pub fn nsupdate(&self, commands: &str) {
        let script = format!(
            "server {} {}\nzone {}\n{commands}\nsend\n",
            self.addr.ip(),
            self.addr.port(),
            self.zone
        );
        let mut child = self
            .command("nsupdate")
            .args([
                "-y",
                &format!("hmac-sha256:{}:{}", self.key_name, self.secret),
            ])
            .arg("-v")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run nsupdate");
        use std::io::Write;
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(script.as_bytes())
            .expect("write nsupdate script");
        let out = child.wait_with_output().expect("nsupdate");
        assert!(
            out.status.success(),
            "nsupdate failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// `program` (dig, nsupdate) where the server serves.
    fn command(&self, program: &str) -> Command {
        let path = find_program(program).unwrap_or_else(|| panic!("{program} is not installed"));
        crate::command_in(self.netns.as_deref(), &path)
    }

    /// Stops the server (a primary that is down).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.stop();
        }
    }
}

impl Drop for DnsServer {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let log = self.log();
            let lines: Vec<&str> = log.lines().collect();
            eprintln!(
                "----- {} log (last 30 lines) -----\n{}",
                self.flavor.binary(),
                lines[lines.len().saturating_sub(30)..].join("\n")
            );
        }
        self.stop();
    }
}

fn getrandom(buf: &mut [u8]) {
    use std::io::Read;
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(buf))
        .expect("read /dev/urandom");
}
