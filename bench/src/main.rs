//! `fort-bench`: benchmarks that start real `fort-agent` processes on loopback (keys and
//! files generated per run, agents killed on exit) and print their numbers.
//!
//! Build both binaries into one target dir, then run, e.g.:
//!   cargo build --release -p fort-agent -p fort-bench
//!   target/release/fort-bench status --connections 32 --duration 10s

mod acme;
mod at_rest;
mod backup_repo;
mod burst;
mod chaos;
mod converge;
mod cycle;
mod deliver;
mod dns_record;
mod failover;
mod gc;
mod mesh;
mod oidc;
mod openbao;
mod paired;
mod plan;
mod postgres;
mod proxy;
mod schema;
mod scrape;
mod sshca;
mod stall;
mod status;
mod unchanged;
mod util;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "fort-bench",
    version,
    about = "Benchmarks of fort agents on loopback"
)]
#[command(after_help = "Examples:
  fort-bench status --connections 32 --duration 10s --compare-plaintext
  fort-bench status --stall 300
  fort-bench status --target https://10.0.0.5:7770 --host forge --key ~/.ssh/id_ed25519 --origin alice --hosts /etc/fort/hosts.json
  fort-bench burst --consumers 20 --needs 50
  fort-bench failover --consumers 500 --needs 2
  fort-bench fulfill-cycle --needs 500
  fort-bench deliver --needs 500 --units 5
  fort-bench gc --origins 200
  fort-bench converge --consumers 50 --needs 10
  fort-bench schema --requests 2000 --rounds 3
  fort-bench plan --needs 500 --entries 5000
  fort-bench dns-record --create 500 --unchanged 10000
  fort-bench oidc --entries 500 --unchanged 10000
  fort-bench postgres --entries 500 --unchanged 10000
  fort-bench proxy --create 500 --unchanged 10000
  fort-bench ssh-ca --certs 500 --unchanged 10000
  fort-bench acme --count 200 --unchanged 10000
  fort-bench unchanged --entries 10000 --runs 5
  fort-bench backup-repo --create 100 --unchanged 10000
  fort-bench scrape --create 500 --unchanged 10000
  fort-bench mesh --members 100
  fort-bench chaos --duration 1h --seed 42
  fort-bench --json converge")]
