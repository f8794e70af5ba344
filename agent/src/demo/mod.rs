//! `fort-agent demo`: a three-host fleet on loopback, started from this very binary, that
//! converges (credentials landing in files, their units restarted once) and then walks
//! through a certificate rotation, a released need, a provider killed with `kill -9` and
//! a certificate renewed before it expires. Every step checks its claim against the agents' state
//! and the files the example handlers write, and fails the demo when it does not hold, so
//! the demo doubles as an end-to-end test in CI. Whatever way it ends (done, failed,
//! Ctrl-C), it stops everything it started: agents, servers and their children.

mod acme;
mod dns;
mod examples;
mod fleet;
mod oidc;
mod postgres;
mod proxy;
mod steps;

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context};
use serde_json::{json, Value};

use fleet::{CapDecl, Fleet, NeedDecl};
use steps::{all_satisfied, cert_serial, need_items, payload, Wait};

#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    /// Keep the fleet running after the walkthrough (until Ctrl-C) to try `fort` commands.
    #[arg(long)]
    pub keep: bool,
    /// Put the fleet's files here (a new or empty directory, kept afterwards) instead of a
    /// temporary directory.
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

const WIKI_DOMAIN: &str = "wiki.demo.test";
const API_DOMAIN: &str = "api.demo.test";
const SHORT_DOMAIN: &str = "short.demo.test";
/// The short-lived certificate lives this long and is renewed this long before it ends.
const SHORT_LIFETIME: u64 = 15;
const SHORT_RENEW_BEFORE: u64 = 10;

/// The walkthrough's steps once the fleet has converged, numbered from 1: (short name,
/// title). A need that a step adds or releases names the step's number.
const STEPS: [(&str, &str); 9] = [
    ("rotation", "certificate rotation reaches only its consumer"),
    (
        "reference",
        "a request built from another need's response follows it",
    ),
    ("release", "a removed need is released and cleaned up"),
    ("kill -9", "the provider killed and restarted loses nothing"),
    (
        "renewal",
        "a certificate living seconds is renewed before it expires",
    ),
    (
        "acme",
        "a certificate from an ACME CA, validated at nginx, for a key app made itself",
    ),
    (
        "oidc",
        "an OIDC client registered at a real OpenID provider",
    ),
    ("nginx", "a virtual host at a real nginx forwards to app"),
    ("postgres", "a database at a real PostgreSQL for app"),
];
const RELEASE_STEP: usize = 3;
const RENEWAL_STEP: usize = 5;

fn declarations() -> (Vec<CapDecl>, Vec<NeedDecl>) {
    let cap = |host, name, handler, cache_response, description| CapDecl {
        host,
        name,
        handler,
        command: None,
        cache_response,
        description,
    };
    let caps = vec![
        cap(
            "forge",
            "oidc",
            "oidc-provider.sh",
            true,
            "OIDC client id and secret per consumer need",
        ),
        cap(
            "forge",
            "ssl-cert",
            "cert-provider.sh",
            true,
            "self-signed certificate per requested domain",
        ),
        cap(
            "beacon",
            "proxy",
            "proxy-provider.sh",
            false,
            "reverse-proxy vhost file; answers OK",
        ),
    ];
    let need = |key, from, request: Value| NeedDecl {
        consumer: "app",
        key,
        from,
        request,
        handler: None,
        files: Vec::new(),
        more: json!({}),
        added_in: None,
        released_in: None,
    };
    let needs = vec![
        // Delivered the NixOS way: two files cut from the JSON payload, and the service
        // using them restarted once when they change.
        NeedDecl {
            files: vec![
                ("client_id", "/client_id", "0444"),
                ("client_secret", "/client_secret", "0400"),
            ],
            more: json!({"restart_units": ["wiki.service"]}),
            ..need(
                "oidc/wiki",
                "forge",
                json!({"client_name": "wiki", "redirect_uris": [format!("https://{WIKI_DOMAIN}/oauth/callback")]}),
            )
        },
        NeedDecl {
            files: vec![("bundle.pem", "", "0400")],
            more: json!({"reload_units": ["nginx.service"]}),
            ..need("ssl-cert/wiki", "forge", json!({"domain": WIKI_DOMAIN}))
        },
        // Delivered by a handler of its own (an example script that stores the payload).
        NeedDecl {
            handler: Some("store-payload.sh"),
            ..need("ssl-cert/api", "forge", json!({"domain": API_DOMAIN}))
        },
        // Built from another need's response: users sign in through the wiki's own OIDC
        // client, whatever id forge issued it. Sent once oidc/wiki is satisfied, and again
        // whenever its client_id changes.
        NeedDecl {
            released_in: Some(RELEASE_STEP),
            ..need(
                "proxy/wiki",
                "beacon",
                json!({
                    "server_names": [WIKI_DOMAIN],
                    "port": 3000,
                    "sign_in_client": {"$fort_ref": "oidc/wiki#/client_id"},
                }),
            )
        },
        // Added by the renewal step: a certificate that lives seconds, renewed before it
        // expires.
        NeedDecl {
            files: vec![("bundle.pem", "", "0400")],
            more: json!({"reload_units": ["nginx.service"], "renew_before_seconds": SHORT_RENEW_BEFORE}),
            added_in: Some(RENEWAL_STEP),
            ..need(
                "ssl-cert/short",
                "forge",
                json!({"domain": SHORT_DOMAIN, "lifetime_seconds": SHORT_LIFETIME}),
            )
        },
    ];
    (caps, needs)
}

