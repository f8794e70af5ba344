//! `acme`: certificates from an ACME CA (RFC 8555) for CSRs the consumers made with their
//! own keys, so no private key crosses the wire. One account per provider (its key in the
//! state); names per caller from the config; HTTP-01 through a webroot the provider's web
//! server serves, DNS-01 (needed for wildcards) through RFC 2136 + TSIG at a zone's
//! primary. Issuance never blocks a run: orders are placed and moved on by one step per
//! run (`$fort_pending` + `$fort_rerun_after`), and an entry being issued keeps its
//! certificate. Unchanged entries cost no request to the CA.

pub mod config;
pub mod issued;
pub mod kept;
pub mod order;
pub mod request;
pub mod state;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::json;
use tokio::sync::OnceCell;

use crate::common::isolate::{self, Attempt, Budget};
use crate::common::state::StateFile;
use crate::common::{Entry, Output, Trigger};
use crate::{Capability, RunFuture};

use config::{Checked, Config};
use order::{Ctx, Step, StepError};
use request::Request;
use state::{Backoff, EntryState, Issued, OrderRecord, State, STATE_VERSION};

pub const CAPABILITY: Capability = Capability {
    name: "acme",
    about: "certificates from an ACME CA for the consumer's CSR (HTTP-01, DNS-01)",
    check,
    run,
    vet,
    answers: &[
        "certificate",
        "chain",
        "fullchain",
        "not_after",
        "expires_at",
    ],
    failover: crate::Failover::Independent,
};

/// Orders moved on at once: each step is a few requests to the CA.
const IN_FLIGHT: usize = 8;
/// Past this, no new step is started: the agent kills a run at 60 s, and a run killed
/// before the state write would forget the orders it placed.
const BUDGET: Duration = Duration::from_secs(30);
/// The longest back-off after repeated failures.
const BACKOFF_MAX: u64 = 3600;

fn check(path: &Path) -> anyhow::Result<()> {
    Config::load(path).map(|_| ())
}

fn run(path: &Path, entries: Vec<Entry>, trigger: Trigger) -> RunFuture<'_> {
    Box::pin(async move {
        let checked = Config::load(path)?;
        reconcile_all(&checked, entries, trigger).await
    })
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// What one entry needs from the CA this run.
enum Work {
    Place(Request),
    Advance(Request, String),
}

/// The response a consumer gets.
pub fn response(i: &Issued) -> serde_json::Value {
    json!({
        "certificate": i.certificate,
        "chain": i.chain,
        "fullchain": format!("{}{}", i.certificate, i.chain),
        "not_after": i.not_after,
        // What the consumer's agent reads the expiry from (protocol §11.4): the PEM sits
        // inside JSON strings, where it does not look for certificates.
        "expires_at": i.not_after,
    })
}

/// [`response`] as it is printed, borrowed: its fields in the order serde_json sorts
/// them, `fullchain` written from its two parts.
#[derive(serde::Serialize)]
struct Printed<'a> {
    certificate: &'a str,
    chain: &'a str,
    expires_at: i64,
    #[serde(serialize_with = "concatenated")]
    fullchain: (&'a str, &'a str),
    not_after: i64,
}

fn concatenated<S: serde::Serializer>(parts: &(&str, &str), s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(&format_args!("{}{}", parts.0, parts.1))
}

/// The hash the agent gives `i`'s response (protocol §11.11), computed from the
/// certificate as printing it would be, without building or printing it: 10,000
/// certificates are 45 MB of output for an agent that already holds them.
pub fn response_sha256(i: &Issued) -> String {
    use sha2::{Digest, Sha256};
    let printed = Printed {
        certificate: &i.certificate,
        chain: &i.chain,
        expires_at: i.not_after,
        fullchain: (&i.certificate, &i.chain),
        not_after: i.not_after,
    };
    let mut hasher = Sha256::new();
    serde_json::to_writer(&mut hasher, &printed).expect("a hasher takes every byte");
    hex::encode(hasher.finalize())
}

