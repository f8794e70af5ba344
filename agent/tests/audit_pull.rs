//! The fleet's trails in one place, against real agents: an operator granted `[access]
//! audit` pulls a provider's and a consumer's trails (the consumer holding checkpoints
//! it witnessed), `fort audit verify --fleet` checks them together, a second pull fetches
//! only what is new, a host without the grant refuses naming the setting while the others
//! are still pulled, a file name that is not the trail's is refused, and a provider trail
//! rewritten on disk after a pull is reported, recorded, and fails the fleet's check
//! while the copy stays as it was pulled.

use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use fort_tests::{bin, eventually, Fleet};
use serde_json::{json, Value};

/// Provider `p` serves `cred` to consumer `c`; `n` serves nothing. `ops` may pull `p`'s
/// and `c`'s trails, not `n`'s.
fn fleet() -> Fleet {
    let mut f = Fleet::new();
    f.principal("ops");
    let handler = f.script(
        "issue",
        r#"r=$(od -An -N8 -tx1 /dev/urandom | tr -d ' \n')
jq -c --arg r "$r" 'with_entries(.value = {"secret": ("s-" + $r)})'"#,
    );
    f.capability(
        "p",
        "cred",
        json!({"handler": handler, "mode": "async", "cacheResponse": true}),
    );
    let sink = f.script("sink", "cat >/dev/null");
    f.need(
        "c",
        "cred/a",
        "p",
        json!({"nag_seconds": 600, "handler": sink}),
    );
    for host in ["p", "c"] {
        f.host(host).extra_toml = "[access]\ntrigger = [\"ops\"]\naudit = [\"ops\"]\n[audit]\ncheckpoint_interval = \"1s\"\n".into();
    }
    f.host("n").extra_toml = "[access]\njournal = [\"ops\"]\n".into();
    f
}

fn audit_dir(f: &Fleet, host: &str) -> PathBuf {
    f.host_dir(host).join("state").join("audit")
}

fn records(dir: &Path) -> Vec<Value> {
    fort_core::audit::read_lines(dir)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|l| l.record)
        .collect()
}

/// `fort audit verify --fleet DIR --json`: (exit code, document, stdout of the text form).
fn verify_fleet(f: &Fleet, dir: &Path) -> (i32, Value, String) {
    let run = |json: bool| {
        let mut cmd = Command::new(bin("fort"));
        cmd.arg("--hosts")
            .arg(f.host_dir("c").join("hosts.json"))
            .args(["audit", "verify", "--fleet"])
            .arg(dir);
        if json {
            cmd.arg("--json");
        }
        cmd.output().expect("run fort")
    };
    let doc = run(true);
    let text = run(false);
    assert_eq!(doc.status.code(), text.status.code());
    (
        doc.status.code().unwrap_or(-1),
        serde_json::from_slice(&doc.stdout).unwrap_or(Value::Null),
        String::from_utf8_lossy(&text.stdout).into_owned(),
    )
}

/// The bytes `fort audit pull` says it fetched of `host`.
fn fetched(out: &str, host: &str) -> u64 {
    out.lines()
        .find_map(|l| l.strip_prefix(&format!("{host}: fetched ")))
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no line for {host} in:\n{out}"))
}

fn copy_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
        .map(|e| e.metadata().unwrap().len())
        .sum()
}

