//! What a consumer of several `ssh-ca` providers trusts: a `{"kind": "ca"}` entry answered
//! with the CA key, its `@cert-authority` line and its KRL and nothing to certify; and
//! `fort-handler ssh-ca-krl --providers`, run as the agent runs a consumer handler, making
//! one KRL of two CAs' that OpenSSH's `ssh-keygen -Q` reads as revoking what either
//! revoked, and one file of their keys.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use serde_json::{json, Value};

mod ssh_ca_harness;
use ssh_ca_harness::*;

#[test]
fn a_ca_request_gets_what_to_trust_and_no_certificate() {
    let test = "ssh_ca_trust::a_ca_request_gets_what_to_trust_and_no_certificate";
    let ca = Ca::new(json!({}));
    // `ops` may have no host certificate: the CA's public part is still its to have.
    let input = json!({
        "app:ssh-ca/host": entry(json!({"kind": "host", "public_key": public(&key())})),
        "ops:ssh-ca/trust": entry(json!({"kind": "ca"})),
        "web:ssh-ca/trust": entry(json!({"kind": "ca", "public_key": null, "principals": null,
                                         "validity_seconds": null})),
        "web:ssh-ca/bad": entry(json!({"kind": "ca", "principals": ["web"]})),
    });
    let out = ca.ok(&input);
    let host = &out["app:ssh-ca/host"];
    for key in ["ops:ssh-ca/trust", "web:ssh-ca/trust"] {
        let trust = &out[key];
        assert_eq!(trust["kind"], "ca", "{out}");
        for field in ["ca_public_key", "known_hosts_line", "krl"] {
            assert_eq!(trust[field], host[field], "{field}");
        }
        for field in ["certificate", "serial", "expires_at"] {
            assert!(trust.get(field).is_none(), "{key} has {field}: {trust}");
        }
    }
    assert!(
        out["web:ssh-ca/bad"]["$fort_refused"]
            .as_str()
            .is_some_and(|r| r.contains("has no field \"principals\"")),
        "{out}"
    );
    let state = ca.state();
    let entries = state["state"]["entries"].as_object().unwrap();
    assert_eq!(entries.keys().collect::<Vec<_>>(), ["app:ssh-ca/host"]);

    // The host entry asks for the CA only now: the certificate it had is revoked.
    if !have_ssh_keygen(test) {
        return;
    }
    let cert = ca.file("host-cert.pub", host["certificate"].as_str().unwrap());
    let mut now_ca = fed_back(&input, &out);
    now_ca["app:ssh-ca/host"]["request"] = json!({"kind": "ca"});
    let after = ca.ok(&now_ca);
    assert_eq!(after["app:ssh-ca/host"]["kind"], "ca");
    assert!(ca.revoked(&after["app:ssh-ca/host"], &cert));
    assert_eq!(
        after["ops:ssh-ca/trust"]["krl"],
        after["app:ssh-ca/host"]["krl"]
    );
}

/// `fort-handler ssh-ca-krl --providers e1,e2 …` with `payload` from `origin`.
fn install(dir: &Path, origin: &str, payload: &Value) -> (bool, String) {
    let mut child = Command::new(fort_tests::bin("fort-handler"))
        .args(["ssh-ca-krl", "--out"])
        .arg(dir.join("revoked.krl"))
        .args(["--providers", "e1,e2", "--ca-keys"])
        .arg(dir.join("ca.pub"))
        .arg("--known-hosts")
        .arg(dir.join("known_hosts"))
        .env_clear()
        .env("FORT_ORIGIN", origin)
        .env("FORT_NEED", "ssh-ca/host")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(payload.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `ssh-keygen -Q -f KRL CERT` says REVOKED.
fn revokes(krl: &Path, cert: &Path) -> bool {
    let out = Command::new("ssh-keygen")
        .args(["-Q", "-f"])
        .arg(krl)
        .arg(cert)
        .output()
        .unwrap();
    assert!(
        matches!(out.status.code(), Some(0 | 1)),
        "ssh-keygen -Q: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.status.code() == Some(1)
}

#[test]
fn the_combined_krl_revokes_what_either_ca_revoked() {
    let test = "ssh_ca_trust::the_combined_krl_revokes_what_either_ca_revoked";
    if !have_ssh_keygen(test) {
        return;
    }
    // Two CAs, each with one certificate released (revoked) and one kept.
    let issue = |ca: &Ca| {
        let input = json!({
            "app:ssh-ca/old": entry(json!({"kind": "host", "public_key": public(&key())})),
            "app:ssh-ca/host": entry(json!({"kind": "host", "public_key": public(&key())})),
        });
        let out = ca.ok(&input);
        let old = ca.file(
            "old-cert.pub",
            out["app:ssh-ca/old"]["certificate"].as_str().unwrap(),
        );
        let live = ca.file(
            "live-cert.pub",
            out["app:ssh-ca/host"]["certificate"].as_str().unwrap(),
        );
        let mut released = fed_back(&input, &out);
        released.as_object_mut().unwrap().remove("app:ssh-ca/old");
        let after = ca.ok(&released);
        (after["app:ssh-ca/host"].clone(), old, live)
    };
    let (e1, e2) = (Ca::new(json!({})), Ca::new(json!({})));
    let (e1_payload, e1_old, e1_live) = issue(&e1);
    let (e2_payload, e2_old, e2_live) = issue(&e2);
    // Same serials at both CAs: a KRL names certificates by CA and serial.
    assert_eq!(
        fort_tests::sshd::cert_serial(&e1_old),
        fort_tests::sshd::cert_serial(&e2_old)
    );

    let dir = tempfile::tempdir().unwrap();
    let krl = dir.path().join("revoked.krl");
    let (ok, err) = install(dir.path(), "e1", &e1_payload);
    assert!(ok, "{err}");
    assert!(revokes(&krl, &e1_old));
    assert!(!revokes(&krl, &e2_old), "e2's part is not there yet");
    let (ok, err) = install(dir.path(), "e2", &e2_payload);
    assert!(ok, "{err}");
    assert!(
        err.contains("holds the KRLs of e1, e2 (2 revoked)"),
        "{err}"
    );
    for (cert, revoked) in [
        (&e1_old, true),
        (&e2_old, true),
        (&e1_live, false),
        (&e2_live, false),
    ] {
        assert_eq!(revokes(&krl, cert), revoked, "{}", cert.display());
    }
    let ca_keys = std::fs::read_to_string(dir.path().join("ca.pub")).unwrap();
    assert_eq!(
        ca_keys,
        format!(
            "{}\n{}\n",
            e1_payload["ca_public_key"].as_str().unwrap(),
            e2_payload["ca_public_key"].as_str().unwrap()
        )
    );
    let known = std::fs::read_to_string(dir.path().join("known_hosts")).unwrap();
    assert_eq!(known.lines().count(), 2, "{known}");
    assert!(known.contains(e2_payload["known_hosts_line"].as_str().unwrap()));
    // Not a listed provider: refused, and nothing it sent is installed.
    let before = std::fs::read(&krl).unwrap();
    let (ok, err) = install(dir.path(), "e3", &e2_payload);
    assert!(
        !ok && err.contains("not one of the providers listed"),
        "{err}"
    );
    assert_eq!(std::fs::read(&krl).unwrap(), before);
}
