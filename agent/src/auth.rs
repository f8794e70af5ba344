//! The request pipeline of docs/protocol.md §3, in its order: transport limits, method and
//! path, headers, clock, origin, signature, nonce — and only then the endpoint. The
//! first failure ends the request and no handler runs. Every response to a request whose
//! signature verified is itself signed (§4).
//!
//! This is one function rather than a tower middleware stack because the order is the
//! contract: a reader can check it top to bottom against the spec.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::Response;
use bytes::Bytes;
use fort_core::canonical::{request_bytes, response_bytes};
use fort_core::names::{is_capability_name, NeedKey};
use fort_core::schema::PeerKind;
use fort_core::sign::{verify_with_key, MAX_SIGNATURE_LEN};
use fort_core::wire::unix_now;
use http::{HeaderMap, HeaderValue, Method, StatusCode};
use http_body_util::BodyExt;

use crate::app::App;
use crate::error::{ApiError, Reply};
use crate::limits::ConnectionTrust;
use crate::nonce::NonceCheck;
use crate::server::PeerAddr;

/// A caller whose signature verified.
#[derive(Debug, Clone)]
pub struct Caller {
    pub origin: String,
    pub kind: PeerKind,
    /// The key its signature verified with (`None`: the local admin socket).
    pub key: Option<ssh_key::PublicKey>,
}

impl Caller {
    /// The caller's key as `ssh-keygen -l` prints it, for the audit trail.
    pub fn fingerprint(&self) -> Option<String> {
        self.key.as_ref().map(fort_core::audit::fingerprint)
    }
}

/// Where a request is going (§2).
#[derive(Debug, Clone, PartialEq)]
pub enum Route {
    Capability(String),
    Callback(NeedKey),
    NeedsList,
    /// Batched requests to one capability (§11.8).
    CapabilityBatch(String),
    /// Batched callbacks (§11.8).
    CallbackBatch,
}

/// Strict path parsing: no decoding, no normalisation, nothing ambiguous reaches routing.
pub fn parse_route(path: &str) -> Result<Route, ApiError> {
    if path.contains('%') || path.contains("..") || path.contains("//") {
        return Err(ApiError::BadRequest("path must be plain".into()));
    }
    let not_found = || ApiError::NotFound(format!("no such path {path}"));
    if path == "/agent/needs" {
        return Ok(Route::NeedsList);
    }
    if path == fort_core::wire::CALLBACKS_PATH {
        return Ok(Route::CallbackBatch);
    }
    if let Some(name) = path
        .strip_prefix("/agent/capabilities/")
        .and_then(|rest| rest.strip_suffix(fort_core::wire::BATCH_SUFFIX))
    {
        return is_capability_name(name)
            .then(|| Route::CapabilityBatch(name.to_owned()))
            .ok_or_else(not_found);
    }
    if let Some(name) = path.strip_prefix("/agent/capabilities/") {
        return is_capability_name(name)
            .then(|| Route::Capability(name.to_owned()))
            .ok_or_else(not_found);
    }
    if let Some(rest) = path.strip_prefix("/agent/needs/") {
        return NeedKey::parse(rest)
            .map(Route::Callback)
            .ok_or_else(not_found);
    }
    Err(not_found())
}

/// The protocol's header names, parsed once: a name given as text is parsed again on
/// every lookup and insert, on every request.
mod header {
    use http::HeaderName;
    pub const ORIGIN: HeaderName = HeaderName::from_static(fort_core::wire::H_ORIGIN);
    pub const TIMESTAMP: HeaderName = HeaderName::from_static(fort_core::wire::H_TIMESTAMP);
    pub const NONCE: HeaderName = HeaderName::from_static(fort_core::wire::H_NONCE);
    pub const SIGNATURE: HeaderName = HeaderName::from_static(fort_core::wire::H_SIGNATURE);
    pub const SERVER_TIME: HeaderName = HeaderName::from_static(fort_core::wire::H_SERVER_TIME);
    pub const PROTOCOL: HeaderName = HeaderName::from_static(fort_core::compat::H_PROTOCOL);
    pub const RELEASE: HeaderName = HeaderName::from_static(fort_core::compat::H_RELEASE);
}

