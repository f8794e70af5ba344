//! What the postgres handler tests share: a scratch PostgreSQL, a config pointing the
//! handler at it, runs of `fort-handler postgres` as the agent makes them, and logins
//! with the credentials it answers.
// Each test file uses part of it.
#![allow(dead_code)]

use std::path::PathBuf;

use fort_tests::postgres::{Postgres, ADMIN};
use serde_json::{json, Value};

/// A started server, or a recorded skip.
pub fn server(test: &str) -> Option<Postgres> {
    match Postgres::start(false) {
        Ok(pg) => Some(pg),
        Err(reason) => {
            fort_tests::skip(test, &reason);
            None
        }
    }
}

pub struct Setup {
    pub pg: Postgres,
    pub dir: tempfile::TempDir,
    pub config: PathBuf,
    /// The state key the runs get (`FORT_STATE_KEY_FILE`); none: plaintext state.
    pub state_key: Option<PathBuf>,
}

impl Setup {
    pub fn new(pg: Postgres, extra: Value) -> Setup {
        let dir = tempfile::tempdir().unwrap();
        let mut config = json!({
            "state_file": dir.path().join("state/postgres.json"),
            "host": "127.0.0.1",
            "socket_dir": pg.socket_dir(),
            "port": pg.port,
            "admin_role": ADMIN,
        });
        for (k, v) in extra.as_object().unwrap() {
            config[k] = v.clone();
        }
        let path = dir.path().join("postgres.json");
        std::fs::write(&path, config.to_string()).unwrap();
        Setup {
            pg,
            dir,
            config: path,
            state_key: None,
        }
    }

    /// Sets `key` of the handler's config to `value` (the operator changed it).
    pub fn set_config(&self, key: &str, value: Value) {
        let mut c: Value = serde_json::from_slice(&std::fs::read(&self.config).unwrap()).unwrap();
        c[key] = value;
        std::fs::write(&self.config, c.to_string()).unwrap();
    }

    pub fn state_file(&self) -> PathBuf {
        self.dir.path().join("state/postgres.json")
    }

    /// One handler run as the agent makes it: (exit ok, stdout as JSON, stderr).
    pub fn run(&self, trigger: &str, input: &Value) -> (bool, Value, String) {
        let key = self.state_key.as_ref().map(|k| k.display().to_string());
        let mut env = vec![("FORT_HOST", "db")];
        if let Some(k) = &key {
            env.push((fort_core::sealed::KEY_FILE_ENV, k));
        }
        fort_tests::run_handler("postgres", &self.config, trigger, &env, input)
    }

    /// A run that must succeed.
    pub fn ok(&self, trigger: &str, input: &Value) -> Value {
        let (ok, out, err) = self.run(trigger, input);
        assert!(ok, "handler failed: {err}");
        out
    }

    pub fn sql(&self, sql: &str) -> String {
        self.pg.superuser(sql).unwrap()
    }

    /// Roles whose names start with `prefix`, sorted.
    pub fn roles(&self, prefix: &str) -> Vec<String> {
        let out = self.sql(&format!(
            "SELECT rolname FROM pg_roles WHERE starts_with(rolname, '{prefix}') ORDER BY 1"
        ));
        out.lines().map(str::to_owned).collect()
    }
}

/// `{key: {"request": …, "response": …}}` with each response taken from `previous`.
pub fn input(requests: &[(&str, Value)], previous: &Value) -> Value {
    let mut m = serde_json::Map::new();
    for (key, request) in requests {
        let response = previous.get(*key).cloned().unwrap_or(Value::Null);
        m.insert(
            (*key).to_owned(),
            json!({"request": request, "response": response}),
        );
    }
    Value::Object(m)
}

pub fn login(s: &Setup, cred: &Value, sql: &str) -> Result<String, String> {
    s.pg.login(
        cred["user"].as_str().unwrap(),
        cred["password"].as_str().unwrap(),
        cred["dbname"].as_str().unwrap(),
        sql,
    )
}