/// `i`'s response for `e`: kept when `e` holds exactly it, printed otherwise.
fn answer(output: &mut Output, kept: &mut kept::Kept, e: &Entry, i: &Issued) {
    match &e.held {
        Some(_) => output.respond_hashed(e, &kept.sha256(&e.key, i), || response(i)),
        None => output.respond(e, response(i)),
    }
}

/// The certificate `e` holds when nothing about it changed: the same CSR and names, no
/// order or back-off under way, not expired.
fn unchanged<'a>(state: &'a State, e: &Entry, now: u64) -> Option<&'a Issued> {
    let st = state.entries.get(&e.key)?;
    if st.order.is_some() || st.backoff.is_some() {
        return None;
    }
    let i = st.issued.as_ref()?;
    let (csr_sha256, names) = request::fingerprint(&e.request)?;
    let same = i.csr_sha256 == csr_sha256
        && names.is_none_or(|n| n == i.names)
        && i.not_after > i64::try_from(now).unwrap_or(i64::MAX);
    same.then_some(i)
}

/// Why the provider's policy refuses `e` its request `req`, decided from the config
/// alone: a name the caller may not have, or a wildcard without DNS-01.
fn refusal(config: &Config, e: &Entry, req: &Request) -> Option<String> {
    if let Some(name) = config
        .allow
        .first_refused(&e.origin, req.names.iter().map(String::as_str))
    {
        return Some(format!(
            "{name} is not a name {} may get a certificate for ({})",
            e.origin,
            config.allow.describe(&e.origin)
        ));
    }
    if config.dns01.is_none() {
        if let Some(w) = req.names.iter().find(|n| n.starts_with("*.")) {
            return Some(format!(
                "{w} is a wildcard name, and this provider has no DNS-01"
            ));
        }
    }
    None
}

fn vet(
    path: &Path,
    _fleet: &crate::common::hosts::Fleet,
    entries: &[Entry],
) -> anyhow::Result<crate::Refusals> {
    let config = Config::load_policy(path)?;
    Ok(entries
        .iter()
        .filter_map(|e| {
            let why = match request::parse(&e.request) {
                Ok(req) => refusal(&config, e, &req)?,
                Err(why) => why,
            };
            Some((e.key.clone(), why))
        })
        .collect())
}

/// Whether `i` is in the last third of its lifetime (or its certificate cannot be read,
/// which a new one mends).
fn renewal_due(i: &Issued, now: u64) -> bool {
    let not_before = x509_parser::pem::parse_x509_pem(i.certificate.as_bytes())
        .ok()
        .and_then(|(_, pem)| {
            pem.parse_x509()
                .ok()
                .map(|c| c.validity().not_before.timestamp())
        });
    not_before.is_none_or(|from| issued::due(from, i.not_after, now))
}

/// The CA as reasons name it: the directory's host.
fn ca_name(directory: &str) -> String {
    let rest = directory.strip_prefix("https://").unwrap_or(directory);
    rest.split('/').next().unwrap_or(rest).to_owned()
}

