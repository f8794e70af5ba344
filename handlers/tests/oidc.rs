//! The oidc capability against a real OpenID provider (npm's oidc-provider, run by node):
//! handler runs fed by hand (stdin → stdout), asserting what a user of the provider sees:
//! the delivered client gets tokens at the token endpoint, a changed redirect URI is what
//! the provider holds, a rotated secret replaces the old one, a released client is gone,
//! a client registered by hand is never touched, refusals say why, and a provider that is
//! down fails the run. The whole fleet (real agents) is in `oidc_fleet.rs`.

use std::path::PathBuf;
use std::process::Command;

use fort_tests::oidc::OidcProvider;
use serde_json::{json, Value};

/// A started provider, or a recorded skip.
fn provider(test: &str) -> Option<OidcProvider> {
    match OidcProvider::start() {
        Ok(p) => Some(p),
        Err(reason) => {
            fort_tests::skip(test, &reason);
            None
        }
    }
}

struct Setup {
    op: OidcProvider,
    dir: tempfile::TempDir,
    config: PathBuf,
    /// The state key the runs get (`FORT_STATE_KEY_FILE`); none: plaintext state.
    state_key: Option<PathBuf>,
}

impl Setup {
    fn new(op: OidcProvider, extra: Value) -> Setup {
        let dir = tempfile::tempdir().unwrap();
        let mut config = json!({
            "issuer": op.issuer,
            "initial_access_token_file": op.token_file,
            "state_file": dir.path().join("state/oidc.json"),
            "ca_file": op.ca_file,
            "allow": {"app": ["wiki", "ci"], "*": ["{origin}"]},
            "allow_redirect_uris": {"app": ["https://wiki.example.org/"]},
            "allow_grant_types": {
                "*": ["authorization_code", "refresh_token"],
                "app": ["client_credentials"],
            },
        });
        for (k, v) in extra.as_object().unwrap() {
            config[k] = v.clone();
        }
        let path = dir.path().join("oidc.json");
        std::fs::write(&path, config.to_string()).unwrap();
        Setup {
            op,
            dir,
            config: path,
            state_key: None,
        }
    }

    fn state_file(&self) -> PathBuf {
        self.dir.path().join("state/oidc.json")
    }

    /// The handler's state, opened with the state key when the runs get one.
    fn state(&self) -> Value {
        let key = self
            .state_key
            .as_ref()
            .map(|k| fort_core::sealed::StateKey::load(k).unwrap());
        let read = fort_core::sealed::read(&self.state_file(), key.as_ref())
            .unwrap()
            .unwrap();
        serde_json::from_slice(&read.plain).unwrap()
    }

    /// One handler run as the agent makes it: (exit ok, stdout as JSON, stderr).
    fn run(&self, input: &Value) -> (bool, Value, String) {
        let key = self.state_key.as_ref().map(|k| k.display().to_string());
        let mut env = vec![("FORT_HOST", "id")];
        if let Some(k) = &key {
            env.push((fort_core::sealed::KEY_FILE_ENV, k));
        }
        fort_tests::run_handler("oidc", &self.config, "request", &env, input)
    }

    /// A run that must succeed; it must not log a secret or a token.
    fn ok(&self, input: &Value) -> Value {
        let (ok, out, err) = self.run(input);
        assert!(ok, "handler failed: {err}");
        assert!(!err.contains(&self.op.initial_token), "{err}");
        for response in out.as_object().unwrap().values() {
            if let Some(secret) = response.get("client_secret").and_then(Value::as_str) {
                assert!(!err.contains(secret), "a secret in the log: {err}");
            }
        }
        out
    }

    fn http(&self) -> reqwest::Client {
        self.op.http()
    }

    /// The token endpoint's answer to a client_credentials grant: (status, body).
    fn client_credentials(&self, client_id: &str, secret: &str) -> (u16, Value) {
        block(self.op.client_credentials(client_id, secret))
    }

    /// `cred` gets an access token.
    fn gets_token(&self, cred: &Value) -> bool {
        let (status, body) = self.client_credentials(
            cred["client_id"].as_str().unwrap(),
            cred["client_secret"].as_str().unwrap(),
        );
        if status == 200 {
            assert!(body["access_token"].is_string(), "{body}");
            true
        } else {
            assert_eq!(body["error"], "invalid_client", "{status} {body}");
            false
        }
    }

