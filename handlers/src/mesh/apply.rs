//! `fort-handler mesh-wg --interface IFACE --private-key FILE`: a member's need handler
//! (docs/handlers.md, "mesh") that applies a `mesh` answer (on stdin, or a saved one with
//! `--answer FILE`) to a WireGuard interface: the private key the agent installed and the
//! listen port, every peer through `wg syncconf` (which changes only what differs, so a
//! peer whose key, endpoint and allowed IPs stayed keeps its tunnel), the tunnel
//! addresses through `ip address replace` (other global addresses of the interface go:
//! it is the mesh's alone), and the link up. A missing interface is made
//! (`ip link add … type wireguard`, the kernel's).
//!
//! Everything in the answer is checked before anything is run: it is rendered into
//! `wg`'s config format, where a stray newline would be another directive. The config,
//! which holds the private key, reaches `wg` on a pipe, never a file.

use std::ffi::OsString;
use std::io::{Read, Write};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};

use clap::Parser;
use ipnet::IpNet;
use serde::Deserialize;
use zeroize::Zeroizing;

use super::request::check_public_key;

/// The name `fort-handler` dispatches on.
pub const NAME: &str = "mesh-wg";

/// Largest answer read (a mesh's answers are at most a few hundred kilobytes).
const MAX_ANSWER: u64 = 4 << 20;
/// The shortest mesh prefixes a member takes from an answer: a prefix is routed into the
/// tunnel, and what is shorter than a private network's (10/8; a ULA's /16 with room)
/// would take traffic that is not the mesh's.
const SHORTEST_V4: u8 = 8;
const SHORTEST_V6: u8 = 16;
/// The most peers an answer may list (a mesh has at most 400 members).
const MAX_PEERS: usize = 1000;

#[derive(Parser)]
#[command(
    name = "fort-handler mesh-wg",
    about = "Applies a mesh answer (on stdin) to a WireGuard interface with wg syncconf"
)]
struct Cli {
    /// The WireGuard interface (made when missing).
    #[arg(long)]
    interface: String,
    /// The private key file the agent installed (the need's `wireguard` key).
    #[arg(long)]
    private_key: PathBuf,
    /// Apply the answer saved in FILE instead of one on stdin (after the interface was
    /// made again); a missing FILE is nothing delivered yet, and not an error.
    #[arg(long)]
    answer: Option<PathBuf>,
    /// The `wg` program. Unset: `wg` on PATH.
    #[arg(long, default_value = "wg")]
    wg: PathBuf,
    /// The `ip` program (iproute2). Unset: `ip` on PATH.
    #[arg(long, default_value = "ip")]
    ip: PathBuf,
}

/// A member's answer, as far as the interface needs it (other members are ignored).
#[derive(Debug, Deserialize)]
pub struct Answer {
    pub public_key: String,
    pub listen_port: u16,
    #[serde(default)]
    pub ipv4: Option<String>,
    #[serde(default)]
    pub ipv6: Option<String>,
    pub peers: Vec<Peer>,
}

#[derive(Debug, Deserialize)]
pub struct Peer {
    #[serde(default)]
    pub host: Option<String>,
    pub public_key: String,
    #[serde(default)]
    pub endpoint: Option<String>,
    pub allowed_ips: Vec<String>,
    #[serde(default)]
    pub persistent_keepalive: Option<u16>,
}

