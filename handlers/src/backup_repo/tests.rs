//! The backup-repo decisions on a scratch directory: what each entry may have, what
//! stays when a change is refused, one key per repository, release and retention.

use std::path::Path;

use serde_json::{json, Value};

use super::access::{self, Owner};
use super::config::Config;
use super::reconcile::{reconcile, vet, Counts, Run};
use super::state::State;
use crate::common::{parse_input, Output};

const HOST_KEY: &str =
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAID1AF8PoQ4lakrcKp00bfrycmCzPLsSWjMDNVfEq9GYM host@backup";

fn key(n: u8) -> String {
    let k = ssh_key::PrivateKey::from(ssh_key::private::Ed25519Keypair::from_seed(&[n; 32]));
    k.public_key().to_openssh().unwrap()
}

struct Scratch {
    _dir: tempfile::TempDir,
    config: Config,
    state: State,
    now: u64,
}

impl Scratch {
    fn new(extra: Value) -> Scratch {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::write(root.join("host.pub"), HOST_KEY).unwrap();
        let mut config = json!({
            "state_file": root.join("state.json"),
            "repositories_dir": root.join("repos"),
            "authorized_keys_file": root.join("authorized_keys"),
            "user": "root",
            "host": "backup.test",
            "port": 2222,
            "host_key_files": [root.join("host.pub")],
            "quota": "20M",
            "max_quota": "50M",
            "quota_per_caller": "100M",
            "retention": "1d",
            "key_lifetime": "30d",
        });
        for (k, v) in extra.as_object().unwrap() {
            config[k] = v.clone();
        }
        std::fs::create_dir_all(root.join("repos")).unwrap();
        std::fs::write(root.join("config.json"), config.to_string()).unwrap();
        Scratch {
            config: Config::load(&root.join("config.json")).unwrap(),
            _dir: dir,
            state: State::default(),
            now: 1_800_000_000,
        }
    }

    fn run_looking(&mut self, input: Value, look: bool) -> (Value, Counts) {
        let entries = parse_input(input.to_string().as_bytes()).unwrap();
        let known_hosts = access::known_hosts(&self.config).unwrap();
        let owner = Owner::default();
        let run = Run {
            config: &self.config,
            known_hosts: &known_hosts,
            owner: &owner,
            now: self.now,
            look,
        };
        let (out, counts, _) = reconcile(&run, &mut self.state, &entries);
        let content = access::authorized_keys(&self.config, self.state.reachable());
        access::write_authorized_keys(&self.config, &content).unwrap();
        (Output::into_json(out), counts)
    }

    fn run(&mut self, input: Value) -> (Value, Counts) {
        self.run_looking(input, false)
    }

    fn authorized(&self) -> String {
        std::fs::read_to_string(&self.config.authorized_keys_file).unwrap()
    }

    fn repo(&self, origin: &str, id: &str) -> std::path::PathBuf {
        self.config.repositories_dir.join(origin).join(id)
    }
}

fn entry(request: Value) -> Value {
    json!({"request": request, "response": null})
}

fn held(response: &Value) -> Value {
    json!(crate::common::entries::payload_sha256(response))
}

