//! The steps of the demo walkthrough, after the fleet has converged, and the probes
//! they share: each step prints what it does, checks its claim against the agents' status
//! and the files the example handlers write, and returns a one-line result or an error.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use fort_core::canonical::sha256_hex;
use serde_json::Value;

use super::fleet::{stored_entries, Fleet};
use super::{SHORT_LIFETIME, SHORT_RENEW_BEFORE, WIKI_DOMAIN};
use crate::admin::AdminRequest;

/// How long one wait may take before the demo calls the step failed.
const STEP_TIMEOUT: Duration = Duration::from_secs(30);

/// A deadline for one wait: [`STEP_TIMEOUT`] from now, then the demo fails naming `what`.
pub(super) struct Wait {
    what: &'static str,
    deadline: Instant,
}

impl Wait {
    pub(super) fn until(what: &'static str) -> Wait {
        Wait {
            what,
            deadline: Instant::now() + STEP_TIMEOUT,
        }
    }

    /// Sleeps a little before the next look, or fails once the deadline has passed.
    pub(super) async fn tick(&self) -> anyhow::Result<()> {
        if Instant::now() > self.deadline {
            bail!(
                "timed out after {}s waiting until {}",
                STEP_TIMEOUT.as_secs(),
                self.what
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        Ok(())
    }
}

/// Where a need's payload can be read whole: its first delivered file, or what its
/// handler stored.
fn payload_path(fleet: &Fleet, need: &str) -> PathBuf {
    let decl = fleet.needs.iter().find(|n| n.key == need);
    match decl.and_then(|d| d.files.first()) {
        Some((name, _, _)) => fleet.delivered(need, name),
        None => fleet.examples_dir("app").join(need.replace('/', "_")),
    }
}

/// What a need holds: the digest (to compare) and the bytes of all its delivered files,
/// or of what its handler stored.
pub(super) fn payload(fleet: &Fleet, need: &str) -> Option<(String, Vec<u8>)> {
    let decl = fleet.needs.iter().find(|n| n.key == need)?;
    let bytes = if decl.files.is_empty() {
        std::fs::read(payload_path(fleet, need)).ok()?
    } else {
        let mut all = Vec::new();
        for (name, _, _) in &decl.files {
            all.extend(std::fs::read(fleet.delivered(need, name)).ok()?);
        }
        all
    };
    Some((sha256_hex(&bytes), bytes))
}

/// Payloads a need has received (an unchanged one counts), from its status row.
async fn received(fleet: &Fleet, need: &str) -> anyhow::Result<u64> {
    let s = fleet.status("app").await?;
    Ok(need_items(&s)
        .iter()
        .find(|n| n["need"] == need)
        .and_then(|n| n["received"].as_u64())
        .unwrap_or(0))
}

/// One need's status row.
pub(super) async fn need_row(fleet: &Fleet, need: &str) -> anyhow::Result<Value> {
    let s = fleet.status("app").await?;
    Ok(need_items(&s)
        .into_iter()
        .find(|n| n["need"] == need)
        .unwrap_or(Value::Null))
}

/// Waits until the unit round in progress is over (gathered for 300 ms, rounds 1 s apart).
pub(super) async fn settle_rounds() {
    tokio::time::sleep(Duration::from_millis(1500)).await;
}

/// `serial=…` of the certificate in a stored payload, for the reader; the check compares digests.
pub(super) fn cert_serial(fleet: &Fleet, need: &str) -> String {
    let path = payload_path(fleet, need);
    std::process::Command::new("openssl")
        .args(["x509", "-noout", "-serial", "-in"])
        .arg(&path)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .trim()
                .replace("serial=", "")
        })
        .map(|s| format!("serial {}…", &s[..s.len().min(12)]))
        .unwrap_or_else(|| "no certificate".into())
}

