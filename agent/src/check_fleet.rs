//! `fort-agent check --fleet DIR`: a whole fleet's generated files checked together,
//! before anything is deployed. `DIR/<host>/` holds what that host would install
//! (`hosts.json`, `needs.json`, `capabilities.json`, and an `agent.toml` naming them);
//! each host is checked as its own build checks it, every host must carry the same
//! registry, and every consumer's requests are held against each provider's request
//! schemas and callers. The NixOS module's `lib.fleetCheck` builds `DIR` from the
//! evaluated hosts and runs this.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use fort_core::schema::{load_needs, Registry};

use crate::check::{check, CheckOptions};
use crate::check_requests::{check_requests, RequestCheck};

/// One host's directory.
struct HostFiles {
    dir: PathBuf,
    hosts: PathBuf,
    needs: PathBuf,
    capabilities: PathBuf,
}

impl HostFiles {
    fn new(dir: PathBuf) -> HostFiles {
        HostFiles {
            hosts: dir.join("hosts.json"),
            needs: dir.join("needs.json"),
            capabilities: dir.join("capabilities.json"),
            dir,
        }
    }
}

/// Every problem found, one per line, or a summary of what was checked.
pub fn check_fleet(dir: &Path, skip_handlers: bool) -> anyhow::Result<String> {
    let mut candidates: BTreeMap<String, HostFiles> = BTreeMap::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("{}", dir.display()))? {
        let entry = entry?;
        if !entry.path().is_dir() {
            continue;
        }
        let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        candidates.insert(name, HostFiles::new(entry.path()));
    }
    // A fleet directory may hold other things (a CA's files, scripts): a host is a
    // directory named after a host of the fleet's registry (any host's hosts.json).
    let registry = candidates
        .values()
        .find_map(|h| Registry::load(&h.hosts).ok());
    let mut lines = Vec::new();
    let mut hosts: BTreeMap<String, HostFiles> = BTreeMap::new();
    for (name, files) in candidates {
        match &registry {
            Some(r) if !r.is_host(&name) => lines.push(format!(
                "note: {name}/ passed over: no host {name} in the fleet's hosts.json"
            )),
            _ => {
                hosts.insert(name, files);
            }
        }
    }
    if hosts.is_empty() {
        bail!(
            "{}: no host directories (expected <host>/hosts.json, needs.json, capabilities.json, agent.toml, for the hosts of hosts.json)",
            dir.display()
        );
    }
    let mut problems = Vec::new();

    // Each host as its own build checks it.
    for (name, h) in &hosts {
        let config = h.dir.join("agent.toml");
        if !config.exists() {
            problems.push(format!("{name}: no agent.toml in {}", h.dir.display()));
            continue;
        }
        match check(
            &config,
            CheckOptions {
                skip_key: true,
                skip_handlers,
            },
        ) {
            Ok(c) => {
                lines.push(c.summary);
                lines.extend(
                    c.warnings
                        .into_iter()
                        .map(|w| format!("warning: {name}: {w}")),
                );
            }
            Err(e) => problems.push(format!("{name}: {e:#}")),
        }
    }

    // One registry for the whole fleet: a host with another hosts.json would refuse
    // (or accept) callers the others expect it to accept (or refuse).
    let mut registries: BTreeMap<Vec<u8>, Vec<&str>> = BTreeMap::new();
    for (name, h) in &hosts {
        if let Ok(bytes) = std::fs::read(&h.hosts) {
            registries.entry(bytes).or_default().push(name);
        }
    }
    if registries.len() > 1 {
        let groups: Vec<String> = registries.values().map(|names| names.join(", ")).collect();
        problems.push(format!(
            "the hosts do not carry the same hosts.json: {} (build them together, with lib.mkFleet)",
            groups.join(" | ")
        ));
    }

    // Every consumer against each of its providers.
    let mut pairs = 0;
    for (consumer, h) in &hosts {
        if !h.needs.exists() {
            continue;
        }
        let registry = match Registry::load(&h.hosts) {
            Ok(r) => r,
            Err(_) => continue, // reported by the host's own check
        };
        let Ok(needs) = load_needs(&h.needs, &registry) else {
            continue;
        };
        let providers: BTreeSet<&str> = needs
            .values()
            .flat_map(|n| n.from.all())
            .map(String::as_str)
            .collect();
        for provider in providers {
            let Some(p) = hosts.get(provider) else {
                let what: Vec<String> = needs
                    .iter()
                    .filter(|(_, n)| n.from.names(provider))
                    .map(|(k, _)| k.to_string())
                    .collect();
                problems.push(format!(
                    "{consumer}: {} from {provider}, which is not among the fleet's hosts ({} has no {provider}/)",
                    what.join(", "),
                    dir.display()
                ));
                continue;
            };
            if !p.capabilities.exists() {
                problems.push(format!(
                    "{consumer}: needs from {provider}, which serves no capabilities ({} is missing)",
                    p.capabilities.display()
                ));
                continue;
            }
            pairs += 1;
            let c = RequestCheck {
                needs: h.needs.clone(),
                capabilities: p.capabilities.clone(),
                hosts: h.hosts.clone(),
                provider: Some(provider.to_owned()),
                consumer: Some(consumer.clone()),
                // What the provider refuses at its door, from its own agent.toml.
                limits: crate::config::Config::load(&p.dir.join("agent.toml"))
                    .map(|c| crate::check_requests::DoorLimits::of(&c))
                    .unwrap_or_default(),
            };
            match check_requests(&c) {
                Ok(summary) => lines.push(format!("{consumer} → {provider}: {summary}")),
                Err(e) => problems.push(format!("{consumer} → {provider}: {e:#}")),
            }
        }
    }
    // Every consumer's requests against its providers' allowances.
    let files: Vec<crate::check_allowances::HostFiles<'_>> = hosts
        .iter()
        .map(|(name, h)| crate::check_allowances::HostFiles {
            name,
            hosts: &h.hosts,
            needs: &h.needs,
            capabilities: &h.capabilities,
        })
        .collect();
    let held = crate::check_allowances::hold(&files);
    lines.extend(held.lines);
    problems.extend(held.problems);

    if !problems.is_empty() {
        bail!(
            "{} problem(s) in the fleet in {}:\n{}",
            problems.len(),
            dir.display(),
            problems.join("\n")
        );
    }
    lines.push(format!(
        "ok: {} host{}, {pairs} consumer → provider pair{} checked",
        hosts.len(),
        if hosts.len() == 1 { "" } else { "s" },
        if pairs == 1 { "" } else { "s" }
    ));
    Ok(lines.join("\n"))
}
