//! `fort-bench oidc`: the oidc capability's handler against a real OpenID provider (npm's
//! oidc-provider under node, tests/oidc/server.mjs): one run registering N clients, a
//! sample of them getting tokens at the token endpoint, and runs over 10,000 unchanged
//! entries with the provider stopped (so no HTTP call can have happened).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use fort_handlers::common::state::StateFile;
use fort_handlers::oidc::config::Config;
use fort_handlers::oidc::reconcile::{self, Client, State};
use fort_handlers::oidc::request::Request;
use fort_handlers::oidc::server::Registration;
use fort_tests::oidc::OidcProvider;
use serde_json::{json, Map, Value};

use crate::util::{self, ms, Report};

#[derive(clap::Args, Debug)]
pub struct OidcArgs {
    /// Entries registered in the first run (each a new client at the provider).
    #[arg(long, default_value_t = 500)]
    entries: usize,
    /// Entries in the run where nothing changed (the registered ones plus entries
    /// recorded in the handler's state only).
    #[arg(long, default_value_t = 10_000)]
    unchanged: usize,
    /// Runs over the unchanged entries (the median and the slowest are reported).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Registered clients that then ask the token endpoint for a client_credentials token.
    #[arg(long, default_value_t = 20)]
    sample: usize,
    /// The fort-handler binary. Default: $FORT_BIN_FORT_HANDLER, else next to fort-bench.
    #[arg(long)]
    handler_bin: Option<PathBuf>,
}

