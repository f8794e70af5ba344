//! Every entry in, one answer per entry out: which entries keep their client without a
//! word to the provider, which need a registration, an update or a new secret, and which
//! clients this handler registered are no longer wanted.

use std::collections::{BTreeMap, HashSet};
use std::time::Instant;

use fort_core::names::{is_host_name, is_principal_name};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::config::Config;
use super::request::{Metadata, Request};
use super::server::{Failure, Registration, Server};
use crate::common::{Entry, Output, Trigger};

/// The state file's version.
pub const STATE_VERSION: u32 = 1;

/// What this handler registered: the proof of ownership every update and delete goes by.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct State {
    /// Entry key → its client.
    #[serde(default)]
    pub clients: BTreeMap<String, Client>,
    /// Clients to delete: replaced by a new registration (a rotated secret), or released
    /// while the provider refused the delete. Tried again on every run until gone.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub retired: Vec<Registration>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Client {
    pub registration: Registration,
    pub client_secret: String,
    /// The metadata the provider holds, as last sent.
    pub metadata: Metadata,
    /// The request's `rotate` this secret answers.
    #[serde(default)]
    pub rotate: u64,
    /// A new secret was asked for (a forced run, `renew`) and the run's budget ran out
    /// before it was made: the next run makes it, although the entry then looks unchanged.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub owed: bool,
}

/// One entry that needs the provider.
#[derive(Debug)]
struct Work {
    entry: usize,
    request: Request,
    /// A new secret is asked for.
    rotate: bool,
}

/// The decisions that need no provider.
#[derive(Debug, Default)]
struct Plan {
    keep: Vec<usize>,
    work: Vec<Work>,
    /// Entry keys of the state that no entry of this run wants (released, or refused now).
    release: Vec<String>,
}

/// What a run did, for its notes on stderr (keys and counts, never a secret).
#[derive(Debug, Default, PartialEq)]
pub struct Counts {
    pub kept: usize,
    pub created: usize,
    pub updated: usize,
    pub rotated: usize,
    pub refused: usize,
    pub pending: usize,
    pub released: usize,
}

/// The outcome of a run: the output, whether the state changed (save it), and the
/// failure that fails the run (after the state is saved: clients already registered
/// must not be forgotten).
#[derive(Default)]
pub struct Reconciled {
    pub output: Output,
    pub changed: bool,
    pub counts: Counts,
    pub failure: Option<anyhow::Error>,
}

