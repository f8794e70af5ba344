//! The signed-request pipeline against a real agent: every negative case gets its status,
//! runs no handler and changes no state; OpenSSH interoperates both ways.

use std::process::Command;

use fort_core::canonical::{request_bytes, response_bytes};
use fort_core::sign::{verify, Signer};
use fort_core::wire::unix_now;
use fort_tests::{eventually, raw_http, raw_post, signed_headers, write_key, Fleet};
use serde_json::json;
use std::time::Duration;

/// Host `a` serves rpc `echo` (allowed: ops) whose handler appends to a marker file, so
/// "no handler ran" is observable; host `b` trusts the same principals.
fn fleet() -> (Fleet, std::path::PathBuf) {
    let mut f = Fleet::new();
    f.principal("ops");
    f.principal("intruder");
    let marker = f.dir.path().join("marker");
    let echo = f.script("echo", &format!("echo run >> {}; cat", marker.display()));
    f.capability(
        "a",
        "echo",
        json!({"handler": echo, "mode": "rpc", "allowed": ["ops"]}),
    );
    f.host("b");
    f.start();
    (f, marker)
}

fn runs(marker: &std::path::Path) -> usize {
    std::fs::read_to_string(marker)
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

const PATH: &str = "/agent/capabilities/echo";

fn send(
    f: &Fleet,
    host: &str,
    path: &str,
    headers: &[(String, String)],
    body: &[u8],
) -> (u16, String, Vec<u8>) {
    raw_http(&f.hosts[host], &raw_post(path, headers, body))
}

fn ops_headers(f: &Fleet, target: &str, path: &str, body: &[u8], ts: u64) -> Vec<(String, String)> {
    signed_headers(&f.principals["ops"], "ops", target, path, body, ts)
}

#[tokio::test]
async fn a_valid_call_runs_the_handler_and_the_reply_is_signed() {
    let (f, marker) = fleet();
    let r = f.post("ops", "a", PATH, &json!({"x": 1})).await;
    assert_eq!(r.status, 200);
    assert!(r.verified(), "{:?}", r.auth);
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&r.body).unwrap(),
        json!({"x": 1})
    );
    assert_eq!(r.content_type.as_deref(), Some("application/json"));
    assert_eq!(runs(&marker), 1);
}

