//! `oidc` with two providers in front of one OpenID provider (npm's oidc-provider),
//! between real agents on loopback (docs/protocol.md §11.13, docs/handlers.md "Several
//! providers"): each provider registers its own clients. The consumer's client comes from
//! its home and is rotated there while the standby hears nothing; the home killed with
//! `kill -9` while the need comes due, the standby registers a fresh client, whose
//! credentials the consumer gets (its files change once) and the token endpoint takes;
//! the old home back releases the entry it no longer serves (its GC reads `served_by`),
//! deleting the client it had registered with that client's registration access token,
//! and nothing of the standby's.
//!
//! An OpenID client never expires, so the need comes due the way an oidc need does in
//! service: the consumer raises `rotate` (a changed request is asked for at once, and
//! goes to the home only). A `check` that fails would do the same; a satisfied need
//! never moves, however long its home is down.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fort_tests::cleanup::{adopt_orphans, leftovers};
use fort_tests::oidc::OidcProvider;
use fort_tests::{eventually, Fleet};
use serde_json::{json, Value};

const TEST: &str =
    "oidc_failover::the_standby_registers_a_fresh_client_and_the_old_home_deletes_its_own";
const NEED: &str = "oidc/wiki";
const ENTRY: &str = "app:oidc/wiki";
const NAG: u64 = 2;
const FAILOVER_AFTER: u64 = 4;

/// `host` serves `oidc` at `op` with a state of its own: its clients, secrets and
/// registration access tokens.
fn provider(f: &mut Fleet, op: &OidcProvider, host: &str) {
    let dir = f.dir.path().to_path_buf();
    let config = dir.join(format!("oidc-{host}.json"));
    std::fs::write(
        &config,
        json!({
            "issuer": op.issuer,
            "initial_access_token_file": op.token_file,
            "state_file": dir.join(format!("handler-state/{host}/oidc.json")),
            "ca_file": op.ca_file,
            "allow": {"*": ["{origin}"]},
            "allow_grant_types": {"*": ["client_credentials"]},
        })
        .to_string(),
    )
    .unwrap();
    f.capability(
        host,
        "oidc",
        json!({"handler": fort_tests::bin("fort-handler"), "args": ["oidc", "--config", config],
               "mode": "async", "cacheResponse": true}),
    );
    // GC sweeps only when the test asks (`fort-agent gc`), with a short grace.
    f.host(host).extra_toml = "[gc]\ninterval = \"0s\"\ngrace = \"1s\"\ntimeout = \"3s\"\n".into();
}

/// app's client as files a service would read, from [e1, e2].
fn request(rotate: u64) -> Value {
    json!({"client_name": "app", "grant_types": ["client_credentials"], "rotate": rotate})
}

fn consumer(f: &mut Fleet) {
    let dir = f.dir.path().join("run/app");
    f.need_from(
        "app",
        NEED,
        &["e1", "e2"],
        json!({"nag_seconds": NAG, "failover_after_seconds": FAILOVER_AFTER,
               "request": request(0),
               "files": fort_tests::pointer_files(&dir, &["client_id", "client_secret", "issuer"])}),
    );
    f.host("app").extra_toml = "[fulfill]\nbackoff = \"1s\"\ntimeout = \"3s\"\n".into();
}

/// The consumer raises `rotate`: its need is due at once.
fn rotate(f: &mut Fleet, to: u64) {
    f.host("app").needs.get_mut(NEED).unwrap()["request"] = request(to);
    f.write_files();
    f.agents["app"].hup();
}

fn read(f: &Fleet, name: &str) -> String {
    std::fs::read_to_string(f.dir.path().join(format!("run/app/{name}"))).unwrap_or_default()
}

/// The client the consumer's files hold: (client_id, client_secret).
fn delivered(f: &Fleet) -> (String, String) {
    (read(f, "client_id"), read(f, "client_secret"))
}

/// What `host`'s handler keeps for app's entry: `{registration, client_secret, …}`.
fn held(f: &Fleet, host: &str) -> Value {
    handler_state(f, host)["clients"][ENTRY].clone()
}

fn handler_state(f: &Fleet, host: &str) -> Value {
    let path = f.dir.path().join(format!("handler-state/{host}/oidc.json"));
    let v: Value =
        serde_json::from_slice(&std::fs::read(path).unwrap_or_default()).unwrap_or(Value::Null);
    v["state"].clone()
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// The OpenID provider as a relying party and the handler's client management see it.
struct Op<'a> {
    op: &'a OidcProvider,
    http: reqwest::Client,
}