/// What each demo host asks for: `{<consumer>: {<need>: <request>}}`, as written to its
/// needs.json. examples/demo-fleet declares the same fleet for NixOS; a test holds the
/// two together, and these requests against the shipped interfaces.
pub fn requests() -> Value {
    let (_, needs) = declarations();
    let mut out = serde_json::Map::new();
    for n in needs {
        let host = out
            .entry(n.consumer.to_owned())
            .or_insert_with(|| json!({}));
        host[n.key] = n.request;
    }
    Value::Object(out)
}

pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    // From here on a signal ends the demo through its normal path, which stops what it
    // started: one arriving while the servers start is acted on once they are up.
    let mut signals = Signals::new()?;
    for tool in ["jq", "openssl"] {
        if !on_path(tool) {
            bail!("the example handlers need `{tool}` on PATH");
        }
    }
    let (temp, root) = match &args.dir {
        Some(d) => {
            std::fs::create_dir_all(d).with_context(|| format!("cannot create {}", d.display()))?;
            if std::fs::read_dir(d)?.next().is_some() {
                bail!(
                    "{} is not empty: old keys and state would mix with the demo's",
                    d.display()
                );
            }
            (None, d.canonicalize()?)
        }
        None => {
            let t = tempfile::Builder::new().prefix("fort-demo-").tempdir()?;
            let root = t.path().to_owned();
            (Some(t), root)
        }
    };
    let (mut caps, mut needs) = declarations();
    let mut declare = |(cap, need)| {
        caps.push(cap);
        needs.push(need);
    };
    // The servers of the last steps, where they are installed. Each is stopped when the
    // demo ends, after the agents (declared later, dropped first).
    let nginx = optional(
        "nginx",
        "the nginx and ACME steps are",
        proxy::DemoNginx::start(&root),
        |n| n.declarations(&root),
        &mut declare,
    );
    // The ACME CA validates names at that nginx.
    let ca = match &nginx {
        Some(n) => optional(
            "pebble",
            "the ACME step is",
            acme::DemoCa::start(&root, n),
            |ca| ca.declarations(&root),
            &mut declare,
        ),
        None => None,
    };
    let idp = optional(
        "the OpenID provider",
        "the OpenID step is",
        oidc::DemoIdp::start(&root),
        |i| i.declarations(&root),
        &mut declare,
    );
    let pg = optional(
        "PostgreSQL",
        "the PostgreSQL step is",
        postgres::DemoPostgres::start(),
        |p| p.declarations(&root),
        &mut declare,
    );
    let servers = Servers {
        ca: ca.as_ref(),
        idp: idp.as_ref(),
        nginx: nginx.as_ref(),
        pg: pg.as_ref(),
    };
    let mut fleet = Fleet::create(&root, &["forge", "beacon", "app"], caps, needs)?;
    let outcome = tokio::select! {
        r = walkthrough(&mut fleet, &servers) => r,
        s = signals.recv() => Err(anyhow::anyhow!("interrupted by {s}")),
    };
    match outcome {
        Ok(()) if args.keep => {
            print_commands(&fleet, temp.is_some());
            let how = signals.recv().await;
            println!("\n{how}: stopping the fleet.");
            Ok(())
        }
        Ok(()) => Ok(()),
        Err(e) => {
            eprintln!("\n{}", fleet.log_tails(15));
            drop(fleet);
            // On failure the files and logs stay for a post-mortem.
            let kept = match temp {
                Some(t) => t.keep(),
                None => root,
            };
            Err(e.context(format!(
                "demo failed; files and agent logs kept in {}",
                kept.display()
            )))
        }
    }
}