#[tokio::test(flavor = "multi_thread")]
async fn an_operator_pulls_the_fleets_trails_and_verifies_them_together() {
    let mut f = fleet();
    f.start();
    assert!(
        eventually(Duration::from_secs(90), || f.need_status("c", "cred/a")
            ["state"]
            == "satisfied")
        .await,
        "{:#}",
        f.status("c")
    );
    // Once p has signed a checkpoint, a rotation's callback carries it to c.
    assert!(
        eventually(Duration::from_secs(30), || records(&audit_dir(&f, "p"))
            .iter()
            .any(|r| r["event"] == "checkpoint"))
        .await
    );
    let (code, out, err) = f.fort(
        "ops",
        "p",
        &["trigger", "p", "cred", "--entry", "c:cred/a", "--force"],
    );
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        eventually(Duration::from_secs(30), || records(&audit_dir(&f, "c"))
            .iter()
            .any(|r| r["event"] == "witnessed" && r["provider"] == "p"))
        .await,
        "c witnessed no checkpoint of p"
    );
    // Some bulk in p's trail, so that fetching it all again would show.
    for _ in 0..60 {
        let (code, out, err) = f.fort("ops", "p", &["call", "p", "status", "{\"entries\":true}"]);
        assert_eq!(code, 0, "{out}{err}");
    }

    // The first pull: p and c are copied; n refuses, naming the setting, and the pull
    // fails naming n.
    let trails = tempfile::tempdir().unwrap();
    let out_dir = trails.path().to_str().unwrap();
    let (code, out, err) = f.fort(
        "ops",
        "c",
        &["audit", "pull", "p", "n", "c", "--out", out_dir],
    );
    assert_eq!(code, 1, "{out}{err}");
    assert!(err.contains("failed for n"), "{err}");
    let n_line = out.lines().find(|l| l.starts_with("n: ")).unwrap_or("");
    assert!(
        n_line.contains("FAILED: HTTP 403") && n_line.contains("[access] audit"),
        "{out}"
    );
    assert!(!trails.path().join("n").exists());
    let first_p = fetched(&out, "p");
    assert!(first_p > 5_000, "{out}");
    assert!(fetched(&out, "c") > 0, "{out}");
    assert!(trails.path().join("p/checkpoints.jsonl").is_file());
    assert!(trails.path().join("c/0000000000000001.jsonl").is_file());

    // Together: each copy is its host's, and p's holds what c witnessed of it.
    let (code, doc, text) = verify_fleet(&f, trails.path());
    assert_eq!(code, 0, "{text}\n{doc:#}");
    assert!(text.lines().any(|l| l.starts_with("ok      p: ")), "{text}");
    assert!(text.lines().any(|l| l.starts_with("ok      c: ")), "{text}");
    let p_doc = doc["hosts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|h| h["host"] == "p")
        .unwrap();
    assert!(p_doc["witnessed"]["checked"].as_u64() >= Some(1), "{doc:#}");

    // The second pull fetches what was added since (the first pull's own operator
    // records and checkpoints), not the trail again.
    let before = copy_bytes(&trails.path().join("p"));
    let (code, out, err) = f.fort("ops", "c", &["audit", "pull", "p", "c", "--out", out_dir]);
    assert_eq!(code, 0, "{out}{err}");
    let second_p = fetched(&out, "p");
    let after = copy_bytes(&trails.path().join("p"));
    assert_eq!(after - before, second_p, "{out}");
    assert!(second_p * 2 < first_p, "{second_p} of {first_p}: {out}");
    assert!(out.contains("(0 new)"), "{out}");
    let (code, _, text) = verify_fleet(&f, trails.path());
    assert_eq!(code, 0, "{text}");

    // Names that are not the trail's are refused before anything is read.
    for (body, says) in [
        (json!({"file": "../x"}), "is not a file of the audit trail"),
        (
            json!({"file": "/etc/passwd"}),
            "is not a file of the audit trail",
        ),
        (
            json!({"file": "0000000000000001.jsonl", "offset": u64::MAX}),
            "is beyond the end of 0000000000000001.jsonl",
        ),
    ] {
        let reply = f.post("ops", "p", "/agent/capabilities/audit", &body).await;
        let text = String::from_utf8_lossy(&reply.body);
        assert_eq!(reply.status, 400, "{body}: {text}");
        assert!(text.contains(says), "{body}: {text}");
    }
    // A host is never granted it, listed or not.
    let reply = f
        .post("c", "p", "/agent/capabilities/audit", &json!({}))
        .await;
    assert_eq!(reply.status, 403);

    // p's first file rewritten in place (one digit of its first record's time): the next
    // pull reports it and leaves the copy as it was; the fleet's check fails naming p.
    let file = audit_dir(&f, "p").join("0000000000000001.jsonl");
    let text = std::fs::read_to_string(&file).unwrap();
    let at = text.find("\"at\":").unwrap() + 5;
    let digit = text.as_bytes()[at];
    let other = if digit == b'1' { b'2' } else { b'1' };
    let mut handle = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
    handle.seek(SeekFrom::Start(at as u64)).unwrap();
    handle.write_all(&[other]).unwrap();
    drop(handle);
    let copy = trails.path().join("p/0000000000000001.jsonl");
    let kept = std::fs::read(&copy).unwrap();
    let (code, out, err) = f.fort("ops", "c", &["audit", "pull", "p", "c", "--out", out_dir]);
    assert_eq!(code, 1, "{out}{err}");
    let p_line = out.lines().find(|l| l.starts_with("p: ")).unwrap_or("");
    assert!(
        p_line.contains("FAILED")
            && p_line.contains("0000000000000001.jsonl")
            && p_line.contains("rewritten or cut short"),
        "{out}"
    );
    assert!(out.lines().any(|l| l.starts_with("c: fetched")), "{out}");
    assert!(err.contains("failed for p"), "{err}");
    assert_eq!(std::fs::read(&copy).unwrap(), kept, "the copy was changed");
    let (code, doc, text) = verify_fleet(&f, trails.path());
    assert_eq!(code, 1, "{text}");
    let broken = text
        .lines()
        .find(|l| l.starts_with("BROKEN  p: "))
        .unwrap_or("");
    assert!(broken.contains("rewritten or cut short"), "{text}");
    assert!(text.lines().any(|l| l.starts_with("ok      c: ")), "{text}");
    assert_eq!(doc["ok"], false);
    // The rewritten trail itself no longer verifies on p either.
    let (ok, _) = f.admin("p", &["audit", "verify"]);
    assert!(!ok);
}
