//! A postgres need served by two provider agents in front of one PostgreSQL server
//! (docs/protocol.md §11.13, docs/handlers.md "How it fails over"), with real agents on
//! loopback: the home killed with `kill -9` while the need comes due, the standby takes
//! the consumer's database over with a new password that logs in with `psql` and finds
//! the data, the consumer's files change once; the home back releases its entry and
//! leaves the database the standby serves in service.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use fort_tests::postgres::{Postgres, ADMIN};
use fort_tests::{eventually, Fleet};
use serde_json::{json, Value};

const TEST: &str = "the_standby_takes_the_database_over_when_the_home_is_killed";
const NEED: &str = "postgres/wiki";

fn read(f: &Fleet, name: &str) -> String {
    std::fs::read_to_string(f.dir.path().join(format!("run/app/{name}"))).unwrap_or_default()
}

/// `host`'s capability: fort-handler postgres on `pg`, naming `peer` as its peer.
fn provider(f: &mut Fleet, pg: &Postgres, host: &str, peer: &str) {
    let dir: &Path = f.dir.path();
    let config: PathBuf = dir.join(format!("postgres-{host}.json"));
    std::fs::write(
        &config,
        json!({
            "state_file": dir.join(format!("handler-state/{host}.json")),
            "host": "127.0.0.1",
            "socket_dir": pg.socket_dir(),
            "port": pg.port,
            "admin_role": ADMIN,
            "peers": [peer],
        })
        .to_string(),
    )
    .unwrap();
    f.capability(
        host,
        "postgres",
        json!({"handler": fort_tests::bin("fort-handler"), "args": ["postgres", "--config", config],
               "mode": "async", "cacheResponse": true}),
    );
    // Sweeps only when asked (`fort-agent gc`), with a short grace.
    f.host(host).extra_toml = "[gc]\ninterval = \"0s\"\ngrace = \"1s\"\ntimeout = \"3s\"\n".into();
}

fn consumer(f: &mut Fleet, request: Value) {
    let dir = f.dir.path().join("run/app");
    f.need_from(
        "app",
        NEED,
        &["db1", "db2"],
        json!({"nag_seconds": 2, "failover_after_seconds": 4, "request": request,
               "files": fort_tests::pointer_files(&dir, &["password", "user", "dbname"])}),
    );
    f.host("app").extra_toml = "[fulfill]\nbackoff = \"1s\"\ntimeout = \"3s\"\n".into();
}

fn login(pg: &Postgres, f: &Fleet, sql: &str) -> Result<String, String> {
    pg.login(
        &read(f, "user"),
        &read(f, "password"),
        &read(f, "dbname"),
        sql,
    )
}

fn row(f: &Fleet) -> Value {
    f.need_status("app", NEED)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_standby_takes_the_database_over_when_the_home_is_killed() {
    let pg = match Postgres::start(false) {
        Ok(pg) => pg,
        Err(reason) => return fort_tests::skip(TEST, &reason),
    };
    let mut f = Fleet::new();
    provider(&mut f, &pg, "db1", "db2");
    provider(&mut f, &pg, "db2", "db1");
    consumer(&mut f, json!({}));
    f.start();
    assert!(
        eventually(Duration::from_secs(60), || f.all_satisfied("app")).await,
        "{}",
        f.status("app")["needs"]
    );
    assert_eq!(row(&f)["from"], "db1");
    assert_eq!(read(&f, "dbname"), "fort_app_wiki");
    login(
        &pg,
        &f,
        "CREATE TABLE notes (t text); INSERT INTO notes VALUES ('kept')",
    )
    .unwrap();
    let first = read(&f, "password");
    assert!(
        f.entries("db2").is_empty(),
        "the standby never heard of app"
    );

    // The home dies; then app asks for a new password: the need is due, the home
    // fails, and after failover_after the need moves to db2.
    f.kill("db1");
    let killed = Instant::now();
    f.host("app").needs.get_mut(NEED).unwrap()["request"] = json!({"rotate": 1});
    f.write_files();
    f.agents["app"].hup();
    // Every password the files held on the way, to count the consumer's changes.
    let mut seen = vec![first.clone()];
    let served = eventually(Duration::from_secs(60), || {
        let now = read(&f, "password");
        if !now.is_empty() && seen.last() != Some(&now) {
            seen.push(now);
        }
        row(&f)["from"] == "db2" && row(&f)["state"] == "satisfied"
    })
    .await;
    assert!(served, "not served by db2: {}", row(&f));
    eprintln!(
        "served by the standby {:?} after the kill",
        killed.elapsed()
    );
    let now = read(&f, "password");
    if seen.last() != Some(&now) {
        seen.push(now.clone());
    }
    assert_eq!(
        seen.len(),
        2,
        "the files changed once: {} passwords",
        seen.len()
    );
    assert_ne!(now, first);
    assert_eq!(login(&pg, &f, "SELECT t FROM notes").unwrap(), "kept");
    assert!(
        pg.login("fort_app_wiki", &first, "fort_app_wiki", "SELECT 1")
            .is_err(),
        "the home's password still works"
    );
    let st = row(&f);
    assert_eq!(st["moves"], 1, "{st}");
    assert!(
        st["moved_because"]
            .as_str()
            .unwrap_or_default()
            .starts_with("db1 failing since"),
        "{st}"
    );
    let mark = |db: &str| {
        pg.superuser(&format!(
            "SELECT shobj_description(oid, 'pg_authid') FROM pg_roles WHERE rolname = '{db}'"
        ))
        .unwrap()
    };
    assert!(mark("fort_app_wiki").starts_with("made by fort on db2 for app:postgres/wiki"));

    // db1 comes back: its GC releases the entry the needs list says db2 serves, and its
    // handler leaves the role and the database alone.
    f.start_host("db1");
    assert!(
        eventually(Duration::from_secs(60), || {
            let (ok, out) = f.admin("db1", &["gc"]);
            assert!(ok, "{out}");
            !f.entries("db1").iter().any(|e| e == &format!("app:{NEED}"))
        })
        .await,
        "db1 released its entry: {:?}",
        f.entries("db1")
    );
    // Its handler ran over what is left (its GC run), then a few nag intervals pass.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(login(&pg, &f, "SELECT t FROM notes").unwrap(), "kept");
    assert_eq!(
        pg.superuser("SELECT rolcanlogin FROM pg_roles WHERE rolname = 'fort_app_wiki'")
            .unwrap(),
        "t"
    );
    assert!(mark("fort_app_wiki").starts_with("made by fort on db2"));
    assert_eq!(read(&f, "password"), now, "nothing changed at app");
    assert_eq!(row(&f)["from"], "db2");
    assert!(f.entries("db2").iter().any(|e| e == &format!("app:{NEED}")));
}
