//! The state key (docs/at-rest.md) with a real agent running the real `fort-handler
//! ssh-ca` as a capability: without a key the agent keeps plaintext and says so; given a
//! key, the handler's plain CA key from before is sealed in place; another key, no key
//! and a changed file stop the start with the file and the way on; `fort-agent state-key
//! rotate` moves everything to a new key, and running it again finishes nothing twice.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use fort_tests::{eventually, Fleet};
use serde_json::json;

/// `forge` serves ssh-ca through `fort-handler`, run at every start (`initialize`); the
/// CA key the handler makes and its state live under the agent's state directory.
fn forge() -> (Fleet, PathBuf) {
    let mut f = Fleet::new();
    f.host("forge");
    let d = f.host_dir("forge");
    let handlers = d.join("state/handlers/ssh-ca");
    let ca_key = handlers.join("ca");
    let config = d.join("ssh-ca.json");
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(
        &config,
        json!({"ca_key_file": ca_key, "generate_ca_key": true,
               "state_file": handlers.join("state.json"),
               "hosts_file": d.join("hosts.json"),
               "host_principals": {"*": ["{origin}"]}})
        .to_string(),
    )
    .unwrap();
    f.capability(
        "forge",
        "ssh-ca",
        json!({"handler": fort_tests::bin("fort-handler"),
               "args": ["ssh-ca", "--config", config], "mode": "async",
               "triggers": {"initialize": true}}),
    );
    (f, ca_key)
}

fn use_key(f: &mut Fleet, key: Option<&Path>) {
    f.host("forge").extra_toml = match key {
        Some(k) => format!("state_key_file = \"{}\"\n", k.display()),
        None => String::new(),
    };
    f.write_files();
}

fn sealed(path: &Path) -> bool {
    std::fs::read(path).is_ok_and(|b| {
        fort_core::sealed::is_sealed(&b) && !fort_tests::contains_bytes(&b, b"PRIVATE KEY")
    })
}

fn log(f: &Fleet) -> String {
    std::fs::read_to_string(f.host_dir("forge").join("agent.log")).unwrap_or_default()
}

fn refused(f: &mut Fleet) -> String {
    match f.try_start_host("forge") {
        Ok(()) => panic!("the agent started:\n{}", log(f)),
        Err(log) => log,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plaintext_is_sealed_in_place_and_a_wrong_key_is_refused_at_start() {
    let (mut f, ca_key) = forge();
    // The release before, or no key: plaintext, and the log says why.
    f.start();
    assert!(
        eventually(Duration::from_secs(60), || ca_key.exists()).await,
        "the handler made no CA key:\n{}",
        log(&f)
    );
    assert!(!sealed(&ca_key));
    assert!(
        log(&f).contains("state is kept in plaintext"),
        "{}",
        log(&f)
    );
    f.kill("forge");

    // With a key: the handler's plain key is sealed in place at its next run.
    let k1 = f.new_state_key("k1");
    use_key(&mut f, Some(&k1));
    f.start_host("forge");
    assert!(
        eventually(Duration::from_secs(60), || sealed(&ca_key)).await,
        "the CA key was not sealed:\n{}",
        log(&f)
    );
    f.kill("forge");

    // Another key: the start stops, naming the file and the way on; nothing changes.
    let before = std::fs::read(&ca_key).unwrap();
    let k2 = f.new_state_key("k2");
    use_key(&mut f, Some(&k2));
    let why = refused(&mut f);
    assert!(why.contains(&ca_key.display().to_string()), "{why}");
    assert!(why.contains("not with this one"), "{why}");
    assert!(why.contains("move the file aside"), "{why}");
    // No key at all: refused too, never read as plaintext.
    use_key(&mut f, None);
    let why = refused(&mut f);
    assert!(why.contains("this process has no state key"), "{why}");
    // A key file that is not one.
    let bad = f.dir.path().join("bad");
    std::fs::write(&bad, "not a key").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&bad, std::fs::Permissions::from_mode(0o600)).unwrap();
    use_key(&mut f, Some(&bad));
    let why = refused(&mut f);
    assert!(why.contains("must be 32 bytes"), "{why}");
    assert_eq!(std::fs::read(&ca_key).unwrap(), before);

    // Rotation to k2, with the agent stopped; the agent then starts and runs on k2.
    let rotate = |old: &Path, new: &Path| {
        Command::new(fort_tests::bin("fort-agent"))
            .args(["state-key", "rotate", "--config"])
            .arg(f.config_path("forge"))
            .arg("--old-key")
            .arg(old)
            .arg("--new-key")
            .arg(new)
            .output()
            .unwrap()
    };
    // The CA key and whatever state the handler keeps beside it, the provider's cached
    // responses and the consumer's kept payloads (sealed inside provider-state.json and
    // fulfillment-state.json, which are otherwise plain).
    let files = fort_core::sealed::sealed_files(&f.host_dir("forge").join("state")).unwrap();
    assert!(files.contains(&ca_key), "{files:?}");
    let sealed_count = files.len() + 2;
    let out = rotate(&k1, &k2);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(
        text.contains(&format!("sealed {sealed_count} file(s)")),
        "{text}"
    );
    // Again: nothing left to do, and nothing done twice.
    let out = rotate(&k1, &k2);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("sealed 0 file(s) with the state key")
            && text.contains(&format!("({sealed_count} already were)")),
        "{text}"
    );
    use_key(&mut f, Some(&k2));
    f.start_host("forge");
    assert!(sealed(&ca_key));
    f.kill("forge");

    // One changed character: authentication fails, the start stops.
    let text = String::from_utf8(std::fs::read(&ca_key).unwrap()).unwrap();
    let at = text.find("\"data\":\"").unwrap() + 8;
    let flipped = if &text[at..at + 1] == "A" { "B" } else { "A" };
    std::fs::write(
        &ca_key,
        format!("{}{flipped}{}", &text[..at], &text[at + 1..]),
    )
    .unwrap();
    let why = refused(&mut f);
    assert!(
        why.contains("authentication of the sealed contents failed"),
        "{why}"
    );
}

