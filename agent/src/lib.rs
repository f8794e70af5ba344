//! The fort agent: one per host. It serves the signed control plane, provides
//! capabilities, fulfils this host's needs, and collects garbage on evidence.

pub mod admin;
pub mod app;
pub mod audit_cli;
pub mod audit_fleet;
pub mod auth;
pub mod builtins;
pub mod check;
pub mod check_allowances;
pub mod check_fleet;
pub mod check_requests;
pub mod cli;
pub mod config;
pub mod demo;
pub mod error;
pub mod limits;
pub mod loaded;
pub mod logging;
pub mod metrics;
pub mod nonce;
pub mod plan;
pub mod provider;
pub mod rotate;
pub mod routes;
pub mod server;
pub mod state_key;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::Router;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::app::App;
use crate::config::Config;

/// The signed control-plane router: every request goes through the §3 pipeline.
pub fn app_router(app: Arc<App>) -> Router {
    Router::new().fallback(auth::dispatch).with_state(app)
}

/// Runs the agent until `shutdown` is cancelled, then drains and flushes state.
pub async fn run(config: Config, shutdown: CancellationToken) -> anyhow::Result<()> {
    let listener = TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    let admin_listener = admin::bind(&config.admin_socket)
        .with_context(|| format!("cannot bind admin socket {}", config.admin_socket.display()))?;
    let metrics_listener = match config.metrics_listen {
        Some(addr) => Some(
            TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot listen for metrics on {addr}"))?,
        ),
        None => None,
    };
    // Whatever a handler leaves behind (a double-forked daemon, a setsid child) is
    // reparented to the agent instead of init, so it can be killed and reaped.
    if let Err(e) = fort_core::process::become_child_subreaper() {
        tracing::warn!(error = %e, "cannot become a child subreaper; processes that handlers leave behind may survive them");
    }
    let app = App::start(config, shutdown.clone()).await?;
    if app.config.plaintext {
        tracing::warn!(
            "plaintext = true: plain http:// addresses are accepted; requests are still signed, but what they carry is readable on the wire unless an overlay network encrypts it"
        );
    }
    tracing::info!(
        host = %app.config.host,
        listen = %app.config.listen,
        tls = app.tls.is_some(),
        max_connections = app.budgets.max_connections(),
        needs = app.loaded.load().needs.len(),
        capabilities = app.loaded.load().capabilities.len(),
        "fort-agent ready"
    );
    tokio::spawn(admin::serve(app.clone(), admin_listener));
    if let Some(l) = metrics_listener {
        tokio::spawn(serve_metrics(app.clone(), l));
    }
    tokio::spawn(reload_on_sighup(app.clone()));
    tokio::spawn(app.quiet.clone().run(app.shutdown.clone()));
    tokio::spawn(reap_orphans_periodically(app.shutdown.clone()));
    notify_systemd("READY=1");
    let control = server::Listener {
        tcp: listener,
        tls: app.tls.clone(),
        budgets: app.budgets.clone(),
        header_read_timeout: app.config.header_read_timeout,
        name: "control plane",
        quiet: app.quiet.clone(),
    };
    server::serve(control, app_router(app.clone()), shutdown).await;
    notify_systemd("STOPPING=1");
    app.flush_stop.cancel();
    app.tasks.close();
    if tokio::time::timeout(Duration::from_secs(10), app.tasks.wait())
        .await
        .is_err()
    {
        tracing::warn!("background tasks still running after 10 s; exiting anyway");
    }
    let _ = std::fs::remove_file(&app.config.admin_socket);
    app.audit.record(fort_core::audit::Event::own(
        fort_core::audit::OwnKind::Stop,
    ));
    let audit = app.audit.clone();
    let _ = tokio::task::spawn_blocking(move || audit.close()).await;
    Ok(())
}

/// Runs also end by killing what they leave behind; this sweep catches orphans that
/// died or escaped between runs, so none lingers as a zombie.
async fn reap_orphans_periodically(shutdown: CancellationToken) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(5)) => {}
            _ = shutdown.cancelled() => return,
        }
        let reaped = tokio::task::spawn_blocking(fort_core::process::reap_orphans)
            .await
            .unwrap_or(0);
        if reaped > 0 {
            tracing::info!(
                reaped,
                "killed or reaped processes that finished handlers left behind"
            );
        }
    }
}

async fn reload_on_sighup(app: Arc<App>) {
    let Ok(mut hup) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) else {
        return;
    };
    loop {
        tokio::select! {
            _ = hup.recv() => {
                if let Err(e) = app.reload().await {
                    tracing::error!(error = %e, "reload failed; keeping the previous configuration");
                }
            }
            _ = app.shutdown.cancelled() => return,
        }
    }
}

