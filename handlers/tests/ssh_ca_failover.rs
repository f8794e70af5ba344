//! `ssh-ca` with two providers, each its own CA, between real agents on loopback and a
//! real `sshd`: the host's certificate comes from its home, the host trusts both CAs
//! (`{"kind": "ca"}` needs at each: sshd lets in a user certificate of either CA) and
//! installs one KRL of both; the home killed with
//! `kill -9` while the certificate comes due, the standby certifies the host within
//! `failover_after` and a nag interval, and a client trusting both CAs accepts either
//! certificate; the old home back releases the moved need, and the certificate it had
//! issued is refused through the combined KRL while the standby's is not.

use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fort_tests::sshd::{can_run, key_pair, krl_revokes, ssh, Sshd, SshdFiles};
use fort_tests::{bin, eventually, free_addr, Fleet};
use serde_json::{json, Value};

const NAG: u64 = 2;
const FAILOVER_AFTER: u64 = 4;
/// Certificates live 300 s and are renewed 280 s before they end: 20 s after issuance.
const VALIDITY: u64 = 300;
const RENEW_BEFORE: u64 = 280;

/// `host` serves `ssh-ca` with a CA key of its own, made on its first run.
fn provider(f: &mut Fleet, host: &str, schema: &Value) {
    let dir = f.dir.path().join(format!("{host}-ca"));
    let config = f.dir.path().join(format!("{host}-ssh-ca.json"));
    std::fs::write(
        &config,
        json!({
            "ca_key_file": dir.join("ca_key"),
            "generate_ca_key": true,
            "state_file": dir.join("state.json"),
            "hosts_file": f.host_dir(host).join("hosts.json"),
            "host_principals": {"*": ["{origin}", "{origin}.example.test"]},
        })
        .to_string(),
    )
    .unwrap();
    f.capability(
        host,
        "ssh-ca",
        json!({"handler": bin("fort-handler"), "args": ["ssh-ca", "--config", config],
               "mode": "async", "cacheResponse": true, "request_schema": schema}),
    );
    // Renewals as often as the consumer asks; GC sweeps only when the test asks.
    f.host(host).extra_toml =
        "renew_interval = \"1s\"\n[gc]\ninterval = \"0s\"\ngrace = \"1s\"\ntimeout = \"3s\"\n"
            .into();
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// The CA key line a certificate file is signed by.
fn signer(cert: &Path) -> Option<String> {
    let text = std::fs::read_to_string(cert).ok()?;
    let cert = ssh_key::Certificate::from_openssh(text.trim()).ok()?;
    ssh_key::PublicKey::new(cert.signature_key().clone(), "")
        .to_openssh()
        .ok()
}

/// A provider's CA key line as the host keeps it (its part of what is trusted).
fn ca_of(krl: &Path, provider: &str) -> Option<String> {
    let part = fort_handlers::ssh_ca::trust::parts_dir(krl).join(format!("{provider}.json"));
    let v: Value = serde_json::from_slice(&std::fs::read(part).ok()?).ok()?;
    let line = v["ca_public_key"].as_str()?;
    let key = ssh_key::PublicKey::from_openssh(line).ok()?;
    ssh_key::PublicKey::new(key.key_data().clone(), "")
        .to_openssh()
        .ok()
}

fn valid_before(cert: &Path) -> u64 {
    let text = std::fs::read_to_string(cert).unwrap();
    ssh_key::Certificate::from_openssh(text.trim())
        .unwrap()
        .valid_before()
}

/// A user certificate for `root`, signed by hand with the CA key `ca_key` (as an
/// operator might with `ssh-keygen -s`), beside the key `key` as `<key>-cert.pub`. Its
/// serial is far above any fort gives here, so no KRL of the test names it.
fn user_cert(ca_key: &Path, key: &Path, serial: u64) {
    use ssh_key::certificate::{Builder, CertType};
    let ca = ssh_key::PrivateKey::read_openssh_file(ca_key).unwrap();
    let subject = ssh_key::PrivateKey::read_openssh_file(key).unwrap();
    let mut b = Builder::new_with_random_nonce(
        &mut ssh_key::rand_core::OsRng,
        subject.public_key().key_data().clone(),
        now() - 60,
        now() + 3600,
    )
    .unwrap();
    b.serial(serial)
        .unwrap()
        .key_id("by-hand")
        .unwrap()
        .cert_type(CertType::User)
        .unwrap()
        .valid_principal("root")
        .unwrap();
    let cert = b.sign(&ca).unwrap().to_openssh().unwrap();
    let mut name = key.as_os_str().to_owned();
    name.push("-cert.pub");
    std::fs::write(name, cert).unwrap();
}

/// The client trusts the host's certificate (before any authentication).
fn trusted(stderr: &str) -> bool {
    stderr.contains("is known and matches the ED25519-CERT host certificate")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_standby_ca_certifies_the_host_and_the_old_homes_revocation_reaches_it() {
    let test = "ssh_ca_failover::the_standby_ca_certifies_the_host_and_the_old_homes_revocation_reaches_it";
    if !can_run(test) {
        return;
    }
    let schemas: Value = serde_json::from_slice(
        &std::fs::read(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../nixos-module/tests/expected/schemas.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let schema = schemas["schemas"]["ssh-ca"].clone();
    let mut f = Fleet::new();
    let root = f.dir.path().to_path_buf();
    let etc = root.join("app-etc-ssh");
    std::fs::create_dir_all(&etc).unwrap();
    let host_public = key_pair(&etc.join("ssh_host_ed25519_key"));
    provider(&mut f, "e1", &schema);
    provider(&mut f, "e2", &schema);

    // The host: its certificate from [e1, e2]; what to trust from each; all installed by
    // one consumer handler, as the NixOS module declares them.
    let files = SshdFiles {
        host_key: etc.join("ssh_host_ed25519_key"),
        host_certificate: etc.join("ssh_host_ed25519_key-cert.pub"),
        trusted_user_ca_keys: etc.join("fort_user_ca.pub"),
        revoked_keys: etc.join("fort_revoked_keys.krl"),
    };
    let known_hosts = etc.join("ssh_known_hosts_fort");
    let trust = f.script(
        "install-trust",
        &format!(
            "exec {} ssh-ca-krl --out {} --providers e1,e2 --ca-keys {} --known-hosts {}",
            bin("fort-handler").display(),
            files.revoked_keys.display(),
            files.trusted_user_ca_keys.display(),
            known_hosts.display()
        ),
    );
    let timing = json!({"nag_seconds": NAG, "failover_after_seconds": FAILOVER_AFTER});
    let mut host_need = json!({
        "request": {"kind": "host", "public_key": host_public, "principals": null,
                    "validity_seconds": VALIDITY},
        "renew_before_seconds": RENEW_BEFORE,
        "files": [{"name": "certificate", "path": files.host_certificate,
                   "pointer": "/certificate", "mode": "0644"}],
        "handler": trust,
    });
    for (k, v) in timing.as_object().unwrap() {
        host_need[k] = v.clone();
    }
    f.need_from("app", "ssh-ca/host", &["e1", "e2"], host_need);
    for p in ["e1", "e2"] {
        f.need(
            "app",
            &format!("ssh-ca/host-ca-{p}"),
            p,
            json!({"request": {"kind": "ca", "public_key": null, "principals": null,
                               "validity_seconds": null},
                   "nag_seconds": NAG, "handler": trust}),
        );
    }
    f.host("app").extra_toml = "[fulfill]\nbackoff = \"1s\"\ntimeout = \"3s\"\n".into();
    f.start();

    let cert = files.host_certificate.clone();
    let krl = files.revoked_keys.clone();
    assert!(
        eventually(Duration::from_secs(60), || f.all_satisfied("app")
            && ca_of(&krl, "e1").is_some()
            && ca_of(&krl, "e2").is_some())
        .await,
        "{}",
        f.status("app")
    );
    let (ca1, ca2) = (ca_of(&krl, "e1").unwrap(), ca_of(&krl, "e2").unwrap());
    assert_ne!(ca1, ca2, "each provider its own CA");
    assert_eq!(
        signer(&cert).as_deref(),
        Some(ca1.as_str()),
        "e1 is the home"
    );
    assert_eq!(f.need_status("app", "ssh-ca/host")["from"], "e1");
    // The standby heard only the request for what to trust: it certified nothing.
    assert_eq!(f.entries("e2"), ["app:ssh-ca/host-ca-e2"]);
    let trusted_cas = std::fs::read_to_string(&files.trusted_user_ca_keys).unwrap();
    assert_eq!(trusted_cas.lines().count(), 2, "{trusted_cas}");
    let known = std::fs::read_to_string(&known_hosts).unwrap();
    assert_eq!(known.lines().count(), 2, "{known}");
    assert!(known.lines().all(|l| l.starts_with("@cert-authority * ")));
    let revoked_opt = format!("RevokedHostKeys={}", krl.display());
    let client_key = root.join("client_ed25519");
    key_pair(&client_key);
    // A user of each CA: sshd trusts both through the combined TrustedUserCAKeys.
    let users: Vec<_> = ["e1", "e2"]
        .iter()
        .zip([9001, 9002])
        .map(|(p, serial)| {
            let key = root.join(format!("user-of-{p}"));
            key_pair(&key);
            user_cert(&root.join(format!("{p}-ca/ca_key")), &key, serial);
            key
        })
        .collect();

    // A client that trusts both CAs accepts the host's certificate from e1.
    let kept = root.join("kept");
    std::fs::create_dir_all(&kept).unwrap();
    let e1_cert = kept.join("e1-cert.pub");
    std::fs::copy(&cert, &e1_cert).unwrap();
    {
        let sshd = Sshd::start(&etc, free_addr("127.0.0.1"), &files);
        let (_, _, stderr) = ssh(&sshd, &known_hosts, &client_key, &[&revoked_opt]);
        assert!(trusted(&stderr), "{stderr}\nsshd:\n{}", sshd.log_text());
        for user in &users {
            let (ok, stdout, stderr) = ssh(&sshd, &known_hosts, user, &[&revoked_opt]);
            assert!(
                ok && stdout.trim() == "fort-ok",
                "{}: {stderr}\nsshd:\n{}",
                user.display(),
                sshd.log_text()
            );
        }
    }

    // The home dies; the certificate comes due 20 s after it was issued.
    let due = valid_before(&e1_cert) - RENEW_BEFORE;
    f.kill("e1");
    let killed = Instant::now();
    let killed_at = now();
    assert!(
        eventually(Duration::from_secs(90), || signer(&cert).as_deref()
            == Some(ca2.as_str()))
        .await,
        "never certified by e2: {}",
        f.need_status("app", "ssh-ca/host")
    );
    let served_at = now();
    let st = f.need_status("app", "ssh-ca/host");
    assert_eq!(st["from"], "e2", "{st}");
    assert_eq!(st["moves"], 1, "{st}");
    let start = due.max(killed_at);
    let moved = st["home_since"]
        .as_u64()
        .unwrap_or(u64::MAX)
        .saturating_sub(start);
    let served = served_at.saturating_sub(start);
    eprintln!(
        "the need moved {moved} s and e2's certificate was installed {served} s after the \
         renewal came due ({:?} after the kill; failover after {FAILOVER_AFTER} s, nag {NAG} s)",
        killed.elapsed()
    );
    // The move, as the consumer recorded it: at the first failed request once the home
    // has failed for failover_after, and failed requests back off to at most the nag
    // interval. Two seconds of slack: the clocks are read in whole seconds.
    assert!(
        moved <= FAILOVER_AFTER + NAG + 2,
        "moved {moved} s after coming due: {st}"
    );
    assert!(
        served <= FAILOVER_AFTER + NAG + 10,
        "served after {served} s"
    );

    // The same client accepts the standby's certificate.
    let e2_cert = kept.join("e2-cert.pub");
    std::fs::copy(&cert, &e2_cert).unwrap();
    {
        let sshd = Sshd::start(&etc, free_addr("127.0.0.1"), &files);
        let (_, _, stderr) = ssh(&sshd, &known_hosts, &client_key, &[&revoked_opt]);
        assert!(trusted(&stderr), "{stderr}\nsshd:\n{}", sshd.log_text());
    }
    assert!(
        !krl_revokes(&krl, &e1_cert),
        "e1 could not revoke while down"
    );

    // The old home comes back; its GC releases the need e2 serves, which revokes the
    // certificate e1 issued; the revocation reaches the host through host-ca-e1.
    f.start_host("e1");
    let has_entry = |f: &Fleet, h: &str| f.entries(h).iter().any(|e| e == "app:ssh-ca/host");
    assert!(
        eventually(Duration::from_secs(60), || {
            let _ = f.admin("e1", &["gc"]);
            !has_entry(&f, "e1")
        })
        .await,
        "e1 kept its entry: {:?}",
        f.entries("e1")
    );
    assert!(
        eventually(Duration::from_secs(60), || krl_revokes(&krl, &e1_cert)).await,
        "e1's revocation never reached the combined KRL: {}",
        f.status("app")
    );
    assert!(
        !krl_revokes(&krl, &e2_cert),
        "nothing revokes e2's certificate"
    );
    assert!(has_entry(&f, "e2"));
    assert_eq!(f.need_status("app", "ssh-ca/host")["from"], "e2");

    // A host still presenting e1's certificate is refused through the combined KRL;
    // the standby's is accepted.
    let old = SshdFiles {
        host_certificate: e1_cert.clone(),
        ..files.clone()
    };
    {
        let sshd = Sshd::start(&etc, free_addr("127.0.0.1"), &old);
        let (ok, _, stderr) = ssh(&sshd, &known_hosts, &client_key, &[&revoked_opt]);
        assert!(!ok && !trusted(&stderr), "{stderr}");
        assert!(stderr.to_lowercase().contains("revoked"), "{stderr}");
    }
    {
        let sshd = Sshd::start(&etc, free_addr("127.0.0.1"), &files);
        let (_, _, stderr) = ssh(&sshd, &known_hosts, &client_key, &[&revoked_opt]);
        assert!(trusted(&stderr), "{stderr}\nsshd:\n{}", sshd.log_text());
    }
}
