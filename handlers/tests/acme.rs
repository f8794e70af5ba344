//! `fort-handler acme` against Debian's pebble on loopback, run as the agent runs it
//! (entries on stdin, answers on stdout): certificates for CSRs made here, through HTTP-01
//! (nginx serving the webroot) and DNS-01 (knotd, RFC 2136 + TSIG) for a wildcard;
//! names outside the caller's allowance refused before any request; unchanged entries
//! answered with the CA stopped; renew issuing a new certificate; release revoking it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use fort_tests::dns::{DnsServer, Flavor};
use fort_tests::pebble::{Pebble, Webroot};
use serde_json::{json, Value};
use x509_parser::pem::{parse_x509_pem, Pem};
use x509_parser::prelude::*;

const KEY: &str = "app:ssl-cert/web";

/// A key and a CSR for `names`, as a consumer makes them.
fn csr(names: &[&str]) -> (rcgen::KeyPair, String) {
    let key = rcgen::KeyPair::generate().unwrap();
    let params =
        rcgen::CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
            .unwrap();
    let csr = params.serialize_request(&key).unwrap().pem().unwrap();
    (key, csr)
}

struct Run {
    ok: bool,
    out: Value,
    stderr: String,
}

fn run(config: &Path, input: &Value) -> Run {
    run_keyed(config, input, None)
}

/// [`run`] with the state key `key` (`FORT_STATE_KEY_FILE`): the state sealed.
fn run_keyed(config: &Path, input: &Value, key: Option<&Path>) -> Run {
    let key = key.map(|k| k.to_string_lossy().into_owned());
    let env: Vec<(&str, &str)> = key
        .iter()
        .map(|k| (fort_core::sealed::KEY_FILE_ENV, k.as_str()))
        .collect();
    let (ok, out, stderr) = fort_tests::run_handler("acme", config, "request", &env, input);
    Run { ok, out, stderr }
}

/// Runs the handler as the agent would (again after `$fort_rerun_after`, the response
/// kept) until the entry is answered; returns the response and every run's output.
fn issue(
    config: &Path,
    request: &Value,
    previous: Option<&Value>,
    renew: bool,
) -> (Value, Vec<Run>) {
    issue_keyed(config, request, previous, renew, None)
}

/// [`issue`] with the state key `key`.
fn issue_keyed(
    config: &Path,
    request: &Value,
    previous: Option<&Value>,
    renew: bool,
    key: Option<&Path>,
) -> (Value, Vec<Run>) {
    let mut runs = Vec::new();
    for _ in 0..40 {
        let mut entry = json!({"request": request, "response": previous});
        if renew {
            entry["renew"] = json!(true);
        }
        let r = run_keyed(config, &json!({ KEY: entry }), key);
        assert!(r.ok, "the run failed: {}", r.stderr);
        let answer = r.out[KEY].clone();
        if answer.get("certificate").is_some() {
            runs.push(r);
            return (answer, runs);
        }
        let pending = answer["$fort_pending"]
            .as_str()
            .unwrap_or_else(|| panic!("neither a certificate nor pending: {} {}", r.out, r.stderr));
        assert!(!pending.is_empty());
        let rerun = r.out["$fort_rerun_after"]
            .as_u64()
            .expect("a pending entry asks for a rerun");
        assert!((1..=3600).contains(&rerun));
        runs.push(r);
        std::thread::sleep(Duration::from_millis(500));
    }
    panic!(
        "no certificate after 40 runs: {:?}",
        runs.last().map(|r| (&r.out, &r.stderr))
    );
}

fn pem_blocks(text: &str) -> Vec<Vec<u8>> {
    Pem::iter_from_buffer(text.as_bytes())
        .map(|p| p.unwrap().contents)
        .collect()
}