pub(super) fn need_items(status: &Value) -> Vec<Value> {
    status["needs"]["items"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

pub(super) fn all_satisfied(status: &Value) -> bool {
    let items = need_items(status);
    !items.is_empty() && items.iter().all(|n| n["satisfied"] == true)
}

pub(super) async fn rotation(fleet: &Fleet) -> anyhow::Result<String> {
    println!("  A daily cert-rotate unit would run `fort-agent trigger ssl-cert --reason systemd`; the marker");
    println!("  file rotate/{WIKI_DOMAIN} asks the handler to renew that domain only.");
    let wiki_before = payload(fleet, "ssl-cert/wiki")
        .context("no ssl-cert/wiki payload")?
        .0;
    let api_before = payload(fleet, "ssl-cert/api")
        .context("no ssl-cert/api payload")?
        .0;
    let oidc_before = payload(fleet, "oidc/wiki")
        .context("no oidc/wiki payload")?
        .0;
    println!(
        "  before: ssl-cert/wiki {}   ssl-cert/api {}",
        cert_serial(fleet, "ssl-cert/wiki"),
        cert_serial(fleet, "ssl-cert/api")
    );
    let calls_before = fleet.systemctl_calls().len();
    let marker = fleet.examples_dir("forge").join("rotate").join(WIKI_DOMAIN);
    std::fs::create_dir_all(marker.parent().expect("has a parent"))?;
    std::fs::write(&marker, "")?;
    let reply = fleet
        .admin(
            "forge",
            &AdminRequest::Trigger {
                capability: "ssl-cert".into(),
                entry: None,
                force: false,
                reason: Some("systemd".into()),
            },
        )
        .await
        .context("trigger ssl-cert on forge")?;
    let run = &reply["run"];
    println!(
        "  forge: handler ran ({} trigger) over {} entries, {} callback(s) planned",
        run["trigger"].as_str().unwrap_or("?"),
        run["entries"],
        run["callbacks"]
    );
    if run["callbacks"] != 1 {
        bail!(
            "the rotation should call back exactly one consumer need, the run planned {}",
            run["callbacks"]
        );
    }
    let wait = Wait::until("app stores the renewed ssl-cert/wiki");
    while payload(fleet, "ssl-cert/wiki").map(|p| p.0).as_ref() == Some(&wiki_before) {
        wait.tick().await?;
    }
    let api_after = payload(fleet, "ssl-cert/api")
        .context("ssl-cert/api payload vanished")?
        .0;
    println!(
        "  after:  ssl-cert/wiki {} (new)   ssl-cert/api {} (unchanged)",
        cert_serial(fleet, "ssl-cert/wiki"),
        cert_serial(fleet, "ssl-cert/api")
    );
    if api_after != api_before {
        bail!("ssl-cert/api changed although only {WIKI_DOMAIN} was rotated");
    }
    if payload(fleet, "oidc/wiki").map(|p| p.0) != Some(oidc_before) {
        bail!("oidc/wiki changed during a certificate rotation");
    }
    if marker.exists() {
        bail!(
            "the handler did not consume the rotation marker {}",
            marker.display()
        );
    }
    let wait = Wait::until("nginx is reloaded for the new certificate");
    while fleet.systemctl_calls().len() == calls_before {
        wait.tick().await?;
    }
    settle_rounds().await;
    let calls = fleet.systemctl_calls();
    let new = &calls[calls_before..];
    println!(
        "  systemctl was asked: {} (wiki.service untouched)",
        new.join("; ")
    );
    if new != ["reload -- nginx.service"] {
        bail!(
            "the rotation should reload nginx once and nothing else, systemctl was asked {new:?}"
        );
    }
    if !all_satisfied(&fleet.status("app").await?) {
        bail!("app has unsatisfied needs after the rotation");
    }
    Ok("ssl-cert/wiki renewed, ssl-cert/api untouched, 1 callback, nginx reloaded once".into())
}

pub(super) async fn reference(fleet: &Fleet) -> anyhow::Result<String> {
    println!("  app's proxy/wiki request carries {{\"$fort_ref\": \"oidc/wiki#/client_id\"}}: beacon's vhost");
    println!(
        "  names the wiki's OIDC client. forge issues app's wiki a new client (`fort-agent trigger"
    );
    println!(
        "  oidc --entry app:oidc/wiki --force`); app gets it, restarts wiki.service, and sends"
    );
    println!("  proxy/wiki again.");
    let vhost = fleet.examples_dir("beacon").join("vhosts/app@wiki.conf");
    let client_line = || {
        std::fs::read_to_string(&vhost)
            .unwrap_or_default()
            .lines()
            .find(|l| l.contains("OIDC client"))
            .map(|l| l.trim().to_owned())
            .unwrap_or_default()
    };
    let id_before = read_delivered(fleet, "oidc/wiki", "client_id")?;
    if !client_line().ends_with(&id_before) {
        bail!(
            "beacon's vhost should name client {id_before}, it says {:?}",
            client_line()
        );
    }
    println!("  before: client_id {id_before}; vhost: {}", client_line());
    let proxy_sent = need_row(fleet, "proxy/wiki").await?["received"]
        .as_u64()
        .unwrap_or(0);
    let calls_before = fleet.systemctl_calls().len();
    fleet
        .admin(
            "forge",
            &AdminRequest::Trigger {
                capability: "oidc".into(),
                entry: Some("app:oidc/wiki".into()),
                force: true,
                reason: None,
            },
        )
        .await
        .context("trigger oidc on forge")?;
    let wait = Wait::until("beacon's vhost names the new OIDC client");
    let id_after = loop {
        let id = read_delivered(fleet, "oidc/wiki", "client_id")?;
        if id != id_before && client_line().ends_with(&id) {
            break id;
        }
        wait.tick().await?;
    };
    let wait = Wait::until("app has proxy/wiki satisfied for the new client");
    while need_row(fleet, "proxy/wiki").await?["received"]
        .as_u64()
        .unwrap_or(0)
        <= proxy_sent
    {
        wait.tick().await?;
    }
    settle_rounds().await;
    println!("  after:  client_id {id_after}; vhost: {}", client_line());
    let calls = fleet.systemctl_calls();
    let new = &calls[calls_before..];
    println!("  systemctl was asked: {}", new.join("; "));
    if new != ["restart -- wiki.service"] {
        bail!("new OIDC credentials should restart wiki.service once, systemctl was asked {new:?}");
    }
    if !all_satisfied(&fleet.status("app").await?) {
        bail!("app has unsatisfied needs after the new OIDC client");
    }
    Ok("new OIDC client, proxy/wiki sent again with it, wiki.service restarted once".into())
}

fn read_delivered(fleet: &Fleet, need: &str, file: &str) -> anyhow::Result<String> {
    let path = fleet.delivered(need, file);
    std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))
}

