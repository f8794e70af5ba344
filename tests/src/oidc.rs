//! An OpenID provider on loopback for tests and benchmarks: npm's `oidc-provider`, run by
//! node with `tests/oidc/server.mjs` (dynamic registration behind an initial access
//! token, RFC 7592 management, client_credentials, storage in memory), over https with a
//! certificate for 127.0.0.1 from a CA made here; stopped on drop, and however the test
//! ends (crate::cleanup).
//!
//! The package comes from `$FORT_OIDC_PROVIDER_DIR` or `~/.cache/fort/oidc-provider`
//! (`.ci/run` installs it there with npm).

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use fort_core::process::Stop;

use crate::cleanup::Running;
use crate::dns::find_program;

/// The `oidc-provider` version `.ci/run` installs and the tests were written against.
pub const PACKAGE_VERSION: &str = "9.13.3";

/// A running provider.
pub struct OidcProvider {
    pub dir: tempfile::TempDir,
    /// `https://127.0.0.1:PORT`, as its discovery document says.
    pub issuer: String,
    /// The initial access token registrations need, and the file holding it.
    pub initial_token: String,
    pub token_file: PathBuf,
    /// The CA the provider's TLS certificate chains to.
    pub ca_file: PathBuf,
    child: Option<Running>,
}

/// Where the package is installed: `$FORT_OIDC_PROVIDER_DIR`, else
/// `~/.cache/fort/oidc-provider`.
pub fn package_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("FORT_OIDC_PROVIDER_DIR") {
        return Some(PathBuf::from(dir));
    }
    std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/fort/oidc-provider"))
}

impl OidcProvider {
    /// Starts the provider. `Err` says why it cannot run here (node or the package
    /// missing), for `skip`.
    pub fn start() -> Result<OidcProvider, String> {
        OidcProvider::start_at(None)
    }

    /// The provider in the network namespace `netns` (the systemd lane's loopback), on
    /// 127.0.0.1:`port` there; `reachable` tells whether an address of that namespace
    /// accepts connections.
    pub fn start_in_namespace(
        netns: &Path,
        port: u16,
        reachable: &dyn Fn(std::net::SocketAddr) -> bool,
    ) -> Result<OidcProvider, String> {
        OidcProvider::start_at(Some((netns, port, reachable)))
    }

    #[allow(clippy::type_complexity)]
    fn start_at(
        within: Option<(&Path, u16, &dyn Fn(std::net::SocketAddr) -> bool)>,
    ) -> Result<OidcProvider, String> {
        let node = find_program("node").ok_or("node is not installed")?;
        let package = package_dir().ok_or("no HOME and no FORT_OIDC_PROVIDER_DIR")?;
        if !package
            .join("node_modules/oidc-provider/package.json")
            .exists()
        {
            return Err(format!(
                "npm's oidc-provider is not installed in {} (.ci/run installs it)",
                package.display()
            ));
        }
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("oidc/server.mjs");
        let dir = tempfile::tempdir().expect("tempdir");
        let ca_file = crate::loopback_tls(dir.path(), "fort test OpenID provider TLS CA", "ca.pem");
        let mut secret = [0u8; 24];
        std::io::Read::read_exact(
            &mut std::fs::File::open("/dev/urandom").expect("urandom"),
            &mut secret,
        )
        .expect("read /dev/urandom");
        let initial_token =
            base64::Engine::encode(&base64::engine::general_purpose::URL_SAFE_NO_PAD, secret);
        let token_file = dir.path().join("initial-access-token");
        std::fs::write(&token_file, format!("{initial_token}\n")).expect("write");
        let listen = match &within {
            Some((_, port, _)) => std::net::SocketAddr::from(([127, 0, 0, 1], *port)),
            None => crate::free_addr("127.0.0.1"),
        };
        let log = std::fs::File::create(dir.path().join("server.log")).expect("log");
        let mut command = crate::command_in(within.as_ref().map(|(netns, _, _)| *netns), &node);
        let child = Running::spawn(
            command
                .arg(&script)
                .env("FORT_OIDC_PROVIDER_DIR", &package)
                .env("FORT_OIDC_PORT", listen.port().to_string())
                .env("FORT_OIDC_TOKEN_FILE", &token_file)
                .env("FORT_OIDC_TLS_CERT", dir.path().join("cert.pem"))
                .env("FORT_OIDC_TLS_KEY", dir.path().join("key.pem"))
                .stdin(Stdio::null())
                .stdout(log.try_clone().expect("log"))
                .stderr(log),
            Stop::TERM,
        )
        .map_err(|e| format!("cannot start node: {e}"))?;
        let mut p = OidcProvider {
            dir,
            issuer: format!("https://{listen}"),
            initial_token,
            token_file,
            ca_file,
            child: Some(child),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        let reachable = |addr| match &within {
            Some((_, _, reachable)) => reachable(addr),
            None => TcpStream::connect(addr).is_ok(),
        };
        while !reachable(listen) {
            if let Some(status) = p.child.as_mut().and_then(Running::exited) {
                return Err(format!("oidc-provider exited ({status}):\n{}", p.log()));
            }
            if Instant::now() > deadline {
                return Err(format!("oidc-provider did not listen:\n{}", p.log()));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(p)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
    }

    /// The registration endpoint (`<issuer>/reg`) and the token endpoint.
    pub fn registration_endpoint(&self) -> String {
        format!("{}/reg", self.issuer)
    }
    pub fn token_endpoint(&self) -> String {
        format!("{}/token", self.issuer)
    }

    /// An HTTP client that trusts the provider's TLS root, as a relying party would.
    pub fn http(&self) -> reqwest::Client {
        fort_core::tls::install_default_provider();
        let ca = std::fs::read(&self.ca_file).expect("the provider's TLS root");
        reqwest::Client::builder()
            .tls_certs_only(reqwest::Certificate::from_pem_bundle(&ca).expect("PEM"))
            .build()
            .expect("an HTTP client")
    }

    /// The token endpoint's answer to a client_credentials grant with `id` and `secret`:
    /// its status and JSON body (`Null` when the body is not JSON).
    pub async fn client_credentials(&self, id: &str, secret: &str) -> (u16, serde_json::Value) {
        let r = self
            .http()
            .post(self.token_endpoint())
            .basic_auth(id, Some(secret))
            .header("content-type", "application/x-www-form-urlencoded")
            .body("grant_type=client_credentials")
            .send()
            .await
            .expect("the token endpoint answers");
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(serde_json::Value::Null))
    }

    /// Stops the provider (a test of a provider that is down).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.stop();
        }
    }
}

impl Drop for OidcProvider {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let log = self.log();
            let lines: Vec<&str> = log.lines().collect();
            eprintln!(
                "----- oidc-provider log (last 30 lines) -----\n{}",
                lines[lines.len().saturating_sub(30)..].join("\n")
            );
        }
        self.stop();
    }
}
