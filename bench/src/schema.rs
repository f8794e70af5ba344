//! Accepted async requests per second with and without a `request_schema`, in one run.
//!
//! One provider agent has two async capabilities with the same trivial handler:
//! `plain` (no schema) and `typed` (an OIDC-client-like schema: required fields, no
//! unknown ones, string patterns, an array of URIs). One host, never started, is among
//! the callers of both with N declared need ids. Rounds alternate between the two
//! capabilities (plain, typed, plain, typed, …) so both see the same machine; each round
//! sends N requests, each a new value for its entry (so each is a durable write, never a
//! free repeat), over C keep-alive connections, and is timed from the first request to the
//! last `202`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use fort_core::client::{ClientOptions, SignedClient, Target};
use serde_json::{json, Value};

use crate::util::{self, AgentProc, Report};

#[derive(clap::Args, Debug)]
pub struct SchemaArgs {
    /// Requests per round (one per declared need id).
    #[arg(long, default_value_t = 2000)]
    requests: usize,
    /// Rounds per capability (they alternate).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 32)]
    connections: usize,
}

const ME: &str = "app";

fn typed_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "client_name": {"type": "string", "pattern": "^[a-z][a-z0-9-]{0,62}$"},
            "redirect_uris": {
                "type": "array",
                "items": {"type": "string", "pattern": "^https://"},
                "minItems": 1,
                "maxItems": 16
            },
            "scopes": {
                "type": "array",
                "items": {"enum": ["openid", "email", "profile", "groups"]},
                "uniqueItems": true
            },
            "public": {"type": "boolean", "default": false}
        },
        "required": ["client_name", "redirect_uris"],
        "additionalProperties": false
    })
}

fn request(n: usize, round: usize) -> Value {
    json!({
        "client_name": format!("app-{n}-r{round}"),
        "redirect_uris": [format!("https://app-{n}.example.org/oauth2/callback")],
        "scopes": ["openid", "email", "profile"],
        "public": false
    })
}

/// One round: every need id of `cap` asked for with the round's value; the time until
/// the last `202`.
async fn round(
    client: &SignedClient,
    target: &Arc<(String, String, Vec<ssh_key::PublicKey>)>,
    cap: &str,
    args: &SchemaArgs,
    r: usize,
) -> Result<Duration> {
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let t0 = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..args.connections.max(1) {
        let (client, target, next, cap) =
            (client.clone(), target.clone(), next.clone(), cap.to_owned());
        let total = args.requests;
        workers.spawn(async move {
            let t = Target {
                name: &target.0,
                address: &target.1,
                keys: &target.2,
            };
            loop {
                let n = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if n >= total {
                    return Ok::<(), anyhow::Error>(());
                }
                let body = json!({"need": format!("{cap}/n{n:05}"), "request": request(n, r)});
                let reply = client
                    .post(
                        &t,
                        &format!("/agent/capabilities/{cap}"),
                        serde_json::to_vec(&body)?,
                    )
                    .await?;
                if reply.status != 202 {
                    bail!(
                        "{cap}: {}: {}",
                        reply.status,
                        String::from_utf8_lossy(&reply.body)
                    );
                }
            }
        });
    }
    while let Some(w) = workers.join_next().await {
        w??;
    }
    Ok(t0.elapsed())
}

pub async fn run(args: SchemaArgs, json_out: bool) -> Result<()> {
    util::require_jq()?;
    let mut fleet = util::new_fleet();
    let handler = util::ok_handler(&fleet, None);
    fleet.capability(
        "forge",
        "plain",
        json!({"handler": handler, "mode": "async"}),
    );
    fleet.capability(
        "forge",
        "typed",
        json!({"handler": handler, "mode": "async", "request_schema": typed_schema()}),
    );
    for cap in ["plain", "typed"] {
        for n in 0..args.requests {
            fleet.need(ME, &format!("{cap}/n{n:05}"), "forge", json!({}));
        }
    }
    // The consumer is never started: its requests are sent from here, signed with its key.
    fleet.write_files();
    let mut agents = vec![AgentProc::spawn(&fleet, "forge")?];
    util::wait_listening(&mut agents, Duration::from_secs(20))?;
    let provider = agents.pop().expect("one");
    let opts = ClientOptions {
        total_timeout: Duration::from_secs(30),
        max_idle_per_peer: args.connections.max(1),
        local_address: Some(fleet.hosts[ME].addr.ip()),
        ..ClientOptions::default()
    };
    let client = SignedClient::new(ME, fleet.hosts[ME].signer.clone(), &opts);
    let target = Arc::new((
        "forge".to_owned(),
        fleet.address_of("forge"),
        fleet.hosts["forge"].keys(),
    ));
    // A warm-up round each: connections, the first state writes.
    round(&client, &target, "plain", &args, 0).await?;
    round(&client, &target, "typed", &args, 0).await?;
    let (mut plain, mut typed) = (Vec::new(), Vec::new());
    for r in 1..=args.rounds.max(1) {
        plain.push(round(&client, &target, "plain", &args, r).await?);
        typed.push(round(&client, &target, "typed", &args, r).await?);
    }
    let rate = |times: &[Duration]| {
        let total: f64 = times.iter().map(Duration::as_secs_f64).sum();
        (args.requests * times.len()) as f64 / total
    };
    let (rp, rt) = (rate(&plain), rate(&typed));
    let ratio = rt / rp;
    let mut r = Report::new("schema", json_out);
    r.line("requests_per_round", args.requests, args.requests);
    r.line("rounds", args.rounds, args.rounds);
    r.line("connections", args.connections, args.connections);
    r.line(
        "plain_accepted_per_s",
        rp.round(),
        format!("{rp:.0} req/s (no request_schema)"),
    );
    r.line(
        "typed_accepted_per_s",
        rt.round(),
        format!("{rt:.0} req/s (validated against request_schema)"),
    );
    r.line(
        "typed_over_plain",
        (ratio * 1000.0).round() / 1000.0,
        format!("{ratio:.3}"),
    );
    r.target("typed/plain ≥ 0.9", ratio >= 0.9);
    r.finish();
    drop(provider);
    Ok(())
}
