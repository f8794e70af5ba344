//! The writer and the verifier together, on a directory of their own: rotation keeps the
//! chain across files, a restart continues it, a torn last line is cut off, and a
//! changed, removed or moved record is named.

use std::path::Path;
use std::time::Duration;

use super::*;
use crate::sign::Signer;

fn options(dir: &Path, max_file_bytes: u64, max_files: usize) -> Options {
    Options {
        dir: dir.to_path_buf(),
        host: "forge".into(),
        max_file_bytes,
        max_files,
        // Checkpoints only when a file is full and at close: the test decides when.
        checkpoint_interval: Duration::from_secs(3600),
        queue: 100_000,
        journal: false,
        syslog: None,
    }
}

fn write(dir: &Path, signer: &Signer, opts: Options, n: usize, from: usize) {
    let _ = dir;
    let audit = Audit::open(opts, signer.clone());
    for i in from..from + n {
        audit.record_caused_by(
            "app",
            Event::caused(CausedKind::Issued)
                .consumer("app")
                .need(format!("cred/{i}"))
                .response(Some(format!("{i:064x}"))),
        );
    }
    audit.close();
}

fn records(dir: &Path) -> Vec<Value> {
    read_lines(dir)
        .unwrap()
        .into_iter()
        .filter_map(|l| l.record)
        .collect()
}

#[test]
fn rotation_keeps_the_chain_across_files_and_removes_the_oldest() {
    let dir = tempfile::tempdir().unwrap();
    let signer = Signer::generate();
    let keys = vec![signer.public_key().clone()];
    write(dir.path(), &signer, options(dir.path(), 4096, 3), 200, 0);
    let names = files(dir.path()).unwrap();
    assert_eq!(names.len(), 3, "{names:?}");
    for name in &names {
        let len = std::fs::metadata(name).unwrap().len();
        // A file is closed once it reaches the bound: by at most one record and its
        // checkpoint more.
        assert!(len < 4096 + 1024, "{} is {len} bytes", name.display());
        let text = std::fs::read_to_string(name).unwrap();
        let last = text.lines().last().unwrap();
        assert!(last.contains("\"event\":\"checkpoint\""), "{last}");
    }
    let v = verify(dir.path(), "forge", &keys).unwrap();
    assert!(v.problems.is_empty(), "{:?}", v.problems);
    assert!(v.first_seq.unwrap() > 1);
    assert!(v
        .notes
        .iter()
        .any(|n| n.contains("older files were removed")));
    assert_eq!(v.signed_through, v.last_seq.map(|s| s - 1));
    assert!(v.checkpoints >= 3);
    // Each file's name is the seq of its first record.
    for name in &names {
        let first = read_lines(dir.path())
            .unwrap()
            .into_iter()
            .find(|l| &l.file == name)
            .unwrap();
        let seq = first.record.unwrap()["seq"].as_u64().unwrap();
        assert_eq!(
            name.file_name().unwrap().to_str().unwrap(),
            format!("{seq:016}.jsonl")
        );
    }
    // Another key did not sign it.
    let other = vec![Signer::generate().public_key().clone()];
    let v = verify(dir.path(), "forge", &other).unwrap();
    assert!(v.problems[0].what.contains("signature"), "{:?}", v.problems);
}

#[test]
fn a_restart_continues_the_chain_and_cuts_a_torn_last_line() {
    let dir = tempfile::tempdir().unwrap();
    let signer = Signer::generate();
    let keys = vec![signer.public_key().clone()];
    let opts = options(dir.path(), 1 << 20, 4);
    write(dir.path(), &signer, opts.clone(), 5, 0);
    let file = files(dir.path()).unwrap()[0].clone();
    // A crash in the middle of a line.
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&file)
        .unwrap();
    let torn = b"{\"seq\":7,\"at\":1,\"pr";
    std::io::Write::write_all(&mut f, torn).unwrap();
    drop(f);
    let v = verify(dir.path(), "forge", &keys).unwrap();
    assert!(v.problems.is_empty(), "{:?}", v.problems);
    assert!(
        v.notes.iter().any(|n| n.contains("cut short")),
        "{:?}",
        v.notes
    );

    write(dir.path(), &signer, opts, 5, 5);
    let all = records(dir.path());
    let seqs: Vec<u64> = all.iter().map(|r| r["seq"].as_u64().unwrap()).collect();
    assert_eq!(seqs, (1..=seqs.len() as u64).collect::<Vec<_>>());
    assert_eq!(all[6]["event"], "torn_tail", "{all:#?}");
    assert_eq!(all[6]["detail"]["bytes"], torn.len());
    let v = verify(dir.path(), "forge", &keys).unwrap();
    assert!(v.problems.is_empty(), "{:?}", v.problems);
    assert_eq!(v.checkpoints, 2);
}

