//! The proxy capability against a real nginx: handler runs fed by hand (stdin → stdout),
//! and HTTP requests through nginx with each vhost's server name reaching the consumer's
//! upstream (small servers on their own 127.0.0.x addresses); released vhosts answering
//! 404; refusals (names outside the allowance, a TLS set nginx cannot load, an admin's
//! broken file) with the others still serving. The fleet of real agents is in
//! `proxy_fleet.rs`.

use std::path::{Path, PathBuf};
use std::process::Command;

use fort_tests::nginx::{Nginx, Upstream};
use serde_json::{json, Value};

const KEY: &str =
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAID1AF8PoQ4lakrcKp00bfrycmCzPLsSWjMDNVfEq9GYM";

/// A started nginx, or a recorded skip.
fn server(test: &str) -> Option<Nginx> {
    match Nginx::start() {
        Ok(n) => Some(n),
        Err(reason) => {
            fort_tests::skip(test, &reason);
            None
        }
    }
}

struct Setup {
    nginx: Nginx,
    dir: tempfile::TempDir,
    config: PathBuf,
}

impl Setup {
    /// hosts.json with app at 127.0.0.2, web at 127.0.0.3 and the principal ops; the
    /// config with `extra` merged in.
    fn new(nginx: Nginx, extra: Value) -> Setup {
        let dir = tempfile::tempdir().unwrap();
        let hosts = dir.path().join("hosts.json");
        std::fs::write(
            &hosts,
            json!({
                "hosts": {"app": {"address": "https://127.0.0.2:7770", "keys": [KEY]},
                          "web": {"address": "https://127.0.0.3:7770", "keys": [KEY]}},
                "principals": {"ops": {"keys": [KEY]}}
            })
            .to_string(),
        )
        .unwrap();
        let mut config = json!({
            "include_dir": nginx.vhosts(),
            "state_file": dir.path().join("state/proxy.json"),
            "hosts": hosts,
            "test_command": nginx.test_command(),
            "reload_command": nginx.reload_command(),
            "listen": [nginx.addr.to_string()],
            "allow": {"app": ["*.app.example.org"], "web": ["web.example.org", "*.web.example.org"],
                      "ops": ["ops.example.org"]},
            "upstream_hosts": {"ops": ["127.0.0.4"]},
        });
        for (k, v) in extra.as_object().unwrap() {
            config[k] = v.clone();
        }
        let path = dir.path().join("proxy.json");
        std::fs::write(&path, config.to_string()).unwrap();
        Setup {
            nginx,
            dir,
            config: path,
        }
    }

    /// One handler run as the agent makes it: (exit ok, stdout as JSON, stderr).
    fn run(&self, trigger: &str, requests: &[(&str, Value)]) -> (bool, Value, String) {
        let input: serde_json::Map<String, Value> = requests
            .iter()
            .map(|(k, r)| ((*k).to_owned(), json!({"request": r})))
            .collect();
        run_handler(&self.config, trigger, &Value::Object(input))
    }

    fn ok(&self, trigger: &str, requests: &[(&str, Value)]) -> (Value, String) {
        let (ok, out, err) = self.run(trigger, requests);
        assert!(
            ok,
            "handler failed: {err}\nnginx: {}",
            self.nginx.error_log()
        );
        (out, err)
    }

    fn vhost(&self, file: &str) -> PathBuf {
        self.nginx.vhosts().join(file)
    }
}

fn run_handler(config: &Path, trigger: &str, input: &Value) -> (bool, Value, String) {
    fort_tests::run_handler("proxy", config, trigger, &[("FORT_HOST", "edge")], input)
}

fn refusal(out: &Value, key: &str) -> String {
    out[key]["$fort_refused"]
        .as_str()
        .unwrap_or_else(|| panic!("{key} is not refused: {out}"))
        .to_owned()
}

