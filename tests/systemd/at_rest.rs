//! Secrets at rest under a booted systemd (docs/at-rest.md), as the NixOS module declares
//! them (nixos-module/tests/lane/fleet.nix, `atRest`): forge seals its state with the
//! state key fort-state-key.service made at its first boot (a systemd encrypted
//! credential, given to the agent with `LoadCredentialEncrypted=`) and issues a
//! certificate (pebble), an SSH host certificate, a database's credentials (PostgreSQL)
//! and an OIDC client (npm's oidc-provider); app keeps the database's credentials and the
//! client secret as systemd encrypted credentials of its DynamicUser service holder.
//!
//! Every secret forge keeps (the ACME account key, the SSH CA key, the database
//! password, the client's registration access token and secret), read by opening forge's
//! sealed files with its state key as root on the running host can, and every secret
//! app received, decrypted with `systemd-creds`, is then searched for byte for byte in
//! both hosts' `/var/lib` and `/run/fort`: none is found. holder reads them and restarts
//! when forge rotates the password; after a reboot of both, everything works with what
//! was kept and nothing is issued again.

use std::collections::BTreeMap;
use std::process::Command;

use fort_core::canonical::sha256_hex;
use fort_core::sealed::{self, StateKey};
use fort_tests::lane::Machine;
use fort_tests::oidc::OidcProvider;
use fort_tests::pebble::Pebble;
use fort_tests::postgres::Postgres;
use serde_json::Value;

use crate::fleet::{self, Lane, QUIET, SOON};
use crate::{certificates, clients, databases};

/// Where app keeps its encrypted credentials (the module's default).
const CREDENTIALS: &str = "/var/lib/fort/credentials";

/// The state files of forge that hold secrets, sealed.
const SEALED: [&str; 4] = [
    "/var/lib/fort/handlers/ssl-cert.json",
    "/var/lib/fort/handlers/ssh-ca/ca_key",
    "/var/lib/fort/handlers/postgres.json",
    "/var/lib/fort/handlers/oidc.json",
];

/// Fields of the handlers' states whose values are secrets.
const SECRET_FIELDS: [&str; 4] = [
    "key_pkcs8",
    "password",
    "registration_access_token",
    "client_secret",
];

/// `path`'s bytes on `m`.
fn read(m: &Machine, path: &str) -> Vec<u8> {
    let out = m.exec(&["cat", path]);
    assert!(out.status.success(), "{}: cannot read {path}", m.name);
    out.stdout
}

/// forge's state key, as systemd decrypted it for the agent.
fn state_key(forge: &Machine, scratch: &std::path::Path) -> StateKey {
    let file = scratch.join("state-key");
    std::fs::write(
        &file,
        read(forge, "/run/credentials/fort-agent.service/state-key"),
    )
    .expect("write");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    StateKey::load(&file).expect("forge's state key")
}

/// Every string under one of `SECRET_FIELDS` in `doc`, labelled with its place.
fn secret_fields(doc: &Value, at: &str, found: &mut BTreeMap<String, String>) {
    match doc {
        Value::Object(map) => {
            for (k, v) in map {
                let here = format!("{at}.{k}");
                match v {
                    Value::String(s) if SECRET_FIELDS.contains(&k.as_str()) && s.len() >= 16 => {
                        found.insert(here, s.clone());
                    }
                    _ => secret_fields(v, &here, found),
                }
            }
        }
        Value::Array(items) => {
            for (i, v) in items.iter().enumerate() {
                secret_fields(v, &format!("{at}[{i}]"), found);
            }
        }
        _ => {}
    }
}

/// The secrets forge keeps: each sealed file opened with its key. The SSH CA key counts
/// by the lines of its body after the first (which every ed25519 key shares).
fn forge_secrets(forge: &Machine, key: &StateKey) -> BTreeMap<String, String> {
    let mut found = BTreeMap::new();
    for path in SEALED {
        let bytes = read(forge, path);
        assert!(sealed::is_sealed(&bytes), "{path} is not sealed");
        let plain = key
            .open(std::path::Path::new(path), &bytes)
            .unwrap_or_else(|e| panic!("{path} does not open with forge's key: {e:?}"));
        let text = String::from_utf8(plain.to_vec()).expect("text");
        if path.ends_with("ca_key") {
            let body: Vec<&str> = text
                .lines()
                .filter(|l| !l.starts_with("-----") && !l.is_empty())
                .collect();
            for (i, line) in body.iter().enumerate().skip(1) {
                found.insert(format!("{path} line {i}"), (*line).to_owned());
            }
        } else {
            let doc: Value = serde_json::from_str(&text).expect("JSON state");
            secret_fields(&doc, path, &mut found);
        }
    }
    for field in SECRET_FIELDS {
        assert!(
            found.keys().any(|k| k.ends_with(&format!(".{field}"))),
            "no {field} in forge's state: {:?}",
            found.keys()
        );
    }
    found
}