/// `forge` as docs/without-nixos.md sets it up: the SSH CA key and the handler's state in
/// a directory of their own, outside the agent's state directory.
fn forge_outside() -> (Fleet, PathBuf, PathBuf) {
    let mut f = Fleet::new();
    f.host("forge");
    let d = f.host_dir("forge");
    let ca = d.join("ca");
    let config = d.join("ssh-ca.json");
    std::fs::create_dir_all(&ca).unwrap();
    std::fs::write(
        &config,
        json!({"ca_key_file": ca.join("ssh_ca_key"), "generate_ca_key": true,
               "state_file": ca.join("state/ssh-ca.json"),
               "hosts_file": d.join("hosts.json"),
               "host_principals": {"*": ["{origin}"]}})
        .to_string(),
    )
    .unwrap();
    f.capability(
        "forge",
        "ssh-ca",
        json!({"handler": fort_tests::bin("fort-handler"),
               "args": ["ssh-ca", "--config", config], "mode": "async",
               "triggers": {"initialize": true}}),
    );
    (f, ca.join("ssh_ca_key"), ca.join("state/ssh-ca.json"))
}

fn key_id(path: &Path) -> Option<String> {
    fort_core::sealed::key_id_of(&std::fs::read(path).ok()?)
}

/// A temporary file beside `path` (what an atomic write killed before its rename leaves).
fn temporaries_beside(path: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(path.parent().unwrap())
        .unwrap()
        .flatten()
        .filter(|e| fort_core::store::temporary_pid(&e.file_name()).is_some())
        .map(|e| e.path())
        .collect()
}

