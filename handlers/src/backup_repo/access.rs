//! What the backup server is given: the `authorized_keys` file (one line per entry, its
//! key restricted to `borg serve` on that entry's repository alone), the repository
//! directories, and the known_hosts lines consumers check the server with.

use std::ffi::OsStr;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use rustix::fs::{self as rfs, AtFlags, Mode, OFlags};

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

/// Largest number of names one removal takes away in a run; a larger tree loses this
/// many, and the rest in the runs after (a released repository past its retention is
/// looked at again within the second).
const MAX_REMOVED_PER_RUN: usize = 100_000;

/// Deepest a removal goes below the repository: borg writes `data/<n>/<segment>`, so a
/// deeper tree was made by someone else, and is left with the entry's failure.
const MAX_DEPTH: usize = 16;

fn dir_flags() -> OFlags {
    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC
}

/// The caller's and the repository's names of a path two levels below
/// `repositories_dir`, or why it is not one.
fn names<'p>(config: &Config, path: &'p Path) -> Result<[&'p OsStr; 2], String> {
    let not_ours = || {
        format!(
            "{} is not a repository of {}",
            path.display(),
            config.repositories_dir.display()
        )
    };
    let rest = path
        .strip_prefix(&config.repositories_dir)
        .map_err(|_| not_ours())?;
    let mut parts = rest.components().map(|c| match c {
        Component::Normal(name) => Some(name),
        _ => None,
    });
    match (parts.next(), parts.next(), parts.next()) {
        (Some(Some(origin)), Some(Some(id)), None) => Ok([origin, id]),
        _ => Err(not_ours()),
    }
}

/// `repositories_dir` itself, the operator's (a link there is the operator's choice);
/// everything below it is reached from here without following a link.
fn open_repositories_dir(config: &Config) -> Result<OwnedFd, String> {
    rfs::open(
        &config.repositories_dir,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| format!("cannot open {}: {e}", config.repositories_dir.display()))
}

/// Why `name` in `shown` cannot be entered.
fn not_entered(shown: &Path, e: rustix::io::Errno) -> String {
    match e {
        rustix::io::Errno::LOOP | rustix::io::Errno::NOTDIR => format!(
            "{} is a symbolic link or not a directory; the handler never goes through one",
            shown.display()
        ),
        e => format!("cannot open {}: {e}", shown.display()),
    }
}

/// Makes the repository's directory (and its caller's), mode 0700 and the owner's;
/// one already there is kept as it is (a repository retained for this very entry, or
/// made before its record was lost). The caller's directory is the owner's account's,
/// which `borg serve` drives: each name is opened from its parent without following a
/// link, and a directory made is given away through what was opened, so a link or a
/// FIFO planted there is this entry's failure, never a directory outside given away.
/// `Err` is this entry's failure.
pub fn make_repository(config: &Config, path: &Path, owner: &Owner) -> Result<(), String> {
    let uid = owner.uid(config)?;
    let mut dir = open_repositories_dir(config)?;
    let mut shown = config.repositories_dir.clone();
    for name in names(config, path)? {
        shown.push(name);
        let made = match rfs::mkdirat(&dir, name, Mode::from_raw_mode(0o700)) {
            Ok(()) => true,
            Err(rustix::io::Errno::EXIST) => false,
            Err(e) => return Err(format!("cannot make {}: {e}", shown.display())),
        };
        dir = rfs::openat(&dir, name, dir_flags(), Mode::empty())
            .map_err(|e| not_entered(&shown, e))?;
        // Made by this handler's account: given to the server's (which takes root).
        if made && rfs::fstat(&dir).map(|st| st.st_uid).ok() != Some(uid) {
            rfs::fchown(&dir, Some(rfs::Uid::from_raw(uid)), None)
                .map_err(|e| format!("cannot give {} to {}: {e}", shown.display(), config.user))?;
        }
    }
    Ok(())
}

