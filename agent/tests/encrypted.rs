//! Files delivered as systemd encrypted credentials, against real agents
//! (docs/protocol.md §11.3, *Encrypted files*; docs/at-rest.md): without `systemd-creds`
//! the need fails with the reason and nothing of it is written, in plaintext or at all,
//! and so it does with the real `systemd-creds` asked for a TPM2 the machine lacks; with
//! the real `systemd-creds`, the file is a credential that decrypts under its name only,
//! nothing of the secret is anywhere in the agent's files (a need referring to the value
//! beside it included), an unchanged payload writes and restarts nothing, and a changed
//! one replaces the file and restarts once.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use fort_tests::{contains_bytes, eventually, files_under, skip, Fleet};
use serde_json::{json, Value};

/// Provider `vault`: each entry gets `{"client_id": <need id>, "client_secret":
/// "<version>-<entry key>"}`, the version read from `<dir>/version`; a restarted vault
/// calls every consumer back (`initialize`).
fn vault(f: &mut Fleet) {
    let d = f.dir.path().display().to_string();
    std::fs::write(f.dir.path().join("version"), "v1").unwrap();
    let h = f.script(
        "vault",
        &format!(
            r#"v=$(cat {d}/version)
jq -c --arg v "$v" 'with_entries(.value = {{"client_id": (.key | split("/")[1]), "client_secret": "\($v)-\(.key)-secret"}})'"#
        ),
    );
    f.capability(
        "vault",
        "secret",
        json!({"handler": h, "mode": "async", "triggers": {"initialize": true}}),
    );
    f.host("vault").extra_toml = "[callbacks]\nbackoff = \"200ms\"\n".into();
}

