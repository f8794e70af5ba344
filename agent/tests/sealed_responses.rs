//! The provider's cached responses sealed with the state key (docs/at-rest.md), with real
//! agents: a provider upgraded onto plain `provider-state.json` seals it in place and its
//! consumer notices nothing; no file of the provider's state holds a response in the
//! clear, in the snapshot or the logs; another key, no key and a changed response stop
//! the start with the file and the way on; `fort-agent state-key rotate` moves it to a
//! new key. A key file others may read is refused, unless systemd's credentials hold it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use fort_tests::{contains_bytes, eventually, files_under, Fleet};
use serde_json::{json, Value};

/// What every response holds, to search the disk for.
const SECRET: &[u8] = b"s3cr3t-";

/// `p` answers each entry with a password derived from its key (the same on every run,
/// so a run changes nothing), counting its runs; `c` needs `cred/x`, delivered to a file.
fn fleet() -> (Fleet, PathBuf) {
    let mut f = Fleet::new();
    let d = f.dir.path().display().to_string();
    let h = f.script(
        "provide",
        &format!(
            r#"echo run >> {d}/runs; jq -c 'with_entries(.value = {{"password": ("s3cr3t-" + .key)}})'"#
        ),
    );
    f.capability("p", "cred", json!({"handler": h, "mode": "async"}));
    let file = f.dir.path().join("delivered-x");
    f.need("c", "cred/x", "p", delivered_to(&file));
    for h in ["p", "c"] {
        f.host(h).extra_toml =
            "[callbacks]\nbackoff = \"200ms\"\n[fulfill]\nbackoff = \"200ms\"\n".into();
    }
    (f, file)
}

