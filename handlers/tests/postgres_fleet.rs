//! The postgres capability in a fleet of real agents: a provider whose capability runs
//! `fort-handler postgres`, consumers whose needs land as files, and `psql` logging in
//! with what was delivered, through rotation and release.

use std::path::{Path, PathBuf};
use std::time::Duration;

use fort_tests::postgres::{Postgres, ADMIN};
use fort_tests::{eventually, Fleet};
use serde_json::{json, Value};

const TEST: &str = "consumers_log_in_with_delivered_credentials_through_rotation_and_release";

/// The need: the credential as files a service would read.
fn need(f: &Fleet, host: &str, request: Value) -> Value {
    let dir = f.dir.path().join(format!("run/{host}"));
    json!({"nag_seconds": 2, "request": request,
           "files": fort_tests::pointer_files(&dir, &["password", "user", "dbname", "uri"])})
}

fn read(f: &Fleet, host: &str, name: &str) -> String {
    std::fs::read_to_string(f.dir.path().join(format!("run/{host}/{name}"))).unwrap_or_default()
}

fn login(
    pg: &Postgres,
    f: &Fleet,
    host: &str,
    password: &str,
    sql: &str,
) -> Result<String, String> {
    pg.login(
        &read(f, host, "user"),
        password,
        &read(f, host, "dbname"),
        sql,
    )
}

fn config(pg: &Postgres, dir: &Path) -> PathBuf {
    let path = dir.join("postgres.json");
    std::fs::write(
        &path,
        json!({
            "state_file": dir.join("handler-state/postgres.json"),
            "host": "127.0.0.1",
            "socket_dir": pg.socket_dir(),
            "port": pg.port,
            "admin_role": ADMIN,
        })
        .to_string(),
    )
    .unwrap();
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumers_log_in_with_delivered_credentials_through_rotation_and_release() {
    let pg = match Postgres::start(false) {
        Ok(pg) => pg,
        Err(reason) => return fort_tests::skip(TEST, &reason),
    };
    pg.superuser("CREATE ROLE legacy LOGIN PASSWORD 'legacy-pw'")
        .unwrap();
    let mut f = Fleet::new();
    let cfg = config(&pg, f.dir.path());
    f.capability(
        "db",
        "postgres",
        json!({"handler": fort_tests::bin("fort-handler"), "args": ["postgres", "--config", cfg],
               "mode": "async", "cacheResponse": true}),
    );
    let app = need(&f, "app", json!({}));
    f.need("app", "postgres/wiki", "db", app);
    let web = need(&f, "web", json!({}));
    f.need("web", "postgres/wiki", "db", web);
    f.start();
    assert!(
        eventually(Duration::from_secs(30), || f.all_satisfied("app")
            && f.all_satisfied("web"))
        .await,
        "not delivered: app {} web {}",
        f.status("app")["needs"],
        f.status("web")["needs"]
    );

    // Two hosts, one need id: two databases, each reachable only with its own password.
    assert_eq!(read(&f, "app", "dbname"), "fort_app_wiki");
    assert_eq!(read(&f, "web", "dbname"), "fort_web_wiki");
    let pw1 = read(&f, "app", "password");
    login(
        &pg,
        &f,
        "app",
        &pw1,
        "CREATE TABLE notes (t text); INSERT INTO notes VALUES ('kept')",
    )
    .unwrap();
    assert_eq!(
        pg.login_uri(&read(&f, "app", "uri"), "SELECT t FROM notes")
            .unwrap(),
        "kept"
    );
    let web_pw = read(&f, "web", "password");
    assert!(pg
        .login("fort_web_wiki", &web_pw, "fort_app_wiki", "SELECT 1")
        .is_err());
    assert!(pg
        .login("fort_app_wiki", &web_pw, "fort_app_wiki", "SELECT 1")
        .is_err());

    // `fort-agent trigger postgres --force` on the provider: every password changes and
    // reaches the consumers; the old one stops working.
    let (ok, out) = f.admin("db", &["trigger", "postgres", "--force"]);
    assert!(ok, "{out}");
    assert!(
        eventually(Duration::from_secs(15), || {
            let now = read(&f, "app", "password");
            !now.is_empty() && now != pw1
        })
        .await,
        "no new password delivered"
    );
    let pw2 = read(&f, "app", "password");
    assert!(
        login(&pg, &f, "app", &pw1, "SELECT 1").is_err(),
        "the old password works"
    );
    assert_eq!(
        login(&pg, &f, "app", &pw2, "SELECT t FROM notes").unwrap(),
        "kept"
    );

    // The consumer asks for a new password by raising `rotate`.
    f.host("app").needs.get_mut("postgres/wiki").unwrap()["request"] = json!({"rotate": 1});
    f.write_files();
    f.agents["app"].hup();
    assert!(
        eventually(Duration::from_secs(15), || {
            let now = read(&f, "app", "password");
            !now.is_empty() && now != pw2
        })
        .await,
        "rotate did not bring a new password"
    );
    let pw3 = read(&f, "app", "password");
    assert!(login(&pg, &f, "app", &pw2, "SELECT 1").is_err());
    assert_eq!(
        login(&pg, &f, "app", &pw3, "SELECT t FROM notes").unwrap(),
        "kept"
    );

    // app drops the need: released at the provider, the role cannot log in, the data is
    // still there; web is untouched.
    f.host("app").needs.clear();
    f.write_files();
    let (ok, out) = f.admin("app", &["reload"]);
    assert!(ok, "{out}");
    assert!(
        eventually(Duration::from_secs(20), || {
            pg.superuser("SELECT rolcanlogin FROM pg_roles WHERE rolname = 'fort_app_wiki'")
                .is_ok_and(|v| v == "f")
        })
        .await,
        "the released role can still log in"
    );
    assert!(pg
        .login("fort_app_wiki", &pw3, "fort_app_wiki", "SELECT 1")
        .is_err());
    assert_eq!(
        pg.superuser_in("fort_app_wiki", "SELECT t FROM notes")
            .unwrap(),
        "kept"
    );
    assert_eq!(
        pg.login(
            "fort_web_wiki",
            &read(&f, "web", "password"),
            "fort_web_wiki",
            "SELECT 1"
        )
        .unwrap(),
        "1"
    );
    // The role made by hand came through every run.
    assert_eq!(
        pg.login("legacy", "legacy-pw", "postgres", "SELECT current_user")
            .unwrap(),
        "legacy"
    );
}
