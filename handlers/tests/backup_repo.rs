//! backup-repo end to end, as a user meets it: real fort agents (a provider `vault`
//! running `fort-handler backup-repo`, consumers `app` and `web` whose agents make their
//! SSH keys and send only the public halves), a real `sshd` on loopback reading the
//! `authorized_keys` file the handler writes, and borg on both sides. The consumer inits,
//! creates and lists an archive with what was delivered; its key reaches its own
//! repository only, cannot delete what it wrote (append-only), cannot pass its quota;
//! another host's key reaches nothing of it, nor can another host ask for it; a rotated
//! key works and the old one is refused; a release takes the key away and keeps the data.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use fort_tests::borg::{can_run, Client};
use fort_tests::sshd::{key_pair, Sshd};
use fort_tests::{bin, eventually, free_addr, Fleet};
use serde_json::{json, Value};

const PROVIDER: &str = "vault";

/// The request schema the NixOS module ships for the backup-repo interface: the agent
/// compiles it and checks every request against it.
fn schema() -> Value {
    let schemas: Value = serde_json::from_slice(
        &std::fs::read(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../nixos-module/tests/expected/schemas.json"),
        )
        .unwrap(),
    )
    .unwrap();
    schemas["schemas"]["backup-repo"].clone()
}

fn borg_program() -> String {
    let out = std::process::Command::new("sh")
        .args(["-c", "command -v borg"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// A backup-repo capability of `vault` with its own state, key file and repositories.
fn capability(f: &mut Fleet, name: &str, sshd_port: u16, host_key: &Path, extra: Value) -> PathBuf {
    let root = f.dir.path().join(name);
    std::fs::create_dir_all(root.join("repos")).unwrap();
    let mut config = json!({
        "state_file": root.join("state.json"),
        "repositories_dir": root.join("repos"),
        "authorized_keys_file": root.join("authorized_keys"),
        "user": "root",
        "host": "127.0.0.1",
        "port": sshd_port,
        "host_key_files": [host_key],
        "borg": borg_program(),
        "quota": "50M",
        "max_quota": "100M",
        "quota_per_caller": "200M",
        "retention": "1d",
    });
    for (k, v) in extra.as_object().unwrap() {
        config[k] = v.clone();
    }
    let path = root.join("config.json");
    std::fs::write(&path, config.to_string()).unwrap();
    f.capability(
        PROVIDER,
        name,
        json!({"handler": bin("fort-handler"), "args": ["backup-repo", "--config", path],
               "mode": "async", "cacheResponse": true, "request_schema": schema()}),
    );
    root
}

/// `consumer`'s need of a repository: its agent makes the key, the request carries its
/// public line, and the key is installed once the provider answers that it authorized
/// it; the known_hosts line and the URL land beside it.
fn need(f: &mut Fleet, consumer: &str, key: &str, extra: Value) -> PathBuf {
    let dir = f
        .dir
        .path()
        .join(format!("{consumer}-{}", key.replace('/', "-")));
    std::fs::create_dir_all(&dir).unwrap();
    let file = |name: &str, pointer: &str| json!({"name": name, "path": dir.join(name), "pointer": pointer, "mode": "0644"});
    let mut spec = json!({
        "request": {"public_key": {"$fort_key": "ssh", "as": "openssh"}, "quota": null, "append_only": true},
        "keys": {"ssh": {"type": "ed25519", "format": "openssh", "path": dir.join("ssh_key"),
                         "mode": "0600", "certificate": "/public_key", "authorized": true}},
        "files": [file("known_hosts", "/known_hosts"), file("repo", "/repo")],
    });
    for (k, v) in extra.as_object().unwrap() {
        if k == "request" {
            for (rk, rv) in v.as_object().unwrap() {
                spec["request"][rk] = rv.clone();
            }
        } else {
            spec[k] = v.clone();
        }
    }
    f.need(consumer, key, PROVIDER, spec);
    dir
}

fn client(dir: &Path, passphrase: &str) -> Client {
    Client::new(
        dir,
        dir.join("ssh_key"),
        dir.join("known_hosts"),
        passphrase,
    )
}

fn repo_url(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("repo")).unwrap()
}

/// Every segment file of a repository, by path, with its bytes.
fn segments(repo: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    fort_tests::files_under(&repo.join("data"))
        .into_iter()
        .map(|p| {
            let bytes = std::fs::read(&p).unwrap();
            (p, bytes)
        })
        .collect()
}

/// The number of a repository's last committed transaction.
fn last_transaction(repo: &Path) -> u64 {
    let text = std::fs::read_to_string(repo.join("transactions")).unwrap();
    let last = text.lines().last().unwrap();
    last.strip_prefix("transaction ")
        .and_then(|r| r.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{last}"))
}

/// Whether sshd logged a refused login with the key whose private half is `private`
/// (`Failed publickey … ED25519 SHA256:…`, LogLevel VERBOSE), rather than anything
/// later failing.
fn refused_by_sshd(sshd: &Sshd, private: &str) -> bool {
    let key = ssh_key::PrivateKey::from_openssh(private).unwrap();
    let fingerprint = key
        .public_key()
        .fingerprint(ssh_key::HashAlg::Sha256)
        .to_string();
    sshd.log_text()
        .lines()
        .any(|l| l.contains("Failed publickey") && l.contains(&fingerprint))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_backs_up_to_its_own_repository_and_to_nothing_else() {
    let test = "backup_repo::a_consumer_backs_up_to_its_own_repository_and_to_nothing_else";
    if !can_run(test) {
        return;
    }
    let mut f = Fleet::new();
    let root = f.dir.path().to_path_buf();
    f.host(PROVIDER);
    f.host("app");
    f.host("web");
    let sshd_dir = root.join("sshd");
    std::fs::create_dir_all(&sshd_dir).unwrap();
    key_pair(&sshd_dir.join("ssh_host_ed25519_key"));
    let host_key_pub = sshd_dir.join("ssh_host_ed25519_key.pub");
    let sshd_addr = free_addr("127.0.0.1");
    let main = capability(
        &mut f,
        "backup-repo",
        sshd_addr.port(),
        &host_key_pub,
        json!({}),
    );
    // Keys that must be rotated within a minute, to see a rotation happen.
    let rotating = capability(
        &mut f,
        "backup-rotating",
        sshd_addr.port(),
        &host_key_pub,
        json!({"key_lifetime": "40s"}),
    );
    let sshd = Sshd::start_with(
        &sshd_dir,
        sshd_addr,
        &sshd_dir.join("ssh_host_ed25519_key"),
        &format!(
            "AuthorizedKeysFile {} {}\n",
            main.join("authorized_keys").display(),
            rotating.join("authorized_keys").display()
        ),
    );
    let app_home = need(&mut f, "app", "backup-repo/home", json!({}));
    let app_small = need(
        &mut f,
        "app",
        "backup-repo/small",
        json!({"request": {"quota": "10M"}}),
    );
    let app_rot = need(
        &mut f,
        "app",
        "backup-rotating/rot",
        json!({"renew_before_seconds": 20, "nag_seconds": 5}),
    );
    let web_home = need(&mut f, "web", "backup-repo/home", json!({}));
    // web's second repository, reached with a key the test made: later web asks for
    // app's key instead.
    let throwaway = key_pair(&root.join("web-throwaway"));
    f.need(
        "web",
        "backup-repo/stolen",
        PROVIDER,
        json!({"request": {"public_key": throwaway, "quota": null, "append_only": true},
               "files": [{"name": "repo", "path": root.join("web-stolen-repo"), "pointer": "/repo"}]}),
    );
    f.start();
    let satisfied =
        |f: &Fleet, host: &str, need: &str| f.need_status(host, need)["state"] == "satisfied";
    assert!(
        eventually(Duration::from_secs(60), || {
            satisfied(&f, "app", "backup-repo/home")
                && satisfied(&f, "app", "backup-repo/small")
                && satisfied(&f, "app", "backup-rotating/rot")
                && satisfied(&f, "web", "backup-repo/home")
                && satisfied(&f, "web", "backup-repo/stolen")
        })
        .await,
        "needs not satisfied: {}\n{}\nvault log:\n{}",
        f.status("app"),
        f.status("web"),
        std::fs::read_to_string(f.host_dir(PROVIDER).join("agent.log")).unwrap_or_default()
    );
    // The key was made by app's agent, in OpenSSH's format, and only its public line
    // left the host.
    let key_text = std::fs::read_to_string(app_home.join("ssh_key")).unwrap();
    assert!(key_text.starts_with("-----BEGIN OPENSSH PRIVATE KEY-----"));
    assert!(!fort_tests::contains_bytes(
        &std::fs::read(main.join("state.json")).unwrap(),
        key_text.as_bytes()
    ));

    // Init, create and list with nothing but what was delivered (the known_hosts line
    // is checked strictly: no prompt, no learning).
    let data = root.join("data");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::write(data.join("notes.txt"), "what must outlive this host\n").unwrap();
    let app = client(&app_home, "app's own passphrase");
    let url = repo_url(&app_home);
    assert!(
        url.starts_with(&format!("ssh://root@127.0.0.1:{}/", sshd_addr.port())),
        "{url}"
    );
    let init = app.run(&["init", "--encryption", "repokey-blake2", &url]);
    assert!(
        init.ok,
        "borg init: {}\nsshd:\n{}",
        init.stderr,
        sshd.log_text()
    );
    let create = app.run(&["create", &format!("{url}::first"), data.to_str().unwrap()]);
    assert!(create.ok, "borg create: {}", create.stderr);
    let list = app.run(&["list", "--short", &url]);
    assert!(list.ok && list.stdout.trim() == "first", "{list:?}");

    // app's key reaches app's repository alone: not web's, not any other path.
    let web_url = repo_url(&web_home);
    let other = app.run(&["list", &web_url]);
    assert!(
        !other.ok && other.stderr.contains("Repository path not allowed"),
        "{other:?}"
    );
    let web = client(&web_home, "web's passphrase");
    let into_app = web.run(&["list", &url]);
    assert!(
        !into_app.ok && into_app.stderr.contains("Repository path not allowed"),
        "{into_app:?}"
    );
    let web_init = web.run(&["init", "--encryption", "repokey-blake2", &web_url]);
    assert!(web_init.ok, "{web_init:?}");

    // Append-only: what the key deletes, prunes or compacts can be rolled back on the
    // server, and the repository cannot be deleted.
    let repo = main.join("repos/app/home");
    assert!(url.ends_with(repo.to_str().unwrap()), "{url}");
    let before = segments(&repo);
    let good = last_transaction(&repo);
    for args in [
        vec!["delete", "--force"],
        vec!["prune", "--keep-last", "1"],
        vec!["compact"],
    ] {
        let target = if args[0] == "delete" {
            format!("{url}::first")
        } else {
            url.clone()
        };
        let mut args: Vec<&str> = args;
        args.push(&target);
        let out = app.run(&args);
        assert!(
            out.ok || out.stderr.contains("append-only"),
            "{args:?}: {out:?}"
        );
    }
    let gone = app.run(&["delete", &url]);
    assert!(
        !gone.ok && gone.stderr.contains("append-only mode"),
        "{gone:?}"
    );
    let after = segments(&repo);
    for (path, bytes) in &before {
        assert_eq!(after.get(path), Some(bytes), "{} changed", path.display());
    }
    // The operator rolls back to the last transaction before the deletion (borg's
    // documented way), and the archive is there again.
    for (path, _) in after.iter().filter(|(p, _)| !before.contains_key(*p)) {
        std::fs::remove_file(path).unwrap();
    }
    for name in std::fs::read_dir(&repo).unwrap().flatten() {
        let n = name.file_name().to_string_lossy().into_owned();
        if ["index.", "hints.", "integrity."]
            .iter()
            .any(|p| n.starts_with(p))
        {
            std::fs::remove_file(name.path()).unwrap();
        }
    }
    let newest = fort_tests::files_under(&repo.join("data"))
        .iter()
        .filter_map(|p| p.file_name()?.to_str()?.parse::<u64>().ok())
        .max();
    assert_eq!(
        newest,
        Some(good),
        "rolled back to the transaction of the create"
    );
    let back = app.with_key(app_home.join("ssh_key"));
    let fresh = Client {
        base: root.join("app-after-rollback"),
        ..back
    };
    let list = fresh.run(&["list", "--short", &url]);
    assert!(
        list.ok && list.stdout.trim() == "first",
        "after the rollback: {list:?}"
    );

    // The quota: a 10M repository takes no 15M archive.
    let small = client(&app_small, "app's own passphrase");
    let small_url = repo_url(&app_small);
    assert!(
        small
            .run(&["init", "--encryption", "repokey-blake2", &small_url])
            .ok
    );
    let big = root.join("big");
    std::fs::create_dir_all(&big).unwrap();
    // Random bytes: nothing for borg to compress or deduplicate.
    let mut noise = Vec::new();
    use std::io::Read;
    std::fs::File::open("/dev/urandom")
        .unwrap()
        .take(15_000_000)
        .read_to_end(&mut noise)
        .unwrap();
    std::fs::write(big.join("noise"), &noise).unwrap();
    let over = small.run(&[
        "create",
        "--compression",
        "none",
        &format!("{small_url}::big"),
        big.to_str().unwrap(),
    ]);
    assert!(
        !over.ok && over.stderr.contains("storage quota"),
        "{over:?}"
    );

    // web cannot ask for app's key either: one key reaches one repository. The change
    // is refused, and what web had stays.
    let app_public = ssh_key::PrivateKey::from_openssh(&key_text)
        .unwrap()
        .public_key()
        .to_openssh()
        .unwrap();
    f.host("web").needs.get_mut("backup-repo/stolen").unwrap()["request"]["public_key"] =
        json!(app_public);
    f.write_files();
    f.agents["web"].hup();
    let reason = |f: &Fleet| {
        f.need_status("web", "backup-repo/stolen")["reason"]
            .as_str()
            .unwrap_or("")
            .to_owned()
    };
    assert!(
        eventually(Duration::from_secs(30), || reason(&f)
            .contains("public_key is another repository's key"))
        .await,
        "{}",
        f.need_status("web", "backup-repo/stolen")
    );
    assert!(
        reason(&f).contains("the repository stays reachable with the key it had"),
        "{}",
        reason(&f)
    );
    assert!(std::fs::read_to_string(main.join("authorized_keys"))
        .unwrap()
        .lines()
        .any(|l| l.ends_with(" web:backup-repo/stolen")
            && l.contains(throwaway.split_whitespace().nth(1).unwrap())));
    assert!(
        fresh.run(&["list", &url]).ok,
        "app's key still reaches app's repository"
    );

    // A rotated key: once the provider answers the new one, app installs it; it works,
    // and the one before is refused.
    let rot_key = app_rot.join("ssh_key");
    let first_key = std::fs::read_to_string(&rot_key).unwrap();
    let old_key = root.join("rot-old-key");
    std::fs::write(&old_key, &first_key).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&old_key, std::fs::Permissions::from_mode(0o600)).unwrap();
    assert!(
        eventually(Duration::from_secs(90), || std::fs::read_to_string(
            &rot_key
        )
        .is_ok_and(|k| k != first_key))
        .await,
        "the key was not rotated: {}",
        f.need_status("app", "backup-rotating/rot")
    );
    let new_key = root.join("rot-new-key");
    std::fs::copy(&rot_key, &new_key).unwrap();
    let rot = client(&app_rot, "app's own passphrase");
    let rot_url = repo_url(&app_rot);
    let with_new = rot
        .with_key(new_key)
        .run(&["init", "--encryption", "repokey-blake2", &rot_url]);
    assert!(with_new.ok, "the rotated key: {with_new:?}");
    let with_old = rot.with_key(old_key).run(&["list", &rot_url]);
    assert!(!with_old.ok, "the old key: {with_old:?}");
    assert!(
        refused_by_sshd(&sshd, &first_key),
        "sshd did not refuse the old key: {with_old:?}\n{}",
        sshd.log_text()
    );

    // A release takes app's key away at once, and keeps the data for the retention. (The
    // consumer removes the need's files with it: the key is tried from a copy.)
    let kept_key = root.join("released-key");
    let kept_hosts = root.join("released-known-hosts");
    std::fs::copy(app_home.join("ssh_key"), &kept_key).unwrap();
    std::fs::copy(app_home.join("known_hosts"), &kept_hosts).unwrap();
    let released = Client::new(
        &root.join("released"),
        kept_key,
        kept_hosts,
        "app's own passphrase",
    );
    assert!(released.run(&["list", &url]).ok);
    f.host("app").needs.remove("backup-repo/home");
    f.write_files();
    f.agents["app"].hup();
    assert!(
        eventually(Duration::from_secs(30), || !std::fs::read_to_string(
            main.join("authorized_keys")
        )
        .unwrap_or_default()
        .contains(" app:backup-repo/home"))
        .await,
        "the released entry's key is still authorized"
    );
    let refused = released.run(&["list", &url]);
    assert!(!refused.ok, "{refused:?}");
    assert!(
        refused_by_sshd(&sshd, &key_text),
        "sshd did not refuse the released key: {refused:?}\n{}",
        sshd.log_text()
    );
    let kept = segments(&repo);
    assert!(
        before.keys().all(|p| kept.contains_key(p)),
        "the data is kept"
    );
    let state: Value =
        serde_json::from_slice(&std::fs::read(main.join("state.json")).unwrap()).unwrap();
    assert!(
        state["state"]["repos"]["app:backup-repo/home"]["released_at"].is_u64(),
        "{state}"
    );
    // web's repository was never touched by any of it.
    assert!(web.run(&["list", &web_url]).ok);
}