/// A need's payload, delivered to `file`.
fn delivered_to(file: &Path) -> Value {
    let id = |flag: &str| {
        let out = Command::new("id").arg(flag).output().unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    json!({"files": [{"path": file, "pointer": "", "mode": "0600",
                      "owner": id("-un"), "group": id("-gn")}]})
}

fn runs(f: &Fleet) -> usize {
    std::fs::read_to_string(f.dir.path().join("runs"))
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

fn use_key(f: &mut Fleet, key: Option<&Path>) {
    let base = "[callbacks]\nbackoff = \"200ms\"\n[fulfill]\nbackoff = \"200ms\"\n";
    f.host("p").extra_toml = match key {
        Some(k) => format!("state_key_file = \"{}\"\n{base}", k.display()),
        None => base.into(),
    };
    f.write_files();
}

fn state_file(f: &Fleet) -> PathBuf {
    f.host_dir("p").join("state/provider-state.json")
}

/// Every file under the provider's state directory holding a response in the clear.
fn clear_copies(f: &Fleet) -> Vec<PathBuf> {
    files_under(&f.host_dir("p").join("state"))
        .into_iter()
        .filter(|p| std::fs::read(p).is_ok_and(|b| contains_bytes(&b, SECRET)))
        .collect()
}

fn snapshot(f: &Fleet) -> Value {
    serde_json::from_slice(&std::fs::read(state_file(f)).unwrap()).unwrap()
}

fn log(f: &Fleet) -> String {
    std::fs::read_to_string(f.host_dir("p").join("agent.log")).unwrap_or_default()
}

fn refused(f: &mut Fleet) -> String {
    match f.try_start_host("p") {
        Ok(()) => panic!("the agent started:\n{}", log(f)),
        Err(log) => log,
    }
}

async fn satisfied(f: &Fleet) -> bool {
    eventually(Duration::from_secs(20), || {
        f.need_status("c", "cred/x")["satisfied"] == true
    })
    .await
}

fn modified(p: &Path) -> std::time::SystemTime {
    std::fs::metadata(p).and_then(|m| m.modified()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_responses_are_sealed_in_place_and_nothing_is_asked_again() {
    let (mut f, delivered) = fleet();
    f.start();
    assert!(satisfied(&f).await);
    f.stop("p");
    // Without a key, as the release before: the response is in the clear (in the log).
    assert!(!clear_copies(&f).is_empty());
    assert_eq!(snapshot(&f)["version"], 2);
    let (handler_runs, delivered_at) = (runs(&f), modified(&delivered));

    // With a key: sealed in place at the start; the entry and its delivery stand.
    let k1 = f.new_state_key("k1");
    use_key(&mut f, Some(&k1));
    f.start_host("p");
    let snap = snapshot(&f);
    assert_eq!(snap["version"], 3);
    assert_eq!(snap["sealed"], "fort-sealed-value-1");
    let entry = &snap["entries"]["c:cred/x"];
    assert!(entry["response"].is_string(), "{entry}");
    assert!(entry["response_hash"].is_string(), "{entry}");
    assert!(log(&f).contains("sealed in place"), "{}", log(&f));
    assert_eq!(clear_copies(&f), Vec::<PathBuf>::new());
    // What needs no secret reads it without the key.
    assert_eq!(f.entries("p"), ["c:cred/x"]);
    let status = f.status("p");
    let row = &status["entries"]["c:cred/x"];
    assert_eq!(row["response_hash"], entry["response_hash"], "{status}");
    assert_eq!(row["undelivered"], false, "{status}");

    // A run over the sealed state answers the same: nothing is delivered again.
    let (ok, out) = f.admin("p", &["trigger", "cred"]);
    assert!(ok, "{out}");
    assert!(eventually(Duration::from_secs(20), || runs(&f) > handler_runs).await);
    // A new consumer's entry is logged sealed, too.
    let y = f.dir.path().join("delivered-y");
    f.need("c", "cred/y", "p", delivered_to(&y));
    f.write_files();
    // The provider first, so that it lists the new need before the consumer asks for it
    // (asked earlier, the provider still running would refuse it until the next nag).
    f.stop("p");
    f.start_host("p");
    f.stop("c");
    f.start_host("c");
    assert!(
        eventually(Duration::from_secs(20), || {
            f.need_status("c", "cred/y")["satisfied"] == true
        })
        .await
    );
    assert!(satisfied(&f).await);
    assert_eq!(modified(&delivered), delivered_at, "delivered once");
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(clear_copies(&f), Vec::<PathBuf>::new(), "logged sealed");
    assert!(std::fs::read_dir(f.host_dir("p").join("state"))
        .unwrap()
        .flatten()
        .any(|e| e
            .file_name()
            .to_string_lossy()
            .starts_with("provider-state.log.")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_key_no_key_and_a_changed_response_stop_the_start_and_rotate_moves_on() {
    let (mut f, _) = fleet();
    let k1 = f.new_state_key("k1");
    use_key(&mut f, Some(&k1));
    f.start();
    assert!(satisfied(&f).await);
    f.stop("p");
    // A start folds the log into the snapshot, where the response is changed below.
    f.start_host("p");
    f.stop("p");
    let before = std::fs::read(state_file(&f)).unwrap();
    let shown = state_file(&f).display().to_string();
    let set_aside = format!(
        "fort-agent set-aside --config {} provider-state.json",
        f.config_path("p").display()
    );

    let k2 = f.new_state_key("k2");
    use_key(&mut f, Some(&k2));
    let why = refused(&mut f);
    assert!(
        why.contains(&format!("{shown} is sealed with the state key")),
        "{why}"
    );
    assert!(why.contains("not with this one"), "{why}");
    assert!(why.contains(&set_aside), "{why}");
    use_key(&mut f, None);
    let why = refused(&mut f);
    assert!(why.contains("this process has no state key"), "{why}");
    assert!(why.contains(&shown), "{why}");
    assert_eq!(
        std::fs::read(state_file(&f)).unwrap(),
        before,
        "nothing changed"
    );

    // One changed character of the sealed response: refused, naming the entry.
    let text = String::from_utf8(before.clone()).unwrap();
    let at = text.find("\"response\":\"").unwrap() + 12;
    let flipped = if &text[at..at + 1] == "A" { "B" } else { "A" };
    let changed = format!("{}{flipped}{}", &text[..at], &text[at + 1..]);
    std::fs::write(state_file(&f), &changed).unwrap();
    use_key(&mut f, Some(&k1));
    let why = refused(&mut f);
    assert!(
        why.contains(&format!(
            "{shown}: entries.c:cred/x.response: authentication of the sealed contents failed"
        )),
        "{why}"
    );
    assert_eq!(std::fs::read(state_file(&f)).unwrap(), changed.as_bytes());
    std::fs::write(state_file(&f), &before).unwrap();

    // Rotation, the agent stopped: then it runs on k2, and k1 opens nothing.
    let rotate = || {
        Command::new(fort_tests::bin("fort-agent"))
            .args(["state-key", "rotate", "--config"])
            .arg(f.config_path("p"))
            .arg("--old-key")
            .arg(&k1)
            .arg("--new-key")
            .arg(&k2)
            .output()
            .unwrap()
    };
    let out = rotate();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        // provider-state.json, and the consumer state beside it.
        out.status.success() && text.contains("sealed 2 file(s)"),
        "{out:?}"
    );
    let out = rotate();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("sealed 0 file(s)") && text.contains("(2 already were)"),
        "{text}"
    );
    assert!(refused(&mut f).contains("not with this one"));
    use_key(&mut f, Some(&k2));
    f.start_host("p");
    assert!(satisfied(&f).await);
    assert_eq!(clear_copies(&f), Vec::<PathBuf>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_file_others_may_read_is_refused_unless_systemd_holds_it() {
    use std::os::unix::fs::PermissionsExt;
    let (mut f, _) = fleet();
    f.write_files();
    let key = f.new_state_key("k");
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    use_key(&mut f, Some(&key));
    let why = refused(&mut f);
    let shown = key.display();
    assert!(
        why.contains(&format!("the state key {shown} has mode 0644")),
        "{why}"
    );
    assert!(why.contains(&format!("chmod 600 {shown}")), "{why}");
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    f.start_host("p");
    f.stop("p");

    // The same key as systemd's credential: systemd decides its mode.
    let creds = f.dir.path().join("credentials");
    std::fs::create_dir(&creds).unwrap();
    std::fs::copy(&key, creds.join("state-key")).unwrap();
    std::fs::set_permissions(
        creds.join("state-key"),
        std::fs::Permissions::from_mode(0o440),
    )
    .unwrap();
    use_key(&mut f, None);
    f.host("p")
        .spawn
        .env
        .push(("CREDENTIALS_DIRECTORY".into(), creds.display().to_string()));
    f.start_host("p");
    assert!(
        log(&f).contains("state is sealed with the state key"),
        "{}",
        log(&f)
    );
}
