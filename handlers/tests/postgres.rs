//! The postgres capability against a real PostgreSQL: handler runs fed by hand (stdin →
//! stdout) for what a user of the server sees: logins with the delivered password,
//! rotation, release keeping the data, refusals, hostile names, roles made by hand, lost
//! state, drift and a server that is down. The whole fleet (real agents) is in
//! `postgres_fleet.rs`.

use fort_handlers::postgres::names;
use fort_tests::postgres::PASSWORD_ADMIN;
use serde_json::{json, Value};

mod postgres_harness;
use postgres_harness::*;

#[test]
fn credentials_log_in_rotate_and_release_keeps_the_data() {
    let Some(pg) = server("credentials_log_in_rotate_and_release_keeps_the_data") else {
        return;
    };
    let s = Setup::new(pg, json!({}));
    // A role and a database made by hand, beside the handler's, with a name it would
    // never derive: it must come through every run untouched.
    s.sql("CREATE ROLE legacy LOGIN PASSWORD 'legacy-pw'");
    s.sql("CREATE DATABASE legacy OWNER legacy");

    let want = [
        ("app:postgres/wiki", json!({})),
        ("web:postgres/wiki", json!({})),
    ];
    let first = s.ok("request", &input(&want, &Value::Null));
    let app = &first["app:postgres/wiki"];
    let web = &first["web:postgres/wiki"];
    assert_eq!(app["dbname"], "fort_app_wiki");
    assert_eq!(app["user"], "fort_app_wiki");
    assert_eq!(app["host"], "127.0.0.1");
    assert_eq!(app["port"], s.pg.port);
    assert_eq!(web["dbname"], "fort_web_wiki", "two hosts, one need id");
    login(
        &s,
        app,
        "CREATE TABLE notes (t text); INSERT INTO notes VALUES ('kept')",
    )
    .unwrap();
    assert_eq!(
        s.pg.login_uri(app["uri"].as_str().unwrap(), "SELECT t FROM notes")
            .unwrap(),
        "kept"
    );
    // web cannot reach app's database, with its own password or app's.
    let web_into_app = s.pg.login(
        web["user"].as_str().unwrap(),
        web["password"].as_str().unwrap(),
        "fort_app_wiki",
        "SELECT 1",
    );
    assert!(web_into_app.is_err(), "{web_into_app:?}");
    // The server holds a SCRAM verifier, never the password.
    let stored = s.sql("SELECT rolpassword FROM pg_authid WHERE rolname = 'fort_app_wiki'");
    assert!(stored.starts_with("SCRAM-SHA-256$4096:"), "{stored}");
    assert!(!stored.contains(app["password"].as_str().unwrap()));
    let mode = std::os::unix::fs::MetadataExt::mode(&std::fs::metadata(s.state_file()).unwrap());
    assert_eq!(mode & 0o777, 0o600);

    // The same input again: the same answers.
    let again = s.ok("request", &input(&want, &first));
    assert_eq!(again, first);

    // `--force` (no cached response): a new password; the old one stops working.
    let forced = s.ok("manual", &input(&want, &json!({"web:postgres/wiki": web})));
    let app2 = &forced["app:postgres/wiki"];
    assert_ne!(app2["password"], app["password"]);
    assert_eq!(
        forced["web:postgres/wiki"], *web,
        "web kept its cached password"
    );
    assert!(
        login(&s, app, "SELECT 1").is_err(),
        "the old password still works"
    );
    assert_eq!(login(&s, app2, "SELECT t FROM notes").unwrap(), "kept");

    // A raised `rotate` in the request: another new password.
    let want = [
        ("app:postgres/wiki", json!({"rotate": 1})),
        ("web:postgres/wiki", json!({})),
    ];
    let rotated = s.ok("request", &input(&want, &forced));
    let app3 = &rotated["app:postgres/wiki"];
    assert_ne!(app3["password"], app2["password"]);
    assert!(login(&s, app2, "SELECT 1").is_err());
    assert_eq!(login(&s, app3, "SELECT t FROM notes").unwrap(), "kept");
    assert_eq!(
        s.ok("request", &input(&want, &rotated)),
        rotated,
        "rotate stays put"
    );

    // Released (app's entry leaves the input): no login, the data stays.
    let want = [("web:postgres/wiki", json!({}))];
    let released = s.ok("gc", &input(&want, &rotated));
    assert_eq!(released.as_object().unwrap().len(), 1);
    let refused = login(&s, app3, "SELECT 1").unwrap_err();
    assert!(
        refused.contains("not permitted to log in") || refused.contains("authentication failed"),
        "{refused}"
    );
    assert_eq!(
        s.pg.superuser_in("fort_app_wiki", "SELECT t FROM notes")
            .unwrap(),
        "kept"
    );
    assert_eq!(
        s.sql("SELECT rolcanlogin FROM pg_roles WHERE rolname = 'fort_app_wiki'"),
        "f"
    );
    // Asked for again: the same database, a new password, the data still there.
    let want = [
        ("app:postgres/wiki", json!({"rotate": 1})),
        ("web:postgres/wiki", json!({})),
    ];
    let back = s.ok("request", &input(&want, &released));
    let app4 = &back["app:postgres/wiki"];
    assert_eq!(app4["dbname"], "fort_app_wiki");
    assert_ne!(app4["password"], app3["password"]);
    assert_eq!(login(&s, app4, "SELECT t FROM notes").unwrap(), "kept");

    // The hand-made role came through all of it.
    assert_eq!(
        s.pg.login("legacy", "legacy-pw", "legacy", "SELECT current_user")
            .unwrap(),
        "legacy"
    );
}

