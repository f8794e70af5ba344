use std::collections::BTreeMap;

use super::*;

fn open(dir: &Path) -> Store<u32> {
    Store::open(&dir.join("s.json"), "entries").unwrap()
}

#[tokio::test]
async fn group_commit_loses_nothing_and_survives_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let token = CancellationToken::new();
    let flusher = tokio::spawn(store.clone().run_flusher(token.clone()));
    let mut tasks = Vec::new();
    for i in 0..500u32 {
        let s = store.clone();
        tasks.push(tokio::spawn(async move {
            s.change_durable(|c| c.put(format!("k{i}"), i))
                .await
                .unwrap();
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(store.read(|m| m.len()), 500);
    assert!(store.writes() < 500, "writes {}", store.writes());
    token.cancel();
    flusher.await.unwrap();
    // Everything is in the log; reading it back (as a restart does) finds all of it.
    let view = Store::<u32>::view(&dir.path().join("s.json"), "entries").unwrap();
    assert_eq!(view.len(), 500);
    let again = open(dir.path());
    assert_eq!(again.read(|m| m.get("k499").copied()), Some(499));
}

#[tokio::test]
async fn changes_reach_memory_only_once_written() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let ((), ticket) = store.change(|c| c.put("a", 1)).unwrap();
    assert_eq!(store.read(|m| m.get("a").copied()), None, "not written yet");
    // A second change sees the first even before it is written.
    let seen = store.change(|c| c.get("a").copied()).unwrap().0;
    assert_eq!(seen, Some(1));
    store.flush_once().await.unwrap();
    store.wait(ticket).await.unwrap();
    assert_eq!(store.read(|m| m.get("a").copied()), Some(1));
}

#[tokio::test]
async fn a_failed_write_leaves_memory_as_it_was() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    store.change_durable_now(|c| c.put("kept", 1)).await;
    // Make the next write fail: the log it must open is a directory.
    let log = {
        let mut w = store.inner.writer.lock().await;
        w.log = None;
        w.generation += 1;
        files::log_path(dir.path(), "s", w.generation)
    };
    std::fs::create_dir(&log).unwrap();
    let ((), t1) = store.change(|c| c.put("lost", 2)).unwrap();
    let ((), t2) = store
        .change(|c| {
            let base = c.get("lost").copied().unwrap_or(0);
            c.put("derived", base + 1)
        })
        .unwrap();
    // Deciding that nothing needs writing, from a value not yet written, waits for it.
    let (seen, t3) = store.change(|c| c.get("lost").copied()).unwrap();
    assert_eq!(seen, Some(2));
    assert!(store.flush_once().await.is_err());
    assert!(store.wait(t1).await.is_err());
    assert!(
        store.wait(t2).await.is_err(),
        "built on a failed change: fails too"
    );
    assert!(
        store.wait(t3).await.is_err(),
        "a change that wrote nothing but read a failed value: fails too"
    );
    assert_eq!(
        store.read(|m| m.clone()),
        BTreeMap::from([("kept".to_owned(), 1)])
    );
    // Space back: new changes are written and the old ones stay gone.
    std::fs::remove_dir(&log).unwrap();
    store.change_durable_now(|c| c.put("after", 3)).await;
    let again = open(dir.path());
    assert_eq!(
        again.read(|m| m.keys().cloned().collect::<Vec<_>>()),
        vec!["after".to_owned(), "kept".to_owned()]
    );
}

#[tokio::test]
async fn torn_tails_are_cut_and_damage_in_the_middle_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    for i in 0..3 {
        store
            .change_durable_now(|c| c.put(format!("k{i}"), i))
            .await;
    }
    let generation = store.inner.writer.lock().await.generation;
    drop(store);
    let log = files::log_path(dir.path(), "s", generation);
    let good = std::fs::read(&log).unwrap();
    // A torn last record: dropped, the rest kept.
    let mut torn = good.clone();
    torn.extend_from_slice(b"0badc0de {\"k\":\"k9\",\"v\":");
    std::fs::write(&log, &torn).unwrap();
    let again = open(dir.path());
    assert_eq!(again.read(|m| m.len()), 3);
    drop(again);
    // Damage followed by valid records: not a torn tail; refuse rather than guess.
    let generation = files::log_generations(dir.path(), "s").unwrap();
    assert!(
        generation.is_empty(),
        "the logs were folded into the snapshot at start"
    );
    let snapshot = std::fs::read(dir.path().join("s.json")).unwrap();
    std::fs::write(dir.path().join("s.log.9"), {
        let mut b = b"ffffffff {\"k\":\"x\",\"v\":1}\n".to_vec();
        b.extend_from_slice(&good);
        b
    })
    .unwrap();
    let err = Store::<u32>::open(&dir.path().join("s.json"), "entries")
        .err()
        .unwrap();
    assert!(err.to_string().contains("damaged"), "{err}");
    assert_eq!(
        std::fs::read(dir.path().join("s.json")).unwrap(),
        snapshot,
        "untouched"
    );
    // An unreadable snapshot is refused too, never replaced by an empty state.
    std::fs::remove_file(dir.path().join("s.log.9")).unwrap();
    std::fs::write(dir.path().join("s.json"), b"{\"version\": 2, \"entr").unwrap();
    let err = Store::<u32>::open(&dir.path().join("s.json"), "entries")
        .err()
        .unwrap();
    assert!(err.to_string().contains("will not start"), "{err}");
}

