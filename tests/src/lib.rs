//! Harness for tests that start real `fort-agent` processes on loopback: each host gets
//! its own 127.0.0.x address and free port, generated SSH key, state directory and config,
//! and is killed on drop (and however the test ends: cleanup).

pub mod borg;
pub mod cleanup;
pub mod dns;
pub mod nginx;
pub mod oidc;
pub mod pebble;
pub mod pki;
pub mod postgres;
pub mod prometheus;
pub mod sshd;
pub mod syslog;
mod wire;
pub mod wireguard;

pub use wire::*;

use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fort_core::client::{ClientOptions, Reply, SignedClient, Target};
use fort_core::sign::Signer;
use serde_json::{json, Value};

pub mod lane;
pub mod releases;

/// The path of a workspace binary (`fort-agent`, `fort`), built by cargo for the tests.
/// Whether the tests run as root (network namespaces, other users' files).
#[allow(unsafe_code)]
pub fn is_root() -> bool {
    // SAFETY: geteuid(2) takes nothing and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

pub fn bin(name: &str) -> PathBuf {
    if let Some(p) = std::env::var_os(format!(
        "FORT_BIN_{}",
        name.replace('-', "_").to_uppercase()
    )) {
        return PathBuf::from(p);
    }
    // target/debug/deps/<test> → target/debug/<name>
    let exe = std::env::current_exe().expect("current exe");
    let mut dir = exe.parent().expect("deps dir").to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is not built; run the tests with `cargo nextest run --workspace` (or `cargo build --bins` first)",
        path.display()
    );
    path
}

/// `program`, run in the network namespace `netns` when there is one (the systemd lane's
/// loopback, through nsenter, which enters it and then runs the program in its place).
pub fn command_in(netns: Option<&Path>, program: impl AsRef<std::ffi::OsStr>) -> Command {
    match netns {
        Some(ns) => {
            let mut c = Command::new("nsenter");
            c.arg(format!("--net={}", ns.display()))
                .arg("--")
                .arg(program);
            c
        }
        None => Command::new(program),
    }
}

/// A free port on `ip`: bind, read, release. Tests run in separate processes, so a
/// different 127.0.0.x per host keeps collisions unlikely.
pub fn free_addr(ip: &str) -> SocketAddr {
    let l = TcpListener::bind(format!("{ip}:0")).expect("bind loopback");
    l.local_addr().expect("local addr")
}

static NEXT_IP: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

fn next_ip() -> String {
    let n =
        NEXT_IP.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + std::process::id() % 200 * 50;
    format!("127.0.{}.{}", 1 + (n / 250) % 250, 1 + n % 250)
}

pub fn write_key(path: &Path, signer: &Signer) {
    std::fs::write(path, signer.private_openssh()).expect("write key");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).expect("chmod key");
}

/// One host of a test fleet.
pub struct HostSpec {
    pub name: String,
    pub addr: SocketAddr,
    pub signer: Signer,
    pub needs: BTreeMap<String, Value>,
    pub capabilities: BTreeMap<String, Value>,
    /// Extra TOML appended to agent.toml.
    pub extra_toml: String,
    /// How the agent process is started (descriptor limit, umask, environment).
    pub spawn: SpawnOptions,
}

/// Process settings for an agent under test.
#[derive(Debug, Clone, Default)]
pub struct SpawnOptions {
    /// `RLIMIT_NOFILE`, soft and hard (the agent raises soft to hard itself).
    pub nofile: Option<u64>,
    /// The umask it starts with.
    pub umask: Option<u32>,
    /// Extra environment variables of the agent process itself.
    pub env: Vec<(String, String)>,
    /// Another `fort-agent` than the tree's (another release's, for the compatibility lane).
    pub binary: Option<PathBuf>,
    /// Extra arguments after `serve --config …` (`--recover`).
    pub args: Vec<String>,
}

