//! The OpenID provider, as this handler talks to it: RFC 7591 registration with the
//! initial access token, RFC 7592 read, update and delete with each client's own
//! registration access token. Tokens and secrets go only into request headers and the
//! state; nothing here logs them.

use std::time::Duration;

use reqwest::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE};
use reqwest::{Method, StatusCode, Url};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::config::Config;
use super::request::Metadata;
use crate::common::entries::one_line;

/// Largest answer read from the provider: a client's metadata is a few kilobytes.
const MAX_BODY: usize = 256 * 1024;
/// Longest client id, secret or token kept: longer is not a provider's answer.
const MAX_VALUE: usize = 4096;

/// What the handler keeps to manage one client it registered: its only proof of
/// ownership (it never touches a client it has no registration access token for).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registration {
    pub client_id: String,
    pub registration_client_uri: String,
    pub registration_access_token: String,
}

/// A client as the provider answered for it.
#[derive(Debug, Clone)]
pub struct Registered {
    pub registration: Registration,
    /// `None`: the provider kept the secret it had (an update may leave it out).
    pub client_secret: Option<String>,
}

/// Why a call did not succeed.
#[derive(Debug)]
pub enum Failure {
    /// The provider refused this request (a bad redirect URI, an unknown scope): the
    /// entry is refused with this reason, the others go on.
    Refused(String),
    /// The client or its registration access token no longer exists (RFC 7592 answers
    /// 401, some providers 404): forget it, or register anew.
    Gone,
    /// The provider is unreachable or failing: the run fails and nothing is revoked,
    /// unless the provider answers other calls of the run (then only this entry waits).
    Down(anyhow::Error),
    /// The provider refused the initial access token, which every registration carries:
    /// the run fails and nothing is revoked.
    Denied(anyhow::Error),
}

type Result<T> = std::result::Result<T, Failure>;

/// The provider's endpoints and an HTTP client for them.
pub struct Server {
    http: reqwest::Client,
    endpoint: Url,
    initial_token: String,
}

