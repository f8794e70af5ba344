//! The crash lane (docs/crash-points.md): a provider and a consumer, each with a state
//! key and an audit trail, run the real `fort-handler ssh-ca` and a script capability;
//! the lane kills a process with SIGKILL at every named crash point on a path that
//! writes state (the agent, the handler it runs, `state-key rotate`), starts it again,
//! and holds: the agent starts; no accepted request, applied payload or signed audit
//! record is lost; no file is left that the next start refuses; no secret is in the clear
//! on disk under a state key. Then it kills the agents at random instants while
//! rotations run, many times, and holds the same. It records how many points and kills
//! it tried (`scripts/test.sh` prints them).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use base64::Engine;
use fort_core::crash::POINTS;
use fort_tests::{bin, contains_bytes, eventually, files_under, Fleet};
use serde_json::{json, Value};

/// What every issued secret holds, to search the disks for.
const CANARY: &str = "crash-canary-5d1e0c7a9b3f42e8a6c4d2f0b8e7a9c1";

/// The consumer's needs: two files in two directories (written one by one), one file,
/// and an SSH user certificate for a key the consumer makes.
const NEEDS: [&str; 4] = ["cred/a", "cred/b", "ssh-ca/login", "scrape/node"];

/// Who a point is armed in.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Target {
    Provider,
    Consumer,
    /// The provider's agent, whose handlers inherit the arming.
    ProviderHandler,
    /// `fort-agent state-key rotate` on the stopped provider.
    Rotate,
}

/// How the fleet comes to the point once armed.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Provoke {
    /// A fresh fleet's first start and convergence passes it.
    FirstStart,
    /// A forced rotation of every entry, and the deliveries after it.
    Rotation,
    /// The provider's handler state was plain when the key came: sealed in place.
    KeyAdded,
    /// `state-key rotate` to a new key.
    KeyRotation,
}

fn scenario(point: &str) -> (Target, Provoke) {
    use Provoke::*;
    use Target::*;
    match point {
        "store.seal.temp" => (ProviderHandler, KeyAdded),
        p if p.starts_with("state-key.") => (Rotate, KeyRotation),
        p if p.starts_with("handler.") => (ProviderHandler, FirstStart),
        p if p.starts_with("deliver.") || p.starts_with("keys.") => (Consumer, FirstStart),
        "audit.rotate.created" => (Provider, Rotation),
        _ => (Provider, FirstStart),
    }
}

struct Lane {
    f: Fleet,
    out: PathBuf,
    keys: [PathBuf; 2],
}