impl HostSpec {
    /// Its address in hosts.json: TLS, as every agent serves.
    pub fn address(&self) -> String {
        format!("https://{}", self.addr)
    }

    pub fn keys(&self) -> Vec<ssh_key::PublicKey> {
        vec![self.signer.public_key().clone()]
    }
}

/// A test fleet: a registry, per-host files, and running agents.
pub struct Fleet {
    /// Plain HTTP everywhere (`plaintext = true`, `http://` addresses): only for tests that
    /// show what TLS hides.
    pub plaintext: bool,
    pub dir: tempfile::TempDir,
    pub hosts: BTreeMap<String, HostSpec>,
    pub principals: BTreeMap<String, Signer>,
    pub agents: BTreeMap<String, Agent>,
}

impl Default for Fleet {
    fn default() -> Self {
        Fleet::new()
    }
}

impl Fleet {
    pub fn new() -> Fleet {
        Fleet {
            plaintext: false,
            dir: tempfile::tempdir().expect("tempdir"),
            hosts: BTreeMap::new(),
            principals: BTreeMap::new(),
            agents: BTreeMap::new(),
        }
    }

    pub fn host(&mut self, name: &str) -> &mut HostSpec {
        if !self.hosts.contains_key(name) {
            let spec = HostSpec {
                name: name.to_owned(),
                addr: free_addr(&next_ip()),
                signer: Signer::generate(),
                needs: BTreeMap::new(),
                capabilities: BTreeMap::new(),
                extra_toml: String::new(),
                spawn: SpawnOptions::default(),
            };
            self.hosts.insert(name.to_owned(), spec);
        }
        self.hosts.get_mut(name).expect("inserted")
    }

    pub fn principal(&mut self, name: &str) -> Signer {
        self.principals
            .entry(name.to_owned())
            .or_insert_with(Signer::generate)
            .clone()
    }

