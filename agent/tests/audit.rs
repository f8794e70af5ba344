//! The audit trail against real agents: a renewal, a refusal, a release and an operator's
//! forced rotation each leave their records on the provider and on the consumer, linked
//! by the response hash; the provider's checkpoints verify with `ssh-keygen -Y verify`
//! and stop verifying when a record is changed, removed or moved, and
//! `fort audit verify` names that record; the consumer witnesses the provider's
//! checkpoints, which then show a provider's trail cut short; a provider told the trail is required
//! issues nothing while it cannot be written.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use fort_tests::{bin, eventually, Fleet};
use serde_json::{json, Value};

/// Provider `p` serves `cred` (cacheResponse). Its handler refuses `*/bad`, issues `*/r`
/// a response that expires in 5 s (renewed with one that lasts an hour), keeps what an
/// entry holds unless asked to renew, and otherwise issues a new random secret.
fn fleet() -> Fleet {
    let mut f = Fleet::new();
    f.principal("ops");
    let handler = f.script(
        "issue",
        r#"in=$(cat)
now=$(date +%s)
r=$(od -An -N8 -tx1 /dev/urandom | tr -d ' \n')
printf '%s' "$in" | jq -c --arg r "$r" --argjson now "$now" 'with_entries(
  if (.key | endswith("/bad")) then .value = {"$fort_refused": "bad is not a credential this consumer may have"}
  elif .value.response != null and (.value.renew | not) then .value = .value.response
  elif (.key | endswith("/r")) and (.value.renew | not) then .value = {"secret": ("s-" + $r + "-" + .key), "expires_at": ($now + 5)}
  else .value = {"secret": ("s-" + $r + "-" + .key), "expires_at": ($now + 3600)} end)'"#,
    );
    f.capability(
        "p",
        "cred",
        json!({"handler": handler, "mode": "async", "cacheResponse": true}),
    );
    let sink = f.script("sink", "cat >/dev/null");
    for id in ["a", "bad", "gone"] {
        f.need(
            "c",
            &format!("cred/{id}"),
            "p",
            json!({"nag_seconds": 600, "handler": sink}),
        );
    }
    f.need(
        "c",
        "cred/r",
        "p",
        json!({"nag_seconds": 600, "renew_before_seconds": 3, "handler": sink}),
    );
    for host in ["p", "c"] {
        f.host(host).extra_toml =
            "[access]\ntrigger = [\"ops\"]\n[audit]\ncheckpoint_interval = \"1s\"\n".into();
    }
    f
}

fn audit_dir(f: &Fleet, host: &str) -> PathBuf {
    f.host_dir(host).join("state").join("audit")
}

/// Every record of `host`'s trail, oldest first.
fn records(f: &Fleet, host: &str) -> Vec<Value> {
    fort_core::audit::read_lines(&audit_dir(f, host))
        .unwrap_or_default()
        .into_iter()
        .filter_map(|l| l.record)
        .collect()
}