#[test]
fn vhosts_forward_to_the_callers_upstream_and_go_with_release() {
    const TEST: &str = "vhosts_forward_to_the_callers_upstream_and_go_with_release";
    let Some(nginx) = server(TEST) else { return };
    let app = Upstream::start("127.0.0.2", "app");
    let web = Upstream::start("127.0.0.3", "web");
    let other = Upstream::start("127.0.0.4", "elsewhere");
    let s = Setup::new(nginx, json!({}));
    // The admin's own vhost in the same directory.
    std::fs::write(
        s.vhost("admin.conf"),
        format!(
            "server {{ listen {}; server_name admin.example.org; return 200 admin; }}\n",
            s.nginx.addr
        ),
    )
    .unwrap();
    let requests = vec![
        (
            "app:proxy/wiki",
            json!({"server_names": ["wiki.app.example.org", "Www.App.example.org"], "port": app.addr.port(),
                   "path": null, "scheme": "http", "upstream_host": null, "tls": null, "sign_in_client": null}),
        ),
        (
            "web:proxy/site",
            json!({"server_names": ["web.example.org"], "port": web.addr.port(), "path": "/base"}),
        ),
        (
            "ops:proxy/grafana",
            json!({"server_names": ["ops.example.org"], "port": other.addr.port(), "upstream_host": "127.0.0.4"}),
        ),
        // Outside web's allowance, claimed already, hostile, or forwarding elsewhere
        // without leave.
        (
            "web:proxy/steal",
            json!({"server_names": ["wiki.app.example.org"], "port": 1}),
        ),
        (
            "app:proxy/twice",
            json!({"server_names": ["a.web.example.org"], "port": 1}),
        ),
        (
            "web:proxy/twin",
            json!({"server_names": ["web.example.org"], "port": 1}),
        ),
        (
            "app:proxy/hostile",
            json!({"server_names": ["x.app.example.org; return 200 pwned"], "port": 1}),
        ),
        (
            "app:proxy/away",
            json!({"server_names": ["away.app.example.org"], "port": 1, "upstream_host": "127.0.0.4"}),
        ),
    ];
    let (out, err) = s.ok("request", &requests);
    assert!(err.contains("3 vhosts written"), "{err}");
    assert!(refusal(&out, "web:proxy/steal")
        .contains("web may not have the server name wiki.app.example.org"));
    assert!(refusal(&out, "app:proxy/twice")
        .contains("app may not have the server name a.web.example.org"));
    assert!(refusal(&out, "web:proxy/twin").contains("web.example.org is already served"));
    assert!(refusal(&out, "app:proxy/hostile").contains("is not a DNS name"));
    assert!(refusal(&out, "app:proxy/away").contains("app may not forward to 127.0.0.4"));
    assert_eq!(
        out["app:proxy/wiki"],
        json!({"server_names": ["wiki.app.example.org", "www.app.example.org"],
               "upstream": format!("http://127.0.0.2:{}", app.addr.port()), "tls": null})
    );
    assert_eq!(
        s.nginx.wait_for("wiki.app.example.org", 200),
        (200, "app /".into())
    );
    assert_eq!(
        s.nginx
            .wait_for_body("www.app.example.org", "/page?q=1", 200, "app /page?q=1"),
        (200, "app /page?q=1".into())
    );
    assert_eq!(
        s.nginx
            .wait_for_body("web.example.org", "/x", 200, "web /base/x"),
        (200, "web /base/x".into())
    );
    assert_eq!(
        s.nginx
            .wait_for_body("ops.example.org", "/", 200, "elsewhere /"),
        (200, "elsewhere /".into())
    );
    assert_eq!(s.nginx.wait_for("x.app.example.org", 404).0, 404);
    assert_eq!(
        s.nginx
            .wait_for_body("admin.example.org", "/", 200, "admin"),
        (200, "admin".into())
    );
    let file = s.vhost("fort.app.proxy.wiki.conf");
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(
        text.starts_with("# fort-handler proxy: app:proxy/wiki;"),
        "{text}"
    );
    assert_eq!(
        std::fs::read_dir(s.nginx.vhosts()).unwrap().count(),
        4,
        "three vhosts and the admin's file, no temporary files"
    );

    // The same entries again: no write, no test, no reload.
    let mtime = std::fs::metadata(&file).unwrap().modified().unwrap();
    let (again, err) = s.ok("request", &requests);
    assert!(
        err.contains("0 vhosts written, 0 removed") && err.contains("0 tests, no reload"),
        "{err}"
    );
    assert_eq!(again, out);
    assert_eq!(std::fs::metadata(&file).unwrap().modified().unwrap(), mtime);

    // app releases its vhost: the name answers 404; the others and the admin's file stay.
    let (_, err) = s.ok("request", &requests[1..3]);
    assert!(
        err.contains("1 removed") && err.contains("reloaded"),
        "{err}"
    );
    assert!(!file.exists());
    assert_eq!(s.nginx.wait_for("wiki.app.example.org", 404).0, 404);
    assert_eq!(
        s.nginx
            .wait_for_body("web.example.org", "/", 200, "web /base/"),
        (200, "web /base/".into())
    );
    assert_eq!(
        s.nginx
            .wait_for_body("admin.example.org", "/", 200, "admin"),
        (200, "admin".into())
    );

    // A file of fort's name that fort did not write is left alone, its entry refused.
    let squatted = s.vhost("fort.app.proxy.wiki.conf");
    std::fs::write(&squatted, "# the admin's\n").unwrap();
    let (out, _) = s.ok("request", &requests[..3]);
    assert!(refusal(&out, "app:proxy/wiki").contains("was not written by fort"));
    assert_eq!(
        std::fs::read_to_string(&squatted).unwrap(),
        "# the admin's\n"
    );
    std::fs::remove_file(&squatted).unwrap();

    // Everything released: only the admin's file is left.
    let (_, err) = s.ok("request", &[]);
    assert!(err.contains("2 removed"), "{err}");
    let left: Vec<String> = std::fs::read_dir(s.nginx.vhosts())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(left, ["admin.conf"]);
    assert_eq!(s.nginx.wait_for("web.example.org", 404).0, 404);
    assert_eq!(
        s.nginx
            .wait_for_body("admin.example.org", "/", 200, "admin"),
        (200, "admin".into())
    );
    drop(s.dir);
}