    /// Writes a handler script under the fleet dir and returns its path.
    pub fn script(&self, name: &str, body: &str) -> PathBuf {
        let path = self.dir.path().join("scripts").join(name);
        std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).expect("write script");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        path
    }

    /// Declares `consumer`'s need `<type>/<id>` from `provider`, and adds the need id to
    /// the consumer's entry in the provider capability's callers (as the NixOS module
    /// computes it).
    pub fn need(&mut self, consumer: &str, key: &str, provider: &str, spec: Value) {
        let mut spec = spec;
        spec["from"] = json!(provider);
        if spec.get("request").is_none() {
            spec["request"] = json!({});
        }
        if spec.get("nag_seconds").is_none() {
            spec["nag_seconds"] = json!(60);
        }
        self.host(consumer).needs.insert(key.to_owned(), spec);
        let (cap, id) = key.split_once('/').expect("<type>/<id>");
        let caps = &mut self.host(provider).capabilities;
        if let Some(c) = caps.get_mut(cap) {
            let ids = c["callers"]
                .as_object_mut()
                .expect("callers object")
                .entry(consumer)
                .or_insert_with(|| json!([]));
            let ids = ids.as_array_mut().expect("need ids");
            if !ids.contains(&json!(id)) {
                ids.push(json!(id));
            }
        }
    }

    /// Declares `consumer`'s need from several providers in order (docs/protocol.md
    /// §11.13); each lists the consumer among the capability's callers.
    pub fn need_from(&mut self, consumer: &str, key: &str, providers: &[&str], spec: Value) {
        for p in providers {
            self.need(consumer, key, p, spec.clone());
        }
        self.host(consumer).needs.get_mut(key).expect("declared")["from"] = json!(providers);
    }

    pub fn capability(&mut self, host: &str, name: &str, spec: Value) {
        let mut spec = spec;
        if spec.get("callers").is_none() {
            spec["callers"] = json!({});
        }
        self.host(host).capabilities.insert(name.to_owned(), spec);
    }

    pub fn hosts_json(&self) -> Value {
        let hosts: serde_json::Map<String, Value> = self
            .hosts
            .values()
            .map(|h| {
                let address = if self.plaintext {
                    format!("http://{}", h.addr)
                } else {
                    h.address()
                };
                (
                    h.name.clone(),
                    json!({"address": address, "keys": [h.signer.public_openssh()]}),
                )
            })
            .collect();
        let principals: serde_json::Map<String, Value> = self
            .principals
            .iter()
            .map(|(n, s)| (n.clone(), json!({"keys": [s.public_openssh()]})))
            .collect();
        json!({"hosts": hosts, "principals": principals})
    }

    pub fn host_dir(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Writes every host's files (again): call after changing needs, then `reload`.
    pub fn write_files(&self) {
        let hosts = serde_json::to_vec_pretty(&self.hosts_json()).expect("json");
        for h in self.hosts.values() {
            let d = self.host_dir(&h.name);
            std::fs::create_dir_all(d.join("state")).expect("mkdir");
            write_key(&d.join("key"), &h.signer);
            std::fs::write(d.join("hosts.json"), &hosts).expect("write");
            std::fs::write(
                d.join("needs.json"),
                serde_json::to_vec_pretty(&h.needs).expect("json"),
            )
            .expect("write");
            std::fs::write(
                d.join("capabilities.json"),
                serde_json::to_vec_pretty(&h.capabilities).expect("json"),
            )
            .expect("write");
            let toml = format!(
                "host = \"{name}\"\nlisten = \"{addr}\"\nhost_key = \"{d}/key\"\nhosts = \"{d}/hosts.json\"\nneeds = \"{d}/needs.json\"\ncapabilities = \"{d}/capabilities.json\"\nstate_dir = \"{d}/state\"\nadmin_socket = \"{d}/agent.sock\"\nplaintext = {plaintext}\n{extra}\n",
                plaintext = self.plaintext,
                name = h.name,
                addr = h.addr,
                d = d.display(),
                extra = h.extra_toml
            );
            std::fs::write(d.join("agent.toml"), toml).expect("write");
        }
    }

    /// `host`'s address as hosts.json lists it.
    pub fn address_of(&self, host: &str) -> String {
        self.hosts_json()["hosts"][host]["address"]
            .as_str()
            .expect("a host")
            .to_owned()
    }

    /// Rewrites `host`'s own copy of hosts.json (after `write_files`): a host that sees
    /// a peer at another address or with another key.
    pub fn edit_hosts_json(&self, host: &str, edit: impl FnOnce(&mut Value)) {
        let path = self.host_dir(host).join("hosts.json");
        let mut v: Value =
            serde_json::from_slice(&std::fs::read(&path).expect("read hosts.json")).expect("json");
        edit(&mut v);
        std::fs::write(&path, serde_json::to_vec_pretty(&v).expect("json")).expect("write");
    }

    /// Writes files and starts every host's agent, waiting until each listens.
    pub fn start(&mut self) {
        self.write_files();
        let names: Vec<String> = self.hosts.keys().cloned().collect();
        for n in names {
            self.start_host(&n);
        }
    }

    pub fn start_host(&mut self, name: &str) {
        if let Err(log) = self.try_start_host(name) {
            panic!("agent {name} exited:\n{log}");
        }
    }

    /// Starts `name`'s agent, expecting that it may refuse to: `Err` carries its log.
    pub fn try_start_host(&mut self, name: &str) -> Result<(), String> {
        let h = &self.hosts[name];
        let agent = Agent::try_spawn_with(&h.name, h.addr, &self.host_dir(name), &h.spawn)?;
        self.agents.insert(name.to_owned(), agent);
        Ok(())
    }

    /// `kill -9` one agent.
    pub fn kill(&mut self, name: &str) {
        if let Some(mut a) = self.agents.remove(name) {
            a.kill9();
        }
    }

    /// Stops one agent as systemd would (SIGTERM), waiting for it to finish.
    pub fn stop(&mut self, name: &str) {
        if let Some(mut a) = self.agents.remove(name) {
            a.stop();
        }
    }

    pub fn config_path(&self, name: &str) -> PathBuf {
        self.host_dir(name).join("agent.toml")
    }

    /// A client signing as `origin` (a host or principal of this fleet).
    pub fn client(&self, origin: &str) -> SignedClient {
        let signer = self
            .hosts
            .get(origin)
            .map(|h| h.signer.clone())
            .or_else(|| self.principals.get(origin).cloned())
            .expect("origin is in the fleet");
        // A host calls from its own address, as its agent does: peers budget connections
        // per address, and twenty hosts are not one.
        let local_address = self.hosts.get(origin).map(|h| h.addr.ip());
        SignedClient::new(
            origin,
            signer,
            &ClientOptions {
                local_address,
                allow_plaintext: self.plaintext,
                ..ClientOptions::default()
            },
        )
    }

    /// Signed `POST path` from `origin` to `host`.
    pub async fn post(&self, origin: &str, host: &str, path: &str, body: &Value) -> Reply {
        let client = self.client(origin);
        let h = &self.hosts[host];
        let address = self.address_of(host);
        let keys = h.keys();
        let target = Target {
            name: host,
            address: &address,
            keys: &keys,
        };
        client
            .post(&target, path, serde_json::to_vec(body).expect("json"))
            .await
            .expect("request reaches the agent")
    }

    /// Signed `POST path` to `host` from many origins at once: `(origin, body)` pairs, sent
    /// concurrently; returns each status in order (`None`: no reply).
    pub async fn post_concurrently(
        &self,
        host: &str,
        path: &str,
        calls: Vec<(String, Value)>,
    ) -> Vec<Option<u16>> {
        let h = &self.hosts[host];
        let address = self.address_of(host);
        let keys = h.keys();
        let tasks: Vec<_> = calls
            .into_iter()
            .map(|(origin, body)| {
                let (client, address, keys, host, path) = (
                    self.client(&origin),
                    address.clone(),
                    keys.clone(),
                    host.to_owned(),
                    path.to_owned(),
                );
                tokio::spawn(async move {
                    let target = Target {
                        name: &host,
                        address: &address,
                        keys: &keys,
                    };
                    let body = serde_json::to_vec(&body).expect("json");
                    client
                        .post(&target, &path, body)
                        .await
                        .ok()
                        .map(|r| r.status)
                })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.expect("task"));
        }
        out
    }

    /// `fort-agent <args> --config <host's config>`, returning (exit ok, stdout).
    pub fn admin(&self, host: &str, args: &[&str]) -> (bool, String) {
        let out = Command::new(bin("fort-agent"))
            .args(args)
            .arg("--config")
            .arg(self.config_path(host))
            .output()
            .expect("run fort-agent");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    }

    /// `fort --origin ORIGIN --key <its key> --hosts <registry_of's hosts.json> ARGS`:
    /// (exit code, stdout, stderr). `origin` is a principal of this fleet.
    pub fn fort(&self, origin: &str, registry_of: &str, args: &[&str]) -> (i32, String, String) {
        let key = self.dir.path().join(format!("{origin}.key"));
        write_key(&key, &self.principals[origin]);
        let out = Command::new(bin("fort"))
            .args(["--origin", origin, "--key"])
            .arg(&key)
            .arg("--hosts")
            .arg(self.host_dir(registry_of).join("hosts.json"))
            .args(args)
            .output()
            .expect("run fort");
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// A new state key in the fleet's directory under `name`, made as an operator makes
    /// one: `fort-agent state-key new FILE`.
    pub fn new_state_key(&self, name: &str) -> PathBuf {
        let path = self.dir.path().join(name);
        let out = Command::new(bin("fort-agent"))
            .args(["state-key", "new"])
            .arg(&path)
            .output()
            .expect("run fort-agent state-key new");
        assert!(out.status.success(), "{out:?}");
        path
    }

    /// The agent's status document over the admin socket.
    pub fn status(&self, host: &str) -> Value {
        let (_, out) = self.admin(host, &["status", "--json"]);
        let v: Value = serde_json::from_str(&out).unwrap_or(Value::Null);
        v["status"].clone()
    }

    /// One need's row in `host`'s status (`Null` when it is not declared there).
    pub fn need_status(&self, host: &str, need: &str) -> Value {
        let s = self.status(host);
        s["needs"]["items"]
            .as_array()
            .and_then(|a| a.iter().find(|n| n["need"] == need).cloned())
            .unwrap_or(Value::Null)
    }

    /// Whether the host answers `status` and every need it declares is satisfied.
    pub fn all_satisfied(&self, host: &str) -> bool {
        let s = self.status(host);
        s["needs"]["total"].as_u64().is_some() && s["needs"]["total"] == s["needs"]["satisfied"]
    }

    /// Keys of the entries in `host`'s provider-state.json, as on disk.
    pub fn entries(&self, host: &str) -> Vec<String> {
        self.read_state(host, "provider-state.json")["entries"]
            .as_object()
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default()
    }

    /// `host`'s state as on disk (snapshot plus log, whether or not the agent runs), in
    /// the shape of the snapshot: `{"entries": {...}}` or `{"needs": {...}}`. `Null` when
    /// it cannot be read.
    pub fn read_state(&self, host: &str, file: &str) -> Value {
        let field = if file.starts_with("provider") {
            "entries"
        } else {
            "needs"
        };
        let path = self.host_dir(host).join("state").join(file);
        match fort_core::store::Store::<Value>::view(&path, field) {
            Ok(map) => json!({ field: map }),
            Err(_) => Value::Null,
        }
    }
}

/// A need's files in `dir`, one per name holding the payload's member of that name
/// (`/<name>`), mode 0400, owned by whoever runs the test (as numbers): what a service
/// of the test would read.
pub fn pointer_files(dir: &Path, names: &[&str]) -> Value {
    use std::os::unix::fs::MetadataExt;
    let me = std::fs::metadata("/proc/self").expect("/proc/self");
    let (user, group) = (me.uid().to_string(), me.gid().to_string());
    names
        .iter()
        .map(|name| {
            json!({"name": name, "path": dir.join(name), "pointer": format!("/{name}"),
                   "owner": user, "group": group, "mode": "0400"})
        })
        .collect()
}

/// Says that (part of) a test could not run here and why: on stderr, and as a line in
/// `target/fort-skipped.txt` (or `$FORT_SKIPPED`), which `.ci/run` prints after the run,
/// so a skip shows in the summary instead of passing silently.
/// Every regular file below `dir`, for tests that search what a fleet wrote.
pub fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(files_under(&p));
        } else if p.is_file() {
            out.push(p);
        }
    }
    out
}