impl Op<'_> {
    fn new(op: &OidcProvider) -> Op<'_> {
        Op {
            op,
            http: op.http(),
        }
    }

    /// Whether a client_credentials grant with `id` and `secret` gets an access token; a
    /// refusal must be the provider's `invalid_client`.
    async fn gets_token(&self, id: &str, secret: &str) -> bool {
        let (status, body) = self.op.client_credentials(id, secret).await;
        if status == 200 {
            assert!(body["access_token"].is_string(), "{body}");
            true
        } else {
            assert_eq!(body["error"], "invalid_client", "{status} {body}");
            false
        }
    }

    /// The status of an RFC 7592 read of the client `held` (a handler's record of it)
    /// with its own registration access token.
    async fn registration_read(&self, held: &Value) -> u16 {
        let r = &held["registration"];
        self.http
            .get(r["registration_client_uri"].as_str().unwrap())
            .bearer_auth(r["registration_access_token"].as_str().unwrap())
            .send()
            .await
            .unwrap()
            .status()
            .as_u16()
    }
}

/// Records in `host`'s audit trail about anything app asked or was given.
fn heard_of_app(f: &Fleet, host: &str) -> Vec<Value> {
    fort_core::audit::read_lines(&f.host_dir(host).join("state/audit"))
        .unwrap_or_default()
        .into_iter()
        .filter_map(|l| l.record)
        .filter(|r| r["caller"] == "app" || r["consumer"] == "app")
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_standby_registers_a_fresh_client_and_the_old_home_deletes_its_own() {
    let op = match OidcProvider::start() {
        Ok(op) => op,
        Err(reason) => return fort_tests::skip(TEST, &reason),
    };
    // Whatever the agents and their handlers start is found after the test.
    adopt_orphans();
    let rp = Op::new(&op);
    let mut f = Fleet::new();
    provider(&mut f, &op, "e1");
    provider(&mut f, &op, "e2");
    consumer(&mut f);
    f.start();
    let status = |f: &Fleet| f.need_status("app", NEED);

    // The client from the home, whose credentials get a token.
    let mut first = None;
    for _ in 0..300 {
        let (id, secret) = delivered(&f);
        if status(&f)["state"] == "satisfied"
            && !secret.is_empty()
            && rp.gets_token(&id, &secret).await
        {
            first = Some((id, secret));
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (id0, secret0) = first.unwrap_or_else(|| panic!("no client from e1: {}", status(&f)));
    assert_eq!(read(&f, "issuer"), op.issuer);
    assert_eq!(status(&f)["from"], "e1");
    assert_eq!(held(&f, "e1")["registration"]["client_id"], id0.as_str());

    // Due while the home answers: the home rotates it (a new client at oidc-provider,
    // which keeps secrets; the old one deleted), and the standby hears nothing of it.
    rotate(&mut f, 1);
    let mut rotated = None;
    for _ in 0..300 {
        let (id, secret) = delivered(&f);
        if id != id0 && secret != secret0 && rp.gets_token(&id, &secret).await {
            rotated = Some((id, secret));
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (id1, secret1) = rotated.unwrap_or_else(|| panic!("not rotated by e1: {}", status(&f)));
    assert!(!rp.gets_token(&id0, &secret0).await, "e1 deleted the old");
    assert!(
        eventually(Duration::from_secs(20), || status(&f)["state"]
            == "satisfied")
        .await,
        "{}",
        status(&f)
    );
    let st = status(&f);
    assert_eq!(
        (&st["from"], &st["moves"]),
        (&json!("e1"), &json!(0)),
        "{st}"
    );
    let e1_client = held(&f, "e1");
    assert_eq!(e1_client["registration"]["client_id"], id1.as_str());
    assert!(
        f.entries("e2").is_empty(),
        "the standby holds an entry while the home answers: {:?}",
        f.entries("e2")
    );
    assert!(handler_state(&f, "e2")["clients"]
        .as_object()
        .is_none_or(|c| c.is_empty()));
    let heard = heard_of_app(&f, "e2");
    assert!(heard.is_empty(), "the standby heard of app: {heard:?}");
    assert!(
        !heard_of_app(&f, "e1").is_empty(),
        "the home's trail records app"
    );

    // The home dies; the consumer raises rotate again: the need is due, its requests to
    // e1 fail, and after failover_after it moves to e2, which registers a new client.
    f.kill("e1");
    let killed = Instant::now();
    let due = now();
    rotate(&mut f, 2);
    // Every client the files held on the way, to count the consumer's changes.
    let mut seen = vec![id1.clone()];
    let mut fresh = None;
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        let (id, secret) = delivered(&f);
        if !id.is_empty() && seen.last() != Some(&id) {
            seen.push(id.clone());
        }
        if id != id1
            && status(&f)["from"] == "e2"
            && status(&f)["state"] == "satisfied"
            && rp.gets_token(&id, &secret).await
        {
            fresh = Some((id, secret));
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let served = now() - due;
    let (id2, secret2) =
        fresh.unwrap_or_else(|| panic!("never served by the standby: {}", status(&f)));
    let st = status(&f);
    assert_eq!(st["moves"], 1, "{st}");
    assert!(
        st["moved_because"]
            .as_str()
            .unwrap_or_default()
            .starts_with("e1 failing since"),
        "{st}"
    );
    let moved = st["home_since"]
        .as_u64()
        .unwrap_or(u64::MAX)
        .saturating_sub(due);
    eprintln!(
        "the need moved {moved} s and the standby's client was delivered {served} s after it \
         came due ({:?} after the kill; failover after {FAILOVER_AFTER} s, nag {NAG} s)",
        killed.elapsed()
    );
    // The move, as the consumer recorded it, within failover_after and a nag interval
    // of coming due (two seconds of slack: whole-second clocks); then one registration.
    assert!(
        moved <= FAILOVER_AFTER + NAG + 2,
        "moved {moved} s after coming due: {st}"
    );
    assert!(
        served <= FAILOVER_AFTER + NAG + 10,
        "served {served} s after coming due"
    );
    assert_eq!(seen, [id1.clone(), id2.clone()], "the files changed once");
    assert_eq!(read(&f, "issuer"), op.issuer);
    // Registered by the standby, which keeps its own registration of it.
    let e2_client = held(&f, "e2");
    assert_eq!(e2_client["registration"]["client_id"], id2.as_str());
    assert_eq!(e2_client["client_secret"], secret2.as_str());
    assert_ne!(
        e2_client["registration"]["registration_access_token"],
        e1_client["registration"]["registration_access_token"]
    );
    // The old client lives until its provider releases it: e1 is down and cannot.
    assert!(rp.gets_token(&id1, &secret1).await);
    assert_eq!(rp.registration_read(&e1_client).await, 200);

    // The old home comes back: its GC reads from app's needs list that e2 serves the
    // need, releases the entry, and its handler deletes the client it had registered.
    f.start_host("e1");
    let back = Instant::now();
    assert!(
        eventually(Duration::from_secs(60), || {
            let (ok, out) = f.admin("e1", &["gc"]);
            assert!(ok, "{out}");
            !f.entries("e1").iter().any(|e| e == ENTRY)
        })
        .await,
        "e1 kept its entry: {:?}",
        f.entries("e1")
    );
    let mut deleted = false;
    for _ in 0..300 {
        if !rp.gets_token(&id1, &secret1).await {
            deleted = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(deleted, "e1's client still gets tokens");
    eprintln!(
        "the old home released the entry and deleted its client {:?} after it came back \
         (GC swept on demand, grace 1 s)",
        back.elapsed()
    );
    // Deleted at the provider, registration and all: its own registration access token
    // reads nothing any more.
    assert_eq!(rp.registration_read(&e1_client).await, 401);
    let e1_state = handler_state(&f, "e1");
    assert!(e1_state["clients"].get(ENTRY).is_none(), "{e1_state}");
    assert!(e1_state["retired"].is_null(), "{e1_state}");

    // Nothing of the standby's was touched, and the consumer keeps its client; a few nag
    // intervals pass first (e1 ran its handler over what was left, redelivered nothing).
    tokio::time::sleep(Duration::from_secs(2 * NAG)).await;
    assert!(rp.gets_token(&id2, &secret2).await, "the standby's client");
    assert_eq!(rp.registration_read(&e2_client).await, 200);
    assert_eq!(held(&f, "e2"), e2_client);
    assert_eq!(delivered(&f), (id2, secret2), "nothing changed at app");
    let st = status(&f);
    assert_eq!(
        (&st["from"], &st["moves"]),
        (&json!("e2"), &json!(1)),
        "{st}"
    );
    assert!(f.entries("e2").iter().any(|e| e == ENTRY));

    // Everything the test started stops with it, handlers included.
    drop(f);
    drop(rp);
    drop(op);
    let left = leftovers(&[]);
    assert!(left.is_empty(), "left running: {left:?}");
}