fn find<'a>(records: &'a [Value], event: &str, need: &str) -> Vec<&'a Value> {
    records
        .iter()
        .filter(|r| r["event"] == event && r["need"] == need)
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn renewal_refusal_release_and_rotation_leave_linked_records_on_both_sides() {
    let mut f = fleet();
    f.start();
    assert!(
        eventually(Duration::from_secs(90), || {
            ["cred/a", "cred/gone"]
                .iter()
                .all(|n| f.need_status("c", n)["state"] == "satisfied")
                && f.need_status("c", "cred/bad")["state"] == "failed"
        })
        .await,
        "{:#}",
        f.status("c")
    );

    // A renewal: cred/r's payload expires in 5 s and is renewed 3 s before.
    assert!(
        eventually(Duration::from_secs(90), || {
            !find(&records(&f, "p"), "renewed", "cred/r").is_empty()
                && find(&records(&f, "c"), "applied", "cred/r").len() >= 2
        })
        .await,
        "no renewal recorded:\n{:#?}",
        records(&f, "p")
    );
    // An operator rotates cred/a.
    let (code, out, err) = f.fort(
        "ops",
        "p",
        &["trigger", "p", "cred", "--entry", "c:cred/a", "--force"],
    );
    assert_eq!(code, 0, "{out}{err}");
    // A release: c no longer declares cred/gone.
    let needs_path = f.host_dir("c").join("needs.json");
    let mut needs: Value = serde_json::from_slice(&std::fs::read(&needs_path).unwrap()).unwrap();
    needs.as_object_mut().unwrap().remove("cred/gone");
    std::fs::write(&needs_path, serde_json::to_vec(&needs).unwrap()).unwrap();
    f.agents["c"].hup();
    assert!(
        eventually(Duration::from_secs(90), || {
            !find(&records(&f, "p"), "released", "cred/gone").is_empty()
                && !find(&records(&f, "c"), "released", "cred/gone").is_empty()
                && find(&records(&f, "c"), "applied", "cred/a").len() >= 2
        })
        .await,
        "p:\n{:#?}\nc:\n{:#?}",
        records(&f, "p"),
        records(&f, "c")
    );
    f.stop("c");
    f.stop("p");
    let (p, c) = (records(&f, "p"), records(&f, "c"));

    // Renewal: the provider's renewed response is the one the consumer applied, and the
    // consumer asked to renew.
    let renewed = find(&p, "renewed", "cred/r")[0];
    assert_eq!(renewed["consumer"], "c");
    assert!(renewed["previous"].is_string() && renewed["previous"] != renewed["response"]);
    assert!(renewed["expires_at"].as_u64().unwrap() > renewed["at"].as_u64().unwrap() + 3000);
    let applied: Vec<_> = find(&c, "applied", "cred/r")
        .into_iter()
        .filter(|r| r["response"] == renewed["response"])
        .collect();
    assert_eq!(applied.len(), 1, "{c:#?}");
    assert_eq!(applied[0]["provider"], "p");
    assert_eq!(applied[0]["previous"], renewed["previous"]);
    assert!(find(&p, "accepted", "cred/r")
        .iter()
        .any(|r| r["detail"]["renew"] == true && r["caller"] == "c" && r["request"].is_string()));
    assert!(find(&p, "delivered", "cred/r")
        .iter()
        .any(|r| r["response"] == renewed["response"]));

    // Refusal: with its reason on both sides.
    let refused = find(&p, "refused", "cred/bad");
    assert!(refused[0]["reason"]
        .as_str()
        .unwrap()
        .contains("bad is not a credential"));
    let told = find(&c, "refused", "cred/bad");
    assert_eq!(told[0]["provider"], "p");
    assert!(told[0]["reason"]
        .as_str()
        .unwrap()
        .contains("refused by p: bad is not"));

    // The operator's rotation: who asked, with which key, and the response it issued is
    // the one the consumer applied.
    let call = p
        .iter()
        .find(|r| r["event"] == "operator" && r["detail"]["call"] == "trigger")
        .expect("the trigger is recorded");
    assert_eq!(call["caller"], "ops");
    assert_eq!(call["status"], 200);
    assert_eq!(call["detail"]["params"]["entry"], "c:cred/a");
    let ops_key = fort_core::audit::fingerprint(f.principals["ops"].public_key());
    assert_eq!(call["key"], json!(ops_key));
    let rotated = find(&p, "issued", "cred/a")
        .into_iter()
        .find(|r| r["detail"]["trigger"] == "manual")
        .expect("the forced run issued cred/a");
    assert_eq!(rotated["detail"]["force"], true);
    assert!(rotated["seq"].as_u64() > call["seq"].as_u64().map(|s| s.saturating_sub(50)));
    let first = find(&p, "issued", "cred/a")[0];
    assert_eq!(rotated["previous"], first["response"]);
    assert!(find(&c, "applied", "cred/a")
        .iter()
        .any(|r| r["response"] == rotated["response"] && r["previous"] == first["response"]));

    // Release: both sides, and the provider names the response the entry held.
    let released = find(&p, "released", "cred/gone")[0];
    assert_eq!(released["caller"], "c");
    let held = find(&p, "issued", "cred/gone")[0]["response"].clone();
    assert_eq!(released["previous"], held);
    assert!(find(&c, "applied", "cred/gone")
        .iter()
        .any(|r| r["response"] == held));
    assert_eq!(find(&c, "released", "cred/gone")[0]["provider"], "p");

    // Start, stop and a final checkpoint on each; nothing of a payload in either trail.
    for (host, recs) in [("p", &p), ("c", &c)] {
        assert_eq!(recs[0]["event"], "start", "{host}");
        assert_eq!(recs[0]["prev"], fort_core::audit::GENESIS);
        let n = recs.len();
        assert_eq!(recs[n - 2]["event"], "stop", "{host}");
        assert_eq!(recs[n - 1]["event"], "checkpoint", "{host}");
        let text = std::fs::read_to_string(
            fort_core::audit::files(&audit_dir(&f, host)).unwrap()[0].clone(),
        )
        .unwrap();
        assert!(!text.contains("\"s-"), "a secret in {host}'s trail");
    }

    // The whole trail verifies, and so does every checkpoint with ssh-keygen alone.
    let (ok, out) = f.admin("p", &["audit", "verify"]);
    assert!(ok, "{out}");
    assert!(out.starts_with("ok: "), "{out}");
    let file = fort_core::audit::files(&audit_dir(&f, "p")).unwrap()[0].clone();
    let key = f.hosts["p"].signer.public_openssh();
    let checkpoints = checkpoint_lines(&file);
    assert!(checkpoints.len() >= 2, "{checkpoints:?}");
    for line in &checkpoints {
        assert!(
            ssh_keygen_accepts(&file, *line, &key),
            "checkpoint at line {line}"
        );
    }
    witnesses_catch_a_trail_cut_short(&f, &c);
    tampering_is_caught(&f, &file, &key);
}

