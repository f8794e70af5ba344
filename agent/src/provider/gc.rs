//! GC sweeps (§8): an entry goes only on evidence. Hosts are asked once per sweep which
//! needs they declare; only a verified `200` with a `needs` array that lacks the entry
//! counts as absence, and absence must last the grace period. A need the list says
//! another provider serves (`served_by`, §11.13) counts as absent here too. Hosts gone from hosts.json
//! lose their entries at once; principals' entries expire after a TTL.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fort_core::client::Target;
use fort_core::names::parse_entry_key;
use fort_core::schema::PeerKind;
use fort_core::wire::{unix_now, NeedsList, NEEDS_PATH};
use serde::Serialize;
use tokio::sync::Semaphore;

use super::state::capability_of;
use super::Trigger;
use crate::app::App;

/// What one enumeration proved.
#[derive(Debug, Clone, PartialEq)]
pub enum Evidence {
    /// A verified list of the needs the origin declares now and has this host serve
    /// (needs it declares but has another provider serve map to that provider).
    Declares(BTreeSet<String>, BTreeMap<String, String>),
    /// No proof; the class of failure (`timeout`, `refused`, `401`, `bad_signature`, …).
    NoProof(String),
}

#[derive(Debug, Clone, Serialize)]
pub struct Decision {
    pub entry: String,
    pub action: &'static str,
    pub reason: String,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct SweepReport {
    pub at: u64,
    pub duration_ms: u64,
    pub dry_run: bool,
    pub origins_asked: usize,
    pub removed: Vec<Decision>,
    pub pending_grace: Vec<Decision>,
    pub kept_no_proof: Vec<Decision>,
    /// Origins whose absence could not be proven, by failure class.
    pub no_proof_classes: BTreeMap<String, usize>,
}

/// Asks one host which needs it declares.
pub async fn enumerate(app: &App, origin: &str, timeout: Duration) -> Evidence {
    let loaded = app.loaded.load_full();
    let Some(peer) = loaded.registry.get(origin) else {
        return Evidence::NoProof("unknown".into());
    };
    let Some(address) = peer.address.clone() else {
        return Evidence::NoProof("principal".into());
    };
    let keys = peer.keys.clone();
    drop(loaded);
    let target = Target {
        name: origin,
        address: &address,
        keys: &keys,
    };
    let reply = match tokio::time::timeout(
        timeout,
        app.client.post(&target, NEEDS_PATH, b"{}".to_vec()),
    )
    .await
    {
        Err(_) => return Evidence::NoProof("timeout".into()),
        Ok(Err(e)) => return Evidence::NoProof(e.class().into()),
        Ok(Ok(r)) => r,
    };
    if reply.status != 200 {
        return Evidence::NoProof(format!("status_{}", reply.status));
    }
    if !reply.verified() {
        return Evidence::NoProof("bad_signature".into());
    }
    match serde_json::from_slice::<NeedsList>(&reply.body) {
        Ok(list) => {
            let me = app.config.host.as_str();
            let elsewhere: BTreeMap<String, String> = list
                .served_by
                .into_iter()
                .filter(|(_, home)| home != me)
                .collect();
            let here = list
                .needs
                .into_iter()
                .filter(|n| !elsewhere.contains_key(n))
                .collect();
            Evidence::Declares(here, elsewhere)
        }
        Err(_) => Evidence::NoProof("bad_json".into()),
    }
}

/// An entry as the sweep saw it: key, need, requested_at, absent_since.
type Seen = (String, String, u64, Option<u64>);

/// One sweep. With `dry_run`, decides and reports but changes nothing.
pub async fn run_once(app: &Arc<App>, dry_run: bool) -> SweepReport {
    let started = Instant::now();
    let now = unix_now();
    let cfg = app.config.gc.clone();
    let mut report = SweepReport {
        at: now,
        dry_run,
        ..Default::default()
    };
    // Snapshot: origin → (entry key, need, requested_at, absent_since).
    let mut by_origin: BTreeMap<String, Vec<Seen>> = BTreeMap::new();
    app.provider.store.read(|entries| {
        for (key, e) in entries {
            if let Some((origin, need)) = parse_entry_key(key) {
                by_origin.entry(origin.to_owned()).or_default().push((
                    key.clone(),
                    need.to_string(),
                    e.requested_at,
                    e.absent_since,
                ));
            }
        }
    });
    let loaded = app.loaded.load_full();
    let mut asks = Vec::new();
    let limit = Arc::new(Semaphore::new(cfg.concurrency.max(1)));
    for origin in by_origin.keys() {
        if loaded.registry.get(origin).map(|p| p.kind) == Some(PeerKind::Host) {
            let (app, origin, limit) = (app.clone(), origin.clone(), limit.clone());
            asks.push(tokio::spawn(async move {
                let _slot = limit.acquire().await.expect("semaphore open");
                let ev = enumerate(&app, &origin, cfg.timeout).await;
                (origin, ev)
            }));
        }
    }
    report.origins_asked = asks.len();
    let mut evidence = BTreeMap::new();
    for a in asks {
        if let Ok((o, ev)) = a.await {
            evidence.insert(o, ev);
        }
    }

    // Decide.
    let grace = cfg.grace.as_secs();
    let mut remove = Vec::new();
    let mut mark_absent = Vec::new();
    let mut clear_absent = Vec::new();
    for (origin, entries) in &by_origin {
        let kind = loaded.registry.get(origin).map(|p| p.kind);
        for (key, need, requested_at, absent_since) in entries {
            let decision = |action, reason: String| Decision {
                entry: key.clone(),
                action,
                reason,
            };
            match kind {
                None => {
                    remove.push((key.clone(), *requested_at));
                    report.removed.push(decision(
                        "remove",
                        format!("{origin} is gone from hosts.json"),
                    ));
                }
                Some(PeerKind::Principal) => {
                    if now.saturating_sub(*requested_at) >= cfg.principal_ttl.as_secs() {
                        remove.push((key.clone(), *requested_at));
                        report
                            .removed
                            .push(decision("remove", "principal entry past its TTL".into()));
                    }
                }
                Some(PeerKind::Host) => match evidence.get(origin) {
                    Some(Evidence::Declares(needs, _)) if needs.contains(need) => {
                        if absent_since.is_some() {
                            clear_absent.push(key.clone());
                        }
                    }
                    Some(Evidence::Declares(_, elsewhere)) => {
                        let since = absent_since.unwrap_or(now);
                        if now.saturating_sub(since) >= grace && absent_since.is_some()
                            || grace == 0
                        {
                            remove.push((key.clone(), *requested_at));
                            let why = match elsewhere.get(need) {
                                Some(home) => {
                                    format!("{origin} has {home} serve {need} (verified)")
                                }
                                None => format!("{origin} no longer declares {need} (verified)"),
                            };
                            report.removed.push(decision("remove", why));
                        } else {
                            if absent_since.is_none() {
                                mark_absent.push((key.clone(), *requested_at));
                            }
                            report.pending_grace.push(decision(
                                "keep",
                                format!("absent since {since}; removed after {}s of grace", grace),
                            ));
                        }
                    }
                    Some(Evidence::NoProof(class)) => {
                        tracing::info!(entry = %key, origin = %origin, class = %class, "gc: absence not proven; entry kept");
                        *report.no_proof_classes.entry(class.clone()).or_insert(0) += 1;
                        app.metrics
                            .gc
                            .inc(&[("decision", "kept_no_proof"), ("reason", class)]);
                        report
                            .kept_no_proof
                            .push(decision("keep", format!("no proof of absence: {class}")));
                    }
                    None => report
                        .kept_no_proof
                        .push(decision("keep", "enumeration task failed".into())),
                },
            }
        }
    }
    drop(loaded);
    if dry_run {
        report.duration_ms = started.elapsed().as_millis() as u64;
        return report;
    }

    // Apply through the single owner. An entry re-requested since the snapshot was seen
    // alive after the evidence was gathered: it is neither removed nor marked.
    let applied = app.provider.store.change(|c| {
        let mut touched = BTreeSet::new();
        for (key, seen_requested) in &remove {
            if c.get(key)
                .is_some_and(|e| e.requested_at == *seen_requested)
            {
                c.remove(key);
                if let Some(cap) = capability_of(key) {
                    touched.insert(cap.to_owned());
                }
            }
        }
        for (key, seen_requested) in &mark_absent {
            if let Some(mut e) = c
                .get(key)
                .filter(|e| e.requested_at == *seen_requested)
                .cloned()
            {
                e.absent_since = Some(now);
                c.put(key.clone(), e);
            }
        }
        for key in &clear_absent {
            if let Some(mut e) = c.get(key).cloned() {
                e.absent_since = None;
                c.put(key.clone(), e);
            }
        }
        touched
    });
    let touched = match applied {
        Ok((touched, ticket)) => match app.provider.store.wait(ticket).await {
            Ok(()) => touched,
            Err(e) => {
                tracing::error!(error = %e, "GC decisions not persisted; will retry next sweep");
                BTreeSet::new()
            }
        },
        Err(e) => {
            tracing::error!(error = %e, "GC decisions not persisted; will retry next sweep");
            BTreeSet::new()
        }
    };
    for d in &report.removed {
        app.metrics
            .gc
            .inc(&[("decision", "removed"), ("reason", "")]);
        tracing::info!(entry = %d.entry, reason = %d.reason, "gc removed entry");
        app.audit.record_for_entry(
            &d.entry,
            fort_core::audit::Event::caused(fort_core::audit::CausedKind::Collected)
                .entry(&d.entry)
                .reason(&d.reason),
        );
    }
    // Let handlers clean up outside resources for what is gone.
    for cap in touched {
        app.provider.enqueue(app, &cap, Trigger::Gc, false, false);
    }
    report.duration_ms = started.elapsed().as_millis() as u64;
    *app.last_gc.lock() = Some(report.clone());
    report
}

/// The periodic sweep: interval plus jitter, until shutdown. `interval = 0` disables it.
pub async fn run_periodic(app: Arc<App>) {
    let cfg = app.config.gc.clone();
    if cfg.interval.is_zero() {
        return;
    }
    loop {
        let jitter = if cfg.jitter.is_zero() {
            Duration::ZERO
        } else {
            Duration::from_millis(rand::random::<u64>() % cfg.jitter.as_millis().max(1) as u64)
        };
        tokio::select! {
            _ = tokio::time::sleep(cfg.interval + jitter) => {}
            _ = app.shutdown.cancelled() => return,
        }
        let r = run_once(&app, false).await;
        tracing::info!(
            removed = r.removed.len(),
            kept_no_proof = r.kept_no_proof.len(),
            ms = r.duration_ms,
            "gc sweep"
        );
    }
}
