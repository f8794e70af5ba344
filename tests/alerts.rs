//! The shipped Prometheus alert rules (nixos-module/alerts/fort.rules.yml): `promtool
//! check rules` accepts them, and each alert has a `promtool test rules` case that fires
//! it, and only it, on the series real agents exported in its situation. Agents on
//! loopback are put in every situation at once (a credential expiring and not renewed, a
//! provider nobody reaches, a handler that fails, a response whose consumer is gone, an
//! audit trail that cannot be written),
//! beside needs and capabilities that are fine; their /metrics are scraped, and every
//! series becomes promtool's input, with the labels Prometheus adds when it scrapes.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use fort_tests::dns::find_program;
use fort_tests::{eventually, free_addr, metrics, skip, Fleet};
use serde_json::{json, Value};

fn rules_file() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../nixos-module/alerts/fort.rules.yml")
}

fn promtool(test: &str) -> Option<PathBuf> {
    let found = find_program("promtool");
    if found.is_none() {
        skip(test, "promtool is not installed (Debian's prometheus)");
    }
    found
}

#[test]
fn the_shipped_rules_pass_promtool_check() {
    let Some(promtool) = promtool("the_shipped_rules_pass_promtool_check") else {
        return;
    };
    let out = Command::new(promtool)
        .args(["check", "rules"])
        .arg(rules_file())
        .output()
        .expect("run promtool");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Each alert of the rules file with its annotations' templates, read from the file's
/// own convention: `- alert: NAME`, then one-line double-quoted annotations.
fn alerts_in_rules() -> BTreeMap<String, BTreeMap<String, String>> {
    let text = std::fs::read_to_string(rules_file()).expect("read the rules");
    let mut alerts: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    let mut current = None;
    let mut in_annotations = false;
    for line in text.lines() {
        let trimmed = line.trim();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        if let Some(name) = trimmed.strip_prefix("- alert: ") {
            current = Some(name.to_owned());
            alerts.entry(name.to_owned()).or_default();
            in_annotations = false;
        } else if trimmed == "annotations:" {
            in_annotations = true;
        } else if trimmed.ends_with(':') || trimmed.starts_with("- ") {
            in_annotations = false;
        } else if let (true, Some(alert), Some((key, value))) =
            (in_annotations, &current, trimmed.split_once(": "))
        {
            let value: String = serde_json::from_str(value)
                .unwrap_or_else(|e| panic!("{alert}'s {key} is no one-line quoted string: {e}"));
            alerts
                .get_mut(alert)
                .expect("current")
                .insert(key.to_owned(), value);
        }
    }
    alerts
}

/// A template with `{{ $labels.x }}` filled in, as Prometheus renders it.
fn render(template: &str, labels: &BTreeMap<String, String>) -> String {
    let mut out = template.to_owned();
    for (k, v) in labels {
        out = out.replace(&format!("{{{{ $labels.{k} }}}}"), v);
    }
    assert!(
        !out.contains("{{"),
        "a template the test cannot render: {out}"
    );
    out
}

/// One exposition line, `name{labels} value`, as (name, labels, value).
fn parse_line(line: &str) -> Option<(String, BTreeMap<String, String>, f64)> {
    let (series, value) = line.rsplit_once(' ')?;
    let value: f64 = value.parse().ok()?;
    let (name, labels) = match series.split_once('{') {
        Some((name, rest)) => (name, rest.strip_suffix('}')?),
        None => (series, ""),
    };
    let mut map = BTreeMap::new();
    // fort's label values are names and outcomes: no `,` or `"` inside them.
    for pair in labels.split(',').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=')?;
        map.insert(k.to_owned(), v.trim_matches('"').to_owned());
    }
    Some((name.to_owned(), map, value))
}

/// Every series of one scrape, labelled as Prometheus labels a target.
fn scrape(addr: SocketAddr) -> Vec<(String, BTreeMap<String, String>, f64)> {
    metrics(addr)
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(parse_line)
        .map(|(name, mut labels, value)| {
            labels.insert("job".into(), "fort".into());
            labels.insert("instance".into(), addr.to_string());
            (name, labels, value)
        })
        .collect()
}

