//! `fort-handler ssh-ca` refusing what it must (principals outside the allowance,
//! unknown key types, callers that may not ask, hostile values), checking its CA key,
//! changing CA keys, and the consumer's KRL helper (`fort-handler ssh-ca-krl`).

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::process::{Command, Stdio};

use serde_json::{json, Value};
use ssh_key::{Algorithm, LineEnding, PrivateKey};

mod ssh_ca_harness;
use ssh_ca_harness::*;

#[test]
fn refusals_name_the_reason_and_leave_other_entries_answered() {
    let ca = Ca::new(json!({}));
    let dsa = "ssh-dss AAAAB3NzaC1kc3MAAAABBwAAAAEHAAAAAQcAAAABBw== x";
    let k = public(&key());
    let input = json!({
        "app:ssh-ca/ok": entry(json!({"kind": "host", "public_key": k})),
        "app:ssh-ca/other-host": entry(json!({"kind": "host", "public_key": k, "principals": ["web"]})),
        "app:ssh-ca/wildcard": entry(json!({"kind": "host", "public_key": k, "principals": ["*.example.test"]})),
        "web:ssh-ca/user": entry(json!({"kind": "user", "public_key": k, "principals": ["deploy"]})),
        "ops:ssh-ca/host": entry(json!({"kind": "host", "public_key": k})),
        "app:ssh-ca/root": entry(json!({"kind": "user", "public_key": k, "principals": ["root"]})),
        "app:ssh-ca/upper": entry(json!({"kind": "user", "public_key": k, "principals": ["Deploy"]})),
        "app:ssh-ca/newline": entry(json!({"kind": "user", "public_key": k, "principals": ["deploy\nroot"]})),
        "app:ssh-ca/none": entry(json!({"kind": "user", "public_key": k})),
        "app:ssh-ca/dsa": entry(json!({"kind": "host", "public_key": dsa})),
        "app:ssh-ca/garbage": entry(json!({"kind": "host", "public_key": "ssh-ed25519 AAAA\u{1b}[2J"})),
        "app:ssh-ca/field": entry(json!({"kind": "host", "public_key": k, "force_command": "sh"})),
        "app:ssh-ca/short": entry(json!({"kind": "user", "public_key": k, "principals": ["deploy"], "validity_seconds": 5})),
        "app:ssh-ca/many": entry(json!({"kind": "user", "public_key": k, "principals": vec!["deploy"; 40]})),
    });
    let out = ca.ok(&input);
    assert!(out["app:ssh-ca/ok"]["certificate"].is_string());
    let reason = |k: &str| {
        out[k]["$fort_refused"]
            .as_str()
            .unwrap_or_else(|| panic!("{k}: {}", out[k]))
            .to_owned()
    };
    assert!(reason("app:ssh-ca/other-host").contains("principal web is not one app may have"));
    assert!(reason("app:ssh-ca/wildcard").contains("*.example.test"));
    assert!(reason("web:ssh-ca/user").contains("web may not ask for user certificates"));
    assert!(reason("ops:ssh-ca/host").contains("ops may not ask for host certificates"));
    assert!(reason("app:ssh-ca/root").contains("principal root is not one app may have"));
    assert!(reason("app:ssh-ca/upper").contains("lower-case"));
    assert!(!reason("app:ssh-ca/newline").contains('\n'));
    assert!(reason("app:ssh-ca/none").contains("must name its principals"));
    assert!(
        reason("app:ssh-ca/dsa").contains("ssh-dss")
            || reason("app:ssh-ca/dsa").contains("public_key")
    );
    assert!(!reason("app:ssh-ca/garbage").contains('\u{1b}'));
    assert!(reason("app:ssh-ca/field").contains("unknown field"));
    assert!(reason("app:ssh-ca/short").contains("at least 60"));
    assert!(reason("app:ssh-ca/many").contains("more than 32"));
    // Nothing was signed for a refused entry.
    assert_eq!(ca.state()["state"]["next_serial"], 2);

    // An allowance taken away: the entry is refused and its certificate revoked.
    let mut config: Value =
        serde_json::from_slice(&std::fs::read(ca.path("config.json")).unwrap()).unwrap();
    let explicit = json!({"kind": "host", "public_key": k, "principals": ["app.example.test"]});
    let first = ca.ok(&json!({"app:ssh-ca/explicit": entry(explicit.clone())}));
    config["host_principals"] = json!({"*": ["{origin}"]});
    ca.write_config(&config);
    let next = json!({
        "app:ssh-ca/ok": {"request": input["app:ssh-ca/ok"]["request"], "response": out["app:ssh-ca/ok"]},
        "app:ssh-ca/explicit": {"request": explicit, "response": first["app:ssh-ca/explicit"]},
    });
    let later = ca.ok(&next);
    let reason = later["app:ssh-ca/explicit"]["$fort_refused"]
        .as_str()
        .unwrap();
    assert!(
        reason.contains("principal app.example.test is not one app may have"),
        "{reason}"
    );
    // A request that names no principals follows the allowance: issued again for what is
    // left, and the certificate that carried more is revoked.
    assert_eq!(later["app:ssh-ca/ok"]["principals"], json!(["app"]));
    let revoked: Vec<u64> = ca.state()["state"]["revoked"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["serial"].as_u64().unwrap())
        .collect();
    assert!(
        revoked.contains(&out["app:ssh-ca/ok"]["serial"].as_u64().unwrap()),
        "{revoked:?}"
    );
    assert!(
        revoked.contains(&first["app:ssh-ca/explicit"]["serial"].as_u64().unwrap()),
        "{revoked:?}"
    );
}

