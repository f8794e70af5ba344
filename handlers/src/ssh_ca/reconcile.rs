//! Every entry in, every answer out: per entry, keep the certificate it holds (no
//! signature, no key parsed), issue a new one (new request, renewal, too little validity
//! left), or refuse it; revoke what released, refused and superseded entries held; and
//! hand every response the current KRL, CA key and known_hosts line.

use std::collections::BTreeSet;

use base64::Engine;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use ssh_key::certificate::CertType;

use super::ca::{Ca, CertSpec};
use super::config::Config;
use super::issue_log::IssueLog;
use super::request::{self, Kind, Request, MAX_PRINCIPALS, MIN_VALIDITY};
use super::state::{Issued, State};
use crate::common::{Allowances, Entry, Output};

/// Who is a host (the `"*"` host principals apply to hosts only).
pub trait Hosts {
    fn is_host(&self, name: &str) -> bool;
}

impl Hosts for crate::common::hosts::Fleet {
    fn is_host(&self, name: &str) -> bool {
        crate::common::hosts::Fleet::is_host(self, name)
    }
}

impl Hosts for BTreeSet<String> {
    fn is_host(&self, name: &str) -> bool {
        self.contains(name)
    }
}

/// What one run did, for the log.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub kept: usize,
    pub issued: usize,
    pub refused: usize,
    /// New or changed requests held back: their caller had its certificates for the hour.
    pub held: usize,
    pub released: usize,
    pub revoked: usize,
    /// The state must be saved.
    pub changed: bool,
}

/// What was decided for one entry in the first pass.
enum Decision {
    /// The cached response stays (its KRL and CA fields are refreshed if they changed).
    Keep(Value),
    Issue(IssueSpec),
    Refuse(String),
    /// The entry keeps what it has and waits (`$fort_pending`), for this reason.
    Hold(String),
    /// `{"kind": "ca"}`: no certificate, only what is to be trusted.
    Ca,
}

struct IssueSpec {
    kind: Kind,
    subject: ssh_key::PublicKey,
    principals: Vec<String>,
    validity: u64,
    hash: String,
}

/// Host principals for callers that are not hosts (people, CI): only where the config
/// names them explicitly, never through `"*"`.
fn host_principals_named(config: &Config) -> Allowances {
    Allowances(
        config
            .host_principals
            .0
            .iter()
            .filter(|(k, _)| k.as_str() != "*")
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
    )
}

/// The entries the provider's policy refuses, decided from the config and the fleet's
/// hosts alone (no CA key, no state): what the fleet check holds requests against.
pub fn vet(config: &Config, hosts: &dyn Hosts, entries: &[Entry], now: u64) -> crate::Refusals {
    let named = host_principals_named(config);
    let state = State::default();
    entries
        .iter()
        .filter_map(|e| {
            let is_host = hosts.is_host(&e.origin);
            let allow = |kind: Kind| match kind {
                Kind::Host if is_host => &config.host_principals,
                Kind::Host => &named,
                Kind::User => &config.user_principals,
            };
            let mut entry = e.clone();
            let why = decide(config, &state, false, &mut entry, allow, now).err()?;
            Some((e.key.clone(), why))
        })
        .collect()
}