/// Runs the helper with the process arguments after `fort-handler`.
pub fn main(args: Vec<OsString>) -> ExitCode {
    let cli = Cli::parse_from(args);
    let mut bytes = Vec::new();
    let read = match &cli.answer {
        Some(path) => match std::fs::File::open(path) {
            Ok(f) => f.take(MAX_ANSWER + 1).read_to_end(&mut bytes),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                eprintln!(
                    "{NAME}: {} does not exist: nothing delivered yet",
                    path.display()
                );
                return ExitCode::SUCCESS;
            }
            Err(e) => Err(e),
        },
        None => std::io::stdin()
            .take(MAX_ANSWER + 1)
            .read_to_end(&mut bytes),
    };
    if let Err(e) = read {
        eprintln!("{NAME}: cannot read the answer: {e}");
        return ExitCode::FAILURE;
    }
    match apply(&cli, &bytes) {
        Ok(done) => {
            eprintln!("{NAME}: {done}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{NAME}: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Reads and checks an answer: every value that goes into `wg`'s config or `ip`'s
/// arguments is one that cannot be read otherwise.
pub fn parse(bytes: &[u8]) -> anyhow::Result<(Answer, Vec<IpNet>)> {
    if bytes.len() as u64 > MAX_ANSWER {
        anyhow::bail!("the answer is larger than {MAX_ANSWER} bytes");
    }
    let a: Answer = serde_json::from_slice(bytes)
        .map_err(|e| anyhow::anyhow!("the payload is not a mesh answer: {e}"))?;
    check_public_key(&a.public_key).map_err(anyhow::Error::msg)?;
    if a.listen_port == 0 {
        anyhow::bail!("listen_port 0");
    }
    if a.peers.len() > MAX_PEERS {
        anyhow::bail!("{} peers, more than {MAX_PEERS}", a.peers.len());
    }
    let mut addresses = Vec::new();
    for (family, text) in [("ipv4", &a.ipv4), ("ipv6", &a.ipv6)] {
        if let Some(t) = text {
            let net: IpNet = t
                .parse()
                .map_err(|_| anyhow::anyhow!("{family} {t:?} is not an address/length"))?;
            // The address's length is the mesh's prefix, which becomes a route through
            // the tunnel: a short one (a /1, a /0) would send the host's own traffic to
            // the coordinator's choice of peer.
            let (v4, shortest) = match net {
                IpNet::V4(_) => (true, SHORTEST_V4),
                IpNet::V6(_) => (false, SHORTEST_V6),
            };
            if v4 != (family == "ipv4") {
                anyhow::bail!("{family} {t:?} is an address of the other family");
            }
            if net.prefix_len() < shortest {
                anyhow::bail!(
                    "{family} {t:?}: a mesh prefix shorter than /{shortest} would route traffic that is not the mesh's into the tunnel"
                );
            }
            addresses.push(net);
        }
    }
    for (i, p) in a.peers.iter().enumerate() {
        let name = p.host.as_deref().unwrap_or("?");
        check_public_key(&p.public_key).map_err(|e| anyhow::anyhow!("peer {i} ({name}): {e}"))?;
        if p.public_key == a.public_key {
            anyhow::bail!("peer {i} ({name}) has this member's own key");
        }
        if let Some(e) = &p.endpoint {
            if !is_endpoint(e) {
                anyhow::bail!("peer {i} ({name}): endpoint {e:?} is not host:port");
            }
        }
        for ip in &p.allowed_ips {
            let net = ip.parse::<IpNet>().map_err(|_| {
                anyhow::anyhow!("peer {i} ({name}): allowed IP {ip:?} is not a prefix")
            })?;
            // A peer is routed only addresses of the mesh this member is in.
            if !addresses.iter().any(|own| own.trunc().contains(&net)) {
                anyhow::bail!(
                    "peer {i} ({name}): allowed IP {ip:?} is outside the mesh's prefixes"
                );
            }
        }
        if p.persistent_keepalive == Some(0) {
            anyhow::bail!("peer {i} ({name}): persistent_keepalive 0");
        }
    }
    Ok((a, addresses))
}

/// `host:port` with an IP address, a bracketed IPv6 address or a DNS name.
fn is_endpoint(e: &str) -> bool {
    let Some((host, port)) = e.rsplit_once(':') else {
        return false;
    };
    if port.parse::<u16>().map_or(true, |p| p == 0) {
        return false;
    }
    if let Some(v6) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        return v6.parse::<std::net::Ipv6Addr>().is_ok();
    }
    host.parse::<std::net::Ipv4Addr>().is_ok()
        || (!host.is_empty()
            && host.len() <= 253
            && host.split('.').all(|l| {
                !l.is_empty()
                    && l.len() <= 63
                    && l.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-')
            }))
}

/// `wg`'s config for the interface: the private key, the port, every peer.
pub fn render(private_key: &str, a: &Answer) -> Zeroizing<String> {
    let mut text = Zeroizing::new(format!(
        "[Interface]\nPrivateKey = {}\nListenPort = {}\n",
        private_key.trim(),
        a.listen_port
    ));
    for p in &a.peers {
        text.push_str(&format!("\n[Peer]\nPublicKey = {}\n", p.public_key));
        if !p.allowed_ips.is_empty() {
            text.push_str(&format!("AllowedIPs = {}\n", p.allowed_ips.join(", ")));
        }
        if let Some(e) = &p.endpoint {
            text.push_str(&format!("Endpoint = {e}\n"));
        }
        if let Some(k) = p.persistent_keepalive {
            text.push_str(&format!("PersistentKeepalive = {k}\n"));
        }
    }
    text
}

fn apply(cli: &Cli, bytes: &[u8]) -> anyhow::Result<String> {
    let iface = &cli.interface;
    if iface.is_empty()
        || iface.len() > 15
        || !iface
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"_-.".contains(&c))
    {
        anyhow::bail!("--interface {iface:?} is not an interface name");
    }
    let (answer, addresses) = parse(bytes)?;
    let key = read_private_key(&cli.private_key)?;
    if !interface_exists(&cli.ip, iface)? {
        run(
            &cli.ip,
            &["link", "add", "dev", iface, "type", "wireguard"],
            None,
        )
        .map_err(|e| anyhow::anyhow!("interface {iface} does not exist and cannot be made: {e}"))?;
    }
    let config = render(&key, &answer);
    run(
        &cli.wg,
        &["syncconf", iface, "/dev/stdin"],
        Some(config.as_bytes()),
    )?;
    set_addresses(&cli.ip, iface, &addresses)?;
    run(&cli.ip, &["link", "set", "dev", iface, "up"], None)?;
    Ok(format!(
        "{iface}: {} peers, addresses {}",
        answer.peers.len(),
        addresses
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    ))
}

/// The private key file: only its owner may read it (it is the interface's identity).
fn read_private_key(path: &Path) -> anyhow::Result<Zeroizing<String>> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path)
        .map_err(|e| anyhow::anyhow!("cannot read the private key {}: {e}", path.display()))?;
    if meta.mode() & 0o077 != 0 {
        anyhow::bail!(
            "the private key {} may be read by others (mode {:o}); not used",
            path.display(),
            meta.mode() & 0o777
        );
    }
    let text = Zeroizing::new(
        std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("cannot read the private key {}: {e}", path.display()))?,
    );
    check_public_key(text.trim())
        .map_err(|_| anyhow::anyhow!("{} is not a WireGuard key", path.display()))?;
    Ok(text)
}

