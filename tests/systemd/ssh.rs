//! The `ssh-ca` capability under systemd: forge's agent (strictSandbox) makes its CA key
//! on the first run and certifies app's host key, as the NixOS module declares it
//! (`fort.host.capabilities.ssh-ca.sshCa`, `fort.host.sshCertificate`); app installs the
//! certificate beside its key, the CA's key and `@cert-authority` line, and the KRL its
//! consumer handler writes. `ssh-keygen` on the test host reads what landed. (The lane's
//! root has no sshd: that a real sshd presents the certificate and refuses what the KRL
//! revokes is shown by the ssh-ca tests outside the lane.)

use std::path::Path;
use std::process::Command;

use crate::fleet::{self, Lane};

/// `ssh-keygen ARGS FILE` over `content` written to a scratch file; its stdout.
fn ssh_keygen(args: &[&str], content: &str, scratch: &Path) -> String {
    let file = scratch.join("in");
    std::fs::write(&file, content).expect("write");
    let out = Command::new("ssh-keygen")
        .args(args)
        .arg(&file)
        .output()
        .expect("ssh-keygen");
    assert!(
        out.status.success(),
        "ssh-keygen {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn ssh_host_certificate_lands_under_systemd() {
    let test = "ssh_host_certificate_lands_under_systemd";
    let Some(lane) =
        Lane::boot_trees(
            test,
            "ssh/forge",
            "ssh/app",
            &mut |_, _, _| match Command::new("ssh-keygen").arg("-?").output() {
                Ok(_) => Ok(()),
                Err(_) => Err("ssh-keygen is not installed (it reads the certificate)".into()),
            },
        )
    else {
        return;
    };
    let (forge, app) = (&lane.forge, &lane.app);
    fleet::wait_need_satisfied(app, "ssh-ca/host");
    let scratch = tempfile::tempdir().expect("tempdir");
    let certificate = app.succeed("cat /etc/lane/host_key-cert.pub");
    let ca = app.succeed("cat /etc/ssh/fort_user_ca.pub");
    let known_hosts = app.succeed("cat /etc/ssh/ssh_known_hosts_fort");
    let listed = ssh_keygen(&["-L", "-f"], &certificate, scratch.path());
    assert!(listed.contains("host certificate"), "{listed}");
    let ca_fingerprint = ssh_keygen(&["-l", "-f"], &ca, scratch.path());
    let ca_sha = ca_fingerprint
        .split_whitespace()
        .nth(1)
        .expect("a fingerprint");
    assert!(
        listed.contains(&format!("Signing CA: ED25519 {ca_sha}")),
        "signed by the CA app was given: {listed}\n{ca_fingerprint}"
    );
    for principal in ["app", "app.lane.test"] {
        assert!(
            listed.lines().any(|l| l.trim() == principal),
            "{principal} in {listed}"
        );
    }
    // The certificate is for app's own host key: the key it signs with.
    let key_line = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../nixos-module/tests/keys/app.pub"),
    )
    .expect("app's public key");
    let key_fingerprint = ssh_keygen(&["-l", "-f"], &key_line, scratch.path());
    assert!(
        listed.contains(key_fingerprint.split_whitespace().nth(1).expect("fp")),
        "{listed}\n{key_fingerprint}"
    );
    assert!(
        known_hosts.starts_with("@cert-authority ") && known_hosts.contains(ca.trim()),
        "{known_hosts}"
    );
    // The KRL the consumer handler wrote beside them (no serial revoked yet).
    let krl = app.exec(&["test", "-s", "/etc/ssh/fort_revoked_keys.krl"]);
    assert!(krl.status.success(), "no KRL");
    // The CA key was made under the sandbox, in the agent's state directory, private.
    fleet::assert_private_under_sandbox(forge, "/var/lib/fort/handlers/ssh-ca/ca_key", "400");
    drop(lane);
}