/// Decides every entry, signs what must be signed, and changes `state` accordingly;
/// certificates for callers' new or changed requests are counted in `log`, and held back
/// past its limit. The caller saves the state, then the log, before printing the output.
pub fn reconcile(
    config: &Config,
    ca: &Ca,
    hosts: &dyn Hosts,
    state: &mut State,
    log: &mut IssueLog,
    entries: Vec<Entry>,
    now: u64,
) -> anyhow::Result<(Output, Counts)> {
    let mut counts = Counts::default();
    let mut krl_changed = state.prune(now);
    // Certificates of another CA key are never kept: every entry gets one of this key.
    let ca_changed = state.ca != ca.fingerprint;
    // Another key than the one that signed before (not the first run's).
    let ca_replaced = ca_changed && !state.ca.is_empty();
    if ca_changed {
        if !state.ca.is_empty() {
            tracing::warn!(
                old = %state.ca,
                new = %ca.fingerprint,
                "the CA key changed: every certificate is issued again"
            );
        }
        // Earlier certificates of the old CA stop counting once consumers trust only the
        // new one; they cannot be named in a KRL of the new CA.
        for issued in state.entries.values_mut() {
            issued.older.clear();
        }
        state.ca = ca.fingerprint.clone();
        counts.changed = true;
    }
    let host_principals_named = host_principals_named(config);

    // Released: entries the input no longer holds.
    let present: BTreeSet<&str> = entries.iter().map(|e| e.key.as_str()).collect();
    let gone: Vec<String> = state
        .entries
        .keys()
        .filter(|k| !present.contains(k.as_str()))
        .cloned()
        .collect();
    for key in gone {
        let issued = state.entries.remove(&key).expect("listed");
        let before = state.revoked.len();
        krl_changed |= state.revoke_entry(&issued, &ca.public_line, now);
        counts.revoked += state.revoked.len() - before;
        counts.released += 1;
        tracing::info!(entry = %key, serial = issued.serial, "released: its certificates are revoked");
    }

    // First pass: decide and sign.
    let mut certified: Vec<(Entry, Decision)> = Vec::with_capacity(entries.len());
    // Seconds until the first held entry may have its certificate.
    let mut held_for: Option<u64> = None;
    for mut entry in entries {
        let is_host = hosts.is_host(&entry.origin);
        let allow = |kind: Kind| match kind {
            Kind::Host if is_host => &config.host_principals,
            Kind::Host => &host_principals_named,
            Kind::User => &config.user_principals,
        };
        // Whether the certificate the entry holds is one the provider still gives it
        // (`None`: the response it holds does not say), read before `decide` takes it.
        let still = state
            .entries
            .get(&entry.key)
            .and_then(|old| still_certified(&entry, old, &allow));
        let decision = match decide(config, state, ca_changed, &mut entry, allow, now) {
            Ok(d) => d,
            Err(reason) => Decision::Refuse(reason),
        };
        let decision = match decision {
            Decision::Issue(spec) => {
                let old = state.entries.get(&entry.key);
                let superseded = old.is_some_and(|old| old.request != spec.hash);
                // A new entry or a changed request is the caller's doing, and counts
                // against its hour; a new CA key, or an allowance narrowed under the
                // certificate it holds, is the provider's, and is never held back.
                let callers_change =
                    (old.is_none() || superseded) && !ca_replaced && still != Some(false);
                let limit = config.max_new_certificates_per_caller_per_hour;
                let held = callers_change
                    .then(|| log.held_back(&entry.origin, limit, now))
                    .flatten();
                if let Some((why, wait)) = held {
                    let minutes = wait.div_ceil(60);
                    let reason = match old {
                        Some(old) if old.valid_before > now => format!(
                            "{why}; the change is made in {minutes} min, and the certificate it has stays valid until {}",
                            rfc3339(old.valid_before)
                        ),
                        _ => format!("{why}; its certificate comes in {minutes} min"),
                    };
                    held_for = Some(held_for.map_or(wait, |w| w.min(wait)));
                    counts.held += 1;
                    tracing::info!(entry = %entry.key, %reason, "held");
                    certified.push((entry, Decision::Hold(reason)));
                    continue;
                }
                let serial = state.take_serial(config.first_serial)?;
                let backdate = config.backdate.as_secs();
                let valid_after = now.saturating_sub(backdate);
                let valid_before = now.saturating_add(spec.validity);
                let signed = ca.sign(&CertSpec {
                    subject: &spec.subject,
                    kind: match spec.kind {
                        Kind::Host => CertType::Host,
                        Kind::User => CertType::User,
                    },
                    serial,
                    key_id: &entry.key,
                    principals: &spec.principals,
                    valid_after,
                    valid_before,
                    extensions: match spec.kind {
                        Kind::Host => &[],
                        Kind::User => &config.user_extensions,
                    },
                });
                // A key this CA cannot certify is that entry's refusal, never the run's
                // failure (the serial taken stays unused).
                let cert = match signed {
                    Ok(cert) => cert,
                    Err(e) => {
                        let reason = format!("the CA cannot certify this key: {e:#}");
                        tracing::warn!(entry = %entry.key, %reason, "refused");
                        counts.refused += 1;
                        certified.push((entry, Decision::Refuse(reason)));
                        continue;
                    }
                };
                let mut older = Vec::new();
                if let Some(old) = state.entries.remove(&entry.key) {
                    if superseded {
                        // What it certified is no longer asked for (another key, fewer
                        // principals): the old certificate must not stay usable.
                        let before = state.revoked.len();
                        krl_changed |= state.revoke_entry(&old, &ca.public_line, now);
                        counts.revoked += state.revoked.len() - before;
                    } else if !ca_changed {
                        older = old.live(now).collect();
                    }
                }
                state.entries.insert(
                    entry.key.clone(),
                    Issued {
                        request: spec.hash,
                        serial,
                        valid_after,
                        valid_before,
                        older,
                    },
                );
                if callers_change {
                    log.record(&entry.origin, now);
                }
                counts.issued += 1;
                tracing::info!(entry = %entry.key, serial, kind = spec.kind.name(), principals = spec.principals.len(), "issued");
                Decision::Keep(json!({
                    "kind": spec.kind.name(),
                    "certificate": cert,
                    "serial": serial,
                    "key_id": entry.key,
                    "principals": spec.principals,
                    "valid_after": valid_after,
                    "valid_before": valid_before,
                    "expires_at": valid_before,
                }))
            }
            Decision::Refuse(reason) => {
                // A refused change leaves the certificate it had valid, while the
                // provider still allows its principals; an allowance taken away revokes.
                let stays = state
                    .entries
                    .get(&entry.key)
                    .filter(|_| !ca_changed && still == Some(true))
                    .map(|old| old.valid_before);
                let reason = match stays {
                    Some(until) => format!(
                        "{reason}; the certificate it had stays valid until {}",
                        rfc3339(until)
                    ),
                    None => {
                        if let Some(old) = state.entries.remove(&entry.key) {
                            counts.changed = true;
                            let before = state.revoked.len();
                            krl_changed |= state.revoke_entry(&old, &ca.public_line, now);
                            counts.revoked += state.revoked.len() - before;
                        }
                        reason
                    }
                };
                counts.refused += 1;
                tracing::info!(entry = %entry.key, %reason, "refused");
                Decision::Refuse(reason)
            }
            Decision::Ca => {
                // Public, so every caller may have it; a certificate the entry held
                // before it asked for this is no longer asked for.
                if let Some(old) = state.entries.remove(&entry.key) {
                    counts.changed = true;
                    let before = state.revoked.len();
                    krl_changed |= state.revoke_entry(&old, &ca.public_line, now);
                    counts.revoked += state.revoked.len() - before;
                }
                counts.kept += 1;
                Decision::Keep(json!({"kind": "ca"}))
            }
            keep => {
                counts.kept += 1;
                keep
            }
        };
        certified.push((entry, decision));
    }

    counts.changed |= krl_changed || counts.issued > 0 || counts.released > 0;
    if krl_changed {
        state.krl_version = state.krl_version.saturating_add(1);
        state.krl_generated = now;
    }
    let krl = base64::engine::general_purpose::STANDARD.encode(
        state
            .krl(&format!("fort ssh-ca {}", ca.fingerprint))?
            .to_bytes(),
    );
    let known_hosts_line = format!(
        "@cert-authority {} {}",
        config.known_hosts_patterns.join(","),
        ca.public_line
    );

    // Second pass: every response carries the KRL and the CA as they are now.
    let mut output = Output::default();
    for (entry, decision) in certified {
        match decision {
            Decision::Keep(mut response) => {
                let fields = [
                    ("krl", &krl),
                    ("ca_public_key", &ca.public_line),
                    ("known_hosts_line", &known_hosts_line),
                ];
                for (field, value) in fields {
                    if response.get(field).and_then(Value::as_str) != Some(value.as_str()) {
                        response[field] = Value::from(value.as_str());
                    }
                }
                output.respond(&entry, response);
            }
            Decision::Refuse(reason) => output.refuse(&entry, reason),
            Decision::Hold(reason) => output.pending(&entry, reason),
            Decision::Issue(_) | Decision::Ca => unreachable!("decided in the first pass"),
        }
    }
    if let Some(wait) = held_for {
        output.rerun_within(wait);
    }
    // Run again when the first certificate is due for renewal, so none lapses while
    // nothing else happens (at most an hour away: the agent clamps it).
    if let Some(due) = state
        .entries
        .values()
        .map(|i| i.renew_at(config.renew_fraction))
        .min()
    {
        output.rerun_within(due.saturating_sub(now).max(1));
    }
    Ok((output, counts))
}

