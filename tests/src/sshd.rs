//! OpenSSH on loopback for tests: `sshd` started from the files a test names (its host
//! key and certificate, the CA keys it trusts for users, its KRL), stopped on drop or on
//! a signal (crate::cleanup); the `ssh` client with nothing but the known hosts file and
//! key a test gives it; and `ssh-keygen`'s view of certificates and KRLs.

use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fort_core::process::Stop;
use ssh_key::rand_core::OsRng;
use ssh_key::{Algorithm, LineEnding, PrivateKey};

use crate::cleanup::Running;

pub const SSHD: &str = "/usr/sbin/sshd";

/// Whether sshd can run here (root, openssh-server and -client); `skip`s `test` if not.
pub fn can_run(test: &str) -> bool {
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
    if !root {
        crate::skip(
            test,
            "sshd must be started as root (openssh-server's privilege separation)",
        );
        return false;
    }
    if !Path::new(SSHD).exists() {
        crate::skip(test, "openssh-server is not installed (no /usr/sbin/sshd)");
        return false;
    }
    for tool in ["ssh", "ssh-keygen"] {
        if Command::new(tool)
            .arg("-V")
            .stderr(Stdio::null())
            .status()
            .is_err()
        {
            crate::skip(test, &format!("{tool} (openssh-client) is not installed"));
            return false;
        }
    }
    true
}

/// A private key (0600) and its public half beside it, as OpenSSH keeps them.
pub fn key_pair(path: &Path) -> String {
    let k = PrivateKey::random(&mut OsRng, Algorithm::Ed25519).expect("key");
    k.write_openssh_file(path, LineEnding::LF)
        .expect("write key");
    let public = k.public_key().to_openssh().expect("public line");
    std::fs::write(path.with_extension("pub"), &public).expect("write public key");
    public
}

/// What sshd is started with.
#[derive(Clone)]
pub struct SshdFiles {
    pub host_key: PathBuf,
    pub host_certificate: PathBuf,
    /// `TrustedUserCAKeys`.
    pub trusted_user_ca_keys: PathBuf,
    /// `RevokedKeys`.
    pub revoked_keys: PathBuf,
}

impl SshdFiles {
    /// `ssh_host_ed25519_key`, its `-cert.pub`, `ca.pub` and `revoked.krl` in `dir`.
    pub fn in_dir(dir: &Path) -> SshdFiles {
        SshdFiles {
            host_key: dir.join("ssh_host_ed25519_key"),
            host_certificate: dir.join("ssh_host_ed25519_key-cert.pub"),
            trusted_user_ca_keys: dir.join("ca.pub"),
            revoked_keys: dir.join("revoked.krl"),
        }
    }
}

/// `sshd -D -e -f CONFIG` on loopback, stopped on drop; its config and log in its
/// directory.
pub struct Sshd {
    running: Running,
    pub addr: SocketAddr,
    log: PathBuf,
}

impl Sshd {
    /// sshd with `files`, its config and log written to `dir`, listening on `addr`.
    pub fn start(dir: &Path, addr: SocketAddr, files: &SshdFiles) -> Sshd {
        Sshd::start_with(
            dir,
            addr,
            &files.host_key,
            &format!(
                "HostCertificate {}\n\
                 TrustedUserCAKeys {}\n\
                 RevokedKeys {}\n\
                 AuthorizedKeysFile none\n",
                files.host_certificate.display(),
                files.trusted_user_ca_keys.display(),
                files.revoked_keys.display(),
            ),
        )
    }

