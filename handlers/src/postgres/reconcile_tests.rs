//! Decisions of `reconcile` that need no server.

use super::*;
use crate::common::parse_input;

/// Every role's limit is 1 (`connection_limit`), however many its caller has.
fn config() -> Config {
    serde_json::from_value(json!({"state_file": "/x", "host": "db.lan",
                                  "allow": {"app": ["gitea"]}, "connection_limit": 1}))
    .unwrap()
}

fn made(config: &Config, entry: &str, password: Option<&str>, rotate: u64) -> Made {
    Made {
        entry: entry.into(),
        password: password.map(str::to_owned),
        rotate,
        connection_limit: i32::try_from(config.connection_limit.unwrap()).unwrap(),
        owed: false,
    }
}

#[test]
fn decisions_without_a_server() {
    let c = config();
    let mut state = State::default();
    state.roles.insert(
        "fort_app_kept".into(),
        made(&c, "app:postgres/kept", Some("pw"), 0),
    );
    state.roles.insert(
        "fort_app_forced".into(),
        made(&c, "app:postgres/forced", Some("pw"), 0),
    );
    state.roles.insert(
        "fort_app_rot".into(),
        made(&c, "app:postgres/rot", Some("pw"), 0),
    );
    state.roles.insert(
        "fort_app_back".into(),
        made(&c, "app:postgres/back", None, 0),
    );
    state.roles.insert(
        "fort_app_gone".into(),
        made(&c, "app:postgres/gone", Some("pw"), 0),
    );
    state
        .roles
        .insert("fort_app_old".into(), made(&c, "app:postgres/old", None, 0));
    let mut owed = made(&c, "app:postgres/owed", Some("pw"), 0);
    owed.owed = true;
    state.roles.insert("fort_app_owed".into(), owed);
    let kept = response(&c, "fort_app_kept", "pw");
    let input = json!({
        "app:postgres/kept": {"request": {}, "response": kept},
        "app:postgres/forced": {"request": {}, "response": null},
        "app:postgres/rot": {"request": {"rotate": 2}, "response": kept},
        "app:postgres/back": {"request": {}, "response": null},
        "app:postgres/owed": {"request": {}, "response": kept},
        "app:postgres/new": {"request": {"name": "gitea"}, "response": null},
        "web:postgres/new": {"request": {"name": "gitea"}, "response": null},
    });
    let entries = parse_input(input.to_string().as_bytes()).unwrap();
    let mut out = Reconciled {
        output: Output::default(),
        changed: false,
        counts: Counts::default(),
        failure: None,
    };
    let p = plan(&c, &state, &entries, &mut out);
    let whys: Vec<(&str, Why)> = p
        .work
        .iter()
        .map(|w| (entries[w.entry].key.as_str(), w.why))
        .collect();
    assert_eq!(
        whys,
        [
            ("app:postgres/back", Why::Reactivate),
            ("app:postgres/forced", Why::Rotate),
            ("app:postgres/new", Why::New),
            ("app:postgres/owed", Why::Rotate),
            ("app:postgres/rot", Why::Rotate),
        ]
    );
    assert_eq!(p.keep, [(2, "fort_app_kept".to_owned())]);
    // Only the role still able to log in is released; one released before stays so.
    assert_eq!(p.release, ["fort_app_gone"]);
    assert_eq!(out.counts.refused, 1);
    assert!(out.output.to_json()["web:postgres/new"]["$fort_refused"]
        .as_str()
        .unwrap()
        .contains("web may not have the database gitea"));
}

#[test]
fn a_callers_roles_share_its_connections() {
    let c: Config = serde_json::from_value(json!({"state_file": "/x", "host": "db.lan",
                                                   "connections_per_caller": 10}))
    .unwrap();
    // Made when each role had 20 (the limit before shares): a, and b whose change
    // is refused below but whose database stays in service.
    let mut state = State::default();
    for id in ["a", "b"] {
        let mut m = made(&config(), &format!("app:postgres/{id}"), Some("pw"), 0);
        m.connection_limit = 20;
        state.roles.insert(format!("fort_app_{id}"), m);
    }
    let held = response(&c, "fort_app_a", "pw");
    let input = json!({
        "app:postgres/a": {"request": {}, "response": held},
        "app:postgres/b": {"request": {"name": "gitea"}, "response": held},
        "app:postgres/c": {"request": {}, "response": null},
        "web:postgres/w": {"request": {}, "response": null},
    });
    let entries = parse_input(input.to_string().as_bytes()).unwrap();
    let mut out = Reconciled {
        output: Output::default(),
        changed: false,
        counts: Counts::default(),
        failure: None,
    };
    let p = plan(&c, &state, &entries, &mut out);
    let limit = |n: &str| p.limits[n];
    assert_eq!(
        [
            limit("fort_app_a"),
            limit("fort_app_b"),
            limit("fort_app_c")
        ],
        [4, 3, 3]
    );
    assert_eq!(limit("fort_web_w"), 10);
    assert_eq!(p.callers, 2);
    // The lowered limits come first, the refused entry's without an answer of its own.
    let work: Vec<(&str, Why, bool)> = p
        .work
        .iter()
        .map(|w| (w.name.as_str(), w.why, w.refused))
        .collect();
    assert_eq!(
        work,
        [
            ("fort_app_a", Why::Limit, false),
            ("fort_app_b", Why::Limit, true),
            ("fort_app_c", Why::New, false),
            ("fort_web_w", Why::New, false),
        ]
    );
    assert!(p.keep.is_empty());
}

#[test]
fn work_goes_by_turns_of_callers() {
    let items = vec!["a1", "a2", "a3", "b1", "c1", "c2"];
    let turns = by_turns(items, |s| &s[..1]);
    assert_eq!(turns, ["a1", "b1", "c1", "a2", "c2", "a3"]);
    assert!(by_turns(Vec::<&str>::new(), |s| s).is_empty());
}