/// The fleet; `provider_key`: whether the provider has its state key from the start (the
/// consumer always has one).
fn lane(provider_key: bool) -> Lane {
    let mut f = Fleet::new();
    let d = f.dir.path().to_path_buf();
    let out = d.join("out");
    let issue = f.script(
        "issue",
        &format!(
            r#"jq -c --arg c "{CANARY}" --arg r "$(od -An -N8 -tx8 /dev/urandom | tr -d ' ')" 'with_entries(.value = (if .value.response != null then .value.response else {{"secret": ($c + "-" + $r + "-" + .key), "id": .key}} end))'"#
        ),
    );
    f.capability(
        "p",
        "cred",
        json!({"handler": issue, "mode": "async", "cacheResponse": true}),
    );
    let ssh = d.join("p").join("state").join("handlers").join("ssh-ca");
    std::fs::create_dir_all(d.join("p")).unwrap();
    let config = d.join("p").join("ssh-ca.json");
    std::fs::write(
        &config,
        json!({"ca_key_file": ssh.join("ca"), "generate_ca_key": true,
               "state_file": ssh.join("state.json"), "hosts_file": d.join("p/hosts.json"),
               "user_principals": {"*": ["{origin}"]}})
        .to_string(),
    )
    .unwrap();
    f.capability(
        "p",
        "ssh-ca",
        json!({"handler": bin("fort-handler"), "args": ["ssh-ca", "--config", config],
               "mode": "async"}),
    );
    // A file a handler keeps for a server to read (Prometheus' target file).
    let scrape = d.join("p").join("scrape.json");
    std::fs::write(
        &scrape,
        json!({"state_file": d.join("p/state/handlers/scrape.json"),
               "targets_dir": d.join("p/targets"), "hosts_file": d.join("p/hosts.json"),
               "ports": {"*": ["9100"]}})
        .to_string(),
    )
    .unwrap();
    std::fs::create_dir_all(d.join("p/targets")).unwrap();
    f.capability(
        "p",
        "scrape",
        json!({"handler": bin("fort-handler"), "args": ["scrape", "--config", scrape],
               "mode": "async"}),
    );
    let file = |path: PathBuf, pointer: &str| json!({"path": path, "pointer": pointer});
    f.need(
        "c",
        "cred/a",
        "p",
        json!({"files": [file(out.join("a1/secret"), "/secret"),
                         file(out.join("a2/id"), "/id")]}),
    );
    f.need(
        "c",
        "cred/b",
        "p",
        json!({"files": [file(out.join("b/secret"), "/secret")]}),
    );
    f.need(
        "c",
        "ssh-ca/login",
        "p",
        json!({"request": {"kind": "user", "public_key": {"$fort_key": "id", "as": "openssh"},
                           "principals": ["c"]},
               "keys": {"id": {"type": "ed25519", "format": "openssh",
                               "path": out.join("login/id_ed25519"), "mode": "0600"}},
               "files": [file(out.join("login/id_ed25519-cert.pub"), "/certificate")]}),
    );
    f.need(
        "c",
        "scrape/node",
        "p",
        json!({"request": {"port": 9100}, "files": [file(out.join("node/target"), "/target")]}),
    );
    let keys = [f.new_state_key("p-key"), f.new_state_key("c-key")];
    for (host, key) in [("p", &keys[0]), ("c", &keys[1])] {
        let key_line = if provider_key || host == "c" {
            format!("state_key_file = \"{}\"\n", key.display())
        } else {
            String::new()
        };
        // Small trail files, so rotation of the trail happens within the lane.
        f.host(host).extra_toml = format!(
            "{key_line}[audit]\ncheckpoint_interval = \"1s\"\nmax_file_bytes = 4096\nmax_files = 3\n[callbacks]\nbackoff = \"200ms\"\n[fulfill]\nbackoff = \"200ms\"\ntimeout = \"5s\"\n"
        );
    }
    Lane { f, out, keys }
}

fn host_of(target: Target) -> &'static str {
    match target {
        Target::Consumer => "c",
        _ => "p",
    }
}

fn log(f: &Fleet, host: &str) -> String {
    std::fs::read_to_string(f.host_dir(host).join("agent.log")).unwrap_or_default()
}

/// Every spelling of `needle` a state file could hold: as it is, and inside base64 at
/// each of the three alignments.
fn spellings(needle: &str) -> Vec<Vec<u8>> {
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut out = vec![needle.as_bytes().to_vec()];
    for offset in 0..3usize {
        let mut data = vec![b'x'; offset];
        data.extend_from_slice(needle.as_bytes());
        let text = b64.encode(&data);
        let skip = (offset * 4).div_ceil(3) + 1;
        out.push(text.as_bytes()[skip..text.len() - 4].to_vec());
    }
    out
}

/// The signed prefix of a host's trail: every line up to the last good checkpoint.
fn signed_lines(f: &Fleet, host: &str) -> Vec<Vec<u8>> {
    fort_core::audit::signed_lines(
        &f.host_dir(host).join("state").join("audit"),
        host,
        &f.hosts[host].keys(),
    )
}