pub fn skip(test: &str, reason: &str) {
    eprintln!("SKIP: {test}: {reason}");
    let path = std::env::var_os("FORT_SKIPPED")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/fort-skipped.txt")
        });
    if let Ok(mut file) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        let _ = writeln!(file, "{test}: {reason}");
    }
}

/// Records a figure a lane measured (`crash lane: 22 of 22 points …`), which
/// `scripts/test.sh` prints at the end of the run: what a lane covered is part of its
/// result, not only in its captured output.
pub fn figure(line: &str) {
    eprintln!("{line}");
    let path = std::env::var_os("FORT_FIGURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/fort-figures.txt")
        });
    if let Ok(mut file) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        let _ = writeln!(file, "{line}");
    }
}

/// The text a metrics listener serves.
pub fn metrics(addr: SocketAddr) -> String {
    let (_, _, body) = raw_http_plain(
        addr,
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    );
    String::from_utf8_lossy(&body).into_owned()
}

/// Polls `f` until it returns true or `timeout` passes.
pub async fn eventually(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether an agent's admin socket answers a status request.
fn admin_answers(socket: &Path) -> bool {
    let Ok(mut s) = std::os::unix::net::UnixStream::connect(socket) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
    if s.write_all(b"{\"cmd\":\"status\"}\n").is_err() {
        return false;
    }
    let mut reply = String::new();
    let _ = std::io::BufReader::new(s).read_line(&mut reply);
    reply.contains("\"ok\":true")
}

/// A running agent process; killed (SIGKILL) on drop.
pub struct Agent {
    pub name: String,
    pub addr: SocketAddr,
    child: cleanup::Running,
}

impl Agent {
    pub fn spawn(name: &str, addr: SocketAddr, dir: &Path) -> Agent {
        match Agent::try_spawn(name, addr, dir) {
            Ok(a) => a,
            Err(log) => panic!("agent {name} exited:\n{log}"),
        }
    }

    /// Starts an agent; `Err` carries its log when it exits instead of listening.
    pub fn try_spawn(name: &str, addr: SocketAddr, dir: &Path) -> Result<Agent, String> {
        Agent::try_spawn_with(name, addr, dir, &SpawnOptions::default())
    }

    #[allow(unsafe_code)]
    pub fn try_spawn_with(
        name: &str,
        addr: SocketAddr,
        dir: &Path,
        options: &SpawnOptions,
    ) -> Result<Agent, String> {
        use std::os::unix::process::CommandExt;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("agent.log"))
            .expect("log file");
        let mut cmd = Command::new(options.binary.clone().unwrap_or_else(|| bin("fort-agent")));
        cmd.arg("serve")
            .arg("--config")
            .arg(dir.join("agent.toml"))
            .args(&options.args)
            .env(
                "FORT_LOG",
                std::env::var("FORT_LOG").unwrap_or_else(|_| "info".into()),
            )
            .envs(options.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        let (nofile, umask) = (options.nofile, options.umask);
        if nofile.is_some() || umask.is_some() {
            // SAFETY: between fork and exec only async-signal-safe calls (setrlimit,
            // umask) on values copied in; nothing is allocated.
            unsafe {
                cmd.pre_exec(move || {
                    if let Some(n) = nofile {
                        let lim = libc::rlimit {
                            rlim_cur: n,
                            rlim_max: n,
                        };
                        if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                            return Err(std::io::Error::last_os_error());
                        }
                    }
                    if let Some(m) = umask {
                        libc::umask(m as libc::mode_t);
                    }
                    Ok(())
                });
            }
        }
        let child = cleanup::Running::spawn(&mut cmd, fort_core::process::Stop::KILL)
            .expect("spawn fort-agent");
        let mut agent = Agent {
            name: name.to_owned(),
            addr,
            child,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        // The port is bound before the agent has loaded its state; it is ready when its
        // admin socket answers (the same moment it tells systemd READY=1).
        while TcpStream::connect_timeout(&addr, Duration::from_millis(100)).is_err()
            || !admin_answers(&dir.join("agent.sock"))
        {
            if let Some(status) = agent.child.exited() {
                let log = std::fs::read_to_string(dir.join("agent.log")).unwrap_or_default();
                return Err(format!("exit status {status}\n{log}"));
            }
            assert!(
                Instant::now() < deadline,
                "agent {name} did not listen on {addr}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(agent)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `Some(status)` once the agent has exited (a crash point killed it, say).
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.exited()
    }

    pub fn kill9(&mut self) {
        self.child.kill();
    }

    /// SIGTERM, then waits (up to 20 s) for the agent to finish its shutdown; SIGKILL
    /// after that.
    #[allow(unsafe_code)]
    pub fn stop(&mut self) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if self.child.exited().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill9();
    }

    /// SIGHUP: reload the JSON files.
    #[allow(unsafe_code)]
    pub fn hup(&self) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGHUP);
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.kill9();
    }
}

