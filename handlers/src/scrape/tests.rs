//! The scrape decisions and target files on a scratch directory.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use super::config::Config;
use super::reconcile::{reconcile, vet, write_files, State};
use crate::common::{parse_input, Output};

struct Scratch {
    _dir: tempfile::TempDir,
    config: Config,
    state: State,
    hosts: BTreeMap<String, String>,
}

impl Scratch {
    fn new() -> Scratch {
        let dir = tempfile::tempdir().unwrap();
        let config = json!({
            "state_file": dir.path().join("state.json"),
            "targets_dir": dir.path().join("targets"),
            "ports": {"*": ["9100-9199"], "app": ["8080"]},
            "labels": {"*": ["env"], "app": ["team"]},
            "reserved_labels": ["tenant"],
        });
        std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
        Scratch {
            config: Config::load(&dir.path().join("config.json")).unwrap(),
            _dir: dir,
            state: State::default(),
            hosts: [("app", "10.0.0.2"), ("web", "[fd00::3]")]
                .map(|(h, a)| (h.to_owned(), a.to_owned()))
                .into(),
        }
    }

    fn run(&mut self, input: Value, look: bool) -> Value {
        let entries = parse_input(input.to_string().as_bytes()).unwrap();
        let (out, _, _, files) = reconcile(&self.config, &self.hosts, &mut self.state, &entries);
        write_files(&self.config, &mut self.state, &files, look).unwrap();
        Output::into_json(out)
    }

    fn file(&self, origin: &str) -> Option<Value> {
        let text = std::fs::read(self.config.targets_dir.join(format!("{origin}.json"))).ok()?;
        Some(serde_json::from_slice(&text).unwrap())
    }
}

fn entry(request: Value) -> Value {
    json!({"request": request, "response": null})
}

#[test]
fn targets_are_at_the_callers_own_address_with_the_providers_labels() {
    let mut s = Scratch::new();
    let out = s.run(
        json!({
            "app:scrape/node": entry(json!({"port": 9100, "labels": {"env": "prod", "team": "db"}})),
            "app:scrape/app": entry(json!({"port": 8080, "path": "/app/metrics", "job": "app"})),
            "web:scrape/node": entry(json!({"port": 9100})),
        }),
        false,
    );
    assert_eq!(
        out["app:scrape/node"],
        json!({"target": "10.0.0.2:9100", "job": "app:node", "path": "/metrics", "labels": {"env": "prod", "team": "db"}})
    );
    assert_eq!(out["web:scrape/node"]["target"], "[fd00::3]:9100");
    let app = s.file("app").unwrap();
    assert_eq!(
        app,
        json!([
            {"targets": ["10.0.0.2:8080"], "labels": {"job": "app:app", "__metrics_path__": "/app/metrics",
             "__scheme__": "http", "fort_host": "app", "fort_need": "scrape/app"}},
            {"targets": ["10.0.0.2:9100"], "labels": {"job": "app:node", "__metrics_path__": "/metrics",
             "__scheme__": "http", "fort_host": "app", "fort_need": "scrape/node", "env": "prod", "team": "db"}},
        ])
    );
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(s.config.targets_dir.join("app.json"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o644);
}

#[test]
fn one_bad_entry_costs_that_entry_and_a_refused_change_keeps_what_it_had() {
    let mut s = Scratch::new();
    let good = json!({"port": 9100});
    let out = s.run(
        json!({
            "app:scrape/node": entry(good.clone()),
            "app:scrape/elsewhere": entry(json!({"port": 9100, "address": "10.9.9.9"})),
            "app:scrape/high": entry(json!({"port": 9300})),
            "app:scrape/spoof": entry(json!({"port": 9101, "labels": {"instance": "db:9100"}})),
            "app:scrape/meta": entry(json!({"port": 9101, "labels": {"__address__": "10.9.9.9:80"}})),
            "app:scrape/tenant": entry(json!({"port": 9101, "labels": {"tenant": "x"}})),
            "web:scrape/team": entry(json!({"port": 9101, "labels": {"team": "x"}})),
            "ops:scrape/node": entry(json!({"port": 9100})),
        }),
        false,
    );
    let refused = |k: &str| out[k]["$fort_refused"].as_str().unwrap_or("").to_owned();
    assert!(
        refused("app:scrape/elsewhere").contains("unknown field `address`"),
        "{out}"
    );
    assert!(
        refused("app:scrape/high").contains(
            "port 9300 is not one app may be scraped on (allowed for app: 8080, 9100-9199)"
        ),
        "{out}"
    );
    for k in ["app:scrape/spoof", "app:scrape/meta", "app:scrape/tenant"] {
        assert!(refused(k).contains("is reserved"), "{k}: {out}");
    }
    assert!(
        refused("web:scrape/team").contains("not one web may set"),
        "{out}"
    );
    assert!(
        refused("ops:scrape/node").contains("no address in the fleet registry"),
        "{out}"
    );
    assert_eq!(out["app:scrape/node"]["target"], "10.0.0.2:9100");
    let app = s.file("app").unwrap();
    assert_eq!(app.as_array().unwrap().len(), 1);
    assert!(s.file("web").is_none() && s.file("ops").is_none());

    // A change to a port it may not have: refused, and its target stays.
    let out = s.run(
        json!({"app:scrape/node": entry(json!({"port": 9300}))}),
        false,
    );
    assert!(out["app:scrape/node"]["$fort_refused"]
        .as_str()
        .unwrap()
        .ends_with("; the target it had (10.0.0.2:9100) stays scraped"));
    assert_eq!(s.file("app").unwrap(), app);
}

#[test]
fn a_release_takes_the_target_out_and_the_last_one_the_file() {
    let mut s = Scratch::new();
    let both = json!({
        "app:scrape/node": entry(json!({"port": 9100})),
        "app:scrape/db": entry(json!({"port": 9187})),
    });
    s.run(both, false);
    assert_eq!(s.file("app").unwrap().as_array().unwrap().len(), 2);
    s.run(
        json!({"app:scrape/node": entry(json!({"port": 9100}))}),
        false,
    );
    assert_eq!(s.file("app").unwrap().as_array().unwrap().len(), 1);
    // Unchanged: kept by its hash, the file not written again; changed by hand, it is
    // put back on a run that looks.
    let path = s.config.targets_dir.join("app.json");
    std::fs::write(&path, "[]").unwrap();
    let response =
        json!({"target": "10.0.0.2:9100", "job": "app:node", "path": "/metrics", "labels": {}});
    let sha = crate::common::entries::payload_sha256(&response);
    let again =
        json!({"app:scrape/node": {"request": {"port": 9100}, "response": response, "held": sha}});
    let out = s.run(again.clone(), false);
    assert_eq!(out["app:scrape/node"], json!({"$fort_keep": sha}));
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "[]");
    s.run(again, true);
    assert_eq!(s.file("app").unwrap().as_array().unwrap().len(), 1);
    s.run(json!({}), false);
    assert!(!path.exists() && s.state.files.is_empty());
}

