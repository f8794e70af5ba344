//! The demo's ACME step: when Debian's `pebble` (Let's Encrypt's test CA) and nginx are
//! installed, the demo starts pebble on loopback and beacon also serves `tls` with
//! `fort-handler acme`; app then asks for a certificate for a key its agent makes and
//! never sends (docs/protocol.md §11.10). Pebble validates the name for real: it resolves
//! it at the demo's DNS (dns.rs) and fetches the HTTP-01 challenge from the demo's nginx,
//! which serves the webroot the handler writes to. Without them the step says so and the
//! certificate steps above, on the example handler, are what the demo shows.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use fort_core::process::{Server, Stop};
use serde_json::json;

use super::dns::DemoDns;
use super::fleet::{CapDecl, Fleet, NeedDecl};
use super::proxy::DemoNginx;
use super::steps::{need_row, Wait};
use super::WIKI_DOMAIN;
use crate::admin::AdminRequest;

pub(super) const NEED: &str = "tls/wiki";
/// The walkthrough step that adds [`NEED`].
pub(super) const STEP: usize = 6;
/// The host serving `tls`: the one whose nginx answers the challenges, as an edge does.
const PROVIDER: &str = "beacon";

/// A pebble the demo started, and the DNS it resolves names at; stopped when dropped.
pub(super) struct DemoCa {
    pebble: Server,
    _dns: DemoDns,
    dir: PathBuf,
    directory: String,
    management: SocketAddr,
    webroot: PathBuf,
}

fn free_port() -> std::io::Result<SocketAddr> {
    TcpListener::bind("127.0.0.1:0")?.local_addr()
}

pub(super) fn find(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/sbin")])
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}

