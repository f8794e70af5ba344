//! `fort`: the operator CLI. Signs requests with an SSH key, verifies signed replies.

use std::io::{IsTerminal, Read};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use fort_agent::cli::{
    fleet, fleet_graph, fleet_json, fleet_table, journal_lines, judge, load_expected, pins,
    resend_text, status_table, trigger_text, Identity, Session, EXIT_FAIL,
};

#[derive(Parser)]
#[command(
    name = "fort",
    version,
    about = "Operator CLI for a fort fleet: signed calls to any host"
)]
#[command(
    after_help = "Examples:\n  fort status forge\n  fort call forge manifest\n  echo '{\"unit\":\"nginx.service\"}' | fort call forge journal -\n  fort journal forge nginx.service --lines 50\n  fort trigger forge oidc --entry app:oidc/wiki --force\n  fort resend app oidc/wiki\n  fort fleet --expect fleet-manifest.json\n  fort fleet --graph | dot -Tsvg > fleet.svg\n  fort audit verify ./forge-audit --signer forge\n  fort audit pull forge app --out ./trails && fort audit verify --fleet ./trails\n\nEnvironment: FORT_SSH_KEY, FORT_ORIGIN, FORT_HOSTS, FORT_PLAINTEXT."
)]
struct Cli {
    /// Private key to sign with (unencrypted OpenSSH ed25519). Default:
    /// ~/.ssh/id_ed25519; its public half must be listed for the origin in hosts.json.
    #[arg(long, env = "FORT_SSH_KEY", global = true, value_name = "FILE")]
    key: Option<PathBuf>,
    /// The principal (or host) name to sign as, as hosts.json lists it. Default: $USER.
    #[arg(long, env = "FORT_ORIGIN", global = true, value_name = "NAME")]
    origin: Option<String>,
    /// The fleet registry: where hosts are and which keys they and the principals sign with.
    #[arg(
        value_name = "FILE",
        long,
        env = "FORT_HOSTS",
        global = true,
        default_value = "/etc/fort/hosts.json"
    )]
    hosts: PathBuf,
    /// Accept plain `http://` addresses in hosts.json (only where an overlay network such
    /// as WireGuard already encrypts; otherwise every host is reached over pinned TLS).
    #[arg(long, env = "FORT_PLAINTEXT", global = true)]
    plaintext: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Call a capability on a host and print its verified reply.
    Call {
        /// A host in hosts.json.
        host: String,
        /// The capability to call: a built-in (status, manifest, needs, journal, systemd,
        /// trigger, resend, audit) or one the host serves.
        capability: String,
        /// The JSON request body; `-` reads it from stdin. Default: `{}`.
        body: Option<String>,
    },
    /// A host's status: its needs and their state, what it provides.
    Status {
        /// A host in hosts.json.
        host: String,
        /// Print the status document as JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Run a capability's handler on a provider now, for every entry or for one (the
    /// principal must be in the host's [access] trigger). Prints the run once it is over.
    Trigger {
        /// The provider: a host in hosts.json.
        host: String,
        /// An async capability the host serves.
        capability: String,
        /// One entry, `<consumer>:<capability>/<need id>` (`fort status HOST` lists
        /// them): its consumer is called back after the run, changed or not.
        #[arg(long, value_name = "KEY")]
        entry: Option<String>,
        /// Leave cached responses out of the handler's input, so it issues new ones:
        /// with --entry, that entry's alone (the others keep theirs).
        #[arg(long)]
        force: bool,
        /// Print the reply as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Have a consumer send one need's request to its provider again now, whatever its
    /// state (the principal must be in the host's [access] trigger).
    Resend {
        /// The consumer: a host in hosts.json.
        host: String,
        /// One of its needs, `<type>/<id>` (`fort status HOST` lists them).
        need: String,
        /// Print the reply as JSON.
        #[arg(long)]
        json: bool,
    },
    /// A unit's journal on a host (the principal must be in the host's [access] journal).
    Journal {
        /// A host in hosts.json.
        host: String,
        /// The systemd unit, e.g. nginx.service.
        unit: String,
        /// The most recent lines to show, 1 to 1000.
        #[arg(long, default_value_t = 100)]
        lines: u32,
        /// Only entries at or after this time, as journalctl reads it ("2025-01-31
        /// 12:00", "-1h", "today").
        #[arg(long, value_name = "TIME")]
        since: Option<String>,
        /// Only entries at or before this time, as journalctl reads it.
        #[arg(long, value_name = "TIME")]
        until: Option<String>,
        /// Print the reply as JSON ({"lines": [...]}) instead of the lines.
        #[arg(long)]
        json: bool,
    },
    /// Print the TLS pin of a host's key(s) for `curl --pinnedpubkey` (one per line).
    Pin {
        /// A host in hosts.json.
        host: String,
    },
    /// Copy hosts' audit trails over signed calls, and read or check a copy (its
    /// `audit.dir`) trusting only the keys in hosts.json.
    #[command(subcommand)]
    Audit(AuditCommand),
    /// Every host's status in one table, asked concurrently. Exits 1 when a host does
    /// not answer or, with --expect, does not run what was built.
    Fleet {
        /// Machine-readable output.
        #[arg(long, conflicts_with = "graph")]
        json: bool,
        /// Print the fleet as a Graphviz graph: hosts as nodes, needs as edges from
        /// consumer to provider coloured by state (satisfied green, pending or waiting
        /// grey, failed red, expiring orange, expired dark red), unreachable hosts dashed.
        #[arg(long)]
        graph: bool,
        /// The manifest hashes a build expects, `{"<host>": "<sha256>"}` (the NixOS
        /// module's lib.fleetManifest as JSON): marks hosts that run other files, hosts
        /// that do not answer, and hosts the build does not know.
        #[arg(long, value_name = "FILE")]
        expect: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum AuditCommand {
    /// Copy each host's audit trail into DIR/<host>/ over signed calls (the principal
    /// must be in the host's [access] audit), each file from where the copy ends. A
    /// copy is only appended to: a host whose files no longer begin with what was pulled
    /// (rewritten, or cut short) is reported, and recorded for `verify --fleet`. Exits 1
    /// naming every host that failed; the others are still pulled.
    Pull {
        /// Hosts in hosts.json.
        #[arg(required = true, value_name = "HOST")]
        targets: Vec<String>,
        /// Where the copies are kept, one directory per host.
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
    },
    /// Print the records, oldest first, filtered by need, host, event or time.
    Show {
        /// The trail's directory.
        dir: PathBuf,
        #[command(flatten)]
        filter: fort_agent::audit_cli::Filter,
        /// Print the records as they are in the files (JSON lines).
        #[arg(long)]
        json: bool,
    },
    /// Check the chain of records and every checkpoint's signature with the writer's
    /// keys in hosts.json; exit 1 naming the first bad record. With --fleet, every
    /// host's copy that `fort audit pull` keeps, each held against the others.
    Verify {
        /// The trail's directory.
        #[arg(required_unless_present = "fleet", conflicts_with = "fleet")]
        dir: Option<PathBuf>,
        /// The host that wrote it (its name in hosts.json).
        #[arg(
            long,
            value_name = "HOST",
            required_unless_present = "fleet",
            conflicts_with = "fleet"
        )]
        signer: Option<String>,
        /// Copies of consumers' trails: every checkpoint of the signer they witnessed
        /// must be in its trail as they saw it.
        #[arg(long, value_name = "DIR", num_args = 1.., conflicts_with = "fleet")]
        witnesses: Vec<PathBuf>,
        /// A directory of copies, `DIR/<host>/` each (as `fort audit pull` keeps them):
        /// every one checked as signed by its host, and against the checkpoints every
        /// other copy witnessed; one line per host.
        #[arg(long, value_name = "DIR")]
        fleet: Option<PathBuf>,
        /// Print the outcome as JSON.
        #[arg(long)]
        json: bool,
    },
}

/// `fort audit` but `pull`: local files only, no call and no key of the operator's.
fn audit(command: &AuditCommand, hosts: &std::path::Path) -> ExitCode {
    let outcome = match command {
        AuditCommand::Pull { .. } => unreachable!("pull signs calls"),
        AuditCommand::Verify {
            fleet: Some(fleet),
            json,
            ..
        } => fort_agent::audit_fleet::verify_fleet(fleet, hosts, *json),
        AuditCommand::Show { dir, filter, json } => {
            fort_agent::audit_cli::show_dir(dir, filter, *json).map(|()| true)
        }
        AuditCommand::Verify {
            dir,
            signer,
            witnesses,
            json,
            ..
        } => match (dir, signer) {
            (Some(dir), Some(signer)) => {
                fort_agent::audit_cli::verify_dir(dir, signer, Some(hosts), witnesses, *json)
            }
            _ => Err("give the trail's DIR and --signer HOST, or --fleet DIR".to_owned()),
        },
    };
    match outcome {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("fort audit: {e}");
            ExitCode::from(2)
        }
    }
}