fn single(headers: &HeaderMap, name: impl http::header::AsHeaderName) -> Option<&str> {
    let mut values = headers.get_all(name).iter();
    let first = values.next()?;
    if values.next().is_some() {
        return None;
    }
    first.to_str().ok()
}

fn is_timestamp(s: &str) -> bool {
    let b = s.as_bytes();
    (1..=12).contains(&b.len()) && b[0] != b'0' && b.iter().all(u8::is_ascii_digit)
}

fn is_nonce(s: &str) -> bool {
    s.len() == 32
        && s.bytes()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
}

fn plain(reply: Reply) -> Response {
    let mut resp = Response::new(Body::from(reply.body));
    *resp.status_mut() = reply.status;
    // Every reply says what this agent speaks (§11.12), refusals included.
    resp.headers_mut().insert(
        header::PROTOCOL,
        HeaderValue::from_static(fort_core::compat::PROTOCOL),
    );
    resp.headers_mut().insert(
        header::RELEASE,
        HeaderValue::from_static(fort_core::compat::RELEASE),
    );
    if reply.json {
        resp.headers_mut().insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
    }
    if let Some(after) = reply.retry_after {
        resp.headers_mut().insert(
            http::header::RETRY_AFTER,
            HeaderValue::from_str(&after.to_string()).expect("digits"),
        );
    }
    resp
}

/// Refuses a request before its signature verified: unsigned reply; the reason is counted
/// exactly and logged in aggregate (strangers can send these at will).
fn refuse(app: &App, peer: Option<IpAddr>, err: ApiError, reason: &'static str) -> Response {
    app.metrics.auth_failures.inc(&[("reason", reason)]);
    let from = peer.map_or_else(|| "?".to_owned(), |ip| ip.to_string());
    app.quiet.info(
        reason,
        &format!("request from {from} refused ({reason}): {err}"),
    );
    plain(err.reply())
}

/// A timestamp outside the window, before or after the body: the reply tells the caller
/// this host's time, so it can tell a skewed clock from a slow link.
fn refuse_clock(app: &App, peer: Option<IpAddr>, message: String, now: u64) -> Response {
    let mut resp = refuse(app, peer, ApiError::Unauthorized(message), "clock");
    resp.headers_mut().insert(
        header::SERVER_TIME,
        HeaderValue::from_str(&now.to_string()).expect("digits"),
    );
    resp
}

/// How long an authenticated request waits for a slot before it is told to come back.
const SLOT_WAIT: Duration = Duration::from_secs(5);

enum BodyError {
    Timeout,
    TooLarge,
    /// The unverified-body budget has no room for the next bytes.
    Budget,
    Broken(String),
}

/// Reads a body frame by frame: within `limit`, by `timeout`, each chunk paid for from
/// `reservation` (when the connection has not proven itself) as it arrives.
async fn read_body(
    mut body: Body,
    limit: usize,
    timeout: Duration,
    mut reservation: Option<&mut crate::limits::BodyReservation>,
) -> Result<Bytes, BodyError> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut buf = bytes::BytesMut::new();
    loop {
        let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) => return Err(BodyError::Timeout),
            Ok(None) => return Ok(buf.freeze()),
            Ok(Some(Err(e))) => return Err(BodyError::Broken(e.to_string())),
            Ok(Some(Ok(frame))) => frame,
        };
        let Some(data) = frame.data_ref() else {
            continue;
        };
        if buf.len() + data.len() > limit {
            return Err(BodyError::TooLarge);
        }
        if let Some(r) = reservation.as_deref_mut() {
            if !r.grow(data.len()) {
                return Err(BodyError::Budget);
            }
        }
        buf.extend_from_slice(data);
    }
}