fn value(
    series: &[(String, BTreeMap<String, String>, f64)],
    name: &str,
    with: &[(&str, &str)],
) -> Option<f64> {
    series
        .iter()
        .find(|(n, labels, _)| {
            n == name
                && with
                    .iter()
                    .all(|(k, v)| labels.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|(_, _, v)| *v)
}

/// Where an alert must fire: the agent, and the label besides `instance` it names.
type Firing = (SocketAddr, Option<(&'static str, &'static str)>);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_alert_fires_on_what_agents_export_in_its_situation() {
    const T: &str = "each_alert_fires_on_what_agents_export_in_its_situation";
    let Some(promtool) = promtool(T) else {
        return;
    };
    let mut f = Fleet::new();
    // A credential living two days, the same whenever it is asked for again: the
    // provider never renews it.
    let expires_at = fort_core::wire::unix_now() + 2 * 86400;
    let tokens = f.script(
        "tokens",
        &format!(
            "cat >/dev/null\nprintf '{{\"c:tok/expiring\": {{\"token\": \"a\", \"expires_at\": {expires_at}}}, \"c:tok/fresh\": {{\"token\": \"b\", \"expires_at\": {expires_at}}}}}'"
        ),
    );
    let broken = f.script("broken", "echo 'the backend is down' >&2\nexit 1");
    // A new response at every run.
    let moving = f.script(
        "moving",
        "cat >/dev/null\nprintf '{\"d:moving/x\": {\"n\": \"%s\"}}' \"$(date +%s%N)\"",
    );
    for (cap, handler) in [("tok", &tokens), ("broken", &broken), ("moving", &moving)] {
        f.capability("p", cap, json!({"handler": handler, "mode": "async"}));
    }
    let out = f.dir.path().join("out");
    let file = |name: &str| json!([{"path": out.join(name)}]);
    f.need(
        "c",
        "tok/expiring",
        "p",
        json!({"renew_before_seconds": 3 * 86400, "files": file("expiring")}),
    );
    f.need("c", "tok/fresh", "p", json!({"files": file("fresh")}));
    f.need("c", "broken/x", "p", json!({"files": file("broken")}));
    // Listed in hosts.json, never started.
    f.host("ghost");
    f.need("c", "tok/lost", "ghost", json!({"files": file("lost")}));
    f.need("d", "moving/x", "p", json!({"files": file("moving")}));
    // c's audit trail would go below a regular file: it can never be written.
    let not_a_dir = f.dir.path().join("not-a-directory");
    std::fs::write(&not_a_dir, "").unwrap();
    let mut scrapes = BTreeMap::new();
    for host in ["p", "c", "d"] {
        let at = free_addr(&f.host(host).addr.ip().to_string());
        scrapes.insert(host, at);
        let audit = if host == "c" {
            format!("[audit]\ndir = \"{}\"\n", not_a_dir.join("audit").display())
        } else {
            String::new()
        };
        f.host(host).extra_toml =
            format!("metrics_listen = \"{at}\"\n[fulfill]\nbackoff = \"200ms\"\n[callbacks]\nbackoff = \"200ms\"\n{audit}");
    }
    f.write_files();
    for host in ["p", "c", "d"] {
        f.start_host(host);
    }
    assert!(
        eventually(Duration::from_secs(30), || f.need_status("d", "moving/x")
            ["satisfied"]
            == true)
        .await,
        "d: {}",
        f.need_status("d", "moving/x")
    );
    // d goes away; its response changes: the callback has nowhere to go.
    f.kill("d");
    let (ok, out) = f.admin("p", &["trigger", "moving", "--force"]);
    assert!(ok, "{out}");

    // Everything in place in one scrape of each agent: the situations, and nothing else.
    let (p, c) = (scrapes["p"], scrapes["c"]);
    let mut series = Vec::new();
    let settled = eventually(Duration::from_secs(60), || {
        let (at_p, at_c) = (scrape(p), scrape(c));
        let need_state = |need: &str, state: &str| {
            value(
                &at_c,
                "fort_need_state",
                &[("need", need), ("state", state)],
            ) == Some(1.0)
        };
        let cap = |name: &str, cap: &str| value(&at_p, name, &[("capability", cap)]);
        let ready = need_state("tok/expiring", "expiring")
            && value(
                &at_c,
                "fort_need_expiry_timestamp_seconds",
                &[("need", "tok/expiring")],
            )
            .is_some()
            && need_state("tok/fresh", "satisfied")
            && value(&at_c, "fort_need_request_failures", &[("need", "tok/lost")])
                .is_some_and(|n| n >= 3.0)
            && value(
                &at_c,
                "fort_need_request_failures",
                &[("need", "tok/fresh")],
            ) == Some(0.0)
            && cap("fort_handler_last_run_success", "broken") == Some(0.0)
            && cap("fort_handler_last_run_success", "tok") == Some(1.0)
            && cap("fort_entries_undelivered", "moving").is_some_and(|n| n >= 1.0)
            && cap("fort_entries_undelivered", "tok") == Some(0.0)
            && value(&at_c, "fort_audit_writable", &[]) == Some(0.0)
            && value(&at_p, "fort_audit_writable", &[]) == Some(1.0);
        if ready {
            series = at_p.into_iter().chain(at_c).collect();
        }
        ready
    })
    .await;
    assert!(
        settled,
        "the situations did not settle:\n{}\n{}",
        metrics(p),
        metrics(c)
    );
    let scraped_at = fort_core::wire::unix_now() as f64;

    // promtool's clock starts at 0: a timestamp becomes the seconds left at the scrape.
    let input: Vec<Value> = series
        .iter()
        .map(|(name, labels, v)| {
            let v = if name.ends_with("_timestamp_seconds") {
                v - scraped_at
            } else {
                *v
            };
            let labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
            json!({"series": format!("{name}{{{}}}", labels.join(",")), "values": format!("{v}x180")})
        })
        .collect();
    let alerts = alerts_in_rules();
    let expected: BTreeMap<&str, Firing> = BTreeMap::from([
        (
            "FortNeedExpiringNotRenewed",
            (c, Some(("need", "tok/expiring"))),
        ),
        ("FortProviderUnreachable", (c, Some(("from", "ghost")))),
        ("FortHandlerFailing", (p, Some(("capability", "broken")))),
        (
            "FortEntriesUndelivered",
            (p, Some(("capability", "moving"))),
        ),
        ("FortAuditUnwritable", (c, None)),
    ]);
    assert_eq!(
        alerts.keys().map(String::as_str).collect::<Vec<_>>(),
        expected.keys().copied().collect::<Vec<_>>(),
        "every shipped alert has a case here, and every case an alert"
    );
    let cases: Vec<Value> = expected
        .iter()
        .map(|(alert, (instance, label))| {
            let mut labels = BTreeMap::from([
                ("severity".to_owned(), "warning".to_owned()),
                ("job".to_owned(), "fort".to_owned()),
                ("instance".to_owned(), instance.to_string()),
            ]);
            if let Some((key, value)) = label {
                labels.insert(key.to_string(), value.to_string());
            }
            let annotations: BTreeMap<&String, String> = alerts[*alert]
                .iter()
                .map(|(k, t)| (k, render(t, &labels)))
                .collect();
            json!({
                "interval": "1m",
                "input_series": input,
                "alert_rule_test": [{
                    "eval_time": "2h",
                    "alertname": alert,
                    "exp_alerts": [{"exp_labels": labels, "exp_annotations": annotations}],
                }],
            })
        })
        .collect();
    // JSON is YAML: promtool reads the test file as is.
    let dir = tempfile::tempdir().unwrap();
    let test_file = dir.path().join("fort.test.yml");
    std::fs::write(
        &test_file,
        serde_json::to_vec_pretty(&json!({
            "rule_files": [rules_file()],
            "evaluation_interval": "1m",
            "tests": cases,
        }))
        .unwrap(),
    )
    .unwrap();
    let out = Command::new(promtool)
        .args(["test", "rules"])
        .arg(&test_file)
        .output()
        .expect("run promtool");
    assert!(
        out.status.success(),
        "{}{}\n(the series: {})",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        std::fs::read_to_string(&test_file).unwrap_or_default()
    );
}