/// The consumer witnessed the provider's checkpoints through its callbacks; held against
/// them, the provider's trail verifies as it is and fails once cut short after one, a
/// cut that the trail alone does not show.
fn witnesses_catch_a_trail_cut_short(f: &Fleet, c: &[Value]) {
    let witnessed: Vec<&Value> = c.iter().filter(|r| r["event"] == "witnessed").collect();
    assert!(
        !witnessed.is_empty(),
        "c witnessed no checkpoint of p:\n{c:#?}"
    );
    assert!(witnessed.iter().all(|r| r["provider"] == "p"));
    let pairs: Vec<_> = witnessed
        .iter()
        .map(|r| (&r["count"], &r["head"]))
        .collect();
    let mut unique = pairs.clone();
    unique.dedup();
    assert_eq!(
        unique.len(),
        pairs.len(),
        "one record per checkpoint: {pairs:?}"
    );
    let verify = |dir: &Path| {
        let out = Command::new(bin("fort"))
            .arg("--hosts")
            .arg(f.host_dir("c").join("hosts.json"))
            .args(["audit", "verify"])
            .arg(dir)
            .args(["--signer", "p", "--json", "--witnesses"])
            .arg(audit_dir(f, "c"))
            .output()
            .unwrap();
        let v: Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|_| panic!("{}", String::from_utf8_lossy(&out.stderr)));
        (out.status.success(), v)
    };
    let (ok, v) = verify(&audit_dir(f, "p"));
    assert!(ok, "{v:#}");
    assert_eq!(v["witnessed"]["checked"], witnessed.len(), "{v:#}");

    // A copy holding a witness p never signed is that copy's fault, not p's.
    let forged = tempfile::tempdir().unwrap();
    for file in fort_core::audit::files(&audit_dir(f, "c")).unwrap() {
        std::fs::copy(&file, forged.path().join(file.file_name().unwrap())).unwrap();
    }
    let last_file = fort_core::audit::files(forged.path())
        .unwrap()
        .pop()
        .unwrap();
    let mut text = std::fs::read_to_string(&last_file).unwrap();
    let mut fake = witnessed[0].clone();
    fake["count"] = json!(999_999);
    text.push_str(&format!("{fake}\n"));
    std::fs::write(&last_file, text).unwrap();
    let out = Command::new(bin("fort"))
        .arg("--hosts")
        .arg(f.host_dir("c").join("hosts.json"))
        .args(["audit", "verify"])
        .arg(audit_dir(f, "p"))
        .args(["--signer", "p", "--json", "--witnesses"])
        .arg(forged.path())
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(out.status.success(), "{v:#}");
    assert_eq!(
        v["witnessed"]["unverified"].as_array().unwrap().len(),
        1,
        "{v:#}"
    );

    // Cut short just before the last checkpoint c witnessed: alone it still verifies.
    let last = witnessed.last().unwrap()["count"].as_u64().unwrap();
    let cut = tempfile::tempdir().unwrap();
    let file = fort_core::audit::files(&audit_dir(f, "p")).unwrap()[0].clone();
    let kept: String = std::fs::read_to_string(&file)
        .unwrap()
        .lines()
        .take(last as usize - 1)
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(cut.path().join(file.file_name().unwrap()), kept).unwrap();
    // The checkpoint index cut the same way: the index alone would show the cut.
    let index: String = std::fs::read_to_string(audit_dir(f, "p").join("checkpoints.jsonl"))
        .unwrap()
        .lines()
        .filter(|l| serde_json::from_str::<Value>(l).unwrap()["count"].as_u64() < Some(last - 2))
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(cut.path().join("checkpoints.jsonl"), index).unwrap();
    let alone =
        fort_core::audit::verify(cut.path(), "p", &[f.hosts["p"].signer.public_key().clone()])
            .unwrap();
    assert!(alone.problems.is_empty(), "{:?}", alone.problems);
    let (ok, v) = verify(cut.path());
    assert!(!ok, "{v:#}");
    let problems = v["witnessed"]["problems"].to_string();
    assert!(problems.contains("the trail was cut short"), "{v:#}");
    assert!(problems.contains(&format!("signed record {last}")), "{v:#}");
}