#[test]
fn refusals_hostile_names_and_hand_made_roles() {
    let Some(pg) = server("refusals_hostile_names_and_hand_made_roles") else {
        return;
    };
    let s = Setup::new(
        pg,
        json!({"allow": {"app": ["gitea", "legacy"], "*": ["{origin}-own"]}}),
    );
    s.sql("CREATE ROLE legacy LOGIN PASSWORD 'legacy-pw'");
    s.sql("CREATE DATABASE legacy OWNER legacy");
    // A hand-made role under a name the handler would derive: never taken over.
    s.sql("CREATE ROLE fort_ops_taken LOGIN PASSWORD 'ops-pw'");
    let before = s.roles("");

    let want = [
        ("app:postgres/named", json!({"name": "gitea"})),
        ("app:postgres/old", json!({"name": "legacy"})),
        ("app:postgres/own", json!({"name": "app-own"})),
        ("web:postgres/steal", json!({"name": "gitea"})),
        ("web:postgres/own", json!({"name": "app-own"})),
        ("web:postgres/prefix", json!({"name": "fort_app_wiki"})),
        (
            "web:postgres/inject",
            json!({"name": "x\"; DROP ROLE legacy; --"}),
        ),
        ("web:postgres/bad", json!({"rotate": -1})),
        ("web:postgres/extra", json!({"superuser": true})),
        ("ops:postgres/taken", json!({})),
        ("x\"; DROP ROLE legacy; --:postgres/evil", json!({})),
        ("web:postgres/fine", json!({})),
    ];
    let out = s.ok("request", &input(&want, &Value::Null));
    let reason = |k: &str| out[k]["$fort_refused"].as_str().unwrap_or("").to_owned();
    assert_eq!(out["app:postgres/named"]["dbname"], "gitea");
    assert_eq!(out["app:postgres/own"]["dbname"], "app-own");
    assert!(reason("app:postgres/old").contains("role legacy exists and was not made by fort"));
    assert!(reason("web:postgres/steal").contains("web may not have the database gitea"));
    assert!(reason("web:postgres/own").contains("may not have the database app-own"));
    assert!(reason("web:postgres/prefix").contains("derived names"));
    assert!(reason("web:postgres/inject").contains("request.name"));
    assert!(reason("web:postgres/bad").contains("request"));
    assert!(reason("web:postgres/extra").contains("unknown field"));
    assert!(reason("ops:postgres/taken").contains("fort_ops_taken exists and was not made by fort"));
    assert!(reason("x\"; DROP ROLE legacy; --:postgres/evil").contains("not a fort host"));
    assert_eq!(out["web:postgres/fine"]["dbname"], "fort_web_fine");
    for (k, _) in &want {
        let v = &out[*k];
        assert!(
            v.get("$fort_refused").is_some() || v.get("password").is_some(),
            "{k}: {v}"
        );
    }
    login(&s, &out["app:postgres/own"], "SELECT 1").unwrap();

    // Exactly three roles more; every hand-made one as it was, and still able to log in.
    let mut expected = before.clone();
    expected.extend(["app-own", "fort_web_fine", "gitea"].map(String::from));
    expected.sort();
    assert_eq!(s.roles(""), expected);
    assert_eq!(
        s.pg.login("legacy", "legacy-pw", "legacy", "SELECT 1")
            .unwrap(),
        "1"
    );
    assert_eq!(
        s.pg.login("fort_ops_taken", "ops-pw", "postgres", "SELECT 1")
            .unwrap(),
        "1"
    );

    // Everything released with `drop` as the policy: the handler's own roles and
    // databases go, the hand-made ones stay.
    std::fs::write(&s.config, {
        let mut c: Value = serde_json::from_slice(&std::fs::read(&s.config).unwrap()).unwrap();
        c["on_release"] = json!("drop");
        c.to_string()
    })
    .unwrap();
    s.ok("gc", &json!({}));
    assert_eq!(s.roles(""), before);
    assert_eq!(s.sql("SELECT count(*) FROM pg_database WHERE datname IN ('gitea', 'app-own', 'fort_web_fine')"), "0");
    assert_eq!(
        s.sql("SELECT count(*) FROM pg_database WHERE datname = 'legacy'"),
        "1"
    );
}

