//! Handler state sealed with the state key (docs/at-rest.md), through `fort-handler
//! ssh-ca` run as the agent runs it with `FORT_STATE_KEY_FILE`: the CA key it made and its
//! state hold no secret in the clear; plain state from before is sealed in place and the
//! CA goes on; another key, no key and a changed file are refused and nothing changes.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

mod ssh_ca_harness;
use ssh_ca_harness::*;

/// A CA whose key the handler makes (`generate_ca_key`) at `made/ca`.
fn generating_ca() -> Ca {
    let ca = Ca::new(json!({}));
    let config = json!({
        "ca_key_file": ca.path("made/ca"),
        "generate_ca_key": true,
        "state_file": ca.path("state/ssh-ca.json"),
        "hosts_file": ca.path("hosts.json"),
        "host_principals": {"*": ["{origin}"]},
        "user_principals": {"app": ["deploy"]},
    });
    ca.write_config(&config);
    ca
}

fn key_file(ca: &Ca, name: &str) -> PathBuf {
    let path = ca.path(name);
    std::fs::write(
        &path,
        fort_core::sealed::StateKey::generate_hex().as_bytes(),
    )
    .unwrap();
    path
}

fn run(ca: &Ca, key: Option<&Path>, input: &Value) -> (bool, Value, String) {
    let key = key.map(|k| k.display().to_string());
    let mut env = vec![("FORT_HOST", "forge")];
    if let Some(k) = &key {
        env.push((fort_core::sealed::KEY_FILE_ENV, k.as_str()));
    }
    fort_tests::run_handler("ssh-ca", &ca.path("config.json"), "request", &env, input)
}

fn ok(ca: &Ca, key: Option<&Path>, input: &Value) -> Value {
    let (ok, out, err) = run(ca, key, input);
    assert!(ok, "run failed: {err}");
    out
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// The files the handler keeps, as bytes.
fn kept(ca: &Ca) -> Vec<(PathBuf, Vec<u8>)> {
    ["made/ca", "state/ssh-ca.json"]
        .iter()
        .map(|f| (ca.path(f), std::fs::read(ca.path(f)).unwrap()))
        .collect()
}

#[test]
fn plain_state_is_sealed_in_place_and_the_ca_goes_on() {
    let ca = generating_ca();
    let host = json!({"kind": "host", "public_key": public(&key())});
    let first = json!({"app:ssh-ca/host": entry(host.clone())});
    // The release before: no key, everything plain.
    let out = ok(&ca, None, &first);
    let ca_line = out["app:ssh-ca/host"]["ca_public_key"].clone();
    for (path, bytes) in kept(&ca) {
        assert!(
            !fort_core::sealed::is_sealed(&bytes),
            "{} sealed without a key",
            path.display()
        );
    }
    assert!(contains(
        &std::fs::read(ca.path("made/ca")).unwrap(),
        b"OPENSSH PRIVATE KEY"
    ));

    // With a key: sealed in place on the first run, and the same CA and serials go on.
    let k = key_file(&ca, "state-key");
    let mut next = fed_back(&first, &out);
    next["web:ssh-ca/host"] = entry(json!({"kind": "host", "public_key": public(&key())}));
    let out = ok(&ca, Some(&k), &next);
    assert_eq!(out["app:ssh-ca/host"]["ca_public_key"], ca_line);
    assert_eq!(out["web:ssh-ca/host"]["ca_public_key"], ca_line);
    assert_eq!(out["web:ssh-ca/host"]["serial"], 2, "serials go on");
    assert_eq!(
        out["app:ssh-ca/host"]["certificate"],
        first_cert(&next),
        "an unchanged entry keeps its certificate"
    );
    for (path, bytes) in kept(&ca) {
        assert!(
            fort_core::sealed::is_sealed(&bytes),
            "{} is not sealed",
            path.display()
        );
        assert!(!contains(&bytes, b"OPENSSH PRIVATE KEY"));
        assert!(!contains(&bytes, b"next_serial"));
    }
    // And it keeps working sealed.
    let again = ok(&ca, Some(&k), &fed_back(&next, &out));
    assert_eq!(again["web:ssh-ca/host"]["serial"], 2);
}

fn first_cert(input: &Value) -> Value {
    input["app:ssh-ca/host"]["response"]["certificate"].clone()
}

#[test]
fn another_key_no_key_and_a_changed_file_are_refused_and_nothing_changes() {
    let ca = generating_ca();
    let k = key_file(&ca, "state-key");
    let input =
        json!({"app:ssh-ca/host": entry(json!({"kind": "host", "public_key": public(&key())}))});
    let out = ok(&ca, Some(&k), &input);
    let before = kept(&ca);
    let next = fed_back(&input, &out);

    let other = key_file(&ca, "other-key");
    let (ok_other, _, err) = run(&ca, Some(&other), &next);
    assert!(!ok_other, "a run under another key succeeded");
    assert!(err.contains("not with this one"), "{err}");
    assert!(
        err.contains(ca.dir.path().to_str().unwrap()),
        "names the file: {err}"
    );
    assert_eq!(kept(&ca), before, "nothing changed");

    let (ok_none, _, err) = run(&ca, None, &next);
    assert!(!ok_none, "a run without a key succeeded");
    assert!(err.contains("this process has no state key"), "{err}");
    assert_eq!(kept(&ca), before, "nothing changed");

    // One changed character inside the sealed state: authentication fails, nothing of
    // it is used, and the file stays as it was for the operator to look at.
    let state = ca.path("state/ssh-ca.json");
    let text = String::from_utf8(std::fs::read(&state).unwrap()).unwrap();
    let at = text.find("\"data\":\"").unwrap() + 8;
    let flipped = if &text[at..at + 1] == "A" { "B" } else { "A" };
    let changed = format!("{}{flipped}{}", &text[..at], &text[at + 1..]);
    std::fs::write(&state, &changed).unwrap();
    let (ok_changed, out, err) = run(&ca, Some(&k), &next);
    assert!(
        !ok_changed,
        "a run on a changed state file succeeded: {out}"
    );
    assert!(
        err.contains("authentication of the sealed contents failed"),
        "{err}"
    );
    assert_eq!(std::fs::read(&state).unwrap(), changed.as_bytes());

    // A sealed file copied over another's place does not open there either.
    std::fs::write(&state, &before[1].1).unwrap();
    std::fs::copy(ca.path("made/ca"), &state).unwrap();
    let (ok_moved, _, err) = run(&ca, Some(&k), &next);
    assert!(!ok_moved);
    assert!(
        err.contains("authentication of the sealed contents failed"),
        "{err}"
    );
}