pub async fn reconcile_all(
    checked: &Checked,
    entries: Vec<Entry>,
    _trigger: Trigger,
) -> anyhow::Result<Output> {
    let started = Instant::now();
    let deadline = started + BUDGET;
    let config = &checked.config;
    let file = StateFile::new(&config.state);
    let mut state: State = file.load(STATE_VERSION)?;
    let mut kept = kept::Kept::load(&config.state);
    let now = now();
    let mut issue_log = issued::IssueLog::load(&config.state, now);
    let limits = issued::Limits {
        per_entry: config.max_certificates_per_week,
        per_caller: config.max_certificates_per_caller_per_week,
        orders_per_caller: config.max_orders_per_caller_per_hour,
    };
    let mut not_due = 0usize;
    let mut output = Output::default();
    let mut dirty = false;
    let mut work: Vec<(String, Work)> = Vec::new();
    let mut refused = 0usize;
    let mut waiting = 0usize;

    // Orders under way count against the limits until they end.
    for (key, st) in &state.entries {
        if let Some(o) = &st.order {
            issue_log.ordered(key, &o.names);
        }
    }

    for e in &entries {
        // An entry whose certificate is still good: answered without a signature check
        // (its CSR was checked when it was issued) and without the CA.
        if !e.renew {
            if let Some(i) = unchanged(&state, e, now) {
                if config
                    .allow
                    .first_refused(&e.origin, i.names.iter().map(String::as_str))
                    .is_none()
                {
                    answer(&mut output, &mut kept, e, i);
                    continue;
                }
            }
        }
        let req = match request::parse(&e.request) {
            Ok(r) => r,
            Err(why) => {
                output.refuse(e, why);
                refused += 1;
                continue;
            }
        };
        if let Some(mut why) = refusal(config, e, &req) {
            // The certificate it had is not revoked: it serves until it expires.
            if let Some(i) = state
                .entries
                .get(&e.key)
                .and_then(|st| st.issued.as_ref())
                .filter(|i| i.not_after > now as i64)
            {
                why.push_str(&format!(
                    "; the certificate it had stays valid until {}",
                    humantime::format_rfc3339_seconds(
                        UNIX_EPOCH + Duration::from_secs(i.not_after.max(0) as u64)
                    )
                ));
            }
            output.refuse(e, why);
            refused += 1;
            continue;
        }
        let st = state.entries.entry(e.key.clone()).or_default();
        // An order for another CSR is given up; its challenge answers are removed.
        if let Some(o) = st
            .order
            .take_if(|o| o.csr_sha256 != req.csr_sha256 || o.names != req.names)
        {
            state.orphans.extend(o.published);
            dirty = true;
        }
        if st
            .backoff
            .take_if(|b| b.csr_sha256 != req.csr_sha256)
            .is_some()
        {
            dirty = true;
        }
        let current = st.issued.as_ref().filter(|i| {
            i.csr_sha256 == req.csr_sha256 && i.names == req.names && i.not_after > now as i64
        });
        if let Some(o) = &st.order {
            work.push((e.key.clone(), Work::Advance(req, o.url.clone())));
        } else if let Some(b) = st.backoff.as_ref().filter(|b| b.until > now) {
            if b.refused {
                output.refuse(e, &b.reason);
                refused += 1;
            } else {
                let wait = b.until - now;
                output.pending(e, format!("{}; trying again in {wait} s", b.reason));
                output.rerun_within(wait);
            }
        } else if let Some(i) = current.filter(|i| !e.renew || !renewal_due(i, now)) {
            // A renewal asked for long before the certificate's last third keeps it: the
            // CA counts every duplicate against limits all callers share.
            not_due += usize::from(e.renew);
            answer(&mut output, &mut kept, e, i);
        } else if let Some(why) = {
            // The entry's certificate for these names is due (whatever key it asks with
            // now: a consumer renews with a new one).
            let renewing = st.issued.as_ref().is_some_and(|i| {
                i.names == req.names && (i.not_after <= now as i64 || renewal_due(i, now))
            });
            issue_log.held_back(&e.key, &req.names, limits, renewing, now)
        } {
            output.pending(e, format!("a new certificate waits: {why}"));
            waiting += 1;
        } else {
            issue_log.placing(&e.key, &req.names);
            work.push((e.key.clone(), Work::Place(req)));
        }
    }

    // Entries that left the input: their orders' answers removed, certificates revoked
    // when configured, then forgotten.
    let present: BTreeSet<&str> = entries.iter().map(|e| e.key.as_str()).collect();
    let released: Vec<String> = state
        .entries
        .keys()
        .filter(|k| !present.contains(k.as_str()))
        .cloned()
        .collect();
    let mut revocations: Vec<(String, String)> = Vec::new();
    for key in released {
        let st = state.entries.remove(&key).unwrap_or_default();
        dirty = true;
        if let Some(o) = st.order {
            state.orphans.extend(o.published);
        }
        match st.issued {
            Some(i) if config.revoke_on_release && i.not_after > now as i64 => {
                // Kept until the CA has it revoked.
                state.entries.insert(
                    key.clone(),
                    EntryState {
                        issued: Some(i.clone()),
                        ..EntryState::default()
                    },
                );
                revocations.push((key, i.certificate));
            }
            _ => {}
        }
    }

    let mut failure: Option<String> = None;
    let needs_account = !work.is_empty() || !revocations.is_empty();
    let mut ctx = Ctx {
        checked,
        account: None,
        primary: OnceCell::new(),
        ca: ca_name(&config.directory),
    };
    if needs_account {
        match order::account(checked, state.account.as_ref()).await {
            Ok((account, made)) => {
                ctx.account = Some(account);
                if let Some(made) = made {
                    state.account = Some(made);
                    dirty = true;
                }
            }
            Err(StepError::Down(why) | StepError::Ca { reason: why, .. }) => {
                if dirty {
                    file.save(STATE_VERSION, &state)?;
                }
                anyhow::bail!("cannot use the ACME account at {}: {why}", config.directory);
            }
        }
    }

    let ctx = &ctx;
    // Each order's step under its own share of the run: one caller's order that hangs or
    // trips a bug waits alone.
    let budget = Budget {
        deadline,
        per_entry: Duration::from_secs(config.timeout_seconds.saturating_mul(2)),
        in_flight: IN_FLIGHT,
    };
    let placing: BTreeSet<String> = work
        .iter()
        .filter(|(_, w)| matches!(w, Work::Place(_)))
        .map(|(k, _)| k.clone())
        .collect();
    let results = isolate::each(work, budget, |w| async move {
        match &w {
            Work::Place(req) => order::place(ctx, req).await,
            Work::Advance(req, url) => order::advance(ctx, url, req).await,
        }
    })
    .await;
    // The CA answered this run (the account, fetched above, or a step): a step that could
    // not reach it failed alone, and waits; otherwise the CA is down and the run fails.
    let ca_answered = ctx.account.is_some()
        || results
            .iter()
            .any(|(_, a)| matches!(a, Attempt::Done(Ok(_) | Err(StepError::Ca { .. }))));
    let by_key: BTreeMap<&str, &Entry> = entries.iter().map(|e| (e.key.as_str(), e)).collect();
    let mut issued = 0usize;
    for (key, attempt) in results {
        let e = by_key[key.as_str()];
        // An order that was started counts against its caller's orders, whatever became
        // of it (the CA may have taken it before the step failed).
        if placing.contains(&key) && !matches!(attempt, Attempt::NotStarted) {
            issue_log.placed(&key, now);
        }
        let st = state.entries.entry(key.clone()).or_default();
        let result = match attempt {
            Attempt::Done(result) => result,
            Attempt::NotStarted => {
                output.pending(e, format!("waiting for its turn at {}", ctx.ca));
                output.rerun_within(1);
                waiting += 1;
                continue;
            }
            other => {
                let why = other.reason(&ctx.ca).unwrap_or_default();
                output.pending(e, why);
                output.rerun_within(config.rerun_seconds);
                waiting += 1;
                continue;
            }
        };
        let (reason, refuse) = match result {
            Ok(Step::Waiting {
                url,
                published,
                why,
            }) => {
                let req = request::parse(&e.request).expect("parsed above");
                let timeout = config.order_timeout_seconds;
                if let Some(o) = st.order.as_mut() {
                    if now.saturating_sub(o.placed_at) > timeout {
                        (
                            format!("the order at {} was not valid after {timeout} s", ctx.ca),
                            false,
                        )
                    } else {
                        o.published.extend(published);
                        output.pending(e, why);
                        output.rerun_within(config.rerun_seconds);
                        waiting += 1;
                        continue;
                    }
                } else {
                    st.order = Some(OrderRecord {
                        url,
                        csr_sha256: req.csr_sha256,
                        names: req.names,
                        placed_at: now,
                        published,
                    });
                    dirty = true;
                    output.pending(e, why);
                    output.rerun_within(config.rerun_seconds);
                    waiting += 1;
                    continue;
                }
            }
            Ok(Step::Issued(i)) => {
                if let Some(o) = st.order.take() {
                    state.orphans.extend(o.published);
                }
                issue_log.record(&key, &i.names, now);
                st.backoff = None;
                output.respond(e, response(&i));
                st.issued = Some(i);
                dirty = true;
                issued += 1;
                continue;
            }
            Ok(Step::Failed { reason, refused }) => (reason, refused),
            Err(StepError::Ca { reason, refused }) => (reason, refused),
            Err(StepError::Down(why)) if ca_answered => {
                output.pending(e, format!("{why}; tried again in a later run"));
                output.rerun_within(config.rerun_seconds);
                waiting += 1;
                continue;
            }
            Err(StepError::Down(why)) => {
                failure = failure.or(Some(why));
                continue;
            }
        };
        // The order failed: its answers go, and this entry waits before the next one.
        if let Some(o) = st.order.take() {
            state.orphans.extend(o.published);
        }
        let failures = st
            .backoff
            .as_ref()
            .map_or(0, |b| b.failures)
            .saturating_add(1);
        let wait = config
            .backoff_seconds
            .saturating_mul(1u64 << (failures - 1).min(20))
            .min(BACKOFF_MAX);
        let csr_sha256 = request::parse(&e.request)
            .map(|r| r.csr_sha256)
            .unwrap_or_default();
        st.backoff = Some(Backoff {
            until: now + wait,
            failures,
            reason: reason.clone(),
            refused: refuse,
            csr_sha256,
        });
        dirty = true;
        if refuse {
            output.refuse(e, &reason);
            refused += 1;
        } else {
            output.pending(e, format!("{reason}; trying again in {wait} s"));
            output.rerun_within(wait);
            waiting += 1;
        }
    }

    let mut revoked = 0usize;
    for (key, certificate) in revocations {
        match order::revoke(ctx, &certificate).await {
            Ok(()) => {
                revoked += 1;
                state.entries.remove(&key);
            }
            // Already revoked, or the CA will not: nothing more to do for it.
            Err(StepError::Ca { reason, .. }) => {
                eprintln!("acme: revoking the certificate of {key}: {reason}");
                state.entries.remove(&key);
            }
            Err(StepError::Down(why)) => failure = failure.or(Some(why)),
        }
    }

    // Challenge answers of orders that ended; kept while they cannot be removed.
    if !state.orphans.is_empty() {
        let orphans = std::mem::take(&mut state.orphans);
        for p in orphans {
            if let Err(StepError::Down(why) | StepError::Ca { reason: why, .. }) =
                order::unpublish(ctx, std::slice::from_ref(&p)).await
            {
                failure = failure.or(Some(why));
                state.orphans.push(p);
            }
        }
        dirty = true;
    }

    if dirty {
        file.save(STATE_VERSION, &state)?;
    }
    kept.save(&present);
    issue_log.save();
    if let Some(why) = failure {
        anyhow::bail!("{why}; nothing is answered this run");
    }
    eprintln!(
        "acme: {} entries: {issued} issued, {waiting} waiting, {refused} refused, {revoked} revoked, {not_due} renewals not due; {} ms",
        entries.len(),
        started.elapsed().as_millis()
    );
    Ok(output)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::common::entries::payload_sha256;

    #[test]
    fn the_hash_of_a_response_is_that_of_its_printed_form() {
        let i = Issued {
            csr_sha256: "00".into(),
            names: vec!["a.test".into()],
            certificate: "-----BEGIN CERTIFICATE-----\nMIIB\"\\\u{1}é\n-----END CERTIFICATE-----\n"
                .into(),
            chain: "-----BEGIN CERTIFICATE-----\nMIIC\t\n-----END CERTIFICATE-----\n".into(),
            not_after: 1_796_022_433,
        };
        assert_eq!(response_sha256(&i), payload_sha256(&response(&i)));
        // The form of the response, pinned: a change here must change kept::RESPONSE_FORM,
        // or hashes recorded for the old form would keep it.
        assert_eq!(
            response_sha256(&i),
            "be4875d2c9758d4a47ff73f3f29f93923a4cca6d3d562eb27e08f453fd085311"
        );
    }
}
