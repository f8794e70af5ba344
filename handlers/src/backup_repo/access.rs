//! What the backup server is given: the `authorized_keys` file (one line per entry, its
//! key restricted to `borg serve` on that entry's repository alone), the repository
//! directories, and the known_hosts lines consumers check the server with.

use std::path::{Path, PathBuf};

use super::config::Config;
use super::state::Repo;

/// The `authorized_keys` file's first line: what it is and that it is replaced whole.
const HEADER: &str = "# Written by fort-handler backup-repo, whole: one line per repository it serves; edits here are lost.\n";

/// The forced command of a repository's key: `borg serve` restricted to exactly that
/// repository (no other path, no sub-repository), append-only unless granted more, and
/// under its quota whatever the repository's own config says.
pub fn command(config: &Config, repo: &Repo) -> String {
    let mut command = format!(
        "{} serve --restrict-to-repository {}",
        config.borg,
        repo.path.display()
    );
    if repo.append_only {
        command.push_str(" --append-only");
    }
    command.push_str(&format!(" --storage-quota {}", repo.quota));
    command
}

/// The file's content for the repositories that may be reached now (entry key → repo),
/// in key order: `command="…",restrict <type> <base64> <entry key>` each. `restrict`
/// turns off forwarding, agent, X11 and a terminal, and whatever sshd adds later.
pub fn authorized_keys<'a>(
    config: &Config,
    reachable: impl Iterator<Item = (&'a String, &'a Repo)>,
) -> String {
    let mut out = String::from(HEADER);
    for (key, repo) in reachable {
        out.push_str(&format!(
            "command=\"{}\",restrict {} {key}\n",
            command(config, repo),
            repo.key
        ));
    }
    out
}

/// Writes the file when its content differs: mode 0644, as sshd requires of a file
/// anyone but root could not change (`StrictModes`). Its directory must exist.
pub fn write_authorized_keys(config: &Config, content: &str) -> anyhow::Result<bool> {
    crate::common::files::replace_if_changed(
        &config.authorized_keys_file,
        content.as_bytes(),
        0o644,
    )
    .map_err(|e| {
        anyhow::anyhow!(
            "cannot write {}: {e}",
            config.authorized_keys_file.display()
        )
    })
}

/// The known_hosts lines of the server's host keys, as a consumer's `ssh` checks them
/// for `host` (`[host]:port` off port 22), each key without its comment.
pub fn known_hosts(config: &Config) -> anyhow::Result<String> {
    let name = if config.port == 22 {
        config.host.clone()
    } else {
        format!("[{}]:{}", config.host, config.port)
    };
    let mut out = String::new();
    for file in &config.host_key_files {
        let text = std::fs::read_to_string(file)
            .map_err(|e| anyhow::anyhow!("cannot read the host key {}: {e}", file.display()))?;
        let key = ssh_key::PublicKey::from_openssh(text.trim())
            .map_err(|e| anyhow::anyhow!("{} is not an OpenSSH public key: {e}", file.display()))?;
        let line = ssh_key::PublicKey::new(key.key_data().clone(), "")
            .to_openssh()
            .map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
        out.push_str(&format!("{name} {line}\n"));
    }
    Ok(out)
}

/// `<repositories_dir>/<origin>/<need id>`: both names are fort names (lower-case
/// letters, digits, `-`, `_`), so the path is plain and one entry's alone.
pub fn repository_path(config: &Config, origin: &str, id: &str) -> Result<PathBuf, String> {
    let plain = |s: &str| {
        !s.is_empty()
            && s.len() <= 64
            && !s.starts_with(['.', '-'])
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-_".contains(&b))
    };
    if !(plain(origin) && plain(id)) {
        return Err(format!("{origin}:{id} does not name a repository path"));
    }
    Ok(config.repositories_dir.join(origin).join(id))
}

/// The account that owns the repositories (`borg serve` runs as it and writes them):
/// looked up once, when the first directory is made.
#[derive(Default)]
pub struct Owner(std::cell::OnceCell<Result<u32, String>>);

impl Owner {
    fn uid(&self, config: &Config) -> Result<u32, String> {
        self.0
            .get_or_init(|| fort_core::accounts::account_id(&config.user, false))
            .clone()
    }
}

/// Makes the repository's directory (and its caller's), mode 0700 and the owner's;
/// one already there is kept as it is (a repository retained for this very entry, or
/// made before its record was lost). `Err` is this entry's failure.
pub fn make_repository(config: &Config, path: &Path, owner: &Owner) -> Result<(), String> {
    use std::os::unix::fs::DirBuilderExt;
    let parent = path.parent().unwrap_or(&config.repositories_dir);
    let uid = owner.uid(config)?;
    for dir in [parent, path] {
        if dir.is_dir() {
            continue;
        }
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(dir)
            .map_err(|e| format!("cannot make {}: {e}", dir.display()))?;
        // Made by this handler's account: given to the server's (which takes root).
        use std::os::unix::fs::MetadataExt;
        let made_by = std::fs::metadata(dir).map(|m| m.uid()).ok();
        if made_by != Some(uid) {
            std::os::unix::fs::chown(dir, Some(uid), None)
                .map_err(|e| format!("cannot give {} to {}: {e}", dir.display(), config.user))?;
        }
    }
    Ok(())
}

/// Removes a released repository whose retention has passed: only a path this handler
/// made (two levels below `repositories_dir`), never following a link out of it; its
/// caller's directory goes when it is empty.
pub fn remove_repository(config: &Config, path: &Path) -> Result<(), String> {
    let inside = path
        .strip_prefix(&config.repositories_dir)
        .is_ok_and(|rest| rest.components().count() == 2);
    if !inside {
        return Err(format!(
            "{} is not a repository of {}",
            path.display(),
            config.repositories_dir.display()
        ));
    }
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(format!("cannot look at {}: {e}", path.display())),
        Ok(m) if m.file_type().is_symlink() => std::fs::remove_file(path)
            .map_err(|e| format!("cannot remove {}: {e}", path.display()))?,
        Ok(_) => std::fs::remove_dir_all(path)
            .map_err(|e| format!("cannot remove {}: {e}", path.display()))?,
    }
    if let Some(parent) = path.parent() {
        // Not empty (another repository of the caller) is fine.
        let _ = std::fs::remove_dir(parent);
    }
    Ok(())
}
