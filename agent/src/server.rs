//! The listeners (control plane and metrics). Served with hyper's own builder because
//! `axum::serve` has no header-read timeout. Per connection, in this order:
//!
//! 1. admission: the listener's and the peer address's connection budgets, taken before a
//!    single byte is read, so handshakes count against them too;
//! 2. TLS 1.3 (the control plane), finished within the header-read timeout, so nothing
//!    reaches HTTP before the handshake is complete and a stalled handshake is dropped;
//! 3. HTTP/1.1 with keep-alive and the header-read timeout (which also closes connections
//!    that sit idle between requests).
//!
//! Shutdown drains in-flight requests through hyper-util's graceful watcher.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::limits::{Budgets, ConnectionTrust};
use crate::logging::Quiet;

/// The peer's address, put in every request's extensions for per-address budgets.
#[derive(Debug, Clone, Copy)]
pub struct PeerAddr(pub SocketAddr);

pub struct Listener {
    pub tcp: TcpListener,
    /// `None`: plain HTTP (metrics, or `plaintext = true`).
    pub tls: Option<tokio_rustls::TlsAcceptor>,
    pub budgets: Arc<Budgets>,
    pub header_read_timeout: Duration,
    /// For logs: "control plane", "metrics".
    pub name: &'static str,
    /// Refusals at admission are logged through this, aggregated.
    pub quiet: Arc<Quiet>,
}

pub async fn serve(listener: Listener, router: Router, shutdown: CancellationToken) {
    let graceful = GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    // Heads are small (the signature header is at most 2 KiB): bounding the buffer keeps
    // a connection that trickles an endless head from holding hyper's default 400 KiB.
    http.timer(TokioTimer::new())
        .header_read_timeout(listener.header_read_timeout)
        .max_buf_size(16 * 1024)
        .max_headers(32)
        .keep_alive(true);
    let http = Arc::new(http);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.tcp.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: back off rather than spin.
                    listener.quiet.warn("accept_failed", &format!("{}: accept failed: {e}", listener.name));
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = shutdown.cancelled() => break,
        };
        let permit = match listener.budgets.connect(peer.ip()) {
            Ok(p) => p,
            Err(why) => {
                listener.quiet.info(
                    why.as_str(),
                    &format!(
                        "{}: connection from {} refused: {}",
                        listener.name,
                        peer.ip(),
                        why.as_str()
                    ),
                );
                drop(stream);
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let closed = permit.closed();
        let trust = permit.trust();
        let router = router.clone();
        let http = http.clone();
        let watcher = graceful.watcher();
        let tls = listener.tls.clone();
        let deadline = listener.header_read_timeout;
        let quiet = listener.quiet.clone();
        let name = listener.name;
        tokio::spawn(async move {
            let _permit = permit;
            let serving = async move {
                let Some(acceptor) = tls else {
                    return serve_connection(&http, watcher, stream, peer, trust, router).await;
                };
                match tokio::time::timeout(deadline, acceptor.accept(stream)).await {
                    Ok(Ok(tls_stream)) => {
                        serve_connection(&http, watcher, tls_stream, peer, trust, router).await
                    }
                    Ok(Err(e)) => quiet.info(
                        "tls_handshake",
                        &format!("{name}: TLS handshake with {} failed: {e}", peer.ip()),
                    ),
                    Err(_) => quiet.info(
                        "tls_timeout",
                        &format!(
                            "{name}: TLS handshake with {} not finished in time",
                            peer.ip()
                        ),
                    ),
                }
            };
            tokio::select! {
                _ = serving => {}
                // Displaced by a newcomer: it never carried a verified request.
                _ = closed.cancelled() => {}
            }
        });
    }
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(Duration::from_secs(10)) => tracing::warn!("connections still open after 10 s; closing"),
    }
}

async fn serve_connection<S>(
    http: &hyper::server::conn::http1::Builder,
    watcher: hyper_util::server::graceful::Watcher,
    io: S,
    peer: SocketAddr,
    trust: ConnectionTrust,
    router: Router,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let service =
        hyper::service::service_fn(move |mut req: http::Request<hyper::body::Incoming>| {
            req.extensions_mut().insert(PeerAddr(peer));
            req.extensions_mut().insert(trust.clone());
            tower::ServiceExt::oneshot(router.clone(), req)
        });
    let conn = http.serve_connection(TokioIo::new(io), service);
    let _ = watcher.watch(conn).await;
}
