//! `fort-agent check --fleet` holds every consumer's requests against the allowances of
//! the capabilities fort's handlers serve: a name, principal or client outside a
//! provider's allow list fails the check, naming the need, the value and what the caller
//! is allowed, before anything is deployed; requests within them pass.

use std::path::Path;
use std::process::Command;

use fort_tests::Fleet;
use serde_json::{json, Value};

/// Every capability of fort-handler on `edge`, each allowing `app` names under
/// `app.example.test` (or `app` itself) only.
fn serve_everything(f: &mut Fleet, cfg: &Path) {
    std::fs::write(cfg.join("tsig.key"), "c2VjcmV0\n").unwrap();
    std::fs::write(cfg.join("token"), "t\n").unwrap();
    let configs: [(&str, &str, Value); 8] = [
        (
            "dns-record",
            "dns-record",
            json!({
            "zone": "example.test", "primary": "127.0.0.1:53",
            "key": {"name": "fort", "file": cfg.join("tsig.key")},
            "allow": {"*": ["*.{origin}.example.test"]},
            "state": cfg.join("dns.json")}),
        ),
        (
            "proxy",
            "proxy",
            json!({
            "include_dir": "/etc/nginx/fort", "state_file": cfg.join("proxy.json"),
            "allow": {"*": ["*.{origin}.example.test"]}}),
        ),
        (
            "ssl-cert",
            "acme",
            json!({
            "directory": "https://127.0.0.1:14000/dir", "http01": {"webroot": "/var/www"},
            "allow": {"*": ["*.{origin}.example.test"]}, "state": cfg.join("acme.json")}),
        ),
        (
            "postgres",
            "postgres",
            json!({
            "state_file": cfg.join("pg.json"), "host": "db.example.test",
            "allow": {"*": ["{origin}_extra"]}}),
        ),
        (
            "oidc",
            "oidc",
            json!({
            "issuer": "https://id.example.test", "initial_access_token_file": cfg.join("token"),
            "state_file": cfg.join("oidc.json"), "allow": {"*": ["{origin}-wiki"]},
            "allow_grant_types": {"*": ["client_credentials"]}}),
        ),
        (
            "ssh-ca",
            "ssh-ca",
            json!({
            "ca_key_file": cfg.join("ca"), "state_file": cfg.join("ssh.json"),
            "hosts_file": "/etc/fort/hosts.json",
            "host_principals": {"*": ["{origin}", "{origin}.example.test"]}}),
        ),
        (
            "backup-repo",
            "backup-repo",
            json!({
            "state_file": cfg.join("borg.json"), "repositories_dir": "/srv/borg",
            "authorized_keys_file": cfg.join("authorized_keys"), "host": "edge.example.test",
            "full_access": {"*": ["{origin}-full"]}}),
        ),
        (
            "scrape",
            "scrape",
            json!({
            "state_file": cfg.join("scrape.json"), "targets_dir": cfg.join("targets"),
            "ports": {"*": ["9100"]}}),
        ),
    ];
    for (name, handler, config) in configs {
        let path = cfg.join(format!("{name}.json"));
        std::fs::write(&path, config.to_string()).unwrap();
        f.capability(
            "edge",
            name,
            json!({"handler": fort_tests::bin("fort-handler"),
                   "args": [handler, "--config", path], "mode": "async"}),
        );
    }
}