/// The servers the demo started for its last steps (`None`: not installed or unusable).
struct Servers<'a> {
    ca: Option<&'a acme::DemoCa>,
    idp: Option<&'a oidc::DemoIdp>,
    nginx: Option<&'a proxy::DemoNginx>,
    pg: Option<&'a postgres::DemoPostgres>,
}

/// A server of the last steps, started: its capability and need declared, or `None`
/// (not installed; or failed, which is said) so that its step says it is skipped.
fn optional<T>(
    what: &str,
    steps: &str,
    started: anyhow::Result<Option<T>>,
    declarations: impl FnOnce(&T) -> anyhow::Result<(CapDecl, NeedDecl)>,
    declare: &mut impl FnMut((CapDecl, NeedDecl)),
) -> Option<T> {
    let server = match started {
        Ok(server) => server?,
        Err(e) => {
            println!("{what} could not be started ({e:#}); {steps} skipped");
            return None;
        }
    };
    match declarations(&server) {
        Ok(d) => {
            declare(d);
            Some(server)
        }
        Err(e) => {
            println!("{what} could not be used ({e:#}); {steps} skipped");
            None
        }
    }
}

/// Ctrl-C, SIGTERM and SIGHUP (a closed terminal), caught from the demo's start.
struct Signals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> anyhow::Result<Signals> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Signals {
            int: signal(SignalKind::interrupt())?,
            term: signal(SignalKind::terminate())?,
            hup: signal(SignalKind::hangup())?,
        })
    }

    async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.int.recv() => "Ctrl-C",
            _ = self.term.recv() => "SIGTERM",
            _ = self.hup.recv() => "SIGHUP",
        }
    }
}

fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
}

/// Elapsed seconds, for progress lines.
fn secs(since: Instant) -> String {
    format!("{:.2}s", since.elapsed().as_secs_f64())
}

