//! acme and proxy on one edge, between real agents, with pebble validating every challenge
//! for real (HTTP-01 through the edge's nginx): a consumer's certificate for the name its
//! vhost at the edge proxies is validated through that vhost, which serves the challenge
//! directory from the acme webroot; the edge's own certificate for the name (its key made
//! on the edge) becomes the vhost's TLS; a challenge path with no answer still reaches the
//! consumer's upstream.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use fort_tests::dns::{DnsServer, Flavor};
use fort_tests::nginx::{http_get, Nginx, Upstream};
use fort_tests::pebble::Pebble;
use fort_tests::{eventually, Fleet};
use serde_json::{json, Value};

const T: &str = "a_name_the_edge_proxies_gets_its_certificate_through_the_vhost_and_serves_tls";
const NAME: &str = "wiki.app.example.test";
const DOCS: &str = "docs.app.example.test";

/// A directory nginx's workers (another user) can read: the test's own are private.
fn public_dir(path: &Path) -> PathBuf {
    std::fs::create_dir_all(path).unwrap();
    let mut p = path.to_path_buf();
    loop {
        let mode = std::fs::metadata(&p).unwrap().permissions().mode();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode | 0o755)).unwrap();
        if !p.pop() || p == Path::new("/tmp") || p == Path::new("/") {
            break;
        }
    }
    path.to_path_buf()
}

/// `curl` over HTTPS to `NAME` at 127.0.0.1:`port`, trusting only `root`.
fn https(port: u16, root: &Path) -> Result<String, String> {
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "5", "--cacert"])
        .arg(root)
        .args(["--resolve", &format!("{NAME}:{port}:127.0.0.1")])
        .arg(format!("https://{NAME}:{port}/tls"))
        .output()
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

fn key_need(dir: &Path) -> Value {
    json!({"request": {"csr": {"$fort_key": "tls", "as": "csr"}},
           "nag_seconds": 2,
           "keys": {"tls": {"type": "ecdsa-p256", "path": dir.join("key.pem"), "mode": "0600",
                            "names": [NAME]}},
           "files": [{"path": dir.join("fullchain.pem"), "pointer": "/fullchain", "mode": "0644"}]})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_the_edge_proxies_gets_its_certificate_through_the_vhost_and_serves_tls() {
    let dns = match DnsServer::start(Flavor::Knot, "example.test", "wiki.app IN A 127.0.0.1\n") {
        Ok(d) => d,
        Err(why) => return fort_tests::skip(T, &why),
    };
    let pebble = match Pebble::start(dns.addr, None) {
        Ok(p) => p,
        Err(why) => return fort_tests::skip(T, &why),
    };
    let nginx = match Nginx::start() {
        Ok(n) => n,
        Err(why) => return fort_tests::skip(T, &why),
    };
    let mut f = Fleet::new();
    f.host("edge");
    let app_ip = f.host("app").addr.ip().to_string();
    let upstream = Upstream::start(&app_ip, "wiki on app");
    let webroot = public_dir(&f.dir.path().join("webroot"));
    let edge_cert = f.dir.path().join("edge-cert");
    // pebble validates HTTP-01 on its http port: the vhosts listen there.
    let http = format!("127.0.0.1:{}", pebble.http_port);
    let tls_addr = fort_tests::free_addr("127.0.0.1");
    let acme = f.dir.path().join("acme.json");
    std::fs::write(
        &acme,
        json!({"directory": pebble.directory, "ca_root": pebble.tls_root,
               "allow": {"app": [NAME], "edge": [NAME]},
               "http01": {"webroot": webroot}, "rerun_seconds": 1, "backoff_seconds": 1,
               "state": f.host_dir("edge").join("handlers/acme.json")})
        .to_string(),
    )
    .unwrap();
    let proxy = f.dir.path().join("proxy.json");
    std::fs::write(
        &proxy,
        json!({"include_dir": nginx.vhosts(),
               "state_file": f.host_dir("edge").join("handlers/proxy.json"),
               "hosts": f.host_dir("edge").join("hosts.json"),
               "test_command": nginx.test_command(), "reload_command": nginx.reload_command(),
               "listen": [http], "listen_tls": [tls_addr.to_string()],
               "allow": {"app": ["*.app.example.test"]},
               // What the NixOS module wires: the acme webroot, and the edge's own
               // certificate for the name as a TLS set.
               "acme_webroot": webroot,
               "tls": {"wiki": {"certificate": edge_cert.join("fullchain.pem"),
                                "key": edge_cert.join("key.pem")}}})
        .to_string(),
    )
    .unwrap();
    for (name, handler, config) in [("ssl-cert", "acme", &acme), ("proxy", "proxy", &proxy)] {
        f.capability(
            "edge",
            name,
            json!({"handler": fort_tests::bin("fort-handler"),
                   "args": [handler, "--config", config], "mode": "async"}),
        );
    }
    // app's vhost asks for TLS with the edge's certificate from the start: until that
    // certificate exists the vhost serves plain HTTP, through which both are validated.
    // A second vhost stays plain.
    for (id, name, tls) in [("wiki", NAME, Some("wiki")), ("docs", DOCS, None)] {
        f.need(
            "app",
            &format!("proxy/{id}"),
            "edge",
            json!({"request": {"server_names": [name], "port": upstream.addr.port(), "tls": tls},
                   "files": [{"path": f.dir.path().join(format!("{id}.json")), "mode": "0644"}],
                   "nag_seconds": 2}),
        );
    }
    let app_cert = f.dir.path().join("app-cert");
    f.need("app", "ssl-cert/wiki", "edge", key_need(&app_cert));
    // The edge's own certificate for the name, from its own acme capability.
    f.need("edge", "ssl-cert/wiki", "edge", key_need(&edge_cert));
    f.start();

    // Both certificates come by HTTP-01 through app's vhost at the edge.
    let both = eventually(Duration::from_secs(90), || {
        app_cert.join("fullchain.pem").exists() && edge_cert.join("fullchain.pem").exists()
    })
    .await;
    assert!(
        both,
        "app: {} edge: {}\nnginx: {}",
        f.need_status("app", "ssl-cert/wiki"),
        f.need_status("edge", "ssl-cert/wiki"),
        nginx.error_log()
    );
    let access = std::fs::read_to_string(nginx.vhosts().join("../access.log")).unwrap_or_default();
    assert!(
        access.contains("/.well-known/acme-challenge/"),
        "the challenges went through nginx: {access}"
    );
    // A challenge path with no answer in the webroot reaches the upstream.
    assert_eq!(
        http_get(
            format!("127.0.0.1:{}", pebble.http_port).parse().unwrap(),
            DOCS,
            "/.well-known/acme-challenge/not-ours"
        ),
        (
            200,
            "wiki on app /.well-known/acme-challenge/not-ours".to_owned()
        )
    );

    // The edge's certificate in place, the vhost serves HTTPS with it, verified against
    // pebble's root, and forwards to app.
    let root = f.dir.path().join("pebble-root.pem");
    std::fs::write(&root, pebble.root()).unwrap();
    let served = eventually(Duration::from_secs(30), || {
        https(tls_addr.port(), &root).is_ok_and(|body| body == "wiki on app /tls")
    })
    .await;
    assert!(
        served,
        "{:?} {}",
        https(tls_addr.port(), &root),
        f.need_status("app", "proxy/wiki")
    );
}