#[test]
fn quoting_reads_back_as_written() {
    let Some(pg) = server("quoting_reads_back_as_written") else {
        return;
    };
    let hostile = [
        "plain",
        "Mixed Case",
        "quote\"inside",
        "it's",
        "back\\slash",
        "both'\\\"",
        "'; DROP ROLE fort_admin; --",
        "\"; DROP ROLE fort_admin; --",
        "ünïcödé ✓",
        "$$dollar$$",
        "new\nline",
    ];
    for text in hostile {
        let lit = names::quote_literal(text).unwrap();
        let ident = names::quote_ident(text).unwrap();
        // A literal reads back as exactly the text, with either setting of
        // standard_conforming_strings.
        for scs in ["on", "off"] {
            let got = pg
                .superuser(&format!(
                    "SET standard_conforming_strings = {scs}; SELECT encode(convert_to({lit}, 'UTF8'), 'hex')"
                ))
                .unwrap();
            assert_eq!(got, hex(text.as_bytes()), "{text:?} with scs {scs}");
        }
        // An identifier names exactly one role of exactly that name.
        pg.superuser(&format!("CREATE ROLE {ident} NOLOGIN"))
            .unwrap();
        let got = pg
            .superuser(&format!(
                "SELECT encode(convert_to(rolname::text, 'UTF8'), 'hex') FROM pg_roles WHERE rolname = {lit}"
            ))
            .unwrap();
        assert_eq!(got, hex(text.as_bytes()), "{text:?}");
        pg.superuser(&format!("DROP ROLE {ident}")).unwrap();
    }
    assert_eq!(
        pg.superuser("SELECT count(*) FROM pg_roles WHERE rolname = 'fort_admin'")
            .unwrap(),
        "1"
    );
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn unchanged_entries_need_no_server_and_a_down_server_fails_the_run() {
    let Some(pg) = server("unchanged_entries_need_no_server_and_a_down_server_fails_the_run")
    else {
        return;
    };
    let s = Setup::new(pg, json!({}));
    let want: Vec<(String, Value)> = (0..8)
        .map(|i| (format!("app:postgres/db{i}"), json!({})))
        .collect();
    let want: Vec<(&str, Value)> = want.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    let first = s.ok("request", &input(&want, &Value::Null));
    let state = std::fs::read(s.state_file()).unwrap();

    s.pg.stop().unwrap();
    // Every entry unchanged: answered from the state, no connection attempted.
    let (ok, out, err) = s.run("request", &input(&want, &first));
    assert!(ok, "{err}");
    assert_eq!(out, first);
    // One entry without a response (a forced run) needs the server: the run fails and
    // nothing is revoked or forgotten.
    let mut partial = first.clone();
    partial.as_object_mut().unwrap().remove("app:postgres/db3");
    let (ok, _, err) = s.run("request", &input(&want, &partial));
    assert!(!ok);
    assert!(err.contains("cannot connect to PostgreSQL"), "{err}");
    assert!(!err.contains(first["app:postgres/db0"]["password"].as_str().unwrap()));
    // A released entry while the server is down: the run fails; the role is still ours.
    let (ok, _, _) = s.run("gc", &input(&want[1..], &first));
    assert!(!ok);
    assert_eq!(std::fs::read(s.state_file()).unwrap(), state);

    s.pg.start_again().unwrap();
    let out = s.ok("request", &input(&want, &partial));
    assert_ne!(
        out["app:postgres/db3"]["password"],
        first["app:postgres/db3"]["password"]
    );
    assert_eq!(out["app:postgres/db4"], first["app:postgres/db4"]);
    login(&s, &out["app:postgres/db3"], "SELECT 1").unwrap();
}

#[test]
fn lost_state_drift_budget_and_a_password_admin() {
    let Some(pg) = server("lost_state_drift_budget_and_a_password_admin") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("admin-password");
    std::fs::write(&secret, "admin-secret\n").unwrap();
    let s = Setup::new(
        pg,
        json!({"admin_role": PASSWORD_ADMIN, "admin_password_file": secret, "connection_limit": 5}),
    );
    let want = [
        ("app:postgres/wiki", json!({})),
        ("app:postgres/blog", json!({})),
    ];
    let first = s.ok("request", &input(&want, &Value::Null));
    assert_eq!(
        s.sql("SELECT rolconnlimit FROM pg_roles WHERE rolname = 'fort_app_wiki'"),
        "5"
    );

    // The state file is lost: the marked roles are recognised and answered again (new
    // passwords: the old ones are not known any more), nothing is duplicated.
    std::fs::remove_file(s.state_file()).unwrap();
    let adopted = s.ok("request", &input(&want, &first));
    assert_ne!(
        adopted["app:postgres/wiki"]["password"],
        first["app:postgres/wiki"]["password"]
    );
    login(&s, &adopted["app:postgres/wiki"], "SELECT 1").unwrap();
    assert_eq!(s.roles("fort_app_"), ["fort_app_blog", "fort_app_wiki"]);

    // Dropped by hand: a request run does not look (no server call for unchanged
    // entries); an initialize run finds it and puts it back with the same password.
    s.sql("DROP DATABASE fort_app_blog");
    s.sql("DROP ROLE fort_app_blog");
    assert_eq!(s.ok("request", &input(&want, &adopted)), adopted);
    assert_eq!(s.ok("initialize", &input(&want, &adopted)), adopted);
    login(&s, &adopted["app:postgres/blog"], "SELECT 1").unwrap();

    // A budget too small for the work: the rest is pending, and later runs finish it.
    let mut c: Value = serde_json::from_slice(&std::fs::read(&s.config).unwrap()).unwrap();
    c["run_budget"] = json!("150ms");
    std::fs::write(&s.config, c.to_string()).unwrap();
    let many: Vec<(String, Value)> = (0..24)
        .map(|i| (format!("web:postgres/n{i:03}"), json!({})))
        .collect();
    let many: Vec<(&str, Value)> = many.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    // (app's two entries are not in this input: they are released on the way.)
    let mut answers = Value::Null;
    let mut runs = 0;
    let mut waited = 0;
    loop {
        runs += 1;
        let out = s.ok("request", &input(&many, &answers));
        let pending = out
            .as_object()
            .unwrap()
            .values()
            .filter(|v| v.get("$fort_pending").is_some())
            .count();
        waited += pending;
        // Keep the answers the agent would keep: responses only.
        let mut kept = answers.as_object().cloned().unwrap_or_default();
        for (k, v) in out.as_object().unwrap() {
            if v.get("password").is_some() {
                kept.insert(k.clone(), v.clone());
            }
        }
        answers = Value::Object(kept);
        if out.get("$fort_rerun_after").is_none() {
            assert_eq!(pending, 0, "pending entries without a rerun");
            break;
        }
        assert_eq!(out["$fort_rerun_after"], 1);
        assert!(runs < 60, "never finished");
    }
    assert_eq!(answers.as_object().unwrap().len(), 24);
    assert!(
        waited > 0,
        "24 databases in one run of 150 ms: the budget was not tested"
    );
    assert_eq!(
        s.sql("SELECT count(*) FROM pg_roles WHERE rolname LIKE 'fort\\_app\\_%' AND rolcanlogin"),
        "0"
    );
}

/// A consumer connects, with the credentials it was given, to every database it may
/// (template1 included, which PUBLIC may connect to) and holds the sessions open. Two
/// other callers' databases are made in the same run, quickly; the consumer's own entry
/// is answered as before.
#[test]
fn a_consumers_sessions_hold_back_no_other_callers_database() {
    const TEST: &str = "a_consumers_sessions_hold_back_no_other_callers_database";
    let Some(pg) = server(TEST) else { return };
    let s = Setup::new(pg, json!({}));
    let attacker = ("app:postgres/db", json!({}));
    let first = s.ok(
        "request",
        &input(std::slice::from_ref(&attacker), &Value::Null),
    );
    let cred = &first["app:postgres/db"];
    let (user, password) = (
        cred["user"].as_str().unwrap(),
        cred["password"].as_str().unwrap(),
    );
    let mut sessions = Vec::new();
    for db in ["template1", "postgres", "fort_app_db"] {
        sessions.push(s.pg.session(user, password, db));
    }

    let want = [
        attacker,
        ("web:postgres/wiki", json!({})),
        ("ops:postgres/grafana", json!({})),
    ];
    let started = std::time::Instant::now();
    let out = s.ok("request", &input(&want, &first));
    let took = started.elapsed();
    for key in ["web:postgres/wiki", "ops:postgres/grafana"] {
        assert!(out[key]["password"].is_string(), "{key}: {out}");
        login(&s, &out[key], "SELECT 1").unwrap();
    }
    assert_eq!(out["app:postgres/db"], first["app:postgres/db"]);
    // Creating a database from a template someone is connected to waits 5 s, then fails.
    assert!(took < std::time::Duration::from_secs(5), "{took:?}");
    drop(sessions);
}

/// A caller whose consumer holds a lock on each of its own roles (a transaction that
/// changed its own password and stays open) and raises `rotate` on every request: each
/// of its entries makes the handler wait for the lock. Its first entry costs the run one
/// lock wait and its others wait for a later run; two other callers' new databases are
/// made in the same run, within its budget.
#[test]
fn a_caller_holding_locks_on_its_own_roles_holds_back_no_other_caller() {
    const TEST: &str = "a_caller_holding_locks_on_its_own_roles_holds_back_no_other_caller";
    let Some(pg) = server(TEST) else { return };
    let s = Setup::new(pg, json!({"run_budget": "12s"}));
    let attacker: Vec<(String, Value)> = (1..=4)
        .map(|i| (format!("app:postgres/a{i}"), json!({})))
        .collect();
    let keys: Vec<(&str, Value)> = attacker
        .iter()
        .map(|(k, r)| (k.as_str(), r.clone()))
        .collect();
    let first = s.ok("request", &input(&keys, &Value::Null));
    let mut sessions = Vec::new();
    for (key, _) in &keys {
        let cred = &first[*key];
        let (user, password) = (
            cred["user"].as_str().unwrap(),
            cred["password"].as_str().unwrap(),
        );
        sessions.push(s.pg.session_holding(
            user,
            password,
            user,
            &format!("ALTER ROLE {user} PASSWORD 'held-by-the-consumer'"),
        ));
    }

    let mut want: Vec<(&str, Value)> = keys
        .iter()
        .map(|(k, _)| (*k, json!({"rotate": 1})))
        .collect();
    want.push(("ops:postgres/grafana", json!({})));
    want.push(("web:postgres/wiki", json!({})));
    let started = std::time::Instant::now();
    let out = s.ok("request", &input(&want, &first));
    let took = started.elapsed();
    for key in ["web:postgres/wiki", "ops:postgres/grafana"] {
        assert!(out[key]["password"].is_string(), "{key}: {out}");
        login(&s, &out[key], "SELECT 1").unwrap();
    }
    // One lock wait (5 s) for the caller, not one per entry.
    assert!(took < std::time::Duration::from_secs(9), "{took:?}");
    let waited = out["app:postgres/a1"]["$fort_pending"]
        .as_str()
        .unwrap_or_default();
    assert!(waited.contains("lock"), "{out}");
    for key in ["app:postgres/a2", "app:postgres/a3", "app:postgres/a4"] {
        let why = out[key]["$fort_pending"].as_str().unwrap_or_default();
        assert!(why.contains("app"), "{key}: {out}");
    }
    drop(sessions);
}

/// With a state key (docs/at-rest.md) the handler's state is sealed: no file it keeps
/// holds the password it handed out; a second run over the sealed state keeps the
/// credential (no rotation, the login works); a changed file is refused before anything
/// at the server changes.
#[test]
fn sealed_state_holds_no_password_keeps_the_login_and_a_changed_file_touches_nothing() {
    let test = "sealed_state_holds_no_password_keeps_the_login_and_a_changed_file_touches_nothing";
    let Some(pg) = server(test) else {
        return;
    };
    let mut s = Setup::new(pg, json!({}));
    s.state_key = Some(fort_tests::state_key_file(&s.dir.path().join("state-key")));
    let want = [("app:postgres/wiki", json!({}))];
    let first = s.ok("request", &input(&want, &Value::Null));
    let cred = &first["app:postgres/wiki"];
    let password = cred["password"].as_str().unwrap();
    login(
        &s,
        cred,
        "CREATE TABLE notes (t text); INSERT INTO notes VALUES ('kept')",
    )
    .unwrap();
    let state_dir = s.dir.path().join("state");
    assert!(fort_core::sealed::is_sealed(
        &std::fs::read(s.state_file()).unwrap()
    ));
    assert_eq!(
        fort_tests::files_holding(&state_dir, password.as_bytes()),
        Vec::<std::path::PathBuf>::new(),
        "the password is readable from a copy of the state"
    );

    // Over the sealed state: the same credential, and it still logs in.
    let verifier = || s.sql("SELECT rolpassword FROM pg_authid WHERE rolname = 'fort_app_wiki'");
    let before = verifier();
    let again = s.ok("request", &input(&want, &first));
    assert_eq!(again, first, "no rotation");
    assert_eq!(verifier(), before);
    assert_eq!(login(&s, cred, "SELECT t FROM notes").unwrap(), "kept");

    // A changed state file: the run fails naming it, and the server is as it was. (The
    // run has no cached response: read, it would have rotated the password.)
    fort_tests::change_sealed_member(&s.state_file(), "data");
    let changed = std::fs::read(s.state_file()).unwrap();
    let (ok, out, err) = s.run("manual", &input(&want, &Value::Null));
    assert!(!ok, "a run on a changed state file succeeded: {out}");
    assert!(
        err.contains("authentication of the sealed contents failed")
            && err.contains(&s.state_file().display().to_string()),
        "{err}"
    );
    assert_eq!(verifier(), before, "the server was changed");
    assert_eq!(s.roles("fort_app"), ["fort_app_wiki"]);
    assert_eq!(login(&s, cred, "SELECT t FROM notes").unwrap(), "kept");
    assert_eq!(
        std::fs::read(s.state_file()).unwrap(),
        changed,
        "the file stays"
    );
}
