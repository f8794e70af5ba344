//! Credentials delivered the NixOS way, against real agents (docs/protocol.md §11.3,
//! §11.4, §11.7): files with their content, owner and mode, JSON pointers, unit restarts
//! gathered into rounds, revocation and removal, an owner that does not exist yet,
//! renewal before expiry, and need states in status and metrics.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use fort_tests::{eventually, free_addr, metrics, skip, Fleet};
use serde_json::{json, Value};

/// Provider `vault`, capability `secret`: each entry gets `{"client_id": <need id>,
/// "client_secret": "<version>-<entry key>"}`, the version read from `<dir>/version`.
/// While `<dir>/revoke` exists no entry gets anything (a revocation for those that had a
/// response). A restarted vault calls every consumer back (`initialize`).
fn vault(f: &mut Fleet) {
    let d = f.dir.path().display().to_string();
    std::fs::write(f.dir.path().join("version"), "v1").unwrap();
    let h = f.script(
        "vault",
        &format!(
            r#"if [ -e {d}/revoke ]; then echo '{{}}'; exit 0; fi
v=$(cat {d}/version)
jq -c --arg v "$v" 'with_entries(.value = {{"client_id": (.key | split("/")[1]), "client_secret": "\($v)-\(.key)"}})'"#
        ),
    );
    f.capability(
        "vault",
        "secret",
        json!({"handler": h, "mode": "async", "triggers": {"initialize": true}}),
    );
    f.host("vault").extra_toml = "[callbacks]\nbackoff = \"200ms\"\n".into();
}