async fn walkthrough(fleet: &mut Fleet, servers: &Servers<'_>) -> anyhow::Result<()> {
    println!(
        "fort demo: three agents on loopback, files in {}",
        fleet.root.display()
    );
    for h in &fleet.hosts {
        let addr = h.addr.to_string();
        let mut first = true;
        let mut line = |what: String| {
            let (name, addr) = if first {
                (h.name, addr.as_str())
            } else {
                ("", "")
            };
            println!("  {name:<7} {addr:<16} {what}");
            first = false;
        };
        for c in fleet.caps.iter().filter(|c| c.host == h.name) {
            line(format!("serves {:<14} {}", c.name, c.description));
        }
        for n in fleet.needs.iter().filter(|n| n.consumer == h.name) {
            let later = match n.added_in {
                Some(step) => format!(" (added in step {step})"),
                None => String::new(),
            };
            line(format!("needs  {:<14} from {}{later}", n.key, n.from));
        }
    }
    println!("  ops     principal        the operator; its key signs the `fort` CLI's calls\n");

    // Converge: start everyone, then watch app's needs until all are satisfied.
    println!("Starting the agents and waiting until every need of app is satisfied");
    let t0 = Instant::now();
    for name in ["forge", "beacon", "app"] {
        let pid = fleet.start(name).await?;
        println!("  +{}  {name} is up (pid {pid})", secs(t0));
    }
    let mut shown: std::collections::HashMap<String, (bool, bool, String)> = Default::default();
    let wait = Wait::until("every need of app is satisfied");
    loop {
        let s = fleet.status("app").await?;
        for n in need_items(&s) {
            let key = n["need"].as_str().unwrap_or("?").to_owned();
            let asked = !n["last_sought"].is_null();
            let now = (
                n["satisfied"] == true,
                asked,
                n["reason"].as_str().unwrap_or("").to_owned(),
            );
            if shown.get(&key) != Some(&now) {
                let what = match &now {
                    (true, _, _) => "satisfied".to_owned(),
                    (false, false, _) => "not asked yet".to_owned(),
                    (false, true, e) if e.is_empty() => {
                        "asked, waiting for the callback".to_owned()
                    }
                    (false, true, e) => format!("not yet: {e}"),
                };
                println!(
                    "  +{}  {key:<14} from {:<7} {what}",
                    secs(t0),
                    n["from"].as_str().unwrap_or("?")
                );
                shown.insert(key, now);
            }
        }
        if all_satisfied(&s) {
            break;
        }
        if let Err(e) = wait.tick().await {
            return Err(e.context(why_unsatisfied(fleet, &s).await));
        }
    }
    let converged = t0.elapsed();
    let s = fleet.status("app").await?;
    println!(
        "Converged: {}/{} needs satisfied in {:.2}s (from the first agent's start)",
        s["needs"]["satisfied"],
        s["needs"]["total"],
        converged.as_secs_f64()
    );
    let read = |need: &str, name: &str| {
        let path = fleet.delivered(need, name);
        std::fs::read_to_string(&path)
            .with_context(|| format!("{need} was satisfied but {} is missing", path.display()))
    };
    let client_id = read("oidc/wiki", "client_id")?;
    let secret = read("oidc/wiki", "client_secret")?;
    println!("  app/run/needs/oidc/wiki/client_id       {client_id} (mode 0444)");
    println!(
        "  app/run/needs/oidc/wiki/client_secret   {}… (mode 0400)",
        &secret[..8.min(secret.len())]
    );
    for (need, shown) in [
        ("ssl-cert/wiki", "app/run/needs/ssl-cert/wiki/bundle.pem"),
        ("ssl-cert/api", "app/examples/ssl-cert_api (its handler)"),
    ] {
        let (_, pem) =
            payload(fleet, need).with_context(|| format!("{need} payload is not stored"))?;
        let pem = String::from_utf8_lossy(&pem);
        if !pem.starts_with("-----BEGIN CERTIFICATE-----") || !pem.contains("PRIVATE KEY-----") {
            bail!("{need}: the stored payload is not a PEM certificate and key");
        }
        println!(
            "  {shown:<39} PEM certificate + key, {}",
            cert_serial(fleet, need)
        );
    }
    // One restart of wiki.service for its two files, one reload of nginx for its
    // certificate: each unit once per round, whatever number of files changed.
    let wait = Wait::until("the units of the delivered files are restarted and reloaded");
    let expected = ["restart -- wiki.service", "reload -- nginx.service"];
    while !expected
        .iter()
        .all(|e| fleet.systemctl_calls().iter().any(|c| c == e))
    {
        wait.tick().await?;
    }
    steps::settle_rounds().await;
    let calls = fleet.systemctl_calls();
    println!(
        "  systemctl (a recorder: the demo runs without systemd) was asked: {}",
        calls.join("; ")
    );
    if calls.len() != expected.len() {
        bail!("each unit should be restarted or reloaded once, systemctl was asked {calls:?}");
    }
    let vhost = fleet.examples_dir("beacon").join("vhosts/app@wiki.conf");
    let conf = std::fs::read_to_string(&vhost).context("beacon wrote no vhost for proxy/wiki")?;
    println!(
        "  beacon/examples/vhosts/app@wiki.conf  {}\n{:<41}{}\n",
        conf.lines().nth(1).unwrap_or("").trim(),
        "",
        conf.lines().nth(2).unwrap_or("").trim()
    );

    let mut results = vec![format!(
        "converged          {}/{} needs in {:.2}s",
        s["needs"]["satisfied"],
        s["needs"]["total"],
        converged.as_secs_f64()
    )];
    for (i, (short, title)) in STEPS.iter().enumerate() {
        let step = i + 1;
        println!("Step {step}/{}: {title}", STEPS.len());
        let started = Instant::now();
        let detail = match step {
            1 => steps::rotation(fleet).await,
            2 => steps::reference(fleet).await,
            RELEASE_STEP => steps::release(fleet).await,
            4 => steps::kill_and_restart(fleet).await,
            RENEWAL_STEP => steps::renewal(fleet).await,
            acme::STEP => acme::step(fleet, servers.ca, servers.nginx).await,
            oidc::STEP => oidc::step(fleet, servers.idp).await,
            proxy::STEP => proxy::step(fleet, servers.nginx).await,
            _ => postgres::step(fleet, servers.pg).await,
        }
        .with_context(|| format!("step {step} ({title}) failed"))?;
        let took = secs(started);
        println!("  OK in {took}\n");
        results.push(format!(
            "{:<18} OK  {detail} ({took})",
            format!("{step} {short}")
        ));
    }
    println!("Summary");
    for r in &results {
        println!("  {r}");
    }
    println!("All steps passed.");
    Ok(())
}

