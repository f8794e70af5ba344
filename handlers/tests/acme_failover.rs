//! `acme` with two providers, each its own ACME account at one pebble, between real
//! agents on loopback: the consumer's certificate (for a key its agent made) comes from
//! its home, renewed there while the standby hears nothing; the home killed with
//! `kill -9` while the certificate comes due, the standby's account orders the renewal
//! and the consumer installs it; the old home back releases the entry it no longer
//! serves and revokes only the certificate it issued, never the standby's. Certificates
//! live a minute (pebble's knob) and are renewed 40 s before they end, within the
//! handler's default weekly budgets.

use std::path::Path;
use std::time::{Duration, Instant};

use fort_tests::dns::{DnsServer, Flavor};
use fort_tests::pebble::{Pebble, Webroot};
use fort_tests::{eventually, Fleet};
use serde_json::{json, Value};

const NEED: &str = "ssl-cert/web";
const NAG: u64 = 2;
const FAILOVER_AFTER: u64 = 4;
const LIFETIME: u64 = 60;
const RENEW_BEFORE: u64 = 40;

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// The leaf of a PEM file: (serial in hex, not before, not after).
fn leaf(pem: &str) -> Option<(String, i64, i64)> {
    let (_, pem) = x509_parser::pem::parse_x509_pem(pem.as_bytes()).ok()?;
    let cert = pem.parse_x509().ok()?;
    let v = cert.validity();
    Some((
        hex::encode(cert.raw_serial()),
        v.not_before.timestamp(),
        v.not_after.timestamp(),
    ))
}

/// Whether the certificate in `cert_pem` is for the private key in `key_pem`.
fn pair_matches(key_pem: &str, cert_pem: &str) -> bool {
    let Ok(key) = rcgen::KeyPair::from_pem(key_pem) else {
        return false;
    };
    let Ok((_, pem)) = x509_parser::pem::parse_x509_pem(cert_pem.as_bytes()) else {
        return false;
    };
    pem.parse_x509().is_ok_and(|cert| {
        cert.public_key().subject_public_key.data.as_ref() == key.public_key_raw()
    })
}