/// The response's leaf chains through its chain to `root`, is for `key`, and names
/// exactly `names`; returns the leaf's serial in hex.
fn assert_issued(response: &Value, root: &str, key: &rcgen::KeyPair, names: &[&str]) -> String {
    let leaf_der = pem_blocks(response["certificate"].as_str().unwrap());
    let chain_der = pem_blocks(response["chain"].as_str().unwrap());
    let full = pem_blocks(response["fullchain"].as_str().unwrap());
    assert_eq!(leaf_der.len(), 1);
    assert!(!chain_der.is_empty());
    assert_eq!(full, [leaf_der.clone(), chain_der.clone()].concat());
    let root_der = pem_blocks(root);
    let mut path: Vec<&Vec<u8>> = leaf_der.iter().chain(chain_der.iter()).collect();
    path.push(&root_der[0]);
    for pair in path.windows(2) {
        let (_, child) = X509Certificate::from_der(pair[0]).unwrap();
        let (_, parent) = X509Certificate::from_der(pair[1]).unwrap();
        child
            .verify_signature(Some(parent.public_key()))
            .expect("each certificate is signed by the next, up to pebble's root");
    }
    let (_, leaf) = X509Certificate::from_der(&leaf_der[0]).unwrap();
    assert_eq!(
        leaf.public_key().raw,
        rcgen::PublicKeyData::subject_public_key_info(key),
        "the certificate is for the consumer's key"
    );
    let mut got: Vec<String> = leaf
        .subject_alternative_name()
        .unwrap()
        .unwrap()
        .value
        .general_names
        .iter()
        .map(|n| match n {
            GeneralName::DNSName(d) => d.to_string(),
            other => panic!("{other:?}"),
        })
        .collect();
    got.sort();
    let mut want: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    want.sort();
    assert_eq!(got, want);
    assert_eq!(
        response["not_after"].as_i64().unwrap(),
        leaf.validity().not_after.timestamp()
    );
    hex::encode(leaf.raw_serial())
}

fn write_config(dir: &Path, config: Value) -> PathBuf {
    let path = dir.join("acme.json");
    std::fs::write(&path, config.to_string()).unwrap();
    path
}

fn dns01(dns: &DnsServer) -> Value {
    let key_file = dns.dir.path().join("tsig.key");
    dns.write_key(&key_file);
    json!({"zone": dns.zone, "primary": dns.addr.to_string(),
           "key": {"name": dns.key_name, "file": key_file}})
}

/// A CA to order from: Knot serving `records` in example.test, pebble resolving through
/// it (certificates living `lifetime` seconds, or pebble's default), and the HTTP-01
/// webroot pebble validates against. `None`: a server is missing, recorded as a skip
/// of `test`. Each stops when dropped.
struct Ca {
    dns: DnsServer,
    pebble: Pebble,
    web: Webroot,
}

impl Ca {
    fn start(test: &str, records: &str, lifetime: Option<u64>) -> Option<Ca> {
        let started = DnsServer::start(Flavor::Knot, "example.test", records).and_then(|dns| {
            let pebble = Pebble::start(dns.addr, lifetime)?;
            let web = Webroot::start(pebble.http_port)?;
            Ok(Ca { dns, pebble, web })
        });
        match started {
            Ok(ca) => Some(ca),
            Err(why) => {
                fort_tests::skip(test, &why);
                None
            }
        }
    }
}

