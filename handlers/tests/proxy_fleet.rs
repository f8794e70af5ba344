//! `proxy` between real agents: a provider whose capability runs `fort-handler proxy`
//! against a real nginx, consumers whose needs ask for vhosts. A request through nginx
//! with a consumer's server name reaches the upstream on that consumer's own address
//! (hosts.json); a name outside the allowance is refused and the consumer's need says
//! why; a released need's vhost answers 404.

use std::time::Duration;

use fort_tests::nginx::{Nginx, Upstream};
use fort_tests::{eventually, Fleet};
use serde_json::json;

const TEST: &str = "a_consumers_vhost_forwards_to_its_own_address_while_it_needs_it";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumers_vhost_forwards_to_its_own_address_while_it_needs_it() {
    let nginx = match Nginx::start() {
        Ok(n) => n,
        Err(why) => return fort_tests::skip(TEST, &why),
    };
    let mut f = Fleet::new();
    f.host("edge");
    let app_ip = f.host("app").addr.ip().to_string();
    f.host("web");
    f.principal("ops");
    let upstream = Upstream::start(&app_ip, "wiki on app");
    let config = f.dir.path().join("proxy.json");
    std::fs::write(
        &config,
        json!({
            "include_dir": nginx.vhosts(),
            "state_file": f.host_dir("edge").join("handlers/proxy.json"),
            "hosts": f.host_dir("edge").join("hosts.json"),
            "test_command": nginx.test_command(),
            "reload_command": nginx.reload_command(),
            "listen": [nginx.addr.to_string()],
            "allow": {"*": ["{origin}.example.test", "*.{origin}.example.test"]},
        })
        .to_string(),
    )
    .unwrap();
    f.capability(
        "edge",
        "proxy",
        json!({
            "handler": fort_tests::bin("fort-handler"),
            "args": ["proxy", "--config", config],
            "mode": "async",
        }),
    );
    let delivered = f.dir.path().join("delivered");
    f.need(
        "app",
        "proxy/wiki",
        "edge",
        json!({
            "request": {"server_names": ["wiki.app.example.test"], "port": upstream.addr.port()},
            "files": [{"path": delivered.join("wiki.json"), "mode": "0644"}],
            "nag_seconds": 2,
        }),
    );
    f.need(
        "web",
        "proxy/site",
        "edge",
        json!({"request": {"server_names": ["wiki.app.example.test"], "port": 80}, "nag_seconds": 2}),
    );
    f.start();

    // app's vhost forwards to app's own address; the need is satisfied with it.
    let served = eventually(Duration::from_secs(30), || {
        nginx.get("wiki.app.example.test", "/docs").1 == "wiki on app /docs"
    })
    .await;
    assert!(
        served,
        "{:?} {}",
        nginx.get("wiki.app.example.test", "/docs"),
        f.need_status("app", "proxy/wiki")
    );
    assert!(eventually(Duration::from_secs(10), || f.all_satisfied("app")).await);
    let response: serde_json::Value =
        serde_json::from_slice(&std::fs::read(delivered.join("wiki.json")).unwrap()).unwrap();
    assert_eq!(
        response["upstream"],
        json!(format!("http://{app_ip}:{}", upstream.addr.port()))
    );

    // web asked for a name of app's: refused, and web's need state says why.
    let refused = eventually(Duration::from_secs(20), || {
        f.need_status("web", "proxy/site")["reason"]
            .as_str()
            .is_some_and(|r| r.contains("web may not have the server name wiki.app.example.test"))
    })
    .await;
    assert!(refused, "{}", f.need_status("web", "proxy/site"));

    // app renames its vhost to a name outside its allowance: the change is refused, the
    // vhost it had keeps serving, and app's need state says both.
    f.host("app").needs.get_mut("proxy/wiki").unwrap()["request"]["server_names"] =
        json!(["wiki.web.example.test"]);
    f.write_files();
    f.agents["app"].hup();
    let said = eventually(Duration::from_secs(20), || {
        f.need_status("app", "proxy/wiki")["reason"]
            .as_str()
            .is_some_and(|r| {
                r.contains("app may not have the server name wiki.web.example.test")
                    && r.contains("the vhost it had stays in service")
            })
    })
    .await;
    assert!(said, "{}", f.need_status("app", "proxy/wiki"));
    assert_eq!(
        nginx.get("wiki.app.example.test", "/docs"),
        (200, "wiki on app /docs".to_owned())
    );
    let (_, status, _) = f.fort("ops", "app", &["status", "app"]);
    assert!(
        status.contains("the vhost it had stays in service"),
        "{status}"
    );
    // Named back: accepted again, nothing stopped serving meanwhile.
    f.host("app").needs.get_mut("proxy/wiki").unwrap()["request"]["server_names"] =
        json!(["wiki.app.example.test"]);
    f.write_files();
    f.agents["app"].hup();
    assert!(eventually(Duration::from_secs(20), || f.all_satisfied("app")).await);

    // app releases its need: the vhost goes, the name answers 404.
    f.host("app").needs.remove("proxy/wiki");
    f.write_files();
    f.agents["app"].hup();
    let file = nginx.vhosts().join("fort.app.proxy.wiki.conf");
    let gone = eventually(Duration::from_secs(20), || {
        nginx.get("wiki.app.example.test", "/").0 == 404 && !file.exists()
    })
    .await;
    assert!(
        gone,
        "{:?}, file there: {}",
        nginx.get("wiki.app.example.test", "/"),
        file.exists()
    );
}