impl Server {
    /// The client and the registration endpoint (from the config or the provider's
    /// discovery document). No request is sent when the endpoint is configured.
    pub async fn connect(config: &Config) -> anyhow::Result<Server> {
        fort_core::tls::install_default_provider();
        let mut builder = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .connect_timeout(config.timeout.min(Duration::from_secs(5)))
            .timeout(config.timeout)
            .user_agent(concat!("fort-handler/", env!("CARGO_PKG_VERSION")));
        if let Some(ca) = &config.ca_file {
            let pem = std::fs::read(ca)
                .map_err(|e| anyhow::anyhow!("ca_file: cannot read {}: {e}", ca.display()))?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem)
                .map_err(|e| anyhow::anyhow!("ca_file {}: {e}", ca.display()))?;
            builder = builder.tls_certs_only(certs);
        }
        let http = builder
            .build()
            .map_err(|e| anyhow::anyhow!("cannot make the HTTP client: {e}"))?;
        let initial_token = config.initial_access_token()?;
        let endpoint = match &config.registration_endpoint {
            Some(e) => Url::parse(e)?,
            None => discover(&http, &config.issuer).await?,
        };
        Ok(Server {
            http,
            endpoint,
            initial_token,
        })
    }

    /// Whether the provider answers at all (its discovery document): after one entry's
    /// call failed without an answer about that entry, this tells a provider that is
    /// down (the run fails) from a failure that was the entry's alone.
    pub async fn answers(&self, config: &Config) -> bool {
        discover(&self.http, &config.issuer).await.is_ok()
    }

    /// RFC 7591 §3.1: registers a new client.
    pub async fn register(&self, metadata: &Metadata) -> Result<Registered> {
        let (status, body) = self
            .call(
                Method::POST,
                self.endpoint.clone(),
                &self.initial_token,
                Some(metadata.to_json()),
            )
            .await?;
        match status {
            StatusCode::CREATED | StatusCode::OK => {
                let registered = self.registered(&body, None)?;
                if registered.client_secret.is_none() {
                    return Err(Failure::Refused(
                        "the provider registered the client without a client secret".into(),
                    ));
                }
                Ok(registered)
            }
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => {
                Err(Failure::Denied(anyhow::anyhow!(
                    "the provider refused the initial access token ({status}: {})",
                    reason(&body)
                )))
            }
            s => Err(refusal(s, &body)),
        }
    }

    /// RFC 7592 §2.2: replaces the client's metadata. Leaving `client_secret` out lets a
    /// provider issue a new one; most keep the old one.
    pub async fn update(&self, r: &Registration, metadata: &Metadata) -> Result<Registered> {
        let mut body = metadata.to_json();
        body["client_id"] = Value::from(r.client_id.clone());
        let url = self.client_uri(r)?;
        let (status, answer) = self
            .call(Method::PUT, url, &r.registration_access_token, Some(body))
            .await?;
        match status {
            StatusCode::OK => self.registered(&answer, Some(r)),
            StatusCode::UNAUTHORIZED | StatusCode::NOT_FOUND => Err(Failure::Gone),
            s => Err(refusal(s, &answer)),
        }
    }

    /// RFC 7592 §2.3: deletes the client.
    pub async fn delete(&self, r: &Registration) -> Result<()> {
        let url = self.client_uri(r)?;
        let (status, body) = self
            .call(Method::DELETE, url, &r.registration_access_token, None)
            .await?;
        match status {
            StatusCode::NO_CONTENT | StatusCode::OK => Ok(()),
            StatusCode::UNAUTHORIZED | StatusCode::NOT_FOUND => Err(Failure::Gone),
            s => Err(refusal(s, &body)),
        }
    }

    /// RFC 7592 §2.1: reads the client's metadata as the provider holds it.
    pub async fn read(&self, r: &Registration) -> Result<Value> {
        let url = self.client_uri(r)?;
        let (status, body) = self
            .call(Method::GET, url, &r.registration_access_token, None)
            .await?;
        match status {
            StatusCode::OK => Ok(body),
            StatusCode::UNAUTHORIZED | StatusCode::NOT_FOUND => Err(Failure::Gone),
            s => Err(refusal(s, &body)),
        }
    }

    /// The client's configuration endpoint, on the registration endpoint's origin: a
    /// registration access token is never sent anywhere else.
    fn client_uri(&self, r: &Registration) -> Result<Url> {
        let url = Url::parse(&r.registration_client_uri)
            .map_err(|e| Failure::Refused(format!("registration_client_uri: {e}")))?;
        if url.origin() != self.endpoint.origin() {
            return Err(Failure::Refused(
                "registration_client_uri is not on the registration endpoint's origin".into(),
            ));
        }
        Ok(url)
    }

    /// Reads a registration answer; `previous` supplies what an update may leave out.
    fn registered(&self, body: &Value, previous: Option<&Registration>) -> Result<Registered> {
        let field = |name: &str| -> Result<Option<String>> {
            match body.get(name) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s))
                    if !s.is_empty()
                        && s.len() <= MAX_VALUE
                        && s.bytes().all(|b| b.is_ascii_graphic()) =>
                {
                    Ok(Some(s.clone()))
                }
                Some(_) => Err(Failure::Refused(format!(
                    "the provider's answer has an unusable {name}"
                ))),
            }
        };
        let missing = |name: &str| {
            Failure::Refused(format!(
                "the provider's answer has no {name}; the client cannot be managed"
            ))
        };
        let client_id = field("client_id")?
            .or_else(|| previous.map(|p| p.client_id.clone()))
            .ok_or_else(|| missing("client_id"))?;
        if previous.is_some_and(|p| p.client_id != client_id) {
            return Err(Failure::Refused(
                "the provider changed the client_id".into(),
            ));
        }
        let registration = Registration {
            registration_client_uri: field("registration_client_uri")?
                .or_else(|| previous.map(|p| p.registration_client_uri.clone()))
                .ok_or_else(|| missing("registration_client_uri"))?,
            registration_access_token: field("registration_access_token")?
                .or_else(|| previous.map(|p| p.registration_access_token.clone()))
                .ok_or_else(|| missing("registration_access_token"))?,
            client_id,
        };
        self.client_uri(&registration)?;
        Ok(Registered {
            registration,
            client_secret: field("client_secret")?,
        })
    }

    /// One request with a bearer token; the answer's status and JSON body (`null` when
    /// empty or not JSON). Transport failures and 5xx answers are `Down`.
    async fn call(
        &self,
        method: Method,
        url: Url,
        token: &str,
        body: Option<Value>,
    ) -> Result<(StatusCode, Value)> {
        let shown = format!("{method} {}", without_query(&url));
        let mut request = self
            .http
            .request(method, url)
            .header(AUTHORIZATION, format!("Bearer {token}"))
            .header(ACCEPT, "application/json");
        if let Some(b) = body {
            request = request
                .header(CONTENT_TYPE, "application/json")
                .body(b.to_string());
        }
        let response = request
            .send()
            .await
            .map_err(|e| Failure::Down(anyhow::anyhow!("{shown}: {}", error_chain(&e))))?;
        let status = response.status();
        let body = read_json(response)
            .await
            .map_err(|e| Failure::Down(anyhow::anyhow!("{shown}: {e}")))?;
        if status.is_server_error() {
            return Err(Failure::Down(anyhow::anyhow!(
                "{shown}: the provider answered {status}: {}",
                reason(&body)
            )));
        }
        Ok((status, body))
    }
}

