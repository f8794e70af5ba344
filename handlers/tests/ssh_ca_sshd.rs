//! The SSH CA end to end, as a user meets it: real fort agents (a provider running
//! `fort-handler ssh-ca`, a consumer writing the delivered files), a real `sshd` on
//! loopback started from those files, and OpenSSH's `ssh` client. The host certificate
//! is presented and trusted through the `@cert-authority` line alone; a user
//! certificate, for a key the consumer's agent made and installed with it, logs in
//! through `TrustedUserCAKeys`; once released, its serial is in the
//! KRL the consumer installed for `RevokedKeys` and the same certificate is refused.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use fort_tests::sshd::{can_run, cert_serial, key_pair, krl_revokes, ssh, Sshd, SshdFiles};
use fort_tests::{bin, eventually, free_addr, Fleet};
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sshd_presents_the_delivered_host_certificate_and_honours_the_krl() {
    let test = "ssh_ca_sshd::sshd_presents_the_delivered_host_certificate_and_honours_the_krl";
    if !can_run(test) {
        return;
    }
    let mut f = Fleet::new();
    let root = f.dir.path().to_path_buf();
    let sshd_dir = root.join("app-sshd");
    let client = root.join("client");
    std::fs::create_dir_all(&sshd_dir).unwrap();
    std::fs::create_dir_all(&client).unwrap();
    let host_public = key_pair(&sshd_dir.join("ssh_host_ed25519_key"));

    // Provider `forge`: the CA key is made on the first run.
    f.host("forge");
    f.host("app");
    let config = root.join("ssh-ca.json");
    std::fs::write(
        &config,
        json!({
            "ca_key_file": root.join("ca/ca_key"),
            "generate_ca_key": true,
            "state_file": root.join("ca/state.json"),
            "hosts_file": f.host_dir("forge").join("hosts.json"),
            "host_principals": {"*": ["{origin}", "{origin}.example.test"]},
            "user_principals": {"app": ["root"]},
        })
        .to_string(),
    )
    .unwrap();
    // The request schema the NixOS module ships for the ssh-ca interface: the agent
    // compiles it and checks every request against it.
    let schemas: Value = serde_json::from_slice(
        &std::fs::read(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../nixos-module/tests/expected/schemas.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let schema = schemas["schemas"]["ssh-ca"].clone();
    assert!(schema.is_object());
    f.capability(
        "forge",
        "ssh-ca",
        json!({"handler": bin("fort-handler"), "args": ["ssh-ca", "--config", config],
               "mode": "async", "cacheResponse": true, "request_schema": schema}),
    );
    let file = |name: &str, path: PathBuf, pointer: &str, mode: &str| json!({"name": name, "path": path, "pointer": pointer, "mode": mode});
    let krl_handler = f.script(
        "install-krl",
        &format!(
            "exec {} ssh-ca-krl --out {}",
            bin("fort-handler").display(),
            sshd_dir.join("revoked.krl").display()
        ),
    );
    // Consumer `app`: its sshd's host certificate, the CA for user certificates, the
    // KRL, and (for the client) the @cert-authority line.
    f.need(
        "app",
        "ssh-ca/host",
        "forge",
        json!({
            // As the NixOS module ships it: unset options are null.
            "request": {"kind": "host", "public_key": host_public, "principals": null,
                        "validity_seconds": null},
            "files": [
                file("cert", sshd_dir.join("ssh_host_ed25519_key-cert.pub"), "/certificate", "0644"),
                file("ca", sshd_dir.join("ca.pub"), "/ca_public_key", "0644"),
                file("known_hosts", client.join("known_hosts"), "/known_hosts_line", "0644"),
            ],
            "handler": krl_handler,
        }),
    );
    f.need(
        "app",
        "ssh-ca/login",
        "forge",
        json!({
            // The user's key is made by app's agent (protocol §11.10), in OpenSSH's format
            // for ssh; only its public line is sent, and it is installed with the
            // certificate that is for it.
            "request": {"kind": "user", "public_key": {"$fort_key": "id", "as": "openssh"},
                        "principals": ["root"]},
            "keys": {"id": {"type": "ed25519", "format": "openssh",
                            "path": client.join("id_ed25519"), "mode": "0600"}},
            "files": [file("cert", client.join("id_ed25519-cert.pub"), "/certificate", "0600")],
        }),
    );
    // A host certificate for another host's name: refused, nothing delivered.
    f.need(
        "app",
        "ssh-ca/impostor",
        "forge",
        json!({
            "request": {"kind": "host", "public_key": host_public, "principals": ["forge.example.test"]},
            "files": [file("cert", sshd_dir.join("impostor-cert.pub"), "/certificate", "0644")],
        }),
    );
    f.start();
    let satisfied = |f: &Fleet, need: &str| f.need_status("app", need)["state"] == "satisfied";
    assert!(
        eventually(Duration::from_secs(30), || satisfied(&f, "ssh-ca/host")
            && satisfied(&f, "ssh-ca/login"))
        .await,
        "needs not satisfied: {}\nforge log:\n{}",
        f.status("app"),
        std::fs::read_to_string(f.host_dir("forge").join("agent.log")).unwrap_or_default()
    );
    // The user's key, made by app's agent, in OpenSSH's format and only for its owner.
    let id = client.join("id_ed25519");
    assert!(std::fs::read_to_string(&id)
        .unwrap()
        .starts_with("-----BEGIN OPENSSH PRIVATE KEY-----"));
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&id).unwrap().permissions().mode() & 0o777,
        0o600
    );
    // The consumer's need state says why (protocol §11.9).
    let impostor_reason = |f: &Fleet| {
        f.need_status("app", "ssh-ca/impostor")["reason"]
            .as_str()
            .unwrap_or("")
            .to_owned()
    };
    assert!(
        eventually(Duration::from_secs(30), || impostor_reason(&f)
            == "refused by forge: principal forge.example.test is not one app may have on a host certificate (allowed for app: app, app.example.test)")
        .await,
        "{}",
        f.need_status("app", "ssh-ca/impostor")
    );
    assert_ne!(
        f.need_status("app", "ssh-ca/impostor")["state"],
        "satisfied"
    );
    assert!(!sshd_dir.join("impostor-cert.pub").exists());
    let known_hosts = std::fs::read_to_string(client.join("known_hosts")).unwrap();
    assert!(
        known_hosts.starts_with("@cert-authority * ssh-ed25519 "),
        "{known_hosts}"
    );

    let sshd = Sshd::start(
        &sshd_dir,
        free_addr("127.0.0.1"),
        &SshdFiles::in_dir(&sshd_dir),
    );

    // The host certificate is presented and trusted through the @cert-authority line
    // alone (StrictHostKeyChecking=yes: no prompt, no learning); the user certificate
    // logs in with no authorized_keys anywhere.
    let (ok, stdout, stderr) = ssh(
        &sshd,
        &client.join("known_hosts"),
        &client.join("id_ed25519"),
        &[],
    );
    assert!(
        ok && stdout.trim() == "fort-ok",
        "ssh failed:\n{stderr}\nsshd:\n{}",
        sshd.log_text()
    );
    assert!(
        stderr.contains("Server host certificate: ssh-ed25519-cert-v01@openssh.com")
            && stderr.contains("ID \"app:ssh-ca/host\""),
        "{stderr}"
    );
    assert!(
        stderr.contains("Host '")
            && stderr.contains("is known and matches the ED25519-CERT host certificate"),
        "{stderr}"
    );
    assert!(
        sshd.log_text().contains("ID app:ssh-ca/login"),
        "{}",
        sshd.log_text()
    );

    // Controls: without the @cert-authority line the host is not trusted; without the
    // certificate the key alone does not log in.
    let empty = root.join("empty_known_hosts");
    std::fs::write(&empty, "").unwrap();
    let (ok, _, stderr) = ssh(&sshd, &empty, &client.join("id_ed25519"), &[]);
    assert!(
        !ok && stderr.contains("Host key verification failed"),
        "{stderr}"
    );
    let bare = root.join("bare");
    std::fs::create_dir_all(&bare).unwrap();
    std::fs::copy(client.join("id_ed25519"), bare.join("id_ed25519")).unwrap();
    let (ok, _, stderr) = ssh(
        &sshd,
        &client.join("known_hosts"),
        &bare.join("id_ed25519"),
        &[],
    );
    assert!(!ok && stderr.contains("Permission denied"), "{stderr}");

    // The certificate is kept aside (as a leaked copy would be), then the need released.
    let kept = root.join("kept");
    std::fs::create_dir_all(&kept).unwrap();
    std::fs::copy(client.join("id_ed25519"), kept.join("id_ed25519")).unwrap();
    std::fs::copy(
        client.join("id_ed25519-cert.pub"),
        kept.join("id_ed25519-cert.pub"),
    )
    .unwrap();
    let serial = cert_serial(&kept.join("id_ed25519-cert.pub"));
    f.host("app").needs.remove("ssh-ca/login");
    f.write_files();
    f.agents["app"].hup();
    let krl = sshd_dir.join("revoked.krl");
    assert!(
        eventually(Duration::from_secs(30), || krl_revokes(
            &krl,
            &kept.join("id_ed25519-cert.pub")
        ))
        .await,
        "serial {serial} never reached the installed KRL; app: {}",
        f.status("app")
    );
    let listed = Command::new("ssh-keygen")
        .args(["-Q", "-l", "-f"])
        .arg(&krl)
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&listed.stdout).contains(&format!("serial: {serial}")));

    // The same sshd, unchanged, reads the new KRL: the kept certificate is refused, and
    // the host certificate still works.
    let (ok, _, stderr) = ssh(
        &sshd,
        &client.join("known_hosts"),
        &kept.join("id_ed25519"),
        &[],
    );
    assert!(!ok && stderr.contains("Permission denied"), "{stderr}");
    assert!(
        eventually(Duration::from_secs(5), || sshd
            .log_text()
            .contains("revoked by file"))
        .await,
        "sshd did not say why:\n{}",
        sshd.log_text()
    );
    let (_, _, stderr) = ssh(
        &sshd,
        &client.join("known_hosts"),
        &kept.join("id_ed25519"),
        &[],
    );
    assert!(stderr.contains("Server host certificate"), "{stderr}");
    let status: Value = f.need_status("app", "ssh-ca/host");
    assert_eq!(status["state"], "satisfied", "{status}");
}