/// A provider's acme state (`{"version", "state"}`).
fn acme_state(f: &Fleet, host: &str) -> Value {
    serde_json::from_slice(
        &std::fs::read(f.host_dir(host).join("handlers/acme.json")).unwrap_or_default(),
    )
    .unwrap_or(Value::Null)
}

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_standbys_account_renews_the_certificate_and_the_old_home_revokes_only_its_own() {
    const T: &str =
        "acme_failover::the_standbys_account_renews_the_certificate_and_the_old_home_revokes_only_its_own";
    let dns = match DnsServer::start(Flavor::Knot, "example.test", "app IN A 127.0.0.1\n") {
        Ok(d) => d,
        Err(why) => return fort_tests::skip(T, &why),
    };
    let pebble = match Pebble::start(dns.addr, Some(LIFETIME)) {
        Ok(p) => p,
        Err(why) => return fort_tests::skip(T, &why),
    };
    let web = match Webroot::start(pebble.http_port) {
        Ok(w) => w,
        Err(why) => return fort_tests::skip(T, &why),
    };
    let mut f = Fleet::new();
    for host in ["e1", "e2"] {
        pebble.serve_ssl_cert(&mut f, host, &web);
        // Renewals as often as the consumer asks; GC sweeps only when the test asks.
        f.host(host).extra_toml =
            "renew_interval = \"1s\"\n[gc]\ninterval = \"0s\"\ngrace = \"1s\"\ntimeout = \"3s\"\n"
                .into();
    }
    let delivered = f.dir.path().join("delivered");
    let (key_path, cert_path) = (delivered.join("key.pem"), delivered.join("cert.pem"));
    f.need_from(
        "app",
        NEED,
        &["e1", "e2"],
        json!({"request": {"csr": {"$fort_key": "tls", "as": "csr"}},
               "nag_seconds": NAG, "failover_after_seconds": FAILOVER_AFTER,
               "renew_before_seconds": RENEW_BEFORE,
               "keys": {"tls": {"type": "ecdsa-p256", "path": key_path, "mode": "0600",
                                "names": ["app.example.test"]}},
               "files": [{"path": cert_path, "pointer": "/fullchain", "mode": "0644"}]}),
    );
    f.host("app").extra_toml = "[fulfill]\nbackoff = \"1s\"\ntimeout = \"3s\"\n".into();
    f.start();

    let status = |f: &Fleet| f.need_status("app", NEED);
    assert!(
        eventually(Duration::from_secs(90), || status(&f)["state"]
            == "satisfied"
            && leaf(&read(&cert_path)).is_some())
        .await,
        "no certificate from the home: {}",
        status(&f)
    );
    assert_eq!(status(&f)["from"], "e1");
    // One renewal by the healthy home (a new key, a new certificate), and the standby
    // hears nothing of it.
    let (first, _, _) = leaf(&read(&cert_path)).unwrap();
    assert!(
        eventually(Duration::from_secs(90), || leaf(&read(&cert_path))
            .is_some_and(|(s, _, _)| s != first))
        .await,
        "never renewed by the home: {}",
        status(&f)
    );
    let cert1 = read(&cert_path);
    let (serial1, _, not_after1) = leaf(&cert1).unwrap();
    assert!(pair_matches(&read(&key_path), &cert1));
    assert!(
        f.entries("e2").is_empty(),
        "the standby heard nothing while the home answered"
    );
    assert_eq!(status(&f)["from"], "e1");

    // The home dies; the certificate comes due 20 s after it was issued.
    let due = not_after1 - RENEW_BEFORE as i64;
    f.kill("e1");
    let (killed, killed_at) = (Instant::now(), now());
    let renewed = eventually(Duration::from_secs(120), || {
        leaf(&read(&cert_path)).is_some_and(|(s, _, _)| s != serial1)
            && status(&f)["state"] == "satisfied"
    })
    .await;
    assert!(renewed, "never renewed by the standby: {}", status(&f));
    let start = due.max(killed_at);
    let waited = now() - start;
    let st = status(&f);
    assert_eq!(st["from"], "e2", "{st}");
    assert_eq!(st["moves"], 1, "{st}");
    let moved = st["home_since"].as_i64().unwrap_or(i64::MAX) - start;
    eprintln!(
        "the need moved {moved} s and the standby's certificate was installed {waited} s \
         after the renewal came due ({:?} after the kill; failover after {FAILOVER_AFTER} s, \
         nag {NAG} s)",
        killed.elapsed()
    );
    // Moved, as the consumer recorded it, within failover_after and a nag interval of
    // coming due (two seconds of slack: whole-second clocks); the rest is the standby's
    // order at pebble (validation through nginx, finalization).
    assert!(
        moved <= (FAILOVER_AFTER + NAG + 2) as i64,
        "moved {moved} s after coming due: {st}"
    );
    assert!(waited <= (FAILOVER_AFTER + NAG + 20) as i64, "{waited} s");
    let cert2 = read(&cert_path);
    let (serial2, _, _) = leaf(&cert2).unwrap();
    assert!(
        pair_matches(&read(&key_path), &cert2),
        "for the consumer's key"
    );

    // Issued by the standby's own account: e2 holds the certificate, and its account is
    // not e1's.
    let (s1, s2) = (acme_state(&f, "e1"), acme_state(&f, "e2"));
    let (a1, a2) = (&s1["state"]["account"], &s2["state"]["account"]);
    assert!(a1.is_object() && a2.is_object(), "{a1} {a2}");
    assert_ne!(a1["credentials"], a2["credentials"], "each its own account");
    let held = s2["state"]["entries"][format!("app:{NEED}")]["issued"]["certificate"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(cert2.starts_with(&held) && !held.is_empty(), "e2 issued it");
    assert_eq!(pebble.cert_status(&serial1), "Valid");
    assert_eq!(pebble.cert_status(&serial2), "Valid");

    // The old home comes back: its GC releases the need e2 serves, its handler revokes
    // the certificate it issued (revoke_on_release), and nothing of e2's.
    f.start_host("e1");
    let has_entry = |f: &Fleet, h: &str| f.entries(h).iter().any(|e| e == &format!("app:{NEED}"));
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
        eventually(Duration::from_secs(60), || pebble.cert_status(&serial1)
            == "Revoked")
        .await,
        "e1 did not revoke the certificate it had issued"
    );
    assert_eq!(
        pebble.cert_status(&serial2),
        "Valid",
        "the standby's is untouched"
    );
    let forgotten = acme_state(&f, "e1")["state"]["entries"]
        .get(format!("app:{NEED}"))
        .is_none();
    assert!(forgotten, "e1 forgot the entry");
    assert!(has_entry(&f, "e2"));
    let st = status(&f);
    assert_eq!(st["from"], "e2", "{st}");
    assert_eq!(st["moves"], 1, "{st}");
    assert!(
        read(&cert_path) == cert2
            || leaf(&read(&cert_path))
                .is_some_and(|(s, _, _)| s != serial1 && pebble.cert_status(&s) == "Valid"),
        "the consumer holds the standby's certificate or its renewal"
    );
}