#[test]
fn a_repository_per_entry_reached_by_its_key_alone() {
    let mut s = Scratch::new(json!({}));
    let (out, counts) = s.run(json!({
        "app:backup-repo/home": entry(json!({"public_key": format!("{} app", key(1))})),
        "web:backup-repo/home": entry(json!({"public_key": key(2), "quota": "30M"})),
    }));
    assert_eq!((counts.created, counts.refused), (2, 0), "{out}");
    let r = &out["app:backup-repo/home"];
    let path = s.repo("app", "home");
    assert!(path.is_dir());
    assert_eq!(
        r["repo"],
        format!("ssh://root@backup.test:2222{}", path.display())
    );
    assert_eq!(r["public_key"], key(1));
    assert_eq!(
        r["known_hosts"],
        format!("[backup.test]:2222 {}\n", key_of(HOST_KEY))
    );
    assert_eq!(
        (r["append_only"].clone(), r["quota"].clone()),
        (json!(true), json!(20_000_000))
    );
    assert_eq!(r["expires_at"], s.now + 30 * 86400);
    assert_eq!(r["retention_seconds"], 86400);
    // Each key runs borg serve on its own repository only, append-only, under its quota.
    let lines = s.authorized();
    let line = lines
        .lines()
        .find(|l| l.ends_with(" app:backup-repo/home"))
        .unwrap();
    assert_eq!(
        line,
        format!(
            "command=\"borg serve --restrict-to-repository {} --append-only --storage-quota 20000000\",restrict {} app:backup-repo/home",
            path.display(),
            key(1)
        )
    );
    assert!(lines.contains("--storage-quota 30000000\",restrict"));
    assert_eq!(lines.lines().filter(|l| !l.starts_with('#')).count(), 2);

    // Unchanged: kept by its hash, nothing touched on disk (a missing directory is only
    // noticed on a run that looks).
    std::fs::remove_dir(&path).unwrap();
    let again = json!({"app:backup-repo/home": {"request": {"public_key": key(1)}, "response": r, "held": held(r)}});
    let (out, counts) = s.run(again.clone());
    assert_eq!(out["app:backup-repo/home"], json!({"$fort_keep": held(r)}));
    assert_eq!((counts.kept, counts.released), (1, 1));
    assert!(!path.exists());
    s.run_looking(again, true);
    assert!(path.is_dir());
}

fn key_of(line: &str) -> String {
    line.rsplit_once(' ').unwrap().0.to_owned()
}

#[test]
fn a_new_key_replaces_the_old_one_and_a_renewal_moves_expires_at() {
    let mut s = Scratch::new(json!({}));
    let (out, _) = s.run(json!({"app:backup-repo/home": entry(json!({"public_key": key(1)}))}));
    let first = out["app:backup-repo/home"].clone();
    s.now += 3600;
    let (out, counts) = s.run(json!({"app:backup-repo/home": {"request": {"public_key": key(3)}, "response": first, "renew": true}}));
    assert_eq!(counts.changed, 1);
    let r = &out["app:backup-repo/home"];
    assert_eq!(
        (r["public_key"].clone(), r["repo"].clone()),
        (json!(key(3)), first["repo"].clone())
    );
    assert_eq!(r["expires_at"], s.now + 30 * 86400);
    let lines = s.authorized();
    assert!(
        lines.contains(&key(3)) && !lines.contains(&key(1)),
        "{lines}"
    );
    // The same key asked to renew: a new expires_at, the same line.
    s.now += 60;
    let (out, _) = s.run(json!({"app:backup-repo/home": {"request": {"public_key": key(3)}, "response": r, "renew": true}}));
    assert_eq!(
        out["app:backup-repo/home"]["expires_at"],
        s.now + 30 * 86400
    );
}