#[tokio::test]
async fn a_version_1_file_loads_and_compaction_keeps_the_log_small() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("s.json"),
        br#"{"version":1,"entries":{"old":7}}"#,
    )
    .unwrap();
    let store = open(dir.path());
    assert_eq!(store.read(|m| m.get("old").copied()), Some(7));
    let value = "x".repeat(2048);
    let big: Store<String> = Store::open(&dir.path().join("b.json"), "entries").unwrap();
    for i in 0..2000 {
        let v = value.clone();
        big.change_durable_now(|c| c.put(format!("k{}", i % 100), v))
            .await;
    }
    assert!(big.snapshots() >= 1, "the log was folded into snapshots");
    let on_disk: u64 = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("b."))
        .map(|e| e.metadata().unwrap().len())
        .sum();
    assert!(
        on_disk < 4 * 1024 * 1024,
        "{on_disk} bytes for 100 records of 2 KiB"
    );
    let view = Store::<String>::view(&dir.path().join("b.json"), "entries").unwrap();
    assert_eq!(view.len(), 100);
}

#[tokio::test]
async fn a_change_that_would_not_read_back_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store: Store<serde_json::Value> =
        Store::open(&dir.path().join("s.json"), "entries").unwrap();
    let mut deep = serde_json::json!(1);
    for _ in 0..200 {
        deep = serde_json::json!([deep]);
    }
    let refused = store.change(|c| c.put("deep", deep));
    assert!(refused.is_err());
    assert!(store.read(|m| m.is_empty()));
}

