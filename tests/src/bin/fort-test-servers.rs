//! Starts every server the test harness offers that is installed here, and an agent,
//! prints `started: <names>`, then ends as its argument says: `exit` (normally), `panic`
//! (unwinding), or `wait` (until a signal ends it). tests/cleanup.rs checks that nothing
//! it started outlives it.

use std::io::Write;
use std::time::Duration;

use fort_tests::dns::{DnsServer, Flavor};
use fort_tests::nginx::Nginx;
use fort_tests::oidc::OidcProvider;
use fort_tests::pebble::{Pebble, Webroot};
use fort_tests::postgres::Postgres;
use fort_tests::Fleet;

fn main() {
    let how = std::env::args().nth(1).unwrap_or_default();
    if !["exit", "panic", "wait"].contains(&how.as_str()) {
        eprintln!("usage: fort-test-servers exit|panic|wait");
        std::process::exit(2);
    }
    let mut started = Vec::new();
    let records = "app IN A 127.0.0.1\n";
    let knot = DnsServer::start(Flavor::Knot, "example.test", records).ok();
    let bind = DnsServer::start(Flavor::Bind, "example.test", records).ok();
    let nginx = Nginx::start().ok();
    let pebble = knot
        .as_ref()
        .and_then(|dns| Pebble::start(dns.addr, None).ok());
    let webroot = pebble
        .as_ref()
        .and_then(|p| Webroot::start(p.http_port).ok());
    let oidc = OidcProvider::start().ok();
    let postgres = Postgres::start(false).ok();
    let session = postgres.as_ref().map(|pg| {
        pg.superuser("CREATE ROLE fort_session LOGIN PASSWORD 'session'")
            .expect("a role for the session");
        pg.session("fort_session", "session", "postgres")
    });
    let mut fleet = Fleet::new();
    fleet.host("a");
    fleet.start();
    for (name, up) in [
        ("knot", knot.is_some()),
        ("bind", bind.is_some()),
        ("nginx", nginx.is_some()),
        ("pebble", pebble.is_some()),
        ("webroot", webroot.is_some()),
        ("oidc-provider", oidc.is_some()),
        ("postgres", postgres.is_some()),
        ("psql", session.is_some()),
        ("agent", true),
    ] {
        if up {
            started.push(name);
        }
    }
    println!("started: {}", started.join(" "));
    let _ = std::io::stdout().flush();
    match how.as_str() {
        "panic" => panic!("ending with a panic, as asked"),
        "wait" => loop {
            std::thread::sleep(Duration::from_secs(1));
        },
        _ => {}
    }
}
