//! `fort-handler ssh-ca` run as the agent runs it (entries on stdin, answers on stdout),
//! with OpenSSH's own `ssh-keygen` reading what it writes: certificates (`-L`), KRLs
//! (`-Q`), certificates signed by hand with the same CA left alone; unchanged entries,
//! renewals, changed requests and releases.

use std::os::unix::fs::MetadataExt;
use std::process::Command;

use serde_json::{json, Value};

mod ssh_ca_harness;
use ssh_ca_harness::*;

#[test]
fn host_and_user_certificates_read_by_ssh_keygen() {
    let test = "ssh_ca::host_and_user_certificates_read_by_ssh_keygen";
    let ca = Ca::new(json!({}));
    let host = key();
    let user = key();
    let input = json!({
        "app:ssh-ca/host": entry(json!({"kind": "host", "public_key": public(&host)})),
        "app:ssh-ca/deploy": entry(json!({"kind": "user", "public_key": public(&user),
                                          "principals": ["deploy", "app-svc"], "validity_seconds": 3600})),
    });
    let out = ca.ok(&input);
    let h = &out["app:ssh-ca/host"];
    let u = &out["app:ssh-ca/deploy"];
    assert_eq!(h["kind"], "host");
    assert_eq!(h["principals"], json!(["app", "app.example.test"]));
    assert_eq!(u["principals"], json!(["app-svc", "deploy"]));
    let ca_line = h["ca_public_key"].as_str().unwrap();
    assert!(ca_line.starts_with("ssh-ed25519 ") && ca_line.ends_with(" fort-ssh-ca@forge"));
    assert_eq!(
        h["known_hosts_line"],
        format!("@cert-authority * {ca_line}")
    );
    let serials = [h["serial"].as_u64().unwrap(), u["serial"].as_u64().unwrap()];
    assert_eq!(
        {
            let mut s = serials;
            s.sort();
            s
        },
        [1, 2]
    );
    let span = u["valid_before"].as_u64().unwrap() - u["valid_after"].as_u64().unwrap();
    assert_eq!(span, 3600 + 300, "asked validity plus the backdate");
    assert_eq!(h["expires_at"], h["valid_before"]);
    // The certificate is for the key asked for, signed by the CA the response names.
    let cert = ssh_key::Certificate::from_openssh(h["certificate"].as_str().unwrap()).unwrap();
    assert_eq!(cert.public_key(), host.public_key().key_data());
    let ca_key = ssh_key::PublicKey::from_openssh(ca_line).unwrap();
    cert.validate([&ca_key.fingerprint(Default::default())])
        .unwrap();
    assert_eq!(cert.key_id(), "app:ssh-ca/host");
    if !have_ssh_keygen(test) {
        return;
    }
    let listed = keygen_list(&ca.file("host-cert.pub", h["certificate"].as_str().unwrap()));
    assert!(listed.contains("host certificate"), "{listed}");
    assert!(listed.contains("Key ID: \"app:ssh-ca/host\""), "{listed}");
    assert!(listed.contains("app.example.test"), "{listed}");
    let listed = keygen_list(&ca.file("user-cert.pub", u["certificate"].as_str().unwrap()));
    assert!(listed.contains("user certificate"), "{listed}");
    assert!(listed.contains("permit-pty"), "{listed}");
    assert!(
        listed.contains(&format!("Serial: {}", u["serial"])),
        "{listed}"
    );
    // Nothing revoked yet: the KRL is empty and revokes neither.
    assert!(!ca.revoked(h, &ca.path("host-cert.pub")));
}

