//! `fort-handler ssh-ca-krl --out PATH`: a need's handler on the consumer (docs/handlers.md
//! consumer handlers) that installs the KRL of an `ssh-ca` payload as the binary file
//! `sshd` reads through `RevokedKeys`. The payload's text fields land through the need's
//! `files`; the KRL is binary, so it is decoded, checked and written here.

use std::ffi::OsString;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use base64::Engine;
use clap::Parser;

use super::krl;

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
