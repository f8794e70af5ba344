//! `fort-handler <capability> --config FILE`: the async provider handler of one capability
//! (docs/handlers.md). Reads every entry on stdin, answers on stdout, logs on stderr;
//! exits non-zero when the run must change nothing (a backend that is down).

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use fort_handlers::{capability, common, mesh, ssh_ca, CAPABILITIES};

#[derive(Parser)]
#[command(
    name = "fort-handler",
    version = fort_core::VERSION,
    about = "fort's capability handlers, run by fort-agent over every entry of a capability",
    after_help = after_help()
)]
struct Cli {
    /// The capability this run serves (see the list below).
    capability: String,
    /// The capability's config (JSON; the NixOS module writes it).
    #[arg(long, required_unless_present_any = ["schema", "answers", "failover"])]
    config: Option<PathBuf>,
    /// Validate the config and the files it names, then exit; nothing is contacted.
    #[arg(long)]
    check: bool,
    /// Print the JSON Schema of the capability's requests (capabilities.json's
    /// `request_schema`, as the NixOS module writes it), then exit.
    #[arg(long, conflicts_with_all = ["config", "check", "vet"])]
    schema: bool,
    /// Read entries on stdin as a run would and print, as a JSON object, those the
    /// provider's policy refuses with why, decided from the config and `--hosts` alone:
    /// no server is contacted, no secret read, no state touched (the fleet check).
    #[arg(long, requires = "hosts")]
    vet: bool,
    /// The fleet's hosts.json, for `--vet`.
    #[arg(long)]
    hosts: Option<PathBuf>,
    /// Print the members every response of this capability has (a JSON list), then
    /// exit; the config is not read.
    #[arg(long)]
    answers: bool,
    /// Print whether a need may name several providers of this capability (JSON:
    /// `{"failover": "independent"}`, `{"failover": "shared-backend"}` or
    /// `{"failover": "one-provider", "why": …}`), then exit. With `--config`, a
    /// shared backend also says which it is and the peers the config names
    /// (`"backend"`, `"peers"`); nothing is contacted.
    #[arg(long)]
    failover: bool,
}

fn after_help() -> String {
    let mut text = String::from("Capabilities:\n");
    for c in CAPABILITIES {
        text.push_str(&format!("  {:<12} {}\n", c.name, c.about));
    }
    text.push_str(
        "\nConsumer helpers (a need's handler, the payload on stdin):\n  \
         ssh-ca-krl --out PATH   installs an ssh-ca payload's KRL for sshd's RevokedKeys\n  \
         mesh-wg --interface IFACE --private-key FILE\n                          \
         applies a mesh answer to a WireGuard interface (wg syncconf)\n",
    );
    text
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .without_time()
        .with_target(false)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("FORT_HANDLER_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    // Crash points of the handler's own writes (its state, a CA key it makes), armed as
    // the agent's are when the crash lane names one.
    fort_core::crash::setup();
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if args.get(1).is_some_and(|a| a == ssh_ca::install::NAME) {
        return ssh_ca::install::main(args[1..].to_vec());
    }
    if args.get(1).is_some_and(|a| a == mesh::apply::NAME) {
        return mesh::apply::main(args[1..].to_vec());
    }
    let cli = Cli::parse();
    let Some(cap) = capability(&cli.capability) else {
        eprintln!(
            "fort-handler: no capability {:?}; known: {}",
            cli.capability,
            CAPABILITIES
                .iter()
                .map(|c| c.name)
                .collect::<Vec<_>>()
                .join(", ")
        );
        return ExitCode::from(2);
    };
    if cli.answers {
        println!("{}", serde_json::json!(cap.answers));
        return ExitCode::SUCCESS;
    }
    if cli.failover {
        let said = match cap.failover {
            fort_handlers::Failover::Independent => serde_json::json!({"failover": "independent"}),
            fort_handlers::Failover::SharedBackend(backend) => match &cli.config {
                None => serde_json::json!({"failover": "shared-backend"}),
                Some(path) => match backend(path) {
                    Ok(b) => serde_json::json!({"failover": "shared-backend",
                                                "backend": b.backend, "peers": b.peers}),
                    Err(e) => {
                        eprintln!("fort-handler: {e:#}");
                        return ExitCode::from(2);
                    }
                },
            },
            fort_handlers::Failover::OneProvider(why) => {
                serde_json::json!({"failover": "one-provider", "why": why})
            }
        };
        println!("{said}");
        return ExitCode::SUCCESS;
    }
    if cli.schema {
        return match fort_handlers::schema::request_schema(cap.name) {
            Some(schema) => {
                println!("{schema:#}");
                ExitCode::SUCCESS
            }
            None => {
                eprintln!("fort-handler {}: no request schema is built in", cap.name);
                ExitCode::FAILURE
            }
        };
    }
    let Some(config) = cli.config else {
        eprintln!("fort-handler {}: --config FILE is required", cap.name);
        return ExitCode::from(2);
    };
    if cli.check {
        return match (cap.check)(&config) {
            Ok(()) => {
                println!("{}: {} is valid", cap.name, config.display());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("fort-handler {}: {e:#}", cap.name);
                ExitCode::FAILURE
            }
        };
    }
    let mut input = Vec::new();
    if let Err(e) = std::io::stdin().read_to_end(&mut input) {
        eprintln!("fort-handler {}: cannot read stdin: {e}", cap.name);
        return ExitCode::FAILURE;
    }
    if let (true, Some(hosts)) = (cli.vet, &cli.hosts) {
        let vetted = common::hosts::Fleet::load(hosts).and_then(|fleet| {
            let entries = common::parse_input(&input)?;
            (cap.vet)(&config, &fleet, &entries)
        });
        return match vetted {
            Ok(refusals) => {
                println!("{}", serde_json::json!(refusals));
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("fort-handler {}: {e:#}", cap.name);
                ExitCode::FAILURE
            }
        };
    }
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("fort-handler: cannot start: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        let entries = common::parse_input(&input)?;
        (cap.run)(&config, entries, common::Trigger::from_env()).await
    });
    match result {
        Ok(output) => {
            // Streamed: 10,000 certificates are tens of megabytes, which a string made
            // first would allocate (and fault in) once more.
            let mut stdout = std::io::BufWriter::with_capacity(1 << 16, std::io::stdout().lock());
            if serde_json::to_writer(&mut stdout, &output.into_json()).is_err()
                || stdout.flush().is_err()
            {
                return ExitCode::FAILURE;
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("fort-handler {}: {e:#}", cap.name);
            ExitCode::FAILURE
        }
    }
}
