//! The CLI side of `fort-agent plan`: which new files to send, read here so the agent
//! needs no access to them.

use std::path::{Path, PathBuf};

use super::{PlanFile, PlanRequest};
use crate::config::Config;

/// The command line of `fort-agent plan`.
#[derive(Debug, Clone, Default)]
pub struct PlanArgs {
    /// The running agent's config (its admin socket; the files it names by default).
    pub config: PathBuf,
    pub new_config: Option<PathBuf>,
    pub hosts: Option<PathBuf>,
    pub needs: Option<PathBuf>,
    pub capabilities: Option<PathBuf>,
}

fn read(path: &Path) -> Result<PlanFile, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let text = String::from_utf8(bytes)
        .map_err(|_| format!("{}: not UTF-8 text, so not JSON or TOML", path.display()))?;
    Ok(PlanFile {
        path: path.to_owned(),
        text,
    })
}

/// A file given on the command line must exist; one the config names may be absent,
/// as the agent takes it (no needs, built-ins only). Notes say which were absent.
fn optional(
    given: Option<&Path>,
    named: Option<&Path>,
    absent_means: &str,
    notes: &mut Vec<String>,
) -> Result<Option<PlanFile>, String> {
    if let Some(p) = given {
        return read(p).map(Some);
    }
    let Some(p) = named else {
        notes.push(format!("the config names no file: {absent_means}"));
        return Ok(None);
    };
    match std::fs::metadata(p) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            notes.push(format!("{} does not exist: {absent_means}", p.display()));
            Ok(None)
        }
        _ => read(p).map(Some),
    }
}

/// The running config (for its admin socket), the request, and notes on absent files.
pub fn build(args: &PlanArgs) -> Result<(Config, PlanRequest, Vec<String>), String> {
    let running = Config::load(&args.config).map_err(|e| e.to_string())?;
    let new_config = match &args.new_config {
        Some(p) => {
            let f = read(p)?;
            // Parsed here too, to know the files it names; the agent checks it again.
            let parsed = Config::from_text(p, &f.text).map_err(|e| e.to_string())?;
            Some((f, parsed))
        }
        None => None,
    };
    let names = new_config.as_ref().map_or(&running, |(_, c)| c);
    let mut notes = Vec::new();
    let hosts = read(args.hosts.as_deref().unwrap_or(&names.hosts))?;
    let needs = optional(
        args.needs.as_deref(),
        names.needs.as_deref(),
        "the host would declare no needs",
        &mut notes,
    )?;
    let capabilities = optional(
        args.capabilities.as_deref(),
        names.capabilities.as_deref(),
        "the host would serve the built-in capabilities only",
        &mut notes,
    )?;
    let request = PlanRequest {
        hosts,
        needs,
        capabilities,
        config: new_config.map(|(f, _)| f),
    };
    Ok((running, request, notes))
}