#[test]
fn acme_http01_issue_keep_renew_and_revoke() {
    const T: &str = "acme_http01_issue_keep_renew_and_revoke";
    let records = "app IN A 127.0.0.1\nwww.app IN A 127.0.0.1\n";
    let Some(Ca {
        dns: _dns,
        pebble,
        web,
    }) = Ca::start(T, records, None)
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state/acme.json");
    let config = write_config(
        dir.path(),
        json!({"directory": pebble.directory, "ca_root": pebble.tls_root,
               "contact": ["mailto:ops@example.test"],
               "allow": {"app": ["app.example.test", "*.app.example.test"]},
               "http01": {"webroot": web.path()},
               "revoke_on_release": true, "rerun_seconds": 1, "state": state}),
    );
    let names = ["app.example.test", "www.app.example.test"];
    let (key, csr_pem) = csr(&names);
    let request = json!({"csr": csr_pem});

    // Issued over a few runs, each answering pending with a reason until it is there.
    let (first, runs) = issue(&config, &request, None, false);
    assert!(runs.len() >= 2, "issuance takes more than one run");
    let reason = runs[0].out[KEY]["$fort_pending"].as_str().unwrap();
    assert!(
        reason.contains("order placed at 127.0.0.1:") && reason.contains("waiting for validation"),
        "{reason}"
    );
    let root = pebble.root();
    let serial = assert_issued(&first, &root, &key, &names);
    assert!(
        web.access_log().contains("/.well-known/acme-challenge/"),
        "pebble fetched the answer"
    );
    // The challenge answers are gone; the state is private and never held the key.
    let challenge_dir = web.path().join(".well-known/acme-challenge");
    assert_eq!(std::fs::read_dir(&challenge_dir).unwrap().count(), 0);
    use std::os::unix::fs::MetadataExt;
    assert_eq!(std::fs::metadata(&state).unwrap().mode() & 0o777, 0o600);
    let key_pem = key.serialize_pem();
    let secret_line = key_pem.lines().nth(1).unwrap();
    let state_text = std::fs::read_to_string(&state).unwrap();
    assert!(!state_text.contains(secret_line));
    assert!(runs
        .iter()
        .all(|r| !r.stderr.contains(secret_line) && !r.out.to_string().contains(secret_line)));

    // The same names for another caller: refused, named, before any request.
    let other = run(
        &config,
        &json!({"web:ssl-cert/x": {"request": request}, KEY: {"request": request, "response": first}}),
    );
    assert!(other.ok);
    assert_eq!(
        other.out["web:ssl-cert/x"]["$fort_refused"],
        "app.example.test is not a name web may get a certificate for (nothing is allowed for web)"
    );
    assert_eq!(other.out[KEY], first);

    // Unchanged: answered from the state with the directory pointing where nothing
    // listens (any request to the CA would fail the run).
    let dead = write_config(
        dir.path(),
        json!({"directory": "https://127.0.0.1:9/dir", "ca_root": pebble.tls_root,
               "allow": {"app": ["app.example.test", "*.app.example.test"]},
               "http01": {"webroot": web.path()},
               "revoke_on_release": true, "rerun_seconds": 1, "state": state}),
    );
    let again = run(
        &dead,
        &json!({ KEY: {"request": request, "response": first} }),
    );
    assert!(again.ok, "{}", again.stderr);
    assert_eq!(again.out[KEY], first);
    assert!(again.out.get("$fort_rerun_after").is_none());
    // An agent holding that certificate names its hash (protocol §11.11): the handler
    // keeps it instead of printing it again; another hash gets the certificate in full.
    let held = fort_core::canonical::sha256_hex(first.to_string().as_bytes());
    let kept = run(
        &dead,
        &json!({ KEY: {"request": request, "response": null, "held": held} }),
    );
    assert!(kept.ok, "{}", kept.stderr);
    assert_eq!(kept.out, json!({ KEY: {"$fort_keep": held} }));
    let stale = run(
        &dead,
        &json!({ KEY: {"request": request, "response": null, "held": "00"} }),
    );
    assert_eq!(stale.out[KEY], first);
    let config = write_config(
        dir.path(),
        json!({"directory": pebble.directory, "ca_root": pebble.tls_root,
               "allow": {"app": ["app.example.test", "*.app.example.test"]},
               "http01": {"webroot": web.path()},
               "revoke_on_release": true, "rerun_seconds": 1, "state": state}),
    );

    // renew long before the certificate's last third: kept, no order (the CA would count
    // a duplicate); renewals that are due are in acme_renewals_and_certificates_bounded.
    let early = run(
        &config,
        &json!({ KEY: {"request": request, "response": first, "renew": true} }),
    );
    assert!(early.ok, "{}", early.stderr);
    assert_eq!(early.out[KEY], first);
    assert!(
        early.stderr.contains("1 renewals not due"),
        "{}",
        early.stderr
    );
    let _ = serial;

    // A new CSR (a new key) is a new certificate.
    let (key3, csr3) = csr(&["www.app.example.test"]);
    let request3 = json!({"csr": csr3, "names": ["www.app.example.test"]});
    let (third, _) = issue(&config, &request3, Some(&first), false);
    let serial3 = assert_issued(&third, &pebble.root(), &key3, &["www.app.example.test"]);
    assert_eq!(pebble.cert_status(&serial3), "Valid");

    // Released: the entry is gone from the input; its certificate is revoked at the CA.
    let released = run(&config, &json!({}));
    assert!(released.ok, "{}", released.stderr);
    assert_eq!(pebble.cert_status(&serial3), "Revoked");
    let state_text = std::fs::read_to_string(&state).unwrap();
    assert!(!state_text.contains(KEY), "the entry is forgotten");
}