/// The discovery document's `registration_endpoint`, after checking that it is the
/// issuer's own document (OpenID Connect Discovery §4.3).
async fn discover(http: &reqwest::Client, issuer: &str) -> anyhow::Result<Url> {
    let url = format!(
        "{}/.well-known/openid-configuration",
        issuer.trim_end_matches('/')
    );
    let response = http
        .get(&url)
        .header(ACCEPT, "application/json")
        .send()
        .await
        .map_err(|e| anyhow::anyhow!("GET {url}: {}", error_chain(&e)))?;
    let status = response.status();
    if !status.is_success() {
        anyhow::bail!("GET {url}: the provider answered {status}");
    }
    let doc = read_json(response)
        .await
        .map_err(|e| anyhow::anyhow!("GET {url}: {e}"))?;
    if doc.get("issuer").and_then(Value::as_str) != Some(issuer) {
        anyhow::bail!("{url} names another issuer than {issuer}");
    }
    let endpoint = doc
        .get("registration_endpoint")
        .and_then(Value::as_str)
        .ok_or_else(|| {
            anyhow::anyhow!("{url} has no registration_endpoint: is dynamic registration enabled?")
        })?;
    let endpoint =
        Url::parse(endpoint).map_err(|e| anyhow::anyhow!("{url}: registration_endpoint: {e}"))?;
    let issuer_url = Url::parse(issuer)?;
    if endpoint.scheme() != issuer_url.scheme() {
        anyhow::bail!("{url}: the registration endpoint's scheme is not the issuer's");
    }
    Ok(endpoint)
}

/// The body as JSON, at most `MAX_BODY` bytes; `null` when empty or not JSON.
async fn read_json(mut response: reqwest::Response) -> anyhow::Result<Value> {
    let mut bytes = Vec::new();
    while let Some(chunk) = response
        .chunk()
        .await
        .map_err(|e| anyhow::anyhow!("reading the answer: {}", error_chain(&e)))?
    {
        if bytes.len().saturating_add(chunk.len()) > MAX_BODY {
            anyhow::bail!("the answer is larger than {MAX_BODY} bytes");
        }
        bytes.extend_from_slice(&chunk);
    }
    Ok(serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

/// A 4xx answer as a refusal of the entry, with the provider's reason.
fn refusal(status: StatusCode, body: &Value) -> Failure {
    Failure::Refused(format!("the provider answered {status}: {}", reason(body)))
}

/// RFC 7591 §3.2.2's `error` and `error_description`, one bounded printable line.
fn reason(body: &Value) -> String {
    let text = |k: &str| body.get(k).and_then(Value::as_str).unwrap_or("");
    let (error, description) = (text("error"), text("error_description"));
    let reason = match (error.is_empty(), description.is_empty()) {
        (true, true) => "no reason given".to_owned(),
        (false, true) => error.to_owned(),
        (true, false) => description.to_owned(),
        (false, false) => format!("{error}: {description}"),
    };
    one_line(&reason.chars().take(200).collect::<String>())
}

fn without_query(url: &Url) -> String {
    let mut u = url.clone();
    u.set_query(None);
    u.to_string()
}

/// An error with its causes (reqwest's own message hides "connection refused").
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}
