//! The state key (docs/at-rest.md): where the agent finds it, the check at start that it
//! is private and that every sealed file under the state directory opens with it, and
//! `fort-agent state-key` (a new key; re-sealing everything with another).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use fort_core::sealed::{self, StateKey, CREDENTIAL_NAME};
use fort_core::store::Resealed;

use crate::config::Config;
use crate::provider::sealing::SealedResponses;

/// Where the key is to be read from: `state_key_file`, else systemd's credential, else
/// nowhere (with the reason, for the log).
pub fn source(config: &Config) -> Result<PathBuf, String> {
    if let Some(file) = &config.state_key_file {
        return Ok(file.clone());
    }
    let why = match std::env::var_os("CREDENTIALS_DIRECTORY") {
        Some(dir) => {
            let file = Path::new(&dir).join(CREDENTIAL_NAME);
            if file.exists() {
                return Ok(file);
            }
            format!(
                "{} has no credential {CREDENTIAL_NAME}",
                Path::new(&dir).display()
            )
        }
        None => "systemd gave the agent no credentials ($CREDENTIALS_DIRECTORY is unset)".into(),
    };
    Err(format!(
        "{} sets no state_key_file, and {why}",
        config.config_file.display()
    ))
}

/// The key the agent seals state with, checked against every sealed file it keeps: a
/// file sealed with another key, or changed on disk, stops the start with the file and
/// the way on. `None` (logged) when there is no key.
pub fn load_and_check(config: &Config) -> Result<Option<Arc<StateKey>>, String> {
    let key = match source(config) {
        Ok(file) => {
            check_private(&file)?;
            Arc::new(StateKey::load(&file)?)
        }
        Err(why) => {
            tracing::warn!(
                "state is kept in plaintext: {why}. Secrets the handlers keep (CA and account keys, passwords, tokens) are readable from a copy of {}; see docs/at-rest.md",
                config.state_dir.display()
            );
            // Sealed files without a key are refused the same way.
            check(&config.state_dir, None)?;
            return Ok(None);
        }
    };
    let files = check(&config.state_dir, Some(&key))?;
    tracing::info!(key = key.id(), file = %key.source().display(), sealed_files = files, "state is sealed with the state key");
    Ok(Some(key))
}

/// A key file that others than its owner may read (or replace) gives away every sealed
/// file, so the agent does not start with it. A systemd credential is exempt: systemd
/// decrypts it into the unit's own `$CREDENTIALS_DIRECTORY` and decides its mode.
fn check_private(file: &Path) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    if let Some(dir) = std::env::var_os("CREDENTIALS_DIRECTORY") {
        if file.starts_with(Path::new(&dir)) {
            return Ok(());
        }
    }
    let shown = file.display();
    let mode = std::fs::metadata(file)
        .map_err(|e| format!("cannot read the state key {shown}: {e}"))?
        .permissions()
        .mode()
        & 0o777;
    if mode & 0o077 != 0 {
        return Err(format!(
            "the state key {shown} has mode {mode:04o}: its group or others may read it, and whoever reads it opens every sealed file. The agent does not start with it: make it its owner's alone (`chmod 600 {shown}`), or give it as a systemd credential (LoadCredentialEncrypted=, read from $CREDENTIALS_DIRECTORY)"
        ));
    }
    Ok(())
}

/// Opens every sealed file under `dir` with `key`; the number of them.
fn check(dir: &Path, key: Option<&StateKey>) -> Result<usize, String> {
    let files = sealed::sealed_files(dir)
        .map_err(|e| format!("cannot look for sealed files in {}: {e}", dir.display()))?;
    for file in &files {
        sealed::read(file, key).map_err(|e| e.to_string())?;
    }
    Ok(files.len())
}

/// `fort-agent state-key rotate`: every sealed file under the state directory and
/// `extra_dirs` sealed again with the key in `new_file`, each atomically. Files already
/// under the new key are left alone, so that a rotation cut short is finished by running
/// it again. The agent must be stopped (the caller checks).
pub fn rotate(
    config: &Config,
    old_file: Option<&Path>,
    new_file: &Path,
    extra_dirs: &[PathBuf],
) -> Result<String, String> {
    let new = StateKey::load(new_file)?;
    let old = match old_file.map_or_else(|| source(config), |f| Ok(f.to_owned())) {
        Ok(f) => Some(StateKey::load(&f)?),
        Err(_) => None,
    };
    let mut dirs = vec![config.state_dir.clone()];
    dirs.extend(extra_dirs.iter().cloned());
    let (mut resealed, mut already) = (0usize, 0usize);
    // The provider's cached responses, sealed inside a file that is otherwise plain.
    let provider = config.state_dir.join(crate::provider::state::FILE);
    let sealing = SealedResponses::sealing;
    match fort_core::store::reseal(
        &provider,
        crate::provider::state::FIELD,
        sealing(old.as_ref(), &provider),
        Arc::new(SealedResponses::new(&new, &provider)),
    )
    .map_err(|e| e.to_string())?
    {
        Resealed::Resealed => resealed += 1,
        Resealed::Already => already += 1,
        Resealed::Plain | Resealed::Absent => {}
    }
    for dir in &dirs {
        let files = sealed::sealed_files(dir)
            .map_err(|e| format!("cannot look for sealed files in {}: {e}", dir.display()))?;
        for file in files {
            let bytes =
                std::fs::read(&file).map_err(|e| format!("cannot read {}: {e}", file.display()))?;
            if sealed::key_id_of(&bytes).as_deref() == Some(new.id()) {
                // Opened, not just recognised: a damaged file is reported now.
                new.open(&file, &bytes).map_err(|e| e.to_string())?;
                already += 1;
                continue;
            }
            let plain = sealed::open_bytes(&file, bytes, old.as_ref())
                .map_err(|e| e.to_string())?
                .plain;
            sealed::write(&file, &plain, Some(&new))
                .map_err(|e| format!("cannot write {}: {e}", file.display()))?;
            resealed += 1;
        }
    }
    Ok(format!(
        "sealed {resealed} file(s) with the state key {} ({already} already were); install {} as the agent's state key before starting it",
        new.id(),
        new_file.display()
    ))
}

/// `fort-agent state-key new FILE`: a new random key, mode 0400, never over a file.
pub fn new_key_file(file: &Path) -> Result<String, String> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let text = StateKey::generate_hex();
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o400)
        .open(file)
        .map_err(|e| format!("cannot create {}: {e}", file.display()))?;
    f.write_all(text.as_bytes())
        .and_then(|()| f.sync_all())
        .map_err(|e| format!("cannot write {}: {e}", file.display()))?;
    let key = StateKey::load(file)?;
    Ok(format!(
        "made the state key {} in {}",
        key.id(),
        file.display()
    ))
}