#[test]
fn acme_dns01_wildcard_through_knot() {
    const T: &str = "acme_dns01_wildcard_through_knot";
    let dns = match DnsServer::start(Flavor::Knot, "example.test", "") {
        Ok(d) => d,
        Err(why) => return fort_tests::skip(T, &why),
    };
    let pebble = match Pebble::start(dns.addr, None) {
        Ok(p) => p,
        Err(why) => return fort_tests::skip(T, &why),
    };
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        json!({"directory": pebble.directory, "ca_root": pebble.tls_root,
               "allow": {"app": ["*.app.example.test"]},
               "dns01": dns01(&dns), "rerun_seconds": 1,
               "state": dir.path().join("state.json")}),
    );
    let names = ["*.app.example.test"];
    let (key, csr_pem) = csr(&names);
    let request = json!({"csr": csr_pem});
    // The first run places the order and publishes the TXT record at the primary.
    let first = run(&config, &json!({ KEY: {"request": request} }));
    assert!(first.ok, "{}", first.stderr);
    assert!(first.out[KEY]["$fort_pending"].is_string(), "{}", first.out);
    assert_eq!(
        dns.dig("_acme-challenge.app.example.test", "TXT").len(),
        1,
        "the challenge record is published at the primary"
    );
    let (response, _) = issue(&config, &request, None, false);
    assert_issued(&response, &pebble.root(), &key, &names);
    assert!(
        dns.dig("_acme-challenge.app.example.test", "TXT")
            .is_empty(),
        "the challenge record is removed"
    );
}

#[test]
fn acme_refusals_before_any_request() {
    let dir = tempfile::tempdir().unwrap();
    let webroot = dir.path().join("www");
    // Nothing listens at this directory: a refusal that reached it would fail the run.
    let config = write_config(
        dir.path(),
        json!({"directory": "https://127.0.0.1:9/dir",
               "allow": {"app": ["app.example.test"], "*": ["{origin}.hosts.example.test"]},
               "http01": {"webroot": webroot}, "state": dir.path().join("state.json")}),
    );
    let (_, good) = csr(&["app.example.test"]);
    let (_, outside) = csr(&["app.example.test", "evil.example.test"]);
    let (_, wildcard) = csr(&["*.app.example.test"]);
    let (_, own) = csr(&["web.hosts.example.test"]);
    // A CSR whose signature no longer verifies: one byte of its signature flipped.
    let tampered = {
        use base64::Engine;
        let (_, p) = parse_x509_pem(good.as_bytes()).unwrap();
        let mut der = p.contents.clone();
        let last = der.len() - 1;
        der[last] ^= 1;
        let b64 = base64::engine::general_purpose::STANDARD.encode(der);
        format!("-----BEGIN CERTIFICATE REQUEST-----\n{b64}\n-----END CERTIFICATE REQUEST-----\n")
    };
    let input = json!({
        "app:ssl-cert/outside": {"request": {"csr": outside}},
        "app:ssl-cert/names": {"request": {"csr": good, "names": ["app.example.test", "x.app.example.test"]}},
        "app:ssl-cert/tampered": {"request": {"csr": tampered}},
        "app:ssl-cert/wild": {"request": {"csr": wildcard}},
        "app:ssl-cert/key": {"request": {"csr": good, "key": "-----BEGIN PRIVATE KEY-----"}},
        "app:ssl-cert/garbage": {"request": {"csr": "hello"}},
        "web:ssl-cert/own": {"request": {"csr": own, "names": ["app.example.test"]}},
    });
    let r = run(&config, &input);
    assert!(r.ok, "{}", r.stderr);
    let reason = |k: &str| {
        r.out[k]["$fort_refused"]
            .as_str()
            .unwrap_or_else(|| panic!("{k}: {}", r.out))
            .to_owned()
    };
    assert_eq!(
        reason("app:ssl-cert/outside"),
        "evil.example.test is not a name app may get a certificate for \
         (allowed for app: app.example.test, app.hosts.example.test)"
    );
    assert!(reason("app:ssl-cert/names").contains("x.app.example.test"));
    assert_eq!(
        reason("app:ssl-cert/tampered"),
        "the CSR's signature does not verify"
    );
    assert!(reason("app:ssl-cert/wild").contains("*.app.example.test"));
    assert!(reason("app:ssl-cert/key").contains("key"));
    assert!(reason("app:ssl-cert/garbage").contains("PEM"));
    assert!(reason("web:ssl-cert/own").contains("not the names requested"));
    assert!(
        !dir.path().join("state.json").exists()
            || !std::fs::read_to_string(dir.path().join("state.json"))
                .unwrap()
                .contains("order")
    );
}