/// Consumer `c` with a `systemctl` that records its calls in `systemctl.log`, and
/// `extra` in its agent.toml (before its tables).
fn consumer(f: &mut Fleet, extra: &str) -> PathBuf {
    let log = f.dir.path().join("systemctl.log");
    let systemctl = f.script("systemctl", &format!(r#"echo "$*" >> {}"#, log.display()));
    f.host("c").extra_toml = format!(
        "systemctl = \"{}\"\n{extra}[fulfill]\nbackoff = \"200ms\"\n",
        systemctl.display()
    );
    log
}

fn encrypted(path: &Path) -> Value {
    json!({"name": "client_secret", "path": path, "pointer": "/client_secret",
           "encrypt": "host", "credential_for": ["wiki.service"]})
}

/// Every file below `dir` that holds `needle`.
fn holding(dir: &Path, needle: &[u8]) -> Vec<PathBuf> {
    files_under(dir)
        .into_iter()
        .filter(|p| contains_bytes(&std::fs::read(p).unwrap_or_default(), needle))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_systemd_creds_the_need_fails_with_the_reason_and_nothing_is_written() {
    let mut f = Fleet::new();
    vault(&mut f);
    consumer(
        &mut f,
        "systemd_creds = \"/nonexistent/fort-test/systemd-creds\"\n",
    );
    let dir = f.dir.path().join("creds");
    let (cred, beside) = (dir.join("client_secret.cred"), dir.join("client_id"));
    f.need(
        "c",
        "secret/wiki",
        "vault",
        json!({"files": [
            encrypted(&cred),
            {"name": "client_id", "path": beside, "pointer": "/client_id"},
        ]}),
    );
    // Another need of the same host, in plaintext: its delivery is not held up.
    let plain = f.dir.path().join("plain/client_secret");
    f.need(
        "c",
        "secret/other",
        "vault",
        json!({"files": [{"path": plain, "pointer": "/client_secret"}]}),
    );
    f.start();
    assert!(
        eventually(Duration::from_secs(15), || {
            f.need_status("c", "secret/wiki")["state"] == "failed"
                && f.need_status("c", "secret/other")["state"] == "satisfied"
        })
        .await,
        "{}\n{}",
        f.need_status("c", "secret/wiki"),
        f.need_status("c", "secret/other")
    );
    let reason = f.need_status("c", "secret/wiki")["reason"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        reason.contains("cannot encrypt with systemd-creds (--with-key=host)")
            && reason.contains("/nonexistent/fort-test/systemd-creds"),
        "{reason}"
    );
    // Nothing of the payload landed: neither the encrypted file, in any form, nor the
    // plain file beside it; nor its secret anywhere in what the agent keeps.
    assert!(!cred.exists() && !beside.exists());
    let secret = b"v1-c:secret/wiki-secret";
    assert_eq!(holding(&f.host_dir("c"), secret), Vec::<PathBuf>::new());
    assert_eq!(
        std::fs::read_to_string(&plain).unwrap(),
        "v1-c:secret/other-secret"
    );
    // Asked for again after the back-off, and failing the same way: never a plaintext.
    let received = f.need_status("c", "secret/wiki")["attempts"].as_u64();
    assert!(
        eventually(Duration::from_secs(10), || f
            .need_status("c", "secret/wiki")["attempts"]
            .as_u64()
            > received)
        .await
    );
    assert!(!cred.exists());
}

/// `systemd-creds` that can encrypt here with a host secret of the test's own
/// (`SYSTEMD_CREDENTIAL_SECRET`, so the machine's is never made or read), or why not.
fn real_systemd_creds(secret: &Path) -> Result<(), String> {
    let out = Command::new("systemd-creds")
        .args(["encrypt", "--name=probe", "--with-key=host", "-", "-"])
        .env("SYSTEMD_CREDENTIAL_SECRET", secret)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| format!("no systemd-creds here: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "systemd-creds cannot encrypt here: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

fn decrypt(secret: &Path, name: &str, cred: &Path) -> std::process::Output {
    Command::new("systemd-creds")
        .args(["decrypt", &format!("--name={name}")])
        .arg(cred)
        .arg("-")
        .env("SYSTEMD_CREDENTIAL_SECRET", secret)
        .output()
        .expect("run systemd-creds")
}

fn restarts(log: &Path) -> usize {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with("restart") && l.contains("wiki.service"))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_encrypted_file_is_a_credential_that_changes_only_with_its_content() {
    let test = "an_encrypted_file_is_a_credential_that_changes_only_with_its_content";
    let mut f = Fleet::new();
    let secret = f.dir.path().join("credential.secret");
    if let Err(why) = real_systemd_creds(&secret) {
        skip(test, &why);
        return;
    }
    vault(&mut f);
    let log = consumer(
        &mut f,
        &format!(
            "[handler_environment]\nSYSTEMD_CREDENTIAL_SECRET = \"{}\"\n",
            secret.display()
        ),
    );
    let cred = f.dir.path().join("creds/secret/wiki/client_secret.cred");
    f.need(
        "c",
        "secret/wiki",
        "vault",
        json!({"files": [encrypted(&cred)]}),
    );
    // A need built from the client id beside the secret: the state keeps that value
    // for it, and nothing of the secret (searched below).
    f.need(
        "c",
        "secret/proxy",
        "vault",
        json!({"request": {"client": {"$fort_ref": "secret/wiki#/client_id"}},
               "files": [{"path": f.dir.path().join("proxy"), "pointer": "/client_id"}]}),
    );
    f.start();
    assert!(
        eventually(Duration::from_secs(15), || f.all_satisfied("c")).await,
        "{}\n{}",
        f.need_status("c", "secret/wiki"),
        f.need_status("c", "secret/proxy")
    );
    let kept =
        f.read_state("c", "fulfillment-state.json")["needs"]["secret/wiki"]["payload"].clone();
    // base64 of {"client_id":"wiki"}: the value referred to, alone.
    assert_eq!(kept, json!("eyJjbGllbnRfaWQiOiJ3aWtpIn0="), "{kept}");
    let plain = b"v1-c:secret/wiki-secret";
    let out = decrypt(&secret, "client_secret", &cred);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.stdout, plain);
    // Bound to its name: it does not load as another credential.
    assert!(!decrypt(&secret, "other", &cred).status.success());
    assert_eq!(std::fs::metadata(&cred).unwrap().mode() & 0o7777, 0o400);
    // The plaintext is in none of the agent's files nor beside the credential.
    for dir in [f.host_dir("c"), cred.parent().unwrap().to_path_buf()] {
        assert_eq!(holding(&dir, plain), Vec::<PathBuf>::new());
    }
    // Created: left to the path unit, not restarted.
    tokio::time::sleep(Duration::from_millis(1600)).await;
    assert_eq!(restarts(&log), 0);

    // The same payload again (vault calls back at its start): nothing is encrypted or
    // written again, nothing restarts.
    let before = std::fs::metadata(&cred).unwrap();
    let received = f.need_status("c", "secret/wiki")["received"].as_u64();
    f.kill("vault");
    f.start_host("vault");
    assert!(
        eventually(Duration::from_secs(15), || f
            .need_status("c", "secret/wiki")["received"]
            .as_u64()
            > received)
        .await
    );
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let after = std::fs::metadata(&cred).unwrap();
    assert_eq!(
        (after.ino(), after.mtime_nsec()),
        (before.ino(), before.mtime_nsec())
    );
    assert_eq!(restarts(&log), 0);

    // A new secret: the file is replaced and wiki restarted, once.
    std::fs::write(f.dir.path().join("version"), "v2").unwrap();
    f.kill("vault");
    f.start_host("vault");
    let next = b"v2-c:secret/wiki-secret".to_vec();
    assert!(
        eventually(Duration::from_secs(15), || decrypt(
            &secret,
            "client_secret",
            &cred
        )
        .stdout
            == next)
        .await
    );
    tokio::time::sleep(Duration::from_millis(1600)).await;
    assert_eq!(
        restarts(&log),
        1,
        "{}",
        std::fs::read_to_string(&log).unwrap()
    );
    for dir in [f.host_dir("c"), cred.parent().unwrap().to_path_buf()] {
        assert_eq!(holding(&dir, &next), Vec::<PathBuf>::new());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_systemd_creds_cannot_use_fails_the_need_with_what_it_said() {
    let test = "a_key_systemd_creds_cannot_use_fails_the_need_with_what_it_said";
    let mut f = Fleet::new();
    let secret = f.dir.path().join("credential.secret");
    if let Err(why) = real_systemd_creds(&secret) {
        skip(test, &why);
        return;
    }
    let has_tpm2 = Command::new("systemd-creds")
        .arg("has-tpm2")
        .output()
        .is_ok_and(|o| o.status.success());
    if has_tpm2 {
        skip(
            test,
            "this machine has a TPM2, which the test needs to be missing",
        );
        return;
    }
    vault(&mut f);
    consumer(
        &mut f,
        &format!(
            "[handler_environment]\nSYSTEMD_CREDENTIAL_SECRET = \"{}\"\n",
            secret.display()
        ),
    );
    let cred = f.dir.path().join("creds/client_secret.cred");
    let mut file = encrypted(&cred);
    file["encrypt"] = json!("tpm2");
    f.need("c", "secret/wiki", "vault", json!({"files": [file]}));
    f.start();
    assert!(
        eventually(Duration::from_secs(15), || f
            .need_status("c", "secret/wiki")["state"]
            == "failed")
        .await,
        "{}",
        f.need_status("c", "secret/wiki")
    );
    let reason = f.need_status("c", "secret/wiki")["reason"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    // What systemd-creds said (no TPM2 here, or no TPM2 support) is in the reason.
    assert!(
        reason.contains("cannot encrypt with systemd-creds (--with-key=tpm2): exited with code")
            && reason.to_lowercase().contains("tpm"),
        "{reason}"
    );
    assert!(!cred.exists());
    assert_eq!(
        holding(&f.host_dir("c"), b"v1-c:secret/wiki-secret"),
        Vec::<PathBuf>::new()
    );
}
