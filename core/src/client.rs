//! The signed HTTP client every fort program uses to talk to an agent: it signs the
//! request (§3), never follows redirects, ignores proxy variables, bounds every phase
//! with a timeout, caps the body it reads, and verifies the signed response (§4).

use std::time::Duration;

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
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            connect_timeout: Duration::from_secs(5),
            read_timeout: Duration::from_secs(30),
            total_timeout: Duration::from_secs(60),
            max_response_bytes: 16 * 1024 * 1024,
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
}

impl ClientError {
    /// A short class name for logs and metrics.
    pub fn class(&self) -> &'static str {
        match self {
            ClientError::Connect { .. } => "refused",
            ClientError::Timeout { .. } => "timeout",
            ClientError::Transport { .. } => "transport",
            ClientError::TooLarge { .. } => "too_large",
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
    /// Base URL, `http://10.0.0.5:7770`.
    pub address: &'a str,
    /// The receiving host's keys, to verify its response.
    pub keys: &'a [PublicKey],
}

/// A reusable signing client: one connection pool, one identity.
#[derive(Clone)]
pub struct SignedClient {
    http: reqwest::Client,
    origin: String,
    signer: Signer,
    max_response_bytes: usize,
}

/// 16 random bytes, lower-case hex.
pub fn new_nonce() -> String {
    let mut b = [0u8; 16];
    rand::rngs::OsRng.fill_bytes(&mut b);
    hex::encode(b)
}

impl SignedClient {
    pub fn new(origin: &str, signer: Signer, options: &ClientOptions) -> SignedClient {
        let http = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .connect_timeout(options.connect_timeout)
            .read_timeout(options.read_timeout)
            .timeout(options.total_timeout)
            .pool_idle_timeout(Duration::from_secs(30))
            // A burst opens many connections; keeping them all idle costs the other side
            // (a provider with 50 consumers) hundreds of sockets and their buffers.
            .pool_max_idle_per_host(2)
            .user_agent(concat!("fort/", env!("CARGO_PKG_VERSION")))
            .build()
            .expect("HTTP client builds");
        SignedClient {
            http,
            origin: origin.to_owned(),
            signer,
            max_response_bytes: options.max_response_bytes,
        }
    }

    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// Signs and sends `POST <path>` with `body`; reads and verifies the reply.
    pub async fn post(
        &self,
        target: &Target<'_>,
        path: &str,
        body: Vec<u8>,
    ) -> Result<Reply, ClientError> {
        let nonce = new_nonce();
        let timestamp = unix_now().to_string();
        let canonical = request_bytes(target.name, path, &self.origin, &timestamp, &nonce, &body);
        let signature = self.signer.sign(&canonical);
        let url = format!("{}{}", target.address.trim_end_matches('/'), path);
        let sent = self
            .http
            .post(&url)
            .header(H_ORIGIN, &self.origin)
            .header(H_TIMESTAMP, &timestamp)
            .header(H_NONCE, &nonce)
            .header(H_SIGNATURE, signature)
            .header(http::header::CONTENT_TYPE, "application/json")
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
        let body = read_capped(sent, &url, self.max_response_bytes).await?;
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

fn root_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut cur = e;
    while let Some(next) = cur.source() {
        cur = next;
    }
    cur.to_string()
}
