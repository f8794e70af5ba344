//! BorgBackup for tests: the `borg` client pointed at a repository over `ssh` with
//! nothing but the key, known hosts file and passphrase a test gives it, its cache and
//! config in a directory of the test's own.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Whether borg can be driven over a real sshd here (root, openssh-server and -client,
/// borgbackup); `skip`s `test` if not.
pub fn can_run(test: &str) -> bool {
    if !crate::sshd::can_run(test) {
        return false;
    }
    if Command::new("borg")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_err()
    {
        crate::skip(test, "borgbackup is not installed (no borg)");
        return false;
    }
    true
}

/// One consumer's borg: its SSH key, the known hosts file it was given, its passphrase.
#[derive(Clone)]
pub struct Client {
    pub key: PathBuf,
    pub known_hosts: PathBuf,
    pub passphrase: String,
    /// `BORG_BASE_DIR`: its cache, config and security files.
    pub base: PathBuf,
}

/// What one borg command did.
#[derive(Debug)]
pub struct Outcome {
    pub ok: bool,
    pub stdout: String,
    pub stderr: String,
}

impl Client {
    pub fn new(dir: &Path, key: PathBuf, known_hosts: PathBuf, passphrase: &str) -> Client {
        Client {
            key,
            known_hosts,
            passphrase: passphrase.to_owned(),
            base: dir.join("borg-base"),
        }
    }

    /// The same client with another key.
    pub fn with_key(&self, key: PathBuf) -> Client {
        Client {
            key,
            ..self.clone()
        }
    }

    /// `borg ARGS`, over `ssh -i KEY` with only the known hosts file (no prompt, no
    /// agent, no other identity), never asking anything on a terminal.
    pub fn run(&self, args: &[&str]) -> Outcome {
        let rsh = format!(
            "ssh -F /dev/null -i {} -o IdentitiesOnly=yes -o IdentityAgent=none -o BatchMode=yes -o StrictHostKeyChecking=yes -o UserKnownHostsFile={} -o GlobalKnownHostsFile=/dev/null -o ConnectTimeout=10",
            self.key.display(),
            self.known_hosts.display()
        );
        let out = Command::new("borg")
            .args(args)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("BORG_RSH", rsh)
            .env("BORG_PASSPHRASE", &self.passphrase)
            .env("BORG_BASE_DIR", &self.base)
            // A rolled back repository is older than this client's cache: said, not asked.
            .env("BORG_RELOCATED_REPO_ACCESS_IS_OK", "yes")
            .env("BORG_UNKNOWN_UNENCRYPTED_REPO_ACCESS_IS_OK", "no")
            .env("BORG_CHECK_I_KNOW_WHAT_I_AM_DOING", "NO")
            .env("BORG_DELETE_I_KNOW_WHAT_I_AM_DOING", "YES")
            .stdin(Stdio::null())
            .output()
            .expect("run borg");
        Outcome {
            ok: out.status.success(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }
}