/// How far a removal went.
#[derive(Debug, PartialEq, Eq)]
pub enum Removal {
    /// The repository is gone (and its caller's directory, when that was empty).
    Done,
    /// A run's share of a large repository is gone; the rest goes in the next run.
    Partly,
}

/// Why a walk stopped before the end.
enum Stop {
    /// The run's share of names is used up.
    Budget,
    Failed(String),
}

/// Removes a released repository whose retention has passed: only a path this handler
/// made (two levels below `repositories_dir`); its caller's directory goes when it is
/// empty. Everything below is the owner's account's: each name is removed from the
/// directory opened above it, never through a link (a link is removed, not followed; a
/// FIFO is unlinked, never opened), at most [`MAX_DEPTH`] deep and at most
/// [`MAX_REMOVED_PER_RUN`] names in a run. `Err`: what is left stays.
pub fn remove_repository(config: &Config, path: &Path) -> Result<Removal, String> {
    remove_repository_within(config, path, MAX_REMOVED_PER_RUN)
}

/// [`remove_repository`] taking away at most `budget` names.
pub(super) fn remove_repository_within(
    config: &Config,
    path: &Path,
    mut budget: usize,
) -> Result<Removal, String> {
    let [origin, id] = names(config, path)?;
    let top = open_repositories_dir(config)?;
    let caller = match rfs::openat(&top, origin, dir_flags(), Mode::empty()) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::NOENT) => return Ok(Removal::Done),
        Err(e) => return Err(not_entered(&config.repositories_dir.join(origin), e)),
    };
    match remove_tree(&caller, id, path, 0, &mut budget) {
        Ok(()) => {}
        Err(Stop::Budget) => return Ok(Removal::Partly),
        Err(Stop::Failed(why)) => return Err(why),
    }
    // Not empty (another repository of the caller) is fine.
    let _ = rfs::unlinkat(&top, origin, AtFlags::REMOVEDIR);
    Ok(Removal::Done)
}

/// Removes `name` in `parent` and, when it is a directory, everything below it.
fn remove_tree(
    parent: &OwnedFd,
    name: &OsStr,
    shown: &Path,
    depth: usize,
    budget: &mut usize,
) -> Result<(), Stop> {
    // unlink never follows a link and never opens what it removes; a directory says so.
    match rfs::unlinkat(parent, name, AtFlags::empty()) {
        Ok(()) | Err(rustix::io::Errno::NOENT) => return Ok(()),
        Err(rustix::io::Errno::ISDIR) => {}
        Err(e) => {
            return Err(Stop::Failed(format!(
                "cannot remove {}: {e}",
                shown.display()
            )))
        }
    }
    if depth >= MAX_DEPTH {
        return Err(Stop::Failed(format!(
            "{} is more than {MAX_DEPTH} directories deep in its repository; it is left as it is",
            shown.display()
        )));
    }
    let dir = rfs::openat(parent, name, dir_flags(), Mode::empty())
        .map_err(|e| Stop::Failed(not_entered(shown, e)))?;
    // The names first, then their removal: a directory is not read while it changes.
    // Those the budget allows are removed; the rest wait for a later run.
    let mut below = Vec::new();
    let mut more = false;
    for entry in rfs::Dir::read_from(&dir).map_err(|e| Stop::Failed(not_entered(shown, e)))? {
        let entry =
            entry.map_err(|e| Stop::Failed(format!("cannot read {}: {e}", shown.display())))?;
        let entry_name = entry.file_name().to_bytes();
        if entry_name == b"." || entry_name == b".." {
            continue;
        }
        if *budget == 0 {
            more = true;
            break;
        }
        *budget -= 1;
        below.push(OsStr::from_bytes(entry_name).to_owned());
    }
    for entry_name in below {
        remove_tree(
            &dir,
            &entry_name,
            &shown.join(&entry_name),
            depth + 1,
            budget,
        )?;
    }
    if more {
        return Err(Stop::Budget);
    }
    rfs::unlinkat(parent, name, AtFlags::REMOVEDIR)
        .map_err(|e| Stop::Failed(format!("cannot remove {}: {e}", shown.display())))
}