    /// An RFC 7592 call with a registration access token: (status, body).
    fn manage(&self, method: reqwest::Method, uri: &str, token: &str) -> (u16, Value) {
        block(async {
            let r = self
                .http()
                .request(method, uri)
                .bearer_auth(token)
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
        })
    }

    /// A client registered by hand at the provider with the initial access token.
    fn register_by_hand(&self, metadata: Value) -> Value {
        block(async {
            let r = self
                .http()
                .post(self.op.registration_endpoint())
                .bearer_auth(&self.op.initial_token)
                .json(&metadata)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status().as_u16(), 201);
            r.json().await.unwrap()
        })
    }
}

fn block<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

/// `{key: {"request": …, "response": …}}` with each response taken from `previous`.
fn input(requests: &[(&str, Value)], previous: &Value) -> Value {
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

fn wiki(redirect: &str) -> Value {
    json!({"client_name": "wiki", "redirect_uris": [redirect],
           "grant_types": ["authorization_code", "client_credentials"],
           "scopes": ["openid", "email"]})
}

fn ci(rotate: u64) -> Value {
    json!({"client_name": "ci", "grant_types": ["client_credentials"], "rotate": rotate})
}

#[test]
fn clients_get_tokens_change_rotate_and_release_and_hand_made_clients_stay() {
    let Some(op) =
        provider("clients_get_tokens_change_rotate_and_release_and_hand_made_clients_stay")
    else {
        return;
    };
    let s = Setup::new(op, json!({}));
    let by_hand = s.register_by_hand(json!({
        "client_name": "admin-tool", "grant_types": ["client_credentials"],
        "response_types": [], "redirect_uris": []
    }));
    let hand_uri = by_hand["registration_client_uri"]
        .as_str()
        .unwrap()
        .to_owned();
    let hand_token = by_hand["registration_access_token"]
        .as_str()
        .unwrap()
        .to_owned();
    let hand_made_intact = |s: &Setup| {
        assert!(
            s.gets_token(&by_hand),
            "the hand-made client lost its secret"
        );
        let (status, held) = s.manage(reqwest::Method::GET, &hand_uri, &hand_token);
        assert_eq!(status, 200, "{held}");
        assert_eq!(held["client_name"], "admin-tool");
    };

    // Registered: each client gets tokens at the provider's token endpoint.
    let first = s.ok(&input(
        &[
            ("app:oidc/wiki", wiki("https://wiki.example.org/cb")),
            ("app:oidc/ci", ci(0)),
        ],
        &Value::Null,
    ));
    let (wiki1, ci1) = (&first["app:oidc/wiki"], &first["app:oidc/ci"]);
    assert_eq!(wiki1["issuer"], s.op.issuer);
    assert_eq!(
        wiki1.as_object().unwrap().keys().collect::<Vec<_>>(),
        ["client_id", "client_secret", "issuer"]
    );
    assert!(s.gets_token(wiki1) && s.gets_token(ci1));
    assert_ne!(wiki1["client_id"], ci1["client_id"]);
    use std::os::unix::fs::MetadataExt;
    let mode = std::fs::metadata(s.dir.path().join("state/oidc.json"))
        .unwrap()
        .mode();
    assert_eq!(mode & 0o777, 0o600);

    // Unchanged: the same answer.
    let again = s.ok(&input(
        &[
            ("app:oidc/wiki", wiki("https://wiki.example.org/cb")),
            ("app:oidc/ci", ci(0)),
        ],
        &first,
    ));
    assert_eq!(again, first);

    // A changed redirect URI is what the provider holds (read back by RFC 7592 with the
    // registration access token from the handler's state); the credential stays.
    let changed = s.ok(&input(
        &[
            (
                "app:oidc/wiki",
                wiki("https://wiki.example.org/auth/callback"),
            ),
            ("app:oidc/ci", ci(0)),
        ],
        &first,
    ));
    assert_eq!(changed["app:oidc/wiki"], *wiki1);
    let state = s.state();
    let reg = &state["state"]["clients"]["app:oidc/wiki"]["registration"];
    let (status, held) = s.manage(
        reqwest::Method::GET,
        reg["registration_client_uri"].as_str().unwrap(),
        reg["registration_access_token"].as_str().unwrap(),
    );
    assert_eq!(status, 200, "{held}");
    assert_eq!(
        held["redirect_uris"],
        json!(["https://wiki.example.org/auth/callback"])
    );
    assert!(s.gets_token(wiki1));

    // Rotation: the old secret stops working, the new one works.
    let rotated = s.ok(&input(
        &[
            (
                "app:oidc/wiki",
                wiki("https://wiki.example.org/auth/callback"),
            ),
            ("app:oidc/ci", ci(1)),
        ],
        &changed,
    ));
    let ci2 = &rotated["app:oidc/ci"];
    assert_ne!(ci2["client_secret"], ci1["client_secret"]);
    assert!(s.gets_token(ci2), "the new secret fails");
    assert!(!s.gets_token(ci1), "the old secret still works");
    assert_eq!(rotated["app:oidc/wiki"], *wiki1);
    assert!(
        s.state()["state"]["retired"].is_null(),
        "the old client was not deleted"
    );

    // Release: the client is deleted at the provider, its credentials fail.
    let released = s.ok(&input(&[("app:oidc/ci", ci(1))], &rotated));
    assert_eq!(released["app:oidc/ci"], *ci2);
    assert!(!s.gets_token(wiki1), "a released client still gets tokens");
    let (status, _) = s.manage(
        reqwest::Method::GET,
        reg["registration_client_uri"].as_str().unwrap(),
        reg["registration_access_token"].as_str().unwrap(),
    );
    assert_eq!(status, 401);
    assert!(s.state()["state"]["clients"]["app:oidc/wiki"].is_null());

    // Everything released: only the hand-made client is left, untouched throughout.
    s.ok(&json!({}));
    assert!(!s.gets_token(ci2));
    hand_made_intact(&s);
}

#[test]
fn refusals_are_per_entry_and_a_provider_that_is_down_fails_the_run() {
    let Some(op) = provider("refusals_are_per_entry_and_a_provider_that_is_down_fails_the_run")
    else {
        return;
    };
    let mut s = Setup::new(op, json!({}));
    let requests = [
        ("app:oidc/wiki", wiki("https://wiki.example.org/cb")),
        // A name, a redirect URI and a grant type outside the caller's allowance.
        (
            "app:oidc/name",
            json!({"client_name": "grafana", "redirect_uris": ["https://wiki.example.org/x"]}),
        ),
        (
            "app:oidc/redirect",
            json!({"client_name": "wiki", "redirect_uris": ["https://evil.example.org/cb"]}),
        ),
        (
            "app:oidc/lookalike",
            json!({"client_name": "wiki", "redirect_uris": ["https://wiki.example.org.evil.test/cb"]}),
        ),
        (
            "web:oidc/m2m",
            json!({"client_name": "web", "grant_types": ["client_credentials"]}),
        ),
        // A scope the provider does not know: its own refusal, for this entry only.
        (
            "app:oidc/scope",
            json!({"client_name": "ci", "grant_types": ["client_credentials"], "scopes": ["payments"]}),
        ),
        (
            "app:oidc/bad",
            json!({"client_name": "wiki\n", "rotate": -1}),
        ),
    ];
    let out = s.ok(&input(&requests, &Value::Null));
    let reason = |key: &str| out[key]["$fort_refused"].as_str().unwrap_or("").to_owned();
    assert!(s.gets_token(&out["app:oidc/wiki"]));
    assert!(reason("app:oidc/name").contains("may not register the client name grafana"));
    assert!(reason("app:oidc/redirect").contains("https://evil.example.org/cb"));
    assert!(reason("app:oidc/lookalike").contains("may not register the redirect URI"));
    assert!(reason("web:oidc/m2m").contains("grant type client_credentials"));
    let scope = reason("app:oidc/scope");
    assert!(scope.contains("400") && scope.contains("scope"), "{scope}");
    assert!(reason("app:oidc/bad").starts_with("request"));
    for r in out.as_object().unwrap().values() {
        if let Some(r) = r["$fort_refused"].as_str() {
            assert!(r.len() <= 400 && !r.chars().any(char::is_control), "{r}");
        }
    }
    let clients = s.state()["state"]["clients"].as_object().unwrap().len();
    assert_eq!(clients, 1, "only the allowed entry has a client");

    // A provider that is down: unchanged entries are still answered from the state, a
    // change fails the run and nothing is revoked.
    s.op.stop();
    let kept = s.ok(&input(&requests[..1], &out));
    assert_eq!(kept["app:oidc/wiki"], out["app:oidc/wiki"]);
    let before = s.state();
    let (ok, _, err) = s.run(&input(
        &[("app:oidc/wiki", wiki("https://wiki.example.org/new"))],
        &out,
    ));
    assert!(!ok && err.contains("Connection refused"), "{err}");
    let (ok, _, _) = s.run(&json!({}));
    assert!(!ok, "a release with the provider down must fail the run");
    assert_eq!(s.state(), before, "a failed run changed the state");
}

#[test]
fn a_wrong_initial_access_token_fails_the_run_without_showing_it() {
    let Some(op) = provider("a_wrong_initial_access_token_fails_the_run_without_showing_it") else {
        return;
    };
    let wrong = op.dir.path().join("wrong-token");
    std::fs::write(&wrong, "not-the-token-0123456789\n").unwrap();
    let s = Setup::new(
        op,
        json!({"initial_access_token_file": wrong, "registration_endpoint": null}),
    );
    let (ok, _, err) = s.run(&input(&[("app:oidc/ci", ci(0))], &Value::Null));
    assert!(!ok && err.contains("initial access token"), "{err}");
    assert!(!err.contains("not-the-token"), "{err}");
    // And --check finds a config whose token file is missing.
    let missing = s.dir.path().join("bad.json");
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(&s.config).unwrap()).unwrap();
    config["initial_access_token_file"] = json!("/nonexistent/token");
    std::fs::write(&missing, config.to_string()).unwrap();
    let check = Command::new(fort_tests::bin("fort-handler"))
        .args(["oidc", "--check", "--config"])
        .arg(&missing)
        .output()
        .unwrap();
    assert!(!check.status.success());
    assert!(String::from_utf8_lossy(&check.stderr).contains("/nonexistent/token"));
}

