//! The signed HTTP client every fort program uses to talk to an agent: it signs the
//! request (§3), speaks TLS 1.3 pinned to the target's keys in hosts.json (§11.1), never
//! follows redirects, ignores proxy variables, bounds every phase with a timeout, caps the
//! body it reads, and verifies the signed response (§4).
//!
//! Connections are kept alive per peer (a bounded pool per peer, bounded number of peers),
//! so steady traffic pays no handshake. Each peer gets its own pool because the pin is
//! per peer: a connection made for one host's keys is never reused for another host.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use parking_lot::Mutex;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use rand::RngCore;
use ssh_key::PublicKey;

use crate::canonical::{request_bytes, response_bytes};
use crate::sign::{verify, Signer, VerifyError};
use crate::wire::{unix_now, H_NONCE, H_ORIGIN, H_SERVER_TIME, H_SIGNATURE, H_TIMESTAMP};

/// Timeouts and limits of a [`SignedClient`].
#[derive(Debug, Clone)]
pub struct ClientOptions {
    pub connect_timeout: Duration,
    pub read_timeout: Duration,
    pub total_timeout: Duration,
    /// Response bodies longer than this are an error, not a truncation.
    pub max_response_bytes: usize,
    /// Idle keep-alive connections kept per peer. A provider with hundreds of consumers
    /// keeps a few to each, not hundreds of sockets and their buffers.
    pub max_idle_per_peer: usize,
    /// Peers whose connection pools are kept; the least recently used go beyond this.
    pub max_peers: usize,
    /// Accept `http://` addresses (`plaintext = true`: an overlay network encrypts).
    pub allow_plaintext: bool,
    /// Source address of outgoing connections (the agent's own listen address, so a
    /// peer counts this host's connections under its address).
    pub local_address: Option<IpAddr>,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            connect_timeout: Duration::from_secs(5),
            read_timeout: Duration::from_secs(30),
            total_timeout: Duration::from_secs(60),
            max_response_bytes: 16 * 1024 * 1024,
            max_idle_per_peer: 4,
            max_peers: 1024,
            allow_plaintext: false,
            local_address: None,
        }
    }
}

/// Why a call produced no usable reply.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot connect to {url}: {detail}")]
    Connect { url: String, detail: String },
    #[error("{url}: timed out")]
    Timeout { url: String },
    #[error("{url}: {detail}")]
    Transport { url: String, detail: String },
    #[error("{url}: response body over {limit} bytes")]
    TooLarge { url: String, limit: usize },
    /// The TLS handshake failed: most often the server's key is not pinned for the host.
    #[error("{url}: TLS: {detail}")]
    Tls { url: String, detail: String },
    #[error(
        "{url}: plain http is refused (set plaintext = true only on an encrypted overlay network)"
    )]
    Plaintext { url: String },
    #[error("{url}: address must be https://HOST:PORT")]
    BadAddress { url: String },
}

impl ClientError {
    /// A short class name for logs and metrics.
    pub fn class(&self) -> &'static str {
        match self {
            ClientError::Connect { .. } => "refused",
            ClientError::Timeout { .. } => "timeout",
            ClientError::Transport { .. } => "transport",
            ClientError::TooLarge { .. } => "too_large",
            ClientError::Tls { .. } => "tls",
            ClientError::Plaintext { .. } => "plaintext_refused",
            ClientError::BadAddress { .. } => "bad_address",
        }
    }
}

/// What the response signature check concluded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResponseAuth {
    Verified,
    /// No `X-Fort-Signature` (e.g. a `401`, or something that is not a fort agent).
    Unsigned,
    /// `X-Fort-Origin` names someone other than the host we called.
    WrongOrigin(String),
    Invalid(VerifyError),
}

/// A reply read in full.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub body: Bytes,
    pub auth: ResponseAuth,
    pub content_type: Option<String>,
    pub location: Option<String>,
    /// `X-Fort-Server-Time` on a clock-skew `401`.
    pub server_time: Option<u64>,
    /// `Retry-After` seconds on a `429` or `503`: when to come back.
    pub retry_after: Option<u64>,
}

impl Reply {
    pub fn verified(&self) -> bool {
        self.auth == ResponseAuth::Verified
    }
    pub fn is_success(&self) -> bool {
        (200..300).contains(&self.status)
    }
}

