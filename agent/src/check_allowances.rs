//! The fleet check's hold of every consumer's requests against its providers' allowances:
//! for each capability a provider serves with fort's own handler (`fort-handler <name>
//! --config FILE`), the consumers' requests go to that handler's `--vet`, which says which
//! its policy refuses (a name, principal or redirect URI outside the allow list) from the
//! config and the fleet's hosts alone. A key a request names (`$fort_key`) is made for
//! the check and thrown away, so a CSR names what the real one will; a request built from
//! another need's response (`$fort_ref`) can only be held when it is sent.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use fort_core::schema::refs::REF_KEY;
use fort_core::schema::{load_capabilities, load_needs, Registry};
use serde_json::{json, Value};

/// One host's generated files, as the fleet check finds them.
pub struct HostFiles<'a> {
    pub name: &'a str,
    pub hosts: &'a Path,
    pub needs: &'a Path,
    pub capabilities: &'a Path,
}

/// What the hold found: lines for the report, and problems.
#[derive(Default)]
pub struct Held {
    pub lines: Vec<String>,
    pub problems: Vec<String>,
}

/// The handler and config of a capability fort's own handler serves.
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Served {
    provider: String,
    capability: String,
    handler: PathBuf,
    name: String,
    config: PathBuf,
}

fn uses_refs(v: &Value) -> bool {
    match v {
        Value::Object(map) => map.contains_key(REF_KEY) || map.values().any(uses_refs),
        Value::Array(items) => items.iter().any(uses_refs),
        _ => false,
    }
}

/// Every consumer's requests held against the allowances of the capabilities that serve
/// them. With `skip_handlers` (files rendered on a machine without the store paths they
/// name) nothing is run, and the report says so.
pub fn hold(hosts: &[HostFiles<'_>], skip_handlers: bool) -> Held {
    let mut held = Held::default();
    let mut asked: BTreeMap<Served, serde_json::Map<String, Value>> = BTreeMap::new();
    let mut later = 0usize;
    for consumer in hosts {
        let Ok(registry) = Registry::load(consumer.hosts) else {
            continue; // reported by the host's own check
        };
        let Ok(needs) = load_needs(consumer.needs, &registry) else {
            continue;
        };
        for (key, spec) in &needs {
            let Some(provider) = hosts.iter().find(|h| h.name == spec.from) else {
                continue;
            };
            let Ok(caps) = load_capabilities(provider.capabilities, &registry) else {
                continue;
            };
            let Some(cap) = caps.get(key.kind()) else {
                continue;
            };
            let served = match (cap.handler.file_name(), cap.args.as_slice()) {
                (Some(f), [name, flag, config, ..])
                    if f == "fort-handler" && flag == "--config" =>
                {
                    Served {
                        provider: provider.name.to_owned(),
                        capability: key.kind().to_owned(),
                        handler: cap.handler.clone(),
                        name: name.clone(),
                        config: PathBuf::from(config),
                    }
                }
                _ => continue,
            };
            if uses_refs(&spec.request) {
                later += 1;
                continue;
            }
            let request = match fort_fulfill::keys::with_throwaway_keys(spec) {
                Ok(r) => r,
                Err(e) => {
                    held.problems.push(format!(
                        "{} → {}: {key}: its request cannot be made: {e}",
                        consumer.name, provider.name
                    ));
                    continue;
                }
            };
            let entry = format!("{}:{key}", consumer.name);
            asked
                .entry(served)
                .or_default()
                .insert(entry, json!({"request": request}));
        }
    }
    for (served, entries) in asked {
        let what = format!(
            "{}'s {} ({} request{})",
            served.provider,
            served.capability,
            entries.len(),
            if entries.len() == 1 { "" } else { "s" }
        );
        if skip_handlers {
            held.lines.push(format!(
                "{what}: allowances not held here (--skip-handlers: fort-handler is not on this machine)"
            ));
            continue;
        }
        let Some(provider) = hosts.iter().find(|h| h.name == served.provider) else {
            continue;
        };
        match vet(&served, provider.hosts, &Value::Object(entries)) {
            Ok(refusals) if refusals.is_empty() => held
                .lines
                .push(format!("{what}: ok: every request within its allowances")),
            Ok(refusals) => {
                for (entry, why) in refusals {
                    let (consumer, need) = entry.split_once(':').unwrap_or(("?", &entry));
                    held.problems.push(format!(
                        "{consumer} → {}: {need}: {} refuses it: {why}",
                        served.provider, served.provider
                    ));
                }
            }
            Err(e) => held.problems.push(format!("{what}: {e}")),
        }
    }
    if later > 0 {
        held.lines.push(format!(
            "{later} request{} built from other needs' responses: allowances held when sent",
            if later == 1 { "" } else { "s" }
        ));
    }
    held
}

/// `fort-handler <name> --config FILE --vet --hosts HOSTS` with `entries` on stdin: entry
/// key → why the policy refuses it.
fn vet(served: &Served, hosts: &Path, entries: &Value) -> Result<BTreeMap<String, String>, String> {
    let mut child = Command::new(&served.handler)
        .arg(&served.name)
        .arg("--config")
        .arg(&served.config)
        .arg("--vet")
        .arg("--hosts")
        .arg(hosts)
        .env_clear()
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run {}: {e}", served.handler.display()))?;
    let input = serde_json::to_vec(entries).expect("entries serialise");
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(&input)
            .map_err(|e| format!("{}: {e}", served.handler.display()))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| format!("{}: {e}", served.handler.display()))?;
    if !out.status.success() {
        return Err(format!(
            "{} {} --vet failed: {}",
            served.handler.display(),
            served.name,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    serde_json::from_slice(&out.stdout)
        .map_err(|e| format!("{} --vet answered no refusals object: {e}", served.name))
}