#[test]
fn full_access_quota_and_keys_are_the_providers_to_grant() {
    let mut s = Scratch::new(json!({"full_access": {"ops": ["admin"]}}));
    let (out, counts) = s.run(json!({
        "app:backup-repo/a": entry(json!({"public_key": key(1), "append_only": false})),
        "ops:backup-repo/admin": entry(json!({"public_key": key(2), "append_only": false})),
        "app:backup-repo/b": entry(json!({"public_key": key(3), "quota": "60M"})),
        "app:backup-repo/c": entry(json!({"public_key": key(4), "quota": "1M"})),
    }));
    assert_eq!(counts.created, 1, "{out}");
    let refused = |k: &str| out[k]["$fort_refused"].as_str().unwrap_or("").to_owned();
    assert!(
        refused("app:backup-repo/a").contains("may not have full access"),
        "{out}"
    );
    assert!(
        refused("app:backup-repo/b").contains("above the 50M"),
        "{out}"
    );
    assert!(
        refused("app:backup-repo/c").contains("below borg's least"),
        "{out}"
    );
    assert_eq!(out["ops:backup-repo/admin"]["append_only"], false);
    let lines = s.authorized();
    assert!(!lines.contains("--append-only"), "{lines}");
    assert!(!s.repo("app", "a").exists());
    // A key one entry holds is refused to every other (sshd would give the first line's
    // repository to whoever logs in with it); new entries sharing one get none.
    let (out, _) = s.run(json!({
        "ops:backup-repo/admin": entry(json!({"public_key": key(2), "append_only": false})),
        "app:backup-repo/x": entry(json!({"public_key": key(2)})),
        "web:backup-repo/y": entry(json!({"public_key": key(6)})),
        "web:backup-repo/z": entry(json!({"public_key": key(6)})),
    }));
    for k in [
        "app:backup-repo/x",
        "web:backup-repo/y",
        "web:backup-repo/z",
    ] {
        assert!(
            out[k]["$fort_refused"]
                .as_str()
                .unwrap()
                .contains("another repository's key"),
            "{out}"
        );
        assert!(!s.authorized().contains(&format!(" {k}\n")));
    }
    assert!(out["ops:backup-repo/admin"]["repo"].is_string());
}

#[test]
fn a_callers_quota_is_bounded_and_what_it_has_is_never_pushed_out() {
    let mut s = Scratch::new(json!({}));
    // 100M per caller: two of 50M fit.
    let two = json!({
        "app:backup-repo/z1": entry(json!({"public_key": key(1), "quota": "50M"})),
        "app:backup-repo/z2": entry(json!({"public_key": key(2), "quota": "50M"})),
    });
    let (out, counts) = s.run(two.clone());
    assert_eq!(counts.created, 2, "{out}");
    // A new one that sorts first does not push them out; another caller is not touched.
    let mut three = two.clone();
    three["app:backup-repo/a"] = entry(json!({"public_key": key(3), "quota": "20M"}));
    three["web:backup-repo/a"] = entry(json!({"public_key": key(4), "quota": "50M"}));
    let (out, _) = s.run(three.clone());
    assert!(
        out["app:backup-repo/a"]["$fort_refused"]
            .as_str()
            .unwrap()
            .contains("would add up to 120M, more than the 100M"),
        "{out}"
    );
    assert!(
        out["app:backup-repo/z1"]["repo"].is_string()
            && out["web:backup-repo/a"]["repo"].is_string()
    );
    // A change asking for more than fits is refused, and the repository stays reachable
    // as it was.
    let mut bigger = two.clone();
    bigger["app:backup-repo/z2"] = entry(json!({"public_key": key(2), "quota": "60M"}));
    let (out, _) = s.run(bigger);
    let why = out["app:backup-repo/z2"]["$fort_refused"].as_str().unwrap();
    assert!(
        why.contains("above the 50M")
            && why.contains("stays reachable with the key it had (quota 50M, append-only)"),
        "{why}"
    );
    assert!(s.authorized().contains(&key(2)));
    // Released repositories still count: their data is on the disk.
    let (out, _) = s.run(json!({
        "app:backup-repo/z1": entry(json!({"public_key": key(1), "quota": "50M"})),
        "app:backup-repo/new": entry(json!({"public_key": key(5), "quota": "50M"})),
    }));
    assert!(
        out["app:backup-repo/new"]["$fort_refused"]
            .as_str()
            .unwrap()
            .contains("released ones still kept"),
        "{out}"
    );
}