/// For a convergence failure: each unsatisfied need with its own last error, or else the
/// outcome of its provider's last handler run (a failing handler is only seen there).
async fn why_unsatisfied(fleet: &Fleet, status: &Value) -> String {
    let mut out = Vec::new();
    for n in need_items(status).iter().filter(|n| n["satisfied"] != true) {
        let need = n["need"].as_str().unwrap_or("?");
        let from = n["from"].as_str().unwrap_or("?");
        let why = match n["reason"].as_str() {
            Some(e) => e.to_owned(),
            None => {
                let cap = need.split('/').next().unwrap_or("");
                match fleet.status(from).await {
                    Ok(p) => {
                        let last = &p["provider"]["capabilities"][cap]["last_run"];
                        match last["error"].as_str() {
                            Some(e) => format!("{from}'s {cap} handler failed: {e}"),
                            None => format!("no callback yet; {from}'s last {cap} run: {last}"),
                        }
                    }
                    Err(e) => format!("{from} does not answer: {e:#}"),
                }
            }
        };
        out.push(format!("{need} from {from}: {why}"));
    }
    format!("unsatisfied: {}", out.join("; "))
}

/// Single-quotes `p` for a shell when it holds anything but plain path characters.
fn sh_quote(p: &Path) -> String {
    let s = p.display().to_string();
    if s.bytes()
        .all(|c| c.is_ascii_alphanumeric() || b"/._-+@:".contains(&c))
    {
        s
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

fn print_commands(fleet: &Fleet, temporary: bool) {
    let exe = std::env::current_exe().unwrap_or_else(|_| "fort-agent".into());
    let fort = exe.with_file_name("fort");
    let root = &fleet.root;
    println!("\nThe fleet keeps running. Try, in another terminal:\n");
    println!(
        "  export FORT_HOSTS={} FORT_SSH_KEY={} FORT_ORIGIN=ops",
        sh_quote(&root.join("hosts.json")),
        sh_quote(&root.join("ops.key"))
    );
    println!("  {} fleet", sh_quote(&fort));
    println!("  {} status app", sh_quote(&fort));
    println!("  {} status forge", sh_quote(&fort));
    println!(
        "  {} trigger forge oidc --entry app:oidc/wiki --force",
        sh_quote(&fort)
    );
    println!("  {} resend app ssl-cert/api", sh_quote(&fort));
    println!(
        "  {} status --config {}",
        sh_quote(&exe),
        sh_quote(&fleet.config("app"))
    );
    println!(
        "  {} trigger ssl-cert --force --config {}",
        sh_quote(&exe),
        sh_quote(&fleet.config("forge"))
    );
    println!(
        "  ls -l {}",
        sh_quote(&fleet.host("app").dir.join("run/needs/oidc/wiki"))
    );
    println!("  cat {}", sh_quote(&root.join(fleet::SYSTEMCTL_LOG)));
    println!(
        "  tail -n 5 {}",
        sh_quote(&fleet.host("app").dir.join("agent.log"))
    );
    if !fort.exists() {
        // Built by the same profile as this binary, where the commands above look for it.
        let release = exe.components().any(|c| c.as_os_str() == "release");
        println!(
            "  (build {} first: cargo build{} --bin fort)",
            fort.display(),
            if release { " --release" } else { "" }
        );
    }
    println!(
        "\nCtrl-C stops the agents{}.",
        if temporary {
            " and removes the temporary directory"
        } else {
            ""
        }
    );
}

#[cfg(test)]
mod tests {
    use fort_core::schema::RequestSchema;
    use serde_json::Value;

    /// Every request the demo sends fits the request schema its capability's shipped
    /// interface becomes (nixos-module/interfaces, rendered into the module tests'
    /// expected schemas.json, which the module evaluation test keeps current), so the
    /// demo's scenario also evaluates as NixOS configuration.
    #[test]
    fn the_demo_asks_what_the_shipped_interfaces_accept() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../nixos-module/tests/expected/schemas.json"
        );
        let schemas: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        let mut checked = 0;
        for (host, needs) in super::requests().as_object().unwrap() {
            for (need, request) in needs.as_object().unwrap() {
                let cap = need.split('/').next().unwrap();
                let schema = RequestSchema::compile(schemas["schemas"][cap].clone())
                    .unwrap_or_else(|e| panic!("no schema for {cap}: {e}"));
                // A reference is resolved before sending; the resolved value is checked
                // by the provider. Here it stands for a value the schema accepts.
                let mut resolved = request.clone();
                if let Some(map) = resolved.as_object_mut() {
                    map.retain(|_, v| !v.get("$fort_ref").is_some_and(Value::is_string));
                }
                let problems = schema.violations(&resolved);
                assert!(problems.is_empty(), "{host} {need}: {problems:?}");
                checked += 1;
            }
        }
        assert_eq!(checked, 5);
    }
}