/// A self-signed certificate and key for `names`, written to `dir`.
fn certificate(dir: &Path, names: &[&str]) -> (PathBuf, PathBuf) {
    let key = rcgen::KeyPair::generate().unwrap();
    let params =
        rcgen::CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
            .unwrap();
    let cert = params.self_signed(&key).unwrap();
    let (c, k) = (dir.join("good.pem"), dir.join("good.key"));
    std::fs::write(&c, cert.pem()).unwrap();
    std::fs::write(&k, key.serialize_pem()).unwrap();
    (c, k)
}

/// `curl -k` over HTTPS to `name` at `addr`; `None` without curl.
fn curl_https(addr: std::net::SocketAddr, name: &str) -> Option<String> {
    let out = Command::new("curl")
        .args(["-sk", "--max-time", "5", "--resolve"])
        .arg(format!("{name}:{}:{}", addr.port(), addr.ip()))
        .arg(format!("https://{name}:{}/", addr.port()))
        .output()
        .ok()?;
    Some(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[test]
fn a_vhost_nginx_refuses_is_refused_and_the_others_keep_serving() {
    const TEST: &str = "a_vhost_nginx_refuses_is_refused_and_the_others_keep_serving";
    let Some(nginx) = server(TEST) else { return };
    let app = Upstream::start("127.0.0.2", "app");
    let certs = tempfile::tempdir().unwrap();
    let (cert, key) = certificate(certs.path(), &["tls.app.example.org"]);
    // The files of "broken" are there but hold no certificate: only nginx finds out.
    let (bad_cert, bad_key) = (certs.path().join("bad.pem"), certs.path().join("bad.key"));
    std::fs::write(&bad_cert, "not a certificate\n").unwrap();
    std::fs::write(&bad_key, "not a key\n").unwrap();
    let tls_addr = fort_tests::free_addr("127.0.0.1");
    let s = Setup::new(
        nginx,
        json!({
            "listen_tls": [tls_addr.to_string()],
            "tls": {"good": {"certificate": cert, "key": key},
                    "broken": {"certificate": bad_cert, "key": bad_key}},
        }),
    );
    let port = app.addr.port();
    let plain = |n: &str| json!({"server_names": [format!("{n}.app.example.org")], "port": port});
    let tls = |n: &str, set: &str| json!({"server_names": [format!("{n}.app.example.org")], "port": port, "tls": set});
    let mut requests = vec![
        ("app:proxy/a", plain("a")),
        ("app:proxy/b", tls("tls", "good")),
        ("app:proxy/c", tls("c", "broken")),
        ("app:proxy/d", plain("d")),
        ("app:proxy/e", plain("e")),
        ("app:proxy/f", tls("f", "missing")),
    ];
    let (out, err) = s.ok("request", &requests);
    let reason = refusal(&out, "app:proxy/c");
    assert!(
        reason.starts_with("nginx refuses the vhost: [emerg] cannot load certificate"),
        "{reason}"
    );
    assert!(refusal(&out, "app:proxy/f").contains("no certificate set \"missing\""));
    assert!(
        err.contains("4 vhosts written") && err.contains("reloaded"),
        "{err}"
    );
    assert!(!s.vhost("fort.app.proxy.c.conf").exists());
    for name in ["a", "d", "e"] {
        assert_eq!(
            s.nginx.wait_for(&format!("{name}.app.example.org"), 200),
            (200, "app /".into()),
            "{name}"
        );
    }
    // The TLS vhost: HTTPS reaches the upstream, plain HTTP is sent there.
    assert_eq!(s.nginx.wait_for("tls.app.example.org", 301).0, 301);
    if let Some(body) = curl_https(tls_addr, "tls.app.example.org") {
        assert_eq!(body, "app /");
    }

    // Asked again unchanged: refused again without a test.
    let (again, err) = s.ok("request", &requests);
    assert_eq!(refusal(&again, "app:proxy/c"), reason);
    assert!(err.contains("0 tests, no reload"), "{err}");

    // An entry with a vhost in place asks for the broken set: refused, its vhost stays.
    requests[0].1 = tls("a", "broken");
    let (out, _) = s.ok("request", &requests);
    assert!(refusal(&out, "app:proxy/a").contains("the previous one stays"));
    assert_eq!(
        s.nginx
            .wait_for_body("a.app.example.org", "/", 200, "app /"),
        (200, "app /".into())
    );
    requests[0].1 = plain("a");

    // A broken file the admin left in the directory: nothing this run would change is
    // made, nothing is reloaded, the run fails and says why; everything still serves.
    std::fs::write(s.vhost("admin.conf"), "server { bogus_directive on; }\n").unwrap();
    requests.push(("app:proxy/g", plain("g")));
    let (ok, _, err) = s.run("request", &requests);
    assert!(!ok);
    assert!(
        err.contains("fails its test without any of this run's changes")
            && err.contains("bogus_directive"),
        "{err}"
    );
    assert!(!s.vhost("fort.app.proxy.g.conf").exists());
    assert_eq!(
        s.nginx
            .wait_for_body("a.app.example.org", "/", 200, "app /"),
        (200, "app /".into())
    );
    assert_eq!(s.nginx.wait_for("g.app.example.org", 404).0, 404);
    // The admin fixes it: the new vhost comes.
    std::fs::remove_file(s.vhost("admin.conf")).unwrap();
    let (out, _) = s.ok("request", &requests);
    assert!(out["app:proxy/g"]["server_names"].is_array(), "{out}");
    assert_eq!(
        s.nginx.wait_for("g.app.example.org", 200),
        (200, "app /".into())
    );
    // The broken set fixed in place: a reconciling run tries c again.
    std::fs::copy(&cert, &bad_cert).unwrap();
    std::fs::copy(&key, &bad_key).unwrap();
    let (out, _) = s.ok("manual", &requests);
    assert!(out["app:proxy/c"]["server_names"].is_array(), "{out}");
}

/// A name of `len` characters below app.example.org, which app may have: labels of 63
/// characters and a shorter last one.
fn long_name(len: usize) -> String {
    let suffix = ".app.example.org";
    let mut left = len - suffix.len();
    let mut labels = Vec::new();
    while left > 64 {
        labels.push("a".repeat(63));
        left -= 64;
    }
    labels.push("b".repeat(left));
    format!("{}{suffix}", labels.join("."))
}

/// A caller's server name that nginx takes while its vhost is alone on its address, but
/// that no server names hash of this nginx holds beside another vhost: refused at the
/// door, with the cause, and the callers after it are served in the same runs. A name as
/// long as a bucket holds (nginx's own rule) is served beside the others.
#[test]
fn a_server_name_longer_than_nginxs_hash_holds_costs_only_its_own_entry() {
    const TEST: &str = "a_server_name_longer_than_nginxs_hash_holds_costs_only_its_own_entry";
    let Some(nginx) = server(TEST) else { return };
    let app = Upstream::start("127.0.0.2", "app");
    let web = Upstream::start("127.0.0.3", "web");
    // The vhosts' own address, where nothing else listens; the test nginx hashes with
    // buckets of 128 bytes: names of at most 110 characters.
    let edge = fort_tests::free_addr("127.0.0.1");
    let s = Setup::new(
        nginx,
        json!({"listen": [edge.to_string()], "server_names_hash_bucket_size": 128}),
    );
    let attacker = (
        "app:proxy/long",
        json!({"server_names": [long_name(111)], "port": app.addr.port()}),
    );
    let (out, _) = s.ok("request", std::slice::from_ref(&attacker));
    let why = refusal(&out, "app:proxy/long");
    assert!(
        why.contains("111 characters") && why.contains("server_names_hash_bucket_size 128"),
        "{why}"
    );

    let requests = [
        attacker,
        (
            "web:proxy/site",
            json!({"server_names": ["web.example.org"], "port": web.addr.port()}),
        ),
        (
            "app:proxy/edge",
            json!({"server_names": [long_name(110)], "port": app.addr.port()}),
        ),
    ];
    for _ in 0..2 {
        let (out, err) = s.ok("request", &requests);
        assert!(out["web:proxy/site"]["upstream"].is_string(), "{out} {err}");
        assert!(out["app:proxy/edge"]["upstream"].is_string(), "{out} {err}");
        assert!(refusal(&out, "app:proxy/long").contains("111 characters"));
    }
    assert_eq!(
        s.nginx.wait_for_at(edge, "web.example.org", 200, "web /").1,
        "web /"
    );
    assert_eq!(
        s.nginx.wait_for_at(edge, &long_name(110), 200, "app /").1,
        "app /"
    );
}

/// When the handler is told of larger buckets than nginx has, a long name gets in while
/// it is alone on its address; every vhost added beside it then fails nginx's test.
/// Those vhosts pass without it, so they are held with nginx's reason, never refused and
/// remembered as broken, and are served once the clash is gone.
#[test]
fn a_vhost_that_only_clashes_with_another_is_held_not_blamed() {
    const TEST: &str = "a_vhost_that_only_clashes_with_another_is_held_not_blamed";
    let Some(nginx) = server(TEST) else { return };
    let app = Upstream::start("127.0.0.2", "app");
    let web = Upstream::start("127.0.0.3", "web");
    let edge = fort_tests::free_addr("127.0.0.1");
    let s = Setup::new(
        nginx,
        json!({"listen": [edge.to_string()], "server_names_hash_bucket_size": 256}),
    );
    let attacker = (
        "app:proxy/long",
        json!({"server_names": [long_name(150)], "port": app.addr.port()}),
    );
    let (out, _) = s.ok("request", std::slice::from_ref(&attacker));
    assert!(out["app:proxy/long"]["upstream"].is_string(), "{out}");
    let site = (
        "web:proxy/site",
        json!({"server_names": ["web.example.org"], "port": web.addr.port()}),
    );
    let both = [attacker, site.clone()];
    for _ in 0..2 {
        let (out, _) = s.ok("request", &both);
        let held = out["web:proxy/site"]["$fort_pending"]
            .as_str()
            .unwrap_or_else(|| panic!("web:proxy/site is not held: {out}"));
        assert!(
            held.contains("clashes") && held.contains("server_names_hash"),
            "{held}"
        );
    }
    // The long name released: the held vhost is tested again and served.
    let (out, _) = s.ok("gc", std::slice::from_ref(&site));
    assert!(out["web:proxy/site"]["upstream"].is_string(), "{out}");
    assert_eq!(
        s.nginx.wait_for_at(edge, "web.example.org", 200, "web /").1,
        "web /"
    );
}

/// A caller may forward to a host name of its own (upstream_hosts), which nginx resolves
/// whenever it loads or tests the configuration. Its vhost passes; then the caller makes
/// the name stop resolving. From then on nginx refuses the configuration as it stands:
/// that vhost alone is taken out, with nginx's reason, and the other callers' vhosts
/// stay and new ones are served in the same run.
#[test]
fn a_vhost_in_place_that_stops_passing_costs_only_its_own_entry() {
    const TEST: &str = "a_vhost_in_place_that_stops_passing_costs_only_its_own_entry";
    let hosts_dir = tempfile::tempdir().unwrap();
    let hosts = hosts_dir.path().join("hosts");
    let resolving = "127.0.0.1 localhost\n127.0.0.2 upstream.app.example.org\n";
    std::fs::write(&hosts, resolving).unwrap();
    let nginx = match Nginx::start_resolving(&hosts) {
        Ok(n) => n,
        Err(reason) => return fort_tests::skip(TEST, &reason),
    };
    let app = Upstream::start("127.0.0.2", "app");
    let web = Upstream::start("127.0.0.3", "web");
    let s = Setup::new(
        nginx,
        json!({"upstream_hosts": {"app": ["*.app.example.org"]}}),
    );
    let attacker = (
        "app:proxy/named",
        json!({"server_names": ["named.app.example.org"], "port": app.addr.port(),
               "upstream_host": "upstream.app.example.org"}),
    );
    let site = (
        "web:proxy/site",
        json!({"server_names": ["web.example.org"], "port": web.addr.port()}),
    );
    let (out, _) = s.ok("request", &[attacker.clone(), site.clone()]);
    assert!(out["app:proxy/named"]["upstream"].is_string(), "{out}");
    assert_eq!(
        s.nginx
            .wait_for_body("named.app.example.org", "/", 200, "app /")
            .1,
        "app /"
    );

    // The name no longer resolves (the file rewritten in place: the bind mount follows
    // its inode). Another caller asks for a new vhost.
    std::fs::write(&hosts, "127.0.0.1 localhost\n").unwrap();
    let blog = (
        "web:proxy/blog",
        json!({"server_names": ["blog.web.example.org"], "port": web.addr.port()}),
    );
    let requests = [attacker, site, blog];
    let (ok, out, err) = s.run("request", &requests);
    assert!(ok, "the run failed: {err}");
    let why = refusal(&out, "app:proxy/named");
    assert!(
        why.contains("taken out") && why.contains("upstream.app.example.org"),
        "{why}"
    );
    assert!(out["web:proxy/site"]["upstream"].is_string(), "{out}");
    assert!(out["web:proxy/blog"]["upstream"].is_string(), "{out}");
    assert!(!s.vhost("fort.app.proxy.named.conf").exists());
    assert_eq!(
        s.nginx
            .wait_for_body("blog.web.example.org", "/", 200, "web /")
            .1,
        "web /"
    );
    assert_eq!(
        s.nginx
            .wait_for_body("web.example.org", "/", 200, "web /")
            .1,
        "web /"
    );

    // Asked for again while the name still does not resolve: refused as broken, and the
    // others are answered as before.
    let (out, _) = s.ok("request", &requests);
    assert!(
        refusal(&out, "app:proxy/named").contains("host not found"),
        "{out}"
    );
    assert!(out["web:proxy/blog"]["upstream"].is_string(), "{out}");
    // The name resolves again: a reconciling run brings the vhost back.
    std::fs::write(&hosts, resolving).unwrap();
    let (out, _) = s.ok("manual", &requests);
    assert!(out["app:proxy/named"]["upstream"].is_string(), "{out}");
}
