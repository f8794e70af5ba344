//! `fort-agent`: the per-host daemon and its local commands.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use fort_agent::admin::{self, AdminRequest};
use fort_agent::config::Config;
use tokio_util::sync::CancellationToken;

const DEFAULT_CONFIG: &str = "/etc/fort/agent.toml";

#[derive(Parser)]
#[command(
    name = "fort-agent",
    version,
    about = "The fort agent: signed control plane, capabilities and needs for one NixOS host"
)]
#[command(
    after_help = "Examples:\n  fort-agent serve --config /etc/fort/agent.toml\n  fort-agent check --config ./agent.toml\n  fort-agent status\n  fort-agent trigger ssl-cert --force\n  fort-agent gc --dry-run\n  fort-agent demo --keep"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the daemon.
    Serve {
        #[arg(long, default_value = DEFAULT_CONFIG)]
        config: PathBuf,
    },
    /// Validate the config and every file it names, then exit.
    Check {
        #[arg(long, default_value = DEFAULT_CONFIG)]
        config: PathBuf,
        /// Do not read the host key (build-time checks have no key).
        #[arg(long)]
        skip_key: bool,
    },
    /// Show this host's needs and provider entries (from the running agent).
    Status {
        #[arg(long, default_value = DEFAULT_CONFIG)]
        config: PathBuf,
        /// Print the raw JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Run a capability's handler now and call back entries whose response changed.
    Trigger {
        capability: String,
        /// Pass no cached responses: regenerate everything.
        #[arg(long)]
        force: bool,
        /// Why: `manual` (default) or `systemd` (set by the NixOS module's units).
        #[arg(long)]
        reason: Option<String>,
        #[arg(long, default_value = DEFAULT_CONFIG)]
        config: PathBuf,
    },
    /// Run a GC sweep now and print what was removed and why.
    Gc {
        /// Decide and print, but remove nothing.
        #[arg(long)]
        dry_run: bool,
        #[arg(long, default_value = DEFAULT_CONFIG)]
        config: PathBuf,
    },
    /// Re-read hosts.json, needs.json and capabilities.json (same as SIGHUP).
    Reload {
        #[arg(long, default_value = DEFAULT_CONFIG)]
        config: PathBuf,
    },
    /// Start a three-host demo fleet on loopback and walk through its lifecycle.
    Demo(fort_agent::demo::DemoArgs),
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("FORT_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colour only for a person at a terminal, never into journald or a log file.
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
}

async fn admin_call(
    config: &std::path::Path,
    req: AdminRequest,
) -> Result<serde_json::Value, String> {
    let cfg = Config::load(config).map_err(|e| e.to_string())?;
    admin::call(&cfg.admin_socket, &req).await
}

fn print_admin(reply: Result<serde_json::Value, String>) -> ExitCode {
    match reply {
        Ok(v) => {
            println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
            if v["ok"].as_bool() == Some(true) {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("fort-agent: {e}");
            ExitCode::FAILURE
        }
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Serve { config } => {
            init_tracing();
            let config = match Config::load(&config) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("fort-agent: {e}");
                    return ExitCode::from(2);
                }
            };
            let shutdown = CancellationToken::new();
            let token = shutdown.clone();
            tokio::spawn(async move {
                let mut term =
                    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                        .expect("SIGTERM handler");
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
                tracing::info!("shutting down");
                token.cancel();
            });
            match fort_agent::run(config, shutdown).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    tracing::error!("{e:#}");
                    eprintln!("fort-agent: {e:#}");
                    ExitCode::from(2)
                }
            }
        }
        Command::Check { config, skip_key } => match fort_agent::check::check(&config, skip_key) {
            Ok(summary) => {
                println!("{summary}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("fort-agent check: {e:#}");
                ExitCode::FAILURE
            }
        },
        Command::Status { config, json } => {
            let reply = admin_call(&config, AdminRequest::Status).await;
            match (reply, json) {
                (Ok(v), false) => {
                    print!("{}", fort_agent::cli::status_table(&v["status"]));
                    ExitCode::SUCCESS
                }
                (r, _) => print_admin(r),
            }
        }
        Command::Trigger {
            capability,
            force,
            reason,
            config,
        } => print_admin(
            admin_call(
                &config,
                AdminRequest::Trigger {
                    capability,
                    force,
                    reason,
                },
            )
            .await,
        ),
        Command::Gc { dry_run, config } => {
            print_admin(admin_call(&config, AdminRequest::Gc { dry_run }).await)
        }
        Command::Reload { config } => print_admin(admin_call(&config, AdminRequest::Reload).await),
        Command::Demo(args) => {
            init_tracing_quiet();
            match fort_agent::demo::run(args).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("fort-agent demo: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

fn init_tracing_quiet() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("FORT_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}
