//! `fort audit verify --fleet DIR`: every host's copy in `DIR/<host>/` (as `fort audit
//! pull` keeps them) checked as a trail signed by that host, and held against the
//! checkpoints of it that every other copy witnessed; and what a pull found wrong with
//! the host's files (`.pulled.json`) counts against it too.

use std::path::{Path, PathBuf};

use fort_core::schema::Registry;
use fort_core::text::printable;
use serde_json::{json, Value};

use crate::audit_cli::{check_dir, Checked};
use crate::cli::audit_pull::{Pulled, PULLED_FILE};

/// One host's copy, checked.
struct HostCheck {
    host: String,
    dir: PathBuf,
    checked: Checked,
    pulled: Vec<crate::cli::audit_pull::Finding>,
}

impl HostCheck {
    fn ok(&self) -> bool {
        self.checked.ok() && self.pulled.is_empty()
    }

    /// Why it is not ok, first things first.
    fn why(&self) -> Vec<String> {
        let (v, held) = (&self.checked.verified, &self.checked.held);
        v.problems
            .iter()
            .map(ToString::to_string)
            .chain(held.problems.iter().map(|p| format!("witnessed: {p}")))
            .chain(self.pulled.iter().map(|f| {
                format!(
                    "pulled: {} (found at {}): {}",
                    printable(&f.file, 40),
                    humantime::format_rfc3339_seconds(
                        std::time::UNIX_EPOCH + std::time::Duration::from_secs(f.at)
                    ),
                    printable(&f.what, 400)
                )
            }))
            .collect()
    }

    fn line(&self) -> String {
        let (v, held) = (&self.checked.verified, &self.checked.held);
        let summary = format!(
            "{} records ({} to {}), {} checkpoints, signed through record {}; {} of its checkpoints witnessed by the others",
            v.records,
            v.first_seq.map_or("-".into(), |s| s.to_string()),
            v.last_seq.map_or("-".into(), |s| s.to_string()),
            v.checkpoints,
            v.signed_through.map_or("-".into(), |s| s.to_string()),
            held.checked,
        );
        if self.ok() {
            format!("ok      {}: {summary}", self.host)
        } else {
            let why = self.why();
            let mut out = format!(
                "BROKEN  {}: {}",
                self.host,
                why.first().map_or("", String::as_str)
            );
            for w in why.iter().skip(1).take(9) {
                out.push_str(&format!("\n          then: {w}"));
            }
            if why.len() > 10 {
                out.push_str(&format!("\n          and {} more", why.len() - 10));
            }
            out.push_str(&format!("\n          ({summary})"));
            out
        }
    }

    fn json(&self) -> Value {
        let mut doc = self.checked.json(&self.dir, &self.host);
        doc["ok"] = json!(self.ok());
        doc["pulled_findings"] = json!(self
            .pulled
            .iter()
            .map(|f| json!({"at": f.at, "file": f.file, "what": f.what}))
            .collect::<Vec<_>>());
        doc
    }
}

/// Checks every copy in `dir`; prints one line per host (or, with `json_out`, one
/// document) and returns whether every one holds.
pub fn verify_fleet(dir: &Path, hosts: &Path, json_out: bool) -> Result<bool, String> {
    let registry = Registry::load(hosts).map_err(|e| e.to_string())?;
    let mut copies: Vec<(String, PathBuf)> = Vec::new();
    let mut skipped: Vec<String> = Vec::new();
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for entry in entries {
        let entry = entry.map_err(|e| format!("{}: {e}", dir.display()))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        // Only directories named after a host: a fleet directory may hold other things.
        if name.starts_with('.') || !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        if registry.hosts().any(|(h, _)| *h == name) {
            copies.push((name, entry.path()));
        } else {
            skipped.push(name);
        }
    }
    copies.sort();
    skipped.sort();
    if copies.is_empty() {
        return Err(format!(
            "{} holds no directory named after a host in {} (fort audit pull HOST… --out {} makes them)",
            dir.display(),
            hosts.display(),
            dir.display()
        ));
    }
    let mut checks = Vec::with_capacity(copies.len());
    for (host, path) in &copies {
        let keys = registry
            .get(host)
            .map(|p| p.keys.clone())
            .unwrap_or_default();
        let witnesses: Vec<PathBuf> = copies
            .iter()
            .filter(|(h, _)| h != host)
            .map(|(_, p)| p.clone())
            .collect();
        let checked = check_dir(path, host, &keys, &witnesses)?;
        let pulled = Pulled::read(path)?.findings;
        checks.push(HostCheck {
            host: host.clone(),
            dir: path.clone(),
            checked,
            pulled,
        });
    }
    let ok = checks.iter().all(HostCheck::ok);
    if json_out {
        let doc = json!({
            "ok": ok,
            "hosts": checks.iter().map(HostCheck::json).collect::<Vec<_>>(),
            "skipped": skipped,
        });
        println!(
            "{}",
            serde_json::to_string_pretty(&doc).expect("serialises")
        );
        return Ok(ok);
    }
    let mut out = String::new();
    for c in &checks {
        out.push_str(&c.line());
        out.push('\n');
    }
    for name in &skipped {
        out.push_str(&format!(
            "skipped {}: not a host in {}\n",
            printable(name, 64),
            hosts.display()
        ));
    }
    let copies_faults: usize = checks.iter().map(|c| c.checked.held.unverified.len()).sum();
    if copies_faults > 0 {
        out.push_str(&format!(
            "note: {copies_faults} witnessed records in the copies were not signed by the host they name (faults of the copies, or keys changed since; `fort audit verify DIR --signer HOST --witnesses …` lists them)\n"
        ));
    }
    let broken: Vec<&str> = checks
        .iter()
        .filter(|c| !c.ok())
        .map(|c| c.host.as_str())
        .collect();
    if broken.is_empty() {
        out.push_str(&format!("ok: {} trails hold\n", checks.len()));
    } else {
        out.push_str(&format!(
            "BROKEN: {} (a finding recorded by a pull stays in that copy's {PULLED_FILE} until removed)\n",
            broken.join(", ")
        ));
    }
    print!("{out}");
    Ok(ok)
}