/// Who is calling whom.
pub struct Target<'a> {
    /// The receiving host's name in hosts.json (the signed target line).
    pub name: &'a str,
    /// Base URL, `https://10.0.0.5:7770`.
    pub address: &'a str,
    /// The receiving host's keys, to verify its response.
    pub keys: &'a [PublicKey],
}

/// A reusable signing client: one identity, a pinned connection pool per peer.
#[derive(Clone)]
pub struct SignedClient {
    inner: Arc<ClientInner>,
}

struct ClientInner {
    origin: String,
    signer: Signer,
    options: ClientOptions,
    peers: Mutex<HashMap<PeerKey, PeerPool>>,
}

/// A pool is valid for one host name, address and key set; a reload that changes any of
/// them gets a new pool, so an old pin never serves a new configuration.
#[derive(Clone, PartialEq, Eq, Hash)]
struct PeerKey {
    name: String,
    address: String,
    keys: Vec<[u8; 32]>,
}

struct PeerPool {
    http: reqwest::Client,
    last_used: Instant,
}

/// 16 random bytes, lower-case hex.
pub fn new_nonce() -> String {
    let mut b = [0u8; 16];
    rand::rngs::OsRng.fill_bytes(&mut b);
    hex::encode(b)
}

impl SignedClient {
    pub fn new(origin: &str, signer: Signer, options: &ClientOptions) -> SignedClient {
        crate::tls::install_default_provider();
        SignedClient {
            inner: Arc::new(ClientInner {
                origin: origin.to_owned(),
                signer,
                options: options.clone(),
                peers: Mutex::new(HashMap::new()),
            }),
        }
    }

    pub fn origin(&self) -> &str {
        &self.inner.origin
    }

    /// Peers with a connection pool now (for tests and status).
    pub fn pooled_peers(&self) -> usize {
        self.inner.peers.lock().len()
    }

    fn builder(&self) -> reqwest::ClientBuilder {
        let o = &self.inner.options;
        reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .connect_timeout(o.connect_timeout)
            .read_timeout(o.read_timeout)
            .timeout(o.total_timeout)
            // Below the agents' header-read timeout (10 s by default), which also closes
            // idle connections: a request must not race the server closing its connection.
            .pool_idle_timeout(Duration::from_secs(5))
            .pool_max_idle_per_host(o.max_idle_per_peer)
            .tcp_nodelay(true)
            .local_address(o.local_address)
            .user_agent(concat!("fort/", env!("CARGO_PKG_VERSION")))
    }

    /// The pool for `target`, created on first use.
    fn pool(&self, target: &Target<'_>, url: &str) -> Result<reqwest::Client, ClientError> {
        let tls = if target.address.starts_with("https://") {
            true
        } else if target.address.starts_with("http://") {
            if !self.inner.options.allow_plaintext {
                return Err(ClientError::Plaintext {
                    url: url.to_owned(),
                });
            }
            false
        } else {
            return Err(ClientError::BadAddress {
                url: url.to_owned(),
            });
        };
        let key = PeerKey {
            name: target.name.to_owned(),
            address: target.address.to_owned(),
            keys: target
                .keys
                .iter()
                .filter_map(|k| k.key_data().ed25519().map(|e| e.0))
                .collect(),
        };
        let mut peers = self.inner.peers.lock();
        if let Some(p) = peers.get_mut(&key) {
            p.last_used = Instant::now();
            return Ok(p.http.clone());
        }
        if peers.len() >= self.inner.options.max_peers.max(1) {
            if let Some(oldest) = peers
                .iter()
                .min_by_key(|(_, p)| p.last_used)
                .map(|(k, _)| k.clone())
            {
                peers.remove(&oldest);
            }
        }
        let builder = self.builder();
        let builder = if tls {
            builder
                .tls_backend_preconfigured(crate::tls::client_config(target.name, target.keys))
                .https_only(true)
        } else {
            builder
        };
        let http = builder.build().map_err(|e| ClientError::Transport {
            url: url.to_owned(),
            detail: root_cause(&e),
        })?;
        peers.insert(
            key,
            PeerPool {
                http: http.clone(),
                last_used: Instant::now(),
            },
        );
        Ok(http)
    }

    /// Signs and sends `POST <path>` with `body`; reads and verifies the reply.
    pub async fn post(
        &self,
        target: &Target<'_>,
        path: &str,
        body: Vec<u8>,
    ) -> Result<Reply, ClientError> {
        self.post_with(target, path, body, &[]).await
    }

