//! The three steps of the demo walkthrough, after the fleet has converged, and the probes
//! they share: each step prints what it does, checks its claim against the agents' status
//! and the files the example handlers write, and returns a one-line result or an error.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use fort_core::canonical::sha256_hex;
use serde_json::Value;

use super::fleet::{stored_entries, Fleet};
use super::WIKI_DOMAIN;
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

/// A stored payload: its digest (to compare) and its bytes.
pub(super) fn payload(fleet: &Fleet, need: &str) -> Option<(String, Vec<u8>)> {
    let path = fleet.examples_dir("app").join(need.replace('/', "_"));
    let bytes = std::fs::read(path).ok()?;
    Some((sha256_hex(&bytes), bytes))
}

/// When a stored payload was last written. (Not its inode: a file replaced twice may get
/// its first inode number back.)
fn payload_written(fleet: &Fleet, need: &str) -> Option<std::time::SystemTime> {
    let path = fleet.examples_dir("app").join(need.replace('/', "_"));
    std::fs::metadata(path).ok().and_then(|m| m.modified().ok())
}

/// `serial=…` of the certificate in a stored payload, for the reader; the check compares digests.
pub(super) fn cert_serial(fleet: &Fleet, need: &str) -> String {
    let path = fleet.examples_dir("app").join(need.replace('/', "_"));
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
    let marker = fleet.examples_dir("forge").join("rotate").join(WIKI_DOMAIN);
    std::fs::create_dir_all(marker.parent().expect("has a parent"))?;
    std::fs::write(&marker, "")?;
    let reply = fleet
        .admin(
            "forge",
            &AdminRequest::Trigger {
                capability: "ssl-cert".into(),
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
    if !all_satisfied(&fleet.status("app").await?) {
        bail!("app has unsatisfied needs after the rotation");
    }
    Ok("ssl-cert/wiki renewed, ssl-cert/api untouched, 1 callback".into())
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
    fleet.write_needs("app", |k| k != "proxy/wiki")?;
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

pub(super) async fn kill_and_restart(fleet: &mut Fleet, secret: &str) -> anyhow::Result<String> {
    println!("  forge is killed with SIGKILL (no shutdown, no flush), then started again. Its entries were");
    println!("  durable before it answered 202, and its initialize run calls every consumer back.");
    let needs = ["oidc/wiki", "ssl-cert/wiki", "ssl-cert/api"];
    let before: Vec<String> = needs
        .iter()
        .map(|n| {
            Ok(payload(fleet, n)
                .with_context(|| format!("no {n} payload"))?
                .0)
        })
        .collect::<anyhow::Result<_>>()?;
    fleet.kill("forge");
    let killed_at = std::time::SystemTime::now();
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
        let redelivered = needs
            .iter()
            .all(|n| payload_written(fleet, n).is_some_and(|t| t > killed_at));
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
    for (n, digest) in needs.iter().zip(&before) {
        if payload(fleet, n).map(|p| p.0).as_ref() != Some(digest) {
            bail!("{n} changed across the restart: a cached response was lost");
        }
    }
    let (_, oidc) = payload(fleet, "oidc/wiki").context("no oidc/wiki payload")?;
    let oidc: Value = serde_json::from_slice(&oidc)?;
    if oidc["client_secret"] != secret {
        bail!("the oidc client_secret changed across the restart");
    }
    if !all_satisfied(&fleet.status("app").await?) {
        bail!("app has unsatisfied needs after forge's restart");
    }
    println!(
        "  app got all 3 payloads again, byte for byte the same: client_secret {}… unchanged",
        &secret[..8.min(secret.len())]
    );
    Ok("3 entries survived, same secret and certificates redelivered".into())
}

/// `path` relative to the fleet's root, for shorter lines.
fn rel(fleet: &Fleet, path: &Path) -> String {
    path.strip_prefix(&fleet.root)
        .unwrap_or(path)
        .display()
        .to_string()
}