impl<V: Serialize + DeserializeOwned + Clone + Send + Sync + 'static> Store<V> {
    /// For tests without a flusher: stage, write, wait.
    pub(super) async fn change_durable_now(&self, f: impl FnOnce(&mut Changes<'_, V>)) {
        let ((), t) = self.change(f).unwrap();
        self.flush_once().await.unwrap();
        self.wait(t).await.unwrap();
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
struct Rec {
    n: u32,
    #[serde(default)]
    phase: Phase,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
enum Phase {
    #[default]
    Old,
}

fn line(key: &str, v: &serde_json::Value) -> String {
    let json = serde_json::json!({"k": key, "v": v}).to_string();
    format!("{:08x} {json}\n", crc32fast::hash(json.as_bytes()))
}

/// A later release's members, in the snapshot, in a record, in a logged record and around
/// the records, are kept through changes, compaction and restarts.
#[tokio::test]
async fn members_of_a_later_release_are_kept() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.json");
    std::fs::write(
        &path,
        r#"{"version":2,"next_log":1,"written_by":"fort 9.0.0","later":[1],"entries":{"a":{"n":1,"x":{"y":2}},"b":{"n":2}}}"#,
    )
    .unwrap();
    std::fs::write(
        dir.path().join("s.log.1"),
        line("b", &serde_json::json!({"n": 3, "z": true})),
    )
    .unwrap();
    let store: Store<Rec> = Store::open(&path, "entries").unwrap();
    assert_eq!(store.read(|m| m["b"].n), 3);
    let token = CancellationToken::new();
    let flusher = tokio::spawn(store.clone().run_flusher(token.clone()));
    store
        .change_durable(|c| {
            c.put(
                "a",
                Rec {
                    n: 10,
                    phase: Phase::Old,
                },
            );
            c.put(
                "c",
                Rec {
                    n: 5,
                    phase: Phase::Old,
                },
            );
        })
        .await
        .unwrap();
    token.cancel();
    flusher.await.unwrap();
    let view = Store::<serde_json::Value>::view(&path, "entries").unwrap();
    assert_eq!(
        view["a"],
        serde_json::json!({"n": 10, "phase": "old", "x": {"y": 2}})
    );
    assert_eq!(view["b"]["z"], true);
    drop(store);
    let _again: Store<Rec> = Store::open(&path, "entries").unwrap();
    let snap: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    assert_eq!(snap["later"], serde_json::json!([1]));
    assert_eq!(snap["entries"]["a"]["x"], serde_json::json!({"y": 2}));
    assert_eq!(snap["entries"]["b"]["z"], true);
    assert_eq!(
        snap["written_by"],
        format!("fort {}", crate::compat::RELEASE)
    );
}

/// A record this release cannot read is a refusal naming file, field and writer, also in
/// a log (never a torn tail); recovering keeps every other record and moves the files.
#[tokio::test]
async fn an_unreadable_record_is_refused_by_name_and_recovered_around() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.json");
    let snap = r#"{"version":2,"next_log":1,"written_by":"fort 9.0.0","entries":{"a":{"n":1},"b":{"n":2,"phase":"new"}}}"#;
    std::fs::write(&path, snap).unwrap();
    let e = Store::<Rec>::open(&path, "entries")
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("s.json: entries.b.phase: unknown variant `new`"),
        "{e}"
    );
    assert!(e.contains("written by fort 9.0.0"), "{e}");
    std::fs::write(&path, snap.replace(r#","phase":"new""#, "")).unwrap();
    let log = line("c", &serde_json::json!({"n": 3, "phase": "new"}))
        + &line("d", &serde_json::json!({"n": 4}));
    std::fs::write(dir.path().join("s.log.1"), &log).unwrap();
    let e = Store::<Rec>::open(&path, "entries")
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("s.log.1: line 1: v.phase: unknown variant `new`"),
        "{e}"
    );
    // Nothing was changed.
    assert_eq!(
        std::fs::read_to_string(dir.path().join("s.log.1")).unwrap(),
        log
    );

    let (store, recovery) =
        Store::<Rec>::open_with(&path, "entries", true, Sealing::Never).unwrap();
    let recovery = recovery.unwrap();
    assert_eq!(recovery.kept, 3);
    assert_eq!(recovery.skipped.len(), 1, "{:?}", recovery.skipped);
    assert_eq!(
        store.read(|m| m.keys().cloned().collect::<Vec<_>>()),
        ["a", "b", "d"]
    );
    assert_eq!(
        std::fs::read_to_string(recovery.moved_to.join("s.log.1")).unwrap(),
        log
    );
    // What was kept is a state of this release: it opens as is.
    drop(store);
    assert_eq!(
        Store::<Rec>::open(&path, "entries")
            .unwrap()
            .read(|m| m.len()),
        3
    );
}

/// A link planted in the state directory, named like a log whose last line is torn,
/// does not make recovery cut the file it points to (outside the directory); a FIFO
/// named like the snapshot or a log is refused at once instead of hanging the start.
#[tokio::test]
async fn links_and_fifos_in_the_state_directory_redirect_nothing_and_hang_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let victim = outside.path().join("precious");
    // Looks like a log whose last record was torn: valid lines, then a partial one.
    let text = format!("{}{{\"k\":\"torn", line("a", &serde_json::json!(1)));
    std::fs::write(&victim, &text).unwrap();
    std::os::unix::fs::symlink(&victim, dir.path().join("s.log.1")).unwrap();
    let refused = Store::<u32>::open(&dir.path().join("s.json"), "entries");
    assert!(refused.is_err(), "a link was read as a log");
    assert_eq!(
        std::fs::read_to_string(&victim).unwrap(),
        text,
        "the target was cut"
    );

    let fifos = tempfile::tempdir().unwrap();
    for name in ["s.json", "s.log.1"] {
        let d = fifos.path().join(name.replace('.', "-"));
        std::fs::create_dir(&d).unwrap();
        let made = std::process::Command::new("mkfifo")
            .arg(d.join(name))
            .status();
        if !made.is_ok_and(|s| s.success()) {
            return; // no mkfifo here: the fsx unit test covers the open itself
        }
        let opened = tokio::time::timeout(
            std::time::Duration::from_secs(5),
            tokio::task::spawn_blocking(move || {
                Store::<u32>::open(&d.join("s.json"), "entries").map(|_| ())
            }),
        )
        .await
        .expect("a FIFO hung the start")
        .unwrap();
        let e = opened.unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{name}: {e}");
    }
}