/// One handler run as the agent makes it: (wall time, output).
fn run_handler(bin: &Path, config: &Path, input: &[u8]) -> Result<(Duration, Value)> {
    let t = Instant::now();
    let mut child = Command::new(bin)
        .args(["oidc", "--config"])
        .arg(config)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("FORT_HOST", "id")
        .env("FORT_CAPABILITY", "oidc")
        .env("FORT_TRIGGER", "request")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("start fort-handler")?;
    child.stdin.take().expect("stdin").write_all(input)?;
    let out = child.wait_with_output()?;
    let wall = t.elapsed();
    if !out.status.success() {
        bail!(
            "fort-handler failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok((wall, serde_json::from_slice(&out.stdout)?))
}

fn key(i: usize) -> String {
    format!("h{i:05}:oidc/app")
}

fn request(i: usize) -> Value {
    json!({"client_name": format!("h{i:05}"), "grant_types": ["client_credentials"]})
}

/// How many of `creds` get a client_credentials token at the provider's token endpoint.
async fn tokens(op: &OidcProvider, creds: &[&Value]) -> Result<usize> {
    fort_core::tls::install_default_provider();
    let ca = std::fs::read(&op.ca_file)?;
    let http = reqwest::Client::builder()
        .tls_certs_only(reqwest::Certificate::from_pem_bundle(&ca)?)
        .build()?;
    let mut ok = 0;
    for c in creds {
        let r = http
            .post(op.token_endpoint())
            .basic_auth(
                c["client_id"].as_str().unwrap_or(""),
                c["client_secret"].as_str(),
            )
            .header("content-type", "application/x-www-form-urlencoded")
            .body("grant_type=client_credentials")
            .send()
            .await?;
        ok += usize::from(r.status().is_success());
    }
    Ok(ok)
}

pub async fn run(args: OidcArgs, json_out: bool) -> Result<()> {
    let bin = util::handler_bin(args.handler_bin.clone())?;
    let mut op = OidcProvider::start().map_err(|e| anyhow!("no OpenID provider: {e}"))?;
    let dir = tempfile::tempdir()?;
    let config_path = dir.path().join("oidc.json");
    std::fs::write(
        &config_path,
        json!({
            "issuer": op.issuer,
            "initial_access_token_file": op.token_file,
            "state_file": dir.path().join("state.json"),
            "ca_file": op.ca_file,
            "allow": {"*": ["{origin}"]},
            "allow_grant_types": {"*": ["client_credentials"]},
            // One run for all of them, however long it takes (a deployment's default,
            // 40 s, would continue in later runs).
            "run_budget": "3000s",
        })
        .to_string(),
    )?;
    let mut r = Report::new("oidc", json_out);
    r.note(&format!(
        "npm oidc-provider {} under node, over https on loopback",
        fort_tests::oidc::PACKAGE_VERSION
    ));

    // 1. One run registering every entry.
    let mut input = Map::new();
    for i in 0..args.entries {
        input.insert(key(i), json!({"request": request(i), "response": null}));
    }
    let input = Value::Object(input);
    let (created_in, out) = run_handler(&bin, &config_path, input.to_string().as_bytes())?;
    let answered: Vec<&Value> = out
        .as_object()
        .map(|m| {
            m.values()
                .filter(|v| v.get("client_secret").is_some())
                .collect()
        })
        .unwrap_or_default();
    r.line(
        "create_entries",
        args.entries,
        format!("{} entries, each a new client (RFC 7591)", args.entries),
    );
    r.line(
        "create_run_s",
        created_in.as_secs_f64(),
        format!(
            "{:.2} s in one run ({:.1} ms per entry)",
            created_in.as_secs_f64(),
            ms(created_in) / args.entries.max(1) as f64
        ),
    );
    let step = (answered.len() / args.sample.max(1)).max(1);
    let sample: Vec<&Value> = answered.iter().step_by(step).copied().collect();
    let got = tokens(&op, &sample).await?;
    r.line(
        "create_answered",
        answered.len(),
        format!(
            "{} answered; {got} of {} sampled clients got a token at the token endpoint",
            answered.len(),
            sample.len()
        ),
    );
    r.target(
        "every entry registered in one run",
        answered.len() == args.entries,
    );
    r.target("sampled delivered clients get tokens", got == sample.len());

    // 2. 10,000 unchanged entries: the registered ones plus entries the state records
    //    (written as the handler writes them), each with its cached response. The
    //    provider is stopped: a run that called it would fail.
    let config = Config::load(&config_path)?;
    let file = StateFile::new(&config.state_file);
    let mut state: State = file.load(reconcile::STATE_VERSION)?;
    let mut unchanged = Map::new();
    for i in 0..args.unchanged.max(args.entries) {
        let k = key(i);
        let req = request(i);
        let parsed = Request::parse(&req).map_err(|e| anyhow!(e))?;
        let client = state.clients.entry(k.clone()).or_insert_with(|| Client {
            registration: Registration {
                client_id: format!("client-{i}"),
                registration_client_uri: format!("{}/reg/client-{i}", op.issuer),
                registration_access_token: format!("rat-{i}"),
            },
            client_secret: format!("secret-{i}"),
            metadata: parsed.metadata,
            rotate: 0,
            owed: false,
        });
        let response = reconcile::response(&config, client);
        unchanged.insert(k, json!({"request": req, "response": response}));
    }
    file.save(reconcile::STATE_VERSION, &state)?;
    let unchanged = Value::Object(unchanged);
    let bytes = unchanged.to_string().into_bytes();
    op.stop();
    let mut walls = Vec::new();
    let mut cpus = Vec::new();
    let mut same = true;
    for _ in 0..args.runs.max(1) {
        let cpu_before = util::children_cpu();
        let (wall, out) = run_handler(&bin, &config_path, &bytes)?;
        cpus.push(util::children_cpu().saturating_sub(cpu_before));
        same &= unchanged
            .as_object()
            .is_some_and(|m| m.iter().all(|(k, v)| out.get(k) == Some(&v["response"])));
        walls.push(wall);
    }
    walls.sort();
    cpus.sort();
    let median = walls[walls.len() / 2];
    let slowest = walls[walls.len() - 1];
    let state_kib = std::fs::metadata(&config.state_file).map_or(0, |m| m.len() / 1024);
    r.line(
        "unchanged_entries",
        args.unchanged,
        format!(
            "{} entries ({} at the provider, the rest in the state only), {} KiB of input, {} KiB of state",
            args.unchanged,
            args.entries,
            bytes.len() / 1024,
            state_kib
        ),
    );
    r.line(
        "unchanged_run_ms_median_max",
        json!([ms(median), ms(slowest)]),
        format!(
            "{:.1} / {:.1} ms per run (whole process: start, parse, state, answer), provider stopped",
            ms(median),
            ms(slowest)
        ),
    );
    r.line(
        "unchanged_run_cpu_ms_median_max",
        json!([ms(cpus[cpus.len() / 2]), ms(cpus[cpus.len() - 1])]),
        format!(
            "{:.1} / {:.1} ms of CPU per run (user and system; the wall time above also waits for a busy machine)",
            ms(cpus[cpus.len() / 2]),
            ms(cpus[cpus.len() - 1])
        ),
    );
    util::unchanged_summary(&mut r, &walls, args.unchanged, &config.state_file);
    r.target("10,000 unchanged entries < 200 ms", ms(slowest) < 200.0);
    r.target("unchanged entries answered without an HTTP call", same);
    r.finish();
    Ok(())
}