#[test]
fn a_release_takes_the_key_away_and_keeps_the_data_for_the_retention() {
    let mut s = Scratch::new(json!({}));
    let one = json!({"app:backup-repo/home": entry(json!({"public_key": key(1)}))});
    s.run(one.clone());
    let path = s.repo("app", "home");
    std::fs::write(path.join("data"), b"archive").unwrap();
    let (out, counts) = s.run(json!({}));
    assert_eq!(counts.released, 1);
    assert!(!s.authorized().contains(&key(1)));
    assert!(path.join("data").exists());
    // Asked again within the retention: the same repository, its data, reachable again.
    s.now += 3600;
    // Run again when the retention ends (at most an hour away: the agent clamps it).
    assert_eq!(out["$fort_rerun_after"], 3600);
    let (out, counts) = s.run(one);
    assert_eq!(counts.changed, 1);
    assert_eq!(out["app:backup-repo/home"]["path"], json!(path));
    assert!(s.authorized().contains(&key(1)) && path.join("data").exists());
    // Nobody else gets the key of a released repository still kept.
    s.run(json!({}));
    let (out, _) = s.run(json!({"web:backup-repo/x": entry(json!({"public_key": key(1)}))}));
    assert!(
        out["web:backup-repo/x"]["$fort_refused"]
            .as_str()
            .unwrap()
            .contains("or a kept one's"),
        "{out}"
    );
    // Released again, and past the retention: removed, with its caller's directory.
    s.run(json!({}));
    s.now += 86400 - 1;
    let (_, counts) = s.run(json!({}));
    assert_eq!(counts.removed, 0);
    s.now += 1;
    let (_, counts) = s.run(json!({}));
    assert_eq!(counts.removed, 1);
    assert!(!path.exists() && !path.parent().unwrap().exists());
    assert!(s.state.repos.is_empty());
}

#[test]
fn vet_holds_requests_to_the_policy_alone() {
    let s = Scratch::new(json!({}));
    let entries = parse_input(
        json!({
            "app:backup-repo/a": entry(json!({"public_key": key(1), "quota": "50M"})),
            "app:backup-repo/b": entry(json!({"public_key": key(2), "quota": "50M"})),
            "app:backup-repo/c": entry(json!({"public_key": key(3), "quota": "10M"})),
            "app:backup-repo/d": entry(json!({"public_key": key(4), "append_only": false})),
            "web:backup-repo/e": entry(json!({"public_key": "ssh-rsa AAAA"})),
        })
        .to_string()
        .as_bytes(),
    )
    .unwrap();
    let refused = vet(&s.config, &entries);
    assert_eq!(
        refused.keys().collect::<Vec<_>>(),
        [
            "app:backup-repo/c",
            "app:backup-repo/d",
            "web:backup-repo/e"
        ]
    );
    assert!(Path::new(&s.config.repositories_dir)
        .read_dir()
        .unwrap()
        .next()
        .is_none());
}

fn mkfifo(path: &Path) {
    rustix::fs::mknodat(
        rustix::fs::CWD,
        path,
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
        0,
    )
    .unwrap();
}

fn owner_of(path: &Path) -> u32 {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path).unwrap().uid()
}

