//! The compatibility lane: the release before the tree (RELEASES' last line, built by
//! scripts/previous-release.sh) and the tree's agents in one fleet, on one state:
//! a provider of each serving a consumer of the other, an upgrade in place and a
//! rollback in place over the same state directory, and `fort fleet` over both. Then
//! what a next release would write (members this release does not know, a newer format
//! version) against the tree, and a deliberately incompatible state against the
//! previous release, which the lane must catch. Without the previous release built, its
//! parts say SKIP with the reason.

use std::path::{Path, PathBuf};
use std::time::Duration;

use fort_tests::releases::{self, Release};
use fort_tests::{eventually, skip, Fleet};
use serde_json::{json, Value};

/// The previous release, or SKIP (with the reason) for `test`.
fn previous(test: &str) -> Option<Release> {
    match releases::previous() {
        Ok(r) => Some(r),
        Err(why) => {
            skip(test, &why);
            None
        }
    }
}

/// A provider handler any release runs: every entry gets `{"for": key}`; every run is
/// counted in `<dir>/runs-<cap>`.
fn provider(f: &mut Fleet, host: &str, cap: &str) {
    let d = f.dir.path().display().to_string();
    let h = f.script(
        &format!("provide-{cap}"),
        &format!(r#"echo run >> {d}/runs-{cap}; jq -c 'with_entries(.value = {{"for": .key}})'"#),
    );
    f.capability(host, cap, json!({"handler": h, "mode": "async"}));
    f.host(host).extra_toml =
        "[callbacks]\nbackoff = \"200ms\"\n[fulfill]\nbackoff = \"200ms\"\n".into();
}

/// A need whose payload lands as a file under the fleet dir.
fn need(f: &mut Fleet, consumer: &str, key: &str, provider: &str) -> PathBuf {
    let path = f
        .dir
        .path()
        .join("delivered")
        .join(format!("{consumer}-{}", key.replace('/', "_")));
    let id = |flag: &str| {
        let out = std::process::Command::new("id")
            .arg(flag)
            .output()
            .expect("id");
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    f.need(
        consumer,
        key,
        provider,
        json!({"files": [{"path": path, "pointer": "", "mode": "0600",
                          "owner": id("-un"), "group": id("-gn")}]}),
    );
    if f.host(consumer).extra_toml.is_empty() {
        f.host(consumer).extra_toml = "[fulfill]\nbackoff = \"200ms\"\n".into();
    }
    path
}

fn runs(f: &Fleet, cap: &str) -> usize {
    std::fs::read_to_string(f.dir.path().join(format!("runs-{cap}")))
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

fn runs_with(f: &mut Fleet, host: &str, binary: Option<&Path>, args: &[&str]) {
    let spawn = &mut f.host(host).spawn;
    spawn.binary = binary.map(Path::to_path_buf);
    spawn.args = args.iter().map(|a| a.to_string()).collect();
}

async fn satisfied(f: &Fleet, host: &str, need: &str) -> bool {
    eventually(Duration::from_secs(20), || {
        f.need_status(host, need)["satisfied"] == true
    })
    .await
}

fn stop(f: &mut Fleet, host: &str) {
    if let Some(mut a) = f.agents.remove(host) {
        a.kill9();
    }
}

fn modified(p: &Path) -> std::time::SystemTime {
    std::fs::metadata(p)
        .and_then(|m| m.modified())
        .expect("delivered file")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_release_serves_the_other_and_fort_fleet_shows_both() {
    let Some(old) = previous("each_release_serves_the_other_and_fort_fleet_shows_both") else {
        return;
    };
    let mut f = Fleet::new();
    provider(&mut f, "p-old", "cred");
    provider(&mut f, "p-new", "token");
    let a = need(&mut f, "c-new", "cred/a", "p-old");
    let b = need(&mut f, "c-old", "token/b", "p-new");
    f.principal("ops");
    runs_with(&mut f, "p-old", Some(&old.agent()), &[]);
    runs_with(&mut f, "c-old", Some(&old.agent()), &[]);
    f.start();
    assert!(
        satisfied(&f, "c-new", "cred/a").await,
        "an old provider serves a new consumer"
    );
    assert!(
        satisfied(&f, "c-old", "token/b").await,
        "a new provider serves an old consumer"
    );
    assert_eq!(
        serde_json::from_slice::<Value>(&std::fs::read(&a).unwrap()).unwrap(),
        json!({"for": "c-new:cred/a"})
    );
    assert!(b.exists());

    // The operator's view of a fleet mid-upgrade: two releases, no warning.
    let (code, out, err) = f.fort("ops", "p-new", &["fleet"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("RELEASE") && out.contains("PROTOCOL"), "{out}");
    let new = fort_core::compat::RELEASE;
    let release_of = |host: &str| {
        out.lines()
            .find(|l| l.starts_with(host))
            .unwrap_or_default()
            .to_owned()
    };
    assert!(
        release_of("c-new").contains(&format!("{new}  ")) || release_of("c-new").contains(new),
        "{out}"
    );
    assert!(release_of("c-new").contains("1.2"), "{out}");
    assert!(
        release_of("p-old").contains(&old.version) && release_of("p-old").contains(&old.protocol),
        "{out}"
    );
    assert!(out.contains("RELEASES IN USE"), "{out}");
    assert!(
        out.contains(&format!("fort {}: c-old, p-old", old.version)),
        "{out}"
    );
    assert!(out.contains(&format!("fort {new}: c-new, p-new")), "{out}");
    assert!(!out.contains("WARNING"), "{out}");
    let (_, json_out, _) = f.fort("ops", "p-new", &["fleet", "--json"]);
    let v: Value = serde_json::from_str(&json_out).unwrap();
    assert_eq!(
        v["releases"][new],
        json!(["c-new", "p-new"]),
        "{}",
        v["releases"]
    );
    assert_eq!(v["releases_warning"], Value::Null);
    // `fort status` of one host says its release and protocol.
    let (_, status, _) = f.fort("ops", "p-new", &["status", "c-new"]);
    assert!(
        status.contains(&format!("release {new}  protocol 1.2")),
        "{status}"
    );
}

/// The heart of the lane: one host's state carried from the previous release to the tree
/// and back, with nothing asked again, no handler run and no delivered file rewritten.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrade_and_rollback_in_place_keep_every_need() {
    let Some(old) = previous("upgrade_and_rollback_in_place_keep_every_need") else {
        return;
    };
    let mut f = Fleet::new();
    provider(&mut f, "p", "cred");
    let file = need(&mut f, "c", "cred/x", "p");
    for h in ["p", "c"] {
        runs_with(&mut f, h, Some(&old.agent()), &[]);
    }
    f.start();
    assert!(satisfied(&f, "c", "cred/x").await);
    let (handler_runs, delivered) = (runs(&f, "cred"), modified(&file));

    for (step, binary) in [("upgrade", None), ("rollback", Some(old.agent()))] {
        for h in ["p", "c"] {
            stop(&mut f, h);
            runs_with(&mut f, h, binary.as_deref(), &[]);
            if let Err(log) = f.try_start_host(h) {
                panic!("{step}: {h}'s agent refuses the state the other release wrote:\n{log}");
            }
        }
        assert!(satisfied(&f, "c", "cred/x").await, "{step}");
        assert_eq!(f.entries("p"), ["c:cred/x"], "{step}");
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(runs(&f, "cred"), handler_runs, "{step}: no handler run");
        assert_eq!(
            modified(&file),
            delivered,
            "{step}: the delivered file is untouched"
        );
    }
}

/// Writes `state` as `host`'s `file` snapshot (its logs removed): what another release
/// left behind.
fn put_state(f: &Fleet, host: &str, file: &str, state: &Value) {
    let dir = f.host_dir(host).join("state");
    let stem = file.trim_end_matches(".json");
    for e in std::fs::read_dir(&dir).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(&format!("{stem}.log.")) {
            std::fs::remove_file(e.path()).unwrap();
        }
    }
    std::fs::write(dir.join(file), serde_json::to_vec(state).unwrap()).unwrap();
}

fn snapshot(f: &Fleet, host: &str, file: &str) -> Value {
    serde_json::from_slice(&std::fs::read(f.host_dir(host).join("state").join(file)).unwrap())
        .unwrap()
}

/// A fleet of the tree's agents, run until `c`'s need is satisfied, then stopped.
async fn settled_tree_fleet() -> (Fleet, PathBuf) {
    let mut f = Fleet::new();
    provider(&mut f, "p", "cred");
    let file = need(&mut f, "c", "cred/x", "p");
    need(&mut f, "c", "cred/y", "p");
    f.start();
    assert!(satisfied(&f, "c", "cred/x").await);
    assert!(satisfied(&f, "c", "cred/y").await);
    stop(&mut f, "c");
    stop(&mut f, "p");
    (f, file)
}

/// What a next release would write: today's state with members this release does not
/// know, in the records, inside them and around them.
fn as_next_release_writes(f: &Fleet) {
    let mut needs = f.read_state("c", "fulfillment-state.json");
    needs["version"] = json!(2);
    needs["written_by"] = json!("fort 9.0.0");
    needs["next_member"] = json!({"kept": true});
    needs["needs"]["cred/x"]["next_field"] = json!({"a": [1, 2]});
    put_state(f, "c", "fulfillment-state.json", &needs);
    let mut entries = f.read_state("p", "provider-state.json");
    entries["version"] = json!(2);
    entries["entries"]["c:cred/x"]["next_field"] = json!("e");
    entries["entries"]["c:cred/x"]["delivery"]["next_nested"] = json!(7);
    put_state(f, "p", "provider-state.json", &entries);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_next_releases_members_are_read_used_and_written_back() {
    let (mut f, file) = settled_tree_fleet().await;
    as_next_release_writes(&f);
    f.start_host("p");
    f.start_host("c");
    // Used: the need stands as the state says; then a new response for it rewrites both
    // records, the consumer's and the provider's.
    assert!(satisfied(&f, "c", "cred/x").await);
    let before = std::fs::read(&file).unwrap();
    std::fs::write(f.dir.path().join("scripts/provide-cred"), "#!/bin/sh\necho run >> /dev/null; jq -c 'with_entries(.value = {\"for\": .key, \"v\": 2})'\n").unwrap();
    let (ok, out) = f.admin("p", &["trigger", "cred", "--entry", "c:cred/x", "--force"]);
    assert!(ok, "{out}");
    assert!(
        eventually(Duration::from_secs(20), || std::fs::read(&file).unwrap()
            != before)
        .await,
        "the new response is delivered"
    );
    assert!(satisfied(&f, "c", "cred/x").await);
    tokio::time::sleep(Duration::from_secs(1)).await;
    // Written back with every member intact, in the logs and in the next snapshot.
    for round in ["logged", "folded at the next start"] {
        let needs = f.read_state("c", "fulfillment-state.json");
        assert_eq!(
            needs["needs"]["cred/x"]["next_field"],
            json!({"a": [1, 2]}),
            "{round}"
        );
        let entries = f.read_state("p", "provider-state.json");
        assert_eq!(entries["entries"]["c:cred/x"]["next_field"], "e", "{round}");
        assert_eq!(
            entries["entries"]["c:cred/x"]["delivery"]["next_nested"], 7,
            "{round}"
        );
        assert!(entries["entries"]["c:cred/x"]["delivery"]["delivered_at"].is_u64());
        stop(&mut f, "c");
        stop(&mut f, "p");
        f.start_host("p");
        f.start_host("c");
    }
    let snap = snapshot(&f, "c", "fulfillment-state.json");
    assert_eq!(snap["next_member"], json!({"kept": true}));
    assert_eq!(
        snap["written_by"],
        format!("fort {}", fort_core::compat::RELEASE)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_format_is_refused_by_name_and_recover_keeps_what_it_reads() {
    let (mut f, _) = settled_tree_fleet().await;
    // A next release's incompatible change: a need state this release has no name for.
    let mut needs = f.read_state("c", "fulfillment-state.json");
    needs["version"] = json!(2);
    needs["written_by"] = json!("fort 9.0.0");
    needs["needs"]["cred/y"]["phase"] = json!("quarantined");
    put_state(&f, "c", "fulfillment-state.json", &needs);
    let log = f.try_start_host("c").expect_err("the agent must refuse");
    let config = f.config_path("c");
    for part in [
        "fulfillment-state.json: needs.cred/y.phase: unknown variant `quarantined`",
        "written by fort 9.0.0",
        &format!("this release (fort {})", fort_core::compat::RELEASE),
        "nothing was changed",
        &format!("fort-agent serve --recover --config {}", config.display()),
        &format!(
            "fort-agent set-aside --config {} fulfillment-state.json",
            config.display()
        ),
    ] {
        assert!(log.contains(part), "{part:?} not in:\n{log}");
    }
    assert_eq!(
        snapshot(&f, "c", "fulfillment-state.json"),
        needs,
        "nothing changed"
    );

    // A format version above the ones it reads: refused by name too.
    let mut newer = needs.clone();
    newer["version"] = json!(4);
    put_state(&f, "c", "fulfillment-state.json", &newer);
    let log = f.try_start_host("c").expect_err("the agent must refuse");
    assert!(log.contains("fulfillment-state.json: version: format version 4; this release reads versions [1, 2, 3]; written by fort 9.0.0"), "{log}");

    // --recover: the files go aside, every record this release reads is kept.
    put_state(&f, "c", "fulfillment-state.json", &needs);
    runs_with(&mut f, "c", None, &["--recover"]);
    f.start_host("p");
    f.start_host("c");
    let kept = f.read_state("c", "fulfillment-state.json");
    // cred/x as it was; cred/y, which it could not read, starts over (it is declared).
    assert_eq!(kept["needs"]["cred/x"], needs["needs"]["cred/x"], "{kept}");
    assert_ne!(kept["needs"]["cred/y"]["phase"], "quarantined", "{kept}");
    let aside: Vec<PathBuf> = fort_tests::files_under(&f.host_dir("c").join("state/set-aside"));
    assert!(
        aside.iter().any(|p| p.ends_with("fulfillment-state.json")
            && std::fs::read(p).unwrap() == serde_json::to_vec(&needs).unwrap()),
        "the refused file is kept aside as it was: {aside:?}"
    );
    let log = std::fs::read_to_string(f.host_dir("c").join("agent.log")).unwrap();
    assert!(
        log.contains("recovered") && log.contains("needs.cred/y.phase"),
        "{log}"
    );
    // The need it could not keep is asked for again, and satisfied.
    assert!(satisfied(&f, "c", "cred/y").await);
    assert!(satisfied(&f, "c", "cred/x").await);

    // set-aside: refused while the agent runs; then moves the file.
    let (ok, _) = f.admin("c", &["set-aside", "fulfillment-state.json"]);
    assert!(!ok, "set-aside under a running agent");
    stop(&mut f, "c");
    let (ok, out) = f.admin("c", &["set-aside", "fulfillment-state.json"]);
    assert!(ok && out.contains("moved to"), "{out}");
    assert!(!f
        .host_dir("c")
        .join("state/fulfillment-state.json")
        .exists());
}

/// The check the rollback above makes, on its own: does the previous release start on
/// `host`'s state, unchanged? `Err` carries its refusal.
fn previous_release_starts(f: &mut Fleet, host: &str, old: &Release) -> Result<(), String> {
    runs_with(f, host, Some(&old.agent()), &[]);
    let started = f.try_start_host(host);
    stop(f, host);
    runs_with(f, host, None, &[]);
    started
}

/// The lane must fail on a change the previous release cannot read: a need in a state
/// the previous release has no name for, as a release would write it if it wrote a new
/// state unconditionally (the rule is: not until the fleet has moved). Members it does
/// not know it keeps; a value it cannot name it refuses, by file and field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lane_catches_a_state_the_previous_release_cannot_read() {
    let Some(old) = previous("the_lane_catches_a_state_the_previous_release_cannot_read") else {
        return;
    };
    let (mut f, _) = settled_tree_fleet().await;
    previous_release_starts(&mut f, "c", &old).expect("the tree's own state rolls back");
    let mut needs = f.read_state("c", "fulfillment-state.json");
    needs["version"] = json!(2);
    needs["needs"]["cred/x"]["phase"] = json!("incompatible_probe");
    put_state(&f, "c", "fulfillment-state.json", &needs);
    let refused = previous_release_starts(&mut f, "c", &old)
        .expect_err("the previous release must refuse a state it has no name for");
    assert!(
        refused.contains("fulfillment-state.json") && refused.contains("incompatible_probe"),
        "{refused}"
    );
}

/// Sealed provider state (snapshot version 3, written only with a state key,
/// docs/at-rest.md) is a format the previous release cannot read: it refuses it by name
/// and changes nothing, and the tree with its key goes on with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_previous_release_refuses_sealed_provider_state_by_name_and_loses_nothing() {
    let test = "the_previous_release_refuses_sealed_provider_state_by_name_and_loses_nothing";
    let Some(old) = previous(test) else {
        return;
    };
    let (mut f, _) = settled_tree_fleet().await;
    let key = f.dir.path().join("state-key");
    let made = std::process::Command::new(fort_tests::bin("fort-agent"))
        .args(["state-key", "new"])
        .arg(&key)
        .output()
        .unwrap();
    assert!(made.status.success(), "{made:?}");
    let without_key = f.host("p").extra_toml.clone();
    let with_key = format!("state_key_file = \"{}\"\n{without_key}", key.display());
    f.host("p").extra_toml = with_key.clone();
    f.write_files();
    f.start_host("p");
    stop(&mut f, "p");
    assert_eq!(snapshot(&f, "p", "provider-state.json")["version"], 3);
    let state_dir = f.host_dir("p").join("state");
    let files = || -> Vec<(PathBuf, Vec<u8>)> {
        fort_tests::files_under(&state_dir)
            .into_iter()
            .filter(|p| p.to_string_lossy().contains("provider-state"))
            .map(|p| (p.clone(), std::fs::read(&p).unwrap()))
            .collect()
    };
    let before = files();
    // A rollback brings back the previous generation's agent.toml, which has no key.
    f.host("p").extra_toml = without_key;
    f.write_files();
    let refused = previous_release_starts(&mut f, "p", &old)
        .expect_err("the previous release must refuse sealed provider state");
    for part in [
        "provider-state.json: version: format version 3; this release reads versions [1, 2]",
        &format!("written by fort {}", fort_core::compat::RELEASE),
    ] {
        assert!(refused.contains(part), "{part:?} not in:\n{refused}");
    }
    assert_eq!(files(), before, "nothing changed");
    f.host("p").extra_toml = with_key;
    f.write_files();
    f.start_host("p");
    f.start_host("c");
    assert!(satisfied(&f, "c", "cred/x").await);
    assert_eq!(f.entries("p"), ["c:cred/x", "c:cred/y"]);
}

/// More than one release back is outside what may be mixed: the first build of 0.1.0 (3829ed3)
/// refuses the need state of 3833b22 and later (`seq` and more), naming file and field,
/// and does not start. The ways on the README gives work: the tree's `set-aside` moves the
/// file so that it starts and asks again, and rolling forward finds everything kept.
/// Runs where that release was built (`scripts/previous-release.sh 3829ed3…`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_two_releases_back_is_refused_by_name_and_set_aside_gets_past_it() {
    let test = "a_rollback_two_releases_back_is_refused_by_name_and_set_aside_gets_past_it";
    let two_back = match releases::made_from("3829ed3") {
        Ok(r) => r,
        Err(why) => return skip(test, &why),
    };
    let (mut f, file) = settled_tree_fleet().await;
    f.start_host("p");
    // A start folds the log into the snapshot, where 3829ed3 reads the records and
    // refuses them. (Records still in a log it takes for a torn tail instead, drops with
    // a warning, and asks for those needs again: it cannot tell them from damage.)
    f.start_host("c");
    stop(&mut f, "c");
    let before = f.read_state("c", "fulfillment-state.json");
    let refused = previous_release_starts(&mut f, "c", &two_back)
        .expect_err("3829ed3 does not read the need state of later releases");
    // It names the file and the first field it does not know (`seq`, or one a later
    // release added before it in the record, as `home_confirmed`).
    assert!(
        refused.contains("fulfillment-state.json") && refused.contains("unknown field `"),
        "{refused}"
    );
    assert_eq!(
        f.read_state("c", "fulfillment-state.json"),
        before,
        "nothing changed"
    );
    // Rolling forward again: everything is there.
    f.start_host("c");
    assert!(satisfied(&f, "c", "cred/x").await);
    stop(&mut f, "c");
    // Or set it aside (with the newer binary, still on the host) and run the old one.
    let (ok, out) = f.admin("c", &["set-aside", "fulfillment-state.json"]);
    assert!(ok, "{out}");
    runs_with(&mut f, "c", Some(&two_back.agent()), &[]);
    f.start_host("c");
    assert!(
        satisfied(&f, "c", "cred/x").await,
        "asked again from scratch"
    );
    assert!(file.exists());
}

/// One `fort-handler CAP --config CONFIG` run of `binary`, as the agent runs it.
fn handler_run(binary: &Path, cap: &str, config: &Path, input: &Value) -> (bool, Value, String) {
    use std::io::Write;
    let mut child = std::process::Command::new(binary)
        .args([cap, "--config"])
        .arg(config)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("FORT_CAPABILITY", cap)
        .env("FORT_TRIGGER", "request")
        .env("FORT_HOST", "forge")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("fort-handler");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        serde_json::from_slice(&out.stdout).unwrap_or(Value::Null),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A handler's state across releases, with the handler that needs no server (ssh-ca):
/// the state the previous release's handler wrote is read by the tree's, which keeps
/// every certificate it holds, and the tree's state by the previous one, whose serials
/// go on from it (a rollback that reused a serial would revoke the wrong certificate).
/// A `{"kind": "ca"}` entry leaves nothing in the state, and the previous release
/// refuses it alone.
#[test]
fn ssh_ca_state_upgrades_and_rolls_back() {
    let Some(old) = previous("ssh_ca_state_upgrades_and_rolls_back") else {
        return;
    };
    if !old.handler().exists() {
        return skip(
            "ssh_ca_state_upgrades_and_rolls_back",
            &format!("fort {} ({}) has no fort-handler", old.version, old.commit),
        );
    }
    use ssh_key::rand_core::OsRng;
    let dir = tempfile::tempdir().unwrap();
    let path = |n: &str| dir.path().join(n);
    let key = || ssh_key::PrivateKey::random(&mut OsRng, ssh_key::Algorithm::Ed25519).unwrap();
    let public = |k: &ssh_key::PrivateKey| k.public_key().to_openssh().unwrap();
    let host_key = public(&key());
    std::fs::write(
        path("hosts.json"),
        json!({"hosts": {"app": {"address": "https://127.0.0.2:7770", "keys": [host_key]},
                         "web": {"address": "https://127.0.0.3:7770", "keys": [host_key]}},
               "principals": {}})
        .to_string(),
    )
    .unwrap();
    std::fs::write(
        path("ca"),
        key()
            .to_openssh(ssh_key::LineEnding::LF)
            .unwrap()
            .as_bytes(),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path("ca"), std::fs::Permissions::from_mode(0o400)).unwrap();
    std::fs::write(
        path("config.json"),
        json!({"ca_key_file": path("ca"), "state_file": path("state/ssh-ca.json"),
               "hosts_file": path("hosts.json"), "host_principals": {"*": ["{origin}"]}})
        .to_string(),
    )
    .unwrap();
    let new = fort_tests::bin("fort-handler");
    let entry = |k: &ssh_key::PrivateKey| json!({"request": {"kind": "host", "public_key": public(k)}, "response": null});
    let (a, b, c) = (key(), key(), key());
    let state = || -> Value {
        serde_json::from_slice(&std::fs::read(path("state/ssh-ca.json")).unwrap()).unwrap()
    };
    let serial = |out: &Value, k: &str| out[k]["serial"].as_u64().unwrap();

    let mut input = json!({"app:ssh-ca/a": entry(&a)});
    let (ok, first, err) = handler_run(&old.handler(), "ssh-ca", &path("config.json"), &input);
    assert!(ok, "the previous release's handler: {err}");
    let written_by_old = state();
    // Upgrade: the tree's handler holds the certificate the old one issued.
    input["app:ssh-ca/a"]["response"] = first["app:ssh-ca/a"].clone();
    input["web:ssh-ca/b"] = entry(&b);
    // What a consumer of several providers asks each for: nothing certified, nothing
    // in the state.
    input["web:ssh-ca/host-ca-forge"] = json!({"request": {"kind": "ca"}, "response": null});
    let (ok, second, err) = handler_run(&new, "ssh-ca", &path("config.json"), &input);
    assert!(
        ok,
        "the tree's handler on the previous release's state: {err}"
    );
    assert!(
        second["app:ssh-ca/a"] == first["app:ssh-ca/a"]
            || second["app:ssh-ca/a"]["$fort_keep"].is_string()
            || second["app:ssh-ca/a"].is_null(),
        "kept, not issued again: {second}"
    );
    assert_eq!(
        state()["state"]["entries"]["app:ssh-ca/a"],
        written_by_old["state"]["entries"]["app:ssh-ca/a"]
    );
    assert_eq!(second["web:ssh-ca/host-ca-forge"]["kind"], "ca", "{second}");
    assert!(state()["state"]["entries"]
        .get("web:ssh-ca/host-ca-forge")
        .is_none());
    let b_serial = serial(&second, "web:ssh-ca/b");
    // Rollback: the previous release's handler reads the tree's state and goes on.
    input["web:ssh-ca/b"]["response"] = second["web:ssh-ca/b"].clone();
    input["web:ssh-ca/c"] = entry(&c);
    let (ok, third, err) = handler_run(&old.handler(), "ssh-ca", &path("config.json"), &input);
    assert!(
        ok,
        "the previous release's handler on the tree's state: {err}"
    );
    assert!(serial(&third, "web:ssh-ca/c") > b_serial, "{third}");
    // The previous release does not know the `ca` kind: it refuses that entry alone.
    assert!(
        third["web:ssh-ca/host-ca-forge"]["$fort_refused"].is_string(),
        "{third}"
    );
    assert_eq!(state()["version"], 1);
}

/// Protocol 1.2 (docs/protocol.md §11.12): every reply says what the agent speaks; a peer
/// of a later minor is served as usual, one of a later major is told why it is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_announce_their_protocol_and_a_later_major_is_refused_by_name() {
    let mut f = Fleet::new();
    f.host("a");
    f.principal("ops");
    f.start();
    let h = &f.hosts["a"];
    let body = b"{}";
    let now = fort_core::wire::unix_now();
    let signer = f.principals["ops"].clone();
    let mut headers = fort_tests::signed_headers(&signer, "ops", "a", "/agent/needs", body, now);
    headers.push(("X-Fort-Protocol".into(), "1.9".into()));
    let (status, head, _) =
        fort_tests::raw_http(h, &fort_tests::raw_post("/agent/needs", &headers, body));
    assert_eq!(status, 200, "{head}");
    let head = head.to_ascii_lowercase();
    assert!(head.contains("x-fort-protocol: 1.2"), "{head}");
    assert!(
        head.contains(&format!("x-fort-release: {}", fort_core::compat::RELEASE)),
        "{head}"
    );

    let mut headers = fort_tests::signed_headers(&signer, "ops", "a", "/agent/needs", body, now);
    headers.push(("X-Fort-Protocol".into(), "2.0".into()));
    let (status, head, reply) =
        fort_tests::raw_http(h, &fort_tests::raw_post("/agent/needs", &headers, body));
    assert_eq!(status, 400, "{head}");
    let reply: Value = serde_json::from_slice(&reply).unwrap();
    assert_eq!(reply["error"], "unsupported_protocol");
    assert!(
        reply["message"]
            .as_str()
            .unwrap()
            .contains("speaks fort protocol 1.2")
            && reply["message"]
                .as_str()
                .unwrap()
                .contains("announced protocol 2.x"),
        "{reply}"
    );
    // A value that breaks the grammar is from a 1.1 peer: served.
    let mut headers = fort_tests::signed_headers(&signer, "ops", "a", "/agent/needs", body, now);
    headers.push(("X-Fort-Protocol".into(), "2.0-beta".into()));
    let (status, head, _) =
        fort_tests::raw_http(h, &fort_tests::raw_post("/agent/needs", &headers, body));
    assert_eq!(status, 200, "{head}");
}