impl Drop for Fleet {
    /// On a failing test, the agents' own words are the best evidence: print their logs.
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        for name in self.hosts.keys() {
            let log =
                std::fs::read_to_string(self.host_dir(name).join("agent.log")).unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            let tail = &lines[lines.len().saturating_sub(40)..];
            eprintln!(
                "----- {name}: last {} log lines -----\n{}",
                tail.len(),
                tail.join("\n")
            );
        }
    }
}

/// Whether `needle` occurs anywhere in `haystack`.
pub fn contains_bytes(haystack: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && haystack.windows(needle.len()).any(|w| w == needle)
}

/// Every file below `dir` that holds `needle`: a secret a copy of the disk would give away.
pub fn files_holding(dir: &Path, needle: &[u8]) -> Vec<PathBuf> {
    files_under(dir)
        .into_iter()
        .filter(|p| std::fs::read(p).is_ok_and(|b| contains_bytes(&b, needle)))
        .collect()
}

/// A new state key (docs/at-rest.md) in the file `path`, mode 0600.
pub fn state_key_file(path: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, fort_core::sealed::StateKey::generate_hex().as_bytes())
        .expect("write the state key");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    path.to_owned()
}

/// `path`'s contents with one character of its sealed `member` changed: what a sealed
/// file looks like after a bit flipped on disk.
pub fn change_sealed_member(path: &Path, member: &str) {
    let text = std::fs::read_to_string(path).expect("a sealed file");
    let marker = format!("\"{member}\":\"");
    let at = text.find(&marker).expect("the member") + marker.len();
    let flipped = if &text[at..at + 1] == "A" { "B" } else { "A" };
    std::fs::write(path, format!("{}{flipped}{}", &text[..at], &text[at + 1..])).expect("write");
}