pub async fn dispatch(State(app): State<Arc<App>>, req: Request) -> Response {
    let peer = req.extensions().get::<PeerAddr>().map(|p| p.0.ip());
    let trust = req.extensions().get::<ConnectionTrust>().cloned();
    // 1. Transport limits, from the head alone: the body is not read for a refusal.
    let limit = app.config.body_limit;
    let declared = req
        .headers()
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return refuse(&app, peer, ApiError::TooLarge(limit), "too_large");
    }

    // 2. Method and path, on the raw path as sent.
    let path = req.uri().path().to_owned();
    let has_query = req
        .uri()
        .path_and_query()
        .is_some_and(|pq| pq.as_str().contains('?'));
    if req.uri().query().is_some() || has_query {
        return refuse(
            &app,
            peer,
            ApiError::BadRequest("no query string".into()),
            "bad_path",
        );
    }
    let route = match parse_route(&path) {
        Ok(r) => r,
        Err(e) => return refuse(&app, peer, e, "bad_path"),
    };
    if req.method() != Method::POST {
        return refuse(&app, peer, ApiError::MethodNotAllowed, "method");
    }

    // 2′. A peer of a later protocol major signs other bytes: say so instead of a 401.
    if let Some(major) = single(req.headers(), header::PROTOCOL)
        .and_then(fort_core::compat::parse_protocol)
        .map(|(major, _)| major)
        .filter(|m| *m != fort_core::compat::PROTOCOL_MAJOR)
    {
        return refuse(
            &app,
            peer,
            ApiError::UnsupportedProtocol(format!(
                "this agent speaks fort protocol {} (fort {}); the request announced protocol {major}.x",
                fort_core::compat::PROTOCOL,
                fort_core::compat::RELEASE
            )),
            "protocol",
        );
    }

    // 3. Headers: present, single, well-formed, untrimmed.
    let headers = req.headers();
    let (Some(origin), Some(timestamp), Some(nonce), Some(signature)) = (
        single(headers, header::ORIGIN),
        single(headers, header::TIMESTAMP),
        single(headers, header::NONCE),
        single(headers, header::SIGNATURE),
    ) else {
        return refuse(
            &app,
            peer,
            ApiError::Unauthorized("missing or repeated header".into()),
            "headers",
        );
    };
    if !is_timestamp(timestamp)
        || !is_nonce(nonce)
        || signature.is_empty()
        || signature.len() > MAX_SIGNATURE_LEN
    {
        return refuse(
            &app,
            peer,
            ApiError::Unauthorized("malformed header".into()),
            "headers",
        );
    }
    let (origin, timestamp_text, nonce, signature) = (
        origin.to_owned(),
        timestamp.to_owned(),
        nonce.to_owned(),
        signature.to_owned(),
    );
    // A provider's latest audit checkpoint, which its callbacks carry (§12.3a); bounded,
    // and looked at only once the callback's signature verified.
    let checkpoint = matches!(route, Route::Callback(_) | Route::CallbackBatch)
        .then(|| single(headers, fort_core::audit::CHECKPOINT_HEADER))
        .flatten()
        .filter(|v| v.len() <= fort_core::audit::CHECKPOINT_HEADER_MAX)
        .map(str::to_owned);

    // 4. Clock.
    let now = unix_now();
    let timestamp: u64 = timestamp_text.parse().expect("checked digits");
    if now.abs_diff(timestamp) > app.config.clock_skew.as_secs() {
        return refuse_clock(
            &app,
            peer,
            format!("timestamp {timestamp} vs now {now}"),
            now,
        );
    }

    // 5. Origin. An unknown one is refused only once its body is in, exactly when and how
    // a known one with a bad signature would be: answering faster would tell strangers
    // which names exist.
    // The configuration as loaded now is held for this request (a reload meanwhile
    // swaps in another for the next): its keys are read where they are, not copied.
    let loaded = app.loaded.load_full();
    let known = loaded.registry.get(&origin).map(|p| (&p.keys, p.kind));

    // The body, within the limit and a deadline. Until the signature is checked it is
    // paid for from the peer address's share of the memory for unverified bodies, byte by
    // byte as it arrives: a stranger holds what it actually sent, and holds no slot of
    // the authenticated callers.
    let mut reservation = trust.as_ref().map(ConnectionTrust::body);
    let body = match read_body(
        req.into_body(),
        limit,
        app.config.body_read_timeout,
        reservation.as_mut(),
    )
    .await
    {
        Ok(body) => body,
        Err(BodyError::Timeout) => {
            return refuse(
                &app,
                peer,
                ApiError::Timeout("body not received in time".into()),
                "body_timeout",
            )
        }
        Err(BodyError::TooLarge) => {
            return refuse(&app, peer, ApiError::TooLarge(limit), "too_large")
        }
        Err(BodyError::Budget) => {
            return refuse(
                &app,
                peer,
                ApiError::Overloaded("too many unverified request bodies in flight".into(), 1),
                "unverified_bodies",
            )
        }
        Err(BodyError::Broken(e)) => {
            return refuse(
                &app,
                peer,
                ApiError::BadRequest(format!("body: {e}")),
                "body",
            )
        }
    };
    let Some((keys, kind)) = known else {
        return refuse(
            &app,
            peer,
            ApiError::Unauthorized(format!("unknown origin {origin:?}")),
            "unknown_origin",
        );
    };
    // The clock again, after the body: a request whose window closed while its body was
    // in transit must not reach the nonce store, which forgets nonces past the window.
    let now = unix_now();
    if now.abs_diff(timestamp) > app.config.clock_skew.as_secs() {
        return refuse_clock(
            &app,
            peer,
            format!("timestamp {timestamp} vs now {now} after the body"),
            now,
        );
    }

    // 6. Signature over the bytes this host builds itself.
    let canonical = request_bytes(
        &app.config.host,
        &path,
        &origin,
        &timestamp_text,
        &nonce,
        &body,
    );
    let key = match verify_with_key(&signature, keys, &canonical) {
        Ok(key) => key.clone(),
        Err(e) => {
            return refuse(
                &app,
                peer,
                ApiError::Unauthorized(format!("{origin}: {e}")),
                "signature",
            );
        }
    };
    drop(reservation);
    if let Some(trust) = &trust {
        trust.verified();
    }
    let caller = Caller {
        origin: origin.clone(),
        kind,
        key: Some(key),
    };
    app.served
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);

    // From here on every reply is signed. Authenticated work waits a little for a slot
    // rather than being shed at once: these are callers the agent must serve anyway. The
    // origin's own share is taken first, so one origin (a busy peer, a stolen key) can
    // hold at most its share of the slots and the others still get theirs.
    let slots = async {
        let share = app.origin_slots(&origin).acquire_owned().await.ok()?;
        let global = app.limiter.clone().acquire_owned().await.ok()?;
        Some((share, global))
    };
    let outcome = match tokio::time::timeout(SLOT_WAIT, slots).await {
        Ok(Some(permit)) => {
            // 7. Replay.
            let outcome = match app.nonces.check_and_record(&origin, &nonce, timestamp, now) {
                NonceCheck::Fresh => {
                    // Only hosts provide: a principal's header is not a checkpoint.
                    if let (Some(value), PeerKind::Host) = (&checkpoint, kind) {
                        app.audit.witness(&origin, keys, value);
                    }
                    crate::routes::handle(&app, &caller, route.clone(), body).await
                }
                NonceCheck::Replay => {
                    app.metrics.auth_failures.inc(&[("reason", "replay")]);
                    Err(ApiError::Unauthorized(format!(
                        "{origin}: replayed nonce {nonce}"
                    )))
                }
                NonceCheck::OriginFull(after) => {
                    app.metrics.auth_failures.inc(&[("reason", "nonce_quota")]);
                    Err(ApiError::TooMany(
                        format!("{origin} holds its quota of unexpired nonces"),
                        after,
                    ))
                }
                NonceCheck::Full(after) => {
                    app.metrics
                        .auth_failures
                        .inc(&[("reason", "nonce_store_full")]);
                    Err(ApiError::Overloaded("nonce store full".into(), after))
                }
            };
            drop(permit);
            outcome
        }
        _ => {
            app.metrics.auth_failures.inc(&[("reason", "overload")]);
            Err(ApiError::Overloaded(
                "too many requests in flight".into(),
                1 + rand::random::<u64>() % 3,
            ))
        }
    };
    let reply = match outcome {
        Ok(reply) => reply,
        Err(e) => {
            let status = e.status();
            let class = match status.as_u16() {
                500 => "failed_500",
                401 => "refused_401",
                403 => "refused_403",
                404 => "refused_404",
                429 => "refused_429",
                503 => "refused_503",
                _ => "refused_other",
            };
            let message = format!("{origin} {path}: {e}");
            if status == StatusCode::INTERNAL_SERVER_ERROR {
                app.quiet.warn(class, &message);
            } else {
                app.quiet.info(class, &message);
            }
            e.reply()
        }
    };
    // Only names this agent serves become metric labels: a caller posting random names
    // must not grow the metrics without bound.
    let label = match &route {
        Route::Capability(c)
            if crate::builtins::Builtin::from_name(c).is_some()
                || app.loaded.load().capabilities.contains_key(c) =>
        {
            c.as_str()
        }
        Route::Capability(_) => "unknown",
        Route::Callback(_) => "callback",
        Route::NeedsList => "needs",
        Route::CapabilityBatch(_) => "batch",
        Route::CallbackBatch => "callbacks",
    };
    app.metrics
        .requests
        .inc(&[("endpoint", label), ("status", reply.status.as_str())]);
    tracing::debug!(origin = %origin, path = %path, nonce = %nonce, status = reply.status.as_u16(), "request served");
    sign_reply(&app, &nonce, reply)
}

