//! Keys made on the consumer's host (docs/protocol.md §11.10) against a hostile or broken
//! provider, with real agents: whatever the provider sends, the host keeps a private key
//! and a certificate that belong together. A fullchain for another key, a certificate
//! that does not parse, one that expired or is not valid yet: refused with the reason in
//! the need's state, the working pair left in place. The expiry comes from the
//! certificate itself. And a service reading key and certificate while they rotate never
//! reads a key with another key's certificate.

use std::collections::BTreeSet;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fort_tests::pki::{pair_matches, stranger_public_pem, Ca};
use fort_tests::{eventually, Fleet};
use serde_json::{json, Value};

const ENTRY: &str = "c:ssl-cert/web";
const NAME: &str = "web.example.test";

/// Provider `p`, capability `ssl-cert`: a CA played by the test. Its handler keeps each
/// run's input in `<dir>/input.json` and prints `<dir>/answer.json`, which the test writes,
/// and asks to be run again a second later.
fn provider(f: &mut Fleet) {
    let d = f.dir.path().display().to_string();
    std::fs::write(
        f.dir.path().join("answer.json"),
        r#"{"$fort_rerun_after": 1}"#,
    )
    .unwrap();
    let h = f.script(
        "ca",
        &format!("cat > {d}/input.tmp && mv {d}/input.tmp {d}/input.json; cat {d}/answer.json"),
    );
    f.capability("p", "ssl-cert", json!({"handler": h, "mode": "async"}));
}

/// What the provider answers the consumer's entry from its next run on.
fn answer(f: &Fleet, payload: Value) {
    let tmp = f.dir.path().join("answer.tmp");
    std::fs::write(
        &tmp,
        json!({ENTRY: payload, "$fort_rerun_after": 1}).to_string(),
    )
    .unwrap();
    std::fs::rename(tmp, f.dir.path().join("answer.json")).unwrap();
}

/// The public key (PEM) the consumer's request carries in the provider's latest run.
fn asked_with(f: &Fleet) -> Option<String> {
    let input: Value =
        serde_json::from_slice(&std::fs::read(f.dir.path().join("input.json")).ok()?).ok()?;
    input[ENTRY]["request"]["public"]
        .as_str()
        .map(str::to_owned)
}

