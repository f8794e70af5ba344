//! The `acme` capability under systemd: forge's agent (strictSandbox) runs
//! `fort-handler acme` against pebble on the lane's loopback, and app's agent makes the
//! key, asks with its CSR and installs key and certificate together, as the NixOS module
//! declares them (`fort.host.capabilities.ssl-cert.acme`, `fort.host.certificates.web`).

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;

use fort_tests::lane::{Machine, Net};
use fort_tests::pebble::Pebble;

use crate::fleet::{self, Lane};

/// Where the lane's fleet expects the CA (nixos-module/tests/lane/fleet.nix).
const DIRECTORY: &str = "127.0.0.1:14000";
const MANAGEMENT: &str = "127.0.0.1:15000";
const DIR: &str = "/var/lib/fort-certificates/web";

/// `openssl ARGS` on the test host over `input`, its stdout.
fn openssl(args: &[&str], input: &str, scratch: &Path) -> String {
    let file = scratch.join("in.pem");
    std::fs::write(&file, input).expect("write");
    let out = Command::new("openssl")
        .args(args)
        .arg("-in")
        .arg(&file)
        .output()
        .expect("openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Starts pebble where the lane's fleet expects it, and gives `forge` its TLS root and
/// the webroot the capability writes challenge answers into.
pub fn start_pebble(net: &Net, forge: &Machine) -> Result<Pebble, String> {
    let listen: SocketAddr = DIRECTORY.parse().expect("address");
    let management: SocketAddr = MANAGEMENT.parse().expect("address");
    let p = Pebble::start_in_namespace(&net.path(), listen, management, &|a| net.reachable(a))?;
    forge.write(
        "/etc/lane/pebble-root.pem",
        std::fs::read(&p.tls_root).expect("pebble's TLS root"),
        0o644,
    );
    forge.mkdir("/var/lib/lane-acme-webroot", 0o755);
    Ok(p)
}

#[test]
fn acme_certificate_for_a_key_app_made_lands_under_systemd() {
    let test = "acme_certificate_for_a_key_app_made_lands_under_systemd";
    let mut pebble: Option<Pebble> = None;
    let Some(lane) = Lane::boot_trees(test, "certs/forge", "certs/app", &mut |net, forge, _| {
        if Command::new("openssl").arg("version").output().is_err() {
            return Err(
                "openssl is not installed (it checks the key against the certificate)".into(),
            );
        }
        pebble = Some(start_pebble(net, forge)?);
        Ok(())
    }) else {
        return;
    };
    let (forge, app) = (&lane.forge, &lane.app);
    fleet::wait_need_satisfied(app, "ssl-cert/web");

    // The key app made, readable by root and the group the module names, and the
    // certificate pebble issued for exactly that key.
    assert_eq!(
        app.succeed(&format!("stat -c '%U %G %a' {DIR}/key.pem")),
        "root lane-web 440\n"
    );
    let key = app.succeed(&format!("cat {DIR}/key.pem"));
    let cert = app.succeed(&format!("cat {DIR}/cert.pem"));
    let fullchain = app.succeed(&format!("cat {DIR}/fullchain.pem"));
    assert!(
        fullchain.starts_with(&cert),
        "fullchain starts with the leaf"
    );
    let scratch = tempfile::tempdir().expect("tempdir");
    let key_public = openssl(&["pkey", "-pubout"], &key, scratch.path());
    let cert_public = openssl(&["x509", "-noout", "-pubkey"], &cert, scratch.path());
    assert_eq!(key_public, cert_public, "the certificate is for app's key");
    let subject = openssl(
        &["x509", "-noout", "-ext", "subjectAltName"],
        &cert,
        scratch.path(),
    );
    assert!(subject.contains("DNS:app.example.test"), "{subject}");
    let issuer = openssl(&["x509", "-noout", "-issuer"], &cert, scratch.path());
    assert!(issuer.contains("Pebble"), "issued by pebble: {issuer}");
    let journal = app.journal("fort-agent.service", 400);
    assert!(
        journal.contains("installed the new key with its certificate"),
        "{journal}"
    );

    // The key never left app: not in forge's state, webroot or journal.
    let secret_line = key.lines().nth(1).expect("a PEM body line").to_owned();
    let found = forge.exec(&[
        "grep",
        "-rlF",
        &secret_line,
        "/var/lib/fort",
        "/var/lib/lane-acme-webroot",
    ]);
    assert_eq!(
        found.status.code(),
        Some(1),
        "the key is on forge: {}",
        String::from_utf8_lossy(&found.stdout)
    );
    assert!(!forge
        .journal("fort-agent.service", 2000)
        .contains(&secret_line));
    // The handler's state lives in the agent's state directory, private; the challenge
    // answers it wrote into the webroot under strictSandbox are gone again.
    fleet::assert_private_under_sandbox(forge, "/var/lib/fort/handlers/ssl-cert.json", "600");
    assert_eq!(
        forge.succeed("find /var/lib/lane-acme-webroot -type f | wc -l"),
        "0\n"
    );
    drop(lane);
    drop(pebble);
}