#[tokio::test]
async fn tampering_after_signing_is_refused_and_runs_nothing() {
    let (f, marker) = fleet();
    let body = br#"{"a":1}"#;
    let now = unix_now();
    type Case<'a> = (&'a str, Vec<(String, String)>, Vec<u8>, &'a str);
    let cases: Vec<Case> = vec![
        (
            "byte flipped",
            ops_headers(&f, "a", PATH, body, now),
            br#"{"a":2}"#.to_vec(),
            PATH,
        ),
        (
            "re-serialised",
            ops_headers(&f, "a", PATH, body, now),
            br#"{ "a": 1 }"#.to_vec(),
            PATH,
        ),
        (
            "other path",
            ops_headers(&f, "a", "/agent/capabilities/status", body, now),
            body.to_vec(),
            PATH,
        ),
        (
            "other host",
            ops_headers(&f, "b", PATH, body, now),
            body.to_vec(),
            PATH,
        ),
    ];
    for (what, headers, sent, path) in cases {
        let (status, _, resp) = send(&f, "a", path, &headers, &sent);
        assert_eq!(status, 401, "{what}");
        assert_eq!(resp, br#"{"error":"unauthorized"}"#, "{what}");
    }
    // Each signed header changed after signing.
    for (i, name) in ["X-Fort-Origin", "X-Fort-Timestamp", "X-Fort-Nonce"]
        .iter()
        .enumerate()
    {
        let mut h = ops_headers(&f, "a", PATH, body, now);
        h[i].1 = match i {
            0 => "intruder".into(),
            1 => (now + 1).to_string(),
            _ => fort_core::client::new_nonce(),
        };
        let (status, _, _) = send(&f, "a", PATH, &h, body);
        assert_eq!(status, 401, "{name} changed");
    }
    assert_eq!(runs(&marker), 0);
}

#[tokio::test]
async fn delivered_to_another_host_that_trusts_the_origin_is_refused() {
    let (f, _) = fleet();
    // Signed for a, sent to b: b builds its own target line and the signature fails.
    let body = b"{}";
    let h = ops_headers(&f, "a", "/agent/capabilities/status", body, unix_now());
    let (status, _, _) = send(&f, "b", "/agent/capabilities/status", &h, body);
    assert_eq!(status, 401);
    // The same request signed for b is fine.
    let h = ops_headers(&f, "b", "/agent/capabilities/status", body, unix_now());
    assert_eq!(send(&f, "b", "/agent/capabilities/status", &h, body).0, 200);
}

#[tokio::test]
async fn replay_and_clock_window() {
    let (f, marker) = fleet();
    let body = b"{}";
    let h = ops_headers(&f, "a", PATH, body, unix_now());
    assert_eq!(send(&f, "a", PATH, &h, body).0, 200);
    let (status, _, resp) = send(&f, "a", PATH, &h, body);
    assert_eq!(status, 401, "replay");
    assert_eq!(resp, br#"{"error":"unauthorized"}"#);
    assert_eq!(runs(&marker), 1);

    let now = unix_now();
    for ts in [now + 301, now - 301] {
        let (status, head, _) = send(&f, "a", PATH, &ops_headers(&f, "a", PATH, body, ts), body);
        assert_eq!(status, 401, "ts {ts}");
        assert!(
            head.to_ascii_lowercase().contains("x-fort-server-time:"),
            "{head}"
        );
    }
    for ts in [now + 299, now - 299] {
        assert_eq!(
            send(&f, "a", PATH, &ops_headers(&f, "a", PATH, body, ts), body).0,
            200,
            "ts {ts}"
        );
    }
    assert_eq!(runs(&marker), 3);
}

#[tokio::test]
async fn replay_is_refused_after_a_restart() {
    let (mut f, marker) = fleet();
    let body = b"{}";
    let h = ops_headers(&f, "a", PATH, body, unix_now());
    assert_eq!(send(&f, "a", PATH, &h, body).0, 200);
    f.kill("a");
    f.start_host("a");
    assert_eq!(send(&f, "a", PATH, &h, body).0, 401);
    assert_eq!(runs(&marker), 1);
}

#[tokio::test]
async fn malformed_duplicate_and_missing_headers() {
    let (f, marker) = fleet();
    let body = b"{}";
    let good = ops_headers(&f, "a", PATH, body, unix_now());
    let mut cases: Vec<Vec<(String, String)>> = Vec::new();
    // Missing each header.
    for i in 0..4 {
        let mut h = good.clone();
        h.remove(i);
        cases.push(h);
    }
    // Duplicated each header.
    for i in 0..4 {
        let mut h = good.clone();
        h.push(h[i].clone());
        cases.push(h);
    }
    let bad_values = [
        (1, "0123"),
        (1, "17e9"),
        (1, "1234567890123"),
        (2, "00112233445566778899AABBCCDDEEFF"),
        (2, "0011"),
        (3, "!!!notbase64!!!"),
    ];
    for (i, v) in bad_values {
        let mut h = ops_headers(&f, "a", PATH, body, unix_now());
        h[i].1 = v.to_owned();
        cases.push(h);
    }
    // Oversized signature.
    let mut h = ops_headers(&f, "a", PATH, body, unix_now());
    h[3].1 = "A".repeat(2052);
    cases.push(h);
    // Valid base64 with trailing bytes in the blob.
    let mut h = ops_headers(&f, "a", PATH, body, unix_now());
    h[3].1 = format!("{}AAAA", h[3].1.trim_end_matches('='));
    cases.push(h);
    for (n, h) in cases.iter().enumerate() {
        let (status, _, resp) = send(&f, "a", PATH, h, body);
        assert_eq!(status, 401, "case {n}: {h:?}");
        assert_eq!(resp, br#"{"error":"unauthorized"}"#);
    }
    assert_eq!(runs(&marker), 0);
}

#[tokio::test]
async fn wrong_keys_are_refused() {
    let (f, marker) = fleet();
    let body = b"{}";
    // b's key signing under a's name.
    let h = signed_headers(&f.hosts["b"].signer, "a", "a", PATH, body, unix_now());
    assert_eq!(send(&f, "a", PATH, &h, body).0, 401);
    // A valid key that is in no registry, as ops.
    let h = signed_headers(&Signer::generate(), "ops", "a", PATH, body, unix_now());
    assert_eq!(send(&f, "a", PATH, &h, body).0, 401);
    assert_eq!(runs(&marker), 0);
}

#[tokio::test]
async fn paths_are_strict() {
    let (f, marker) = fleet();
    let body = b"{}";
    for path in [
        "/agent/capabilities/%65cho",
        "/agent/capabilities/echo/",
        "/agent//capabilities/echo",
        "/agent/capabilities/echo?x=1",
        "/agent/capabilities/ECHO",
        "/agent/capabilities/../capabilities/echo",
        "/agent/other",
    ] {
        let h = ops_headers(&f, "a", path, body, unix_now());
        let (status, _, _) = send(&f, "a", path, &h, body);
        assert!(status == 400 || status == 404, "{path}: {status}");
    }
    // Any method but POST.
    let (status, _, _) = raw_http(
        &f.hosts["a"],
        format!("GET {PATH} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
    );
    assert_eq!(status, 405);
    assert_eq!(runs(&marker), 0);
}

#[tokio::test]
async fn body_over_the_limit_is_413_without_a_signature_check() {
    let (f, marker) = fleet();
    let big = vec![b' '; 1024 * 1024 + 1];
    let h = vec![("X-Fort-Origin".to_owned(), "nobody".to_owned())];
    // Only the head goes out: the agent must answer from the declared length alone,
    // without waiting for (or reading) a byte of the body.
    let request = raw_post(PATH, &h, &big);
    let head_end = request.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
    let (status, _, _) = raw_http(&f.hosts["a"], &request[..head_end]);
    assert_eq!(status, 413);
    assert_eq!(runs(&marker), 0);
}

#[tokio::test]
async fn callers_not_permitted_get_403() {
    let (f, marker) = fleet();
    let r = f.post("intruder", "a", PATH, &json!({})).await;
    assert_eq!(r.status, 403);
    assert!(r.verified(), "403 after a verified signature is signed");
    // Operator built-ins are closed unless listed in [access].
    let r = f
        .post(
            "ops",
            "a",
            "/agent/capabilities/journal",
            &json!({"unit": "x.service"}),
        )
        .await;
    assert_eq!(r.status, 403);
    let r = f
        .post("ops", "a", "/agent/capabilities/nonexistent", &json!({}))
        .await;
    assert_eq!(r.status, 404);
    assert_eq!(runs(&marker), 0);
}

fn ssh_keygen_sign(key: &std::path::Path, namespace: &str, hash: &str, msg: &[u8]) -> String {
    use std::io::Write;
    let mut child = Command::new("ssh-keygen")
        .args([
            "-q",
            "-Y",
            "sign",
            "-n",
            namespace,
            "-O",
            &format!("hashalg={hash}"),
            "-f",
        ])
        .arg(key)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("ssh-keygen is installed (openssh-client)");
    child.stdin.take().unwrap().write_all(msg).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter(|l| !l.starts_with("-----"))
        .collect()
}

#[tokio::test]
async fn openssh_signed_requests_interoperate() {
    let (f, marker) = fleet();
    let key = f.dir.path().join("ops-key");
    write_key(&key, &f.principals["ops"]);
    let body = br#"{"from":"openssh"}"#;
    let mut results = Vec::new();
    for (ns, hash) in [
        ("fort-agent", "sha512"),
        ("git", "sha512"),
        ("file", "sha512"),
        ("fort-agent", "sha256"),
    ] {
        let ts = unix_now().to_string();
        let nonce = fort_core::client::new_nonce();
        let canonical = request_bytes("a", PATH, "ops", &ts, &nonce, body);
        let sig = ssh_keygen_sign(&key, ns, hash, &canonical);
        let headers = vec![
            ("X-Fort-Origin".to_owned(), "ops".to_owned()),
            ("X-Fort-Timestamp".to_owned(), ts),
            ("X-Fort-Nonce".to_owned(), nonce.clone()),
            ("X-Fort-Signature".to_owned(), sig),
        ];
        let (status, head, resp) = send(&f, "a", PATH, &headers, body);
        results.push((ns, hash, status));
        if status == 200 {
            // And the agent's response signature verifies with ssh-keygen -Y verify.
            let sig_line = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .starts_with("x-fort-signature:")
                        .then(|| l[17..].trim().to_owned())
                })
                .expect("signed response");
            let msg = response_bytes("a", &nonce, 200, &resp);
            assert_eq!(
                verify(&sig_line, &[f.hosts["a"].signer.public_key().clone()], &msg),
                Ok(())
            );
            let dir = f.dir.path();
            let armored: Vec<String> = sig_line
                .as_bytes()
                .chunks(70)
                .map(|c| String::from_utf8(c.to_vec()).unwrap())
                .collect();
            std::fs::write(
                dir.join("resp.sig"),
                format!(
                    "-----BEGIN SSH SIGNATURE-----\n{}\n-----END SSH SIGNATURE-----\n",
                    armored.join("\n")
                ),
            )
            .unwrap();
            std::fs::write(
                dir.join("allowed"),
                format!(
                    "a namespaces=\"fort-agent\" {}\n",
                    f.hosts["a"].signer.public_openssh()
                ),
            )
            .unwrap();
            std::fs::write(dir.join("resp.msg"), &msg).unwrap();
            let out = Command::new("ssh-keygen")
                .args(["-Y", "verify", "-n", "fort-agent", "-I", "a", "-f"])
                .arg(dir.join("allowed"))
                .arg("-s")
                .arg(dir.join("resp.sig"))
                .stdin(std::fs::File::open(dir.join("resp.msg")).unwrap())
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "ssh-keygen -Y verify: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    assert_eq!(
        results,
        vec![
            ("fort-agent", "sha512", 200),
            ("git", "sha512", 401),
            ("file", "sha512", 401),
            ("fort-agent", "sha256", 401)
        ]
    );
    assert_eq!(runs(&marker), 1);
}

#[tokio::test]
async fn the_cli_does_not_follow_redirects() {
    use std::io::{Read, Write};
    let mut f = Fleet::new();
    let ops = f.principal("ops");
    // Not an agent: a listener that answers every request with a redirect to a second
    // listener, which must never be contacted.
    let redirector = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let target = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    target.set_nonblocking(true).unwrap();
    let location = format!(
        "http://{}/agent/capabilities/status",
        target.local_addr().unwrap()
    );
    let raddr = redirector.local_addr().unwrap();
    std::thread::spawn(move || {
        if let Ok((mut s, _)) = redirector.accept() {
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf);
            let _ = write!(s, "HTTP/1.1 302 Found\r\nLocation: {location}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        }
    });
    let hosts = json!({"hosts": {"redir": {"address": format!("http://{raddr}"), "keys": [Signer::generate().public_openssh()]}},
                       "principals": {"ops": {"keys": [ops.public_openssh()]}}});
    let dir = f.dir.path().to_path_buf();
    std::fs::write(dir.join("hosts.json"), hosts.to_string()).unwrap();
    write_key(&dir.join("key"), &ops);
    let out = Command::new(fort_tests::bin("fort"))
        .args(["--origin", "ops", "--key"])
        .arg(dir.join("key"))
        .arg("--hosts")
        .arg(dir.join("hosts.json"))
        .args(["--plaintext", "status", "redir"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not followed"));
    assert!(
        target.accept().is_err(),
        "the redirect target was contacted"
    );
    f.principals.clear();
}

/// `fort pin HOST` as an operator runs it (it needs no key of its own).
fn fort_pin(f: &Fleet, host: &str) -> String {
    let hosts = f.dir.path().join("hosts-for-pin.json");
    std::fs::write(&hosts, f.hosts_json().to_string()).unwrap();
    let out = Command::new(fort_tests::bin("fort"))
        .arg("--hosts")
        .arg(&hosts)
        .args(["pin", host])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

#[tokio::test]
async fn the_readme_s_hand_signing_script_works_with_the_right_pin_only() {
    if Command::new("curl").arg("--version").output().is_err() {
        fort_tests::skip(
            "the_readme_s_hand_signing_script_works_with_the_right_pin_only",
            "curl not found (apt-get install curl)",
        );
        return;
    }
    let (f, marker) = fleet();
    let key = f.dir.path().join("ops-key");
    write_key(&key, &f.principals["ops"]);
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/fort-curl.sh");
    let pin = fort_pin(&f, "a");
    assert!(pin.starts_with("sha256//"), "{pin}");
    let curl = |pin: &str| {
        Command::new("sh")
            .arg(&script)
            .arg(&key)
            .args([
                "ops",
                "a",
                &f.hosts["a"].address(),
                pin,
                PATH,
                r#"{"hand":"signed"}"#,
            ])
            .output()
            .unwrap()
    };
    let out = curl(&pin);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap(),
        json!({"hand": "signed"})
    );
    assert_eq!(runs(&marker), 1);
    // Another host's pin: curl aborts before sending a byte of the request.
    let wrong = fort_pin(&f, "b");
    let out = curl(&wrong);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("pinned"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(runs(&marker), 1, "the request reached the handler");
}

/// Sends headers and all of `body` but its last byte; returns the open connection.
fn stall(f: &Fleet, headers: &[(String, String)], body: &[u8]) -> fort_tests::TlsStream {
    use std::io::Write;
    let mut s = fort_tests::tls_connect(&f.hosts["a"]);
    let req = raw_post(PATH, headers, body);
    s.write_all(&req[..req.len() - 1]).unwrap();
    s.flush().unwrap();
    s
}

fn finish(mut s: fort_tests::TlsStream, last: u8) -> u16 {
    use std::io::{Read, Write};
    s.write_all(&[last]).unwrap();
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    String::from_utf8_lossy(&buf)
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn a_replay_whose_body_is_held_back_past_the_window_is_refused() {
    let mut f = Fleet::new();
    f.principal("ops");
    let marker = f.dir.path().join("marker");
    let echo = f.script("echo", &format!("echo run >> {}; cat", marker.display()));
    f.capability(
        "a",
        "echo",
        json!({"handler": echo, "mode": "rpc", "allowed": ["ops"]}),
    );
    f.host("a").extra_toml = "clock_skew = \"2s\"\nbody_read_timeout = \"30s\"\n".into();
    f.start();
    let body = br#"{"replay":"me"}"#;
    let h = ops_headers(&f, "a", PATH, body, unix_now());
    assert_eq!(send(&f, "a", PATH, &h, body).0, 200);
    // Inside the window: the replay's headers and most of its body.
    let held = stall(&f, &h, body);
    std::thread::sleep(std::time::Duration::from_millis(3500));
    // Any request makes the store forget expired nonces.
    assert_eq!(
        send(
            &f,
            "a",
            "/agent/capabilities/status",
            &ops_headers(&f, "a", "/agent/capabilities/status", b"{}", unix_now()),
            b"{}"
        )
        .0,
        200
    );
    assert_eq!(finish(held, *body.last().unwrap()), 401);
    assert_eq!(runs(&marker), 1);
}

#[tokio::test]
async fn slow_bodies_cannot_hold_every_slot() {
    let mut f = Fleet::new();
    f.principal("ops");
    f.host("a").extra_toml = "max_concurrent_requests = 4\nbody_read_timeout = \"1s\"\n".into();
    f.start();
    // No key needed for this: a known origin name and a body that never finishes.
    let fake = vec![
        ("X-Fort-Origin".to_owned(), "ops".to_owned()),
        ("X-Fort-Timestamp".to_owned(), unix_now().to_string()),
        ("X-Fort-Nonce".to_owned(), "0".repeat(32)),
        ("X-Fort-Signature".to_owned(), "AAAA".to_owned()),
    ];
    let held: Vec<_> = (0..4).map(|_| stall(&f, &fake, &[b' '; 100])).collect();
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let r = f
        .post("ops", "a", "/agent/capabilities/status", &json!({}))
        .await;
    assert_eq!(r.status, 200, "slots still held by slow bodies");
    for s in held {
        assert_eq!(finish(s, b' '), 408);
    }
}

/// Finding: connections that send a plausible head (a known origin, any nonce, a bogus
/// signature, a body length) and then never the body held every concurrency slot, and
/// signed callers got 503 for as long as the attack lasted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unauthenticated_stalls_do_not_deny_authenticated_callers() {
    use std::io::Write;
    let mut f = Fleet::new();
    f.principal("ops");
    f.host("a");
    f.start();
    let fake = vec![
        ("X-Fort-Origin".to_owned(), "a".to_owned()),
        ("X-Fort-Timestamp".to_owned(), unix_now().to_string()),
        ("X-Fort-Nonce".to_owned(), "0".repeat(32)),
        ("X-Fort-Signature".to_owned(), "AAAA".to_owned()),
    ];
    // Each promises a 1 MiB body (the largest allowed) and sends none of it: were the
    // promise charged, a handful would take all the memory set aside for such bodies.
    let mut head = format!("POST {PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: 1048576\r\n");
    for (k, v) in &fake {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    // 300 connections from twenty addresses (more than the 256 request slots there are).
    let mut held = Vec::new();
    for ip in 201..=220 {
        for _ in 0..15 {
            let mut s = fort_tests::tls_connect_from(&format!("127.0.0.{ip}"), &f.hosts["a"])
                .expect("connect");
            s.write_all(head.as_bytes()).unwrap();
            s.flush().unwrap();
            held.push(s);
        }
    }
    std::thread::sleep(std::time::Duration::from_millis(500));
    let started = std::time::Instant::now();
    for _ in 0..5 {
        let r = f
            .post("ops", "a", "/agent/capabilities/status", &json!({}))
            .await;
        assert_eq!(
            r.status, 200,
            "a signed caller was refused during the stall"
        );
    }
    assert!(started.elapsed() < std::time::Duration::from_secs(3));
    drop(held);
}

/// An unknown origin is refused exactly as a known one with a bad signature: after the
/// body, with the same status and body. Otherwise a stranger could list the fleet's
/// principals by timing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_and_known_origins_look_the_same_to_a_stranger() {
    let mut f = Fleet::new();
    f.principal("ops");
    f.host("a").extra_toml = "body_read_timeout = \"1s\"\n".into();
    f.start();
    let mut replies = Vec::new();
    for origin in ["ops", "nosuchname"] {
        let h = vec![
            ("X-Fort-Origin".to_owned(), origin.to_owned()),
            ("X-Fort-Timestamp".to_owned(), unix_now().to_string()),
            ("X-Fort-Nonce".to_owned(), "0".repeat(32)),
            ("X-Fort-Signature".to_owned(), "AAAA".to_owned()),
        ];
        // The body never comes: both wait for it the same time, both get the same reply.
        let mut req = format!("POST {PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n");
        for (k, v) in &h {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        req.push_str("\r\n");
        let started = std::time::Instant::now();
        let (status, _, body) = raw_http(&f.hosts["a"], req.as_bytes());
        replies.push((status, body, started.elapsed().as_millis() / 500));
        // And a complete body with a bad signature: 401 for both.
        let (status, _, body) = send(&f, "a", PATH, &h, b"{}");
        replies.push((status, body, 0));
    }
    assert_eq!(replies[0], replies[2], "{replies:?}");
    assert_eq!(replies[1], replies[3], "{replies:?}");
    assert_eq!(replies[1].0, 401);
}

/// A head that never ends holds little memory: hyper's read buffer is bounded well
/// below its default.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endless_heads_hold_little_memory() {
    use std::io::Write;
    let mut f = Fleet::new();
    f.host("a").extra_toml = "header_read_timeout = \"30s\"\n".into();
    f.start();
    let pid = f.agents["a"].pid();
    let rss = || {
        std::fs::read_to_string(format!("/proc/{pid}/status"))
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse::<u64>().ok())
            .unwrap()
    };
    let before = rss();
    let filler = format!("X-Filler: {}\r\n", "y".repeat(1000));
    let mut held = Vec::new();
    for ip in 221..=228 {
        for _ in 0..16 {
            let Ok(mut s) = fort_tests::tls_connect_from(&format!("127.0.0.{ip}"), &f.hosts["a"])
            else {
                continue;
            };
            let _ = s.write_all(format!("POST {PATH} HTTP/1.1\r\n").as_bytes());
            for _ in 0..400 {
                if s.write_all(filler.as_bytes()).is_err() {
                    break;
                }
            }
            let _ = s.flush();
            held.push(s);
        }
    }
    std::thread::sleep(std::time::Duration::from_millis(500));
    let grown = rss().saturating_sub(before);
    assert!(
        grown < 20_000,
        "{} heads of 400 KB grew the agent by {grown} kB",
        held.len()
    );
}

/// Finding: a principal with no permission at all filled the nonce store, and every
/// caller then got 503 until its nonces expired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_origin_cannot_lock_out_another_with_nonces() {
    let mut f = Fleet::new();
    f.principal("ops");
    f.principal("noisy");
    f.host("a").extra_toml = "nonce_capacity = 400\nnonce_quota_per_origin = 40\n".into();
    f.start();
    let mut statuses = Vec::new();
    for _ in 0..100 {
        let r = f
            .post("noisy", "a", "/agent/capabilities/status", &json!({}))
            .await;
        statuses.push(r.status);
    }
    let ok = statuses.iter().filter(|s| **s == 200).count();
    let told_to_wait = statuses.iter().filter(|s| **s == 429).count();
    assert_eq!((ok, told_to_wait), (40, 60), "{statuses:?}");
    let r = f
        .post("noisy", "a", "/agent/capabilities/status", &json!({}))
        .await;
    assert_eq!(r.status, 429);
    assert!(r.verified(), "a 429 after the signature is signed");
    let retry = r.retry_after.expect("Retry-After");
    assert!((1..=301).contains(&retry), "{retry}");
    for _ in 0..10 {
        let r = f
            .post("ops", "a", "/agent/capabilities/status", &json!({}))
            .await;
        assert_eq!(r.status, 200, "another origin was locked out");
    }
}

/// Finding: 100,000 pipelined unsigned requests wrote 100,000 log lines in 2 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_unsigned_requests_costs_a_bounded_number_of_log_lines() {
    use std::io::{Read, Write};
    let mut f = Fleet::new();
    let metrics = fort_tests::free_addr("127.0.0.1");
    f.host("a").extra_toml = format!("metrics_listen = \"{metrics}\"\n");
    f.start();
    let log = f.host_dir("a").join("agent.log");
    let lines_before = std::fs::read_to_string(&log).unwrap().lines().count();
    const FLOOD: usize = 20_000;
    const CHUNK: usize = 250;
    let one = b"POST /agent/needs HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n";
    let mut s = fort_tests::tls_connect(&f.hosts["a"]);
    let (mut answered, mut buf, mut tail) = (0usize, vec![0u8; 65536], Vec::new());
    for _ in 0..FLOOD / CHUNK {
        s.write_all(&one.repeat(CHUNK)).unwrap();
        s.flush().unwrap();
        let target = answered + CHUNK;
        while answered < target {
            let n = s.read(&mut buf).expect("the agent keeps answering");
            assert!(n > 0, "connection closed after {answered} replies");
            tail.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&tail).into_owned();
            answered += text.matches("HTTP/1.1 401").count();
            // Keep a little in case a status line straddles two reads.
            let keep = tail.len().min(16);
            tail = tail[tail.len() - keep..].to_vec();
            if String::from_utf8_lossy(&tail).contains("HTTP/1.1 401") {
                tail.clear();
            }
        }
    }
    assert_eq!(answered, FLOOD);
    std::thread::sleep(std::time::Duration::from_millis(300));
    let lines_after = std::fs::read_to_string(&log).unwrap().lines().count();
    assert!(
        lines_after - lines_before < 50,
        "{} log lines for {FLOOD} refusals",
        lines_after - lines_before
    );
    // The metrics still count every single one.
    let (_, _, body) = fort_tests::raw_http_plain(
        metrics,
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    );
    let text = String::from_utf8_lossy(&body);
    assert!(
        text.contains(&format!(
            "fort_auth_failures_total{{reason=\"headers\"}} {FLOOD}"
        )),
        "{text}"
    );
}

/// One origin with many slow calls in flight holds only its share of the request slots
/// (an eighth, at least 8): another origin is still served while all of them wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_origin_cannot_hold_every_request_slot() {
    let mut f = Fleet::new();
    f.principal("hog");
    f.principal("ops");
    let started = f.dir.path().join("started");
    let gate = f.dir.path().join("gate");
    let slow = f.script(
        "slow",
        &format!(
            "echo x >> {}; while [ ! -e {} ]; do sleep 0.05; done; cat",
            started.display(),
            gate.display()
        ),
    );
    f.capability(
        "a",
        "slow",
        json!({"handler": slow, "mode": "rpc", "allowed": ["hog"]}),
    );
    f.host("a").extra_toml = "max_concurrent_requests = 16\n".into();
    f.start();
    let hog_calls = (0..16)
        .map(|i| ("hog".to_owned(), json!({ "i": i })))
        .collect();
    let count = |p: &std::path::Path| {
        std::fs::read_to_string(p)
            .map(|s| s.lines().count())
            .unwrap_or(0)
    };
    let (hog, ops) = tokio::join!(
        f.post_concurrently("a", "/agent/capabilities/slow", hog_calls),
        async {
            assert!(eventually(Duration::from_secs(10), || count(&started) >= 8).await);
            tokio::time::sleep(Duration::from_millis(300)).await;
            // hog holds its share; ops gets a slot of its own at once.
            let in_flight = count(&started);
            let r = f
                .post("ops", "a", "/agent/capabilities/status", &json!({}))
                .await;
            std::fs::write(&gate, "").unwrap();
            (r.status, in_flight)
        }
    );
    assert_eq!(ops.0, 200, "ops was not served while hog waited");
    assert_eq!(ops.1, 8, "hog ran more calls at once than its share");
    // hog's other calls waited for its share, not failed.
    assert!(hog.iter().all(|s| *s == Some(200)), "{hog:?}");
}

#[tokio::test]
async fn the_status_document_counts_the_nonces_held_and_the_memory_used() {
    let (f, _) = fleet();
    let body = b"{}";
    let mut held = Vec::new();
    for _ in 0..3 {
        let h = ops_headers(&f, "b", "/agent/capabilities/status", body, unix_now());
        let (status, _, resp) = send(&f, "b", "/agent/capabilities/status", &h, body);
        assert_eq!(status, 200);
        let doc: serde_json::Value = serde_json::from_slice(&resp).expect("status is JSON");
        held.push(doc["nonces"].as_u64().expect("nonces"));
        assert!(
            doc["memory"]["rss_bytes"].as_u64().unwrap_or(0) > 0,
            "{doc}"
        );
        assert!(doc["state_formats"].is_object(), "{doc}");
        assert!(doc["provider"]["capabilities"].is_object(), "{doc}");
        assert!(
            doc.get("gc").is_some() && doc.get("entries").is_none(),
            "{doc}"
        );
    }
    // Each call's own nonce is held by the time its document is made.
    assert!(
        held[0] >= 1 && held[1] > held[0] && held[2] > held[1],
        "{held:?}"
    );
}