    /// [`SignedClient::post`] with headers of its own (announcements the signature does
    /// not cover, such as a provider's latest audit checkpoint).
    pub async fn post_with(
        &self,
        target: &Target<'_>,
        path: &str,
        body: Vec<u8>,
        extra: &[(&'static str, String)],
    ) -> Result<Reply, ClientError> {
        let nonce = new_nonce();
        let timestamp = unix_now().to_string();
        let origin = &self.inner.origin;
        let canonical = request_bytes(target.name, path, origin, &timestamp, &nonce, &body);
        let signature = self.inner.signer.sign(&canonical);
        let url = format!("{}{}", target.address.trim_end_matches('/'), path);
        let http = self.pool(target, &url)?;
        let sent = http
            .post(&url)
            .header(H_ORIGIN, origin)
            .header(H_TIMESTAMP, &timestamp)
            .header(H_NONCE, &nonce)
            .header(H_SIGNATURE, signature)
            .header(crate::compat::H_PROTOCOL, crate::compat::PROTOCOL)
            .header(crate::compat::H_RELEASE, crate::compat::RELEASE)
            .header(http::header::CONTENT_TYPE, "application/json");
        let sent = extra
            .iter()
            .fold(sent, |r, (name, value)| r.header(*name, value))
            .body(body)
            .send()
            .await
            .map_err(|e| classify(&url, e))?;
        let status = sent.status().as_u16();
        let header = |name: &str| {
            sent.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        let responder = header(H_ORIGIN);
        let response_signature = header(H_SIGNATURE);
        let content_type = header("content-type");
        let location = header("location");
        let server_time = header(H_SERVER_TIME).and_then(|v| v.parse().ok());
        let retry_after = header("retry-after").and_then(|v| v.parse().ok());
        let body = read_capped(sent, &url, self.inner.options.max_response_bytes).await?;
        let auth = match (responder, response_signature) {
            (Some(who), _) if who != target.name => ResponseAuth::WrongOrigin(who),
            (Some(_), Some(sig)) => {
                let msg = response_bytes(target.name, &nonce, status, &body);
                match verify(&sig, target.keys, &msg) {
                    Ok(()) => ResponseAuth::Verified,
                    Err(e) => ResponseAuth::Invalid(e),
                }
            }
            _ => ResponseAuth::Unsigned,
        };
        Ok(Reply {
            status,
            body,
            auth,
            content_type,
            location,
            server_time,
            retry_after,
        })
    }
}

async fn read_capped(
    mut response: reqwest::Response,
    url: &str,
    limit: usize,
) -> Result<Bytes, ClientError> {
    let mut buf = BytesMut::new();
    while let Some(chunk) = response.chunk().await.map_err(|e| classify(url, e))? {
        if buf.len() + chunk.len() > limit {
            return Err(ClientError::TooLarge {
                url: url.to_owned(),
                limit,
            });
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(buf.freeze())
}

fn classify(url: &str, e: reqwest::Error) -> ClientError {
    let url = url.to_owned();
    if let Some(tls) = find_source::<rustls::Error>(&e) {
        let detail = match tls {
            // The pinning verifier's own words, without rustls's "unexpected error" prefix.
            rustls::Error::General(message) => message.clone(),
            other => other.to_string(),
        };
        return ClientError::Tls { url, detail };
    }
    if e.is_timeout() {
        ClientError::Timeout { url }
    } else if e.is_connect() {
        ClientError::Connect {
            url,
            detail: root_cause(&e),
        }
    } else {
        ClientError::Transport {
            url,
            detail: root_cause(&e),
        }
    }
}

/// The first error of type `T` in `e`'s source chain (a TLS failure is buried under
/// reqwest's and hyper's own errors).
fn find_source<'a, T: std::error::Error + 'static>(
    e: &'a (dyn std::error::Error + 'static),
) -> Option<&'a T> {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(found) = err.downcast_ref::<T>() {
            return Some(found);
        }
        // An io::Error's `source()` skips the error it wraps; look inside it first.
        if let Some(inner) = err
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
        {
            if let Some(found) = find_source::<T>(inner) {
                return Some(found);
            }
        }
        cur = err.source();
    }
    None
}

fn root_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut cur = e;
    while let Some(next) = cur.source() {
        cur = next;
    }
    cur.to_string()
}