fn default_key() -> PathBuf {
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/root"));
    home.join(".ssh/id_ed25519")
}

fn default_origin() -> String {
    std::env::var("USER").unwrap_or_else(|_| "root".into())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    fort_agent::cli::quiet_on_closed_pipe();
    let cli = Cli::parse();
    if let Command::Audit(command) = &cli.command {
        if !matches!(command, AuditCommand::Pull { .. }) {
            return audit(command, &cli.hosts);
        }
    }
    if let Command::Pin { host } = &cli.command {
        return match pins(&cli.hosts, host) {
            Ok(lines) => {
                for l in lines {
                    println!("{l}");
                }
                ExitCode::SUCCESS
            }
            Err((code, e)) => {
                eprintln!("fort: {e}");
                ExitCode::from(code)
            }
        };
    }
    let id = Identity {
        hosts: cli.hosts.clone(),
        key: cli.key.clone().unwrap_or_else(default_key),
        origin: cli.origin.clone().unwrap_or_else(default_origin),
        plaintext: cli.plaintext,
    };
    let session = match Session::open(&id) {
        Ok(s) => s,
        Err((code, e)) => {
            eprintln!("fort: {e}");
            return ExitCode::from(code);
        }
    };
    if let Command::Audit(AuditCommand::Pull { targets, out }) = &cli.command {
        let reports = fort_agent::cli::audit_pull::pull_all(&session, targets, out).await;
        let mut failed = Vec::new();
        for r in &reports {
            println!("{}", r.text());
            if r.error.is_some() {
                failed.push(r.host.as_str());
            }
        }
        if failed.is_empty() {
            return ExitCode::SUCCESS;
        }
        eprintln!(
            "fort: audit pull failed for {} (the others were pulled)",
            failed.join(", ")
        );
        return ExitCode::from(EXIT_FAIL);
    }
    let pretty = std::io::stdout().is_terminal();
    // What to call, and how to show a verified reply when not as JSON.
    let (host, capability, body, render): (String, String, String, Render) = match cli.command {
        Command::Pin { .. } | Command::Audit(_) => unreachable!("answered above"),
        Command::Fleet {
            json,
            graph,
            expect,
        } => {
            let expected = match expect.as_deref().map(load_expected).transpose() {
                Ok(e) => e,
                Err(e) => {
                    eprintln!("fort: {e}");
                    return ExitCode::from(EXIT_FAIL);
                }
            };
            let expected = expected.as_ref();
            let rows = fort_agent::cli::with_expected_hosts(fleet(&session).await, expected);
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&fleet_json(&rows, expected)).unwrap_or_default()
                );
            } else if graph {
                print!("{}", fleet_graph(&rows, expected));
            } else {
                print!("{}", fleet_table(&rows, expected));
            }
            let healthy = fort_agent::cli::healthy(&rows, expected);
            return ExitCode::from(if healthy { 0 } else { EXIT_FAIL });
        }
        Command::Call {
            host,
            capability,
            body,
        } => {
            let body = match body.as_deref() {
                None => "{}".to_owned(),
                Some("-") => {
                    let mut s = String::new();
                    if let Err(e) = std::io::stdin().read_to_string(&mut s) {
                        eprintln!("fort: reading stdin: {e}");
                        return ExitCode::from(EXIT_FAIL);
                    }
                    s
                }
                Some(b) => b.to_owned(),
            };
            (host, capability, body, Render::Json)
        }
        Command::Status { host, json } => {
            let render = if json { Render::Json } else { Render::Status };
            (
                host,
                "status".to_owned(),
                r#"{"entries":true}"#.to_owned(),
                render,
            )
        }
        Command::Trigger {
            host,
            capability,
            entry,
            force,
            json,
        } => {
            let mut p = serde_json::json!({"capability": capability, "force": force});
            if let Some(e) = entry {
                p["entry"] = e.into();
            }
            let render = if json { Render::Json } else { Render::Trigger };
            (host, "trigger".to_owned(), p.to_string(), render)
        }
        Command::Resend { host, need, json } => {
            let render = if json { Render::Json } else { Render::Resend };
            let p = serde_json::json!({ "need": need });
            (host, "resend".to_owned(), p.to_string(), render)
        }
        Command::Journal {
            host,
            unit,
            lines,
            since,
            until,
            json,
        } => {
            let mut p = serde_json::json!({"unit": unit, "lines": lines});
            if let Some(s) = since {
                p["since"] = s.into();
            }
            if let Some(u) = until {
                p["until"] = u.into();
            }
            let render = if json { Render::Json } else { Render::Journal };
            (host, "journal".to_owned(), p.to_string(), render)
        }
    };
    if serde_json::from_str::<serde::de::IgnoredAny>(&body).is_err() {
        eprintln!("fort: the request body is not JSON");
        return ExitCode::from(EXIT_FAIL);
    }
    let reply = match session.call(&host, &capability, body.into_bytes()).await {
        Ok(reply) => reply,
        Err((code, e)) => {
            eprintln!("fort: {e}");
            return ExitCode::from(code);
        }
    };
    let (code, out, note) = judge(&reply, pretty, &host, &session.signing);
    let parsed = serde_json::from_str::<serde_json::Value>(&out).ok();
    let text = match (code, &render, &parsed) {
        (0, Render::Status, Some(v)) => Some(status_table(v)),
        (0, Render::Trigger, Some(v)) => Some(trigger_text(&host, v)),
        (0, Render::Resend, Some(v)) => Some(resend_text(&host, v)),
        (0, Render::Journal, Some(v)) => journal_lines(v),
        _ => None,
    };
    let mut code = code;
    match text {
        Some(t) => print!("{t}"),
        None if code == 0 && !matches!(render, Render::Json) => {
            // A verified 2xx this command cannot read: say so rather than guess.
            println!("{}", out.trim_end());
            eprintln!("fort: the {capability} reply from {host} is not what this fort reads");
            code = EXIT_FAIL;
        }
        // A refusal's message is in the note below; the body is for --json and `call`.
        None if note.is_some() && !matches!(render, Render::Json) => {}
        None => {
            if !out.is_empty() {
                println!("{}", out.trim_end());
            }
        }
    }
    if let Some(n) = note {
        eprintln!("fort: {n}");
    }
    // A trigger whose run failed changed nothing: not a success.
    if code == 0
        && matches!(render, Render::Trigger | Render::Json)
        && capability == "trigger"
        && parsed.as_ref().is_some_and(|v| v["run"]["ok"] == false)
    {
        code = EXIT_FAIL;
    }
    ExitCode::from(code)
}

/// How a verified reply is shown.
enum Render {
    /// As it came (pretty on a terminal): `fort call` and every `--json`.
    Json,
    Status,
    Trigger,
    Resend,
    Journal,
}
