//! scrape end to end, as a user meets it: real fort agents (a provider `mon` running
//! `fort-handler scrape`, a consumer `app` whose own agent serves `/metrics`), and a real
//! Prometheus on loopback reading the target files the handler writes. app's exporter is
//! `up` in Prometheus' API within a few scrape intervals, at app's address from the
//! registry and labelled with who asked; a request naming another address, or a reserved
//! label, or a port the provider does not allow, is refused and costs only that entry;
//! a release takes the target out.

use std::path::Path;
use std::time::{Duration, Instant};

use fort_tests::prometheus::{find, Prometheus};
use fort_tests::{bin, eventually, free_addr, Fleet};
use serde_json::{json, Value};

fn schema() -> Value {
    let schemas: Value = serde_json::from_slice(
        &std::fs::read(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../nixos-module/tests/expected/schemas.json"),
        )
        .unwrap(),
    )
    .unwrap();
    schemas["schemas"]["scrape"].clone()
}

/// Prometheus' active target whose `fort_need` label is `need`, if any.
async fn target(prometheus: &Prometheus, need: &str) -> Option<Value> {
    prometheus
        .active_targets()
        .await
        .into_iter()
        .find(|t| t["labels"]["fort_need"] == need)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_what_a_consumer_declares_at_its_own_address() {
    let test = "scrape::prometheus_scrapes_what_a_consumer_declares_at_its_own_address";
    let Some(program) = find(test) else {
        return;
    };
    let mut f = Fleet::new();
    let root = f.dir.path().to_path_buf();
    f.host("mon");
    // app's agent serves /metrics on its own address, as the registry gives it.
    let app_ip = f.host("app").addr.ip().to_string();
    let metrics = free_addr(&app_ip);
    f.host("app").extra_toml = format!("metrics_listen = \"{metrics}\"\n");
    let targets = root.join("targets");
    let config = root.join("scrape.json");
    std::fs::write(
        &config,
        json!({
            "state_file": root.join("scrape-state.json"),
            "targets_dir": targets,
            "hosts_file": f.host_dir("mon").join("hosts.json"),
            "ports": {"*": [metrics.port().to_string()]},
            "labels": {"*": ["env"]},
        })
        .to_string(),
    )
    .unwrap();
    f.capability(
        "mon",
        "scrape",
        json!({"handler": bin("fort-handler"), "args": ["scrape", "--config", config],
               "mode": "async", "cacheResponse": true, "request_schema": schema()}),
    );
    let need = |f: &mut Fleet, id: &str, request: Value| {
        f.need(
            "app",
            &format!("scrape/{id}"),
            "mon",
            json!({"request": request, "nag_seconds": 5,
                   "files": [{"name": "target", "path": root.join(format!("target-{id}")), "pointer": "/target"}]}),
        );
    };
    let request = |port: u16, labels: Value| json!({"port": port, "path": "/metrics", "job": null, "labels": labels});
    need(
        &mut f,
        "agent",
        request(metrics.port(), json!({"env": "test"})),
    );
    // Each of these is refused, and costs nothing of the one above.
    need(
        &mut f,
        "elsewhere",
        json!({"port": metrics.port(), "address": "127.0.0.1"}),
    );
    need(
        &mut f,
        "spoof",
        request(metrics.port(), json!({"instance": "db:9100"})),
    );
    need(&mut f, "ssh", request(22, json!({})));
    f.start();
    let prometheus = Prometheus::start(
        &program,
        &root.join("prometheus"),
        free_addr("127.0.0.1"),
        &targets,
    );

    let status = |f: &Fleet, id: &str| f.need_status("app", &format!("scrape/{id}"));
    assert!(
        eventually(Duration::from_secs(30), || status(&f, "agent")["state"]
            == "satisfied")
        .await,
        "{}\nmon log:\n{}",
        status(&f, "agent"),
        std::fs::read_to_string(f.host_dir("mon").join("agent.log")).unwrap_or_default()
    );
    // The target is app's address from the registry, the port it asked for.
    let delivered = std::fs::read_to_string(root.join("target-agent")).unwrap();
    assert_eq!(delivered, metrics.to_string());

    // up in Prometheus within a few scrape intervals (1 s each) of the file landing.
    let landed = Instant::now();
    let mut up = None;
    while landed.elapsed() < Duration::from_secs(20) {
        if let Some(t) = target(&prometheus, "scrape/agent").await {
            if t["health"] == "up" {
                up = Some(t);
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let Some(t) = up else {
        panic!(
            "no target up: {:?}\nprometheus:\n{}",
            prometheus.active_targets().await,
            prometheus.log_text()
        );
    };
    eprintln!(
        "scrape/agent up in Prometheus {:?} after its target file",
        landed.elapsed()
    );
    assert_eq!(t["labels"]["instance"], metrics.to_string());
    // The job is the caller's own, under its name.
    assert_eq!(t["labels"]["job"], "app:agent");
    assert_eq!(t["labels"]["fort_host"], "app");
    assert_eq!(t["labels"]["env"], "test");
    assert_eq!(t["scrapeUrl"], format!("http://{metrics}/metrics"));
    // What it scraped are the agent's own series, labelled with who asked.
    let mut series = Vec::new();
    for _ in 0..50 {
        series = prometheus
            .query(r#"count({fort_host="app", fort_need="scrape/agent", __name__=~"fort_.+"})"#)
            .await;
        if !series.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        series
            .first()
            .is_some_and(|s| s["value"][1].as_str().is_some_and(|n| n != "0")),
        "no series of app's agent: {series:?}"
    );

    // The bad entries: refused, each with its reason; none of them is a target.
    let reason = |f: &Fleet, id: &str| status(f, id)["reason"].as_str().unwrap_or("").to_owned();
    assert!(
        eventually(Duration::from_secs(30), || {
            reason(&f, "elsewhere").contains("address")
                && reason(&f, "spoof").contains("the label instance is reserved")
                && reason(&f, "ssh").contains("port 22 is not one app may be scraped on")
        })
        .await,
        "{} / {} / {}",
        reason(&f, "elsewhere"),
        reason(&f, "spoof"),
        reason(&f, "ssh")
    );
    let active = prometheus.active_targets().await;
    assert_eq!(active.len(), 1, "{active:?}");

    // A release takes the target out of Prometheus.
    f.host("app").needs.remove("scrape/agent");
    f.write_files();
    f.agents["app"].hup();
    let mut gone = false;
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if target(&prometheus, "scrape/agent").await.is_none() {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(gone, "the released target is still scraped");
    assert!(!targets.join("app.json").exists());
}
