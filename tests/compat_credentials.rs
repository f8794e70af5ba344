//! The compatibility lane for files delivered as encrypted credentials
//! (docs/compatibility.md, *Encrypted delivered files*): the release before the tree
//! refuses a needs.json with `encrypt` by name; given the needs.json of its own
//! generation (the file declared without `encrypt`) it starts on the state the tree
//! wrote, the need starts over and its file is written as that release writes it; and
//! rolling forward again makes it a credential again, never taking the plain file for
//! one. Without the previous release built, or without a `systemd-creds` that can
//! encrypt here, it says SKIP with the reason.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use fort_tests::releases::{self, Release};
use fort_tests::{eventually, skip, Fleet};
use serde_json::{json, Value};

const TEST: &str = "a_rollback_to_the_previous_release_starts_an_encrypted_need_over";

fn previous() -> Option<Release> {
    releases::previous().map_err(|why| skip(TEST, &why)).ok()
}

/// `systemd-creds` that encrypts with a host secret of the test's own, or why not.
fn systemd_creds(secret: &Path) -> Result<(), String> {
    let out = Command::new("systemd-creds")
        .args(["encrypt", "--name=probe", "--with-key=host", "-", "-"])
        .env("SYSTEMD_CREDENTIAL_SECRET", secret)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| format!("no systemd-creds here: {e}"))?;
    out.status.success().then_some(()).ok_or_else(|| {
        format!(
            "systemd-creds cannot encrypt here: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )
    })
}

fn decrypt(secret: &Path, cred: &Path) -> Option<Vec<u8>> {
    let out = Command::new("systemd-creds")
        .args(["decrypt", "--name=secret"])
        .arg(cred)
        .arg("-")
        .env("SYSTEMD_CREDENTIAL_SECRET", secret)
        .output()
        .ok()?;
    out.status.success().then_some(out.stdout)
}

/// c's need as the generation with `encrypt` declares it, or as the one before.
fn declare(f: &mut Fleet, file: &Path, encrypted: bool) {
    let mut entry = json!({"name": "secret", "path": file, "pointer": "/for"});
    if encrypted {
        entry["encrypt"] = json!("host");
    }
    f.host("c").needs.clear();
    f.need("c", "cred/x", "p", json!({"files": [entry]}));
}

fn run_as(f: &mut Fleet, binary: Option<&Path>) {
    f.host("c").spawn.binary = binary.map(Path::to_path_buf);
}

async fn state_of(f: &Fleet) -> Value {
    f.need_status("c", "cred/x")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_to_the_previous_release_starts_an_encrypted_need_over() {
    let Some(old) = previous() else { return };
    let mut f = Fleet::new();
    let secret = f.dir.path().join("credential.secret");
    if let Err(why) = systemd_creds(&secret) {
        skip(TEST, &why);
        return;
    }
    let d = f.dir.path().display().to_string();
    let h = f.script(
        "provide",
        &format!(r#"echo run >> {d}/runs; jq -c 'with_entries(.value = {{"for": .key}})'"#),
    );
    f.capability("p", "cred", json!({"handler": h, "mode": "async"}));
    f.host("p").extra_toml = "[callbacks]\nbackoff = \"200ms\"\n".into();
    f.host("c").extra_toml = format!(
        "[handler_environment]\nSYSTEMD_CREDENTIAL_SECRET = \"{}\"\n[fulfill]\nbackoff = \"200ms\"\n",
        secret.display()
    );
    let file = f.dir.path().join("delivered/secret");
    declare(&mut f, &file, true);
    f.start();
    let satisfied = |f: &Fleet| f.need_status("c", "cred/x")["satisfied"] == true;
    assert!(eventually(Duration::from_secs(20), || satisfied(&f)).await);
    let plain = b"c:cred/x".to_vec();
    assert_eq!(decrypt(&secret, &file), Some(plain.clone()));
    f.stop("c");

    // The previous release with this generation's needs.json: refused, by name.
    run_as(&mut f, Some(&old.agent()));
    let refused = f
        .try_start_host("c")
        .expect_err("the previous release must refuse a needs.json with encrypt");
    assert!(
        refused.contains("needs.json") && refused.contains("encrypt"),
        "{refused}"
    );

    // With the needs.json of its own generation: it starts on the tree's state, and the
    // need, declared otherwise, starts over; its file is written as it writes files.
    declare(&mut f, &file, false);
    f.write_files();
    f.start_host("c");
    assert!(
        eventually(Duration::from_secs(20), || std::fs::read(&file).ok()
            == Some(plain.clone()))
        .await,
        "{}",
        state_of(&f).await
    );
    assert!(eventually(Duration::from_secs(20), || satisfied(&f)).await);
    f.stop("c");

    // Forward again: a credential again, the plain file not taken for one.
    run_as(&mut f, None);
    declare(&mut f, &file, true);
    f.write_files();
    f.start_host("c");
    let secret_path = secret.clone();
    assert!(
        eventually(Duration::from_secs(20), || decrypt(&secret_path, &file)
            == Some(plain.clone()))
        .await,
        "{}",
        state_of(&f).await
    );
    assert!(eventually(Duration::from_secs(20), || satisfied(&f)).await);
    assert_ne!(std::fs::read(&file).unwrap(), plain);
}