fn check(f: &Fleet) -> (bool, String) {
    f.write_files();
    let out = Command::new(fort_tests::bin("fort-agent"))
        .args(["check", "--fleet"])
        .arg(f.dir.path())
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// A repository with full access, reached with a key the consumer makes.
fn borg_need(keys: &Path) -> Value {
    json!({"request": {"public_key": {"$fort_key": "ssh", "as": "openssh"}, "append_only": false},
           "keys": {"ssh": {"type": "ed25519", "format": "openssh", "path": keys.join("ssh_key"),
                            "certificate": "/public_key", "authorized": true}}})
}

fn csr_need(names: &[&str], keys: &Path) -> Value {
    json!({"request": {"csr": {"$fort_key": "tls", "as": "csr"}},
           "keys": {"tls": {"type": "ecdsa-p256", "path": keys.join("key.pem"), "names": names}}})
}

#[test]
fn requests_outside_a_providers_allowances_fail_the_fleet_check_by_name() {
    let mut f = Fleet::new();
    let cfg = tempfile::tempdir().unwrap();
    serve_everything(&mut f, cfg.path());
    let keys = tempfile::tempdir().unwrap();
    // Within their allowances: web's requests.
    let ok: [(&str, Value); 8] = [
        (
            "dns-record/www",
            json!({"request": {"name": "www.web.example.test"}}),
        ),
        (
            "proxy/site",
            json!({"request": {"server_names": ["site.web.example.test"], "port": 80}}),
        ),
        (
            "ssl-cert/site",
            csr_need(&["site.web.example.test"], keys.path()),
        ),
        ("postgres/db", json!({"request": {"name": "web_extra"}})),
        (
            "oidc/wiki",
            json!({"request": {"client_name": "web-wiki", "grant_types": ["client_credentials"]}}),
        ),
        (
            "ssh-ca/host",
            json!({"request": {"kind": "host", "public_key": fort_core::sign::Signer::generate().public_openssh(), "principals": ["web"]}}),
        ),
        ("backup-repo/web-full", borg_need(keys.path())),
        ("scrape/node", json!({"request": {"port": 9100}})),
    ];
    for (need, spec) in ok {
        f.need("web", need, "edge", spec);
    }
    let (passed, report) = check(&f);
    assert!(passed, "{report}");
    assert!(
        report.contains("edge's proxy (1 request): ok: every request within its allowances"),
        "{report}"
    );

    // app asks for what web may have.
    let app_keys = tempfile::tempdir().unwrap();
    let wrong: [(&str, Value, &str); 8] = [
        ("dns-record/www", json!({"request": {"name": "www.web.example.test"}}),
         "app may not hold records at www.web.example.test (allowed for app: *.app.example.test)"),
        ("proxy/site", json!({"request": {"server_names": ["site.web.example.test"], "port": 80}}),
         "app may not have the server name site.web.example.test (the provider's allow list; allowed for app: *.app.example.test)"),
        ("ssl-cert/site", csr_need(&["site.web.example.test"], app_keys.path()),
         "site.web.example.test is not a name app may get a certificate for (allowed for app: *.app.example.test)"),
        ("postgres/db", json!({"request": {"name": "web_extra"}}),
         "app may not have the database web_extra (the provider's allow list; allowed for app: app_extra)"),
        ("oidc/wiki", json!({"request": {"client_name": "web-wiki", "grant_types": ["client_credentials"]}}),
         "app may not register the client name web-wiki (the provider's allow list; allowed for app: app-wiki)"),
        ("ssh-ca/host", json!({"request": {"kind": "host", "public_key": fort_core::sign::Signer::generate().public_openssh(), "principals": ["web"]}}),
         "principal web is not one app may have on a host certificate (allowed for app: app, app.example.test)"),
        ("backup-repo/web-full", borg_need(app_keys.path()),
         "app may not have full access (append_only = false) to repository web-full (allowed for app: app-full); its key may only add archives"),
        ("scrape/node", json!({"request": {"port": 22}}),
         "port 22 is not one app may be scraped on (allowed for app: 9100)"),
    ];
    for (need, spec, _) in &wrong {
        f.need("app", need, "edge", spec.clone());
    }
    // And a file pointing at a member postgres never answers.
    f.host("app").needs.get_mut("postgres/db").unwrap()["files"] =
        json!([{"path": keys.path().join("host"), "pointer": "/hostname"}]);
    let (passed, report) = check(&f);
    assert!(!passed, "{report}");
    for (need, _, says) in &wrong {
        let line = format!("app → edge: {need}: edge refuses it: {says}");
        assert!(report.contains(&line), "missing {line:?} in:\n{report}");
    }
    assert!(
        report.contains("app → edge: postgres/db: file ")
            && report.contains(
                "points at /hostname, which no answer of edge's postgres has (host, port, dbname, user, password, uri)"
            ),
        "{report}"
    );
    assert!(report.contains("9 problem(s)"), "{report}");
}

#[test]
fn two_providers_for_a_capability_that_takes_one_fail_the_fleet_check() {
    let mut f = Fleet::new();
    let cfg = tempfile::tempdir().unwrap();
    serve_everything(&mut f, cfg.path());
    let caps = f.host("edge").capabilities.clone();
    f.host("edge2").capabilities = caps;
    let keys = tempfile::tempdir().unwrap();
    // acme issues at each provider on its own account: two providers are fine.
    f.need_from(
        "web",
        "ssl-cert/site",
        &["edge", "edge2"],
        csr_need(&["site.web.example.test"], keys.path()),
    );
    let (passed, report) = check(&f);
    assert!(passed, "{report}");
    // One DNS primary, whose records a standby does not adopt.
    f.need_from(
        "web",
        "dns-record/www",
        &["edge", "edge2"],
        json!({"request": {"name": "www.web.example.test"}}),
    );
    let (passed, report) = check(&f);
    assert!(!passed, "{report}");
    for provider in ["edge", "edge2"] {
        let line = format!(
            "web → {provider}: dns-record/www: from names 2 providers, but dns-record takes one: its providers would share one"
        );
        assert!(report.contains(&line), "missing {line:?} in:\n{report}");
    }
    assert!(!report.contains("ssl-cert/site: from names"), "{report}");
    assert!(report.contains("2 problem(s)"), "{report}");
}

/// edge's and edge2's postgres, each with its own config: `peers` and the server as
/// given.
fn postgres_at(f: &mut Fleet, cfg: &Path, provider: &str, host: &str, peers: &[&str]) {
    let path = cfg.join(format!("postgres-{provider}.json"));
    let config = json!({"state_file": cfg.join(format!("pg-{provider}.json")), "host": host,
                        "allow": {"*": ["{origin}_extra"]}, "peers": peers});
    std::fs::write(&path, config.to_string()).unwrap();
    if !f.host(provider).capabilities.contains_key("postgres") {
        f.capability(
            provider,
            "postgres",
            json!({"handler": fort_tests::bin("fort-handler"),
                   "args": ["postgres", "--config", path], "mode": "async"}),
        );
    }
}

#[test]
fn providers_of_a_shared_backend_must_name_one_server_and_each_other() {
    let mut f = Fleet::new();
    let cfg = tempfile::tempdir().unwrap();
    // Neither lists the other: neither would take over what the other made.
    postgres_at(&mut f, cfg.path(), "edge", "db.example.test", &[]);
    postgres_at(&mut f, cfg.path(), "edge2", "db.example.test", &[]);
    f.need_from(
        "web",
        "postgres/db",
        &["edge", "edge2"],
        json!({"request": {"name": "web_extra"}}),
    );
    let (passed, report) = check(&f);
    assert!(!passed, "{report}");
    for (p, other) in [("edge", "edge2"), ("edge2", "edge")] {
        let line = format!(
            "web → {p}: postgres/db: {p} does not list {other} among its peers, so it would not take over what {other} made for the need"
        );
        assert!(report.contains(&line), "missing {line:?} in:\n{report}");
    }
    // Peers of each other, but on two servers.
    postgres_at(&mut f, cfg.path(), "edge", "db.example.test", &["edge2"]);
    postgres_at(&mut f, cfg.path(), "edge2", "db2.example.test", &["edge"]);
    let (passed, report) = check(&f);
    assert!(!passed, "{report}");
    assert!(
        report.contains(
            "web → edge2: postgres/db: edge2 serves it on db2.example.test:5432 (fort_…), edge on db.example.test:5432 (fort_…): providers of one need must share one backend"
        ),
        "{report}"
    );
    // One server, each the other's peer: the standby takes over what the home made.
    postgres_at(&mut f, cfg.path(), "edge2", "db.example.test", &["edge"]);
    let (passed, report) = check(&f);
    assert!(passed, "{report}");
}
