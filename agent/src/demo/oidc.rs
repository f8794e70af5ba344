//! The demo's OpenID step: when node and npm's `oidc-provider` are installed (where
//! `.ci/run` puts it: `$FORT_OIDC_PROVIDER_DIR` or `~/.cache/fort/oidc-provider`), the
//! demo starts a real OpenID provider on loopback and forge also serves `idp` with
//! `fort-handler oidc`; app's need for a client is registered there by RFC 7591, and the
//! delivered client gets a token at the provider's token endpoint. Without them the step
//! says so and the OIDC client of the steps above comes from the example handler.

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

pub(super) const NEED: &str = "idp/wiki";
/// The walkthrough step that adds [`NEED`].
pub(super) const STEP: usize = 7;

/// The provider's server: the same script the oidc tests run, shipped in the binary.
const SERVER: &str = include_str!("../../../tests/oidc/server.mjs");

/// An OpenID provider the demo started; stopped when dropped.
pub(super) struct DemoIdp {
    node: Server,
    dir: PathBuf,
    issuer: String,
}

fn package_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("FORT_OIDC_PROVIDER_DIR") {
        return Some(dir.into());
    }
    std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/fort/oidc-provider"))
}

impl DemoIdp {
    /// Starts the provider under `root/idp`; `Ok(None)` when node or the package is not
    /// installed.
    pub(super) fn start(root: &Path) -> anyhow::Result<Option<DemoIdp>> {
        let Some(node) = super::acme::find("node") else {
            return Ok(None);
        };
        let Some(package) =
            package_dir().filter(|d| d.join("node_modules/oidc-provider/package.json").is_file())
        else {
            return Ok(None);
        };
        let dir = root.join("idp");
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join("server.mjs"), SERVER)?;
        let token: String = (0..32)
            .map(|_| char::from(b'a' + rand::random::<u8>() % 26))
            .collect();
        std::fs::write(dir.join("initial-access-token"), &token)?;
        let addr: SocketAddr = TcpListener::bind("127.0.0.1:0")?.local_addr()?;
        let log = std::fs::File::create(dir.join("idp.log"))?;
        let node = Server::spawn(
            Command::new(node)
                .arg(dir.join("server.mjs"))
                .env("FORT_OIDC_PROVIDER_DIR", &package)
                .env("FORT_OIDC_PORT", addr.port().to_string())
                .env("FORT_OIDC_TOKEN_FILE", dir.join("initial-access-token"))
                .env("NODE_NO_WARNINGS", "1")
                .stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log),
            Stop::TERM,
        )
        .context("cannot start node")?;
        let mut idp = DemoIdp {
            node,
            dir,
            issuer: format!("http://{addr}"),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(addr).is_err() {
            if let Some(status) = idp.node.exited() {
                bail!(
                    "the OpenID provider exited ({status}); see {}",
                    idp.dir.join("idp.log").display()
                );
            }
            if Instant::now() > deadline {
                bail!("the OpenID provider did not listen within 20s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(Some(idp))
    }

    /// forge's `idp` capability (`fort-handler oidc` against this provider) and app's need
    /// for a client there, added by the step.
    pub(super) fn declarations(&self, root: &Path) -> anyhow::Result<(CapDecl, NeedDecl)> {
        let handler = std::env::current_exe()?.with_file_name("fort-handler");
        if !handler.is_file() {
            bail!("{} is not built", handler.display());
        }
        let config = self.dir.join("oidc.json");
        std::fs::write(
            &config,
            json!({
                "issuer": self.issuer,
                "initial_access_token_file": self.dir.join("initial-access-token"),
                "state_file": root.join("forge/state/oidc-clients.json"),
                "allow": {"app": ["wiki"]},
                "allow_redirect_uris": {"app": [format!("https://{}/", super::WIKI_DOMAIN)]},
                "allow_grant_types": {"app": ["authorization_code", "client_credentials"]},
            })
            .to_string(),
        )?;
        let cap = CapDecl {
            host: "forge",
            name: "idp",
            handler: "",
            command: Some((
                handler,
                vec![
                    "oidc".into(),
                    "--config".into(),
                    config.display().to_string(),
                ],
            )),
            cache_response: true,
            description: "OIDC clients registered at an OpenID provider (RFC 7591)",
        };
        let need = NeedDecl {
            consumer: "app",
            key: NEED,
            from: "forge",
            request: json!({
                "client_name": "wiki",
                "redirect_uris": [format!("https://{}/oauth/callback", super::WIKI_DOMAIN)],
                "grant_types": ["authorization_code", "client_credentials"],
            }),
            handler: None,
            files: vec![
                ("client_id", "/client_id", "0444"),
                ("client_secret", "/client_secret", "0400"),
            ],
            more: json!({}),
            added_in: Some(STEP),
            released_in: None,
        };
        Ok((cap, need))
    }
}

/// The step: app's client is registered at the provider, delivered as files, and gets a
/// `client_credentials` token with them.
pub(super) async fn step(fleet: &Fleet, idp: Option<&DemoIdp>) -> anyhow::Result<String> {
    let Some(idp) = idp else {
        println!(
            "  node and npm's oidc-provider are not installed: no OpenID provider to register"
        );
        println!("  at; the OIDC client of the steps above comes from the example handler.");
        return Ok("skipped: no OpenID provider installed".into());
    };
    println!(
        "  an OpenID provider (npm's oidc-provider) runs at {};",
        idp.issuer
    );
    println!("  forge serves idp with fort-handler oidc; app declares {NEED}.");
    fleet.declare_at("app", STEP)?;
    fleet
        .admin("app", &AdminRequest::Reload)
        .await
        .context("reload app")?;
    let wait = Wait::until("app holds a client registered at the OpenID provider");
    loop {
        if need_row(fleet, NEED).await?["satisfied"] == true {
            break;
        }
        wait.tick().await?;
    }
    let read = |name: &str| {
        std::fs::read_to_string(fleet.delivered(NEED, name))
            .with_context(|| format!("{NEED} has no {name}"))
    };
    let (id, secret) = (read("client_id")?, read("client_secret")?);
    let out = Command::new("curl")
        .args(["-sS", "-u", &format!("{id}:{secret}"), "-d"])
        .arg("grant_type=client_credentials")
        .arg(format!("{}/token", idp.issuer))
        .output()
        .context("cannot run curl")?;
    let answer: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    if answer["access_token"].as_str().is_none_or(str::is_empty) {
        bail!(
            "the delivered client got no token: {}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
    println!("  app/run/needs/{NEED}/client_id       {id} (registered by RFC 7591)");
    println!(
        "  the delivered id and secret get a client_credentials token at {}/token",
        idp.issuer
    );
    Ok("a client registered at a real OpenID provider gets a token".into())
}