/// The repositories' owner (`borg serve`) may plant anything in its caller's directory:
/// a link where a repository or a caller's directory goes is not gone through, and
/// nothing outside is made or given away.
#[test]
fn a_link_where_a_repository_goes_is_that_entrys_failure() {
    if !fort_tests::is_root() {
        fort_tests::skip(
            "a_link_where_a_repository_goes_is_that_entrys_failure",
            "giving a directory to another account needs root",
        );
        return;
    }
    let mut s = Scratch::new(json!({"user": "nobody"}));
    let outside = tempfile::tempdir().unwrap();
    let repos = s.config.repositories_dir.clone();
    // The caller's directory itself a link out.
    std::os::unix::fs::symlink(outside.path(), repos.join("app")).unwrap();
    // A repository's place a link out, and a FIFO.
    std::fs::create_dir(repos.join("web")).unwrap();
    std::os::unix::fs::symlink(outside.path(), repos.join("web").join("home")).unwrap();
    mkfifo(&repos.join("web").join("fifo"));
    let (out, counts) = s.run(json!({
        "app:backup-repo/home": entry(json!({"public_key": key(1)})),
        "web:backup-repo/home": entry(json!({"public_key": key(2)})),
        "web:backup-repo/fifo": entry(json!({"public_key": key(3)})),
        "web:backup-repo/plain": entry(json!({"public_key": key(4)})),
    }));
    for k in [
        "app:backup-repo/home",
        "web:backup-repo/home",
        "web:backup-repo/fifo",
    ] {
        let why = out[k]["$fort_pending"].as_str().unwrap_or_default();
        assert!(why.contains("not a directory"), "{k}: {out}");
    }
    // The others' failure is theirs alone.
    assert_eq!((counts.created, counts.pending), (1, 3), "{out}");
    assert_eq!(owner_of(&s.repo("web", "plain")), 65534);
    assert!(outside.path().read_dir().unwrap().next().is_none());
    assert_eq!(owner_of(outside.path()), 0);
    assert!(!s.authorized().contains(&key(1)) && s.authorized().contains(&key(4)));
}

/// A released repository's removal takes links, FIFOs and hard links away without
/// going through them, stops at a tree deeper than borg makes, and takes a large tree
/// away over several runs.
#[test]
fn a_removal_never_leaves_the_repository_and_is_bounded() {
    let mut s = Scratch::new(json!({}));
    let outside = tempfile::tempdir().unwrap();
    let precious = outside.path().join("precious");
    std::fs::write(&precious, b"precious").unwrap();
    s.run(json!({
        "app:backup-repo/links": entry(json!({"public_key": key(1)})),
        "app:backup-repo/deep": entry(json!({"public_key": key(2)})),
    }));
    let links = s.repo("app", "links");
    std::os::unix::fs::symlink(outside.path(), links.join("dir")).unwrap();
    std::os::unix::fs::symlink(&precious, links.join("file")).unwrap();
    std::fs::hard_link(&precious, links.join("hard")).unwrap();
    mkfifo(&links.join("fifo"));
    std::fs::create_dir_all(links.join("data/0")).unwrap();
    std::fs::write(links.join("data/0/1"), b"segment").unwrap();
    let deep = s.repo("app", "deep");
    let mut bottom = deep.clone();
    for _ in 0..20 {
        bottom.push("d");
    }
    std::fs::create_dir_all(&bottom).unwrap();

    s.run(json!({}));
    s.now += 86400;
    let (out, counts) = s.run(json!({}));
    assert_eq!(counts.removed, 1);
    // What cannot be removed is tried again within the hour, not every second.
    assert_eq!(out["$fort_rerun_after"], 3600);
    assert!(!links.exists());
    assert_eq!(std::fs::read(&precious).unwrap(), b"precious");
    assert_eq!(outside.path().read_dir().unwrap().count(), 1);
    // Deeper than borg writes: left as it is, its record kept, the caller's directory too.
    assert!(bottom.is_dir());
    assert_eq!(
        s.state.repos.keys().collect::<Vec<_>>(),
        ["app:backup-repo/deep"]
    );
    let e = access::remove_repository(&s.config, &deep).unwrap_err();
    assert!(e.contains("directories deep"), "{e}");

    // A tree of more names than a run takes: removed over several runs.
    std::fs::remove_dir_all(deep.join("d")).unwrap();
    for n in 0..25 {
        std::fs::write(deep.join(n.to_string()), b"x").unwrap();
    }
    for _ in 0..2 {
        assert_eq!(
            access::remove_repository_within(&s.config, &deep, 10),
            Ok(access::Removal::Partly)
        );
    }
    assert_eq!(deep.read_dir().unwrap().count(), 5);
    assert_eq!(
        access::remove_repository_within(&s.config, &deep, 10),
        Ok(access::Removal::Done)
    );
    assert!(!deep.exists() && !deep.parent().unwrap().exists());
}