#[test]
fn unchanged_entries_keep_their_response_without_signing_or_writing() {
    let ca = Ca::new(json!({}));
    let input = json!({
        "app:ssh-ca/host": entry(json!({"kind": "host", "public_key": public(&key())})),
        "web:ssh-ca/host": entry(json!({"kind": "host", "public_key": public(&key()),
                                        "principals": ["web.example.test"]})),
    });
    let out = ca.ok(&input);
    let state_before = std::fs::metadata(ca.path("state/ssh-ca.json")).unwrap();
    assert_eq!(state_before.mode() & 0o777, 0o600);
    let next = fed_back(&input, &out);
    let again = ca.ok(&next);
    let strip = |v: &Value| {
        let mut v = v.clone();
        v.as_object_mut().unwrap().remove("$fort_rerun_after");
        v
    };
    assert_eq!(strip(&again), strip(&out), "same responses");
    let state_after = std::fs::metadata(ca.path("state/ssh-ca.json")).unwrap();
    assert_eq!(
        state_after.ino(),
        state_before.ino(),
        "the state was not replaced"
    );
    assert_eq!(ca.state()["state"]["next_serial"], 3);
    // It asks to be run again before the first certificate is due (clamped to an hour).
    assert!(again["$fort_rerun_after"]
        .as_u64()
        .is_some_and(|s| (1..=3600).contains(&s)));
    // A comment on the key is not a new request.
    let mut commented = next.clone();
    let line = commented["app:ssh-ca/host"]["request"]["public_key"]
        .as_str()
        .unwrap()
        .to_owned();
    commented["app:ssh-ca/host"]["request"]["public_key"] = json!(format!("{line} root@app"));
    assert_eq!(
        ca.ok(&commented)["app:ssh-ca/host"]["serial"],
        out["app:ssh-ca/host"]["serial"]
    );
}

#[test]
fn renewal_keeps_the_old_certificate_a_changed_request_revokes_it() {
    let test = "ssh_ca::renewal_keeps_the_old_certificate_a_changed_request_revokes_it";
    if !have_ssh_keygen(test) {
        return;
    }
    let ca = Ca::new(json!({}));
    let k = public(&key());
    let input = json!({"app:ssh-ca/deploy": entry(json!({"kind": "user", "public_key": k,
                                                          "principals": ["deploy", "app-svc"]}))});
    let first = ca.ok(&input);
    let first_cert = ca.file(
        "first-cert.pub",
        first["app:ssh-ca/deploy"]["certificate"].as_str().unwrap(),
    );
    let mut renew = fed_back(&input, &first);
    renew["app:ssh-ca/deploy"]["renew"] = json!(true);
    let second = ca.ok(&renew);
    let r = &second["app:ssh-ca/deploy"];
    assert_eq!(r["serial"], 2);
    assert!(
        !ca.revoked(r, &first_cert),
        "a renewal does not revoke what it replaces"
    );
    // Fewer principals: the certificate that carried more must not stay usable.
    let mut fewer = fed_back(&input, &second);
    fewer["app:ssh-ca/deploy"]["request"]["principals"] = json!(["deploy"]);
    let third = ca.ok(&fewer);
    let r = &third["app:ssh-ca/deploy"];
    assert_eq!(r["serial"], 3);
    assert_eq!(r["principals"], json!(["deploy"]));
    let second_cert = ca.file(
        "second-cert.pub",
        second["app:ssh-ca/deploy"]["certificate"].as_str().unwrap(),
    );
    let third_cert = ca.file("third-cert.pub", r["certificate"].as_str().unwrap());
    assert!(ca.revoked(r, &first_cert));
    assert!(ca.revoked(r, &second_cert));
    assert!(!ca.revoked(r, &third_cert));
}