fn checkpoint_lines(file: &Path) -> Vec<usize> {
    std::fs::read_to_string(file)
        .unwrap()
        .lines()
        .enumerate()
        .filter(|(_, l)| l.contains("\"event\":\"checkpoint\""))
        .map(|(i, _)| i + 1)
        .collect()
}

/// scripts/audit-checkpoint.sh, which the protocol document shows: ssh-keygen only.
fn ssh_keygen_accepts(file: &Path, line: usize, key: &str) -> bool {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/audit-checkpoint.sh");
    let out = Command::new("sh")
        .arg(script)
        .arg(file)
        .arg(line.to_string())
        .arg("p")
        .arg(key)
        .output()
        .unwrap();
    out.status.success()
}

/// A copy of the trail with its lines changed by `edit`, verified by ssh-keygen (the
/// last checkpoint) and by `fort audit verify`: (ssh-keygen accepted, verify's JSON).
fn tampered(
    f: &Fleet,
    file: &Path,
    key: &str,
    name: &str,
    edit: impl FnOnce(&mut Vec<String>),
) -> (bool, Value) {
    let dir = f.dir.path().join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let mut lines: Vec<String> = std::fs::read_to_string(file)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect();
    edit(&mut lines);
    let copy = dir.join(file.file_name().unwrap());
    std::fs::write(&copy, lines.join("\n") + "\n").unwrap();
    // An operator's copy is of the whole directory: the checkpoint index with it.
    let index = file.parent().unwrap().join("checkpoints.jsonl");
    std::fs::copy(&index, dir.join("checkpoints.jsonl")).unwrap();
    let last = *checkpoint_lines(&copy).last().unwrap();
    let accepted = ssh_keygen_accepts(&copy, last, key);
    // As an operator checks a copy with nothing but the fleet's hosts.json.
    let out = Command::new(bin("fort"))
        .args(["audit", "verify", "--json", "--signer", "p"])
        .arg(&dir)
        .arg("--hosts")
        .arg(f.host_dir("p").join("hosts.json"))
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    (accepted, serde_json::from_slice(&out.stdout).unwrap())
}