#[test]
fn the_ca_key_is_checked_and_made_on_request() {
    let test = "ssh_ca::the_ca_key_is_checked_and_made_on_request";
    let ca = Ca::new(json!({}));
    let input =
        json!({"app:ssh-ca/host": entry(json!({"kind": "host", "public_key": public(&key())}))});
    let check = |ca: &Ca| {
        let out = Command::new(fort_tests::bin("fort-handler"))
            .args(["ssh-ca", "--check", "--config"])
            .arg(ca.path("config.json"))
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    assert!(check(&ca).0);
    std::fs::set_permissions(ca.path("ca"), std::fs::Permissions::from_mode(0o644)).unwrap();
    let (ok, _, err) = ca.run(&input);
    assert!(!ok && err.contains("readable by others"), "{err}");
    assert!(!check(&ca).0);
    assert!(
        !ca.path("state/ssh-ca.json").exists(),
        "a failed run records nothing"
    );

    // A key that must be made: ed25519, 0400, and the same key on the next run.
    let mut config: Value =
        serde_json::from_slice(&std::fs::read(ca.path("config.json")).unwrap()).unwrap();
    config["ca_key_file"] = json!(ca.path("made/ca_key"));
    config["generate_ca_key"] = json!(true);
    ca.write_config(&config);
    let out = ca.ok(&input);
    let meta = std::fs::metadata(ca.path("made/ca_key")).unwrap();
    assert_eq!(meta.mode() & 0o777, 0o400);
    let made = PrivateKey::read_openssh_file(&ca.path("made/ca_key")).unwrap();
    assert_eq!(made.algorithm(), Algorithm::Ed25519);
    let again = ca.ok(&fed_back(&input, &out));
    assert_eq!(
        again["app:ssh-ca/host"]["ca_public_key"],
        out["app:ssh-ca/host"]["ca_public_key"]
    );

    // Missing and not to be made: the run fails and says which file.
    config["generate_ca_key"] = json!(false);
    config["ca_key_file"] = json!(ca.path("nowhere"));
    ca.write_config(&config);
    let (ok, _, err) = ca.run(&input);
    assert!(!ok && err.contains("nowhere"), "{err}");

    if !have_ssh_keygen(test) {
        return;
    }
    // Encrypted, or of another type: refused with the reason.
    for (args, expect) in [
        (vec!["-t", "ed25519", "-N", "secret"], "encrypted"),
        (
            vec!["-t", "rsa", "-b", "2048", "-N", ""],
            "ed25519 keys only",
        ),
    ] {
        let p = ca.path("other_ca");
        let _ = std::fs::remove_file(&p);
        let st = Command::new("ssh-keygen")
            .arg("-q")
            .args(&args)
            .arg("-f")
            .arg(&p)
            .status()
            .unwrap();
        assert!(st.success());
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o400)).unwrap();
        config["ca_key_file"] = json!(p);
        ca.write_config(&config);
        let (ok, _, err) = ca.run(&input);
        assert!(!ok && err.contains(expect), "{err}");
    }
}