/// Decides every entry and does the provider work, within the config's time budget.
/// Nothing is sent to the provider when no entry changed and nothing is to be deleted.
pub async fn reconcile(
    config: &Config,
    state: &mut State,
    entries: &[Entry],
    _trigger: Trigger,
) -> Reconciled {
    let started = Instant::now();
    let mut out = Reconciled::default();
    let plan = plan(config, state, entries, &mut out);
    for &i in &plan.keep {
        if let Some(client) = state.clients.get(&entries[i].key) {
            out.output.respond(&entries[i], response(config, client));
            out.counts.kept += 1;
        }
    }
    if plan.work.is_empty() && plan.release.is_empty() && state.retired.is_empty() {
        return out;
    }
    let server = match Server::connect(config).await {
        Ok(s) => s,
        Err(e) => {
            out.failure = Some(e);
            return out;
        }
    };
    let mut left = Vec::new();
    // Whether the provider answered a call of this run.
    let mut answered = false;
    for work in plan.work {
        if started.elapsed() >= config.run_budget {
            left.push(work);
            continue;
        }
        let entry = &entries[work.entry];
        match apply(&server, state, entry, &work, &mut out).await {
            Ok(client) => {
                answered = true;
                answer(config, state, entry, client, &mut out)
            }
            Err(Failure::Refused(reason)) => {
                answered = true;
                tracing::warn!("{}: refused: {reason}", entry.key);
                out.counts.refused += 1;
                out.output.refuse(entry, reason);
            }
            Err(Failure::Gone) => {
                // A registration never answers Gone; an update's Gone registers anew.
                out.counts.refused += 1;
                out.output
                    .refuse(entry, "the provider lost the client; asked again next run");
            }
            // The provider answers (other calls, or its discovery document): this entry's
            // call failed alone, and it waits; its client, if any, stays as it was.
            Err(Failure::Down(e)) if answered || server.answers(config).await => {
                answered = true;
                tracing::warn!("{}: {e:#}; tried again in a later run", entry.key);
                out.counts.pending += 1;
                out.output
                    .pending(entry, format!("the provider failed this client: {e:#}"));
            }
            Err(Failure::Down(e) | Failure::Denied(e)) => {
                out.failure = Some(e);
                return out;
            }
        }
    }
    if !left.is_empty() {
        // Later runs go on where this one stopped; meanwhile each keeps what it had.
        let n = left.len();
        for work in &left {
            let entry = &entries[work.entry];
            if let Some(c) = state.clients.get_mut(&entry.key) {
                if work.rotate && !c.owed {
                    c.owed = true;
                    out.changed = true;
                }
            }
            out.output.pending(
                entry,
                format!("{n} clients are being registered; this one comes in a later run"),
            );
        }
        out.counts.pending += n;
        out.output.rerun_within(1);
    }
    for key in plan.release {
        if started.elapsed() >= config.run_budget {
            out.output.rerun_within(1);
            break;
        }
        let Some(client) = state.clients.get(&key) else {
            continue;
        };
        let id = client.registration.client_id.clone();
        match server.delete(&client.registration).await {
            Ok(()) => tracing::info!("{key}: released; deleted client {id}"),
            Err(Failure::Gone) => tracing::warn!("{key}: released; client {id} was already gone"),
            Err(Failure::Refused(reason)) => {
                tracing::warn!(
                    "{key}: released; cannot delete client {id}: {reason}; tried again next run"
                );
                if let Some(c) = state.clients.get(&key) {
                    state.retired.push(c.registration.clone());
                }
            }
            Err(Failure::Down(e) | Failure::Denied(e)) => {
                // Kept as it is: the entry may come back, and must find its client.
                out.failure = Some(e);
                return out;
            }
        }
        state.clients.remove(&key);
        out.changed = true;
        out.counts.released += 1;
    }
    if let Err(e) = delete_retired(config, &server, state, started, &mut out).await {
        out.failure = Some(e);
    }
    out
}

/// Registers, updates or rotates one entry's client, for its answer. The state is
/// changed as soon as the provider has changed (a rotated registration access token must
/// never be lost to a later failure of the same entry).
async fn apply(
    server: &Server,
    state: &mut State,
    entry: &Entry,
    work: &Work,
    out: &mut Reconciled,
) -> Result<Client, Failure> {
    let metadata = &work.request.metadata;
    let fresh = |registered: super::server::Registered| Client {
        client_secret: registered.client_secret.unwrap_or_default(),
        registration: registered.registration,
        metadata: metadata.clone(),
        rotate: work.request.rotate,
        owed: false,
    };
    let Some(old) = state.clients.get(&entry.key).cloned() else {
        let client = fresh(server.register(metadata).await?);
        tracing::info!(
            "{}: registered client {}",
            entry.key,
            client.registration.client_id
        );
        out.counts.created += 1;
        return Ok(client);
    };
    let updated = match server.update(&old.registration, metadata).await {
        Ok(u) => u,
        Err(Failure::Gone) => {
            // Deleted at the provider by someone else: the entry gets a new client.
            tracing::warn!(
                "{}: client {} is gone from the provider; registering a new one",
                entry.key,
                old.registration.client_id
            );
            state.clients.remove(&entry.key);
            out.changed = true;
            let client = fresh(server.register(metadata).await?);
            out.counts.created += 1;
            return Ok(client);
        }
        Err(e) => return Err(e),
    };
    let new_secret = updated.client_secret.filter(|s| *s != old.client_secret);
    let rotated_in_place = new_secret.is_some();
    let mut client = Client {
        registration: updated.registration,
        client_secret: new_secret.unwrap_or(old.client_secret),
        metadata: metadata.clone(),
        rotate: old.rotate,
        owed: old.owed,
    };
    if !work.rotate || rotated_in_place {
        client.rotate = work.request.rotate;
        client.owed = false;
        if work.rotate {
            out.counts.rotated += 1;
        } else {
            out.counts.updated += 1;
        }
        return Ok(client);
    }
    // RFC 7592 gives no way to ask for a new secret and this provider kept the old one:
    // a new client replaces the old, which is deleted once the new one is recorded.
    state.clients.insert(entry.key.clone(), client.clone());
    out.changed = true;
    let replacement = fresh(server.register(metadata).await?);
    tracing::info!(
        "{}: new secret as a new client {} (replaces {})",
        entry.key,
        replacement.registration.client_id,
        client.registration.client_id
    );
    state.retired.push(client.registration);
    out.counts.rotated += 1;
    Ok(replacement)
}