/// A `systemctl` that records its arguments, one call per line, in `systemctl.log`.
fn recorder(f: &Fleet) -> (PathBuf, PathBuf) {
    let log = f.dir.path().join("systemctl.log");
    let script = f.script("systemctl", &format!(r#"echo "$*" >> {}"#, log.display()));
    (script, log)
}

fn calls(log: &Path) -> Vec<String> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// Consumer `c`: its `systemctl` is the recorder, it retries fast and serves metrics.
fn consumer(f: &mut Fleet, systemctl: &Path) -> std::net::SocketAddr {
    let metrics = free_addr("127.0.0.1");
    f.host("c").extra_toml = format!(
        "systemctl = \"{}\"\nmetrics_listen = \"{metrics}\"\n[fulfill]\nbackoff = \"200ms\"\n",
        systemctl.display()
    );
    metrics
}

fn id(args: &[&str]) -> String {
    let out = Command::new("id").args(args).output().expect("run id");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

fn is_root() -> bool {
    id(&["-u"]) == "0"
}

/// An account that owns delivered files: a new system user (and its group) when the tests
/// run as root, removed on drop; else the current user, the only one it may give files to.
struct Account {
    user: String,
    group: String,
    created: bool,
}

impl Account {
    fn current() -> Account {
        Account {
            user: id(&["-un"]),
            group: id(&["-gn"]),
            created: false,
        }
    }

    /// A name no account has yet; `create` makes it real.
    fn unused() -> Account {
        let user = format!("fortt{:08x}", rand_u32());
        Account {
            group: user.clone(),
            user,
            created: false,
        }
    }

    fn create(&mut self) -> bool {
        let ok = Command::new("useradd")
            .args(["--system", "--no-create-home", "--user-group", "--shell"])
            .arg("/usr/sbin/nologin")
            .arg(&self.user)
            .status()
            .is_ok_and(|s| s.success());
        self.created |= ok;
        ok
    }

    /// A fresh user when root can make one, else the current user.
    fn for_files(test: &str) -> Account {
        if is_root() {
            let mut a = Account::unused();
            if a.create() {
                return a;
            }
            skip(
                test,
                "useradd failed; files are given to the current user instead",
            );
        }
        Account::current()
    }

    fn uid(&self) -> u32 {
        id(&["-u", &self.user]).parse().expect("uid")
    }

    fn gid(&self) -> u32 {
        id(&["-g", &self.user]).parse().expect("gid")
    }
}

impl Drop for Account {
    fn drop(&mut self) {
        if self.created {
            let _ = Command::new("userdel").arg(&self.user).status();
        }
    }
}

fn rand_u32() -> u32 {
    let mut b = [0u8; 4];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
        .expect("urandom");
    u32::from_le_bytes(b)
}

fn file(path: &Path, pointer: &str, mode: &str, who: &Account) -> Value {
    json!({"path": path, "pointer": pointer, "mode": mode, "owner": who.user, "group": who.group})
}

fn mode_of(path: &Path) -> u32 {
    std::fs::metadata(path).expect("stat").mode() & 0o7777
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

fn received(f: &Fleet, need: &str) -> u64 {
    f.need_status("c", need)["received"].as_u64().unwrap_or(0)
}

fn state(f: &Fleet, need: &str) -> String {
    f.need_status("c", need)["state"]
        .as_str()
        .unwrap_or("")
        .to_owned()
}

/// Waits out the restart round in progress (300 ms of gathering, rounds 1 s apart).
async fn rounds_settle() {
    tokio::time::sleep(Duration::from_millis(1600)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_land_with_their_content_owner_and_mode() {
    let mut f = Fleet::new();
    vault(&mut f);
    let (systemctl, _) = recorder(&f);
    consumer(&mut f, &systemctl);
    let who = Account::for_files("files_land_with_their_content_owner_and_mode");
    let dir = f.dir.path().join("run/needs/secret/wiki");
    let (whole, secret, client_id) = (
        dir.join("client.json"),
        dir.join("client_secret"),
        dir.join("client_id"),
    );
    f.need(
        "c",
        "secret/wiki",
        "vault",
        json!({"files": [
            file(&whole, "", "0440", &who),
            file(&secret, "/client_secret", "0400", &who),
            file(&client_id, "/client_id", "0644", &who),
        ]}),
    );
    // The agent's own umask (0077 under the NixOS unit) must not hide the directories it
    // creates from the services that read their files.
    f.host("c").spawn.umask = Some(0o077);
    f.start();
    assert!(
        eventually(Duration::from_secs(15), || f.all_satisfied("c")).await,
        "{}",
        f.need_status("c", "secret/wiki")
    );
    for d in [f.dir.path().join("run"), dir.clone()] {
        assert_eq!(mode_of(&d), 0o755, "{}", d.display());
    }
    let payload: Value = serde_json::from_str(&read(&whole)).expect("the whole payload, JSON");
    assert_eq!(payload["client_secret"], "v1-c:secret/wiki");
    // A string at the pointer is written as its bytes, not as JSON.
    assert_eq!(read(&secret), "v1-c:secret/wiki");
    assert_eq!(read(&client_id), "wiki");
    assert_eq!(mode_of(&whole), 0o440);
    assert_eq!(mode_of(&secret), 0o400);
    assert_eq!(mode_of(&client_id), 0o644);
    for p in [&whole, &secret, &client_id] {
        let m = std::fs::metadata(p).unwrap();
        assert_eq!(
            (m.uid(), m.gid()),
            (who.uid(), who.gid()),
            "{}",
            p.display()
        );
    }
    // Nothing but the files: no temporary file left beside them.
    let names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), 3, "{names:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn units_restart_once_per_change_and_never_for_an_unchanged_payload() {
    let mut f = Fleet::new();
    vault(&mut f);
    let (systemctl, log) = recorder(&f);
    let metrics_at = consumer(&mut f, &systemctl);
    let who = Account::current();
    let run = f.dir.path().join("run");
    for id in ["a", "b", "c"] {
        let mut spec = json!({
            "files": [file(&run.join(id), "/client_secret", "0400", &who)],
            "restart_units": ["wiki.service"],
        });
        if id == "a" {
            spec["reload_units"] = json!(["nginx.service"]);
        }
        f.need("c", &format!("secret/{id}"), "vault", spec);
    }
    f.start();
    assert!(eventually(Duration::from_secs(15), || f.all_satisfied("c")).await);
    rounds_settle().await;
    let first = calls(&log);
    assert!(
        first.iter().any(|l| l == "restart -- wiki.service"),
        "{first:?}"
    );

    // The same payloads again (the vault restarts and calls everyone back): files are
    // not touched and nothing restarts.
    let stamp = |p: &Path| {
        let m = std::fs::metadata(p).unwrap();
        (m.ino(), m.mtime_nsec(), m.mtime())
    };
    let before: Vec<_> = ["a", "b", "c"].map(|i| stamp(&run.join(i))).into();
    f.kill("vault");
    f.start_host("vault");
    assert!(
        eventually(Duration::from_secs(15), || ["a", "b", "c"]
            .iter()
            .all(|i| received(&f, &format!("secret/{i}")) >= 2))
        .await,
        "the restarted vault did not call back: {}",
        f.status("c")
    );
    rounds_settle().await;
    assert_eq!(
        calls(&log),
        first,
        "an unchanged payload restarted something"
    );
    let after: Vec<_> = ["a", "b", "c"].map(|i| stamp(&run.join(i))).into();
    assert_eq!(before, after, "an unchanged file was rewritten");

    // All three change in one run: one restart of the unit they share, one reload.
    std::fs::write(f.dir.path().join("version"), "v2").unwrap();
    let (ok, out) = f.admin("vault", &["trigger", "secret", "--force"]);
    assert!(ok, "{out}");
    assert!(
        eventually(Duration::from_secs(15), || ["a", "b", "c"]
            .iter()
            .all(|i| read(&run.join(i)).starts_with("v2-")))
        .await
    );
    rounds_settle().await;
    let now = calls(&log);
    assert_eq!(
        &now[first.len()..],
        ["restart -- wiki.service", "reload -- nginx.service"],
        "three changed needs naming one unit"
    );
    let restarts = now.iter().filter(|l| l.starts_with("restart")).count();
    let text = metrics(metrics_at);
    assert!(
        text.contains(&format!(
            "fort_unit_actions{{action=\"restart\"}} {restarts}"
        )),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revocation_keeps_the_files_and_removal_deletes_them() {
    let mut f = Fleet::new();
    vault(&mut f);
    let (systemctl, log) = recorder(&f);
    let metrics_at = consumer(&mut f, &systemctl);
    let who = Account::current();
    let path = f.dir.path().join("run/wiki-secret");
    f.need(
        "c",
        "secret/wiki",
        "vault",
        json!({"nag_seconds": 1, "files": [file(&path, "/client_secret", "0400", &who)],
               "restart_units": ["wiki.service"]}),
    );
    f.start();
    assert!(eventually(Duration::from_secs(15), || f.all_satisfied("c")).await);
    assert_eq!(read(&path), "v1-c:secret/wiki");

    std::fs::write(f.dir.path().join("revoke"), "").unwrap();
    assert!(f.admin("vault", &["trigger", "secret", "--force"]).0);
    assert!(
        eventually(Duration::from_secs(10), || f
            .need_status("c", "secret/wiki")["reason"]
            == "revoked by the provider")
        .await,
        "{}",
        f.need_status("c", "secret/wiki")
    );
    assert_eq!(state(&f, "secret/wiki"), "pending");
    // The last good credential keeps serving.
    assert_eq!(read(&path), "v1-c:secret/wiki");
    let text = metrics(metrics_at);
    assert!(
        text.contains("fort_need_state{need=\"secret/wiki\",state=\"pending\"} 1"),
        "{text}"
    );

    // The vault answers again: the need is asked again at its nag and satisfied.
    std::fs::remove_file(f.dir.path().join("revoke")).unwrap();
    assert!(eventually(Duration::from_secs(10), || f.all_satisfied("c")).await);

    // The need goes from needs.json: released at the vault, then its files deleted.
    f.host("c").needs.clear();
    f.write_files();
    let (ok, out) = f.admin("c", &["reload"]);
    assert!(ok, "{out}");
    assert!(
        eventually(Duration::from_secs(10), || !path.exists()
            && f.entries("vault").is_empty())
        .await,
        "file still there: {}, vault entries {:?}",
        path.exists(),
        f.entries("vault")
    );
    let text = metrics(metrics_at);
    assert!(!text.contains("need=\"secret/wiki\""), "{text}");
    // Removing a credential restarts nothing: the service may still be using it.
    assert!(calls(&log).iter().all(|l| l == "restart -- wiki.service"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_owner_fails_the_need_until_the_account_exists() {
    const TEST: &str = "a_missing_owner_fails_the_need_until_the_account_exists";
    if !is_root() {
        skip(TEST, "creating the missing account needs root");
        return;
    }
    let mut f = Fleet::new();
    vault(&mut f);
    let (systemctl, _) = recorder(&f);
    let metrics_at = consumer(&mut f, &systemctl);
    let mut who = Account::unused();
    let path = f.dir.path().join("run/secret");
    f.need(
        "c",
        "secret/wiki",
        "vault",
        json!({"nag_seconds": 2, "files": [file(&path, "/client_secret", "0400", &who)]}),
    );
    f.start();
    assert!(
        eventually(Duration::from_secs(15), || state(&f, "secret/wiki")
            == "failed")
        .await,
        "{}",
        f.need_status("c", "secret/wiki")
    );
    let row = f.need_status("c", "secret/wiki");
    let reason = row["reason"].as_str().unwrap();
    assert!(
        reason.contains(&who.user) && reason.contains("does not exist"),
        "{reason}"
    );
    assert!(
        !reason.contains("v1-"),
        "the reason shows payload bytes: {reason}"
    );
    assert!(!path.exists(), "a file was written without its owner");
    let text = metrics(metrics_at);
    assert!(
        text.contains("fort_need_state{need=\"secret/wiki\",state=\"failed\"} 1"),
        "{text}"
    );
    assert!(text.contains("fort_needs{state=\"failed\"} 1"), "{text}");

    if !who.create() {
        skip(
            TEST,
            "useradd failed; recovery once the account exists untested",
        );
        return;
    }
    assert!(
        eventually(Duration::from_secs(15), || f.all_satisfied("c")).await,
        "{}",
        f.need_status("c", "secret/wiki")
    );
    assert_eq!(std::fs::metadata(&path).unwrap().uid(), who.uid());
    assert_eq!(f.need_status("c", "secret/wiki")["reason"], Value::Null);
}

fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
}

fn expiry_metric(text: &str, need: &str) -> Option<u64> {
    let prefix = format!("fort_need_expiry_timestamp_seconds{{need=\"{need}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_is_renewed_before_it_expires_and_expires_without_its_provider() {
    const TEST: &str =
        "a_certificate_is_renewed_before_it_expires_and_expires_without_its_provider";
    if !on_path("jq") || !on_path("openssl") {
        skip(TEST, "the example certificate handler needs jq and openssl");
        return;
    }
    let mut f = Fleet::new();
    let example =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../handlers/examples/cert-provider.sh");
    let certs = f.dir.path().join("certs");
    // The example handler, slowed by a second so that the `expiring` state lasts long
    // enough to be seen.
    let handler = f.script(
        "cert-provider",
        &format!("sleep 1\nexec sh {}", example.display()),
    );
    f.capability(
        "ca",
        "ssl-cert",
        json!({"handler": handler, "mode": "async", "cacheResponse": true}),
    );
    f.host("ca").extra_toml = format!(
        "handler_environment = {{ FORT_EXAMPLE_STATE = \"{}\" }}\n",
        certs.display()
    );
    let (systemctl, log) = recorder(&f);
    let metrics_at = consumer(&mut f, &systemctl);
    let who = Account::current();
    let pem = f.dir.path().join("run/short.pem");
    f.need(
        "c",
        "ssl-cert/short",
        "ca",
        json!({
            "request": {"domain": "short.test", "lifetime_seconds": 10},
            "renew_before_seconds": 8,
            "nag_seconds": 1,
            "files": [file(&pem, "", "0400", &who)],
            "reload_units": ["nginx.service"],
        }),
    );
    f.start();
    assert!(eventually(Duration::from_secs(20), || f.all_satisfied("c")).await);
    let first = f.need_status("c", "ssl-cert/short");
    let first_expiry = first["expires_at"]
        .as_u64()
        .expect("expires_at from notAfter");
    let first_pem = read(&pem);
    assert!(first_pem.contains("BEGIN CERTIFICATE"));
    assert_eq!(
        expiry_metric(&metrics(metrics_at), "ssl-cert/short"),
        Some(first_expiry)
    );

    // Two seconds after issue it is inside its renewal window: `expiring`, asked again
    // with `renew`, and satisfied by a new certificate before the old one expires.
    assert!(
        eventually(Duration::from_secs(10), || state(&f, "ssl-cert/short")
            == "expiring")
        .await,
        "{}",
        f.need_status("c", "ssl-cert/short")
    );
    let row = f.need_status("c", "ssl-cert/short");
    assert_eq!(row["satisfied"], false);
    assert!(
        row["reason"].as_str().unwrap().contains("expires at"),
        "{row}"
    );
    assert!(
        eventually(Duration::from_secs(10), || {
            f.need_status("c", "ssl-cert/short")["expires_at"]
                .as_u64()
                .is_some_and(|e| e > first_expiry)
        })
        .await,
        "not renewed: {}",
        f.need_status("c", "ssl-cert/short")
    );
    let renewed_at = fort_core::wire::unix_now();
    assert!(renewed_at < first_expiry, "renewed only after expiry");
    assert_ne!(read(&pem), first_pem);
    let renewals = read(&certs.join("renewals.log"));
    assert!(
        renewals.contains("c:ssl-cert/short renew"),
        "the handler never saw renew: {renewals:?}"
    );
    assert!(calls(&log).iter().any(|l| l == "reload -- nginx.service"));

    // Without its provider the certificate runs out: `expiring`, then `expired`.
    f.kill("ca");
    assert!(
        eventually(Duration::from_secs(20), || state(&f, "ssl-cert/short")
            == "expired")
        .await,
        "{}",
        f.need_status("c", "ssl-cert/short")
    );
    let row = f.need_status("c", "ssl-cert/short");
    assert!(row["reason"].as_str().unwrap().contains("expired"), "{row}");
    let text = metrics(metrics_at);
    assert!(
        text.contains("fort_need_state{need=\"ssl-cert/short\",state=\"expired\"} 1"),
        "{text}"
    );
    assert!(text.contains("fort_needs{state=\"expired\"} 1"), "{text}");
    assert!(!text.contains("state=\"expiring\"} 1"), "{text}");
}