/// With a state key (docs/at-rest.md) the handler's state is sealed: no file it keeps
/// holds a client secret or a registration access token; a second run over the sealed
/// state keeps the client (it still authenticates, nothing is registered again); a
/// changed file is refused and the provider's clients stay as they were.
#[test]
fn sealed_state_holds_no_secret_keeps_the_client_and_a_changed_file_touches_nothing() {
    let test = "sealed_state_holds_no_secret_keeps_the_client_and_a_changed_file_touches_nothing";
    let Some(op) = provider(test) else {
        return;
    };
    let mut s = Setup::new(op, json!({}));
    s.state_key = Some(fort_tests::state_key_file(&s.dir.path().join("state-key")));
    let want = [("app:oidc/ci", ci(0))];
    let first = s.ok(&input(&want, &Value::Null));
    let cred = &first["app:oidc/ci"];
    assert!(s.gets_token(cred));
    let reg = s.state()["state"]["clients"]["app:oidc/ci"]["registration"].clone();
    let (uri, token) = (
        reg["registration_client_uri"].as_str().unwrap().to_owned(),
        reg["registration_access_token"]
            .as_str()
            .unwrap()
            .to_owned(),
    );
    let state_dir = s.dir.path().join("state");
    assert!(fort_core::sealed::is_sealed(
        &std::fs::read(s.state_file()).unwrap()
    ));
    for secret in [cred["client_secret"].as_str().unwrap(), &token] {
        assert_eq!(
            fort_tests::files_holding(&state_dir, secret.as_bytes()),
            Vec::<PathBuf>::new(),
            "a secret is readable from a copy of the state"
        );
    }

    // Over the sealed state: the same client, still authenticating, still managed.
    let again = s.ok(&input(&want, &first));
    assert_eq!(again, first, "no new client, no rotation");
    assert!(s.gets_token(cred));
    assert_eq!(s.manage(reqwest::Method::GET, &uri, &token).0, 200);

    // A changed state file: the run fails naming it; at the provider nothing changed.
    fort_tests::change_sealed_member(&s.state_file(), "data");
    let (ok, out, err) = s.run(&input(&want, &Value::Null));
    assert!(!ok, "a run on a changed state file succeeded: {out}");
    assert!(
        err.contains("authentication of the sealed contents failed")
            && err.contains(&s.state_file().display().to_string()),
        "{err}"
    );
    assert!(s.gets_token(cred), "the client lost its secret");
    let (status, held) = s.manage(reqwest::Method::GET, &uri, &token);
    assert_eq!(status, 200, "{held}");
    assert_eq!(held["client_id"], cred["client_id"]);
}