#[test]
fn the_first_bad_record_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let signer = Signer::generate();
    let keys = vec![signer.public_key().clone()];
    write(dir.path(), &signer, options(dir.path(), 1 << 20, 4), 10, 0);
    let file = files(dir.path()).unwrap()[0].clone();
    let lines: Vec<String> = std::fs::read_to_string(&file)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect();
    let check = |edit: &dyn Fn(&mut Vec<String>)| {
        let copy = tempfile::tempdir().unwrap();
        let mut l = lines.clone();
        edit(&mut l);
        std::fs::write(
            copy.path().join(file.file_name().unwrap()),
            l.join("\n") + "\n",
        )
        .unwrap();
        verify(copy.path(), "forge", &keys).unwrap().problems
    };
    let changed = check(&|l| l[3] = l[3].replace("cred/3", "cred/X"));
    assert_eq!(
        (changed[0].line, changed[0].seq),
        (4, Some(4)),
        "{changed:?}"
    );
    assert!(changed[0].what.contains("changed"), "{changed:?}");
    let removed = check(&|l| {
        l.remove(3);
    });
    assert_eq!(removed[0].seq, Some(5), "{removed:?}");
    assert!(
        removed[0].what.contains("record 4 is missing"),
        "{removed:?}"
    );
    let moved = check(&|l| l.swap(3, 4));
    assert_eq!(moved[0].line, 4, "{moved:?}");
    assert!(moved[0].what.contains("out of order"), "{moved:?}");
    let garbage = check(&|l| l[2] = "not json".into());
    assert_eq!(garbage[0].line, 3, "{garbage:?}");
}

#[test]
fn a_disabled_trail_records_nothing_and_is_never_unwritable() {
    let audit = Audit::disabled();
    audit.record(Event::own(OwnKind::Start));
    assert!(audit.writable());
    assert!(audit.stats().is_none());
    audit.close();
}

#[test]
fn a_hostile_copy_is_reported_not_a_panic() {
    // A copy handed to an operator is hostile input: a hash that splits a character at
    // byte 12, escape sequences, and a seq at the top of u64 must each become a problem.
    let dir = tempfile::tempdir().unwrap();
    let signer = Signer::generate();
    let keys = vec![signer.public_key().clone()];
    write(dir.path(), &signer, options(dir.path(), 1 << 20, 4), 3, 0);
    let file = files(dir.path()).unwrap()[0].clone();
    let mut lines: Vec<Value> = records(dir.path());
    let split = format!("a{}\u{1b}[2J", "é".repeat(8));
    let checkpoint = lines
        .iter()
        .position(|r| r["event"] == "checkpoint")
        .unwrap();
    lines[checkpoint]["head"] = split.clone().into();
    lines[1]["prev"] = split.into();
    lines[2]["seq"] = u64::MAX.into();
    let text: String = lines.iter().map(|r| format!("{r}\n")).collect();
    std::fs::write(&file, text).unwrap();
    let v = verify(dir.path(), "forge", &keys).unwrap();
    assert!(!v.problems.is_empty());
    for p in &v.problems {
        assert!(!p.what.contains('\u{1b}'), "{p}");
    }
    let long = format!("a{}", "é".repeat(20));
    assert_eq!(short_hash(&long), format!("a{}", "é".repeat(11)));
    assert_eq!(short_hash("0123456789abcdef"), "0123456789ab");
}

/// A caller that keeps causing records gets its budget and no more: the rest are
/// counted and the count recorded with its next record that fits; another caller's
/// records are not held back by it.
#[test]
fn a_caller_causes_at_most_its_budget_of_records() {
    let dir = tempfile::tempdir().unwrap();
    let signer = Signer::generate();
    let audit = Audit::open(options(dir.path(), 1 << 20, 4), signer);
    let denied = |who: &str| {
        Event::caused(CausedKind::Denied)
            .caller(who)
            .capability("cred")
    };
    for _ in 0..100 {
        audit.record_caused_by("mallory", denied("mallory"));
    }
    audit.record_caused_by("app", denied("app"));
    // 64 a minute: one more fits after a second.
    std::thread::sleep(Duration::from_millis(1100));
    audit.record_caused_by("mallory", denied("mallory"));
    audit.close();
    let all = records(dir.path());
    let count = |who: &str| {
        all.iter()
            .filter(|r| r["event"] == "denied" && r["caller"] == who)
            .count()
    };
    assert_eq!(count("mallory"), 65, "{all:?}");
    assert_eq!(count("app"), 1);
    let summary: Vec<&Value> = all.iter().filter(|r| r["event"] == "suppressed").collect();
    assert_eq!(summary.len(), 1, "{all:?}");
    assert_eq!(summary[0]["caller"], "mallory");
    assert_eq!(
        summary[0]["detail"],
        serde_json::json!({"event": "denied", "records": 36})
    );
}