fn answer(config: &Config, state: &mut State, entry: &Entry, client: Client, out: &mut Reconciled) {
    out.output.respond(entry, response(config, &client));
    state.clients.insert(entry.key.clone(), client);
    out.changed = true;
}

/// Deletes the retired clients (released, or replaced); whatever the provider refuses
/// stays for the next run.
async fn delete_retired(
    config: &Config,
    server: &Server,
    state: &mut State,
    started: Instant,
    out: &mut Reconciled,
) -> anyhow::Result<()> {
    let mut keep = Vec::new();
    let retired = std::mem::take(&mut state.retired);
    let mut failure = None;
    for r in retired {
        if failure.is_some() || started.elapsed() >= config.run_budget {
            keep.push(r);
            continue;
        }
        match server.delete(&r).await {
            Ok(()) => tracing::info!("deleted client {}", r.client_id),
            Err(Failure::Gone) => {
                tracing::warn!("client {} was already gone; forgotten", r.client_id)
            }
            Err(Failure::Refused(reason)) => {
                tracing::warn!(
                    "client {}: cannot delete: {reason}; tried again next run",
                    r.client_id
                );
                keep.push(r);
            }
            Err(Failure::Down(e) | Failure::Denied(e)) => {
                failure = Some(e);
                keep.push(r);
            }
        }
        out.changed = true;
    }
    if !keep.is_empty() && failure.is_none() && started.elapsed() >= config.run_budget {
        out.output.rerun_within(1);
    }
    state.retired = keep;
    failure.map_or(Ok(()), Err)
}

/// The entries the provider's policy refuses, decided from the config alone (no server,
/// no state): what the fleet check holds requests against.
pub fn vet(config: &Config, entries: &[Entry]) -> crate::Refusals {
    let mut out = Reconciled::default();
    plan(config, &State::default(), entries, &mut out);
    out.output.into_refusals()
}

/// Sorts every entry into kept, refused (answered here) and work, and lists the clients
/// no entry wants.
fn plan(config: &Config, state: &State, entries: &[Entry], out: &mut Reconciled) -> Plan {
    let mut plan = Plan::default();
    let mut wanted: HashSet<&str> = HashSet::with_capacity(entries.len());
    for (i, entry) in entries.iter().enumerate() {
        let request = match decide(config, entry) {
            Ok(r) => r,
            Err(reason) => {
                // A refused change leaves the client it had in service, while the
                // provider's policy still allows that client.
                let stays = state
                    .clients
                    .get(&entry.key)
                    .is_some_and(|c| permitted(config, &entry.origin, &c.metadata).is_ok());
                let reason = if stays {
                    wanted.insert(&entry.key);
                    format!("{reason}; the client it had stays in service")
                } else {
                    reason
                };
                out.counts.refused += 1;
                out.output.refuse(entry, reason);
                continue;
            }
        };
        wanted.insert(&entry.key);
        match state.clients.get(&entry.key) {
            None => plan.work.push(Work {
                entry: i,
                request,
                rotate: false,
            }),
            Some(c) => {
                let rotate =
                    c.rotate != request.rotate || entry.response.is_none() || entry.renew || c.owed;
                if rotate || c.metadata != request.metadata {
                    plan.work.push(Work {
                        entry: i,
                        request,
                        rotate,
                    });
                } else {
                    plan.keep.push(i);
                }
            }
        }
    }
    plan.release = state
        .clients
        .keys()
        .filter(|k| !wanted.contains(k.as_str()))
        .cloned()
        .collect();
    plan
}

/// The entry's checked request, or why it is refused: the caller must be allowed its
/// client name, every redirect URI and every grant type.
fn decide(config: &Config, entry: &Entry) -> Result<Request, String> {
    let origin = &entry.origin;
    if !is_host_name(origin) && !is_principal_name(origin) {
        return Err("the caller's name is not a fort host or principal name".into());
    }
    let request = Request::parse(&entry.request)?;
    permitted(config, origin, &request.metadata)?;
    Ok(request)
}