/// One `fort-handler <capability> --config CONFIG` run as the agent makes it: a cleared
/// environment with `PATH`, `FORT_CAPABILITY`, `FORT_TRIGGER` and `env`, the input on
/// stdin. (exit ok, stdout as JSON or null, stderr).
pub fn run_handler(
    capability: &str,
    config: &Path,
    trigger: &str,
    env: &[(&str, &str)],
    input: &Value,
) -> (bool, Value, String) {
    let mut child = Command::new(bin("fort-handler"))
        .args([capability, "--config"])
        .arg(config)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("FORT_CAPABILITY", capability)
        .env("FORT_TRIGGER", trigger)
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start fort-handler");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(input.to_string().as_bytes())
        .expect("write the input");
    let out = child.wait_with_output().expect("fort-handler");
    (
        out.status.success(),
        serde_json::from_slice(&out.stdout).unwrap_or(Value::Null),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// TLS for a server a test starts on loopback: a CA made here (`ca_name`, written to
/// `dir/ca_file`) and a certificate it signs for `localhost` and `127.0.0.1`, written to
/// `dir/cert.pem` with its key in `dir/key.pem`. Returns the CA file, for the client.
pub fn loopback_tls(dir: &Path, ca_name: &str, ca_file: &str) -> PathBuf {
    let ca_key = rcgen::KeyPair::generate().expect("key");
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, ca_name);
    let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key).expect("CA");
    let key = rcgen::KeyPair::generate().expect("key");
    let mut params = rcgen::CertificateParams::new(vec!["localhost".to_owned()]).expect("params");
    params
        .subject_alt_names
        .push(rcgen::SanType::IpAddress("127.0.0.1".parse().expect("ip")));
    let cert = params.signed_by(&key, &ca).expect("leaf");
    let ca_path = dir.join(ca_file);
    std::fs::write(&ca_path, ca.pem()).expect("write");
    std::fs::write(dir.join("cert.pem"), cert.pem()).expect("write");
    std::fs::write(dir.join("key.pem"), key.serialize_pem()).expect("write");
    ca_path
}