/// What must hold after every crash and restart; each violation, one line.
async fn violations(l: &Lane, signed_before: &[(String, Vec<Vec<u8>>)]) -> Vec<String> {
    let f = &l.f;
    let mut out = Vec::new();
    let converged = eventually(Duration::from_secs(60), || f.all_satisfied("c")).await;
    if !converged {
        out.push(format!(
            "c's needs were not all satisfied again: {}",
            f.status("c")["needs"]
        ));
    }
    let entries: BTreeSet<String> = f.entries("p").into_iter().collect();
    for need in NEEDS {
        if !entries.contains(&format!("c:{need}")) {
            out.push(format!("p lost the entry c:{need}"));
        }
    }
    for (file, holds) in [
        ("a1/secret", CANARY),
        ("b/secret", CANARY),
        ("a2/id", "cred/a"),
    ] {
        let text = std::fs::read_to_string(l.out.join(file)).unwrap_or_default();
        if !text.contains(holds) {
            out.push(format!("c's delivered file {file} holds {text:?}"));
        }
    }
    if !l.out.join("login/id_ed25519-cert.pub").is_file() {
        out.push("c's SSH certificate is not delivered".into());
    }
    // The target file Prometheus reads is whole JSON naming c, never a torn write.
    let targets = std::fs::read(f.host_dir("p").join("targets").join("c.json")).unwrap_or_default();
    if !serde_json::from_slice::<serde_json::Value>(&targets)
        .is_ok_and(|v| v.to_string().contains("fort_need"))
    {
        out.push(format!(
            "p's target file for c is not whole: {:?}",
            String::from_utf8_lossy(&targets)
        ));
    }
    for host in ["p", "c"] {
        let (ok, text) = f.admin(host, &["audit", "verify"]);
        if !ok {
            out.push(format!("{host}'s trail does not verify: {text}"));
        }
        let all: BTreeSet<Vec<u8>> =
            fort_core::audit::read_lines(&f.host_dir(host).join("state").join("audit"))
                .unwrap_or_default()
                .into_iter()
                .map(|l| l.bytes)
                .collect();
        if let Some((_, before)) = signed_before.iter().find(|(h, _)| h == host) {
            // What was signed before stays, unless rotation removed its whole file.
            let lost = before
                .iter()
                .find(|b| !all.contains(*b) && lost_is_not_rotation(f, host, b));
            if let Some(line) = lost {
                out.push(format!(
                    "{host}'s trail lost a signed record: {}",
                    String::from_utf8_lossy(line)
                ));
            }
        }
        // Under a state key, no secret in the clear anywhere in the state directory.
        let keyed = f.hosts[host].extra_toml.contains("state_key_file");
        let state = f.host_dir(host).join("state");
        let spellings = spellings(CANARY);
        for file in files_under(&state) {
            if keyed
                && std::fs::read(&file)
                    .is_ok_and(|b| spellings.iter().any(|s| contains_bytes(&b, s)))
            {
                out.push(format!("a secret in the clear in {}", file.display()));
            }
            let name = file.file_name().unwrap_or_default();
            if let Some(pid) = fort_core::store::temporary_pid(name) {
                if !Path::new(&format!("/proc/{pid}")).exists() {
                    out.push(format!(
                        "a dead writer's temporary file stays: {}",
                        file.display()
                    ));
                }
            }
        }
    }
    out
}

/// A signed record gone from the trail is lost unless the trail now begins after it (its
/// file was rotated away, which the index still covers).
fn lost_is_not_rotation(f: &Fleet, host: &str, line: &[u8]) -> bool {
    let seq = serde_json::from_slice::<Value>(line)
        .ok()
        .and_then(|v| v["seq"].as_u64())
        .unwrap_or(0);
    let dir = f.host_dir(host).join("state").join("audit");
    let first = fort_core::audit::read_lines(&dir)
        .unwrap_or_default()
        .into_iter()
        .find_map(|l| l.record.and_then(|r| r["seq"].as_u64()))
        .unwrap_or(0);
    seq >= first
}

fn snapshot_signed(f: &Fleet) -> Vec<(String, Vec<Vec<u8>>)> {
    ["p", "c"]
        .iter()
        .map(|h| (h.to_string(), signed_lines(f, h)))
        .collect()
}

