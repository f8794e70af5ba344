//! `dns-record` against real primaries: knotd and named on loopback, the handler run as the
//! agent runs it (entries on stdin, answers on stdout), and `dig` showing what a resolver
//! would see. Every scenario runs against both servers.

use std::path::{Path, PathBuf};
use std::process::Command;

use fort_tests::dns::{DnsServer, Flavor};
use serde_json::{json, Value};

const ZONE: &str = "example.test";

struct Setup {
    server: DnsServer,
    dir: tempfile::TempDir,
    config: PathBuf,
}

/// A primary of `flavor` with `records` in its zone, a hosts.json (app at 10.0.0.2, web at
/// 10.0.0.3, six at fd00::6, the principal ops) and the handler's config. `None`: skipped.
fn setup(test: &str, flavor: Flavor, records: &str) -> Option<Setup> {
    let server = match DnsServer::start(flavor, ZONE, records) {
        Ok(s) => s,
        Err(why) => {
            fort_tests::skip(&format!("{test} ({})", flavor.name()), &why);
            return None;
        }
    };
    let dir = tempfile::tempdir().unwrap();
    let key = fort_core::sign::Signer::generate().public_openssh();
    let hosts = dir.path().join("hosts.json");
    std::fs::write(
        &hosts,
        json!({
            "hosts": {
                "app": {"address": "https://10.0.0.2:7770", "keys": [key]},
                "web": {"address": "https://10.0.0.3:7770", "keys": [key]},
                "six": {"address": "https://[fd00::6]:7770", "keys": [key]}
            },
            "principals": {"ops": {"keys": [key]}}
        })
        .to_string(),
    )
    .unwrap();
    server.write_key(&dir.path().join("tsig.key"));
    let config = dir.path().join("dns-record.json");
    let setup = Setup {
        server,
        dir,
        config,
    };
    setup.write_config(|_| {});
    Some(setup)
}

impl Setup {
    fn write_config(&self, edit: impl FnOnce(&mut Value)) {
        let d = self.dir.path();
        let mut config = json!({
            "zone": ZONE,
            "primary": self.server.addr.to_string(),
            "key": {"name": self.server.key_name, "file": d.join("tsig.key")},
            "allow": {
                "app": ["*.app.example.test", "shared.example.test"],
                "web": ["shared.example.test"],
                "*": ["{origin}.example.test"]
            },
            "hosts": d.join("hosts.json"),
            "state": d.join("state/dns-record.json"),
        });
        edit(&mut config);
        std::fs::write(&self.config, config.to_string()).unwrap();
    }

    /// One handler run: (success, stdout as JSON, stderr).
    fn run(&self, trigger: &str, entries: &[(&str, Value)]) -> (bool, Value, String) {
        let input: serde_json::Map<String, Value> = entries
            .iter()
            .map(|(k, r)| (k.to_string(), json!({"request": r, "response": null})))
            .collect();
        fort_tests::run_handler(
            "dns-record",
            &self.config,
            trigger,
            &[],
            &Value::Object(input),
        )
    }

    fn state(&self) -> Value {
        let text = std::fs::read_to_string(self.dir.path().join("state/dns-record.json"))
            .unwrap_or_else(|_| "null".into());
        serde_json::from_str(&text).unwrap()
    }
}