/// The checkpoint callbacks carry (§12.3a): none before the first, the newest after it,
/// and after a restart the one the trail ends with, also when that is in the file
/// before the newest.
#[test]
fn the_latest_checkpoint_travels_and_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let signer = Signer::generate();
    let keys = vec![signer.public_key().clone()];
    let audit = Audit::open(options(dir.path(), 1 << 20, 4), signer.clone());
    assert_eq!(audit.latest_checkpoint(), None);
    audit.record_caused_by("app", Event::caused(CausedKind::Issued).need("cred/a"));
    audit.close();
    let reopened = Audit::open(options(dir.path(), 1 << 20, 4), signer.clone());
    let header = reopened.latest_checkpoint().expect("the stop's checkpoint");
    let w = Witnessed::parse(&header).unwrap();
    assert!(w.verifies("forge", &keys));
    let last = records(dir.path()).pop().unwrap();
    assert_eq!(last["event"], "checkpoint");
    assert_eq!(
        (serde_json::json!(w.count), serde_json::json!(w.head)),
        (last["count"].clone(), last["head"].clone())
    );
    reopened.close();

    // A file filled to its bound ends with a checkpoint; the next restart begins a file
    // of its own and still hands out that checkpoint.
    let small = tempfile::tempdir().unwrap();
    write(small.path(), &signer, options(small.path(), 4096, 4), 40, 0);
    let opened = Audit::open(options(small.path(), 4096, 4), signer.clone());
    let w = Witnessed::parse(&opened.latest_checkpoint().unwrap()).unwrap();
    assert!(w.verifies("forge", &keys));
    opened.close();
    assert!(verify(small.path(), "forge", &keys)
        .unwrap()
        .problems
        .is_empty());
}

/// Rounds of records on `provider`, each ended by a stop's checkpoint that the consumer
/// at `consumer` witnesses, as it would from a callback: the witnesses, oldest first.
fn witnessed_rounds(provider: &Path, consumer: &Path, signer: &Signer, rounds: usize) -> usize {
    let keys = vec![signer.public_key().clone()];
    let witness = Audit::open(options(consumer, 1 << 20, 8), Signer::generate());
    for round in 0..rounds {
        write(provider, signer, options(provider, 4096, 3), 30, round * 30);
        let opened = Audit::open(options(provider, 4096, 3), signer.clone());
        let header = opened.latest_checkpoint().expect("a checkpoint");
        witness.witness("forge", &keys, &header);
        opened.close();
    }
    witness.close();
    records(consumer)
        .iter()
        .filter(|r| r["event"] == "witnessed")
        .count()
}

