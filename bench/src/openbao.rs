//! The comparison of `fort-bench postgres`: OpenBao (Vault's open fork) in dev mode on
//! loopback, its database secrets engine configured against the same PostgreSQL, issuing
//! credentials one request at a time over its HTTP API. Benchmark-only: no test needs it.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use fort_tests::postgres::Postgres;
use serde_json::{json, Value};

/// `--bao`, else `bao` on the PATH.
pub fn find(explicit: Option<PathBuf>) -> Option<PathBuf> {
    if let Some(p) = explicit {
        return Some(p);
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("bao"))
        .find(|p| p.is_file())
}

pub struct Issued {
    pub version: String,
    pub issued: usize,
    pub issued_in: Duration,
    /// A sample credential logs in.
    pub login_ok: bool,
    /// What a role whose creation statements also create a database gives.
    pub with_database: String,
}

/// The dev server, stopped on drop.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

struct Api {
    http: reqwest::Client,
    base: String,
    token: String,
}

impl Api {
    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<Value> {
        let mut req = self
            .http
            .request(method, format!("{}/v1/{path}", self.base))
            .header("X-Vault-Token", &self.token);
        if let Some(b) = body {
            req = req
                .header("Content-Type", "application/json")
                .body(b.to_string());
        }
        let resp = req.send().await?;
        let status = resp.status();
        let text = resp.text().await?;
        if !status.is_success() {
            bail!("{path}: {status}: {}", text.trim());
        }
        Ok(serde_json::from_str(&text).unwrap_or(Value::Null))
    }
}

/// Starts OpenBao, points its database engine at `pg`, and issues `n` credentials.
pub async fn issue(bao: &std::path::Path, pg: &Postgres, n: usize) -> Result<Issued> {
    fort_core::tls::install_default_provider();
    let version = Command::new(bao)
        .arg("version")
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .unwrap_or("")
                .to_owned()
        })
        .unwrap_or_default();
    let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let home = tempfile::tempdir()?;
    let token = format!("bench-{}", fort_handlers::postgres::names::new_password());
    let server = Server(
        Command::new(bao)
            .args(["server", "-dev", "-dev-no-store-token"])
            .arg(format!("-dev-root-token-id={token}"))
            .arg(format!("-dev-listen-address=127.0.0.1:{port}"))
            .env("HOME", home.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("start bao server -dev")?,
    );
    let api = Api {
        http: reqwest::Client::builder()
            .timeout(Duration::from_secs(60))
            .build()?,
        base: format!("http://127.0.0.1:{port}"),
        token,
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while api
        .call(reqwest::Method::GET, "sys/health", None)
        .await
        .is_err()
    {
        if Instant::now() > deadline {
            bail!("OpenBao did not come up on 127.0.0.1:{port}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Its admin role logs in over TCP with a password, as OpenBao's plugin connects.
    let admin_pw = fort_handlers::postgres::names::new_password();
    pg.superuser(&format!(
        "CREATE ROLE fort_bao LOGIN CREATEROLE CREATEDB PASSWORD '{admin_pw}'"
    ))
    .map_err(|e| anyhow!(e))?;
    api.call(
        reqwest::Method::POST,
        "sys/mounts/database",
        Some(json!({"type": "database"})),
    )
    .await?;
    api.call(
        reqwest::Method::POST,
        "database/config/pg",
        Some(json!({
            "plugin_name": "postgresql-database-plugin",
            "connection_url": format!("postgresql://{{{{username}}}}:{{{{password}}}}@127.0.0.1:{}/postgres?sslmode=disable", pg.port),
            "username": "fort_bao",
            "password": admin_pw,
            "allowed_roles": "*",
        })),
    )
    .await?;
    let role = r#"CREATE ROLE "{{name}}" WITH LOGIN PASSWORD '{{password}}' VALID UNTIL '{{expiration}}';"#;
    api.call(
        reqwest::Method::POST,
        "database/roles/app",
        Some(json!({"db_name": "pg", "creation_statements": [role], "default_ttl": "1h", "max_ttl": "24h"})),
    )
    .await?;

    let t = Instant::now();
    let mut last = Value::Null;
    for _ in 0..n {
        last = api
            .call(reqwest::Method::GET, "database/creds/app", None)
            .await?;
    }
    let issued_in = t.elapsed();
    let user = last["data"]["username"].as_str().unwrap_or("");
    let password = last["data"]["password"].as_str().unwrap_or("");
    let login_ok = pg.login(user, password, "postgres", "SELECT 1").is_ok();
    let issued = pg
        .superuser("SELECT count(*) FROM pg_roles WHERE rolname LIKE 'v-%'")
        .map_err(|e| anyhow!(e))?
        .parse()
        .unwrap_or(0);

    // A role and a database per credential, as fort makes them.
    api.call(
        reqwest::Method::POST,
        "database/roles/appdb",
        Some(json!({"db_name": "pg", "creation_statements": [role, r#"CREATE DATABASE "{{name}}" OWNER "{{name}}";"#],
                    "default_ttl": "1h", "max_ttl": "24h"})),
    )
    .await?;
    let with_database = match api
        .call(reqwest::Method::GET, "database/creds/appdb", None)
        .await
    {
        Ok(_) => "issued".to_owned(),
        Err(e) => {
            let text = e.to_string();
            let cause = if text.contains("cannot run inside a transaction block") {
                "refused: CREATE DATABASE cannot run inside a transaction block (the engine runs creation statements in one)".to_owned()
            } else {
                format!("refused: {}", text.chars().take(200).collect::<String>())
            };
            cause
        }
    };
    drop(server);
    Ok(Issued {
        version,
        issued,
        issued_in,
        login_ok,
        with_database,
    })
}