struct Cli {
    /// Print one JSON object instead of aligned lines.
    #[arg(long, global = true)]
    json: bool,
    /// The fort-agent binary. Default: $FORT_BIN_FORT_AGENT, else next to fort-bench.
    #[arg(long, global = true)]
    agent_bin: Option<PathBuf>,
    /// FORT_LOG for the agents started (what a deployment runs with: info).
    #[arg(long, global = true, default_value = "info")]
    agent_log: String,
    /// Keep the fleet directory (configs, state files, agent logs) after the run.
    #[arg(long, global = true)]
    keep: bool,
    /// Worker threads of this process's runtime. Default: one per core.
    #[arg(long, global = true)]
    threads: Option<usize>,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Signed `status` calls over N keep-alive TLS connections: req/s, latency, TLS
    /// handshakes/s, and (with --compare-plaintext) the ratio to plain HTTP.
    Status(status::StatusArgs),
    /// N consumers × M needs at once against one provider: time until every need is
    /// called back, provider CPU per need, state writes, peak memory.
    Burst(burst::BurstArgs),
    /// K consumers × M needs from two providers, the home killed with kill -9 as every
    /// need comes due: time until the standby serves them all, and the connections that
    /// reach the dead home's address.
    Failover(failover::FailoverArgs),
    /// One consumer's fulfiller: CPU of a steady cycle, and N needs all due at once.
    FulfillCycle(cycle::CycleArgs),
    /// One consumer with N needs delivering files, answered in one burst and then all
    /// rotated: time, files written, unit restarts issued.
    Deliver(deliver::DeliverArgs),
    /// One GC sweep over entries from many origin agents.
    Gc(gc::GcArgs),
    /// Time for K consumer agents to converge, and their idle memory.
    Converge(converge::ConvergeArgs),
    /// Accepted async requests per second with a request_schema and without, as a ratio.
    Schema(schema::SchemaArgs),
    /// `fort-agent plan` latency on a consumer with N needs and on a provider with M
    /// entries, and proof that planning writes nothing.
    Plan(plan::PlanArgs),
    /// The dns-record handler against knotd and named: one run creating N records, and
    /// runs over M unchanged entries with the primary stopped.
    DnsRecord(dns_record::DnsRecordArgs),
    /// The oidc capability's handler against a real OpenID provider (npm's oidc-provider):
    /// one run registering N clients, a run over 10,000 unchanged entries with it stopped.
    Oidc(oidc::OidcArgs),
    /// The postgres capability's handler against a real PostgreSQL: one run creating N
    /// roles and databases, a run over 10,000 unchanged entries with the server stopped,
    /// and OpenBao's database engine issuing N credentials beside it (when `bao` is found).
    Postgres(postgres::PostgresArgs),
    /// The proxy handler against a real nginx: one run creating N vhosts (one test, one
    /// reload), and runs over M unchanged entries that call nginx for nothing.
    Proxy(proxy::ProxyArgs),
    /// The SSH CA handler: N certificates issued in one run beside `ssh-keygen -s` once
    /// per certificate, a run over M unchanged entries, and a release re-sending the KRL.
    SshCa(sshca::SshCaArgs),
    /// The acme handler against pebble (challenges always valid): N certificates issued
    /// by the handler, through agents and by `lego run` once per certificate (as
    /// security.acme), and a run over M unchanged entries with pebble stopped.
    Acme(acme::AcmeArgs),
    /// What sealing the state costs: the ssh-ca handler over M unchanged entries with
    /// plaintext and with sealed state, in alternating runs, as a ratio.
    AtRest(at_rest::AtRestArgs),
    /// Every capability's handler over N unchanged entries (what a provider pays on every
    /// request), measured the same way and side by side: median run, state per entry.
    Unchanged(unchanged::UnchangedArgs),
    /// A fleet of 40+ agents under seeded random faults (kills, hangs, partitions, slow
    /// links, full disks, clocks off, kills mid-run and mid-rotation, reloads, rollbacks)
    /// with invariants checked throughout and at the end; the figures, and any violation
    /// with its seed.
    Chaos(chaos::ChaosArgs),
    /// backup-repo: repositories and their restricted keys made in one run, against
    /// `borg init` and an authorized_keys edit per client by hand, and runs over N
    /// unchanged entries.
    BackupRepo(backup_repo::BackupRepoArgs),
    /// scrape: Prometheus targets made in one run, and runs over N unchanged exporters
    /// that must write no target file.
    Scrape(scrape::ScrapeArgs),
    /// A join reaching every member of an N-member WireGuard mesh (`fort-handler mesh`):
    /// the time, and the coordinator's handler runs and callbacks it took.
    Mesh(mesh::MeshArgs),
    /// The chaos run's token issuer (an async handler; not for use by hand).
    #[command(hide = true)]
    ChaosTokenHandler(chaos::token::TokenHandlerArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Cmd::ChaosTokenHandler(a) = cli.command {
        return match chaos::token::run(a) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("token handler: {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    if let Err(e) = util::init_agent_bin(cli.agent_bin.clone(), &cli.agent_log) {
        eprintln!("fort-bench: {e:#}");
        return ExitCode::from(2);
    }
    util::set_keep(cli.keep);
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = cli.threads {
        rt.worker_threads(n.max(1));
    }
    let rt = match rt.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("fort-bench: runtime: {e}");
            return ExitCode::from(2);
        }
    };
    let json = cli.json;
    let log_level = cli.agent_log.clone();
    // Every agent is owned inside these futures and killed when they return.
    let result = rt.block_on(async move {
        match cli.command {
            Cmd::Status(a) => status::run(a, json).await,
            Cmd::Burst(a) => burst::run(a, json).await,
            Cmd::Failover(a) => failover::run(a, json).await,
            Cmd::FulfillCycle(a) => cycle::run(a, json).await,
            Cmd::Deliver(a) => deliver::run(a, json).await,
            Cmd::Gc(a) => gc::run(a, json).await,
            Cmd::Converge(a) => converge::run(a, json).await,
            Cmd::Schema(a) => schema::run(a, json).await,
            Cmd::Plan(a) => plan::run(a, json).await,
            Cmd::DnsRecord(a) => dns_record::run(a, json).await,
            Cmd::Oidc(a) => oidc::run(a, json).await,
            Cmd::Postgres(a) => postgres::run(a, json).await,
            Cmd::Proxy(a) => proxy::run(a, json).await,
            Cmd::SshCa(a) => sshca::run(a, json).await,
            Cmd::Acme(a) => acme::run(a, json).await,
            Cmd::AtRest(a) => at_rest::run(a, json).await,
            Cmd::Unchanged(a) => unchanged::run(a, json).await,
            Cmd::BackupRepo(a) => backup_repo::run(a, json).await,
            Cmd::Scrape(a) => scrape::run(a, json).await,
            Cmd::Mesh(a) => mesh::run(a, json).await,
            Cmd::Chaos(a) => chaos::run(a, json, log_level).await,
            Cmd::ChaosTokenHandler(_) => unreachable!("handled before the runtime"),
        }
    });
    rt.shutdown_timeout(std::time::Duration::from_secs(2));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fort-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}
