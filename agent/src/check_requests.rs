//! `fort-agent check --needs FILE --capabilities FILE`: a consumer's requests held
//! against a provider's request schemas, for deployments that do not use the NixOS
//! module (which does the same at evaluation through the capability interfaces).

use std::path::PathBuf;

use anyhow::{bail, Context};
use fort_core::schema::keys::KEY_REF;
use fort_core::schema::refs::REF_KEY;
use fort_core::schema::{load_capabilities, load_needs, Registry};
use serde_json::Value;

/// The files and names of one consumer-against-provider check.
#[derive(Debug, Clone)]
pub struct RequestCheck {
    pub needs: PathBuf,
    pub capabilities: PathBuf,
    pub hosts: PathBuf,
    /// Only needs `from` this host, and each must be offered. Unset: every need whose
    /// type the capabilities file offers.
    pub provider: Option<String>,
    /// The consumer's host name: its need ids must be among the callers.
    pub consumer: Option<String>,
    /// What the provider refuses at its door before any schema (its agent.toml; the
    /// defaults when it is not known).
    pub limits: DoorLimits,
}

/// The limits a provider applies to a request before it looks at it (docs/protocol.md
/// §6.1): a request past any of them is refused at run time, so the check refuses it too.
#[derive(Debug, Clone, Copy)]
pub struct DoorLimits {
    /// `max_request_bytes`: one stored request, as compact JSON (413 past it).
    pub max_request_bytes: usize,
    /// `body_limit`: the whole body that carries it (413 past it).
    pub body_limit: usize,
}

impl Default for DoorLimits {
    fn default() -> DoorLimits {
        DoorLimits {
            max_request_bytes: crate::config::defaults::max_request_bytes(),
            body_limit: crate::config::defaults::body_limit(),
        }
    }
}

impl DoorLimits {
    /// Those of the provider whose agent.toml is `config`.
    pub fn of(config: &crate::config::Config) -> DoorLimits {
        DoorLimits {
            max_request_bytes: config.max_request_bytes,
            body_limit: config.body_limit,
        }
    }

    /// Why the provider refuses `request` for `need` at the door, if it does. A request
    /// built from other needs' values is held to what is known of it: its own members
    /// can only grow when those are filled in.
    fn refusal(&self, need: &str, request: &Value) -> Option<String> {
        let size = serde_json::to_vec(request).map_or(usize::MAX, |b| b.len());
        if size > self.max_request_bytes {
            return Some(format!(
                "the request is {size} bytes as compact JSON; the provider stores at most {} (max_request_bytes), and answers 413",
                self.max_request_bytes
            ));
        }
        let depth = fort_core::wire::json_depth(request);
        if depth > fort_core::wire::MAX_REQUEST_DEPTH {
            return Some(format!(
                "the request nests {depth} levels deep; the provider takes at most {}, and answers 400",
                fort_core::wire::MAX_REQUEST_DEPTH
            ));
        }
        // The body around it: {"need": …, "request": …, "renew": true}.
        let body = size.saturating_add(need.len()).saturating_add(64);
        if body > self.body_limit {
            return Some(format!(
                "the request's body is about {body} bytes; the provider reads at most {} (body_limit), and answers 413",
                self.body_limit
            ));
        }
        None
    }
}

/// JSON pointers of every reference in `v` (to a payload or a key): their values are only
/// known at run time.
fn reference_paths(v: &Value, at: &str, out: &mut Vec<String>) {
    match v {
        Value::Object(map) if map.contains_key(REF_KEY) || map.contains_key(KEY_REF) => {
            out.push(at.to_owned())
        }
        Value::Object(map) => {
            for (k, child) in map {
                let k = k.replace('~', "~0").replace('/', "~1");
                reference_paths(child, &format!("{at}/{k}"), out);
            }
        }
        Value::Array(items) => {
            for (i, child) in items.iter().enumerate() {
                reference_paths(child, &format!("{at}/{i}"), out);
            }
        }
        _ => {}
    }
}

fn under(path: &str, prefix: &str) -> bool {
    path == prefix || path.starts_with(&format!("{prefix}/"))
}

/// `Ok(summary)` when every request fits; `Err` lists every problem, one per line.
pub fn check_requests(c: &RequestCheck) -> anyhow::Result<String> {
    let registry = Registry::load(&c.hosts).context("hosts")?;
    let needs = load_needs(&c.needs, &registry).context("needs")?;
    let caps = load_capabilities(&c.capabilities, &registry).context("capabilities")?;
    if let Some(p) = &c.provider {
        if !registry.is_host(p) {
            bail!("--provider {p}: not a host in {}", c.hosts.display());
        }
    }
    let mut problems = Vec::new();
    let (mut checked, mut unchecked, mut with_refs) = (0, 0, 0);
    for (key, spec) in &needs {
        if c.provider.as_ref().is_some_and(|p| !spec.from.names(p)) {
            continue;
        }
        let Some(cap) = caps.get(key.kind()) else {
            if let Some(p) = &c.provider {
                problems.push(format!(
                    "{key}: {p} offers no capability {} in {}",
                    key.kind(),
                    c.capabilities.display()
                ));
            }
            continue;
        };
        if let Some(me) = &c.consumer {
            if !cap.declares(me, key.id()) && !cap.allowed.contains(me) {
                problems.push(format!(
                    "{key}: {me} is not among the callers of {} for id {} (the provider would answer 403)",
                    key.kind(),
                    key.id()
                ));
            }
        }
        if let Some(why) = c.limits.refusal(key.as_str(), &spec.request) {
            problems.push(format!("{key}: {why}"));
        }
        let Some(schema) = &cap.request_schema else {
            unchecked += 1;
            continue;
        };
        checked += 1;
        let mut refs = Vec::new();
        reference_paths(&spec.request, "", &mut refs);
        if !refs.is_empty() {
            with_refs += 1;
        }
        for (at, message) in schema.violations(&spec.request) {
            if refs.iter().any(|r| under(&at, r)) {
                continue;
            }
            problems.push(format!("{key}: request {message}"));
        }
    }
    if !problems.is_empty() {
        bail!(
            "{} problem(s) with the requests of {} against {}:\n  {}",
            problems.len(),
            c.needs.display(),
            c.capabilities.display(),
            problems.join("\n  ")
        );
    }
    let of = c
        .provider
        .as_ref()
        .map(|p| format!("{p}'s"))
        .unwrap_or_else(|| "the".into());
    let mut summary = format!(
        "ok: {checked} request{} fit {of} request schemas",
        if checked == 1 { "" } else { "s" }
    );
    if unchecked > 0 {
        summary.push_str(&format!(
            "; {unchecked} capabilit{} without a schema accept any request",
            if unchecked == 1 { "y" } else { "ies" }
        ));
    }
    if with_refs > 0 {
        summary.push_str(&format!(
            "; values built from other needs ({with_refs} request{}) are checked when sent",
            if with_refs == 1 { "" } else { "s" }
        ));
    }
    Ok(summary)
}