fn sign_reply(app: &App, nonce: &str, reply: Reply) -> Response {
    let msg = response_bytes(&app.config.host, nonce, reply.status.as_u16(), &reply.body);
    let signature = app.signer.sign(&msg);
    let mut resp = plain(reply);
    let h = resp.headers_mut();
    h.insert(
        header::ORIGIN,
        HeaderValue::from_str(&app.config.host).expect("host name is a header value"),
    );
    h.insert(
        header::SIGNATURE,
        HeaderValue::from_str(&signature).expect("base64 is a header value"),
    );
    resp
}

/// Body bytes as JSON, or 400.
pub fn json_body(body: &Bytes) -> Result<serde_json::Value, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::BadRequest(format!("body is not JSON: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_are_strict() {
        assert_eq!(parse_route("/agent/needs").unwrap(), Route::NeedsList);
        assert_eq!(
            parse_route("/agent/capabilities/oidc").unwrap(),
            Route::Capability("oidc".into())
        );
        assert!(matches!(
            parse_route("/agent/needs/oidc/x").unwrap(),
            Route::Callback(_)
        ));
        assert_eq!(
            parse_route("/agent/capabilities/oidc/batch").unwrap(),
            Route::CapabilityBatch("oidc".into())
        );
        assert_eq!(
            parse_route("/agent/callbacks").unwrap(),
            Route::CallbackBatch
        );
        for bad in [
            "/agent/capabilities/oidc/batch/",
            "/agent/capabilities/oidc/other",
            "/agent/callbacks/",
            "/agent/capabilities/oidc/",
            "/agent/capabilities/OIDC",
            "/agent/needs/",
            "/x",
        ] {
            assert!(
                matches!(parse_route(bad), Err(ApiError::NotFound(_))),
                "{bad}"
            );
        }
        for bad in [
            "/agent/capabilities/%6fidc",
            "/agent//needs",
            "/agent/needs/../needs",
        ] {
            assert!(
                matches!(parse_route(bad), Err(ApiError::BadRequest(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn header_grammars() {
        assert!(is_timestamp("1700000000"));
        assert!(!is_timestamp("01700000000"));
        assert!(!is_timestamp(" 1700000000"));
        assert!(!is_timestamp("1234567890123"));
        assert!(is_nonce("00112233445566778899aabbccddeeff"));
        assert!(!is_nonce("00112233445566778899AABBCCDDEEFF"));
    }
}