    /// sshd with `host_key` and the settings `extra` (lines of sshd_config), its config
    /// and log written to `dir`, listening on `addr`; public keys only, no PAM.
    pub fn start_with(dir: &Path, addr: SocketAddr, host_key: &Path, extra: &str) -> Sshd {
        // sshd refuses to start without its privilege separation directory.
        let _ = std::fs::create_dir_all("/run/sshd");
        std::fs::create_dir_all(dir).expect("sshd dir");
        let config = dir.join(format!("sshd_config-{}", addr.port()));
        std::fs::write(
            &config,
            format!(
                "ListenAddress {addr}\n\
                 HostKey {}\n\
                 {extra}\
                 PubkeyAuthentication yes\n\
                 PasswordAuthentication no\n\
                 KbdInteractiveAuthentication no\n\
                 PermitRootLogin prohibit-password\n\
                 UsePAM no\n\
                 StrictModes no\n\
                 PidFile {d}/sshd-{port}.pid\n\
                 LogLevel VERBOSE\n",
                host_key.display(),
                d = dir.display(),
                port = addr.port(),
            ),
        )
        .expect("write sshd_config");
        let log = dir.join(format!("sshd-{}.log", addr.port()));
        let running = Running::spawn(
            Command::new(SSHD)
                .args(["-D", "-e", "-f"])
                .arg(&config)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log).expect("sshd log")),
            Stop::TERM,
        )
        .expect("start sshd");
        let mut sshd = Sshd { running, addr, log };
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect_timeout(&addr, Duration::from_millis(100)).is_err() {
            if let Some(status) = sshd.running.exited() {
                panic!("sshd exited ({status}):\n{}", sshd.log_text());
            }
            assert!(
                Instant::now() < deadline,
                "sshd did not listen:\n{}",
                sshd.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        sshd
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// `ssh -v root@ADDR echo fort-ok` with nothing but the given known hosts file and key
/// (its certificate, if any, beside it as `<key>-cert.pub`), checking the host
/// certificate for the name `app.example.test`, and `extra` options (`-o K=V` pairs):
/// (success, stdout, stderr).
pub fn ssh(sshd: &Sshd, known_hosts: &Path, key: &Path, extra: &[&str]) -> (bool, String, String) {
    let out = Command::new("ssh")
        .args([
            "-F",
            "/dev/null",
            "-v",
            "-o",
            "StrictHostKeyChecking=yes",
            "-o",
        ])
        .arg(format!("UserKnownHostsFile={}", known_hosts.display()))
        .args([
            "-o",
            "GlobalKnownHostsFile=/dev/null",
            "-o",
            "BatchMode=yes",
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "ConnectTimeout=10",
            // The name the host certificate is checked against; the address is loopback.
            "-o",
            "HostKeyAlias=app.example.test",
        ])
        .args(extra.iter().flat_map(|o| ["-o", o]))
        .arg("-i")
        .arg(key)
        .args(["-p", &sshd.addr.port().to_string()])
        .arg(format!("root@{}", sshd.addr.ip()))
        .args(["echo", "fort-ok"])
        .stdin(Stdio::null())
        .output()
        .expect("run ssh");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `ssh-keygen -Q -f KRL CERT` says REVOKED.
pub fn krl_revokes(krl: &Path, cert: &Path) -> bool {
    Command::new("ssh-keygen")
        .args(["-Q", "-f"])
        .arg(krl)
        .arg(cert)
        .output()
        .is_ok_and(|o| o.status.code() == Some(1))
}

/// The serial of a certificate file, as `ssh-keygen -L` reads it.
pub fn cert_serial(path: &Path) -> u64 {
    cert_field(path, "Serial: ")
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no serial in {}", path.display()))
}

/// The signing CA's fingerprint of a certificate file (`ssh-keygen -L`'s "Signing CA").
pub fn cert_signing_ca(path: &Path) -> String {
    cert_field(path, "Signing CA: ")
        .unwrap_or_else(|| panic!("no signing CA in {}", path.display()))
}

fn cert_field(path: &Path, prefix: &str) -> Option<String> {
    let out = Command::new("ssh-keygen")
        .arg("-L")
        .arg("-f")
        .arg(path)
        .output()
        .expect("ssh-keygen -L");
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.trim().strip_prefix(prefix))
        .map(str::to_owned)
}
