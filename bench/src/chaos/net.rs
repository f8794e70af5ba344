//! Faults between hosts in the kernel, the way Jepsen makes them: every host of the run
//! in a network namespace of its own, joined by a veth pair to one bridge (which also
//! carries the run's own calls from the root namespace), and nftables rules in a host's
//! namespace dropping what it sends to a peer (a one-way partition), what it sends and
//! receives (two-way), or whatever exceeds a small rate (a slow link: TCP retransmits).
//! Everything made here is removed when the run ends, however it ends.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::{Command, Stdio};

/// What is done to the traffic from one host to another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Link {
    /// Everything `from` sends to `to` is dropped.
    Drop,
    /// What `from` sends to `to` past a few kB/s is dropped.
    Slow,
}

/// The bytes a slow link passes per second before it drops.
const SLOW_BYTES_PER_SECOND: u32 = 4096;

pub struct Net {
    bridge: String,
    namespaces: BTreeMap<String, (String, Ipv4Addr)>,
    /// (from, to) → what is done to that direction's packets, with a count of the faults
    /// asking for it (two faults on one pair overlap).
    links: BTreeMap<(String, String), BTreeMap<Link, u32>>,
    _on_signal: fort_tests::cleanup::OnSignal,
}

/// Why the kernel way cannot run here, or `None` when it can.
pub fn unavailable() -> Option<String> {
    #[allow(unsafe_code)]
    // SAFETY: geteuid(2) has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if !root {
        return Some("network namespaces and nftables rules need root".into());
    }
    for tool in ["ip", "nft", "nsenter"] {
        let found = Command::new(tool)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok();
        if !found {
            return Some(format!("{tool} is not installed"));
        }
    }
    None
}

