//! WireGuard members in network namespaces of their own, for tests whose traffic must
//! cross real tunnels: an underlay (a bridge in a namespace of its own, so the host's
//! network is never touched), and per member a namespace joined to the bridge by a veth
//! pair and a `wireguard-go` interface (userspace, `/dev/net/tun`). Everything is removed
//! when dropped, and when a signal ends the test.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::cleanup::{self, OnSignal, Running};

/// Whether this machine can run such a test: root, `/dev/net/tun`, `wireguard-go`, `wg`,
/// `ip` and `ping`. Otherwise the test is skipped, saying why.
pub fn can_run(test: &str) -> bool {
    let missing = |tool: &str| {
        Command::new(tool)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_err()
    };
    let why = if !crate::is_root() {
        Some("needs root (network namespaces)".to_owned())
    } else if !Path::new("/dev/net/tun").exists() {
        Some("no /dev/net/tun".to_owned())
    } else {
        ["wireguard-go", "wg", "ip"]
            .into_iter()
            .find(|t| missing(t))
            .map(|tool| {
                format!(
                    "{tool} is not installed (apt-get install wireguard-go wireguard-tools iproute2)"
                )
            })
    };
    match why {
        Some(why) => {
            crate::skip(test, &why);
            false
        }
        None => true,
    }
}

/// Runs `ip ARGS`, panicking with its stderr when it fails.
pub fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The namespaces a test made, deleted on drop and on a signal.
#[derive(Clone, Default)]
struct Namespaces(Arc<Mutex<Vec<String>>>);

impl Namespaces {
    fn add(&self, name: &str) {
        ip(&["netns", "add", name]);
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(name.to_owned());
    }

    /// Deletes every namespace (and with them their interfaces and veth pairs).
    fn remove_all(&self) {
        let names: Vec<String> =
            std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()));
        for name in names.iter().rev() {
            let _ = Command::new("ip")
                .args(["netns", "del", name])
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// The underlay: a bridge every member's namespace is joined to, on `198.18.0.0/24`
/// (RFC 2544's benchmarking range, inside the test's own namespaces only).
pub struct Underlay {
    tag: String,
    bridge: String,
    namespaces: Namespaces,
    members: Vec<Member>,
    // Dropped after the members (fields drop in order): namespaces go last.
    _cleanup: OnSignal,
}

/// One member's namespace and interface.
pub struct Member {
    pub index: u8,
    /// Its namespace, for `ip netns exec`.
    pub netns: String,
    /// Its WireGuard interface (unique on the machine: `wireguard-go`'s control socket
    /// is `/var/run/wireguard/<name>.sock`).
    pub interface: String,
    /// Its address on the underlay, where it listens.
    pub underlay: String,
    /// `wireguard-go`'s own log (verbose: handshakes sent, received and refused).
    pub log: PathBuf,
    wireguard_go: Option<Running>,
}

impl Underlay {
    pub fn new() -> Underlay {
        let tag = format!("{}", std::process::id() % 100_000);
        let namespaces = Namespaces::default();
        let on_signal = {
            let n = namespaces.clone();
            cleanup::on_signal(move || n.remove_all())
        };
        let bridge = format!("fort-wg-{tag}-br");
        namespaces.add(&bridge);
        ip(&["-n", &bridge, "link", "add", "br0", "type", "bridge"]);
        ip(&["-n", &bridge, "link", "set", "br0", "up"]);
        Underlay {
            tag,
            bridge,
            namespaces,
            members: Vec::new(),
            _cleanup: on_signal,
        }
    }

    /// A new member `index` (1 to 250): its namespace, veth to the bridge, and a running
    /// `wireguard-go` interface with no key and no peers.
    pub fn member(&mut self, index: u8, log_dir: &Path) -> &Member {
        let netns = format!("fort-wg-{}-{index}", self.tag);
        self.namespaces.add(&netns);
        let port = format!("p{index}");
        ip(&[
            "link",
            "add",
            "eth0",
            "netns",
            &netns,
            "type",
            "veth",
            "peer",
            "name",
            &port,
            "netns",
            &self.bridge,
        ]);
        ip(&["-n", &self.bridge, "link", "set", &port, "master", "br0"]);
        ip(&["-n", &self.bridge, "link", "set", &port, "up"]);
        let underlay = format!("198.18.0.{index}");
        ip(&[
            "-n",
            &netns,
            "address",
            "add",
            &format!("{underlay}/24"),
            "dev",
            "eth0",
        ]);
        ip(&["-n", &netns, "link", "set", "eth0", "up"]);
        ip(&["-n", &netns, "link", "set", "lo", "up"]);
        let interface = format!("fwg{}{index}", self.tag);
        let log_path = log_dir.join(format!("wireguard-go-{index}.log"));
        let log = std::fs::File::create(&log_path).expect("log file");
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &netns, "wireguard-go", "-f", &interface])
            .env("LOG_LEVEL", "verbose")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log);
        let running =
            Running::spawn(&mut cmd, fort_core::process::Stop::TERM).expect("start wireguard-go");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !socket(&interface).exists() {
            assert!(
                Instant::now() < deadline,
                "wireguard-go did not make {interface}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        self.members.push(Member {
            index,
            netns,
            interface,
            underlay,
            log: log_path,
            wireguard_go: Some(running),
        });
        self.members.last().expect("pushed")
    }

    pub fn get(&self, index: u8) -> &Member {
        self.members
            .iter()
            .find(|m| m.index == index)
            .expect("a member of this underlay")
    }
}