pub(super) async fn release(fleet: &Fleet) -> anyhow::Result<String> {
    println!("  app stops declaring proxy/wiki (needs.json rewritten, then `fort-agent reload`): it tells");
    println!("  beacon at once, beacon drops the entry and its handler removes the vhost.");
    let vhost = fleet.examples_dir("beacon").join("vhosts/app@wiki.conf");
    let entries = |s: &Value| {
        s["provider"]["capabilities"]["proxy"]["entries"]
            .as_u64()
            .unwrap_or(0)
    };
    let before = entries(&fleet.status("beacon").await?);
    println!(
        "  before: beacon has {before} proxy entry, vhost {} exists: {}",
        rel(fleet, &vhost),
        vhost.exists()
    );
    if before != 1 || !vhost.exists() {
        bail!("beacon should hold one proxy entry and its vhost before the release");
    }
    fleet.declare_at("app", super::RELEASE_STEP)?;
    fleet
        .admin("app", &AdminRequest::Reload)
        .await
        .context("reload app")?;
    let wait = Wait::until("beacon has dropped app:proxy/wiki and its vhost is gone");
    while entries(&fleet.status("beacon").await?) != 0 || vhost.exists() {
        wait.tick().await?;
    }
    if stored_entries(fleet, "beacon").contains_key("app:proxy/wiki") {
        bail!("beacon's provider-state.json still holds app:proxy/wiki");
    }
    let s = fleet.status("app").await?;
    println!(
        "  after:  beacon has 0 proxy entries, vhost removed; app declares {} needs, {} satisfied",
        s["needs"]["total"], s["needs"]["satisfied"]
    );
    if s["needs"]["total"] != 3 || !all_satisfied(&s) {
        bail!(
            "app should declare 3 satisfied needs after the release, status says {}",
            s["needs"]
        );
    }
    Ok("entry released at once, vhost removed".into())
}