async fn serve_metrics(app: Arc<App>, listener: TcpListener) {
    let router = Router::new()
        .route(
            "/metrics",
            axum::routing::get(
                |axum::extract::State(app): axum::extract::State<Arc<App>>| async move {
                    let counts = app
                        .fulfiller
                        .counts()
                        .iter()
                        .map(|(phase, n)| (format!("{{state=\"{}\"}}", phase.as_str()), *n as f64))
                        .collect();
                    // One series per need, in its current state only: a need that goes away
                    // (or changes state) leaves no series behind.
                    let needs = app.fulfiller.status();
                    let states = needs
                        .iter()
                        .map(|n| {
                            (
                                format!("{{need=\"{}\",state=\"{}\"}}", n.need, n.state.as_str()),
                                1.0,
                            )
                        })
                        .collect();
                    let expiries = needs
                        .iter()
                        .filter_map(|n| {
                            n.expires_at
                                .map(|at| (format!("{{need=\"{}\"}}", n.need), at as f64))
                        })
                        .collect();
                    let failures = app
                        .fulfiller
                        .request_failures()
                        .into_iter()
                        .map(|(need, from, n)| {
                            (format!("{{need=\"{need}\",from=\"{from}\"}}"), f64::from(n))
                        })
                        .collect();
                    // Which provider serves each need, and how often it moved (§11.13).
                    let homes = needs
                        .iter()
                        .map(|n| (format!("{{need=\"{}\",provider=\"{}\"}}", n.need, n.from), 1.0))
                        .collect();
                    let moves = needs
                        .iter()
                        .map(|n| (format!("{{need=\"{}\"}}", n.need), n.moves as f64))
                        .collect();
                    let (entries, undelivered, last_run) = provider_gauges(&app);
                    let (restarts, reloads, _) = app.fulfiller.unit_counts();
                    let mut gauges = vec![
                        ("fort_needs", "Declared needs by state.", counts),
                        (
                            "fort_need_state",
                            "Each declared need, labelled with its state.",
                            states,
                        ),
                        (
                            "fort_need_expiry_timestamp_seconds",
                            "When the payload each need holds expires (unix seconds).",
                            expiries,
                        ),
                        (
                            "fort_need_request_failures",
                            "Requests in a row for each need that got no answer from its provider (no connection, TLS, a timeout, a server error); 0 once one is answered.",
                            failures,
                        ),
                        (
                            "fort_need_home",
                            "Each declared need, labelled with the provider serving it.",
                            homes,
                        ),
                        (
                            "fort_need_moves",
                            "Moves of each need to another of its providers since the agent started.",
                            moves,
                        ),
                        ("fort_entries", "Provider entries by capability.", entries),
                        (
                            "fort_entries_undelivered",
                            "Entries by capability whose current response or verdict their consumer has not acknowledged.",
                            undelivered,
                        ),
                        (
                            "fort_handler_last_run_success",
                            "1 when the capability's last handler run succeeded, 0 when it failed (no series before its first run).",
                            last_run,
                        ),
                        (
                            "fort_unit_actions",
                            "Unit restarts and reloads issued for changed delivered files.",
                            vec![
                                ("{action=\"restart\"}".to_owned(), restarts as f64),
                                ("{action=\"reload\"}".to_owned(), reloads as f64),
                            ],
                        ),
                    ];
                    gauges.extend(audit_gauges(&app.audit));
                    app.metrics.render(&gauges)
                },
            ),
        )
        .with_state(app.clone());
    // Its own small budget and the same timeouts as the control plane: scrapes come from
    // one or two collectors, and idle connections here must never cost the control plane
    // its descriptors.
    let metrics = server::Listener {
        tcp: listener,
        tls: None,
        budgets: limits::Budgets::new(16, 8, 0, 0),
        header_read_timeout: app.config.header_read_timeout,
        name: "metrics",
        quiet: app.quiet.clone(),
    };
    server::serve(metrics, router, app.shutdown.clone()).await;
}

type Series = Vec<(String, f64)>;

/// The provider's gauges by capability: entries, undelivered entries, whether the last
/// handler run succeeded.
/// The audit trail's series (docs/protocol.md §12.5): none when it is off.
fn audit_gauges(audit: &fort_core::audit::Audit) -> Vec<metrics::Gauge<'static>> {
    let Some(st) = audit.stats() else {
        return Vec::new();
    };
    let one = |v: u64| vec![(String::new(), v as f64)];
    let mut gauges = vec![
        (
            "fort_audit_records",
            "Records written to the audit trail since the agent started.",
            one(st.records),
        ),
        (
            "fort_audit_lost_records",
            "Records the audit trail could not take (its queue was full) since the agent started.",
            one(st.lost),
        ),
        (
            "fort_audit_checkpoints",
            "Checkpoints signed since the agent started.",
            one(st.checkpoints),
        ),
        (
            "fort_audit_writable",
            "1 when the audit trail's last write succeeded, 0 when its files cannot be written.",
            one(u64::from(st.writable)),
        ),
    ];
    if let Some(n) = st.not_copied {
        gauges.push((
            "fort_audit_syslog_not_copied",
            "Records the remote syslog copy could not send since the agent started (the trail's files still hold them).",
            one(n),
        ));
    }
    gauges
}

fn provider_gauges(app: &App) -> (Series, Series, Series) {
    let loaded = app.loaded.load_full();
    let summary = app
        .provider
        .summary(|origin| loaded.registry.is_host(origin));
    let (mut entries, mut undelivered, mut last_run) = (Vec::new(), Vec::new(), Vec::new());
    for (cap, c) in &summary.capabilities {
        let label = format!("{{capability=\"{cap}\"}}");
        entries.push((label.clone(), c.entries as f64));
        undelivered.push((label.clone(), c.undelivered as f64));
        if let Some(run) = &c.last_run {
            last_run.push((label, if run.ok { 1.0 } else { 0.0 }));
        }
    }
    (entries, undelivered, last_run)
}

/// `sd_notify(3)` without libsystemd: one datagram to `$NOTIFY_SOCKET`, if set.
fn notify_systemd(state: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let Ok(sock) = std::os::unix::net::UnixDatagram::unbound() else {
        return;
    };
    let bytes = path.as_encoded_bytes();
    let sent = if let Some(name) = bytes.strip_prefix(b"@") {
        use std::os::linux::net::SocketAddrExt;
        std::os::unix::net::SocketAddr::from_abstract_name(name)
            .and_then(|a| sock.send_to_addr(state.as_bytes(), &a))
    } else {
        sock.send_to(state.as_bytes(), &path)
    };
    if let Err(e) = sent {
        tracing::warn!(error = %e, "sd_notify failed");
    }
}
