//! The postgres capability's bounds per caller against a real PostgreSQL: the server's
//! connections are shared by every caller (and by the handler's own role), so each
//! caller's roles share `connections_per_caller` between them, however many databases it
//! asks for.

use serde_json::{json, Value};

mod postgres_harness;
use postgres_harness::*;

/// Each role's `CONNECTION LIMIT`, by name, for roles starting with `prefix`.
fn limits(s: &Setup, prefix: &str) -> Vec<(String, u32)> {
    s.sql(&format!(
        "SELECT rolname, rolconnlimit FROM pg_roles WHERE starts_with(rolname, '{prefix}') ORDER BY 1"
    ))
    .lines()
    .map(|l| {
        let (name, n) = l.split_once('|').unwrap();
        (name.to_owned(), n.parse().unwrap())
    })
    .collect()
}

fn sum(limits: &[(String, u32)]) -> u32 {
    limits.iter().map(|(_, n)| n).sum()
}

/// `app` asks for three databases, `web` and `ops` for one each. `app`'s roles together
/// get its share (20 by default, then 4), not 20 each; with every connection of its
/// share held, the server refuses `app` another one while `web` and `ops` log in; the
/// limits follow the operator's setting and `app`'s releases without a new password.
#[test]
fn a_callers_databases_share_its_connections() {
    const TEST: &str = "a_callers_databases_share_its_connections";
    let Some(pg) = server(TEST) else { return };
    let s = Setup::new(pg, json!({}));
    let mut want = vec![
        ("app:postgres/d1", json!({})),
        ("app:postgres/d2", json!({})),
        ("app:postgres/d3", json!({})),
        ("ops:postgres/grafana", json!({})),
        ("web:postgres/wiki", json!({})),
    ];
    let (ok, first, notes) = s.run("request", &input(&want, &Value::Null));
    assert!(ok, "{notes}");
    let app = limits(&s, "fort_app_");
    assert_eq!(sum(&app), 20, "{app:?}");
    assert!(app.iter().all(|(_, n)| *n >= 6), "{app:?}");
    assert_eq!(limits(&s, "fort_web_"), [("fort_web_wiki".to_owned(), 20)]);
    // 200 connections, 3 for superusers and 1 for the handler's role: 60 fit.
    assert!(!notes.contains("max_connections"), "{notes}");

    s.set_config("connections_per_caller", json!(4));
    let second = s.ok("request", &input(&want, &first));
    assert_eq!(second, first, "a new limit is no new password");
    let app = limits(&s, "fort_app_");
    assert_eq!(sum(&app), 4, "{app:?}");
    assert_eq!(limits(&s, "fort_web_"), [("fort_web_wiki".to_owned(), 4)]);

    // app holds every connection its share allows ...
    let mut sessions = Vec::new();
    for (role, n) in &app {
        let key = format!("app:postgres/{}", role.trim_start_matches("fort_app_"));
        let cred = &first[&key];
        for _ in 0..*n {
            sessions.push(s.pg.session(
                cred["user"].as_str().unwrap(),
                cred["password"].as_str().unwrap(),
                cred["dbname"].as_str().unwrap(),
            ));
        }
    }
    // ... and gets no other, through any of its roles ...
    for key in ["app:postgres/d1", "app:postgres/d2", "app:postgres/d3"] {
        let refused = login(&s, &first[key], "SELECT 1").unwrap_err();
        assert!(refused.contains("too many connections"), "{key}: {refused}");
    }
    // ... while the other callers log in.
    for key in ["web:postgres/wiki", "ops:postgres/grafana"] {
        login(&s, &first[key], "SELECT 1").unwrap();
    }
    drop(sessions);
    // (A backend in pg_sleep does not notice its client is gone.)
    let sessions_of_app =
        "FROM pg_stat_activity WHERE starts_with(usename, 'fort_app_') AND pid <> pg_backend_pid()";
    s.sql(&format!(
        "SELECT count(pg_terminate_backend(pid)) {sessions_of_app}"
    ));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    while s.sql(&format!("SELECT count(*) {sessions_of_app}")) != "0" {
        assert!(
            std::time::Instant::now() < deadline,
            "app's sessions never ended"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }

    // Released: the two left share app's 4.
    want.retain(|(k, _)| *k != "app:postgres/d3");
    let third = s.ok("gc", &input(&want, &first));
    assert_eq!(third["app:postgres/d1"], first["app:postgres/d1"]);
    let app: Vec<(String, u32)> = limits(&s, "fort_app_")
        .into_iter()
        .filter(|(name, _)| name != "fort_app_d3")
        .collect();
    assert_eq!(app, [("fort_app_d1".into(), 2), ("fort_app_d2".into(), 2)]);

    // A refused change keeps d2's database in service, within the share: a new entry
    // of app's lowers its limit too.
    want.retain(|(k, _)| *k != "app:postgres/d2");
    want.push(("app:postgres/d2", json!({"name": "gitea"})));
    want.push(("app:postgres/d4", json!({})));
    let (ok, fourth, notes) = s.run("request", &input(&want, &third));
    assert!(ok, "{notes}");
    let why = fourth["app:postgres/d2"]["$fort_refused"].as_str().unwrap();
    assert!(why.contains("stays in service"), "{why}");
    let app: Vec<(String, u32)> = limits(&s, "fort_app_")
        .into_iter()
        .filter(|(name, _)| name != "fort_app_d3")
        .collect();
    assert_eq!(
        app,
        [
            ("fort_app_d1".into(), 2),
            ("fort_app_d2".into(), 1),
            ("fort_app_d4".into(), 1)
        ]
    );
    login(&s, &first["app:postgres/d2"], "SELECT 1").unwrap();

    // Shares that can add up to more than the server has: the run's notes say so.
    s.set_config("connections_per_caller", json!(80));
    let (ok, _, notes) = s.run("request", &input(&want, &third));
    assert!(ok, "{notes}");
    assert!(
        notes.contains("max_connections 200") && notes.contains("connections_per_caller"),
        "{notes}"
    );
}