#[test]
fn the_consumer_helper_installs_only_a_krl() {
    let ca = Ca::new(json!({}));
    let out = ca.ok(
        &json!({"app:ssh-ca/host": entry(json!({"kind": "host", "public_key": public(&key())}))}),
    );
    let payload = out["app:ssh-ca/host"].to_string();
    let target = ca.path("etc/ssh/revoked.krl");
    let helper = |stdin: &str| {
        let mut child = Command::new(fort_tests::bin("fort-handler"))
            .args(["ssh-ca-krl", "--out"])
            .arg(&target)
            .stdin(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(stdin.as_bytes())
            .unwrap();
        let o = child.wait_with_output().unwrap();
        (
            o.status.success(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    let (ok, err) = helper(&payload);
    assert!(ok, "{err}");
    let bytes = std::fs::read(&target).unwrap();
    assert!(bytes.starts_with(b"SSHKRL\n\0"));
    assert_eq!(std::fs::metadata(&target).unwrap().mode() & 0o777, 0o644);
    let ino = std::fs::metadata(&target).unwrap().ino();
    assert!(helper(&payload).0);
    assert_eq!(
        std::fs::metadata(&target).unwrap().ino(),
        ino,
        "unchanged: not rewritten"
    );
    // Not a KRL, not base64, not JSON: refused, and the installed KRL stays.
    for bad in [
        r#"{"krl": "aGVsbG8gd29ybGQ="}"#,
        r#"{"krl": "%%%"}"#,
        "garbage",
        r#"{"certificate": "x"}"#,
    ] {
        let (ok, err) = helper(bad);
        assert!(!ok, "{bad}: {err}");
        assert_eq!(std::fs::read(&target).unwrap(), bytes);
    }
}

#[test]
fn a_new_ca_key_issues_every_certificate_again() {
    let ca = Ca::new(json!({}));
    let input =
        json!({"app:ssh-ca/host": entry(json!({"kind": "host", "public_key": public(&key())}))});
    let first = ca.ok(&input);
    std::fs::set_permissions(ca.path("ca"), std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::write(
        ca.path("ca"),
        key().to_openssh(LineEnding::LF).unwrap().as_bytes(),
    )
    .unwrap();
    let second = ca.ok(&fed_back(&input, &first));
    let (a, b) = (&first["app:ssh-ca/host"], &second["app:ssh-ca/host"]);
    assert_ne!(a["ca_public_key"], b["ca_public_key"]);
    assert_ne!(a["serial"], b["serial"]);
    let cert = ssh_key::Certificate::from_openssh(b["certificate"].as_str().unwrap()).unwrap();
    let new_ca = ssh_key::PublicKey::from_openssh(b["ca_public_key"].as_str().unwrap()).unwrap();
    cert.validate([&new_ca.fingerprint(Default::default())])
        .unwrap();
    // Kept from then on.
    let third = ca.ok(&fed_back(&input, &second));
    assert_eq!(third["app:ssh-ca/host"]["serial"], b["serial"]);
}
