//! One caller of `fort-handler ssh-ca` against the others. Every response carries the KRL,
//! so each certificate a caller's change revokes (another key, validity or principals),
//! and each entry it releases, changes the payload of every other consumer: the handler
//! issues at most `max_new_certificates_per_caller_per_hour` certificates for one
//! caller's new or changed requests, and holds the rest with the reason.

use serde_json::{json, Map, Value};

mod ssh_ca_harness;
use ssh_ca_harness::*;

/// The default of `max_new_certificates_per_caller_per_hour`.
const PER_HOUR: usize = 10;

/// What the agent holds per entry after a run: a response replaces what it held, a
/// `$fort_pending` keeps it, a refusal withdraws it.
fn held_after(held: &mut Map<String, Value>, input: &Value, output: &Value) {
    for key in input.as_object().unwrap().keys() {
        let answer = &output[key];
        if answer.get("$fort_pending").is_some() {
            continue;
        }
        if answer.get("$fort_refused").is_some() || answer.is_null() {
            held.remove(key);
        } else {
            held.insert(key.clone(), answer.clone());
        }
    }
    held.retain(|k, _| input.get(k).is_some());
}

/// `requests` as the agent hands them in, each with the response it holds.
fn input_of(requests: &[(String, Value)], held: &Map<String, Value>) -> Value {
    let mut m = Map::new();
    for (key, request) in requests {
        let response = held.get(key).cloned().unwrap_or(Value::Null);
        m.insert(
            key.clone(),
            json!({"request": request, "response": response}),
        );
    }
    Value::Object(m)
}

/// `app` changes the validity of its user certificate on every run, and every third run
/// asks under a new id and releases that entry on the next: 60 runs. The two other
/// callers' responses change at most `PER_HOUR` times (each time the KRL changes); `app`'s
/// change is held, with the reason, and the certificate it holds is not revoked.
#[test]
fn a_caller_changing_its_requests_changes_the_others_payloads_a_bounded_number_of_times() {
    let test = "ssh_ca_isolation::a_caller_changing_its_requests_changes_the_others_payloads_a_bounded_number_of_times";
    let ca = Ca::new(json!({}));
    let innocent = [
        (
            "web:ssh-ca/host".to_owned(),
            json!({"kind": "host", "public_key": public(&key())}),
        ),
        (
            "ops:ssh-ca/ops".to_owned(),
            json!({"kind": "user", "public_key": public(&key()), "principals": ["ops"]}),
        ),
    ];
    let attacker_key = public(&key());
    let attacker = |run: usize| {
        (
            "app:ssh-ca/deploy".to_owned(),
            json!({"kind": "user", "public_key": attacker_key, "principals": ["deploy"],
                   "validity_seconds": 7200 + 60 * (run % 2) as u64}),
        )
    };
    let mut held = Map::new();
    let mut changed = [0usize; 2];
    let mut held_reason = None;
    for run in 0..60 {
        let mut requests = innocent.to_vec();
        requests.push(attacker(run));
        // A new id on every third run, released (left out) on the next.
        if run % 3 == 0 {
            requests.push((
                format!("app:ssh-ca/n{run}"),
                json!({"kind": "user", "public_key": public(&key()), "principals": ["deploy"]}),
            ));
        }
        let input = input_of(&requests, &held);
        let out = ca.ok(&input);
        for (i, (key, _)) in innocent.iter().enumerate() {
            assert!(
                out[key]["certificate"].is_string(),
                "run {run}: {key} is answered: {}",
                out[key]
            );
            if run > 0 && out[key] != held[key] {
                changed[i] += 1;
            }
        }
        if let Some(why) = out["app:ssh-ca/deploy"]["$fort_pending"].as_str() {
            held_reason = Some(why.to_owned());
        }
        held_after(&mut held, &input, &out);
    }
    for (i, (key, _)) in innocent.iter().enumerate() {
        // Each change is a new KRL: app's changes did reach the others, a bounded number
        // of times.
        assert!(
            (1..=PER_HOUR).contains(&changed[i]),
            "{key}'s response changed in {} of 59 runs",
            changed[i]
        );
    }
    let why = held_reason.expect("app's change is held");
    assert!(
        why.contains("max_new_certificates_per_caller_per_hour")
            && why.contains("app's")
            && why.contains(" min"),
        "{why}"
    );
    // What app holds stays valid: the KRL every consumer has does not revoke it.
    let deploy = &held["app:ssh-ca/deploy"];
    let revoked: Vec<u64> = ca.state()["state"]["revoked"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["serial"].as_u64().unwrap())
        .collect();
    assert!(!revoked.contains(&deploy["serial"].as_u64().unwrap()));
    if have_ssh_keygen(test) {
        let cert = ca.file("deploy-cert.pub", deploy["certificate"].as_str().unwrap());
        assert!(!ca.revoked(&held["web:ssh-ca/host"], &cert));
    }

    // An hour later the held change is made, and the certificate it replaces revoked.
    let held_span =
        deploy["valid_before"].as_u64().unwrap() - deploy["valid_after"].as_u64().unwrap();
    let asked = if held_span == 7200 + 300 { 61 } else { 60 };
    let mut requests = innocent.to_vec();
    requests.push(attacker(asked));
    let input = input_of(&requests, &held);
    let entries = fort_handlers::common::parse_input(input.to_string().as_bytes()).unwrap();
    let later = ca.state()["state"]["krl_generated"].as_u64().unwrap() + 3601;
    let out = fort_handlers::ssh_ca::run_now(&ca.path("config.json"), entries, later)
        .unwrap()
        .into_json();
    let now_held = &out["app:ssh-ca/deploy"];
    assert!(now_held["certificate"].is_string(), "{out}");
    assert_eq!(
        now_held["valid_before"].as_u64().unwrap() - now_held["valid_after"].as_u64().unwrap(),
        7200 + 60 * (asked % 2) as u64 + 300
    );
    let revoked: Vec<u64> = ca.state()["state"]["revoked"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["serial"].as_u64().unwrap())
        .collect();
    assert!(revoked.contains(&deploy["serial"].as_u64().unwrap()));
}