impl DemoCa {
    /// Starts pebble under `root/pebble`, validating HTTP-01 at `nginx`, or says why not
    /// (`Ok(None)`: not installed). Pebble ships no TLS certificate of its own: the demo
    /// makes a CA and a certificate for 127.0.0.1, which the handler is told to trust.
    pub(super) fn start(root: &Path, nginx: &DemoNginx) -> anyhow::Result<Option<DemoCa>> {
        let Some(program) = find("pebble") else {
            return Ok(None);
        };
        let dir = root.join("pebble");
        std::fs::create_dir_all(&dir)?;
        let ca_key = rcgen::KeyPair::generate()?;
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new())?;
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "fort demo pebble TLS CA");
        let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key)?;
        let key = rcgen::KeyPair::generate()?;
        let mut params = rcgen::CertificateParams::new(vec!["localhost".to_owned()])?;
        params
            .subject_alt_names
            .push(rcgen::SanType::IpAddress([127, 0, 0, 1].into()));
        let cert = params.signed_by(&key, &ca)?;
        std::fs::write(dir.join("tls-root.pem"), ca.pem())?;
        std::fs::write(dir.join("cert.pem"), cert.pem())?;
        std::fs::write(dir.join("key.pem"), key.serialize_pem())?;
        let (listen, management) = (free_port()?, free_port()?);
        let config = json!({"pebble": {
            "listenAddress": listen.to_string(),
            "managementListenAddress": management.to_string(),
            "certificate": dir.join("cert.pem"),
            "privateKey": dir.join("key.pem"),
            // Where the names resolve to (127.0.0.1), nginx answers HTTP-01.
            "httpPort": nginx.addr.port(),
            "tlsPort": free_port()?.port(),
            "ocspResponderURL": "",
            "externalAccountBindingRequired": false,
        }});
        std::fs::write(dir.join("pebble.json"), config.to_string())?;
        let dns = DemoDns::start()?;
        let log = std::fs::File::create(dir.join("pebble.log"))?;
        let pebble = Server::spawn(
            Command::new(program)
                .arg("-config")
                .arg(dir.join("pebble.json"))
                .arg("-dnsserver")
                .arg(dns.addr.to_string())
                .env("PEBBLE_VA_NOSLEEP", "1")
                .env("PEBBLE_WFE_NONCEREJECT", "0")
                .stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log),
            Stop::TERM,
        )
        .context("cannot start pebble")?;
        let mut ca = DemoCa {
            pebble,
            _dns: dns,
            dir,
            directory: format!("https://{listen}/dir"),
            management,
            webroot: nginx.webroot().to_owned(),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(listen).is_err() || TcpStream::connect(management).is_err() {
            if let Some(status) = ca.pebble.exited() {
                bail!(
                    "pebble exited ({status}); see {}",
                    ca.dir.join("pebble.log").display()
                );
            }
            if Instant::now() > deadline {
                bail!("pebble did not listen within 20s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(Some(ca))
    }

    /// beacon's `tls` capability (`fort-handler acme` against this pebble, writing
    /// challenges to nginx's webroot) and app's need for a certificate for its own key,
    /// added by the step.
    pub(super) fn declarations(&self, root: &Path) -> anyhow::Result<(CapDecl, NeedDecl)> {
        use std::os::unix::fs::MetadataExt;
        let handler = std::env::current_exe()?.with_file_name("fort-handler");
        if !handler.is_file() {
            bail!("{} is not built", handler.display());
        }
        let config = self.dir.join("acme.json");
        std::fs::write(
            &config,
            json!({
                "directory": self.directory,
                "ca_root": self.dir.join("tls-root.pem"),
                "allow": {"app": [WIKI_DOMAIN]},
                "http01": {"webroot": self.webroot},
                "revoke_on_release": true,
                "rerun_seconds": 1,
                "state": self.dir.join("acme-state.json"),
            })
            .to_string(),
        )?;
        let cap = CapDecl {
            host: PROVIDER,
            name: "tls",
            handler: "",
            command: Some((
                handler,
                vec![
                    "acme".into(),
                    "--config".into(),
                    config.display().to_string(),
                ],
            )),
            cache_response: false,
            description:
                "certificates from pebble (ACME, HTTP-01 at nginx) for keys the consumers make",
        };
        let me = std::fs::metadata(root)?;
        let key_path = root.join("app/run/needs").join(NEED).join("key.pem");
        let need = NeedDecl {
            consumer: "app",
            key: NEED,
            from: PROVIDER,
            request: json!({"csr": {"$fort_key": "key", "as": "csr"}}),
            handler: None,
            files: vec![
                ("cert.pem", "/certificate", "0444"),
                ("chain.pem", "/chain", "0444"),
            ],
            more: json!({"keys": {"key": {
                "type": "ecdsa-p256", "path": key_path, "names": [WIKI_DOMAIN],
                "owner": me.uid().to_string(), "group": me.gid().to_string(), "mode": "0400",
            }}}),
            added_in: Some(STEP),
            released_in: None,
        };
        Ok((cap, need))
    }

    /// Pebble's root, which its certificates chain to (it makes a new one each start).
    fn root_pem(&self) -> anyhow::Result<String> {
        let out = Command::new("curl")
            .args(["-sSf", "--cacert"])
            .arg(self.dir.join("tls-root.pem"))
            .arg(format!("https://{}/roots/0", self.management))
            .output()
            .context("cannot run curl")?;
        if !out.status.success() {
            bail!(
                "pebble's root: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8(out.stdout)?)
    }
}

fn openssl(args: &[&str], paths: &[&Path]) -> anyhow::Result<String> {
    let out = Command::new("openssl")
        .args(args)
        .args(paths)
        .output()
        .context("cannot run openssl")?;
    if !out.status.success() {
        bail!(
            "openssl {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The step: app asks for a certificate with a CSR its agent makes; key and certificate
/// land together, the certificate verifies against pebble's root, and the key is in no
/// state file.
pub(super) async fn step(
    fleet: &Fleet,
    ca: Option<&DemoCa>,
    nginx: Option<&DemoNginx>,
) -> anyhow::Result<String> {
    let (Some(ca), Some(nginx)) = (ca, nginx) else {
        println!("  pebble (Debian's package) and nginx, where it validates names, are not both");
        println!(
            "  installed: no ACME CA to ask; the certificate steps above use the example handler."
        );
        return Ok("skipped: pebble or nginx is not installed".into());
    };
    println!("  pebble, an ACME CA, runs at {};", ca.directory);
    println!(
        "  {PROVIDER} serves tls with fort-handler acme, which puts HTTP-01 challenges where its"
    );
    println!(
        "  nginx ({}) serves them. app declares {NEED} with a key its agent makes:",
        nginx.addr
    );
    println!("  the request carries {{\"$fort_key\": \"key\", \"as\": \"csr\"}}, only a CSR.");
    fleet.declare_at("app", STEP)?;
    fleet
        .admin("app", &AdminRequest::Reload)
        .await
        .context("reload app")?;
    let wait = Wait::until("app holds a certificate from pebble for its own key");
    loop {
        if need_row(fleet, NEED).await?["satisfied"] == true {
            break;
        }
        // The CA's fetches answered 403: say so now, not as a timeout later.
        if nginx.refused_challenges() > 0 {
            bail!(
                "nginx answered pebble's HTTP-01 fetches with 403: its workers cannot read the webroot {} (a directory above it does not let them pass). Run the demo with TMPDIR set to a directory others can pass through (for example TMPDIR=/tmp); nginx's log: {}",
                nginx.webroot().display(),
                nginx.access_log_path().display()
            );
        }
        wait.tick().await?;
    }
    let key = fleet.delivered(NEED, "key.pem");
    let cert = fleet.delivered(NEED, "cert.pem");
    let chain = fleet.delivered(NEED, "chain.pem");
    let key_public = openssl(&["pkey", "-pubout", "-in"], &[&key])?;
    let cert_public = openssl(&["x509", "-noout", "-pubkey", "-in"], &[&cert])?;
    if key_public != cert_public {
        bail!("{} is not the key of {}", key.display(), cert.display());
    }
    let root = ca.dir.join("root.pem");
    std::fs::write(&root, ca.root_pem()?)?;
    openssl(
        &["verify", "-CAfile"],
        &[&root, Path::new("-untrusted"), &chain, &cert],
    )
    .context("the certificate does not verify against pebble's root")?;
    // Pebble fetched the challenge from nginx: its validation is in nginx's access log.
    let fetched = nginx
        .access_log()
        .lines()
        .filter(|l| l.contains("/.well-known/acme-challenge/") && l.contains("\" 200 "))
        .count();
    if fetched == 0 {
        bail!("nginx served no ACME challenge: pebble did not validate through it");
    }
    // The private key is in its file only: not in app's state, nor the provider's.
    let pem = std::fs::read_to_string(&key)?;
    let secret = pem.lines().nth(1).unwrap_or_default().to_owned();
    for host in ["app", PROVIDER] {
        for file in walk(&fleet.host(host).dir.join("state")) {
            if std::fs::read_to_string(&file).is_ok_and(|t| t.contains(&secret)) {
                bail!("{} holds app's private key", file.display());
            }
        }
    }
    println!("  pebble fetched the challenge for {WIKI_DOMAIN} from nginx: {fetched} GET .../acme-challenge/... 200 in its log");
    println!("  app/run/needs/{NEED}/key.pem    made by app's agent (ECDSA P-256, mode 0400)");
    println!("  app/run/needs/{NEED}/cert.pem   issued by pebble for that key: openssl verify OK");
    println!("  the private key is in no state file of app or {PROVIDER}, and was in no request");
    Ok("a certificate from pebble, validated by HTTP-01 at nginx, for a key app made".into())
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else if p.is_file() {
            out.push(p);
        }
    }
    out
}
