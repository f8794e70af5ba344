//! `fort-agent`: the per-host daemon and its local commands.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use fort_agent::admin::{self, AdminRequest};
use fort_agent::config::Config;
use fort_agent::plan::{self, request::PlanArgs};
use tokio_util::sync::CancellationToken;

const DEFAULT_CONFIG: &str = "/etc/fort/agent.toml";

#[derive(Parser)]
#[command(
    name = "fort-agent",
    version,
    about = "The fort agent: signed control plane, capabilities and needs for one NixOS host"
)]
#[command(
    after_help = "Examples:\n  fort-agent serve --config /etc/fort/agent.toml\n  fort-agent check --config ./agent.toml\n  fort-agent check --needs app/needs.json --capabilities forge/capabilities.json --hosts hosts.json --provider forge --consumer app\n  fort-agent check --fleet ./fleet-files\n  fort-agent status\n  fort-agent trigger ssl-cert --force\n  fort-agent trigger oidc --entry app:oidc/wiki --force\n  fort-agent resend oidc/wiki\n  fort-agent gc --dry-run\n  fort-agent audit show --need oidc/wiki --since 2h\n  fort-agent audit verify\n  fort-agent plan --needs ./new-needs.json\n  fort-agent serve --recover --config /etc/fort/agent.toml\n  fort-agent set-aside fulfillment-state.json\n  fort-agent demo --keep"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum AuditCommand {
    /// Print the records, oldest first, filtered by need, host, event or time.
    Show {
        #[command(flatten)]
        source: fort_agent::audit_cli::Source,
        #[command(flatten)]
        filter: fort_agent::audit_cli::Filter,
        /// Print the records as they are in the files (JSON lines).
        #[arg(long)]
        json: bool,
    },
    /// Check the chain of records and every checkpoint's signature with the host's keys
    /// in hosts.json; exit 1 naming the first bad record.
    Verify {
        #[command(flatten)]
        source: fort_agent::audit_cli::Source,
        /// Print the outcome as JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum Command {
    /// Run the daemon.
    Serve {
        /// The agent's config file (agent.toml).
        #[arg(long, default_value = DEFAULT_CONFIG, value_name = "FILE")]
        config: PathBuf,
        /// A state file this release refuses (another release wrote it, or it is damaged)
        /// is moved aside under <state_dir>/set-aside/ and every record this release can
        /// read is kept, instead of not starting. The log says what was not kept.
        #[arg(long)]
        recover: bool,
    },
    /// Move a state file (and its logs) aside, under <state_dir>/set-aside/, so that the
    /// agent starts without it; nothing is deleted. Refused while the agent runs.
    SetAside {
        /// The agent's config file (agent.toml): where its state directory is.
        #[arg(long, default_value = DEFAULT_CONFIG, value_name = "FILE")]
        config: PathBuf,
        /// `provider-state.json` or `fulfillment-state.json`.
        #[arg(required = true)]
        files: Vec<String>,
    },
    /// Validate the config and every file it names, then exit: non-zero with the file
    /// and field at fault when the agent would refuse to start or could not run a
    /// handler.
    Check {
        /// The agent's config file (agent.toml).
        #[arg(long, default_value = DEFAULT_CONFIG, value_name = "FILE")]
        config: PathBuf,
        /// Do not read the host key (build-time checks have no key).
        #[arg(long)]
        skip_key: bool,
        /// Do not check that handler and check programs exist and are executable (files
        /// checked away from the host that runs them).
        #[arg(long)]
        skip_handlers: bool,
        /// Instead of a config: hold this consumer's needs.json against a provider's
        /// capabilities.json (its request schemas, and with --consumer its callers).
        #[arg(long, value_name = "FILE", requires_all = ["capabilities", "hosts"])]
        needs: Option<PathBuf>,
        /// The provider's capabilities.json (with --needs).
        #[arg(long, value_name = "FILE", requires = "needs")]
        capabilities: Option<PathBuf>,
        /// The fleet's hosts.json (with --needs).
        #[arg(long, value_name = "FILE", requires = "needs")]
        hosts: Option<PathBuf>,
        /// The provider's host name: only needs from it are checked, and each must be
        /// offered (with --needs). Default: every need whose type the file offers.
        #[arg(long, value_name = "HOST", requires = "needs")]
        provider: Option<String>,
        /// The consumer's host name: each need id must be among the callers (with --needs).
        #[arg(long, value_name = "HOST", requires = "needs")]
        consumer: Option<String>,
        /// Instead of a config: a whole fleet's files, DIR/<host>/{agent.toml,hosts.json,
        /// needs.json,capabilities.json} (the NixOS module's lib.fleetCheck builds it).
        /// Each host is checked as its own build checks it (without its key), every
        /// host must carry the same hosts.json, and every consumer's requests are held
        /// against each provider's request schemas and callers.
        #[arg(long, value_name = "DIR", conflicts_with_all = ["needs", "skip_key"])]
        fleet: Option<PathBuf>,
    },
    /// Show this host's needs, capabilities and provider entries (from the running agent).
    Status {
        /// The running agent's config: where its admin socket is.
        #[arg(long, default_value = DEFAULT_CONFIG, value_name = "FILE")]
        config: PathBuf,
        /// Print the agent's reply as JSON ({"ok", "status"}: the status document, its
        /// `entries` shaped as provider-state.json's, hashes instead of payloads).
        #[arg(long)]
        json: bool,
    },
    /// Run a capability's handler now and call back entries whose response changed.
    Trigger {
        /// A capability this host serves.
        capability: String,
        /// One entry, `<consumer>:<capability>/<need id>` (`fort-agent status` lists
        /// them): its consumer is called back after the run, changed or not.
        #[arg(long, value_name = "KEY")]
        entry: Option<String>,
        /// Pass no cached responses, so the handler issues new ones: with --entry, that
        /// entry's alone (the others keep theirs); without, every entry's.
        #[arg(long)]
        force: bool,
        /// Why: `manual` (default) or `systemd` (set by the NixOS module's units).
        #[arg(long)]
        reason: Option<String>,
        /// Print the agent's reply as JSON.
        #[arg(long)]
        json: bool,
        /// The running agent's config: where its admin socket is.
        #[arg(long, default_value = DEFAULT_CONFIG, value_name = "FILE")]
        config: PathBuf,
    },
    /// Send one need's request to its provider again now, whatever the need's state.
    Resend {
        /// A need this host declares, `<type>/<id>`.
        need: String,
        /// Print the agent's reply as JSON.
        #[arg(long)]
        json: bool,
        /// The running agent's config: where its admin socket is.
        #[arg(long, default_value = DEFAULT_CONFIG, value_name = "FILE")]
        config: PathBuf,
    },
    /// Run a GC sweep now and print what was removed and why.
    Gc {
        /// Decide and print, but remove nothing.
        #[arg(long)]
        dry_run: bool,
        /// Print the agent's reply as JSON.
        #[arg(long)]
        json: bool,
        /// The running agent's config: where its admin socket is.
        #[arg(long, default_value = DEFAULT_CONFIG, value_name = "FILE")]
        config: PathBuf,
    },
    /// Show what loading new files would change in the running agent; changes nothing.
    ///
    /// The files not given are those the new config (or else the running one) names,
    /// as a reload would read them. They are read here and sent to the agent, which
    /// validates them exactly as a reload does.
    Plan {
        /// The running agent's config: its admin socket, and the files it names.
        #[arg(long, default_value = DEFAULT_CONFIG, value_name = "FILE")]
        config: PathBuf,
        /// A new agent.toml: keys that change are listed (they take effect on a
        /// restart), and it names the files not given below.
        #[arg(long, value_name = "FILE")]
        new_config: Option<PathBuf>,
        /// The new hosts.json.
        #[arg(long, value_name = "FILE")]
        hosts: Option<PathBuf>,
        /// The new needs.json.
        #[arg(long, value_name = "FILE")]
        needs: Option<PathBuf>,
        /// The new capabilities.json.
        #[arg(long, value_name = "FILE")]
        capabilities: Option<PathBuf>,
        /// Print the plan as JSON.
        #[arg(long)]
        json: bool,
    },
    /// The audit trail: what this host issued, received and was asked to do.
    #[command(subcommand)]
    Audit(AuditCommand),
    /// Re-read hosts.json, needs.json and capabilities.json (same as SIGHUP).
    Reload {
        /// Print the agent's reply as JSON.
        #[arg(long)]
        json: bool,
        /// The running agent's config: where its admin socket is.
        #[arg(long, default_value = DEFAULT_CONFIG, value_name = "FILE")]
        config: PathBuf,
    },
    /// Start a three-host demo fleet on loopback and walk through its lifecycle.
    Demo(fort_agent::demo::DemoArgs),
    /// The key that seals state holding secrets (docs/at-rest.md).
    #[command(subcommand)]
    StateKey(StateKeyCommand),
}

#[derive(Subcommand)]
enum StateKeyCommand {
    /// Make a new random state key in FILE (mode 0400; an existing file is never
    /// replaced). Under systemd, encrypt it with `systemd-creds encrypt --name=state-key`.
    New {
        /// Where the key goes: 64 hex digits, readable by its owner only.
        #[arg(value_name = "FILE")]
        file: PathBuf,
    },
    /// Seal every sealed file under the state directory (and each --dir) again with the
    /// key in --new-key, each atomically; files already under it are left alone, so an
    /// interrupted rotation is finished by running it again. Refused while the agent
    /// runs. Then install the new key as the agent's and start it.
    Rotate {
        /// The agent's config file (agent.toml): its state directory and its key.
        #[arg(long, default_value = DEFAULT_CONFIG, value_name = "FILE")]
        config: PathBuf,
        /// The key the files are sealed with now. Unset: the agent's (`state_key_file`,
        /// or the credential `state-key` in $CREDENTIALS_DIRECTORY).
        #[arg(long, value_name = "FILE")]
        old_key: Option<PathBuf>,
        /// The key to seal them with.
        #[arg(long, value_name = "FILE")]
        new_key: PathBuf,
        /// More directories holding handler state (a capability whose state file is
        /// outside the state directory).
        #[arg(long = "dir", value_name = "DIR")]
        dirs: Vec<PathBuf>,
    },
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

/// The host name the config gives, for messages.
fn host_of(config: &std::path::Path) -> String {
    Config::load(config).map_or_else(|_| "this host".to_owned(), |c| c.host)
}

/// Prints the agent's reply: as JSON with `json`, else as `text` renders it (an error
/// the agent reports goes to stderr). Exits 0 only when the agent says `ok`.
fn print_admin(
    reply: Result<serde_json::Value, String>,
    json: bool,
    text: impl FnOnce(&serde_json::Value) -> String,
) -> ExitCode {
    match reply {
        Ok(v) => {
            let ok = v["ok"].as_bool() == Some(true);
            if json {
                println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
            } else if ok || !v["run"].is_null() {
                print!("{}", text(&v));
            }
            if !ok {
                if let Some(e) = v["error"].as_str() {
                    eprintln!("fort-agent: {}", fort_core::text::printable(e, 1000));
                }
                return ExitCode::FAILURE;
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("fort-agent: {e}");
            ExitCode::FAILURE
        }
    }
}

fn main() -> ExitCode {
    tune_allocator();
    // Named crash points on every state write (docs/crash-points.md): off unless
    // FAILPOINTS names one, as the crash lane does.
    fort_core::crash::setup();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
        .block_on(agent_main())
}

/// Keeps the agent's resident memory close to what it uses (measured with `fort-bench
/// burst` at 50,000 entries: peak RSS 152–157 MB with glibc's defaults, 105–121 MB with
/// these, at the same CPU). By default glibc raises its mmap threshold each time a large
/// block is freed, so the next large buffers (handler input and output, a snapshot, a
/// batch) come from the heap and fragment it, and it keeps up to eight arenas per core,
/// each holding freed memory of its own. A fixed 1 MiB threshold returns large buffers to
/// the kernel when they are freed, and two arenas are plenty for two worker threads.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn tune_allocator() {
    // SAFETY: mallopt only sets allocator parameters; it is called before any other
    // thread exists. A refused setting (returns 0) leaves glibc's default in place.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn tune_allocator() {}

async fn agent_main() -> ExitCode {
    let cli = Cli::parse();
    if !matches!(cli.command, Command::Serve { .. } | Command::Demo { .. }) {
        fort_agent::cli::quiet_on_closed_pipe();
    }
    match cli.command {
        Command::Serve { config, recover } => {
            init_tracing();
            let config = match Config::load(&config) {
                Ok(c) => Config { recover, ..c },
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
        Command::Check {
            fleet: Some(dir),
            skip_handlers,
            ..
        } => match fort_agent::check_fleet::check_fleet(&dir, skip_handlers) {
            Ok(summary) => {
                println!("{summary}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("fort-agent check: {e:#}");
                ExitCode::FAILURE
            }
        },
        Command::Check {
            needs: Some(needs),
            capabilities: Some(capabilities),
            hosts: Some(hosts),
            provider,
            consumer,
            ..
        } => {
            let c = fort_agent::check_requests::RequestCheck {
                needs,
                capabilities,
                hosts,
                provider,
                consumer,
                limits: Default::default(),
            };
            match fort_agent::check_requests::check_requests(&c) {
                Ok(summary) => {
                    println!("{summary}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("fort-agent check: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Check {
            config,
            skip_key,
            skip_handlers,
            ..
        } => match fort_agent::check::check(
            &config,
            fort_agent::check::CheckOptions {
                skip_key,
                skip_handlers,
            },
        ) {
            Ok(checked) => {
                for w in checked.warnings {
                    eprintln!("fort-agent check: warning: {w}");
                }
                println!("{}", checked.summary);
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("fort-agent check: {e:#}");
                ExitCode::FAILURE
            }
        },
        Command::Status { config, json } => print_admin(
            admin_call(&config, AdminRequest::Status { entries: true }).await,
            json,
            |v| fort_agent::cli::status_table(&v["status"]),
        ),
        Command::Trigger {
            capability,
            entry,
            force,
            reason,
            json,
            config,
        } => {
            let req = AdminRequest::Trigger {
                capability,
                entry,
                force,
                reason,
            };
            let host = host_of(&config);
            print_admin(admin_call(&config, req).await, json, |v| {
                fort_agent::cli::trigger_text(&host, &v["trigger"])
            })
        }
        Command::Resend { need, json, config } => {
            let host = host_of(&config);
            print_admin(
                admin_call(&config, AdminRequest::Resend { need }).await,
                json,
                |v| fort_agent::cli::resend_text(&host, &v["resend"]),
            )
        }
        Command::Gc {
            dry_run,
            json,
            config,
        } => print_admin(
            admin_call(&config, AdminRequest::Gc { dry_run }).await,
            json,
            |v| fort_agent::cli::gc_text(&v["report"]),
        ),
        Command::SetAside { config, files } => {
            fort_agent::cli::offline::set_aside(&config, &files).await
        }
        Command::Audit(AuditCommand::Show {
            source,
            filter,
            json,
        }) => match fort_agent::audit_cli::show(&source, &filter, json) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("fort-agent audit: {e}");
                ExitCode::from(2)
            }
        },
        Command::Audit(AuditCommand::Verify { source, json }) => {
            match fort_agent::audit_cli::verify(&source, json) {
                Ok(true) => ExitCode::SUCCESS,
                Ok(false) => ExitCode::from(1),
                Err(e) => {
                    eprintln!("fort-agent audit: {e}");
                    ExitCode::from(2)
                }
            }
        }
        Command::StateKey(StateKeyCommand::New { file }) => {
            fort_agent::cli::offline::new_state_key(&file)
        }
        Command::StateKey(StateKeyCommand::Rotate {
            config,
            old_key,
            new_key,
            dirs,
        }) => {
            fort_agent::cli::offline::rotate_state_key(&config, old_key.as_deref(), &new_key, &dirs)
                .await
        }
        Command::Reload { json, config } => print_admin(
            admin_call(&config, AdminRequest::Reload).await,
            json,
            |_| "reloaded hosts.json, needs.json and capabilities.json\n".to_owned(),
        ),
        Command::Plan {
            config,
            new_config,
            hosts,
            needs,
            capabilities,
            json,
        } => {
            let args = PlanArgs {
                config,
                new_config,
                hosts,
                needs,
                capabilities,
            };
            plan(&args, json).await
        }
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

async fn plan(args: &PlanArgs, json: bool) -> ExitCode {
    let fail = |e: &str| {
        eprintln!("fort-agent plan: {e}");
        ExitCode::FAILURE
    };
    let (running, req, notes) = match plan::request::build(args) {
        Ok(b) => b,
        Err(e) => return fail(&e),
    };
    for n in notes {
        eprintln!("fort-agent plan: note: {n}");
    }
    let req = AdminRequest::Plan {
        hosts: req.hosts,
        needs: req.needs,
        capabilities: req.capabilities,
        config: req.config,
    };
    let reply = match admin::call(&running.admin_socket, &req).await {
        Ok(v) => v,
        Err(e) => return fail(&e),
    };
    if reply["ok"].as_bool() != Some(true) {
        return fail(
            reply["error"]
                .as_str()
                .unwrap_or("the agent refused the plan"),
        );
    }
    // The state formats this binary writes against those of the release running: the
    // running agent (maybe an older release) does not know what this binary will write.
    let running_status = admin::call(
        &running.admin_socket,
        &AdminRequest::Status { entries: false },
    )
    .await
    .map(|v| v["status"].clone())
    .unwrap_or_default();
    let formats = fort_agent::cli::versions::format_changes(&running_status);
    if json {
        let mut plan = reply["plan"].clone();
        plan["state_formats"] = formats;
        println!(
            "{}",
            serde_json::to_string_pretty(&plan).unwrap_or_default()
        );
        return ExitCode::SUCCESS;
    }
    match serde_json::from_value::<plan::Plan>(reply["plan"].clone()) {
        Ok(p) => {
            print!("{}", plan::render::text(&p));
            print!("{}", fort_agent::cli::versions::format_text(&formats));
            ExitCode::SUCCESS
        }
        Err(e) => fail(&format!("the agent's plan does not parse: {e}")),
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
