//! Two postgres providers in front of one PostgreSQL server, as a need that names both
//! moves between them (docs/protocol.md §11.13): the standby takes over what the home
//! made for that entry, and nothing else, with a new password and the data kept; the old
//! home, back, leaves the role it no longer serves alone, however it is run; asked to
//! renew, a provider takes the role back. Handler runs fed by hand; the fleet with real
//! agents and `kill -9` is in `postgres_fleet_failover.rs`.

use std::path::PathBuf;

use serde_json::{json, Value};

mod postgres_harness;
use postgres_harness::*;

/// A second provider on the server of `s` (whose own provider is `db`).
struct Peer {
    host: &'static str,
    config: PathBuf,
}

impl Peer {
    fn new(s: &Setup, host: &'static str, extra: Value) -> Peer {
        let mut config = json!({
            "state_file": s.dir.path().join(format!("state/{host}.json")),
            "host": "127.0.0.1",
            "socket_dir": s.pg.socket_dir(),
            "port": s.pg.port,
            "admin_role": fort_tests::postgres::ADMIN,
        });
        for (k, v) in extra.as_object().unwrap() {
            config[k] = v.clone();
        }
        let path = s.dir.path().join(format!("{host}.json"));
        std::fs::write(&path, config.to_string()).unwrap();
        Peer { host, config: path }
    }

    fn run(&self, trigger: &str, input: &Value) -> (bool, Value, String) {
        fort_tests::run_handler(
            "postgres",
            &self.config,
            trigger,
            &[("FORT_HOST", self.host)],
            input,
        )
    }

    fn ok(&self, trigger: &str, input: &Value) -> Value {
        let (ok, out, err) = self.run(trigger, input);
        assert!(ok, "{} failed: {err}", self.host);
        out
    }
}

fn comment(s: &Setup, role: &str) -> String {
    s.sql(&format!(
        "SELECT shobj_description(oid, 'pg_authid') FROM pg_roles WHERE rolname = '{role}'"
    ))
}

