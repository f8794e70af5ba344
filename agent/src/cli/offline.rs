//! Commands that change the agent's state files while it is stopped (`fort-agent
//! set-aside`, `fort-agent state-key rotate`): a running agent would write them again
//! meanwhile, so each refuses while the agent answers on its admin socket.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use crate::admin::{self, AdminRequest};
use crate::config::Config;

/// The agent's configuration, once it is known not to be running; else the exit code
/// `command` ends with, its reason printed.
async fn stopped_agent(config: &Path, command: &str, why: &str) -> Result<Config, ExitCode> {
    let cfg = Config::load(config).map_err(|e| {
        eprintln!("fort-agent {command}: {e}");
        ExitCode::from(2)
    })?;
    if admin::call(&cfg.admin_socket, &AdminRequest::Counts)
        .await
        .is_ok()
    {
        eprintln!(
            "fort-agent {command}: the agent is running (it answers on {}); stop it first: {why}",
            cfg.admin_socket.display()
        );
        return Err(ExitCode::FAILURE);
    }
    Ok(cfg)
}

/// `fort-agent set-aside`: moves state files aside while the agent is stopped.
pub async fn set_aside(config: &Path, files: &[String]) -> ExitCode {
    const STORES: [&str; 2] = [crate::provider::state::FILE, fort_fulfill::state::FILE];
    if let Some(f) = files.iter().find(|f| !STORES.contains(&f.as_str())) {
        eprintln!(
            "fort-agent set-aside: {f:?} is not a state file fort-agent keeps (one of {STORES:?})"
        );
        return ExitCode::from(2);
    }
    let cfg = match stopped_agent(config, "set-aside", "it would write the files again").await {
        Ok(cfg) => cfg,
        Err(code) => return code,
    };
    for f in files {
        let name = f.trim_end_matches(".json");
        match fort_core::store::set_aside(&cfg.state_dir, name) {
            Ok(Some(dir)) => println!(
                "{f}: moved to {}; the agent starts without it",
                dir.display()
            ),
            Ok(None) => println!("{f}: not in {}; nothing to move", cfg.state_dir.display()),
            Err(e) => {
                eprintln!("fort-agent set-aside: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}

/// `fort-agent state-key new FILE`.
pub fn new_state_key(file: &Path) -> ExitCode {
    report(crate::state_key::new_key_file(file))
}

/// `fort-agent state-key rotate`: every sealed file under the state directory (and
/// `dirs`) sealed again under `new_key`, while the agent is stopped.
pub async fn rotate_state_key(
    config: &Path,
    old_key: Option<&Path>,
    new_key: &Path,
    dirs: &[PathBuf],
) -> ExitCode {
    let cfg = match stopped_agent(
        config,
        "state-key rotate",
        "it would write files under the old key meanwhile",
    )
    .await
    {
        Ok(cfg) => cfg,
        Err(code) => return code,
    };
    report(crate::state_key::rotate(&cfg, old_key, new_key, dirs))
}

fn report<E: std::fmt::Display>(done: Result<String, E>) -> ExitCode {
    match done {
        Ok(text) => {
            println!("{text}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("fort-agent state-key: {e}");
            ExitCode::FAILURE
        }
    }
}
