//! `acme` between real agents: a provider whose `ssl-cert` capability runs `fort-handler
//! acme` against pebble, a consumer whose need carries a CSR made here (its key never
//! leaves the test), and what a user sees: `openssl s_server` serving the delivered
//! certificate with that key, verified by `curl` trusting only pebble's root; a name
//! outside the allowance refused with the reason in the need's state; release revoking
//! the certificate at the CA.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use fort_tests::dns::{find_program, DnsServer, Flavor};
use fort_tests::pebble::{Pebble, Webroot};
use fort_tests::{eventually, Fleet};
use serde_json::json;
use x509_parser::prelude::*;

struct Killed(Child);
impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn csr(names: &[&str]) -> (rcgen::KeyPair, String) {
    let key = rcgen::KeyPair::generate().unwrap();
    let params =
        rcgen::CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
            .unwrap();
    let csr = params.serialize_request(&key).unwrap().pem().unwrap();
    (key, csr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acme_fleet_certificate_served_and_revoked() {
    const T: &str = "acme_fleet_certificate_served_and_revoked";
    let Some(openssl) = find_program("openssl") else {
        return fort_tests::skip(T, "openssl is not installed");
    };
    let records = "app IN A 127.0.0.1\n";
    let dns = match DnsServer::start(Flavor::Knot, "example.test", records) {
        Ok(d) => d,
        Err(why) => return fort_tests::skip(T, &why),
    };
    let pebble = match Pebble::start(dns.addr, None) {
        Ok(p) => p,
        Err(why) => return fort_tests::skip(T, &why),
    };
    let web = match Webroot::start(pebble.http_port) {
        Ok(w) => w,
        Err(why) => return fort_tests::skip(T, &why),
    };
    let mut f = Fleet::new();
    f.host("ca");
    pebble.serve_ssl_cert(&mut f, "ca", &web);
    let (key, csr_pem) = csr(&["app.example.test"]);
    let (_, outside) = csr(&["evil.example.test"]);
    let delivered = f.dir.path().join("delivered");
    f.need(
        "app",
        "ssl-cert/web",
        "ca",
        json!({"request": {"csr": csr_pem},
               "files": [
                   {"path": delivered.join("fullchain.pem"), "pointer": "/fullchain", "mode": "0644"},
                   {"path": delivered.join("cert.pem"), "pointer": "/certificate", "mode": "0644"},
                   {"path": delivered.join("chain.pem"), "pointer": "/chain", "mode": "0644"}]}),
    );
    f.need(
        "app",
        "ssl-cert/evil",
        "ca",
        json!({"request": {"csr": outside},
               "files": [{"path": delivered.join("evil.pem"), "pointer": "/fullchain", "mode": "0644"}]}),
    );
    f.start();

    let fullchain = delivered.join("fullchain.pem");
    assert!(
        eventually(Duration::from_secs(60), || fullchain.exists()).await,
        "no certificate delivered: {}",
        f.need_status("app", "ssl-cert/web")
    );
    // The refused need says why, and gets nothing.
    let refused = eventually(Duration::from_secs(20), || {
        f.need_status("app", "ssl-cert/evil")["reason"]
            .as_str()
            .is_some_and(|r| {
                r.contains("evil.example.test is not a name app may get a certificate for")
            })
    })
    .await;
    assert!(refused, "{}", f.need_status("app", "ssl-cert/evil"));
    assert!(!delivered.join("evil.pem").exists());

    // A TLS server with the delivered chain and the consumer's own key; a client that
    // trusts only pebble's root verifies it for the name.
    let key_path = f.dir.path().join("app-key.pem");
    std::fs::write(&key_path, key.serialize_pem()).unwrap();
    let root_path = f.dir.path().join("pebble-root.pem");
    std::fs::write(&root_path, pebble.root()).unwrap();
    let port = fort_tests::free_addr("127.0.0.1").port();
    let _server = Killed(
        Command::new(openssl)
            .args([
                "s_server",
                "-quiet",
                "-www",
                "-accept",
                &port.to_string(),
                "-cert",
            ])
            .arg(delivered.join("cert.pem"))
            .arg("-cert_chain")
            .arg(delivered.join("chain.pem"))
            .arg("-key")
            .arg(&key_path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let curl = |port: u16| {
        Command::new("curl")
            .args(["-sS", "-o", "/dev/null", "-w", "%{http_code}", "--cacert"])
            .arg(&root_path)
            .args(["--resolve", &format!("app.example.test:{port}:127.0.0.1")])
            .arg(format!("https://app.example.test:{port}/"))
            .output()
            .unwrap()
    };
    let ok = eventually(Duration::from_secs(10), || {
        String::from_utf8_lossy(&curl(port).stdout) == "200"
    })
    .await;
    let last = curl(port);
    assert!(ok, "curl: {}", String::from_utf8_lossy(&last.stderr));

    // The consumer's key is in no request, state or log the provider holds.
    let secret_line = key.serialize_pem().lines().nth(1).unwrap().to_owned();
    for entry in fort_tests::files_under(f.dir.path()) {
        if entry == key_path {
            continue;
        }
        let text = std::fs::read(&entry).unwrap_or_default();
        assert!(
            !String::from_utf8_lossy(&text).contains(&secret_line),
            "{} holds the consumer's key",
            entry.display()
        );
    }

    // Released: the certificate is revoked at the CA.
    let pem = std::fs::read(&fullchain).unwrap();
    let (_, leaf) = x509_parser::pem::parse_x509_pem(&pem).unwrap();
    let (_, cert) = X509Certificate::from_der(&leaf.contents).unwrap();
    let serial = hex::encode(cert.raw_serial());
    assert_eq!(pebble.cert_status(&serial), "Valid");
    f.host("app").needs.remove("ssl-cert/web");
    f.write_files();
    f.agents["app"].hup();
    let revoked = eventually(Duration::from_secs(30), || {
        pebble.cert_status(&serial) == "Revoked"
    })
    .await;
    assert!(revoked, "the certificate was not revoked");
}