pub(super) async fn kill_and_restart(fleet: &mut Fleet) -> anyhow::Result<String> {
    println!("  forge is killed with SIGKILL (no shutdown, no flush), then started again. Its entries were");
    println!("  durable before it answered 202, and its initialize run calls every consumer back.");
    let needs = ["oidc/wiki", "ssl-cert/wiki", "ssl-cert/api"];
    let secret = read_secret(fleet)?;
    let mut before = Vec::new();
    for n in needs {
        let digest = payload(fleet, n)
            .with_context(|| format!("no {n} payload"))?
            .0;
        before.push((digest, received(fleet, n).await?));
    }
    let stamp = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let files = [
        fleet.delivered("oidc/wiki", "client_secret"),
        fleet.delivered("ssl-cert/wiki", "bundle.pem"),
    ];
    let files_before: Vec<_> = files.iter().map(|p| stamp(p)).collect();
    let calls_before = fleet.systemctl_calls();
    fleet.kill("forge");
    let on_disk = stored_entries(fleet, "forge");
    let with_response = on_disk
        .values()
        .filter(|e| !e["response"].is_null())
        .count();
    println!("  forge killed; its provider-state.json holds {} entries, {with_response} with a response:", on_disk.len());
    for k in on_disk.keys() {
        println!("    {k}");
    }
    if on_disk.len() != 3 || with_response != 3 {
        bail!(
            "forge's state on disk should hold 3 entries with responses, it holds {}",
            on_disk.len()
        );
    }
    if !all_satisfied(&fleet.status("app").await?) {
        bail!("app lost a satisfied need while forge was down");
    }
    println!("  app keeps its 3 needs satisfied while forge is down");
    let pid = fleet.start("forge").await?;
    println!("  forge restarted (pid {pid})");
    let wait = Wait::until("app has received every payload again from the restarted forge");
    loop {
        let mut redelivered = true;
        for (n, (_, count)) in needs.iter().zip(&before) {
            redelivered &= received(fleet, n).await? > *count;
        }
        let s = fleet.status("forge").await?;
        let undelivered: u64 = ["oidc", "ssl-cert"]
            .iter()
            .map(|c| {
                s["provider"]["capabilities"][c]["undelivered"]
                    .as_u64()
                    .unwrap_or(1)
            })
            .sum();
        if redelivered && undelivered == 0 {
            break;
        }
        wait.tick().await?;
    }
    for (n, (digest, _)) in needs.iter().zip(&before) {
        if payload(fleet, n).map(|p| p.0).as_ref() != Some(digest) {
            bail!("{n} changed across the restart: a cached response was lost");
        }
    }
    if read_secret(fleet)? != secret {
        bail!("the oidc client_secret changed across the restart");
    }
    if !all_satisfied(&fleet.status("app").await?) {
        bail!("app has unsatisfied needs after forge's restart");
    }
    settle_rounds().await;
    let files_after: Vec<_> = files.iter().map(|p| stamp(p)).collect();
    if files_after != files_before {
        bail!("a delivered file was rewritten although its content did not change");
    }
    if fleet.systemctl_calls() != calls_before {
        bail!("a unit was restarted for a payload that did not change");
    }
    println!(
        "  app got all 3 payloads again, byte for byte the same: client_secret {}… unchanged,",
        &secret[..8.min(secret.len())]
    );
    println!("  its delivered files untouched and no unit restarted");
    Ok("3 entries survived, same secret and certificates, nothing restarted".into())
}