/// A renewal is honoured once the certificate is in its last third (and kept before);
/// one caller's entry gets at most `max_certificates_per_week` certificates, however it
/// asks (renewals, new keys), while another caller is served in the same runs.
#[test]
fn acme_renewals_and_certificates_bounded() {
    const T: &str = "acme_renewals_and_certificates_bounded";
    let records = "app IN A 127.0.0.1\nweb IN A 127.0.0.1\n";
    // Certificates living 12 s: due for renewal after 8.
    let Some(Ca {
        dns: _dns,
        pebble,
        web,
    }) = Ca::start(T, records, Some(12))
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        json!({"directory": pebble.directory, "ca_root": pebble.tls_root,
               "allow": {"app": ["app.example.test"], "web": ["web.example.test"]},
               "http01": {"webroot": web.path()}, "max_certificates_per_week": 2,
               "rerun_seconds": 1, "state": dir.path().join("state/acme.json")}),
    );
    let (_, app_csr) = csr(&["app.example.test"]);
    let request = json!({"csr": app_csr});
    let (first, _) = issue(&config, &request, None, false);
    let issued_at = std::time::Instant::now();

    // Asked to renew at once: kept.
    let early = run(
        &config,
        &json!({ KEY: {"request": request, "response": first, "renew": true} }),
    );
    assert_eq!(early.out[KEY], first, "{}", early.stderr);
    // In its last third: renewed (the entry's second certificate this week).
    std::thread::sleep(Duration::from_secs(8).saturating_sub(issued_at.elapsed()));
    let (second, _) = issue(&config, &request, Some(&first), true);
    assert_ne!(second["certificate"], first["certificate"]);

    // A third certificate for this entry, with a new key, waits; another caller asking
    // in the same runs gets its own.
    let (_, app_csr3) = csr(&["app.example.test"]);
    let (_, web_csr) = csr(&["web.example.test"]);
    let mut web_answer = Value::Null;
    for _ in 0..40 {
        let r = run(
            &config,
            &json!({ KEY: {"request": {"csr": app_csr3}, "response": second},
                     "web:ssl-cert/site": {"request": {"csr": web_csr}, "response": null} }),
        );
        assert!(r.ok, "{}", r.stderr);
        let held = r.out[KEY]["$fort_pending"].as_str().unwrap_or_default();
        assert!(
            held.contains("2 certificates were issued for this entry")
                && held.contains("max_certificates_per_week"),
            "{}",
            r.out
        );
        if r.out["web:ssl-cert/site"].get("certificate").is_some() {
            web_answer = r.out["web:ssl-cert/site"].clone();
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    assert!(web_answer["certificate"].is_string(), "web was not served");
}

/// A caller's entries together get at most `max_certificates_per_caller_per_week`
/// certificates, however it asks: many entries at once, or entries released and asked
/// for again under new ids with new names (each entry, and each set of names, would be
/// new to the per-entry limits). Another caller is served in the same runs.
#[test]
fn acme_a_caller_cannot_spend_the_cas_limits_for_everyone() {
    const T: &str = "acme_a_caller_cannot_spend_the_cas_limits_for_everyone";
    let records = "*.app IN A 127.0.0.1\nweb IN A 127.0.0.1\n";
    let Some(Ca {
        dns: _dns,
        pebble,
        web,
    }) = Ca::start(T, records, None)
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        json!({"directory": pebble.directory, "ca_root": pebble.tls_root,
               "allow": {"app": ["*.app.example.test"], "web": ["web.example.test"]},
               "http01": {"webroot": web.path()}, "max_certificates_per_caller_per_week": 2,
               "rerun_seconds": 1, "state": dir.path().join("state/acme.json")}),
    );
    let request = |name: &str| json!({"csr": csr(&[name]).1});
    let (web_key, web_request) = ("web:ssl-cert/site", request("web.example.test"));
    // Runs the entries (responses kept) until none is under way; the last output.
    let settle = |input: &mut Value| -> Value {
        for _ in 0..40 {
            let r = run(&config, input);
            assert!(r.ok, "the run failed: {}", r.stderr);
            let mut under_way = false;
            for (key, answer) in r.out.as_object().unwrap() {
                if key.starts_with('$') {
                    continue;
                }
                if answer.get("certificate").is_some() {
                    input[key]["response"] = answer.clone();
                }
                let pending = answer["$fort_pending"].as_str().unwrap_or_default();
                under_way |= pending.starts_with("order ");
            }
            if !under_way {
                return r.out;
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        panic!("orders still under way after 40 runs");
    };

    let mut input = json!({});
    for i in 1..=3 {
        input[format!("app:ssl-cert/c{i}")] =
            json!({"request": request(&format!("c{i}.app.example.test")), "response": null});
    }
    input[web_key] = json!({"request": web_request, "response": null});
    let out = settle(&mut input);
    assert!(out[web_key]["certificate"].is_string(), "{out}");
    let issued = (1..=3)
        .filter(|i| out[format!("app:ssl-cert/c{i}")]["certificate"].is_string())
        .count();
    assert_eq!(issued, 2, "{out}");
    let held = out["app:ssl-cert/c3"]["$fort_pending"]
        .as_str()
        .unwrap_or_default();
    assert!(
        held.contains("app's entries") && held.contains("max_certificates_per_caller_per_week"),
        "{out}"
    );

    // Released, and asked for again under a new id with a new name: still held.
    let mut input = json!({
        "app:ssl-cert/fresh": {"request": request("fresh.app.example.test"), "response": null},
        web_key: input[web_key].clone(),
    });
    let out = settle(&mut input);
    let held = out["app:ssl-cert/fresh"]["$fort_pending"]
        .as_str()
        .unwrap_or_default();
    assert!(held.contains("app's entries"), "{out}");
    assert!(out[web_key]["certificate"].is_string(), "{out}");
}

/// Two callers allowed the same names share that set's weekly limit, as they share the
/// CA's. Another caller's new certificates for those names cannot take its last one: the
/// holder's renewal, once due, gets it, in the same runs as the other caller is held.
#[test]
fn acme_another_caller_cannot_take_a_holders_renewal() {
    const T: &str = "acme_another_caller_cannot_take_a_holders_renewal";
    let records = "app IN A 127.0.0.1\n";
    // Certificates living 12 s: due for renewal after 8.
    let Some(Ca {
        dns: _dns,
        pebble,
        web,
    }) = Ca::start(T, records, Some(12))
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        json!({"directory": pebble.directory, "ca_root": pebble.tls_root,
               "allow": {"app": ["app.example.test"], "web": ["app.example.test"]},
               "http01": {"webroot": web.path()}, "max_certificates_per_week": 2,
               "rerun_seconds": 1, "state": dir.path().join("state/acme.json")}),
    );
    let (_, holder_csr) = csr(&["app.example.test"]);
    let (first, _) = issue(&config, &json!({"csr": holder_csr}), None, false);
    let issued_at = std::time::Instant::now();

    // The other caller asks for the same names while the holder's certificate is young.
    let (_, other_csr) = csr(&["app.example.test"]);
    let other = "web:ssl-cert/same";
    let r = run(
        &config,
        &json!({ KEY: {"request": {"csr": holder_csr}, "response": first},
                 other: {"request": {"csr": other_csr}, "response": null} }),
    );
    assert!(r.ok, "{}", r.stderr);
    let held = r.out[other]["$fort_pending"].as_str().unwrap_or_default();
    assert!(held.contains("due for renewal"), "{}", r.out);

    // Due: the holder renews with a new key and gets the names' last certificate, while
    // the other caller keeps waiting.
    std::thread::sleep(Duration::from_secs(8).saturating_sub(issued_at.elapsed()));
    let (_, renewal_csr) = csr(&["app.example.test"]);
    let mut renewed = Value::Null;
    for _ in 0..40 {
        let r = run(
            &config,
            &json!({ KEY: {"request": {"csr": renewal_csr}, "response": first},
                     other: {"request": {"csr": other_csr}, "response": null} }),
        );
        assert!(r.ok, "{}", r.stderr);
        assert!(
            r.out[other]["$fort_pending"].as_str().is_some(),
            "{}",
            r.out
        );
        if r.out[KEY].get("certificate").is_some() {
            renewed = r.out[KEY].clone();
            break;
        }
        let why = r.out[KEY]["$fort_pending"].as_str().unwrap_or_default();
        assert!(why.starts_with("order "), "{}", r.out);
        std::thread::sleep(Duration::from_millis(500));
    }
    assert_ne!(renewed["certificate"], first["certificate"], "not renewed");
}

/// A caller's orders that fail (names the CA cannot validate), asked for again under new
/// ids to escape each entry's back-off, would spend the CA's new orders per account for
/// every caller: at most `max_orders_per_caller_per_hour` are placed, whatever became of
/// them, and another caller's order is placed and served in the same runs.
#[test]
fn acme_a_callers_failing_orders_cannot_spend_the_accounts_orders() {
    const T: &str = "acme_a_callers_failing_orders_cannot_spend_the_accounts_orders";
    // No record for the caller's names: every validation of them fails.
    let Some(Ca {
        dns: _dns,
        pebble,
        web,
    }) = Ca::start(T, "web IN A 127.0.0.1\n", None)
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        json!({"directory": pebble.directory, "ca_root": pebble.tls_root,
               "allow": {"app": ["*.app.example.test"], "web": ["web.example.test"]},
               "http01": {"webroot": web.path()}, "max_orders_per_caller_per_hour": 3,
               "rerun_seconds": 1, "state": dir.path().join("state/acme.json")}),
    );
    let site = "web:ssl-cert/site";
    let web_request = json!({"csr": csr(&["web.example.test"]).1});
    let mut web_response = Value::Null;
    let mut placed = 0;
    // Each round: new ids with new names (the ones before released), and web's entry.
    for round in 0..6 {
        let mut input = json!({ site: {"request": web_request, "response": web_response} });
        for i in 0..2 {
            let name = format!("r{round}n{i}.app.example.test");
            input[format!("app:ssl-cert/r{round}n{i}")] =
                json!({"request": {"csr": csr(&[&name]).1}, "response": null});
        }
        let r = run(&config, &input);
        assert!(r.ok, "{}", r.stderr);
        for i in 0..2 {
            let why = r.out[format!("app:ssl-cert/r{round}n{i}")]["$fort_pending"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            if why.contains("max_orders_per_caller_per_hour") {
                assert!(why.contains("3 orders"), "{why}");
            } else {
                placed += 1;
            }
        }
        if r.out[site].get("certificate").is_some() {
            web_response = r.out[site].clone();
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    assert_eq!(placed, 3, "orders placed for app");
    for _ in 0..20 {
        if web_response.get("certificate").is_some() {
            break;
        }
        let r = run(
            &config,
            &json!({ site: {"request": web_request, "response": web_response} }),
        );
        assert!(r.ok, "{}", r.stderr);
        if r.out[site].get("certificate").is_some() {
            web_response = r.out[site].clone();
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    assert!(
        web_response["certificate"].is_string(),
        "web was not served"
    );
}

/// With a state key (docs/at-rest.md): no file the handler keeps holds the ACME account
/// key; a second run over the sealed state keeps the certificate without a request to the
/// CA; a changed state file fails the run before any request, and the file stays.
#[test]
fn acme_sealed_state_holds_no_account_key_and_a_changed_file_is_refused() {
    const T: &str = "acme_sealed_state_holds_no_account_key_and_a_changed_file_is_refused";
    let Some(Ca {
        dns: _dns,
        pebble,
        web,
    }) = Ca::start(T, "app IN A 127.0.0.1\n", None)
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state/acme.json");
    let key_file = fort_tests::state_key_file(&dir.path().join("state-key"));
    let config_for = |directory: &str| {
        write_config(
            dir.path(),
            json!({"directory": directory, "ca_root": pebble.tls_root,
                   "allow": {"app": ["app.example.test"]},
                   "http01": {"webroot": web.path()}, "rerun_seconds": 1, "state": state}),
        )
    };
    let config = config_for(&pebble.directory);
    let names = ["app.example.test"];
    let (key, csr_pem) = csr(&names);
    let request = json!({"csr": csr_pem});
    let (first, _) = issue_keyed(&config, &request, None, false, Some(&key_file));
    assert_issued(&first, &pebble.root(), &key, &names);

    // The account key, as the handler keeps it (opened with the state key): in no file.
    let opened = fort_core::sealed::read(
        &state,
        Some(&fort_core::sealed::StateKey::load(&key_file).unwrap()),
    )
    .unwrap()
    .unwrap();
    assert!(!opened.was_plain);
    let doc: Value = serde_json::from_slice(&opened.plain).unwrap();
    let credentials = doc["state"]["account"]["credentials"].as_object().unwrap();
    let account_key = credentials
        .iter()
        .find(|(k, v)| k.contains("key") && v.is_string())
        .map(|(_, v)| v.as_str().unwrap().to_owned())
        .unwrap_or_else(|| panic!("no account key in {credentials:?}"));
    assert!(account_key.len() > 40);
    for secret in [account_key.as_bytes(), b"PRIVATE KEY"] {
        assert_eq!(
            fort_tests::files_holding(&dir.path().join("state"), secret),
            Vec::<PathBuf>::new(),
            "the account key is readable from a copy of the state"
        );
    }

    // Over the sealed state, with the directory where nothing listens (any request to
    // the CA would fail the run): the certificate is kept.
    let dead = config_for("https://127.0.0.1:9/dir");
    let entry = json!({ KEY: {"request": request, "response": first} });
    let again = run_keyed(&dead, &entry, Some(&key_file));
    assert!(again.ok, "{}", again.stderr);
    assert_eq!(again.out[KEY], first);

    // A changed state file: the run fails naming it, before any request to the CA.
    fort_tests::change_sealed_member(&state, "data");
    let changed = std::fs::read(&state).unwrap();
    let config = config_for(&pebble.directory);
    let fetched = web.access_log();
    let refused = run_keyed(
        &config,
        &json!({ KEY: {"request": request}}),
        Some(&key_file),
    );
    assert!(
        !refused.ok,
        "a run on a changed state file succeeded: {}",
        refused.out
    );
    assert!(
        refused
            .stderr
            .contains("authentication of the sealed contents failed")
            && refused.stderr.contains(&state.display().to_string()),
        "{}",
        refused.stderr
    );
    assert_eq!(std::fs::read(&state).unwrap(), changed, "the file stays");
    // Nor did an order reach the CA: pebble validates one by fetching from the webroot.
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(web.access_log(), fetched, "the CA was asked for something");
}