#[test]
fn a_standby_takes_over_only_what_the_home_made_for_that_entry() {
    const TEST: &str = "a_standby_takes_over_only_what_the_home_made_for_that_entry";
    let Some(pg) = server(TEST) else { return };
    // `db` and `db2` share the server and list each other; `db3` makes roles there too,
    // but neither lists it.
    let s = Setup::new(pg, json!({"peers": ["db2"], "allow": {"web": ["shared"]}}));
    let db2 = Peer::new(
        &s,
        "db2",
        json!({"peers": ["db"], "allow": {"app": ["shared"]}}),
    );
    let db3 = Peer::new(&s, "db3", json!({"name_prefix": "fort"}));

    // The home, db, serves app and web.
    let want = [
        ("app:postgres/wiki", json!({})),
        ("web:postgres/wiki", json!({})),
        ("web:postgres/files", json!({"name": "shared"})),
    ];
    let home = s.ok("request", &input(&want, &Value::Null));
    let app1 = home["app:postgres/wiki"].clone();
    login(
        &s,
        &app1,
        "CREATE TABLE notes (t text); INSERT INTO notes VALUES ('kept')",
    )
    .unwrap();

    // app's need moves to db2: a new entry there, whose role db made for that same entry.
    let moved = [("app:postgres/wiki", json!({}))];
    let (ok, standby, notes) = db2.run("request", &input(&moved, &Value::Null));
    assert!(ok, "{notes}");
    assert!(notes.contains("1 taken over from peers"), "{notes}");
    let app2 = standby["app:postgres/wiki"].clone();
    assert_eq!(app2["dbname"], "fort_app_wiki", "{standby}");
    assert_ne!(app2["password"], app1["password"], "a new password");
    assert_eq!(login(&s, &app2, "SELECT t FROM notes").unwrap(), "kept");
    assert!(login(&s, &app1, "SELECT 1").is_err(), "the home's password");
    assert!(comment(&s, "fort_app_wiki").starts_with("made by fort on db2 for app:postgres/wiki"));
    assert!(s
        .sql("SELECT shobj_description(oid, 'pg_database') FROM pg_database WHERE datname = 'fort_app_wiki'")
        .starts_with("made by fort on db2 for app:postgres/wiki"));

    // What db made for another entry is never taken over, whatever name is asked for.
    // (Every run of db2 holds all its entries, as the agent runs it.)
    let mut at_db2 = vec![
        ("app:postgres/wiki", json!({})),
        ("app:postgres/files", json!({"name": "shared"})),
    ];
    let out = db2.ok("request", &input(&at_db2, &standby));
    assert_eq!(out["app:postgres/wiki"], app2);
    let why = out["app:postgres/files"]["$fort_refused"]
        .as_str()
        .unwrap_or_default();
    assert!(
        why.contains("role shared exists and was not made by fort for this entry"),
        "{out}"
    );
    assert!(comment(&s, "shared").starts_with("made by fort on db for web:postgres/files"));
    // Nor what a provider that is not a peer made, for the very same entry.
    let web = [("web:postgres/wiki", json!({}))];
    let out = db3.ok("request", &input(&web, &Value::Null));
    assert!(
        out["web:postgres/wiki"]["$fort_refused"].is_string(),
        "{out}"
    );
    at_db2.push(("ops:postgres/wiki", json!({})));
    let db2_out = db2.ok("request", &input(&at_db2, &standby));
    assert_eq!(
        db2_out["ops:postgres/wiki"]["dbname"], "fort_ops_wiki",
        "{db2_out}"
    );
    let db3_made = [("ops:postgres/wiki", json!({}))];
    let out = db3.ok("request", &input(&db3_made, &Value::Null));
    assert!(
        out["ops:postgres/wiki"]["$fort_refused"].is_string(),
        "{out}"
    );

    // db back with its entries as they were: its start (initialize) finds app's role
    // taken over, answers no password and touches nothing; web keeps its own.
    let out = s.ok("initialize", &input(&want, &home));
    let pending = out["app:postgres/wiki"]["$fort_pending"]
        .as_str()
        .unwrap_or_default();
    assert!(pending.contains("db2 took this database over"), "{out}");
    assert_eq!(out["web:postgres/wiki"], home["web:postgres/wiki"]);
    assert_eq!(login(&s, &app2, "SELECT t FROM notes").unwrap(), "kept");
    // A request run over the same entries says the same: the old password is never
    // answered again.
    let out = s.ok("request", &input(&want, &home));
    assert!(
        out["app:postgres/wiki"]["$fort_pending"].is_string(),
        "{out}"
    );

    // The need moves back to db, which is asked to renew: it takes the role back.
    let mut back = input(&want, &home);
    back["app:postgres/wiki"]["renew"] = json!(true);
    let out = s.ok("request", &back);
    let app3 = out["app:postgres/wiki"].clone();
    assert!(app3["password"].is_string(), "{out}");
    assert_ne!(app3["password"], app2["password"], "{out}");
    assert_eq!(login(&s, &app3, "SELECT t FROM notes").unwrap(), "kept");
    assert!(login(&s, &app2, "SELECT 1").is_err());

    // db2 releases the entry it no longer serves (its GC): the role db serves stays.
    let (ok, _, notes) = db2.run("gc", &input(&[("ops:postgres/wiki", json!({}))], &db2_out));
    assert!(ok, "{notes}");
    assert_eq!(login(&s, &app3, "SELECT t FROM notes").unwrap(), "kept");
    assert_eq!(
        s.sql("SELECT rolcanlogin FROM pg_roles WHERE rolname = 'fort_app_wiki'"),
        "t"
    );
    let state: Value =
        serde_json::from_slice(&std::fs::read(s.dir.path().join("state/db2.json")).unwrap())
            .unwrap();
    assert!(state.to_string().contains("fort_ops_wiki"), "{state}");
    assert!(
        !state.to_string().contains("fort_app_wiki"),
        "forgotten: {state}"
    );
}