fn read_secret(fleet: &Fleet) -> anyhow::Result<String> {
    read_delivered(fleet, "oidc/wiki", "client_secret")
}

pub(super) async fn renewal(fleet: &Fleet) -> anyhow::Result<String> {
    const NEED: &str = "ssl-cert/short";
    println!("  app now also declares {NEED}: a certificate living {SHORT_LIFETIME}s, to be renewed {SHORT_RENEW_BEFORE}s");
    println!("  before it expires (renew_before_seconds). In the renewal window the need is `expiring` and");
    println!("  is asked for again with \"renew\": true, which forge's handler honours.");
    fleet.declare_at("app", super::RENEWAL_STEP)?;
    fleet
        .admin("app", &AdminRequest::Reload)
        .await
        .context("reload app")?;
    let wait = Wait::until("app holds a certificate for ssl-cert/short");
    let first = loop {
        let row = need_row(fleet, NEED).await?;
        if row["satisfied"] == true {
            if let Some(at) = row["expires_at"].as_u64() {
                break at;
            }
        }
        wait.tick().await?;
    };
    let now = fort_core::wire::unix_now();
    println!(
        "  satisfied: {}, expires in {}s; the renewal window opens in {}s",
        cert_serial(fleet, NEED),
        first.saturating_sub(now),
        first.saturating_sub(SHORT_RENEW_BEFORE).saturating_sub(now)
    );
    let calls_before = fleet.systemctl_calls().len();
    let mut seen = vec!["satisfied".to_owned()];
    let wait = Wait::until("ssl-cert/short is renewed");
    let (renewed, row) = loop {
        let row = need_row(fleet, NEED).await?;
        let state = row["state"].as_str().unwrap_or("?").to_owned();
        if seen.last() != Some(&state) {
            seen.push(state);
        }
        match row["expires_at"].as_u64() {
            Some(at) if at > first && row["satisfied"] == true => break (at, row),
            _ => wait.tick().await?,
        }
    };
    let now = fort_core::wire::unix_now();
    if now >= first {
        bail!("ssl-cert/short was renewed only after it expired");
    }
    let log = fleet.examples_dir("forge").join("renewals.log");
    let renewals = std::fs::read_to_string(&log).unwrap_or_default();
    if !renewals.contains("app:ssl-cert/short renew") {
        bail!(
            "forge's handler did not see renew: true ({} says {renewals:?})",
            log.display()
        );
    }
    println!("  states seen: {}", seen.join(" → "));
    println!(
        "  renewed {}s before expiry: {}, expires in {}s; forge's handler logged the renewal asked for",
        first - now,
        cert_serial(fleet, NEED),
        renewed.saturating_sub(now)
    );
    let wait = Wait::until("nginx is reloaded for the renewed certificate");
    while fleet.systemctl_calls().len() == calls_before {
        wait.tick().await?;
    }
    if row["reason"] != Value::Null {
        bail!("a renewed certificate should leave no reason, status says {row}");
    }
    println!(
        "  systemctl was asked: {}",
        fleet.systemctl_calls()[calls_before..].join("; ")
    );
    println!(
        "  (it keeps being renewed every {}s while the demo runs)",
        SHORT_LIFETIME - SHORT_RENEW_BEFORE
    );
    Ok(format!(
        "renewed {}s before expiry, renew seen by the handler",
        first - now
    ))
}

/// `path` relative to the fleet's root, for shorter lines.
fn rel(fleet: &Fleet, path: &Path) -> String {
    path.strip_prefix(&fleet.root)
        .unwrap_or(path)
        .display()
        .to_string()
}
