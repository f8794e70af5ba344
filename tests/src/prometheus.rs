//! Prometheus on loopback for tests: Debian's `prometheus` started with a config that
//! scrapes every second from the `file_sd` target files in a directory a test names,
//! its storage in a scratch directory, stopped on drop or on a signal (crate::cleanup);
//! and its HTTP API, read as a user would.

use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fort_core::process::Stop;
use serde_json::Value;

use crate::cleanup::Running;

/// The prometheus program, or `skip`s `test` when it is not installed.
pub fn find(test: &str) -> Option<PathBuf> {
    let found = ["/usr/bin/prometheus", "/usr/local/bin/prometheus"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.exists());
    if found.is_none() {
        crate::skip(test, "prometheus is not installed (Debian's prometheus)");
    }
    found
}

/// A running Prometheus.
pub struct Prometheus {
    _running: Running,
    pub addr: SocketAddr,
    log: PathBuf,
}

impl Prometheus {
    /// Scrapes `<targets>/*.json` every second (job `fort`), listening on `addr`.
    pub fn start(program: &Path, dir: &Path, addr: SocketAddr, targets: &Path) -> Prometheus {
        std::fs::create_dir_all(dir).expect("prometheus dir");
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
                 scrape_configs:\n  - job_name: fort\n    file_sd_configs:\n      - files: ['{}/*.json']\n        refresh_interval: 1s\n",
                targets.display()
            ),
        )
        .expect("write prometheus.yml");
        let log = dir.join("prometheus.log");
        let mut running = Running::spawn(
            Command::new(program)
                .arg(format!("--config.file={}", config.display()))
                .arg(format!(
                    "--storage.tsdb.path={}",
                    dir.join("data").display()
                ))
                .arg(format!("--web.listen-address={addr}"))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log).expect("prometheus log")),
            Stop::TERM,
        )
        .expect("start prometheus");
        let deadline = Instant::now() + Duration::from_secs(30);
        while TcpStream::connect_timeout(&addr, Duration::from_millis(100)).is_err() {
            if let Some(status) = running.exited() {
                panic!(
                    "prometheus exited ({status}):\n{}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
            assert!(Instant::now() < deadline, "prometheus did not listen");
            std::thread::sleep(Duration::from_millis(100));
        }
        Prometheus {
            _running: running,
            addr,
            log,
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `GET /api/v1/<path>`'s `data`, or `None` when it does not answer.
    pub async fn api(&self, path: &str) -> Option<Value> {
        fort_core::tls::install_default_provider();
        let url = format!("http://{}/api/v1/{path}", self.addr);
        let body: Value = reqwest::get(url).await.ok()?.json().await.ok()?;
        (body["status"] == "success").then(|| body["data"].clone())
    }

    /// The result of the instant query `promql` (`/api/v1/query`).
    pub async fn query(&self, promql: &str) -> Vec<Value> {
        fort_core::tls::install_default_provider();
        let url = reqwest::Url::parse_with_params(
            &format!("http://{}/api/v1/query", self.addr),
            [("query", promql)],
        )
        .expect("a URL");
        let body: Option<Value> = match reqwest::get(url).await {
            Ok(r) => r.json().await.ok(),
            Err(_) => None,
        };
        body.and_then(|b| b["data"]["result"].as_array().cloned())
            .unwrap_or_default()
    }

    /// Its active targets (`/api/v1/targets`).
    pub async fn active_targets(&self) -> Vec<Value> {
        self.api("targets?state=active")
            .await
            .and_then(|d| d["activeTargets"].as_array().cloned())
            .unwrap_or_default()
    }
}