#[test]
fn release_revokes_into_the_krl_and_leaves_hand_made_certificates_alone() {
    let test = "ssh_ca::release_revokes_into_the_krl_and_leaves_hand_made_certificates_alone";
    if !have_ssh_keygen(test) {
        return;
    }
    let ca = Ca::new(json!({"first_serial": 100}));
    let input = json!({
        "app:ssh-ca/host": entry(json!({"kind": "host", "public_key": public(&key())})),
        "app:ssh-ca/deploy": entry(json!({"kind": "user", "public_key": public(&key()),
                                          "principals": ["deploy"]})),
        "ops:ssh-ca/me": entry(json!({"kind": "user", "public_key": public(&key()),
                                      "principals": ["ops"]})),
    });
    let out = ca.ok(&input);
    let deploy_cert = ca.file(
        "deploy-cert.pub",
        out["app:ssh-ca/deploy"]["certificate"].as_str().unwrap(),
    );
    let host_cert = ca.file(
        "host-cert.pub",
        out["app:ssh-ca/host"]["certificate"].as_str().unwrap(),
    );
    // Certificates an operator signed by hand with the same CA: the default serial 0, and
    // one outside what fort issued.
    let hand = key();
    std::fs::write(ca.path("hand.pub"), public(&hand)).unwrap();
    let mut hand_certs = Vec::new();
    for (i, serial) in ["0", "7"].iter().enumerate() {
        let copy = ca.path(&format!("hand{i}.pub"));
        std::fs::copy(ca.path("hand.pub"), &copy).unwrap();
        let st = Command::new("ssh-keygen")
            .args(["-q", "-s"])
            .arg(ca.path("ca"))
            .args(["-I", "by-hand", "-n", "deploy", "-z", serial])
            .arg(&copy)
            .status()
            .unwrap();
        assert!(st.success());
        hand_certs.push(ca.path(&format!("hand{i}-cert.pub")));
    }
    let krl_version = |r: &Value| {
        use base64::Engine;
        let b = base64::engine::general_purpose::STANDARD
            .decode(r["krl"].as_str().unwrap())
            .unwrap();
        u64::from_be_bytes(b[12..20].try_into().unwrap())
    };
    let v0 = krl_version(&out["app:ssh-ca/host"]);

    let mut released = fed_back(&input, &out);
    released
        .as_object_mut()
        .unwrap()
        .remove("app:ssh-ca/deploy");
    let after = ca.ok(&released);
    assert!(after.get("app:ssh-ca/deploy").is_none());
    let h = &after["app:ssh-ca/host"];
    assert_eq!(
        h["serial"], out["app:ssh-ca/host"]["serial"],
        "the host keeps its certificate"
    );
    assert_eq!(h["certificate"], out["app:ssh-ca/host"]["certificate"]);
    assert_ne!(
        h["krl"], out["app:ssh-ca/host"]["krl"],
        "and gets the new KRL"
    );
    assert_eq!(krl_version(h), v0 + 1);
    assert!(ca.revoked(h, &deploy_cert));
    assert!(!ca.revoked(h, &host_cert));
    for c in &hand_certs {
        assert!(!ca.revoked(h, c), "{} was made by hand", c.display());
    }
    assert_eq!(
        after["ops:ssh-ca/me"]["krl"], h["krl"],
        "every response carries the same KRL"
    );
    // `ssh-keygen -Ql` lists it.
    let listed = Command::new("ssh-keygen")
        .args(["-Q", "-l", "-f"])
        .arg(ca.krl_file(h))
        .output()
        .unwrap();
    let listed = String::from_utf8_lossy(&listed.stdout);
    assert!(
        listed.contains(&format!("serial: {}", out["app:ssh-ca/deploy"]["serial"])),
        "{listed}"
    );
    // The next unchanged run changes nothing (the KRL stays at its version).
    let again = ca.ok(&fed_back(&released, &after));
    assert_eq!(again["app:ssh-ca/host"], after["app:ssh-ca/host"]);
}

#[test]
fn krl_ranges_and_lists_read_back_with_ssh_keygen() {
    let test = "ssh_ca::krl_ranges_and_lists_read_back_with_ssh_keygen";
    if !have_ssh_keygen(test) {
        return;
    }
    // Twelve new certificates for one caller at once: more than its hour allows by default.
    let ca = Ca::new(json!({"max_new_certificates_per_caller_per_hour": 12}));
    let mut input = serde_json::Map::new();
    for i in 0..12 {
        input.insert(
            format!("app:ssh-ca/u{i:02}"),
            entry(json!({"kind": "user", "public_key": public(&key()), "principals": ["deploy"]})),
        );
    }
    let input = Value::Object(input);
    let out = ca.ok(&input);
    let serial = |k: &str| out[k]["serial"].as_u64().unwrap();
    // Release a run of seven (one range) and two apart (a list).
    let release: Vec<String> = out
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| !k.starts_with('$'))
        .filter(|k| matches!(serial(k), 2..=8 | 10 | 12))
        .cloned()
        .collect();
    assert_eq!(release.len(), 9);
    let mut next = fed_back(&input, &out);
    for k in &release {
        next.as_object_mut().unwrap().remove(k);
    }
    let after = ca.ok(&next);
    let krl_holder = after
        .as_object()
        .unwrap()
        .values()
        .find(|v| v.get("krl").is_some())
        .unwrap()
        .clone();
    for (k, v) in out
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| !k.starts_with('$'))
    {
        let cert = ca.file("c-cert.pub", v["certificate"].as_str().unwrap());
        assert_eq!(
            ca.revoked(&krl_holder, &cert),
            release.contains(k),
            "{k} serial {}",
            serial(k)
        );
    }
}