/// Checkpoints witnessed long ago, their files rotated away, are proven ancestors of the
/// kept trail through the checkpoint index; a trail begun afresh above them (signed with
/// the same key, as root on the provider could) is not, with or without an index of its
/// own; and an index that goes on past the trail shows it cut short.
#[test]
fn the_index_proves_rotated_checkpoints_and_catches_a_trail_begun_afresh() {
    let (provider, consumer) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let signer = Signer::generate();
    let keys = vec![signer.public_key().clone()];
    let witnessed = witnessed_rounds(provider.path(), consumer.path(), &signer, 6);
    assert!(witnessed >= 6, "{witnessed}");
    let v = verify(provider.path(), "forge", &keys).unwrap();
    assert!(v.problems.is_empty(), "{:?}", v.problems);
    let first = v.first_seq.unwrap();
    let held = witness::hold(provider.path(), "forge", &keys, &[consumer.path().into()]).unwrap();
    assert!(held.problems.is_empty(), "{:?}", held.problems);
    assert_eq!(held.checked as usize, witnessed);
    assert!(held.predating >= 3, "rotated away: {}", held.predating);
    let index = Index::read(provider.path()).unwrap().unwrap();
    assert!(index.problems.is_empty(), "{:?}", index.problems);
    assert!(index.entries.len() >= 6 && index.entries[0].count < first);

    // Root on the provider begins the trail again above every witnessed count: one
    // record that claims its predecessors were rotated away, then the writer goes on
    // and signs checkpoints with the real key.
    let newest = records(consumer.path())
        .iter()
        .filter_map(|r| r["count"].as_u64())
        .max()
        .unwrap();
    for with_index in [false, true] {
        let fresh = tempfile::tempdir().unwrap();
        let seq = newest + 10;
        let line = format!(
            "{{\"seq\":{seq},\"at\":1,\"prev\":\"{}\",\"event\":\"start\"}}\n",
            "5e".repeat(32)
        );
        std::fs::write(fresh.path().join(writer::file_name(seq)), line).unwrap();
        if with_index {
            // An index of its own, begun afresh too (the real one would not continue).
            std::fs::write(
                fresh.path().join(INDEX_FILE),
                index_line(seq - 2, &"77".repeat(32), 1, GENESIS),
            )
            .unwrap();
        }
        write(
            fresh.path(),
            &signer,
            options(fresh.path(), 1 << 20, 3),
            5,
            0,
        );
        let alone = verify(fresh.path(), "forge", &keys).unwrap();
        assert!(
            alone.problems.is_empty(),
            "alone it verifies: {:?}",
            alone.problems
        );
        let held = witness::hold(fresh.path(), "forge", &keys, &[consumer.path().into()]).unwrap();
        assert_eq!(held.problems.len(), witnessed, "{:?}", held.problems);
        assert!(
            held.problems[0].contains("the trail was rewritten"),
            "{:?}",
            held.problems
        );
    }

    // A copy cut short, its index kept whole: the index alone shows the cut.
    let cut = tempfile::tempdir().unwrap();
    let names = files(provider.path()).unwrap();
    for name in &names[..names.len() - 1] {
        std::fs::copy(name, cut.path().join(name.file_name().unwrap())).unwrap();
    }
    std::fs::copy(
        provider.path().join(INDEX_FILE),
        cut.path().join(INDEX_FILE),
    )
    .unwrap();
    let v = verify(cut.path(), "forge", &keys).unwrap();
    assert!(
        v.problems
            .iter()
            .any(|p| p.what.contains("the trail was cut short")),
        "{:?}",
        v.problems
    );
}

/// A crash between a checkpoint's sync and its index line: the next start adds the line
/// from the checkpoint record, and the chain of the index holds.
#[test]
fn a_checkpoint_missing_from_the_index_is_added_at_the_next_start() {
    let dir = tempfile::tempdir().unwrap();
    let signer = Signer::generate();
    let keys = vec![signer.public_key().clone()];
    write(dir.path(), &signer, options(dir.path(), 1 << 20, 4), 5, 0);
    write(dir.path(), &signer, options(dir.path(), 1 << 20, 4), 5, 5);
    let index_file = dir.path().join(INDEX_FILE);
    let text = std::fs::read_to_string(&index_file).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    assert!(lines.len() >= 2, "{text}");
    lines.pop();
    // And a torn half line in its place.
    std::fs::write(&index_file, format!("{}\n{{\"count\":", lines.join("\n"))).unwrap();
    let v = verify(dir.path(), "forge", &keys).unwrap();
    assert!(v.problems.is_empty(), "{:?}", v.problems);
    assert!(
        v.notes.iter().any(|n| n.contains("not in the index yet")),
        "{:?}",
        v.notes
    );
    Audit::open(options(dir.path(), 1 << 20, 4), signer.clone()).close();
    let index = Index::read(dir.path()).unwrap().unwrap();
    assert!(
        index.problems.is_empty() && !index.torn,
        "{:?}",
        index.problems
    );
    let v = verify(dir.path(), "forge", &keys).unwrap();
    assert!(v.problems.is_empty(), "{:?}", v.problems);
    assert!(
        !v.notes.iter().any(|n| n.contains("not in the index")),
        "{:?}",
        v.notes
    );
}

/// A FIFO (or a link) named like a trail file is not the trail's: the verifier and the
/// writer pass it over instead of hanging on it or following it.
#[test]
fn a_fifo_or_link_named_like_a_trail_file_hangs_and_redirects_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let signer = Signer::generate();
    let keys = vec![signer.public_key().clone()];
    write(dir.path(), &signer, options(dir.path(), 1 << 20, 4), 3, 0);
    let fifo = dir.path().join(writer::file_name(999));
    let made = std::process::Command::new("mkfifo").arg(&fifo).status();
    if !made.is_ok_and(|s| s.success()) {
        return;
    }
    let outside = tempfile::tempdir().unwrap();
    let victim = outside.path().join("precious");
    std::fs::write(&victim, b"{\"seq\":1000,\"at\":1,\"pr").unwrap();
    std::os::unix::fs::symlink(&victim, dir.path().join(writer::file_name(1000))).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let d = dir.path().to_path_buf();
    let s = signer.clone();
    std::thread::spawn(move || {
        let v = verify(&d, "forge", &[s.public_key().clone()]).unwrap();
        Audit::open(options(&d, 1 << 20, 4), s).close();
        let _ = tx.send(v);
    });
    let v = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("a FIFO hung the verifier or the writer");
    assert!(v.problems.is_empty(), "{:?}", v.problems);
    assert_eq!(
        std::fs::read(&victim).unwrap(),
        b"{\"seq\":1000,\"at\":1,\"pr"
    );
    assert!(verify(dir.path(), "forge", &keys)
        .unwrap()
        .problems
        .is_empty());
}