fn run(args: &[&str]) -> Result<(), String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .map_err(|e| format!("{}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn remove_all(bridge: &str, namespaces: &[String]) {
    for ns in namespaces {
        let _ = run(&["ip", "netns", "del", ns]);
    }
    let _ = run(&["ip", "link", "del", bridge]);
}

impl Net {
    /// A namespace per host, addressed in a /16 of 10.0.0.0/8 no route of this machine
    /// uses yet; the bridge holds .0.1, the hosts the addresses after it.
    pub fn setup(hosts: &[String]) -> Result<Net, String> {
        let tag = format!("{:04x}", std::process::id() & 0xffff);
        let bridge = format!("fcb{tag}");
        let routes = Command::new("ip")
            .args(["-4", "route"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        let start = std::process::id() % 150;
        let second = (0..150u32)
            .map(|n| (100 + (start + n) % 150) as u8)
            .find(|n| !routes.contains(&format!("10.{n}.")))
            .ok_or("no free 10.x.0.0/16 for the run's bridge")?;
        let names: Vec<String> = hosts
            .iter()
            .enumerate()
            .map(|(i, _)| format!("fort-chaos-{tag}-{i}"))
            .collect();
        let on_signal = {
            let (bridge, names) = (bridge.clone(), names.clone());
            fort_tests::cleanup::on_signal(move || remove_all(&bridge, &names))
        };
        let mut net = Net {
            bridge: bridge.clone(),
            namespaces: BTreeMap::new(),
            links: BTreeMap::new(),
            _on_signal: on_signal,
        };
        run(&["ip", "link", "add", &bridge, "type", "bridge"])?;
        run(&[
            "ip",
            "addr",
            "add",
            &format!("10.{second}.0.1/16"),
            "dev",
            &bridge,
        ])?;
        run(&["ip", "link", "set", &bridge, "up"])?;
        for (i, (host, ns)) in hosts.iter().zip(&names).enumerate() {
            let n = i + 2;
            let ip = Ipv4Addr::new(10, second, (n / 250) as u8, (n % 250) as u8 + 1);
            let outer = format!("fc{tag}h{i}");
            let inner = format!("fc{tag}n{i}");
            run(&["ip", "netns", "add", ns])?;
            net.namespaces.insert(host.clone(), (ns.clone(), ip));
            run(&[
                "ip", "link", "add", &outer, "type", "veth", "peer", "name", &inner,
            ])?;
            run(&["ip", "link", "set", &inner, "netns", ns])?;
            run(&["ip", "link", "set", &outer, "master", &bridge, "up"])?;
            run(&["ip", "-n", ns, "link", "set", &inner, "name", "eth0"])?;
            run(&[
                "ip",
                "-n",
                ns,
                "addr",
                "add",
                &format!("{ip}/16"),
                "dev",
                "eth0",
            ])?;
            run(&["ip", "-n", ns, "link", "set", "eth0", "up"])?;
            run(&["ip", "-n", ns, "link", "set", "lo", "up"])?;
            net.apply(host)?;
        }
        Ok(net)
    }

    /// `host`'s address in its namespace.
    pub fn ip(&self, host: &str) -> Ipv4Addr {
        self.namespaces[host].1
    }

    /// The namespace a process of `host` joins (for `nsenter --net=`).
    pub fn netns_path(&self, host: &str) -> PathBuf {
        PathBuf::from("/run/netns").join(&self.namespaces[host].0)
    }

    /// Whether a TCP connection from `from`'s namespace to `to` (an address of another
    /// host) is made within a second: how a fault is seen to hold.
    pub fn connects(&self, from: &str, to: std::net::SocketAddr) -> bool {
        let path = self.netns_path(from);
        std::thread::spawn(move || {
            let Ok(ns) = std::fs::File::open(&path) else {
                return false;
            };
            use std::os::fd::AsRawFd;
            #[allow(unsafe_code)]
            // SAFETY: setns(2) on an open namespace file; it moves this thread alone,
            // which ends right after.
            let joined = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } == 0;
            joined
                && std::net::TcpStream::connect_timeout(&to, std::time::Duration::from_secs(1))
                    .is_ok()
        })
        .join()
        .unwrap_or(false)
    }

    /// Adds `link` to the traffic from `from` to `to`.
    pub fn add(&mut self, from: &str, to: &str, link: Link) -> Result<(), String> {
        *self
            .links
            .entry((from.to_owned(), to.to_owned()))
            .or_default()
            .entry(link)
            .or_default() += 1;
        self.apply(from)?;
        self.apply(to)
    }

    /// Takes one `link` away from the traffic from `from` to `to`.
    pub fn remove(&mut self, from: &str, to: &str, link: Link) -> Result<(), String> {
        let key = (from.to_owned(), to.to_owned());
        if let Some(kinds) = self.links.get_mut(&key) {
            if let Some(n) = kinds.get_mut(&link) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    kinds.remove(&link);
                }
            }
            if kinds.is_empty() {
                self.links.remove(&key);
            }
        }
        self.apply(from)?;
        self.apply(to)
    }

    /// Replaces `host`'s table with the rules its links need now, in one transaction.
    fn apply(&self, host: &str) -> Result<(), String> {
        let (ns, _) = &self.namespaces[host];
        let mut output = String::new();
        let mut input = String::new();
        for ((from, to), kinds) in &self.links {
            let drop = kinds.contains_key(&Link::Drop);
            let slow = kinds.contains_key(&Link::Slow);
            if from == host {
                let peer = self.ip(to);
                if drop {
                    output.push_str(&format!("    ip daddr {peer} drop\n"));
                } else if slow {
                    output.push_str(&format!(
                        "    ip daddr {peer} limit rate over {SLOW_BYTES_PER_SECOND} bytes/second drop\n"
                    ));
                }
            } else if to == host && drop {
                input.push_str(&format!("    ip saddr {} drop\n", self.ip(from)));
            }
        }
        let text = format!(
            "table inet fort_chaos {{}}\nflush table inet fort_chaos\ntable inet fort_chaos {{\n  chain output {{\n    type filter hook output priority 0;\n{output}  }}\n  chain input {{\n    type filter hook input priority 0;\n{input}  }}\n}}\n"
        );
        let mut child = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{ns}"))
            .args(["--", "nft", "-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("nft: {e}"))?;
        use std::io::Write;
        child
            .stdin
            .take()
            .expect("piped")
            .write_all(text.as_bytes())
            .map_err(|e| format!("nft: {e}"))?;
        let out = child.wait_with_output().map_err(|e| format!("nft: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "nft in {host}'s namespace: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        let names: Vec<String> = self.namespaces.values().map(|(n, _)| n.clone()).collect();
        remove_all(&self.bridge, &names);
    }
}
