//! `fort`: the operator CLI. Signs requests with an SSH key, verifies signed replies.

use std::io::{IsTerminal, Read};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use fort_agent::cli::{fleet, fleet_json, fleet_table, judge, pins, Identity, Session, EXIT_FAIL};

#[derive(Parser)]
#[command(
    name = "fort",
    version,
    about = "Operator CLI for a fort fleet: signed calls to any host"
)]
#[command(
    after_help = "Examples:\n  fort status forge\n  fort call forge manifest\n  echo '{\"unit\":\"nginx.service\"}' | fort call forge journal -\n  fort journal forge nginx.service --lines 50\n  fort fleet --json\n\nEnvironment: FORT_SSH_KEY, FORT_ORIGIN, FORT_HOSTS."
)]
struct Cli {
    /// Private key to sign with (unencrypted OpenSSH ed25519).
    #[arg(long, env = "FORT_SSH_KEY", global = true)]
    key: Option<PathBuf>,
    /// The principal or host name to sign as.
    #[arg(long, env = "FORT_ORIGIN", global = true)]
    origin: Option<String>,
    /// The fleet registry.
    #[arg(
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
    /// Call a capability on a host: JSON argument, `-` for stdin, default `{}`.
    Call {
        host: String,
        capability: String,
        body: Option<String>,
    },
    /// A host's status.
    Status { host: String },
    /// A unit's journal on a host.
    Journal {
        host: String,
        unit: String,
        #[arg(long, default_value_t = 100)]
        lines: u32,
        #[arg(long)]
        since: Option<String>,
        #[arg(long)]
        until: Option<String>,
    },
    /// Print the TLS pin of a host's key(s) for `curl --pinnedpubkey` (one per line).
    Pin {
        /// A host in hosts.json.
        host: String,
    },
    /// Every host's status in one table, asked concurrently.
    Fleet {
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
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
    let cli = Cli::parse();
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
    let pretty = std::io::stdout().is_terminal();
    let (host, capability, body) = match cli.command {
        Command::Pin { .. } => unreachable!("answered above"),
        Command::Fleet { json } => {
            let rows = fleet(&session).await;
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&fleet_json(&rows)).unwrap_or_default()
                );
            } else {
                print!("{}", fleet_table(&rows));
            }
            let all_up = rows.iter().all(|r| r.status.is_ok());
            return ExitCode::from(if all_up { 0 } else { EXIT_FAIL });
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
            (host, capability, body)
        }
        Command::Status { host } => (host, "status".to_owned(), "{}".to_owned()),
        Command::Journal {
            host,
            unit,
            lines,
            since,
            until,
        } => {
            let mut p = serde_json::json!({"unit": unit, "lines": lines});
            if let Some(s) = since {
                p["since"] = s.into();
            }
            if let Some(u) = until {
                p["until"] = u.into();
            }
            (host, "journal".to_owned(), p.to_string())
        }
    };
    if serde_json::from_str::<serde::de::IgnoredAny>(&body).is_err() {
        eprintln!("fort: the request body is not JSON");
        return ExitCode::from(EXIT_FAIL);
    }
    match session.call(&host, &capability, body.into_bytes()).await {
        Ok(reply) => {
            let (code, out, note) = judge(&reply, pretty);
            if !out.is_empty() {
                println!("{}", out.trim_end());
            }
            if let Some(n) = note {
                eprintln!("fort: {n}");
            }
            ExitCode::from(code)
        }
        Err((code, e)) => {
            eprintln!("fort: {e}");
            ExitCode::from(code)
        }
    }
}