fn interface_exists(ip: &Path, iface: &str) -> anyhow::Result<bool> {
    let out = Command::new(ip)
        .args(["-j", "link", "show", "dev", iface])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| anyhow::anyhow!("cannot run {}: {e}", ip.display()))?;
    Ok(out.status.success())
}

/// The interface's global addresses become exactly `want`.
fn set_addresses(ip: &Path, iface: &str, want: &[IpNet]) -> anyhow::Result<()> {
    #[derive(Deserialize)]
    struct Link {
        #[serde(default)]
        addr_info: Vec<Addr>,
    }
    #[derive(Deserialize)]
    struct Addr {
        local: IpAddr,
        prefixlen: u8,
        #[serde(default)]
        scope: String,
    }
    let out = Command::new(ip)
        .args(["-j", "address", "show", "dev", iface])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| anyhow::anyhow!("cannot run {}: {e}", ip.display()))?;
    if !out.status.success() {
        anyhow::bail!(
            "ip address show dev {iface}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let links: Vec<Link> = serde_json::from_slice(&out.stdout).unwrap_or_default();
    let have: Vec<IpNet> = links
        .iter()
        .flat_map(|l| &l.addr_info)
        .filter(|a| a.scope == "global")
        .filter_map(|a| IpNet::new(a.local, a.prefixlen).ok())
        .collect();
    for net in have.iter().filter(|n| !want.contains(n)) {
        run(
            ip,
            &["address", "del", &net.to_string(), "dev", iface],
            None,
        )?;
    }
    for net in want.iter().filter(|n| !have.contains(n)) {
        run(
            ip,
            &["address", "replace", &net.to_string(), "dev", iface],
            None,
        )?;
    }
    Ok(())
}

/// Runs `program args…` with `input` on stdin; its stderr in the error.
fn run(program: &Path, args: &[&str], input: Option<&[u8]>) -> anyhow::Result<()> {
    let mut child = Command::new(program)
        .args(args)
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| anyhow::anyhow!("cannot run {}: {e}", program.display()))?;
    if let (Some(bytes), Some(mut stdin)) = (input, child.stdin.take()) {
        stdin
            .write_all(bytes)
            .map_err(|e| anyhow::anyhow!("{} {}: {e}", program.display(), args.join(" ")))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| anyhow::anyhow!("{}: {e}", program.display()))?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        anyhow::bail!(
            "{} {} failed ({}): {}",
            program.display(),
            args.join(" "),
            out.status,
            fort_core::text::printable(stderr.trim(), 300)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const A: &str = "xTIBA5rboUvnH4htodjb6e697QjLERt1NAB4mZqp8Dg=";
    const B: &str = "TrMvSoP4jYQlY6RIzBgbssQqY3vxI2Pi+y71lOWWXX0=";

    #[test]
    fn an_answer_renders_and_a_hostile_one_is_refused() {
        let good = json!({"public_key": A, "listen_port": 51820, "ipv4": "10.77.0.5/16",
                          "ipv6": "fd77::5/64",
                          "peers": [{"host": "db", "public_key": B, "endpoint": "[fd00::2]:51820",
                                     "allowed_ips": ["10.77.0.9/32", "fd77::9/128"],
                                     "persistent_keepalive": 25}]});
        let (a, addresses) = parse(good.to_string().as_bytes()).unwrap();
        assert_eq!(addresses.len(), 2);
        let text = render("PRIVATE\n", &a);
        assert_eq!(
            text.as_str(),
            format!("[Interface]\nPrivateKey = PRIVATE\nListenPort = 51820\n\n[Peer]\nPublicKey = {B}\nAllowedIPs = 10.77.0.9/32, fd77::9/128\nEndpoint = [fd00::2]:51820\nPersistentKeepalive = 25\n")
        );
        for (peer, says) in [
            (
                json!({"public_key": "x\n[Peer]", "allowed_ips": []}),
                "not a WireGuard public key",
            ),
            (
                json!({"public_key": B, "endpoint": "a:1\nPrivateKey = x", "allowed_ips": []}),
                "not host:port",
            ),
            (
                json!({"public_key": B, "allowed_ips": ["10.0.0.1/32\nEndpoint = x:1"]}),
                "not a prefix",
            ),
            (json!({"public_key": A, "allowed_ips": []}), "own key"),
            (
                json!({"public_key": B, "allowed_ips": [], "persistent_keepalive": 0}),
                "persistent_keepalive",
            ),
        ] {
            let mut bad = good.clone();
            bad["peers"] = json!([peer]);
            let err = parse(bad.to_string().as_bytes()).unwrap_err().to_string();
            assert!(err.contains(says), "{peer}: {err}");
        }
        let mut bad = good.clone();
        bad["ipv4"] = json!("10.77.0.5");
        assert!(parse(bad.to_string().as_bytes()).is_err());
        // A coordinator cannot route the member's own traffic into the tunnel.
        for (field, value, says) in [
            ("ipv4", json!("10.77.0.5/1"), "shorter than /8"),
            ("ipv4", json!("fd77::5/64"), "other family"),
            ("ipv6", json!("::5/0"), "shorter than /16"),
        ] {
            let mut bad = good.clone();
            bad[field] = value;
            let err = parse(bad.to_string().as_bytes()).unwrap_err().to_string();
            assert!(err.contains(says), "{field}: {err}");
        }
        let mut bad = good.clone();
        bad["peers"][0]["allowed_ips"] = json!(["0.0.0.0/1"]);
        let err = parse(bad.to_string().as_bytes()).unwrap_err().to_string();
        assert!(err.contains("outside the mesh"), "{err}");
        assert!(is_endpoint("wg.example.org:51820"));
        assert!(!is_endpoint("wg.example.org:0"));
        assert!(!is_endpoint("fd00::1:51820"));
    }
}