/// An encrypted credential of app's, decrypted as systemd does for holder.
fn credential(app: &Machine, need: &str, name: &str) -> String {
    app.succeed(&format!(
        "systemd-creds decrypt --name={name} {CREDENTIALS}/{need}/{name}.cred -"
    ))
}

/// The secrets app received, and the database's credentials as holder got them.
fn app_secrets(app: &Machine) -> (BTreeMap<String, String>, Value) {
    let password = credential(app, "postgres/wiki", "password");
    let connection: Value =
        serde_json::from_str(&credential(app, "postgres/wiki", "connection.json"))
            .expect("connection.json");
    assert_eq!(connection["password"], password.as_str());
    let client_secret = credential(app, "oidc/lane", "client_secret");
    let found = BTreeMap::from([
        ("app: database password".to_owned(), password),
        ("app: client secret".to_owned(), client_secret),
    ]);
    (found, connection)
}

/// The files of `m` under `/var/lib` and `/run/fort` that hold any of `secrets`.
fn holding(m: &Machine, secrets: &BTreeMap<String, String>) -> String {
    let mut args = vec!["grep", "-rlaF"];
    for s in secrets.values() {
        args.extend(["-e", s.as_str()]);
    }
    args.extend(["--", "/var/lib", "/run/fort"]);
    let out = m.exec(&args);
    assert!(
        out.status.code() == Some(0) || out.status.code() == Some(1),
        "grep on {}: {}",
        m.name,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Which secrets (by label) are in which files of either host; empty when none is.
fn found_anywhere(lane: &Lane, secrets: &BTreeMap<String, String>) -> Vec<String> {
    let mut found = Vec::new();
    for m in [&lane.forge, &lane.app] {
        if holding(m, secrets).is_empty() {
            continue;
        }
        for (label, s) in secrets {
            let files = holding(m, &BTreeMap::from([(label.clone(), s.clone())]));
            if !files.is_empty() {
                found.push(format!("{label} on {}: {}", m.name, files.trim()));
            }
        }
    }
    found
}

/// What holder noted it received: the SHA-256 of each credential, by name.
fn holder_sums(app: &Machine) -> BTreeMap<String, String> {
    let out = app.exec(&["cat", "/run/holder/sums"]);
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_once("  "))
        .map(|(sum, name)| (name.to_owned(), sum.to_owned()))
        .collect()
}

fn assert_holder_holds(app: &Machine, secrets: &BTreeMap<String, String>) {
    let sums = holder_sums(app);
    assert_eq!(
        sums.get("password").map(String::as_str),
        Some(sha256_hex(secrets["app: database password"].as_bytes()).as_str()),
        "{sums:?}"
    );
    assert_eq!(
        sums.get("client_secret").map(String::as_str),
        Some(sha256_hex(secrets["app: client secret"].as_bytes()).as_str()),
        "{sums:?}"
    );
}

/// The delivered credentials work at the real servers.
fn assert_logins(
    lane: &Lane,
    pg: &Postgres,
    oidc: &OidcProvider,
    connection: &Value,
    secrets: &BTreeMap<String, String>,
) {
    let (user, db) = (
        connection["user"].as_str().expect("user"),
        connection["dbname"].as_str().expect("dbname"),
    );
    pg.login(user, &secrets["app: database password"], db, "SELECT 1")
        .expect("the database password logs in");
    let client_id = lane.app.succeed("cat /run/fort/needs/oidc/lane/client_id");
    let net = lane.net_path();
    if let Err(e) =
        clients::gets_token(Some(&net), oidc, &client_id, &secrets["app: client secret"])
    {
        panic!("app's client gets no token: {e}");
    }
}

#[test]
fn nothing_a_provider_keeps_or_a_consumer_receives_is_on_either_disk() {
    let test = "nothing_a_provider_keeps_or_a_consumer_receives_is_on_either_disk";
    let mut servers: Option<(Pebble, OidcProvider, Postgres)> = None;
    let Some(mut lane) =
        Lane::boot_trees(test, "atrest/forge", "atrest/app", &mut |net, forge, _| {
            if Command::new("curl").arg("--version").output().is_err() {
                return Err("curl is not installed (it asks the provider for a token)".into());
            }
            let pebble = certificates::start_pebble(net, forge)?;
            let oidc = clients::start_oidc(net, forge)?;
            let pg = databases::start_postgres(forge)?;
            servers = Some((pebble, oidc, pg));
            Ok(())
        })
    else {
        return;
    };
    let (_pebble, oidc, pg) = servers.as_ref().expect("started before the machines");
    lane.wait_satisfied();
    for need in ["ssl-cert/web", "ssh-ca/host", "postgres/wiki", "oidc/lane"] {
        assert_eq!(fleet::need(&lane.app, need)["state"], "satisfied", "{need}");
    }
    lane.app.wait_for_unit("holder.service", SOON);
    let scratch = tempfile::tempdir().expect("tempdir");

    // The state key is a credential only systemd decrypts, made at forge's first boot.
    let key = state_key(&lane.forge, scratch.path());
    let cred = lane
        .forge
        .succeed("stat -c '%U %a' /var/lib/fort-credentials/state-key.cred");
    assert_eq!(cred, "root 600\n");
    let state = read(&lane.forge, "/var/lib/fort/provider-state.json");
    let snapshot: Value = serde_json::from_slice(&state).expect("provider-state.json");
    assert_eq!(snapshot["version"], 3, "cached responses sealed");
    assert_eq!(snapshot["key_id"], key.id());

    let mut secrets = forge_secrets(&lane.forge, &key);
    let (received, connection) = app_secrets(&lane.app);
    secrets.extend(received.clone());
    lane.app
        .wait_until("holder noted its credentials", SOON, || {
            holder_sums(&lane.app).len() == 3
        });
    assert_holder_holds(&lane.app, &received);
    assert_logins(&lane, pg, oidc, &connection, &received);
    let found = found_anywhere(&lane, &secrets);
    assert!(found.is_empty(), "secrets on disk: {found:#?}");
    // The search finds what is there: the certificate, public, delivered in plaintext.
    let cert = lane
        .app
        .succeed("cat /var/lib/fort-certificates/web/cert.pem");
    let line = cert.lines().nth(2).expect("a PEM body line").to_owned();
    let files = holding(&lane.app, &BTreeMap::from([("cert".to_owned(), line)]));
    assert!(
        files
            .lines()
            .any(|f| f == "/var/lib/fort-certificates/web/cert.pem"),
        "{files}"
    );
    eprintln!(
        "{} secrets searched for on both hosts: {:?}",
        secrets.len(),
        secrets.keys().collect::<Vec<_>>()
    );

    // forge rotates the password: holder restarts with the new one, which logs in; the
    // old one does not, and the new one is on no disk either.
    std::thread::sleep(QUIET);
    let starts = lane.app.starts("holder.service");
    fleet::fort_agent(
        &lane.forge,
        "atrest/forge",
        &[
            "trigger",
            "postgres",
            "--entry",
            "app:postgres/wiki",
            "--force",
        ],
    );
    let old = received["app: database password"].clone();
    lane.app
        .wait_until("holder holds the new password", SOON, || {
            holder_sums(&lane.app).get("password") != Some(&sha256_hex(old.as_bytes()))
                && lane.app.prop("holder.service", "ActiveState") == "active"
        });
    let (received, connection) = app_secrets(&lane.app);
    assert_ne!(received["app: database password"], old);
    assert_holder_holds(&lane.app, &received);
    std::thread::sleep(QUIET);
    assert_eq!(lane.app.starts("holder.service"), starts + 1, "one restart");
    assert_logins(&lane, pg, oidc, &connection, &received);
    let user = connection["user"].as_str().expect("user");
    let db = connection["dbname"].as_str().expect("dbname");
    assert!(pg.login(user, &old, db, "SELECT 1").is_err());
    let key_secrets = forge_secrets(&lane.forge, &key);
    let mut all = key_secrets.clone();
    all.extend(received.clone());
    let found = found_anywhere(&lane, &all);
    assert!(
        found.is_empty(),
        "secrets on disk after rotation: {found:#?}"
    );

    // Both reboot: forge opens its sealed state with the same credential, app's services
    // start with what was kept, and nothing is issued again.
    let client_id = lane.app.succeed("cat /run/fort/needs/oidc/lane/client_id");
    let issued = fleet::need(&lane.app, "postgres/wiki")["received"].as_u64();
    lane.forge.reboot().expect("reboot forge");
    lane.app.reboot().expect("reboot app");
    for m in [&lane.forge, &lane.app] {
        m.wait_for_unit("fort-agent.service", SOON);
    }
    lane.app.wait_for_unit("holder.service", SOON);
    lane.wait_satisfied();
    lane.app.wait_until(
        "holder noted its credentials after the reboot",
        SOON,
        || holder_sums(&lane.app).len() == 3,
    );
    assert_holder_holds(&lane.app, &received);
    assert_eq!(state_key(&lane.forge, scratch.path()).id(), key.id());
    assert_eq!(forge_secrets(&lane.forge, &key), key_secrets);
    assert_eq!(
        lane.app.succeed("cat /run/fort/needs/oidc/lane/client_id"),
        client_id
    );
    assert!(fleet::need(&lane.app, "postgres/wiki")["received"].as_u64() >= issued);
    assert_logins(&lane, pg, oidc, &connection, &received);
    assert!(
        !lane
            .forge
            .journal("fort-agent.service", 400)
            .contains("plaintext"),
        "forge's agent says it keeps plaintext"
    );
    drop(lane);
    drop(servers);
}