/// Whether the provider's policy lets `origin` have a client with `m`, or why not.
fn permitted(config: &Config, origin: &str, m: &Metadata) -> Result<(), String> {
    if !config.allow.permits(origin, &m.client_name) {
        return Err(format!(
            "{origin} may not register the client name {} (the provider's allow list; {})",
            m.client_name,
            config.allow.describe(origin)
        ));
    }
    if let Some(uri) = m
        .redirect_uris
        .iter()
        .find(|u| !config.permits_redirect(origin, u))
    {
        return Err(format!(
            "{origin} may not register the redirect URI {uri} (the provider's allow_redirect_uris)"
        ));
    }
    if let Some(g) = m
        .grant_types
        .iter()
        .find(|g| !config.permits_grant(origin, **g))
    {
        return Err(format!(
            "{origin} may not use the grant type {} (the provider's allow_grant_types)",
            g.as_str()
        ));
    }
    Ok(())
}

/// The credential a consumer gets.
pub fn response(config: &Config, client: &Client) -> Value {
    json!({
        "client_id": client.registration.client_id,
        "client_secret": client.client_secret,
        "issuer": config.issuer,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::common::parse_input;

    fn config(dir: &std::path::Path) -> Config {
        std::fs::write(dir.join("token"), "t\n").unwrap();
        serde_json::from_value(json!({
            // Nothing listens there: a run that contacts the provider fails.
            "issuer": "http://127.0.0.1:9",
            "initial_access_token_file": dir.join("token"),
            "state_file": dir.join("state.json"),
            "allow": {"app": ["wiki"]},
            "allow_redirect_uris": {"app": ["https://wiki.example.org/"]},
            "timeout": "1s",
        }))
        .unwrap()
    }

    fn client(rotate: u64) -> Client {
        Client {
            registration: Registration {
                client_id: "id1".into(),
                registration_client_uri: "http://127.0.0.1:9/reg/id1".into(),
                registration_access_token: "rat".into(),
            },
            client_secret: "secret".into(),
            metadata: Request::parse(&json!({"client_name": "wiki",
                "redirect_uris": ["https://wiki.example.org/cb"]}))
            .unwrap()
            .metadata,
            rotate,
            owed: false,
        }
    }

    fn run(config: &Config, state: &mut State, input: Value) -> Reconciled {
        let entries = parse_input(input.to_string().as_bytes()).unwrap();
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(reconcile(config, state, &entries, Trigger::Request))
    }

    #[test]
    fn unchanged_entries_never_reach_the_provider() {
        let dir = tempfile::tempdir().unwrap();
        let c = config(dir.path());
        let mut state = State::default();
        state.clients.insert("app:oidc/wiki".into(), client(0));
        let kept = response(&c, &client(0));
        let request =
            json!({"client_name": "wiki", "redirect_uris": ["https://wiki.example.org/cb"]});
        let done = run(
            &c,
            &mut state,
            json!({"app:oidc/wiki": {"request": request, "response": kept},
                   "app:oidc/evil": {"request": {"client_name": "root"}}}),
        );
        assert!(done.failure.is_none() && !done.changed);
        assert_eq!(done.counts.kept, 1);
        assert_eq!(done.counts.refused, 1);
        let out = done.output.to_json();
        assert_eq!(out["app:oidc/wiki"], kept);
        assert!(out["app:oidc/evil"]["$fort_refused"].is_string());

        // A raised rotate, a forced run and a changed request all need the provider,
        // which is down: the run fails and the state keeps the client.
        for (request, response) in [
            (
                json!({"client_name": "wiki", "redirect_uris": ["https://wiki.example.org/cb"], "rotate": 1}),
                kept.clone(),
            ),
            (request.clone(), Value::Null),
            (
                json!({"client_name": "wiki", "redirect_uris": ["https://wiki.example.org/b"]}),
                kept.clone(),
            ),
        ] {
            let done = run(
                &c,
                &mut state,
                json!({"app:oidc/wiki": {"request": request, "response": response}}),
            );
            assert!(done.failure.is_some());
            assert_eq!(state.clients["app:oidc/wiki"], client(0));
        }
    }
}