fn tampering_is_caught(f: &Fleet, file: &Path, key: &str) {
    let lines: Vec<String> = std::fs::read_to_string(file)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect();
    // A record well before the last checkpoint, and not one itself.
    let k = (3..lines.len())
        .find(|i| lines[*i].contains("\"event\":\"issued\""))
        .expect("an issued record");
    let seq = k as u64 + 1;

    // Changed: the response it names.
    let (accepted, v) = tampered(f, file, key, "edited", |l| {
        l[k] = l[k].replacen("\"response\":\"", "\"response\":\"0", 1);
    });
    assert!(!accepted, "ssh-keygen accepted an edited record");
    assert_eq!(v["first_bad"]["seq"], seq, "{v:#}");
    assert_eq!(v["first_bad"]["line"], k + 1, "{v:#}");
    assert!(
        v["first_bad"]["problem"]
            .as_str()
            .unwrap()
            .contains("changed"),
        "{v:#}"
    );

    // Removed.
    let (accepted, v) = tampered(f, file, key, "removed", |l| {
        l.remove(k);
    });
    assert!(
        !accepted,
        "ssh-keygen accepted a trail with a record removed"
    );
    let problem = v["first_bad"]["problem"].as_str().unwrap();
    assert!(
        problem.contains(&format!("record {seq} is missing")),
        "{v:#}"
    );

    // Moved: two records swapped.
    let (accepted, v) = tampered(f, file, key, "reordered", |l| l.swap(k, k + 1));
    assert!(
        !accepted,
        "ssh-keygen accepted a trail with records out of order"
    );
    let problem = v["first_bad"]["problem"].as_str().unwrap();
    assert!(problem.contains("out of order"), "{v:#}");
    assert_eq!(v["first_bad"]["line"], k + 1, "{v:#}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_provider_that_requires_its_trail_issues_nothing_while_it_cannot_be_written() {
    let mut f = Fleet::new();
    f.principal("ops");
    let handler = f.script("issue", r#"jq -c 'with_entries(.value = {"n": .key})'"#);
    f.capability(
        "p",
        "cred",
        json!({"handler": handler, "mode": "async", "allowed": ["ops"]}),
    );
    f.host("p").extra_toml = "[audit]\nrequired = true\n".into();
    f.start();
    let ask = |id: &str| json!({"need": format!("cred/{id}"), "request": {}});
    let r = f
        .post("ops", "p", "/agent/capabilities/cred", &ask("one"))
        .await;
    assert_eq!(r.status, 202);

    let dir = audit_dir(&f, "p");
    let away = f.dir.path().join("audit-away");
    std::fs::rename(&dir, &away).unwrap();
    assert_eq!(
        answered_with(&f, &ask("two"), 503).await,
        503,
        "requests are still accepted"
    );
    let r = f
        .post("ops", "p", "/agent/capabilities/cred", &ask("two"))
        .await;
    assert!(
        String::from_utf8_lossy(&r.body).contains("audit trail"),
        "{:?}",
        r.body
    );

    std::fs::rename(&away, &dir).unwrap();
    assert_eq!(
        answered_with(&f, &ask("two"), 202).await,
        202,
        "the provider does not issue again"
    );
    assert!(
        eventually(Duration::from_secs(60), || f
            .entries("p")
            .contains(&"ops:cred/two".to_owned()))
        .await
    );
    f.stop("p");
    let recs = records(&f, "p");
    assert!(recs
        .iter()
        .any(|r| r["event"] == "accepted" && r["need"] == "cred/two"));
    let (ok, out) = f.admin("p", &["audit", "verify"]);
    assert!(ok, "{out}");
}

/// Asks `p` for `body` until it answers `want` (within a minute, however loaded the
/// machine); the last status it answered.
async fn answered_with(f: &Fleet, body: &Value, want: u16) -> u16 {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let status = f
            .post("ops", "p", "/agent/capabilities/cred", body)
            .await
            .status;
        if status == want || std::time::Instant::now() > deadline {
            return status;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every record also reaches a real syslog server (rsyslogd), over TCP from the provider
/// and UDP from the consumer, as the line its trail holds; while the server is down the
/// trail goes on, and the copy resumes once it is back.
#[tokio::test(flavor = "multi_thread")]
async fn records_reach_a_remote_syslog_server_over_tcp_and_udp() {
    let test = "records_reach_a_remote_syslog_server_over_tcp_and_udp";
    let mut server = match fort_tests::syslog::SyslogServer::start() {
        Ok(s) => s,
        Err(why) => return fort_tests::skip(test, &why),
    };
    let mut f = fleet();
    let metrics_addr = fort_tests::free_addr("127.0.0.1");
    for (host, to, metrics) in [
        (
            "p",
            format!("tcp://{}", server.tcp),
            format!("metrics_listen = \"{metrics_addr}\"\n"),
        ),
        ("c", format!("udp://{}", server.udp), String::new()),
    ] {
        f.host(host).extra_toml =
            format!("{metrics}[access]\ntrigger = [\"ops\"]\n[audit]\nsyslog = \"{to}\"\n");
    }
    f.start();
    let copied = |server: &fort_tests::syslog::SyslogServer, host: &str, event: &str| {
        server.lines().iter().any(|l| {
            l.starts_with(&format!("{host} fort-agent audit authpriv {{"))
                && l.contains(&format!("\"event\":\"{event}\""))
        })
    };
    assert!(
        eventually(Duration::from_secs(60), || copied(&server, "p", "issued")
            && copied(&server, "c", "applied"))
        .await,
        "{:#?}",
        server.lines()
    );
    // Every record of the provider's trail so far, in its order, is a message.
    let messages: Vec<String> = server
        .lines()
        .iter()
        .filter_map(|l| {
            l.strip_prefix("p fort-agent audit authpriv ")
                .map(str::to_owned)
        })
        .collect();
    let trail: Vec<String> = fort_core::audit::read_lines(&audit_dir(&f, "p"))
        .unwrap()
        .into_iter()
        .map(|l| String::from_utf8(l.bytes).unwrap())
        .collect();
    assert!(messages.len() >= 3, "{messages:#?}");
    assert_eq!(
        messages[..],
        trail[..messages.len()],
        "the copy is the trail"
    );

    // The server goes away: the trail goes on; back, the copy resumes.
    server.stop();
    let rotate = || {
        let (code, out, err) = f.fort(
            "ops",
            "p",
            &["trigger", "p", "cred", "--entry", "c:cred/a", "--force"],
        );
        assert_eq!(code, 0, "{out}{err}");
    };
    let issued = |recs: &[Value]| find(recs, "issued", "cred/a").len();
    let before = issued(&records(&f, "p"));
    rotate();
    assert!(
        eventually(Duration::from_secs(30), || issued(&records(&f, "p"))
            > before)
        .await,
        "the provider stopped issuing with its syslog server gone"
    );
    server.restart().expect("rsyslogd again");
    let last_seq = |lines: Vec<String>| {
        lines
            .iter()
            .filter_map(|l| l.strip_prefix("p fort-agent audit authpriv "))
            .filter_map(|m| serde_json::from_str::<Value>(m).ok())
            .filter_map(|v| v["seq"].as_u64())
            .max()
            .unwrap_or(0)
    };
    let copied_before = last_seq(server.lines());
    let trail_now = records(&f, "p").len() as u64;
    // Records keep coming (the consumer asks again, checkpoints): the copy catches up
    // past what was written while the server was down.
    assert!(
        eventually(Duration::from_secs(60), || {
            rotate();
            last_seq(server.lines()) > trail_now.max(copied_before)
        })
        .await,
        "the copy did not resume: {:#?}",
        server.lines()
    );
    // What was not copied while the server was down is counted where operators look.
    let scraped = fort_tests::metrics(metrics_addr);
    let series = |name: &str| {
        scraped
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .and_then(|v| v.parse::<f64>().ok())
    };
    assert!(
        series("fort_audit_syslog_not_copied").is_some_and(|n| n >= 1.0),
        "{scraped}"
    );
    assert_eq!(series("fort_audit_writable"), Some(1.0), "{scraped}");
    assert!(series("fort_audit_records").is_some_and(|n| n >= trail_now as f64));
    // A stop: its last records are sent before the agent exits.
    f.stop("p");
    assert!(
        eventually(Duration::from_secs(10), || copied(&server, "p", "stop")).await,
        "the stop record was not copied: {:#?}",
        server.lines()
    );
}