impl Default for Underlay {
    fn default() -> Self {
        Underlay::new()
    }
}

impl Drop for Underlay {
    fn drop(&mut self) {
        for m in &mut self.members {
            if let Some(mut w) = m.wireguard_go.take() {
                w.stop();
            }
            // A killed wireguard-go leaves its socket behind.
            let _ = std::fs::remove_file(socket(&m.interface));
        }
        self.namespaces.remove_all();
    }
}

fn socket(interface: &str) -> PathBuf {
    PathBuf::from(format!("/var/run/wireguard/{interface}.sock"))
}

impl Member {
    /// `ip netns exec <ns> PROGRAM`: a command run inside the member's namespace.
    pub fn command(&self, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.netns, program]);
        c
    }

    /// The last `lines` lines of `wireguard-go`'s log, for a failing assertion.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().filter(|l| !l.contains("Routine:")).collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// One ping from this member to `address` (1 s to answer).
    pub fn ping(&self, address: &str) -> bool {
        self.start_ping(address)
            .and_then(|mut c| c.wait())
            .is_ok_and(|s| s.success())
    }

    /// One ping from this member to `address`, started: many can run at once, so that a
    /// round over every pair of a mesh takes a second, not a second per pair.
    pub fn start_ping(&self, address: &str) -> std::io::Result<std::process::Child> {
        self.command("ping")
            .args(["-c", "1", "-W", "1", "-n", "-q", address])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
    }

    /// `wg show <iface> WHAT`, as lines of (peer public key, value).
    fn wg_show(&self, what: &str) -> Vec<(String, String)> {
        let out = Command::new("wg")
            .args(["show", &self.interface, what])
            .output()
            .expect("run wg");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| {
                let (k, v) = l.split_once('\t')?;
                Some((k.to_owned(), v.to_owned()))
            })
            .collect()
    }

    /// Each peer's latest handshake (unix seconds; 0: none yet), by public key.
    pub fn handshakes(&self) -> std::collections::BTreeMap<String, u64> {
        self.wg_show("latest-handshakes")
            .into_iter()
            .map(|(k, v)| (k, v.trim().parse().unwrap_or(0)))
            .collect()
    }

    /// The public keys of the interface's peers, sorted.
    pub fn peers(&self) -> Vec<String> {
        let out = Command::new("wg")
            .args(["show", &self.interface, "peers"])
            .output()
            .expect("run wg");
        let mut keys: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::trim)
            .filter(|k| !k.is_empty())
            .map(str::to_owned)
            .collect();
        keys.sort();
        keys
    }

    /// The interface's own public key (empty without a private key).
    pub fn public_key(&self) -> String {
        let out = Command::new("wg")
            .args(["show", &self.interface, "public-key"])
            .output()
            .expect("run wg");
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }
}