fn check(config: &Path) -> (bool, String) {
    let out = Command::new(fort_tests::bin("fort-handler"))
        .args(["dns-record", "--check", "--config"])
        .arg(config)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn refusal(output: &Value, key: &str) -> String {
    output[key]["$fort_refused"]
        .as_str()
        .unwrap_or_else(|| panic!("{key} is not refused: {output}"))
        .to_owned()
}

/// One `#[test]` per server for each scenario.
macro_rules! on_both {
    ($($scenario:ident),* $(,)?) => {$(
        mod $scenario {
            #[test]
            fn knot() {
                super::$scenario(fort_tests::dns::Flavor::Knot, stringify!($scenario));
            }
            #[test]
            fn bind() {
                super::$scenario(fort_tests::dns::Flavor::Bind, stringify!($scenario));
            }
        }
    )*};
}

on_both!(
    records_appear_and_release_removes_only_them,
    refusals_name_the_reason_and_touch_nothing,
    a_wrong_key_is_refused_by_the_primary_and_fails_the_run,
    drift_is_restored_on_initialize_and_hand_made_records_win,
    changes_replace_only_what_fort_made,
    unchanged_entries_need_no_primary,
    one_callers_large_record_set_costs_only_its_own_entry,
    a_refused_change_keeps_the_records_in_service,
    one_caller_cannot_fill_a_shared_txt_name,
);

const HAND_MADE: &str = "manual IN A 192.0.2.1\nshared IN TXT \"admin made this\"\n";

fn records_appear_and_release_removes_only_them(flavor: Flavor, test: &str) {
    let Some(s) = setup(test, flavor, HAND_MADE) else {
        return;
    };
    // An administrator's record at a name fort will use for another type.
    s.server
        .nsupdate("update add www.app.example.test. 300 TXT \"admin at www\"");
    let hostile = r#"v=fort1 "quoted" back\slash; semi"#;
    let entries = [
        (
            "app:dns-record/www",
            json!({"name": "www.app.example.test"}),
        ),
        ("six:dns-record/v6", json!({"name": "six.example.test"})),
        (
            "app:dns-record/alias",
            json!({"name": "alias.app.example.test", "type": "CNAME", "values": ["www.app.example.test"]}),
        ),
        (
            "web:dns-record/txt",
            json!({"name": "shared.example.test", "type": "TXT", "values": [hostile]}),
        ),
        (
            "app:dns-record/txt",
            json!({"name": "Shared.Example.Test.", "type": "TXT", "values": ["app was here"], "ttl": 60}),
        ),
    ];
    let (ok, out, err) = s.run("request", &entries);
    assert!(ok, "{err}");
    assert_eq!(
        out["app:dns-record/www"],
        json!({"name": "www.app.example.test", "type": "A", "values": ["10.0.0.2"], "ttl": 300})
    );
    assert_eq!(out["six:dns-record/v6"]["values"], json!(["fd00::6"]));
    assert_eq!(out["app:dns-record/txt"]["ttl"], json!(60));
    assert!(err.contains("5 created"), "{err}");

    let dig = |name: &str, t: &str| s.server.dig(name, t);
    assert_eq!(dig("www.app.example.test", "A"), ["10.0.0.2"]);
    assert_eq!(dig("six.example.test", "AAAA"), ["fd00::6"]);
    assert_eq!(
        dig("alias.app.example.test", "CNAME"),
        ["www.app.example.test."]
    );
    assert_eq!(
        dig("shared.example.test", "TXT"),
        [
            r#""admin made this""#,
            r#""app was here""#,
            r#""v=fort1 \"quoted\" back\\slash; semi""#
        ]
    );

    // The same input again: nothing to do, the same answers.
    let (ok, again, err) = s.run("request", &entries);
    assert!(ok, "{err}");
    assert_eq!(again, out);
    assert!(err.contains("0 created, 0 changed, 0 removed"), "{err}");

    // One entry released: only its value goes, the shared name keeps the others.
    let (ok, _, err) = s.run("gc", &entries[..4]);
    assert!(ok, "{err}");
    assert_eq!(
        dig("shared.example.test", "TXT"),
        [
            r#""admin made this""#,
            r#""v=fort1 \"quoted\" back\\slash; semi""#
        ]
    );

    // Everything released: every record fort made is gone, every hand-made one stays.
    let (ok, out, err) = s.run("gc", &[]);
    assert!(ok, "{err}");
    assert_eq!(out, json!({}));
    assert!(err.contains("4 removed"), "{err}");
    assert!(dig("www.app.example.test", "A").is_empty());
    assert!(dig("six.example.test", "AAAA").is_empty());
    assert!(dig("alias.app.example.test", "CNAME").is_empty());
    assert_eq!(dig("shared.example.test", "TXT"), [r#""admin made this""#]);
    assert_eq!(dig("www.app.example.test", "TXT"), [r#""admin at www""#]);
    assert_eq!(dig("manual.example.test", "A"), ["192.0.2.1"]);
    assert_eq!(s.state()["state"]["held"], json!({}));
}

fn refusals_name_the_reason_and_touch_nothing(flavor: Flavor, test: &str) {
    let Some(s) = setup(
        test,
        flavor,
        "taken.app IN A 192.0.2.7\ncn.app IN CNAME elsewhere.test.\n",
    ) else {
        return;
    };
    let entries = [
        ("app:dns-record/ok", json!({"name": "ok.app.example.test"})),
        ("app:dns-record/theirs", json!({"name": "web.example.test"})),
        ("app:dns-record/outside", json!({"name": "app.example.org"})),
        (
            "app:dns-record/taken",
            json!({"name": "taken.app.example.test"}),
        ),
        (
            "app:dns-record/cn",
            json!({"name": "cn.app.example.test", "type": "TXT", "values": ["x"]}),
        ),
        (
            "app:dns-record/hostile",
            json!({"name": "x.app.example.test", "type": "TXT", "values": ["a\nupdate delete example.test."]}),
        ),
        (
            "app:dns-record/injection",
            json!({"name": "x.app.example.test. 0 IN A 1.2.3.4\nupdate add y"}),
        ),
        (
            "app:dns-record/twice",
            json!({"name": "ok.app.example.test", "values": ["10.9.9.9"]}),
        ),
        (
            "ops:dns-record/principal",
            json!({"name": "ops.example.test"}),
        ),
    ];
    let (ok, out, err) = s.run("request", &entries);
    assert!(ok, "{err}");
    assert_eq!(out["app:dns-record/ok"]["values"], json!(["10.0.0.2"]));
    let says = [
        ("theirs", "app may not hold records at web.example.test"),
        ("outside", "is not in the zone example.test"),
        (
            "taken",
            "taken.app.example.test already holds records that fort did not make",
        ),
        (
            "cn",
            "cn.app.example.test already holds records that fort did not make",
        ),
        ("hostile", "printable"),
        ("injection", "is not a DNS name"),
        (
            "twice",
            "ok.app.example.test A is already held for another consumer",
        ),
        ("principal", "hosts.json gives ops no IP address"),
    ];
    for (need, text) in says {
        let key = format!(
            "{}:dns-record/{need}",
            if need == "principal" { "ops" } else { "app" }
        );
        let r = refusal(&out, &key);
        assert!(r.contains(text), "{key}: {r}");
    }
    assert!(err.contains("refused app:dns-record/theirs"), "{err}");
    assert_eq!(s.server.dig("taken.app.example.test", "A"), ["192.0.2.7"]);
    assert_eq!(
        s.server.dig("cn.app.example.test", "CNAME"),
        ["elsewhere.test."]
    );
    assert!(s.server.dig("web.example.test", "A").is_empty());
    assert!(s.server.dig("x.app.example.test", "TXT").is_empty());
    assert_eq!(s.server.dig("ok.app.example.test", "A"), ["10.0.0.2"]);

    // A name taken away from the caller's allowance: its record goes, it is refused.
    s.write_config(|c| c["allow"] = json!({"app": ["other.app.example.test"]}));
    let (ok, out, err) = s.run("request", &entries[..1]);
    assert!(ok, "{err}");
    assert!(refusal(&out, "app:dns-record/ok").contains("may not hold"));
    assert!(s.server.dig("ok.app.example.test", "A").is_empty());
}

fn a_wrong_key_is_refused_by_the_primary_and_fails_the_run(flavor: Flavor, test: &str) {
    let Some(s) = setup(test, flavor, "") else {
        return;
    };
    let entries = [(
        "app:dns-record/www",
        json!({"name": "www.app.example.test"}),
    )];
    // Same name and algorithm, another secret.
    std::fs::write(
        s.dir.path().join("tsig.key"),
        "c2VjcmV0IHRoYXQgdGhlIHByaW1hcnkgZG9lcyBub3Qga25vdw==\n",
    )
    .unwrap();
    let (ok, out, err) = s.run("request", &entries);
    assert!(!ok, "{out} {err}");
    assert_eq!(out, Value::Null, "nothing is answered");
    assert!(err.contains("NOTAUTH") && err.contains("TSIG"), "{err}");
    assert!(!err.contains(&s.server.secret), "{err}");
    assert!(s.server.dig("www.app.example.test", "A").is_empty());
    assert!(s.state()["state"]["held"]
        .as_object()
        .is_none_or(|h| h.is_empty()));

    // No key file, or one without a secret: --check and the run fail before any message.
    for (content, says) in [
        (None, "cannot read the TSIG key file"),
        (Some("not a key\n"), "holds no secret"),
    ] {
        let key = s.dir.path().join("tsig.key");
        match content {
            Some(c) => std::fs::write(&key, c).unwrap(),
            None => std::fs::remove_file(&key).unwrap(),
        }
        let (ok, err) = check(&s.config);
        assert!(!ok && err.contains(says), "{err}");
        let (ok, _, err) = s.run("request", &entries);
        assert!(!ok && err.contains(says), "{err}");
    }
    s.server.write_key(&s.dir.path().join("tsig.key"));
    assert!(check(&s.config).0);
    let (ok, _, err) = s.run("request", &entries);
    assert!(ok, "{err}");
    assert_eq!(s.server.dig("www.app.example.test", "A"), ["10.0.0.2"]);
}

fn drift_is_restored_on_initialize_and_hand_made_records_win(flavor: Flavor, test: &str) {
    let Some(s) = setup(test, flavor, "") else {
        return;
    };
    let entries = [
        (
            "app:dns-record/www",
            json!({"name": "www.app.example.test"}),
        ),
        (
            "app:dns-record/txt",
            json!({"name": "t.app.example.test", "type": "TXT", "values": ["ours"]}),
        ),
    ];
    assert!(s.run("request", &entries).0);
    s.server
        .nsupdate("update delete www.app.example.test. A\nupdate delete t.app.example.test. TXT");
    // A request run trusts the state and asks the primary nothing.
    let (ok, out, err) = s.run("request", &entries);
    assert!(ok, "{err}");
    assert!(err.contains("0 checked"), "{err}");
    assert_eq!(out["app:dns-record/www"]["values"], json!(["10.0.0.2"]));
    assert!(s.server.dig("www.app.example.test", "A").is_empty());
    // An initialize run looks, and puts back what is missing.
    let (ok, _, err) = s.run("initialize", &entries);
    assert!(ok, "{err}");
    assert!(
        err.contains("2 checked at the primary, 2 restored"),
        "{err}"
    );
    assert_eq!(s.server.dig("www.app.example.test", "A"), ["10.0.0.2"]);
    assert_eq!(s.server.dig("t.app.example.test", "TXT"), [r#""ours""#]);

    // An administrator replaced the address by hand: fort gives the name up and says so.
    s.server.nsupdate(
        "update delete www.app.example.test. A\nupdate add www.app.example.test. 300 A 192.0.2.50",
    );
    let (ok, out, err) = s.run("manual", &entries);
    assert!(ok, "{err}");
    assert!(refusal(&out, "app:dns-record/www").contains("fort did not make"));
    assert_eq!(s.server.dig("www.app.example.test", "A"), ["192.0.2.50"]);
    // Released later: the administrator's record is not fort's to delete.
    assert!(s.run("gc", &[]).0);
    assert_eq!(s.server.dig("www.app.example.test", "A"), ["192.0.2.50"]);
    assert!(s.server.dig("t.app.example.test", "TXT").is_empty());
}

fn changes_replace_only_what_fort_made(flavor: Flavor, test: &str) {
    let Some(s) = setup(test, flavor, "") else {
        return;
    };
    let key = "app:dns-record/www";
    let ask = |values: &[&str], ttl: u32, name: &str| {
        let (ok, out, err) = s.run(
            "request",
            &[(key, json!({"name": name, "values": values, "ttl": ttl}))],
        );
        assert!(ok, "{err}");
        assert!(out[key]["values"].is_array(), "{out}");
    };
    ask(&["10.0.0.20", "10.0.0.21"], 60, "www.app.example.test");
    // A value an administrator adds beside fort's stays through fort's changes.
    s.server
        .nsupdate("update add www.app.example.test. 60 A 192.0.2.99");
    ask(&["10.0.0.21", "10.0.0.22"], 60, "www.app.example.test");
    assert_eq!(
        s.server.dig("www.app.example.test", "A"),
        ["10.0.0.21", "10.0.0.22", "192.0.2.99"]
    );
    ask(&["10.0.0.21", "10.0.0.22"], 120, "www.app.example.test");
    let ttls = s.server.answers("www.app.example.test", "A");
    assert!(
        ttls.iter()
            .filter(|(_, v)| v.starts_with("10."))
            .all(|(t, _)| *t == 120),
        "{ttls:?}"
    );
    // Moved to another name: the old one keeps only the administrator's value.
    ask(&["10.0.0.23"], 120, "www2.app.example.test");
    assert_eq!(s.server.dig("www.app.example.test", "A"), ["192.0.2.99"]);
    assert_eq!(s.server.dig("www2.app.example.test", "A"), ["10.0.0.23"]);
}

fn unchanged_entries_need_no_primary(flavor: Flavor, test: &str) {
    let Some(mut s) = setup(test, flavor, "") else {
        return;
    };
    let entries = [(
        "app:dns-record/www",
        json!({"name": "www.app.example.test"}),
    )];
    assert!(s.run("request", &entries).0);
    s.server.stop();
    let (ok, out, err) = s.run("request", &entries);
    assert!(ok, "{err}");
    assert_eq!(out["app:dns-record/www"]["values"], json!(["10.0.0.2"]));
    // A primary that is down fails every run that needs it; nothing is answered or
    // revoked, and what was created stays recorded.
    let more = [
        entries[0].clone(),
        (
            "app:dns-record/new",
            json!({"name": "new.app.example.test"}),
        ),
    ];
    for (trigger, input) in [
        ("request", &more[..]),
        ("initialize", &entries[..]),
        ("gc", &[][..]),
    ] {
        let (ok, out, err) = s.run(trigger, input);
        assert!(!ok && out.is_null(), "{trigger}: {out} {err}");
        assert!(err.contains("no usable answer"), "{trigger}: {err}");
    }
    assert!(s.state()["state"]["held"]["app:dns-record/www"].is_object());
}

/// A caller asks for as much record data as one entry could ever hold (16 TXT values of
/// 2,048 characters), then changes it: a change deletes the old set and adds the new one
/// in one message, which no DNS message could carry. Only that entry is refused, with the
/// real cause; the other callers are served in the same runs.
fn one_callers_large_record_set_costs_only_its_own_entry(flavor: Flavor, test: &str) {
    let Some(s) = setup(test, flavor, "") else {
        return;
    };
    let big = |tag: &str| {
        let values: Vec<String> = (0..16)
            .map(|i| format!("{tag}{i:02}{}", "k".repeat(2040)))
            .collect();
        json!({"name": "big.app.example.test", "type": "TXT", "values": values})
    };
    let attacker = "app:dns-record/big";
    let mut entries = vec![
        (attacker, big("a")),
        (
            "web:dns-record/txt",
            json!({"name": "shared.example.test", "type": "TXT", "values": ["web was here"]}),
        ),
        ("six:dns-record/v6", json!({"name": "six.example.test"})),
    ];
    let (ok, out, err) = s.run("request", &entries);
    assert!(ok, "{err}");
    assert_eq!(out["web:dns-record/txt"]["values"], json!(["web was here"]));
    assert_eq!(out["six:dns-record/v6"]["values"], json!(["fd00::6"]));

    // Changed once, and a third caller arrives in the same run.
    entries[0].1 = big("b");
    entries.push((
        "app:dns-record/www",
        json!({"name": "www.app.example.test"}),
    ));
    for _ in 0..2 {
        let (ok, out, err) = s.run("request", &entries);
        assert!(ok, "one entry failed the run: {err}");
        assert_eq!(
            out["app:dns-record/www"]["values"],
            json!(["10.0.0.2"]),
            "{out}"
        );
        assert_eq!(
            out["six:dns-record/v6"]["values"],
            json!(["fd00::6"]),
            "{out}"
        );
        assert_eq!(out["web:dns-record/txt"]["values"], json!(["web was here"]));
        let why = refusal(&out, attacker);
        assert!(why.contains("bytes") && !why.contains("TSIG"), "{why}");
    }
    assert_eq!(s.server.dig("www.app.example.test", "A"), ["10.0.0.2"]);
    assert_eq!(s.server.dig("six.example.test", "AAAA"), ["fd00::6"]);
    assert_eq!(
        s.server.dig("shared.example.test", "TXT"),
        [r#""web was here""#]
    );
    // What the attacker could never change is not left behind either.
    assert!(s.server.dig("big.app.example.test", "TXT").is_empty());
}

/// A caller renames its record to a name it may not have: refused, and the records it had
/// stay (and stay its own); the provider narrowing the allowance takes them away.
fn a_refused_change_keeps_the_records_in_service(flavor: Flavor, test: &str) {
    let Some(s) = setup(test, flavor, "") else {
        return;
    };
    let key = "app:dns-record/www";
    let (ok, _, err) = s.run("request", &[(key, json!({"name": "shared.example.test"}))]);
    assert!(ok, "{err}");
    let renamed = [
        (key, json!({"name": "www.web.example.test"})),
        // Another caller asking for the name in the same run does not get it.
        ("web:dns-record/www", json!({"name": "shared.example.test"})),
    ];
    let (ok, out, err) = s.run("request", &renamed);
    assert!(ok, "{err}");
    let why = refusal(&out, key);
    assert!(
        why.contains("may not hold records at www.web.example.test")
            && why.contains("the records it had stay in service"),
        "{why}"
    );
    assert!(refusal(&out, "web:dns-record/www").contains("already held"));
    assert_eq!(s.server.dig("shared.example.test", "A"), ["10.0.0.2"]);
    // The allowance narrowed: what it had goes.
    s.write_config(|c| c["allow"] = json!({"app": ["other.app.example.test"]}));
    let (ok, out, err) = s.run("request", &renamed[..1]);
    assert!(ok, "{err}");
    assert!(!refusal(&out, key).contains("stay in service"));
    assert!(s.server.dig("shared.example.test", "A").is_empty());
}

/// TXT values at one name are shared by every caller allowed it, and a primary holds a
/// bounded number of records of one type at a name (BIND: `max-records-per-type`, 100).
/// One caller asks for seven sets of 16 values at a name another caller uses: its entries
/// together get one set's worth, the rest are refused with the cause, and the other
/// caller's values, old and new, are served.
fn one_caller_cannot_fill_a_shared_txt_name(flavor: Flavor, test: &str) {
    let Some(s) = setup(test, flavor, "") else {
        return;
    };
    let shared = |values: Vec<String>| json!({"name": "shared.example.test", "type": "TXT", "values": values});
    let mut entries: Vec<(String, Value)> = vec![(
        "web:dns-record/txt".into(),
        shared(vec!["web was here".into()]),
    )];
    for i in 0..7 {
        let values = (0..16).map(|j| format!("app {i} {j}")).collect();
        entries.push((format!("app:dns-record/t{i}"), shared(values)));
    }
    let run = |entries: &[(String, Value)]| {
        let refs: Vec<(&str, Value)> = entries
            .iter()
            .map(|(k, v)| (k.as_str(), v.clone()))
            .collect();
        let (ok, out, err) = s.run("request", &refs);
        assert!(ok, "{err}");
        out
    };
    let out = run(&entries);
    assert_eq!(out["web:dns-record/txt"]["values"], json!(["web was here"]));
    assert_eq!(
        out["app:dns-record/t0"]["values"].as_array().unwrap().len(),
        16
    );
    for i in 1..7 {
        let why = refusal(&out, &format!("app:dns-record/t{i}"));
        assert!(why.contains("one caller holds at most 16"), "{why}");
    }
    // The other caller adds values at its name: served.
    entries.push((
        "web:dns-record/more".into(),
        shared((0..4).map(|j| format!("web more {j}")).collect()),
    ));
    let out = run(&entries);
    assert_eq!(
        out["web:dns-record/more"]["values"]
            .as_array()
            .map(Vec::len),
        Some(4),
        "{out}"
    );
    assert_eq!(s.server.dig("shared.example.test", "TXT").len(), 21);
}