/// Waits until `point` killed what it was armed in; false when it did not come.
async fn killed_at(l: &mut Lane, target: Target, point: &str) -> bool {
    let marker = format!("crash point {point}: killed");
    let host = host_of(target);
    let deadline = Instant::now() + Duration::from_secs(40);
    while Instant::now() < deadline {
        match target {
            Target::ProviderHandler => {
                if log(&l.f, host).contains(&marker) {
                    return true;
                }
            }
            _ => {
                // Killed before it was ready: its start failed, and its log says where.
                let Some(agent) = l.f.agents.get_mut(host) else {
                    return log(&l.f, host).contains(&marker);
                };
                if let Some(status) = agent.exited() {
                    use std::os::unix::process::ExitStatusExt;
                    return status.signal() == Some(9) && log(&l.f, host).contains(&marker);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

fn arm(l: &mut Lane, host: &str, point: Option<&str>) {
    let env = &mut l.f.host(host).spawn.env;
    env.retain(|(k, _)| k != fort_core::crash::ENV);
    if let Some(p) = point {
        env.push((fort_core::crash::ENV.into(), format!("{p}=return")));
    }
}

fn force_rotation(f: &Fleet) {
    let (ok, out) = f.admin("p", &["trigger", "cred", "--force"]);
    assert!(ok, "{out}");
}

fn rotate_key(l: &Lane, point: Option<&str>, new_key: &Path) -> std::process::Output {
    let mut cmd = Command::new(bin("fort-agent"));
    cmd.args(["state-key", "rotate", "--config"])
        .arg(l.f.config_path("p"))
        .arg("--new-key")
        .arg(new_key);
    if let Some(p) = point {
        cmd.env(fort_core::crash::ENV, format!("{p}=return"));
    }
    cmd.output().unwrap()
}

/// Kills at `point` as its scenario says, starts again, and returns what broke.
async fn crash_at(point: &str) -> Result<(), String> {
    let (target, provoke) = scenario(point);
    let mut l = lane(provoke != Provoke::KeyAdded);
    l.f.write_files();
    let host = host_of(target);
    match provoke {
        Provoke::FirstStart => {
            arm(&mut l, host, Some(point));
            for h in ["p", "c"] {
                // An agent killed at a point of its own start never answers: that is the
                // kill this scenario is after.
                let _ = l.f.try_start_host(h);
            }
        }
        Provoke::Rotation | Provoke::KeyRotation | Provoke::KeyAdded => {
            l.f.start();
            if !eventually(Duration::from_secs(60), || l.f.all_satisfied("c")).await {
                return Err(format!("the fleet did not converge: {}", l.f.status("c")));
            }
        }
    }
    let signed = snapshot_signed(&l.f);
    match provoke {
        Provoke::FirstStart => {}
        Provoke::Rotation => {
            l.f.stop(host);
            arm(&mut l, host, Some(point));
            l.f.start_host(host);
            for _ in 0..40 {
                if l.f.agents.get_mut(host).and_then(|a| a.exited()).is_some() {
                    break;
                }
                let _ = l.f.admin("p", &["trigger", "cred", "--force"]);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        Provoke::KeyAdded => {
            // Plain until now: the provider gets its key, its handler seals in place.
            l.f.stop("p");
            let key = l.keys[0].clone();
            l.f.host("p").extra_toml = format!(
                "state_key_file = \"{}\"\n{}",
                key.display(),
                l.f.hosts["p"].extra_toml
            );
            l.f.write_files();
            arm(&mut l, "p", Some(point));
            l.f.start_host("p");
            let (ok, out) = l.f.admin("p", &["trigger", "ssh-ca"]);
            let _ = (ok, out);
        }
        Provoke::KeyRotation => {
            l.f.stop("p");
            let new = l.f.new_state_key("p-key-2");
            let out = rotate_key(&l, Some(point), &new);
            use std::os::unix::process::ExitStatusExt;
            if out.status.signal() != Some(9)
                || !String::from_utf8_lossy(&out.stderr).contains(point)
            {
                return Err(format!(
                    "state-key rotate was not killed at {point}: {out:?}"
                ));
            }
            // Run again, as the docs say: it must finish; then the agent runs on it.
            let out = rotate_key(&l, None, &new);
            if !out.status.success() {
                return Err(format!("the rotation run again did not finish: {out:?}"));
            }
            l.f.host("p").extra_toml = l.f.hosts["p"]
                .extra_toml
                .replace(&l.keys[0].display().to_string(), &new.display().to_string());
            l.f.write_files();
            l.f.try_start_host("p")
                .map_err(|log| format!("p did not start after the rotation: {log}"))?;
            let v = violations(&l, &signed).await;
            return if v.is_empty() {
                Ok(())
            } else {
                Err(v.join("\n"))
            };
        }
    }
    if target != Target::Rotate && !killed_at(&mut l, target, point).await {
        return Err(format!(
            "{point} was never reached in {host}:\n{}",
            log(&l.f, host)
                .lines()
                .rev()
                .take(15)
                .collect::<Vec<_>>()
                .join("\n")
        ));
    }
    // Start again, unarmed: it must start, and everything must hold.
    arm(&mut l, host, None);
    l.f.kill(host);
    for h in ["p", "c"] {
        if !l.f.agents.contains_key(h) {
            l.f.try_start_host(h)
                .map_err(|log| format!("{h} did not start after the kill at {point}: {log}"))?;
        }
    }
    let v = violations(&l, &signed).await;
    if v.is_empty() {
        Ok(())
    } else {
        Err(v.join("\n"))
    }
}

async fn crash_at_each(filter: impl Fn(&str) -> bool) -> (usize, Vec<String>) {
    let mut tried = 0;
    let mut failures = Vec::new();
    for (point, _) in POINTS.iter().filter(|(p, _)| filter(p)) {
        tried += 1;
        let started = Instant::now();
        let outcome = crash_at(point).await;
        eprintln!(
            "{point}: {} in {:?}",
            if outcome.is_ok() { "held" } else { "BROKE" },
            started.elapsed()
        );
        if let Err(e) = outcome {
            failures.push(format!("{point}: {e}"));
        }
    }
    (tried, failures)
}

fn consumer_side(point: &str) -> bool {
    scenario(point).0 == Target::Consumer
}

fn keys_and_handlers(point: &str) -> bool {
    matches!(scenario(point).0, Target::ProviderHandler | Target::Rotate)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_at_every_provider_crash_point_leaves_nothing_the_next_start_refuses() {
    let (tried, failures) = crash_at_each(|p| !consumer_side(p) && !keys_and_handlers(p)).await;
    fort_tests::figure(&format!(
        "crash lane (provider): killed at {tried} crash points, {} recovered",
        tried - failures.len()
    ));
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_at_every_consumer_crash_point_leaves_nothing_the_next_start_refuses() {
    let (tried, failures) = crash_at_each(consumer_side).await;
    fort_tests::figure(&format!(
        "crash lane (consumer): killed at {tried} crash points, {} recovered",
        tried - failures.len()
    ));
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_at_every_handler_and_key_crash_point_leaves_nothing_the_next_start_refuses() {
    let (tried, failures) = crash_at_each(keys_and_handlers).await;
    fort_tests::figure(&format!(
        "crash lane (handlers, state key): killed at {tried} crash points, {} recovered",
        tried - failures.len()
    ));
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// Kills the provider or the consumer at random instants while every entry is rotated
/// over and over, `FORT_CRASH_KILLS` times (default 30), seeded (`FORT_CRASH_SEED`,
/// printed): each time the agent must start again, and at the end everything must hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_kills_while_rotations_run_lose_nothing() {
    let kills: usize = std::env::var("FORT_CRASH_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);
    let seed: u64 = std::env::var("FORT_CRASH_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(rand_seed);
    let mut rng = SplitMix(seed);
    let mut l = lane(true);
    l.f.start();
    assert!(
        eventually(Duration::from_secs(60), || l.f.all_satisfied("c")).await,
        "{}",
        l.f.status("c")
    );
    let mut failed_starts = Vec::new();
    for i in 0..kills {
        let host = if rng.next().is_multiple_of(2) {
            "p"
        } else {
            "c"
        };
        let delay = Duration::from_millis(rng.next() % 1500);
        let until = Instant::now() + delay;
        while Instant::now() < until {
            force_rotation(&l.f);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        l.f.kill(host);
        if let Err(log) = l.f.try_start_host(host) {
            failed_starts.push(format!("kill {i} of {host} (seed {seed}): {log}"));
            break;
        }
    }
    let v = violations(&l, &[]).await;
    fort_tests::figure(&format!(
        "crash lane (random): {kills} kills at random instants (seed {seed}), {} failed starts, {} violations",
        failed_starts.len(),
        v.len()
    ));
    assert!(failed_starts.is_empty(), "{}", failed_starts.join("\n"));
    assert!(v.is_empty(), "seed {seed}:\n{}", v.join("\n"));
}

fn rand_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64)
}

/// A tiny seeded generator: the same seed, the same kills.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

#[test]
fn every_point_has_a_scenario_and_the_list_is_long() {
    assert!(POINTS.len() >= 20, "{}", POINTS.len());
    for (point, _) in POINTS {
        let _ = scenario(point);
    }
    let _: Value = json!(null);
}