#[test]
fn vet_holds_requests_to_the_policy_and_the_registry() {
    let s = Scratch::new();
    let entries = parse_input(
        json!({
            "app:scrape/a": entry(json!({"port": 9100})),
            "app:scrape/b": entry(json!({"port": 22})),
            "ops:scrape/c": entry(json!({"port": 9100})),
        })
        .to_string()
        .as_bytes(),
    )
    .unwrap();
    let refused = vet(&s.config, &s.hosts, &entries);
    assert_eq!(
        refused.keys().collect::<Vec<_>>(),
        ["app:scrape/b", "ops:scrape/c"]
    );
    assert!(!s.config.targets_dir.exists());
}

/// The `job` label is the provider's: a caller's job is under its own name, so no caller
/// puts its targets in another's job or in one the operator scrapes itself.
#[test]
fn a_job_is_its_callers_own() {
    let mut s = Scratch::new();
    let out = s.run(
        json!({
            "app:scrape/node": entry(json!({"port": 9100, "job": "prometheus"})),
            "web:scrape/node": entry(json!({"port": 9100, "job": "app"})),
            "web:scrape/db": entry(json!({"port": 9187})),
        }),
        false,
    );
    let jobs = |origin: &str| -> Vec<String> {
        s.file(origin)
            .unwrap()
            .as_array()
            .unwrap()
            .iter()
            .map(|g| g["labels"]["job"].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(jobs("app"), ["app:prometheus"]);
    assert_eq!(jobs("web"), ["web:db", "web:app"]);
    assert_eq!(out["app:scrape/node"]["job"], "app:prometheus");
    assert_eq!(out["web:scrape/node"]["job"], "web:app");
}

/// A target a release before gave the job it asked for: the next run gives it its
/// caller's, in the same file, rewritten whole, and answers it anew; nothing else in the
/// directory.
#[test]
fn a_target_of_a_release_before_gets_its_callers_job() {
    let mut s = Scratch::new();
    let request = json!({"port": 9100, "job": "prometheus"});
    std::fs::create_dir_all(&s.config.targets_dir).unwrap();
    let before = serde_json::to_vec_pretty(&json!([
        {"targets": ["10.0.0.2:9100"], "labels": {"job": "prometheus", "__metrics_path__": "/metrics",
         "__scheme__": "http", "fort_host": "app", "fort_need": "scrape/node"}},
    ]))
    .unwrap();
    let path = s.config.targets_dir.join("app.json");
    std::fs::write(&path, &before).unwrap();
    s.state = serde_json::from_value(json!({
        "entries": {"app:scrape/node": {"port": 9100, "path": "/metrics", "job": "prometheus", "labels": {}}},
        "files": {"app": fort_core::canonical::sha256_hex(&before)},
    }))
    .unwrap();
    let old_response =
        json!({"target": "10.0.0.2:9100", "job": "prometheus", "path": "/metrics", "labels": {}});
    let held = crate::common::entries::payload_sha256(&old_response);
    let out = s.run(
        json!({"app:scrape/node": {"request": request, "response": old_response, "held": held}}),
        false,
    );
    assert_eq!(out["app:scrape/node"]["job"], "app:prometheus", "{out}");
    assert_eq!(s.file("app").unwrap()[0]["labels"]["job"], "app:prometheus");
    let names: Vec<_> = std::fs::read_dir(&s.config.targets_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["app.json"]);
    assert_eq!(
        s.state.files["app"],
        fort_core::canonical::sha256_hex(&std::fs::read(&path).unwrap())
    );
}