fn rfc3339(unix: u64) -> humantime::Rfc3339Timestamp {
    humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + std::time::Duration::from_secs(unix))
}

/// Whether the certificate `entry` holds (its cached response, of the serial `issued`
/// records) is one the provider would still give it: every principal still allowed for
/// its kind. `None` when the response does not tell (there is none, it is of another
/// serial, or it names no kind or principals).
fn still_certified<'c>(
    entry: &Entry,
    issued: &Issued,
    allow: &impl Fn(Kind) -> &'c Allowances,
) -> Option<bool> {
    let r = entry.response.as_ref()?;
    if r.get("serial").and_then(Value::as_u64) != Some(issued.serial) {
        return None;
    }
    let kind = match r.get("kind").and_then(Value::as_str) {
        Some("host") => Kind::Host,
        Some("user") => Kind::User,
        _ => return None,
    };
    let patterns = allow(kind).patterns(&entry.origin);
    let list = r
        .get("principals")
        .and_then(Value::as_array)
        .filter(|l| !l.is_empty())?;
    Some(list.iter().all(|p| {
        p.as_str()
            .is_some_and(|p| Allowances::any_permits(&patterns, p))
    }))
}

/// Keep, issue or refuse one entry. Cheap when the entry is unchanged: the request is
/// read and its principals checked against the allowances (which may have changed), but
/// its key is parsed and a certificate signed only when one must be issued.
fn decide<'c>(
    config: &'c Config,
    state: &State,
    ca_changed: bool,
    entry: &mut Entry,
    allow: impl Fn(Kind) -> &'c Allowances,
    now: u64,
) -> Result<Decision, String> {
    if request::is_ca(&entry.request)? {
        return Ok(Decision::Ca);
    }
    let req = Request::parse(&entry.request)?;
    let allowances = allow(req.kind);
    let origin = entry.origin.as_str();
    let patterns = allowances.patterns(origin);
    if patterns.is_empty() {
        return Err(format!(
            "{origin} may not ask for {} certificates",
            req.kind.name()
        ));
    }
    let mut principals = match req.principals {
        Some(list) => list,
        None if req.kind == Kind::Host => patterns
            .iter()
            .filter(|p| !p.contains('*'))
            .cloned()
            .collect(),
        None => return Err("a user certificate must name its principals".into()),
    };
    if principals.is_empty() {
        return Err(format!(
            "no principals: {origin} may have no exact host name"
        ));
    }
    if principals.len() > MAX_PRINCIPALS {
        return Err(format!("more than {MAX_PRINCIPALS} principals"));
    }
    for p in &principals {
        request::check_principal(req.kind, p)?;
        if !Allowances::any_permits(&patterns, p) {
            return Err(format!(
                "principal {p} is not one {origin} may have on a {} certificate ({})",
                req.kind.name(),
                allowances.describe(origin)
            ));
        }
    }
    principals.sort();
    principals.dedup();
    let max = match req.kind {
        Kind::Host => config.host_validity.as_secs(),
        Kind::User => config.user_validity.as_secs(),
    };
    let validity = match req.validity_seconds {
        Some(v) if v < MIN_VALIDITY => {
            return Err(format!("validity_seconds must be at least {MIN_VALIDITY}"))
        }
        Some(v) => v.min(max),
        None => max,
    };
    let hash = request_hash(req.kind, &req.public_key, &principals, validity);

    if let (Some(response), Some(issued), false) = (
        entry.response.take(),
        state.entries.get(&entry.key),
        entry.renew,
    ) {
        let same = issued.request == hash
            && response.get("serial").and_then(Value::as_u64) == Some(issued.serial)
            && response.get("certificate").is_some_and(Value::is_string);
        if same && !ca_changed && now < issued.renew_at(config.renew_fraction) {
            return Ok(Decision::Keep(response));
        }
    }
    let subject = request::public_key(&req.public_key)?;
    Ok(Decision::Issue(IssueSpec {
        kind: req.kind,
        subject,
        principals,
        validity,
        hash,
    }))
}

/// What a certificate certifies, hashed: the key's type and base64 (its comment is not
/// part of it), the sorted principals and the validity.
fn request_hash(kind: Kind, public_key: &str, principals: &[String], validity: u64) -> String {
    let mut fields = public_key.split_whitespace();
    let mut h = Sha256::new();
    h.update(kind.name());
    for part in [fields.next(), fields.next()] {
        h.update([0]);
        h.update(part.unwrap_or(""));
    }
    for p in principals {
        h.update([1]);
        h.update(p);
    }
    h.update(validity.to_be_bytes());
    hex::encode(h.finalize())
}