/// Every kind of record a remote party can cause is budgeted per origin, by its kind: a
/// caller past the burst is held back, another caller of the same kind is not. Every kind
/// is in docs/protocol.md §12.2.
#[test]
fn every_kind_a_remote_party_can_cause_is_budgeted_per_origin() {
    let dir = tempfile::tempdir().unwrap();
    let audit = Audit::open(options(dir.path(), 64 << 20, 4), Signer::generate());
    for kind in CausedKind::ALL {
        let burst = kind.budget().burst as usize;
        assert!(burst > 0 && kind.budget().per_minute > 0, "{kind:?}");
        let mut kept = 0;
        for _ in 0..burst + 20 {
            kept += usize::from(audit.record_caused_by(
                &format!("mallory-{kind:?}"),
                Event::caused(kind).need("cred/a"),
            ));
        }
        // Refilled while the loop ran: a few at most.
        assert!(
            kept >= burst && kept < burst + 10,
            "{kind:?}: {kept} of a burst of {burst}"
        );
        assert!(audit.record_caused_by(&format!("app-{kind:?}"), Event::caused(kind)));
    }
    audit.close();
    let protocol = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/protocol.md"),
    )
    .unwrap();
    let names = CausedKind::ALL
        .iter()
        .map(|k| k.as_str())
        .chain(OwnKind::ALL.iter().map(|k| k.as_str()));
    for name in names {
        assert!(
            protocol.contains(&format!("`{name}`")),
            "{name} is not in §12.2"
        );
    }
}

/// A checkpoint chained while its file could not grow (a full disk: here a file size
/// limit, which fails a write as ENOSPC does) is written once there is room again, and
/// goes into the checkpoint index then: the trail verifies. (The limit is the process's:
/// nextest runs each test in a process of its own.)
#[test]
#[allow(unsafe_code)]
fn a_checkpoint_written_after_a_full_disk_is_indexed() {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let dir = tempfile::tempdir().unwrap();
    let signer = Signer::generate();
    let keys = vec![signer.public_key().clone()];
    let mut opts = options(dir.path(), 1 << 20, 4);
    opts.checkpoint_interval = Duration::from_millis(200);
    let audit = Audit::open(opts, signer.clone());
    let record = |i: usize| {
        audit.record_caused_by(
            "app",
            Event::caused(CausedKind::Issued)
                .consumer("app")
                .need(format!("cred/{i}"))
                .response(Some(format!("{i:064x}"))),
        );
    };
    let checkpoints = || {
        records(dir.path())
            .iter()
            .filter(|r| r["event"] == "checkpoint")
            .count()
    };
    let wait_for = |what: &dyn Fn() -> bool| {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while !what() {
            assert!(std::time::Instant::now() < deadline, "timed out");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    record(0);
    wait_for(&|| checkpoints() == 1);
    // The records after it are written; then the file may not grow, and the checkpoint
    // that covers them is chained but cannot be written.
    record(1);
    let file = files(dir.path()).unwrap()[0].clone();
    wait_for(&|| std::fs::read_to_string(&file).unwrap().contains("cred/1"));
    // SAFETY: signal(2) with SIG_IGN: a write past the limit fails with EFBIG instead
    // of killing the process.
    unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) };
    let before = getrlimit(Resource::Fsize);
    let size = std::fs::metadata(&file).unwrap().len();
    setrlimit(
        Resource::Fsize,
        Rlimit {
            current: Some(size),
            maximum: before.maximum,
        },
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(800));
    assert!(!audit.writable(), "the checkpoint could not be written");
    setrlimit(Resource::Fsize, before).unwrap();
    wait_for(&|| checkpoints() >= 2);
    audit.close();
    let v = verify(dir.path(), "forge", &keys).unwrap();
    assert!(v.problems.is_empty(), "{:?}", v.problems);
    assert!(v.checkpoints >= 3, "{}", v.checkpoints);
}
