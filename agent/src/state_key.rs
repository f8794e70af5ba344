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

/// A key file that anyone but the agent's user (or root) may read or replace gives away
/// every sealed file, so the agent does not start with it: its mode must keep group and
/// others out, it must belong to the agent's user or root, and no directory on its way
/// may let another user swap it (writable by group or others; a world-writable directory
/// with the sticky bit, such as /tmp, still lets its owner's files alone, so only its
/// own directory must not be writable at all). A link is followed and both the link's
/// place and its target are held to this. A systemd credential is exempt: systemd
/// decrypts it into the unit's own `$CREDENTIALS_DIRECTORY` and decides its mode.
pub fn check_private(file: &Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    if let Some(dir) = std::env::var_os("CREDENTIALS_DIRECTORY") {
        if file.starts_with(Path::new(&dir)) {
            return Ok(());
        }
    }
    let shown = file.display();
    let meta =
        std::fs::metadata(file).map_err(|e| format!("cannot read the state key {shown}: {e}"))?;
    if !meta.is_file() {
        return Err(format!("the state key {shown} is not a regular file"));
    }
    let mode = meta.mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(format!(
            "the state key {shown} has mode {mode:04o}: its group or others may read it, and whoever reads it opens every sealed file. The agent does not start with it: make it its owner's alone (`chmod 600 {shown}`), or give it as a systemd credential (LoadCredentialEncrypted=, read from $CREDENTIALS_DIRECTORY)"
        ));
    }
    let me = rustix::process::geteuid().as_raw();
    if meta.uid() != me && meta.uid() != 0 {
        return Err(format!(
            "the state key {shown} belongs to user {} (the agent runs as user {me}): its owner can read or replace it. The agent does not start with it: `chown` it to the agent's user or root",
            meta.uid()
        ));
    }
    let mut places = vec![file.to_path_buf()];
    if let Ok(target) = std::fs::canonicalize(file) {
        if target != file {
            places.push(target);
        }
    }
    for place in &places {
        let abs = std::path::absolute(place).unwrap_or_else(|_| place.clone());
        for (depth, dir) in abs.ancestors().skip(1).enumerate() {
            let Ok(d) = std::fs::metadata(dir) else {
                continue;
            };
            let writable = d.mode() & 0o022 != 0;
            let sticky = d.mode() & 0o1000 != 0;
            let foreign = d.uid() != me && d.uid() != 0;
            if (writable && (depth == 0 || !sticky)) || foreign {
                return Err(format!(
                    "the state key {shown} lies in {} ({}): another user could replace the key there. The agent does not start with it: keep the key in a directory only its owner or root may change (or give it as a systemd credential)",
                    dir.display(),
                    if foreign {
                        format!("owned by user {}", d.uid())
                    } else {
                        format!("mode {:04o}", d.mode() & 0o7777)
                    }
                ));
            }
        }
    }
    Ok(())
}

/// Opens every sealed file under `dir`, and every one the handlers noted in its registry
/// (also outside it), with `key`; the number of them.
fn check(dir: &Path, key: Option<&StateKey>) -> Result<usize, String> {
    let files = known_sealed_files(dir, &[])?;
    for file in &files {
        sealed::read(file, key).map_err(|e| e.to_string())?;
    }
    Ok(files.len())
}

/// The sealed files fort keeps: under the state directory and `extra_dirs`, and those the
/// handlers noted in the state directory's registry. A temporary file a killed writer left
/// beside one is removed on the way (it was never state).
fn known_sealed_files(state_dir: &Path, extra_dirs: &[PathBuf]) -> Result<Vec<PathBuf>, String> {
    let mut files = Vec::new();
    for dir in std::iter::once(state_dir).chain(extra_dirs.iter().map(PathBuf::as_path)) {
        files.extend(
            sealed::sealed_files(dir)
                .map_err(|e| format!("cannot look for sealed files in {}: {e}", dir.display()))?,
        );
    }
    for noted in sealed::noted(state_dir) {
        let bytes = fort_core::fsx::read_regular(&noted, 1 << 30)
            .map_err(|e| format!("cannot read {}: {e}", noted.display()))?;
        if sealed::is_sealed(&bytes) {
            files.push(noted);
        }
    }
    files.sort();
    files.dedup();
    for f in &files {
        fort_core::store::remove_stale_temporaries_of(f);
    }
    Ok(files)
}

/// `fort-agent state-key rotate`: every sealed file under the state directory and
/// `extra_dirs`, and every one the handlers noted (an SSH CA key, a handler's state kept
/// elsewhere), sealed again with the key in `new_file`, each atomically. Files already
/// under the new key are left alone, and a temporary file a cut-short run left is never
/// taken for one, so a rotation cut short is finished by running it again. A file that
/// opens with neither key stops the rotation, which names it and every file still under
/// the old key: nothing is left behind unsaid. The agent must be stopped (the caller
/// checks).
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
    let (mut resealed, mut already) = (0usize, 0usize);
    // The provider's cached responses and the consumer's kept payloads, each sealed
    // inside a file that is otherwise plain.
    let provider = config.state_dir.join(crate::provider::state::FILE);
    let consumer = config.state_dir.join(fort_fulfill::state::FILE);
    let sealing = SealedResponses::sealing;
    let payloads = fort_fulfill::sealing::SealedPayloads::sealing;
    let outcomes = [
        fort_core::store::reseal(
            &provider,
            crate::provider::state::FIELD,
            sealing(old.as_ref(), &provider),
            Arc::new(SealedResponses::new(&new, &provider)),
        ),
        fort_core::store::reseal(
            &consumer,
            fort_fulfill::state::FIELD,
            payloads(old.as_ref(), &consumer),
            Arc::new(fort_fulfill::sealing::SealedPayloads::new(&new, &consumer)),
        ),
    ];
    for outcome in outcomes {
        match outcome.map_err(|e| e.to_string())? {
            Resealed::Resealed => resealed += 1,
            Resealed::Already => already += 1,
            Resealed::Plain | Resealed::Absent => {}
        }
    }
    let files = known_sealed_files(&config.state_dir, extra_dirs)?;
    let mut left: Vec<String> = Vec::new();
    let mut failure: Option<String> = None;
    for file in &files {
        let outcome = (|| {
            let bytes = fort_core::fsx::read_regular(file, 1 << 30)
                .map_err(|e| format!("cannot read {}: {e}", file.display()))?;
            if sealed::key_id_of(&bytes).as_deref() == Some(new.id()) {
                // Opened, not just recognised: a damaged file is reported now.
                new.open(file, &bytes).map_err(|e| e.to_string())?;
                return Ok(false);
            }
            let plain = sealed::open_bytes(file, bytes, old.as_ref())
                .map_err(|e| e.to_string())?
                .plain;
            sealed::write_at(
                file,
                &plain,
                Some(&new),
                Some(fort_core::crash::replace_temp("state-key.rotate.temp")),
            )
            .map_err(|e| format!("cannot write {}: {e}", file.display()))?;
            fort_core::crash::point("state-key.rotate.between");
            Ok(true)
        })();
        match outcome {
            Ok(true) => resealed += 1,
            Ok(false) => already += 1,
            Err(e) => {
                left.push(file.display().to_string());
                failure.get_or_insert(e);
            }
        }
    }
    if let Some(e) = failure {
        return Err(format!(
            "{e}\nthe rotation is not finished: {} file(s) are not sealed with the state key {} ({}); {resealed} were sealed with it now and {already} already were. Keep the old key until every file is rotated: fix the file named first, or move it aside, and run the rotation again",
            left.len(),
            new.id(),
            left.join(", ")
        ));
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
