//! `fort-handler ssh-ca-krl --out PATH`: a need's handler on the consumer (docs/handlers.md
//! consumer handlers) that installs the KRL of an `ssh-ca` payload as the binary file
//! `sshd` reads through `RevokedKeys`. The payload's text fields land through the need's
//! `files`; the KRL is binary, so it is decoded, checked and written here. With
//! `--providers` (a need served by several providers, and one need per provider for its
//! CA) it installs what every listed provider must be trusted for (`super::trust`).

use std::ffi::OsString;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use base64::Engine;
use clap::Parser;

use super::{krl, trust};

/// The name `fort-handler` dispatches on.
pub const NAME: &str = "ssh-ca-krl";

/// Largest payload read: the agent's own bound on what a consumer handler gets.
const MAX_PAYLOAD: u64 = 16 << 20;

#[derive(Parser)]
#[command(
    name = "fort-handler ssh-ca-krl",
    about = "Installs the KRL of an ssh-ca payload (on stdin) for sshd's RevokedKeys"
)]
struct Cli {
    /// Where the KRL goes (replaced atomically, mode 0644; unchanged content is not
    /// rewritten).
    #[arg(long)]
    out: PathBuf,
    /// The providers the consumer lists (comma-separated): the payload is kept as its
    /// sender's part (`FORT_ORIGIN`, which must be one of them) in `<out>.d/`, and `--out`
    /// gets one KRL revoking what any listed provider's revokes.
    #[arg(long, value_delimiter = ',')]
    providers: Vec<String>,
    /// With `--providers`: where every listed provider's CA key goes, one per line
    /// (`TrustedUserCAKeys`).
    #[arg(long, requires = "providers")]
    ca_keys: Option<PathBuf>,
    /// With `--providers`: where every listed provider's `@cert-authority` line goes.
    #[arg(long, requires = "providers")]
    known_hosts: Option<PathBuf>,
}

/// Runs the helper with the process arguments after `fort-handler`.
pub fn main(args: Vec<OsString>) -> ExitCode {
    let cli = Cli::parse_from(args);
    let mut payload = Vec::new();
    if let Err(e) = std::io::stdin()
        .take(MAX_PAYLOAD + 1)
        .read_to_end(&mut payload)
    {
        eprintln!("{NAME}: cannot read the payload: {e}");
        return ExitCode::FAILURE;
    }
    if !cli.providers.is_empty() {
        return combined(&cli, &payload);
    }
    match install(&payload, &cli.out) {
        Ok(summary) => {
            eprintln!(
                "{NAME}: {} holds KRL version {} ({} revoked)",
                cli.out.display(),
                summary.version,
                summary.revoked_count
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{NAME}: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// `--providers`: the payload as its sender's part, and every listed provider's together.
fn combined(cli: &Cli, payload: &[u8]) -> ExitCode {
    if payload.len() as u64 > MAX_PAYLOAD {
        eprintln!("{NAME}: the payload is larger than 16 MiB");
        return ExitCode::FAILURE;
    }
    if let Some(bad) = cli
        .providers
        .iter()
        .find(|p| !fort_core::names::is_host_name(p))
    {
        eprintln!("{NAME}: --providers: {bad:?} is not a host name");
        return ExitCode::FAILURE;
    }
    let origin = std::env::var("FORT_ORIGIN").unwrap_or_default();
    let to = trust::Targets {
        krl: &cli.out,
        providers: &cli.providers,
        ca_keys: cli.ca_keys.as_deref(),
        known_hosts: cli.known_hosts.as_deref(),
    };
    match trust::install(payload, &origin, &to) {
        Ok(done) => {
            eprintln!(
                "{NAME}: {} holds the KRLs of {} ({} revoked)",
                cli.out.display(),
                done.providers.join(", "),
                done.krl.revoked_count
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{NAME}: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Decodes the payload's `krl`, checks it is a KRL, and writes it to `out` unless it
/// already holds exactly that.
pub fn install(payload: &[u8], out: &Path) -> anyhow::Result<krl::Summary> {
    if payload.len() as u64 > MAX_PAYLOAD {
        anyhow::bail!("the payload is larger than 16 MiB");
    }
    #[derive(serde::Deserialize)]
    struct Payload {
        krl: String,
    }
    let p: Payload = serde_json::from_slice(payload)
        .map_err(|e| anyhow::anyhow!("the payload is not an ssh-ca response: {e}"))?;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(p.krl.as_bytes())
        .map_err(|e| anyhow::anyhow!("krl is not base64: {e}"))?;
    let summary = krl::parse(&bytes).map_err(|e| anyhow::anyhow!("krl: {e}"))?;
    if std::fs::read(out).is_ok_and(|old| old == bytes) {
        return Ok(summary);
    }
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir)
            .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", dir.display()))?;
    }
    fort_core::store::write_atomic(out, &bytes)
        .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", out.display()))?;
    // A KRL is public (it lists serials); clients read it too (`RevokedHostKeys`).
    std::fs::set_permissions(out, std::fs::Permissions::from_mode(0o644))
        .map_err(|e| anyhow::anyhow!("cannot chmod {}: {e}", out.display()))?;
    Ok(summary)
}
