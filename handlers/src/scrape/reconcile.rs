//! Every entry in, every answer out: per entry, the target Prometheus scrapes at its
//! caller's own address from the fleet registry, on a port and with labels the provider
//! allows that caller; per caller, one `file_sd` target file with its entries' targets.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::config::Config;
use super::request::Exporter;
use crate::common::entries::payload_sha256;
use crate::common::{Entry, Output};

/// The version of the state document; a later release upgrades from it.
pub const VERSION: u32 = 1;

#[derive(Debug, Default, Serialize, Deserialize)]
pub struct State {
    /// Entry key → the exporter it has (its `job` as asked: the label is
    /// [`job_label`]'s).
    pub entries: BTreeMap<String, Exporter>,
    /// Caller → SHA-256 of the target file written for it: only these files are ever
    /// replaced or removed.
    pub files: BTreeMap<String, String>,
}

/// Where a caller is, as the fleet registry says.
pub trait Addresses {
    /// `origin`'s address as a target's host (`10.0.0.2`, `[fd00::2]`, `app.lan`), `None`
    /// for principals and unknown names.
    fn address_of(&self, origin: &str) -> Option<String>;
}

impl Addresses for crate::common::hosts::Fleet {
    fn address_of(&self, origin: &str) -> Option<String> {
        let host = self.host_of(origin)?;
        Some(if host.contains(':') {
            format!("[{host}]")
        } else {
            host
        })
    }
}

impl Addresses for BTreeMap<String, String> {
    fn address_of(&self, origin: &str) -> Option<String> {
        self.get(origin).cloned()
    }
}

/// What one run did, for the log.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub kept: usize,
    pub added: usize,
    pub changed: usize,
    pub refused: usize,
    pub released: usize,
}

/// Whether the provider gives `origin` this exporter: its port and labels.
fn allowed(config: &Config, origin: &str, e: &Exporter) -> Result<(), String> {
    if !config.port_allowed(origin, e.port) {
        return Err(format!(
            "port {} is not one {origin} may be scraped on ({})",
            e.port,
            config.describe_ports(origin)
        ));
    }
    for name in e.labels.keys() {
        if config.reserved(name) {
            return Err(format!(
                "the label {name} is reserved (job, instance, __…, fort_host and fort_need are set by the provider)"
            ));
        }
        if !config.labels.permits(origin, name) {
            return Err(format!(
                "the label {name} is not one {origin} may set ({})",
                config.labels.describe(origin)
            ));
        }
    }
    Ok(())
}

/// The entry's exporter and its target's host, or why not.
fn decide(
    config: &Config,
    hosts: &dyn Addresses,
    entry: &Entry,
) -> Result<(Exporter, String), String> {
    let e = Exporter::parse(&entry.request, entry.need.id())?;
    allowed(config, &entry.origin, &e)?;
    let host = hosts.address_of(&entry.origin).ok_or_else(|| {
        format!(
            "{} has no address in the fleet registry to be scraped at (only hosts are)",
            entry.origin
        )
    })?;
    Ok((e, host))
}

/// The entries the provider's policy refuses, decided from the config and the fleet's
/// hosts alone: what the fleet check holds requests against.
pub fn vet(config: &Config, hosts: &dyn Addresses, entries: &[Entry]) -> crate::Refusals {
    entries
        .iter()
        .filter_map(|e| Some((e.key.clone(), decide(config, hosts, e).err()?)))
        .collect()
}

/// The `job` label of a caller's exporter: the job it asked for (or its need id) under
/// the caller's name, `<caller>:<job>`. The provider's, not the caller's: no caller can
/// put its targets in another caller's job or one the operator scrapes itself, and `:`
/// is in neither a host's name nor a job's, so two callers never share one.
pub fn job_label(origin: &str, e: &Exporter) -> String {
    format!("{origin}:{}", e.job)
}

/// Prometheus' target group for one entry: its caller's address, and labels that name
/// the caller and the need (which no request can set).
fn group(config: &Config, key: &str, origin: &str, host: &str, e: &Exporter) -> Value {
    let need = key.split_once(':').map_or(key, |(_, n)| n);
    let mut labels = serde_json::Map::new();
    for (k, v) in &e.labels {
        labels.insert(k.clone(), json!(v));
    }
    labels.insert("job".into(), json!(job_label(origin, e)));
    labels.insert("__metrics_path__".into(), json!(e.path));
    labels.insert("__scheme__".into(), json!(config.scheme.as_str()));
    labels.insert("fort_host".into(), json!(origin));
    labels.insert("fort_need".into(), json!(need));
    json!({"targets": [format!("{host}:{}", e.port)], "labels": labels})
}

fn response(origin: &str, host: &str, e: &Exporter) -> Value {
    json!({
        "target": format!("{host}:{}", e.port),
        "job": job_label(origin, e),
        "path": e.path,
        "labels": e.labels,
    })
}

