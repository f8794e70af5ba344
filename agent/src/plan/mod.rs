//! `fort-agent plan`: what loading other files would do to the running agent, decided
//! from what it holds now and changing none of it. The CLI reads the new files and
//! sends their bytes over the admin socket; the agent validates them exactly as a
//! reload does, then compares them with its loaded view, its fulfilment state and its
//! provider entries, all read-only.

pub mod render;
pub mod request;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;

use fort_core::names::parse_entry_key;
use fort_core::schema::{CapabilitySpec, PeerKind};
use fort_fulfill::NeedsPreview;
use serde::{Deserialize, Serialize};

use crate::app::{check_own_key, App};
use crate::config::Config;
use crate::loaded::{FileBytes, Files, Loaded};

/// One new file as the CLI read it: where from (for messages) and its text.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanFile {
    pub path: PathBuf,
    pub text: String,
}

impl PlanFile {
    fn bytes(&self) -> FileBytes {
        FileBytes {
            path: self.path.clone(),
            bytes: self.text.as_bytes().to_vec(),
        }
    }
}

/// What to plan: the files a reload (or, with `config`, a restart) would load.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanRequest {
    pub hosts: PlanFile,
    /// `None`: no needs file (the host would declare no needs).
    #[serde(default)]
    pub needs: Option<PlanFile>,
    /// `None`: no capabilities file (built-ins only).
    #[serde(default)]
    pub capabilities: Option<PlanFile>,
    /// A new agent.toml; `None`: the running configuration.
    #[serde(default)]
    pub config: Option<PlanFile>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Manifests {
    pub current: String,
    pub new: String,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CapabilityCount {
    pub capability: String,
    /// Entries held for it now.
    pub entries: usize,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CapabilityChange {
    pub capability: String,
    pub fields: Vec<String>,
}

/// The need ids one host gains or loses among a capability's callers.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CallersChange {
    pub capability: String,
    pub host: String,
    pub added: Vec<String>,
    pub removed: Vec<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CapabilitiesPlan {
    pub added: Vec<String>,
    /// No longer served: requests get 404; entries stay until GC proves them absent.
    pub removed: Vec<CapabilityCount>,
    /// handler, mode, cacheResponse, triggers, description, request_schema.
    pub changed: Vec<CapabilityChange>,
    pub callers: Vec<CallersChange>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AddressChange {
    pub host: String,
    pub from: String,
    pub to: String,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RegistryPlan {
    pub hosts_added: Vec<String>,
    pub hosts_removed: Vec<String>,
    pub principals_added: Vec<String>,
    pub principals_removed: Vec<String>,
    /// Hosts and principals whose keys change: requests signed with a key no longer
    /// listed get 401 (and a host's TLS pin changes).
    pub keys_changed: Vec<String>,
    pub addresses_changed: Vec<AddressChange>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EntryNote {
    pub entry: String,
    pub reason: String,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EntriesPlan {
    /// Entries of origins no longer in hosts.json: the next GC sweep drops them.
    pub dropped: Vec<EntryNote>,
    /// Entries whose origin may no longer ask for them (403, or 404 for a capability
    /// no longer served); GC drops them once their host stops declaring them.
    pub refused: Vec<EntryNote>,
}

/// Who gains or loses the right to call what.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AccessChange {
    pub who: String,
    /// `this host` (hosts.json), `capability <name>`, `journal`, `systemd`.
    pub to: String,
    pub why: String,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AccessPlan {
    pub lost: Vec<AccessChange>,
    pub granted: Vec<AccessChange>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ConfigPlan {
    /// Whether a new agent.toml was compared at all.
    pub compared: bool,
    /// Dotted keys whose effective value changes (defaults filled in).
    pub changed_keys: Vec<String>,
    /// agent.toml is read at start only: these take effect on a restart.
    pub restart_needed: bool,
}

/// Everything loading the new files would change.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub host: String,
    /// Whether anything below changes.
    pub changes: bool,
    pub manifest_sha256: Manifests,
    pub needs: NeedsPreview,
    pub capabilities: CapabilitiesPlan,
    pub registry: RegistryPlan,
    pub entries: EntriesPlan,
    pub access: AccessPlan,
    pub config: ConfigPlan,
}

/// Validates the new files as a reload would, then compares. Reads only.
pub fn plan(app: &Arc<App>, req: &PlanRequest) -> Result<Plan, String> {
    let new_config = match &req.config {
        Some(f) => Config::from_text(&f.path, &f.text).map_err(|e| e.to_string())?,
        None => app.config.clone(),
    };
    let files = Files {
        hosts: req.hosts.bytes(),
        needs: req.needs.as_ref().map(PlanFile::bytes),
        capabilities: req.capabilities.as_ref().map(PlanFile::bytes),
    };
    let new = Loaded::from_files(&new_config, &files).map_err(|e| e.to_string())?;
    // The key the agent would sign with: the running one, unless the new config names
    // another file.
    if new_config.host_key == app.config.host_key {
        check_own_key(&new_config, &new, &app.signer).map_err(|e| e.to_string())?;
    } else {
        let signer =
            fort_core::sign::Signer::from_file(&new_config.host_key).map_err(|e| e.to_string())?;
        check_own_key(&new_config, &new, &signer).map_err(|e| e.to_string())?;
    }
    let current = app.loaded.load_full();
    let mut plan = Plan {
        host: new_config.host.clone(),
        manifest_sha256: Manifests {
            current: current.manifest_sha256.clone(),
            new: new.manifest_sha256.clone(),
        },
        needs: app.fulfiller.preview(&new.needs),
        registry: registry(&current, &new),
        ..Plan::default()
    };
    let entry_counts = app.provider.entry_counts();
    plan.capabilities = capabilities(&current, &new, &entry_counts);
    plan.entries = entries(app, &current, &new);
    plan.access = access(&current, &new, &app.config, &new_config);
    if req.config.is_some() {
        let changed_keys = config_keys(&app.config, &new_config);
        plan.config = ConfigPlan {
            compared: true,
            restart_needed: !changed_keys.is_empty(),
            changed_keys,
        };
    }
    plan.changes = !(plan.needs.is_empty()
        && plan.capabilities == CapabilitiesPlan::default()
        && plan.registry == RegistryPlan::default()
        && plan.entries == EntriesPlan::default()
        && plan.access == AccessPlan::default()
        && plan.config.changed_keys.is_empty());
    Ok(plan)
}

fn registry(current: &Loaded, new: &Loaded) -> RegistryPlan {
    let mut out = RegistryPlan::default();
    let (old, new) = (&current.registry.peers, &new.registry.peers);
    for (name, peer) in new {
        match old.get(name) {
            None => match peer.kind {
                PeerKind::Host => out.hosts_added.push(name.clone()),
                PeerKind::Principal => out.principals_added.push(name.clone()),
            },
            Some(was) => {
                if was.keys != peer.keys {
                    out.keys_changed.push(name.clone());
                }
                if was.address != peer.address {
                    out.addresses_changed.push(AddressChange {
                        host: name.clone(),
                        from: was.address.clone().unwrap_or_default(),
                        to: peer.address.clone().unwrap_or_default(),
                    });
                }
            }
        }
    }
    for (name, peer) in old {
        if !new.contains_key(name) {
            match peer.kind {
                PeerKind::Host => out.hosts_removed.push(name.clone()),
                PeerKind::Principal => out.principals_removed.push(name.clone()),
            }
        }
    }
    out
}

/// The fields of a capability, other than who may call it, that differ.
fn capability_fields(old: &CapabilitySpec, new: &CapabilitySpec) -> Vec<String> {
    [
        ("handler", old.handler != new.handler),
        ("mode", old.mode != new.mode),
        ("cacheResponse", old.cache_response != new.cache_response),
        ("triggers", old.triggers != new.triggers),
        ("description", old.description != new.description),
        ("request_schema", old.request_schema != new.request_schema),
    ]
    .into_iter()
    .filter(|(_, d)| *d)
    .map(|(n, _)| n.to_owned())
    .collect()
}

fn capabilities(
    current: &Loaded,
    new: &Loaded,
    entry_counts: &BTreeMap<String, usize>,
) -> CapabilitiesPlan {
    let mut out = CapabilitiesPlan::default();
    let empty = BTreeMap::new();
    for (name, cap) in &new.capabilities {
        let old = current.capabilities.get(name);
        match old {
            None => out.added.push(name.clone()),
            Some(old) => {
                let fields = capability_fields(old, cap);
                if !fields.is_empty() {
                    out.changed.push(CapabilityChange {
                        capability: name.clone(),
                        fields,
                    });
                }
            }
        }
        let old_callers = old.map_or(&empty, |o| &o.callers);
        let hosts: BTreeSet<&String> = old_callers.keys().chain(cap.callers.keys()).collect();
        for host in hosts {
            let none = BTreeSet::new();
            let was = old_callers.get(host).unwrap_or(&none);
            let is = cap.callers.get(host).unwrap_or(&none);
            let change = CallersChange {
                capability: name.clone(),
                host: host.clone(),
                added: is.difference(was).cloned().collect(),
                removed: was.difference(is).cloned().collect(),
            };
            if !change.added.is_empty() || !change.removed.is_empty() {
                out.callers.push(change);
            }
        }
    }
    for name in current.capabilities.keys() {
        if !new.capabilities.contains_key(name) {
            out.removed.push(CapabilityCount {
                capability: name.clone(),
                entries: entry_counts.get(name).copied().unwrap_or(0),
            });
        }
    }
    out
}

/// Whether `origin` may hold the entry for need id `id` of `cap`.
fn may_hold(cap: Option<&CapabilitySpec>, origin: &str, id: &str) -> bool {
    cap.is_some_and(|c| c.allows(origin) || c.declares(origin, id))
}

fn entries(app: &Arc<App>, current: &Loaded, new: &Loaded) -> EntriesPlan {
    let ttl = humantime::format_duration(app.config.gc.principal_ttl);
    let mut out = EntriesPlan::default();
    app.provider.store.read(|entries| {
        for key in entries.keys() {
            let Some((origin, need)) = parse_entry_key(key) else {
                continue;
            };
            let Some(was) = current.registry.get(origin) else {
                // Already unknown: the next sweep drops it whatever is loaded.
                continue;
            };
            let Some(peer) = new.registry.get(origin) else {
                out.dropped.push(EntryNote {
                    entry: key.clone(),
                    reason: format!("{origin} is no longer in hosts.json"),
                });
                continue;
            };
            let (kind, id) = (need.kind(), need.id());
            let old_cap = current.capabilities.get(kind);
            let new_cap = new.capabilities.get(kind);
            if !may_hold(old_cap, origin, id) || may_hold(new_cap, origin, id) {
                continue;
            }
            let host = peer.kind == PeerKind::Host && was.kind == PeerKind::Host;
            let reason = match (new_cap.is_some(), host) {
                (false, true) => format!("capability {kind} is no longer served: {origin}'s next request gets 404; GC drops the entry once {origin} stops declaring {need}"),
                (false, false) => format!("capability {kind} is no longer served: {origin}'s next request gets 404; the entry expires {ttl} after its last request"),
                (true, true) => format!("no longer allowed: {origin}'s next request gets 403; GC drops the entry once {origin} stops declaring {need}"),
                (true, false) => format!("no longer allowed: {origin}'s next request gets 403; the entry expires {ttl} after its last request"),
            };
            out.refused.push(EntryNote {
                entry: key.clone(),
                reason,
            });
        }
    });
    out
}

fn access(current: &Loaded, new: &Loaded, old_cfg: &Config, new_cfg: &Config) -> AccessPlan {
    let mut out = AccessPlan::default();
    let (old_peers, new_peers) = (&current.registry.peers, &new.registry.peers);
    let change = |who: &str, to: &str, why: &str| AccessChange {
        who: who.to_owned(),
        to: to.to_owned(),
        why: why.to_owned(),
    };
    for who in old_peers.keys().filter(|n| !new_peers.contains_key(*n)) {
        out.lost.push(change(
            who,
            "this host",
            "no longer in hosts.json: every request it signs gets 401",
        ));
    }
    for who in new_peers.keys().filter(|n| !old_peers.contains_key(*n)) {
        out.granted
            .push(change(who, "this host", "added to hosts.json"));
    }
    // Names gone from hosts.json are reported once, above.
    let listed =
        |list: &[String], other: &[String], out: &mut Vec<AccessChange>, to: &str, why: &str| {
            for who in list.iter().filter(|w| !other.contains(w)) {
                if old_peers.contains_key(who) && new_peers.contains_key(who) {
                    out.push(change(who, to, why));
                }
            }
        };
    for (name, cap) in &new.capabilities {
        if let Some(old) = current.capabilities.get(name) {
            let to = format!("capability {name}");
            listed(
                &old.allowed,
                &cap.allowed,
                &mut out.lost,
                &to,
                "dropped from its allowed list: requests get 403",
            );
            listed(
                &cap.allowed,
                &old.allowed,
                &mut out.granted,
                &to,
                "added to its allowed list",
            );
        }
    }
    for (to, old, new) in [
        ("journal", &old_cfg.access.journal, &new_cfg.access.journal),
        ("systemd", &old_cfg.access.systemd, &new_cfg.access.systemd),
        ("trigger", &old_cfg.access.trigger, &new_cfg.access.trigger),
        ("audit", &old_cfg.access.audit, &new_cfg.access.audit),
    ] {
        listed(
            old,
            new,
            &mut out.lost,
            to,
            &format!(
                "dropped from [access] {to} in agent.toml: requests get 403 (after a restart)"
            ),
        );
        listed(
            new,
            old,
            &mut out.granted,
            to,
            &format!("added to [access] {to} in agent.toml (after a restart)"),
        );
    }
    out
}

/// Dotted keys whose effective values differ (defaults filled in). Values are not
/// shown: `handler_environment` may hold secrets.
fn config_keys(old: &Config, new: &Config) -> Vec<String> {
    fn flatten(prefix: &str, v: &serde_json::Value, out: &mut BTreeMap<String, serde_json::Value>) {
        match v {
            // An empty table has no keys to name; its first entry will.
            serde_json::Value::Object(m) => {
                for (k, v) in m {
                    let key = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    flatten(&key, v, out);
                }
            }
            other => {
                out.insert(prefix.to_owned(), other.clone());
            }
        }
    }
    let mut a = BTreeMap::new();
    let mut b = BTreeMap::new();
    flatten(
        "",
        &serde_json::to_value(old).expect("config serialises"),
        &mut a,
    );
    flatten(
        "",
        &serde_json::to_value(new).expect("config serialises"),
        &mut b,
    );
    let keys: BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    keys.into_iter()
        .filter(|k| a.get(*k) != b.get(*k))
        .cloned()
        .collect()
}
