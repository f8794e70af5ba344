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
/// them. A handler that is not on this machine (files rendered without the store paths
/// they name) is not run, and the report says so.
pub fn hold(hosts: &[HostFiles<'_>]) -> Held {
    let mut held = Held::default();
    let mut asked: BTreeMap<Served, serde_json::Map<String, Value>> = BTreeMap::new();
    let mut answers: BTreeMap<(PathBuf, String), Result<Vec<String>, String>> = BTreeMap::new();
    let mut failovers: BTreeMap<(PathBuf, String, PathBuf), Result<Option<Backend>, String>> =
        BTreeMap::new();
    // Per need with several providers on a shared backend: each provider's backend.
    let mut shared: BTreeMap<(String, String), Vec<(String, Backend)>> = BTreeMap::new();
    let mut later = 0usize;
    for consumer in hosts {
        let Ok(registry) = Registry::load(consumer.hosts) else {
            continue; // reported by the host's own check
        };
        let Ok(needs) = load_needs(consumer.needs, &registry) else {
            continue;
        };
        // Every provider a need names must hold what it asks (§11.13).
        let served_needs = needs.iter().flat_map(|(key, spec)| {
            hosts
                .iter()
                .filter(|h| spec.from.names(h.name))
                .map(move |provider| (key, spec, provider))
        });
        for (key, spec, provider) in served_needs {
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
            // A need with several providers: the capability must be one that fails over.
            if spec.from.several() && served.handler.is_file() {
                let said = failovers
                    .entry((
                        served.handler.clone(),
                        served.name.clone(),
                        served.config.clone(),
                    ))
                    .or_insert_with(|| failover_of(&served));
                match &*said {
                    Err(why) => held.problems.push(format!(
                        "{} → {}: {key}: from names {} providers, but {} takes one: {why}",
                        consumer.name,
                        provider.name,
                        spec.from.all().len(),
                        key.kind()
                    )),
                    Ok(Some(backend)) => shared
                        .entry((consumer.name.to_owned(), key.to_string()))
                        .or_default()
                        .push((provider.name.to_owned(), backend.clone())),
                    Ok(None) => {}
                }
            }
            // Each file's pointer must start at a member the capability's answers have.
            if served.handler.is_file() {
                let members = answers
                    .entry((served.handler.clone(), served.name.clone()))
                    .or_insert_with(|| members_of(&served));
                for f in &spec.files {
                    let first = f.pointer.split('/').nth(1).unwrap_or("");
                    if let (false, Ok(known)) = (f.pointer.is_empty(), &*members) {
                        if !known.iter().any(|m| m == first) {
                            held.problems.push(format!(
                                "{} → {}: {key}: file {} points at {}, which no answer of {}'s {} has ({})",
                                consumer.name,
                                provider.name,
                                f.path.display(),
                                f.pointer,
                                provider.name,
                                key.kind(),
                                known.join(", ")
                            ));
                        }
                    }
                }
            }
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
    for ((consumer, key), providers) in shared {
        held.problems
            .extend(shared_backend_problems(&consumer, &key, &providers));
    }
    for (served, entries) in asked {
        let what = format!(
            "{}'s {} ({} request{})",
            served.provider,
            served.capability,
            entries.len(),
            if entries.len() == 1 { "" } else { "s" }
        );
        if !served.handler.is_file() {
            held.lines.push(format!(
                "{what}: allowances not held here ({} is not on this machine)",
                served.handler.display()
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

/// `fort-handler <name> --config FILE --answers`: the members every response has.
fn members_of(served: &Served) -> Result<Vec<String>, String> {
    let out = Command::new(&served.handler)
        .arg(&served.name)
        .arg("--config")
        .arg(&served.config)
        .arg("--answers")
        .env_clear()
        .output()
        .map_err(|e| format!("cannot run {}: {e}", served.handler.display()))?;
    serde_json::from_slice(&out.stdout).map_err(|e| format!("{} --answers: {e}", served.name))
}

/// The backend a provider of a shared-backend capability says it uses.
#[derive(Clone, serde::Deserialize)]
struct Backend {
    backend: String,
    #[serde(default)]
    peers: Vec<String>,
}

/// `fort-handler <name> --failover --config FILE`: `Err(why)` when a need may name only
/// one provider of it (docs/protocol.md §11.13), the backend and peers of a capability
/// whose providers share one. A handler that cannot say is taken at its word that it
/// fails over: releases before this one had no such flag.
fn failover_of(served: &Served) -> Result<Option<Backend>, String> {
    let Ok(out) = Command::new(&served.handler)
        .arg(&served.name)
        .arg("--failover")
        .arg("--config")
        .arg(&served.config)
        .env_clear()
        .output()
    else {
        return Ok(None);
    };
    let said: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    match said["failover"].as_str() {
        Some("one-provider") => {
            let why = said["why"].as_str().unwrap_or("its handler says so");
            Err(fort_core::text::printable(why, 300))
        }
        Some("shared-backend") => serde_json::from_value(said)
            .map(Some)
            .map_err(|e| format!("its handler's --failover cannot be read: {e}")),
        _ => Ok(None),
    }
}

/// Providers of one need that share a backend must name the same one, and each must list
/// the others as peers: a standby takes over only what a listed peer made.
fn shared_backend_problems(
    consumer: &str,
    key: &str,
    providers: &[(String, Backend)],
) -> Vec<String> {
    let mut problems = Vec::new();
    let Some((first, first_backend)) = providers.first() else {
        return problems;
    };
    for (provider, b) in providers {
        if b.backend != first_backend.backend {
            problems.push(format!(
                "{consumer} → {provider}: {key}: {provider} serves it on {}, {first} on {}: providers of one need must share one backend",
                fort_core::text::printable(&b.backend, 200),
                fort_core::text::printable(&first_backend.backend, 200)
            ));
        }
        for (other, _) in providers.iter().filter(|(o, _)| o != provider) {
            if !b.peers.contains(other) {
                problems.push(format!(
                    "{consumer} → {provider}: {key}: {provider} does not list {other} among its peers, so it would not take over what {other} made for the need"
                ));
            }
        }
    }
    problems
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
