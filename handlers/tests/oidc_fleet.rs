//! The oidc capability in a fleet of real agents: a provider whose capability runs
//! `fort-handler oidc` against a real OpenID provider (npm's oidc-provider), consumers
//! whose client lands as files a service would read, and the provider's token endpoint
//! taking what was delivered, through rotation and release; a client name outside the
//! caller's allowance shows its reason in the need's state.

use std::path::{Path, PathBuf};
use std::time::Duration;

use fort_tests::oidc::OidcProvider;
use fort_tests::{eventually, Fleet};
use serde_json::{json, Value};

const TEST: &str = "consumers_get_tokens_with_delivered_clients_through_rotation_and_release";

/// The need: the client as files a service would read.
fn need(f: &Fleet, host: &str, id: &str, request: Value) -> Value {
    let dir = f.dir.path().join(format!("run/{host}/{id}"));
    json!({"nag_seconds": 2, "request": request,
           "files": fort_tests::pointer_files(&dir, &["client_id", "client_secret", "issuer"])})
}

fn read(f: &Fleet, host: &str, id: &str, name: &str) -> String {
    std::fs::read_to_string(f.dir.path().join(format!("run/{host}/{id}/{name}")))
        .unwrap_or_default()
}

fn config(op: &OidcProvider, dir: &Path) -> PathBuf {
    let path = dir.join("oidc.json");
    std::fs::write(
        &path,
        json!({
            "issuer": op.issuer,
            "initial_access_token_file": op.token_file,
            "state_file": dir.join("handler-state/oidc.json"),
            "ca_file": op.ca_file,
            "allow": {"*": ["{origin}"]},
            "allow_grant_types": {"*": ["client_credentials"]},
        })
        .to_string(),
    )
    .unwrap();
    path
}

/// Whether the token endpoint gives an access token for `id` and `secret`.
async fn gets_token(op: &OidcProvider, id: &str, secret: &str) -> bool {
    op.client_credentials(id, secret).await.0 == 200
}

fn m2m(name: &str, rotate: u64) -> Value {
    json!({"client_name": name, "grant_types": ["client_credentials"], "rotate": rotate})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumers_get_tokens_with_delivered_clients_through_rotation_and_release() {
    let op = match OidcProvider::start() {
        Ok(op) => op,
        Err(reason) => return fort_tests::skip(TEST, &reason),
    };
    let mut f = Fleet::new();
    let cfg = config(&op, f.dir.path());
    f.capability(
        "id",
        "oidc",
        json!({"handler": fort_tests::bin("fort-handler"), "args": ["oidc", "--config", cfg],
               "mode": "async", "cacheResponse": true}),
    );
    let app = need(&f, "app", "wiki", m2m("app", 0));
    f.need("app", "oidc/wiki", "id", app);
    let web = need(&f, "web", "wiki", m2m("web", 0));
    f.need("web", "oidc/wiki", "id", web);
    let evil = need(&f, "web", "evil", m2m("app", 0));
    f.need("web", "oidc/evil", "id", evil);
    f.start();
    // Every file of both clients (files are written one after the other).
    let delivered = |f: &Fleet, host: &str| {
        ["client_id", "client_secret", "issuer"]
            .iter()
            .all(|name| !read(f, host, "wiki", name).is_empty())
    };
    assert!(
        eventually(Duration::from_secs(30), || delivered(&f, "app")
            && delivered(&f, "web"))
        .await,
        "not delivered: app {} web {}",
        f.status("app")["needs"],
        f.status("web")["needs"]
    );

    // Each consumer's client gets tokens; the issuer is the provider's.
    let (app_id, app_secret) = (
        read(&f, "app", "wiki", "client_id"),
        read(&f, "app", "wiki", "client_secret"),
    );
    assert_eq!(read(&f, "app", "wiki", "issuer"), op.issuer);
    assert!(gets_token(&op, &app_id, &app_secret).await);
    let (web_id, web_secret) = (
        read(&f, "web", "wiki", "client_id"),
        read(&f, "web", "wiki", "client_secret"),
    );
    assert_ne!(app_id, web_id);
    assert!(gets_token(&op, &web_id, &web_secret).await);
    assert!(!gets_token(&op, &app_id, &web_secret).await);

    // web may not register a client named app: the need says why and gets nothing.
    let refused = eventually(Duration::from_secs(20), || {
        f.need_status("web", "oidc/evil")["reason"]
            .as_str()
            .is_some_and(|r| r.contains("web may not register the client name app"))
    })
    .await;
    assert!(refused, "{}", f.need_status("web", "oidc/evil"));
    assert!(read(&f, "web", "evil", "client_secret").is_empty());

    // The consumer raises `rotate`: a new secret arrives, the old one stops working.
    f.host("app").needs.get_mut("oidc/wiki").unwrap()["request"] = m2m("app", 1);
    f.write_files();
    f.agents["app"].hup();
    // The new client's id and secret arrive as two files: wait until both are there.
    let mut rotated = None;
    for _ in 0..75 {
        let (id, secret) = (
            read(&f, "app", "wiki", "client_id"),
            read(&f, "app", "wiki", "client_secret"),
        );
        if !secret.is_empty() && secret != app_secret && gets_token(&op, &id, &secret).await {
            rotated = Some((id, secret));
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (new_id, new_secret) = rotated.expect("rotate did not bring a new secret that works");
    assert!(!gets_token(&op, &app_id, &app_secret).await);

    // app drops the need: its client is deleted at the provider; web keeps its own.
    f.host("app").needs.clear();
    f.write_files();
    let (ok, out) = f.admin("app", &["reload"]);
    assert!(ok, "{out}");
    let mut gone = false;
    for _ in 0..100 {
        if !gets_token(&op, &new_id, &new_secret).await {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(gone, "the released client still gets tokens");
    assert!(gets_token(&op, &web_id, &web_secret).await);
}