/// What the provider changes is never held back: with `app`'s hour spent, an allowance
/// narrowed under its host certificate still issues it again for what is left and
/// revokes the old one, while `app`'s own change waits; a renewal is not counted.
#[test]
fn the_providers_changes_and_renewals_are_not_held_back() {
    let ca = Ca::new(json!({"max_new_certificates_per_caller_per_hour": 2}));
    let host = json!({"kind": "host", "public_key": public(&key())});
    let user = |v: u64| json!({"kind": "user", "public_key": public(&key()), "principals": ["deploy"], "validity_seconds": v});
    let mut held = Map::new();
    let requests = [
        ("app:ssh-ca/host".to_owned(), host.clone()),
        ("app:ssh-ca/deploy".to_owned(), user(3600)),
    ];
    let input = input_of(&requests, &held);
    let first = ca.ok(&input);
    held_after(&mut held, &input, &first);
    assert!(held["app:ssh-ca/deploy"]["certificate"].is_string());

    // A renewal asked for: issued, not counted, not held.
    let mut input = input_of(&requests, &held);
    input["app:ssh-ca/deploy"]["renew"] = json!(true);
    let renewed = ca.ok(&input);
    assert_ne!(
        renewed["app:ssh-ca/deploy"]["serial"],
        first["app:ssh-ca/deploy"]["serial"]
    );
    held_after(&mut held, &input, &renewed);

    let mut config: Value =
        serde_json::from_slice(&std::fs::read(ca.path("config.json")).unwrap()).unwrap();
    config["host_principals"] = json!({"*": ["{origin}"]});
    ca.write_config(&config);
    let changed = [
        ("app:ssh-ca/host".to_owned(), host),
        ("app:ssh-ca/deploy".to_owned(), user(1800)),
    ];
    let input = input_of(&changed, &held);
    let out = ca.ok(&input);
    assert_eq!(
        out["app:ssh-ca/host"]["principals"],
        json!(["app"]),
        "{out}"
    );
    let why = out["app:ssh-ca/deploy"]["$fort_pending"]
        .as_str()
        .unwrap_or_else(|| panic!("{out}"));
    assert!(why.contains("2 certificates"), "{why}");
    let revoked: Vec<u64> = ca.state()["state"]["revoked"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["serial"].as_u64().unwrap())
        .collect();
    assert!(revoked.contains(&first["app:ssh-ca/host"]["serial"].as_u64().unwrap()));
    assert!(!revoked.contains(&renewed["app:ssh-ca/deploy"]["serial"].as_u64().unwrap()));
    assert!(
        out["$fort_rerun_after"].as_u64().is_some_and(|s| s > 60),
        "{out}"
    );
}