/// Decides every entry and changes `state.entries`; returns the output, what it did,
/// whether the state changed, and each caller's target file as it must be now.
pub fn reconcile(
    config: &Config,
    hosts: &dyn Addresses,
    state: &mut State,
    entries: &[Entry],
) -> (Output, Counts, bool, BTreeMap<String, Vec<u8>>) {
    let mut counts = Counts::default();
    let mut changed = false;
    let present: BTreeSet<&str> = entries.iter().map(|e| e.key.as_str()).collect();
    let before = state.entries.len();
    state.entries.retain(|k, _| present.contains(k.as_str()));
    counts.released = before - state.entries.len();
    changed |= counts.released > 0;

    let mut output = Output::default();
    let mut groups: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    for entry in entries {
        match decide(config, hosts, entry) {
            Ok((e, host)) => {
                match state.entries.get(&entry.key) {
                    None => counts.added += 1,
                    Some(old) if *old != e => counts.changed += 1,
                    Some(_) => counts.kept += 1,
                }
                groups.entry(entry.origin.clone()).or_default().push(group(
                    config,
                    &entry.key,
                    &entry.origin,
                    &host,
                    &e,
                ));
                let response = response(&entry.origin, &host, &e);
                let sha = payload_sha256(&response);
                output.respond_hashed(entry, &sha, || response);
                if state.entries.get(&entry.key) != Some(&e) {
                    state.entries.insert(entry.key.clone(), e);
                    changed = true;
                }
            }
            Err(reason) => {
                counts.refused += 1;
                // A refused change keeps the target it had while the provider would
                // still give it (its port and labels allowed, its caller a host).
                let kept = state.entries.get(&entry.key).and_then(|old| {
                    allowed(config, &entry.origin, old).ok()?;
                    Some((old.clone(), hosts.address_of(&entry.origin)?))
                });
                match kept {
                    Some((old, host)) => {
                        groups.entry(entry.origin.clone()).or_default().push(group(
                            config,
                            &entry.key,
                            &entry.origin,
                            &host,
                            &old,
                        ));
                        output.refuse(
                            entry,
                            format!(
                                "{reason}; the target it had ({host}:{}) stays scraped",
                                old.port
                            ),
                        );
                    }
                    None => {
                        changed |= state.entries.remove(&entry.key).is_some();
                        output.refuse(entry, reason);
                    }
                }
            }
        }
    }
    let files = groups
        .into_iter()
        .map(|(origin, groups)| {
            let mut bytes = serde_json::to_vec_pretty(&groups).expect("JSON serialises");
            bytes.push(b'\n');
            (origin, bytes)
        })
        .collect();
    (output, counts, changed, files)
}

/// `<targets_dir>/<origin>.json`; a caller's name is a fort name, so it is one file of
/// the directory and no other.
pub fn file_of(config: &Config, origin: &str) -> Option<std::path::PathBuf> {
    let plain = !origin.is_empty()
        && origin.len() <= 64
        && !origin.starts_with(['.', '-'])
        && origin
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-_".contains(&b));
    plain.then(|| config.targets_dir.join(format!("{origin}.json")))
}

/// Writes the target files that changed (all of them when `look`: one changed by hand
/// is put back) and removes those of callers that have none now; records what it wrote.
/// True when the state changed. `Err`: the directory cannot be written, and the run
/// fails.
pub fn write_files(
    config: &Config,
    state: &mut State,
    files: &BTreeMap<String, Vec<u8>>,
    look: bool,
) -> anyhow::Result<(bool, usize)> {
    use crate::common::files;
    let mut changed = false;
    let mut written = 0;
    if !config.targets_dir.is_dir() {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(&config.targets_dir)
            .map_err(|e| anyhow::anyhow!("cannot make {}: {e}", config.targets_dir.display()))?;
    }
    for (origin, bytes) in files {
        let Some(path) = file_of(config, origin) else {
            continue;
        };
        let sha = fort_core::canonical::sha256_hex(bytes);
        if !look && state.files.get(origin) == Some(&sha) {
            continue;
        }
        // 0644: Prometheus runs as its own user.
        if files::replace_if_changed(&path, bytes, 0o644)
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?
        {
            written += 1;
        }
        if state.files.get(origin) != Some(&sha) {
            state.files.insert(origin.clone(), sha);
            changed = true;
        }
    }
    let gone: Vec<String> = state
        .files
        .keys()
        .filter(|o| !files.contains_key(*o))
        .cloned()
        .collect();
    for origin in gone {
        if let Some(path) = file_of(config, &origin) {
            files::remove(&path)
                .map_err(|e| anyhow::anyhow!("cannot remove {}: {e}", path.display()))?;
        }
        state.files.remove(&origin);
        changed = true;
        written += 1;
    }
    Ok((changed, written))
}