/// Rotation finds the CA key and the handler's state kept outside the state directory
/// (the handlers note every file they seal); a rotation killed at its crash point, after
/// a file's sealed copy is written and before its rename, is finished by running it
/// again; and a handler killed while it saves its state leaves nothing the next start of
/// the agent refuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_rotation_finishes_and_finds_files_outside_the_state_directory() {
    let (mut f, ca_key, state) = forge_outside();
    let k1 = f.new_state_key("k1");
    use_key(&mut f, Some(&k1));
    f.start();
    let id1 = fort_core::sealed::StateKey::load(&k1)
        .unwrap()
        .id()
        .to_owned();
    assert!(
        eventually(Duration::from_secs(60), || {
            key_id(&ca_key).as_deref() == Some(&id1) && key_id(&state).as_deref() == Some(&id1)
        })
        .await,
        "the CA key and state were not sealed:\n{}",
        log(&f)
    );
    f.kill("forge");

    let k2 = f.new_state_key("k2");
    let id2 = fort_core::sealed::StateKey::load(&k2)
        .unwrap()
        .id()
        .to_owned();
    let rotate = |crash_at: Option<&str>| {
        let mut cmd = Command::new(fort_tests::bin("fort-agent"));
        cmd.args(["state-key", "rotate", "--config"])
            .arg(f.config_path("forge"))
            .arg("--old-key")
            .arg(&k1)
            .arg("--new-key")
            .arg(&k2);
        if let Some(point) = crash_at {
            cmd.env("FAILPOINTS", format!("{point}=return"));
        }
        cmd.output().unwrap()
    };
    // Killed at provider-state.json's rename, then (run again) at the CA key's: each
    // time a sealed temporary file is left beside the file.
    use std::os::unix::process::ExitStatusExt;
    let mut left = Vec::new();
    for point in ["state-key.rotate.snapshot", "state-key.rotate.temp"] {
        let out = rotate(Some(point));
        assert_eq!(out.status.signal(), Some(9), "{point}: {out:?}");
        left.extend(temporaries_beside(&ca_key));
        left.extend(temporaries_beside(&f.host_dir("forge").join("state/x")));
    }
    assert_eq!(left.len(), 2, "{left:?}");
    // Run again, as the docs say: it finishes, and the temporary files are gone.
    let out = rotate(None);
    assert!(out.status.success(), "{out:?}");
    assert!(left.iter().all(|t| !t.exists()), "{left:?}");
    assert_eq!(
        key_id(&ca_key),
        Some(id2.clone()),
        "the CA key outside state_dir"
    );
    assert_eq!(
        key_id(&state),
        Some(id2.clone()),
        "the state outside state_dir"
    );

    // The agent on the new key, its handler killed while it saves its state: the agent
    // starts again, and the handler's next run goes on from the state it had.
    use_key(&mut f, Some(&k2));
    // A state to write: the handler begins it again at its first run.
    std::fs::remove_file(&state).unwrap();
    f.host("forge")
        .spawn
        .env
        .push(("FAILPOINTS".into(), "handler.state.temp=return".into()));
    f.start_host("forge");
    assert!(
        eventually(Duration::from_secs(60), || !temporaries_beside(&state)
            .is_empty())
        .await,
        "the handler was not killed at its state save:\n{}",
        log(&f)
    );
    f.kill("forge");
    f.host("forge").spawn.env.clear();
    f.start_host("forge");
    assert!(
        eventually(Duration::from_secs(60), || temporaries_beside(&state)
            .is_empty())
        .await,
        "the temporary file stayed:\n{}",
        log(&f)
    );
    assert_eq!(key_id(&ca_key), Some(id2));
}

/// `fort-agent check` applies every rule the start applies to the state key, and both
/// refuse a key another user owns or could replace: missing, readable by others (also
/// through a link), owned by another user, in a directory others may write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_refuses_every_state_key_the_start_refuses() {
    use std::os::unix::fs::PermissionsExt;
    let (mut f, _) = forge();
    let good = f.new_state_key("good");
    let check = |f: &Fleet| {
        let out = Command::new(fort_tests::bin("fort-agent"))
            .args(["check", "--skip-handlers", "--config"])
            .arg(f.config_path("forge"))
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    use_key(&mut f, Some(&good));
    let (ok, err) = check(&f);
    assert!(ok, "a good key: {err}");

    let dir = f.dir.path().join("keys");
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    let copy = |name: &str, mode: u32| {
        let p = dir.join(name);
        std::fs::copy(&good, &p).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        p
    };
    let readable = copy("readable", 0o644);
    let link = dir.join("link");
    std::os::unix::fs::symlink(&readable, &link).unwrap();
    let shared = f.dir.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
    let in_shared = shared.join("key");
    std::fs::copy(&good, &in_shared).unwrap();
    std::fs::set_permissions(&in_shared, std::fs::Permissions::from_mode(0o600)).unwrap();
    let mut cases = vec![
        (dir.join("missing"), "cannot read the state key"),
        (readable, "mode 0644"),
        (link, "mode 0644"),
        (in_shared, "another user could replace"),
    ];
    let root = rustix_is_root();
    if root {
        let foreign = copy("foreign", 0o600);
        std::os::unix::fs::chown(&foreign, Some(65534), Some(65534)).unwrap();
        cases.push((foreign, "belongs to user 65534"));
    } else {
        fort_tests::skip(
            "check_refuses_every_state_key_the_start_refuses",
            "a key owned by another user: chown needs root",
        );
    }
    for (key, why) in cases {
        use_key(&mut f, Some(&key));
        let (ok, err) = check(&f);
        assert!(!ok, "check passed {}", key.display());
        assert!(err.contains(why), "{}: {err}", key.display());
        let log = refused(&mut f);
        assert!(log.contains(why), "serve: {}: {log}", key.display());
    }
}

fn rustix_is_root() -> bool {
    std::fs::metadata("/proc/self")
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
        .unwrap_or(false)
}
