//! `dns-record` between real agents: a provider whose capability runs `fort-handler
//! dns-record`, consumers whose needs name records, and a primary (knotd, named) that
//! `dig` asks. A consumer's record carries its own address from hosts.json, and goes when
//! the consumer releases the need.

use std::time::Duration;

use fort_tests::dns::{DnsServer, Flavor};
use fort_tests::{eventually, Fleet};
use serde_json::json;

const ZONE: &str = "example.test";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn knot() {
    a_consumers_record_lives_as_long_as_its_need(Flavor::Knot).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bind() {
    a_consumers_record_lives_as_long_as_its_need(Flavor::Bind).await;
}

async fn a_consumers_record_lives_as_long_as_its_need(flavor: Flavor) {
    let test = format!("dns_record_fleet ({})", flavor.name());
    let server = match DnsServer::start(flavor, ZONE, "manual IN A 192.0.2.1\n") {
        Ok(s) => s,
        Err(why) => return fort_tests::skip(&test, &why),
    };
    let mut f = Fleet::new();
    f.host("dns");
    let key = f.dir.path().join("tsig.key");
    server.write_key(&key);
    let config = f.dir.path().join("dns-record.json");
    std::fs::write(
        &config,
        json!({
            "zone": ZONE,
            "primary": server.addr.to_string(),
            "key": {"name": server.key_name, "file": key},
            "allow": {"*": ["{origin}.example.test", "*.{origin}.example.test"]},
            "hosts": f.host_dir("dns").join("hosts.json"),
            "state": f.host_dir("dns").join("handlers/dns-record.json"),
        })
        .to_string(),
    )
    .unwrap();
    f.capability(
        "dns",
        "dns-record",
        json!({
            "handler": fort_tests::bin("fort-handler"),
            "args": ["dns-record", "--config", config],
            "mode": "async",
            "cacheResponse": true,
        }),
    );
    // The record set lands in a file, so the need is satisfied by it.
    let delivered = f.dir.path().join("delivered");
    let file = |name: &str| json!([{"path": delivered.join(name), "mode": "0644"}]);
    f.need(
        "app",
        "dns-record/www",
        "dns",
        json!({"request": {"name": "www.app.example.test"}, "files": file("www.json")}),
    );
    f.need(
        "web",
        "dns-record/spf",
        "dns",
        json!({
            "request": {"name": "web.example.test", "type": "TXT", "values": ["v=spf1 -all"]},
            "files": file("spf.json")
        }),
    );
    f.start();
    let app_ip = f.hosts["app"].addr.ip().to_string();

    // Each consumer's record is served, and each need is satisfied with the record set.
    let served = eventually(Duration::from_secs(20), || {
        server.dig("www.app.example.test", "A") == [app_ip.clone()]
            && server.dig("web.example.test", "TXT") == [r#""v=spf1 -all""#]
    })
    .await;
    assert!(served, "{:?}", server.dig("www.app.example.test", "A"));
    assert!(
        eventually(Duration::from_secs(10), || f.all_satisfied("app")
            && f.all_satisfied("web"))
        .await
    );
    let record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(delivered.join("www.json")).unwrap()).unwrap();
    assert_eq!(
        record,
        json!({"name": "www.app.example.test", "type": "A", "values": [app_ip], "ttl": 300})
    );

    // app releases its need: its record goes; web's and the hand-made one stay.
    f.host("app").needs.remove("dns-record/www");
    f.write_files();
    f.agents["app"].hup();
    let gone = eventually(Duration::from_secs(20), || {
        server.dig("www.app.example.test", "A").is_empty()
    })
    .await;
    assert!(gone, "{:?}", server.dig("www.app.example.test", "A"));
    assert_eq!(server.dig("web.example.test", "TXT"), [r#""v=spf1 -all""#]);
    assert_eq!(server.dig("manual.example.test", "A"), ["192.0.2.1"]);
}