/// Consumer `c`'s need `ssl-cert/web`: a P-256 key made on `c`, and the certificate, chain
/// and fullchain beside it in `dir` (the layout of the NixOS module's default paths).
fn consumer(f: &mut Fleet, dir: &Path, reuse: bool, nag_seconds: u64) {
    f.host("c").extra_toml = "[fulfill]\nbackoff = \"200ms\"\n".into();
    let file = |name: &str| {
        json!({"name": name, "path": dir.join(format!("{name}.pem")),
               "pointer": format!("/{name}"), "mode": "0644"})
    };
    f.need(
        "c",
        "ssl-cert/web",
        "p",
        json!({"request": {"public": {"$fort_key": "tls", "as": "public"}},
               "nag_seconds": nag_seconds,
               "renew_before_seconds": 86_400,
               "keys": {"tls": {"type": "ecdsa-p256", "path": dir.join("key.pem"),
                                "mode": "0600", "reuse": reuse}},
               "files": [file("certificate"), file("chain"), file("fullchain")]}),
    );
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// Key, certificate, chain and fullchain as they are on disk.
fn installed(dir: &Path) -> [String; 4] {
    ["key", "certificate", "chain", "fullchain"].map(|n| read(&dir.join(format!("{n}.pem"))))
}

fn now() -> i64 {
    fort_core::wire::unix_now() as i64
}

async fn first_request(f: &Fleet) -> String {
    let mut public = None;
    eventually(Duration::from_secs(20), || {
        public = asked_with(f);
        public.is_some()
    })
    .await;
    public.expect("the consumer asked with a public key")
}

/// A certificate, its issuer and both together.
fn issued(ca: &Ca, leaf: &str) -> Value {
    json!({"certificate": leaf, "chain": ca.pem, "fullchain": format!("{leaf}{}", ca.pem)})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_payload_replaces_a_working_pair_with_one_that_does_not_work() {
    let mut f = Fleet::new();
    provider(&mut f);
    let dir = f.dir.path().join("run/needs/ssl-cert/web");
    consumer(&mut f, &dir, true, 2);
    f.start();
    let public = first_request(&f).await;
    let ca = Ca::new("fort test CA");
    let leaf = ca.sign(&public, NAME, 30);
    answer(&f, issued(&ca, &leaf));
    assert!(
        eventually(Duration::from_secs(20), || f.all_satisfied("c")).await,
        "{}",
        f.need_status("c", "ssl-cert/web")
    );
    let working = installed(&dir);
    assert!(pair_matches(&working[0], working[1].as_bytes()));
    assert!(pair_matches(&working[0], working[3].as_bytes()));
    // The chain starts with the issuer's certificate, a CA's: that is no leaf for
    // another key, and it is installed.
    assert_eq!(working[2], ca.pem);

    let t = now();
    let stranger = ca.sign_with(
        &stranger_public_pem(),
        NAME,
        t - 3600,
        t + 30 * 86_400,
        true,
    );
    let garbage = "-----BEGIN CERTIFICATE-----\nMIIBAAECAwQ=\n-----END CERTIFICATE-----\n";
    let with_leaf = |leaf: &str| issued(&ca, leaf);
    let cases = [
        (
            "a fullchain for another key, after a line of text and marked CA:TRUE",
            json!({"certificate": leaf, "chain": ca.pem,
                   "fullchain": format!("issued by the test CA\n{stranger}{}", ca.pem)}),
            "file fullchain starts with a certificate",
        ),
        (
            "a fullchain whose first certificate does not parse",
            json!({"certificate": leaf, "chain": ca.pem,
                   "fullchain": format!("{garbage}{leaf}{}", ca.pem)}),
            "does not parse",
        ),
        (
            "a certificate that expired in 2002",
            with_leaf(&ca.sign_with(&public, NAME, 978_307_200, 1_009_843_200, false)),
            "expired at 2002-01-01T00:00:00Z",
        ),
        (
            "a certificate valid from tomorrow",
            with_leaf(&ca.sign_with(&public, NAME, t + 86_400, t + 60 * 86_400, false)),
            "is not valid before",
        ),
    ];
    // Each hostile payload in turn, the working one sent again after it: every one
    // is refused with its reason, and the working pair never leaves.
    let mut broken = Vec::new();
    for (what, payload, reason) in cases {
        answer(&f, payload);
        let mut st = Value::Null;
        let refused = eventually(Duration::from_secs(15), || {
            st = f.need_status("c", "ssl-cert/web");
            st["state"] == "failed" && st["reason"].as_str().is_some_and(|r| r.contains(reason))
        })
        .await;
        if !refused {
            broken.push(format!("{what}: not refused with {reason:?}: {st}"));
        }
        if installed(&dir) != working {
            broken.push(format!("{what}: the working pair was replaced"));
        }
        answer(&f, issued(&ca, &leaf));
        let back = eventually(Duration::from_secs(15), || {
            f.all_satisfied("c") && installed(&dir) == working
        })
        .await;
        assert!(back, "{what}: {}", f.need_status("c", "ssl-cert/web"));
    }

    // The expiry is the certificate's, however the payload carries it: a certificate
    // ending in two hours in a JSON payload that claims three months, or claims nothing.
    for claimed in [Some(t + 90 * 86_400), None] {
        let ends = now() + 7200;
        let short = ca.sign_with(&public, NAME, t - 3600, ends, false);
        let mut payload = with_leaf(&short);
        if let Some(at) = claimed {
            payload["expires_at"] = json!(at);
        }
        answer(&f, payload);
        let mut st = Value::Null;
        let read = eventually(Duration::from_secs(15), || {
            st = f.need_status("c", "ssl-cert/web");
            st["expires_at"] == json!(ends)
        })
        .await;
        let what = format!("a certificate ending at {ends} with expires_at {claimed:?}");
        if !read {
            broken.push(format!(
                "{what}: the need's expiry is not the certificate's: {st}"
            ));
            continue;
        }
        // Inside the day-long renewal window: renewing, and saying so in plain words
        // each time the payload comes back (between, the reason says a renewal is asked).
        let renewing = eventually(Duration::from_secs(15), || {
            st = f.need_status("c", "ssl-cert/web");
            st["state"] == "expiring"
                && st["reason"].as_str().is_some_and(|r| {
                    r.ends_with("inside the renewal window; asking again every 2s")
                })
        })
        .await;
        if !renewing {
            broken.push(format!("{what}: {st}"));
        }
        assert!(pair_matches(&read_key(&dir), short.as_bytes()));
    }
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

fn read_key(dir: &Path) -> String {
    read(&dir.join("key.pem"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_never_sees_a_key_with_another_keys_certificate() {
    let mut f = Fleet::new();
    provider(&mut f);
    let dir = f.dir.path().join("run/needs/ssl-cert/web");
    // A new key on every renewal, asked for at most every second.
    consumer(&mut f, &dir, false, 1);
    f.start();
    let ca = Ca::new("fort test CA");

    // A service reading its pair as a server does: the key, then the certificate; the
    // key read again tells whether the two reads saw one installation.
    let stop = Arc::new(AtomicBool::new(false));
    let reader = {
        let (stop, key_path, cert_path) = (
            stop.clone(),
            dir.join("key.pem"),
            dir.join("certificate.pem"),
        );
        std::thread::spawn(move || {
            let mut seen = BTreeSet::new();
            let mut samples = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let key = std::fs::read(&key_path).unwrap_or_default();
                let cert = std::fs::read(&cert_path).unwrap_or_default();
                let again = std::fs::read(&key_path).unwrap_or_default();
                if key == again && !key.is_empty() && !cert.is_empty() {
                    samples += 1;
                    seen.insert((key, cert));
                }
            }
            (samples, seen)
        })
    };

    // The layout's directory as the first pair lands in it.
    let inode = |p: &Path| std::fs::metadata(p).map(|m| m.ino()).unwrap_or(0);
    let mut first_inodes = None;

    // Every certificate enters its renewal window (a day before its end) 5 s after it is
    // made, so each installation is renewed with a new key moments later.
    const ROTATIONS: usize = 10;
    let mut signed = BTreeSet::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(150);
    while signed.len() < ROTATIONS && std::time::Instant::now() < deadline {
        if let Some(public) = asked_with(&f) {
            if signed.insert(public.clone()) {
                let t = now();
                let end = t + 86_400 + 5;
                let leaf = ca.sign_with(&public, NAME, t - 3600, end, false);
                let mut payload = issued(&ca, &leaf);
                payload["expires_at"] = json!(end);
                answer(&f, payload);
            }
        }
        if first_inodes.is_none() && dir.join("chain.pem").exists() {
            first_inodes = Some((inode(&dir), inode(&dir.join("chain.pem"))));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The last one installed too.
    let last_installed = eventually(Duration::from_secs(20), || {
        let key = read_key(&dir);
        !key.is_empty() && pair_matches(&key, read(&dir.join("certificate.pem")).as_bytes())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::Relaxed);
    let (samples, seen) = reader.join().unwrap();
    assert!(last_installed, "{}", f.need_status("c", "ssl-cert/web"));
    let keys: BTreeSet<&Vec<u8>> = seen.iter().map(|(k, _)| k).collect();
    assert!(
        keys.len() + 1 >= ROTATIONS,
        "only {} keys were installed in {} renewals: {}",
        keys.len(),
        signed.len(),
        f.need_status("c", "ssl-cert/web")
    );
    let mismatched = seen
        .iter()
        .filter(|(k, c)| !pair_matches(&String::from_utf8_lossy(k), c))
        .count();
    assert_eq!(
        mismatched,
        0,
        "{mismatched} of {} pairs read ({samples} reads, {} keys) were a key with another key's certificate",
        seen.len(),
        keys.len()
    );

    // The directory was replaced as a whole; the chain, the same in every answer, was
    // carried over as it was (linked, not written again).
    let (dir_inode, chain_inode) = first_inodes.expect("a first pair");
    assert_ne!(inode(&dir), dir_inode, "the directory was never exchanged");
    assert_eq!(inode(&dir.join("chain.pem")), chain_inode);

    // A directory left half-built or half-removed by a crash holds a private key: it is
    // removed when the agent starts again.
    f.kill("c");
    let leftover = dir.parent().unwrap().join(".web.fort-dir");
    std::fs::create_dir(&leftover).unwrap();
    std::fs::write(leftover.join("key.pem"), read_key(&dir)).unwrap();
    f.start_host("c");
    assert!(
        eventually(Duration::from_secs(10), || !leftover.exists()).await,
        "the leftover directory is still there"
    );
    assert!(pair_matches(
        &read_key(&dir),
        read(&dir.join("certificate.pem")).as_bytes()
    ));
}
