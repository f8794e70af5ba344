//! The demo fleet on disk and as processes: keys, `hosts.json`, per-host `needs.json`,
//! `capabilities.json` (with `callers` computed from the needs, as the NixOS module does)
//! and `agent.toml`, the example handlers written out, and one `fort-agent serve` child per
//! host, each in a process group of its own, stopped when the fleet is dropped, so an
//! error, a panic or Ctrl-C never leaves agents (or a handler they run) behind.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{SocketAddr, TcpListener};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use fort_core::process::{Server, Stop};
use fort_core::sign::Signer;
use serde_json::{json, Map, Value};

use crate::admin::{self, AdminRequest};

/// One need a demo host declares.
pub struct NeedDecl {
    pub consumer: &'static str,
    pub key: &'static str,
    pub from: &'static str,
    pub request: Value,
    /// An example handler's file name, run with the payload.
    pub handler: Option<&'static str>,
    /// Files written from the payload, as `(name, JSON pointer, mode)`: each lands at
    /// `<consumer>/run/needs/<type>/<id>/<name>`, owned by whoever runs the demo.
    pub files: Vec<(&'static str, &'static str, &'static str)>,
    /// More needs.json fields as they are written (`restart_units`, `reload_units`,
    /// `renew_before_seconds`): a JSON object.
    pub more: Value,
    /// The walkthrough step that declares it; `None`: declared from the start.
    pub added_in: Option<usize>,
    /// The step that releases it, if one does.
    pub released_in: Option<usize>,
}

/// One capability a demo host serves.
pub struct CapDecl {
    pub host: &'static str,
    pub name: &'static str,
    pub handler: &'static str,
    /// A program and its arguments to serve the capability with, instead of the example
    /// handler `handler` (fort-handler, for the ACME step).
    pub command: Option<(PathBuf, Vec<String>)>,
    pub cache_response: bool,
    pub description: &'static str,
}

pub struct Host {
    pub name: &'static str,
    pub addr: SocketAddr,
    pub dir: PathBuf,
    signer: Signer,
    agent: Option<Server>,
}

pub struct Fleet {
    pub root: PathBuf,
    pub hosts: Vec<Host>,
    pub needs: Vec<NeedDecl>,
    pub caps: Vec<CapDecl>,
    exe: PathBuf,
}

/// The demo runs without systemd: unit restarts and reloads go to a script that writes
/// down what it was asked, one line per call, in this file under the fleet's root.
pub const SYSTEMCTL_LOG: &str = "systemctl.log";

/// Nag interval of every demo need: short, so a lost request is retried within seconds.
const NAG_SECONDS: u64 = 5;

/// Tunables that make a loopback fleet converge in well under a second and retry fast.
const AGENT_TOML_EXTRA: &str = r#"handler_timeout = "30s"
# The demo's certificates live seconds: each may be renewed within a second of the last.
renew_interval = "1s"

[access]
journal = ["ops"]
systemd = ["ops"]
trigger = ["ops"]

[callbacks]
backoff = "500ms"
timeout = "5s"

[fulfill]
backoff = "500ms"
timeout = "5s"
"#;

/// A free loopback port: bind to port 0, read it, release it for the agent.
fn free_addr() -> anyhow::Result<SocketAddr> {
    let l = TcpListener::bind("127.0.0.1:0").context("cannot bind a loopback port")?;
    Ok(l.local_addr()?)
}

fn write_private(path: &Path, text: &str) -> anyhow::Result<()> {
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(())
}

fn write_json(path: &Path, v: &Value) -> anyhow::Result<()> {
    let bytes = serde_json::to_vec_pretty(v).expect("JSON serialises");
    std::fs::write(path, bytes).with_context(|| format!("cannot write {}", path.display()))
}

impl Fleet {
    /// Generates keys and ports and writes every file under `root` (which must exist).
    pub fn create(
        root: &Path,
        names: &[&'static str],
        caps: Vec<CapDecl>,
        needs: Vec<NeedDecl>,
    ) -> anyhow::Result<Fleet> {
        let exe = std::env::current_exe().context("cannot locate the fort-agent binary")?;
        let scripts = root.join("handlers");
        std::fs::create_dir_all(&scripts)?;
        let recorder = format!(
            "#!/bin/sh\n# The demo's systemctl: writes down what it is asked, starts nothing.\necho \"$*\" >> '{}'\n",
            root.join(SYSTEMCTL_LOG).display().to_string().replace('\'', r"'\''")
        );
        let demo_scripts = [("systemctl-recorder", recorder.as_str())];
        for (name, text) in super::examples::EXAMPLES.iter().chain(&demo_scripts) {
            let path = scripts.join(name);
            std::fs::write(&path, text)?;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
        }
        let mut hosts = Vec::new();
        for name in names {
            let dir = root.join(name);
            std::fs::create_dir_all(dir.join("state"))?;
            let signer = Signer::generate();
            write_private(&dir.join("key"), &signer.private_openssh())?;
            hosts.push(Host {
                name,
                addr: free_addr()?,
                dir,
                signer,
                agent: None,
            });
        }
        // The operator: its key is written so the printed `fort` commands work as is.
        let ops = Signer::generate();
        write_private(&root.join("ops.key"), &ops.private_openssh())?;
        std::fs::write(root.join("ops.key.pub"), ops.public_openssh() + "\n")?;
        let registry = json!({
            "hosts": hosts.iter().map(|h| (h.name.to_owned(), json!({
                "address": format!("https://{}", h.addr),
                "keys": [h.signer.public_openssh()],
            }))).collect::<Map<_, _>>(),
            "principals": {"ops": {"keys": [ops.public_openssh()]}},
        });
        write_json(&root.join("hosts.json"), &registry)?;
        let fleet = Fleet {
            root: root.to_owned(),
            hosts,
            needs,
            caps,
            exe,
        };
        for h in &fleet.hosts {
            fleet.write_capabilities(h)?;
            fleet.declare_at(h.name, 0)?;
            let d = h.dir.display();
            let toml = format!(
                "host = \"{name}\"\nlisten = \"{addr}\"\nhost_key = \"{d}/key\"\nhosts = \"{root}/hosts.json\"\nneeds = \"{d}/needs.json\"\ncapabilities = \"{d}/capabilities.json\"\nstate_dir = \"{d}/state\"\nadmin_socket = \"{d}/agent.sock\"\n# Handlers get a clean environment: what they need is passed explicitly.\nhandler_environment = {{ FORT_EXAMPLE_STATE = \"{d}/examples\" }}\nsystemctl = \"{recorder}\"\n{AGENT_TOML_EXTRA}",
                recorder = fleet.script("systemctl-recorder").display(),
                name = h.name,
                addr = h.addr,
                root = root.display(),
            );
            std::fs::write(h.dir.join("agent.toml"), toml)?;
            crate::check::check(&fleet.config(h.name), crate::check::CheckOptions::default())
                .with_context(|| format!("the generated configuration of {} is wrong", h.name))?;
        }
        Ok(fleet)
    }

    /// `capabilities.json`: `callers` maps every host declaring a need of that type from
    /// here to the need ids it declares, as the NixOS module computes it.
    fn write_capabilities(&self, h: &Host) -> anyhow::Result<()> {
        let mut out = Map::new();
        for c in self.caps.iter().filter(|c| c.host == h.name) {
            let mut callers: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
            for n in &self.needs {
                if let Some((kind, id)) = n.key.split_once('/') {
                    if n.from == h.name && kind == c.name {
                        callers.entry(n.consumer).or_default().insert(id);
                    }
                }
            }
            // `initialize`: after a restart the handler runs over the stored entries and
            // calls every consumer back, so nothing waits for a nag.
            out.insert(
                c.name.to_owned(),
                json!({
                    "handler": c.command.as_ref().map_or_else(|| self.script(c.handler), |(p, _)| p.clone()),
                    "args": c.command.as_ref().map(|(_, a)| a.clone()).unwrap_or_default(),
                    "mode": "async",
                    "cacheResponse": c.cache_response,
                    "callers": callers,
                    "triggers": {"initialize": true},
                    "description": c.description,
                }),
            );
        }
        write_json(&h.dir.join("capabilities.json"), &Value::Object(out))
    }

    /// Writes `host`'s `needs.json` as walkthrough step `step` has it: the needs declared
    /// from the start or by a step up to it, less those a step up to it released.
    pub fn declare_at(&self, host: &str, step: usize) -> anyhow::Result<()> {
        self.write_needs(host, |n| {
            n.added_in.is_none_or(|s| s <= step) && n.released_in.is_none_or(|s| s > step)
        })
    }

    /// Writes `host`'s `needs.json` with the declared needs `keep` accepts.
    fn write_needs(&self, host: &str, keep: impl Fn(&NeedDecl) -> bool) -> anyhow::Result<()> {
        use std::os::unix::fs::MetadataExt;
        // The files go to whoever runs the demo: as root or not, the agent can chown to it.
        let me = std::fs::metadata(&self.root)?;
        let mut out = Map::new();
        for n in self.needs.iter().filter(|n| n.consumer == host && keep(n)) {
            let files: Vec<Value> = n
                .files
                .iter()
                .map(|(name, pointer, mode)| {
                    json!({
                        "name": name,
                        "path": self.delivered(n.key, name),
                        "pointer": pointer,
                        "mode": mode,
                        "owner": me.uid().to_string(),
                        "group": me.gid().to_string(),
                    })
                })
                .collect();
            let mut spec = json!({
                "from": n.from,
                "request": n.request,
                "nag_seconds": NAG_SECONDS,
                "handler": n.handler.map(|s| self.script(s)),
                "files": files,
            });
            if let (Some(spec), Some(more)) = (spec.as_object_mut(), n.more.as_object()) {
                spec.extend(more.clone());
            }
            out.insert(n.key.to_owned(), spec);
        }
        write_json(&self.host(host).dir.join("needs.json"), &Value::Object(out))
    }

    /// Where file `name` of app's need `key` is delivered.
    pub fn delivered(&self, key: &str, name: &str) -> PathBuf {
        self.host("app").dir.join("run/needs").join(key).join(name)
    }

    /// What the `systemctl` recorder wrote: one line per call.
    pub fn systemctl_calls(&self) -> Vec<String> {
        std::fs::read_to_string(self.root.join(SYSTEMCTL_LOG))
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    pub fn script(&self, name: &str) -> PathBuf {
        self.root.join("handlers").join(name)
    }

    pub fn host(&self, name: &str) -> &Host {
        self.hosts
            .iter()
            .find(|h| h.name == name)
            .expect("a demo host")
    }

    fn host_mut(&mut self, name: &str) -> &mut Host {
        self.hosts
            .iter_mut()
            .find(|h| h.name == name)
            .expect("a demo host")
    }

    pub fn config(&self, name: &str) -> PathBuf {
        self.host(name).dir.join("agent.toml")
    }

    /// What the example handlers of `name` see as `FORT_EXAMPLE_STATE`.
    pub fn examples_dir(&self, name: &str) -> PathBuf {
        self.host(name).dir.join("examples")
    }

    /// Starts `name`'s agent and returns once its admin socket answers.
    pub async fn start(&mut self, name: &str) -> anyhow::Result<u32> {
        let exe = self.exe.clone();
        let h = self.host_mut(name);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(h.dir.join("agent.log"))?;
        // SIGTERM first: the agent stops its handler runs (each in a group of its own)
        // before it exits, which SIGKILL would leave running; it waits up to 10 s for its
        // tasks to end.
        let stop = Stop {
            grace: Duration::from_secs(15),
            ..Stop::TERM
        };
        let agent = Server::spawn(
            Command::new(&exe)
                .arg("serve")
                .arg("--config")
                .arg(h.dir.join("agent.toml"))
                .env("FORT_LOG", "info")
                // The log is a file, not a terminal: no colour escapes in it.
                .env("NO_COLOR", "1")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log),
            stop,
        )
        .with_context(|| format!("cannot start {}", exe.display()))?;
        let pid = agent.id();
        h.agent = Some(agent);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if self
                .admin(name, &AdminRequest::Status { entries: false })
                .await
                .is_ok()
            {
                return Ok(pid);
            }
            let h = self.host_mut(name);
            if let Some(status) = h.agent.as_mut().and_then(Server::exited) {
                h.agent = None;
                bail!(
                    "agent {name} exited at start with {status}; see {}/agent.log",
                    h.dir.display()
                );
            }
            if Instant::now() > deadline {
                bail!("agent {name} did not come up within 20 s");
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// `kill -9`: no shutdown, no flush; only what the agent made durable survives.
    pub fn kill(&mut self, name: &str) {
        if let Some(mut agent) = self.host_mut(name).agent.take() {
            agent.kill();
        }
    }

    pub async fn admin(&self, name: &str, req: &AdminRequest) -> anyhow::Result<Value> {
        let socket = self.host(name).dir.join("agent.sock");
        let reply = admin::call(&socket, req).await.map_err(|e| anyhow!(e))?;
        if reply["ok"].as_bool() != Some(true) {
            bail!("{name}: {}", reply["error"]);
        }
        Ok(reply)
    }

    pub async fn status(&self, name: &str) -> anyhow::Result<Value> {
        Ok(self
            .admin(name, &AdminRequest::Status { entries: false })
            .await?["status"]
            .take())
    }

    /// The last lines of every agent's log, for a failure report.
    pub fn log_tails(&self, lines: usize) -> String {
        let mut out = String::new();
        for h in &self.hosts {
            let text = std::fs::read_to_string(h.dir.join("agent.log")).unwrap_or_default();
            let all: Vec<&str> = text.lines().collect();
            out.push_str(&format!("--- {}/agent.log (last {lines} lines)\n", h.name));
            for l in &all[all.len().saturating_sub(lines)..] {
                out.push_str(l);
                out.push('\n');
            }
        }
        out
    }
}

impl Drop for Fleet {
    /// Every agent is stopped at once (each may take a moment to stop its handlers), and
    /// then reaped.
    fn drop(&mut self) {
        std::thread::scope(|s| {
            for handle in self.hosts.iter().filter_map(|h| h.agent.as_ref()) {
                let handle = handle.handle();
                s.spawn(move || handle.stop());
            }
        });
        for h in &mut self.hosts {
            h.agent = None;
        }
    }
}

/// A provider's entries as written on disk (snapshot and log; whether or not it runs).
pub fn stored_entries(fleet: &Fleet, host: &str) -> BTreeMap<String, Value> {
    let path = fleet
        .host(host)
        .dir
        .join("state")
        .join(crate::provider::state::FILE);
    fort_core::store::Store::<Value>::view(&path, crate::provider::state::FIELD).unwrap_or_default()
}
