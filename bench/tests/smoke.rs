//! Every `fort-bench` command at a small size, as `scripts/test.sh` (and so CI) runs it on
//! every change: each finishes, and prints its figures and targets as one JSON object.
//! Whether a target is met is not asserted (the machine is shared and noisy); that the
//! benchmark still runs to the end and says what it measured is. A command whose server
//! is not installed says SKIP and why. `every_benchmark_is_smoke_tested` holds the help
//! text to this list, so a new benchmark is smoke-tested from its first commit.

use std::process::Command;
use std::time::{Duration, Instant};

/// A benchmark, its small-size arguments, and the programs it needs.
struct Smoke {
    name: &'static str,
    args: &'static [&'static str],
    needs: &'static [&'static str],
}

const SMOKES: &[Smoke] = &[
    Smoke {
        name: "status",
        args: &[
            "--connections",
            "4",
            "--duration",
            "1s",
            "--warmup",
            "200ms",
        ],
        needs: &[],
    },
    Smoke {
        name: "burst",
        args: &["--consumers", "2", "--needs", "5", "--timeout", "60s"],
        needs: &[],
    },
    Smoke {
        name: "failover",
        args: &[
            "--consumers",
            "3",
            "--needs",
            "1",
            "--nag",
            "2s",
            "--failover-after",
            "4s",
            "--tail",
            "2s",
            "--timeout",
            "90s",
        ],
        needs: &[],
    },
    Smoke {
        name: "fulfill-cycle",
        args: &["--needs", "20", "--iterations", "50", "--timeout", "60s"],
        needs: &[],
    },
    Smoke {
        name: "deliver",
        args: &["--needs", "10", "--units", "2", "--timeout", "60s"],
        needs: &[],
    },
    Smoke {
        name: "gc",
        args: &["--origins", "5", "--absent", "2", "--runs", "1"],
        needs: &[],
    },
    Smoke {
        name: "converge",
        args: &["--consumers", "3", "--needs", "2", "--idle", "1s"],
        needs: &[],
    },
    Smoke {
        name: "schema",
        args: &["--requests", "100", "--rounds", "1", "--connections", "4"],
        needs: &[],
    },
    Smoke {
        name: "plan",
        args: &[
            "--needs",
            "20",
            "--entries",
            "100",
            "--origins",
            "3",
            "--runs",
            "2",
        ],
        needs: &[],
    },
    Smoke {
        name: "dns-record",
        args: &[
            "--create",
            "10",
            "--unchanged",
            "100",
            "--runs",
            "2",
            "--server",
            "knot",
        ],
        needs: &["knotd", "knotc", "dig"],
    },
    Smoke {
        name: "oidc",
        args: &["--entries", "5", "--unchanged", "100", "--runs", "2"],
        needs: &["node"],
    },
    Smoke {
        name: "postgres",
        args: &[
            "--entries",
            "5",
            "--unchanged",
            "100",
            "--runs",
            "2",
            "--no-openbao",
        ],
        needs: &["psql"],
    },
    Smoke {
        name: "proxy",
        args: &["--create", "5", "--unchanged", "100", "--runs", "2"],
        needs: &["nginx"],
    },
    Smoke {
        name: "ssh-ca",
        args: &["--certs", "10", "--unchanged", "100", "--hosts", "10"],
        needs: &["ssh-keygen"],
    },
    Smoke {
        name: "at-rest",
        args: &["--unchanged", "100", "--hosts", "10", "--runs", "2"],
        needs: &[],
    },
    Smoke {
        name: "unchanged",
        args: &[
            "--entries",
            "100",
            "--runs",
            "2",
            "--only",
            "ssh-ca,postgres",
        ],
        needs: &["ssh-keygen"],
    },
    Smoke {
        name: "backup-repo",
        args: &["--create", "5", "--unchanged", "100", "--runs", "2"],
        needs: &["borg"],
    },
    Smoke {
        name: "scrape",
        args: &["--create", "5", "--unchanged", "100", "--runs", "2"],
        needs: &[],
    },
    Smoke {
        name: "mesh",
        args: &["--members", "4", "--timeout", "60s"],
        needs: &[],
    },
    // acme has a smoke run of its own in cli.rs (acme_small), with pebble and lego.
];

/// Runs one benchmark at its small size: it must finish, and print one JSON object
/// naming itself, with figures beside the load average and its targets.
fn smoke(name: &str) {
    let s = SMOKES.iter().find(|s| s.name == name).expect("in the list");
    let test = format!("smoke_{}", name.replace('-', "_"));
    for program in s.needs {
        if fort_tests::dns::find_program(program).is_none() {
            return fort_tests::skip(&test, &format!("{program} is not installed"));
        }
    }
    let started = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_fort-bench"))
        .arg("--agent-bin")
        .arg(fort_tests::bin("fort-agent"))
        .arg("--json")
        .arg(name)
        .args(s.args)
        .env("FORT_BIN_FORT_HANDLER", fort_tests::bin("fort-handler"))
        .output()
        .expect("run fort-bench");
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() && stderr.contains("not installed") {
        return fort_tests::skip(&test, stderr.trim());
    }
    assert!(
        out.status.success(),
        "fort-bench {name} failed after {:?}: {stderr}",
        started.elapsed()
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "fort-bench {name} printed no JSON object ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    });
    assert!(
        report["bench"]
            .as_str()
            .is_some_and(|b| b.starts_with(name)),
        "{report}"
    );
    let figures = report
        .as_object()
        .map(|m| {
            m.iter()
                .filter(|(k, v)| {
                    !["bench", "loadavg", "targets"].contains(&k.as_str())
                        && (v.is_number() || v.is_array() || v.is_object())
                })
                .count()
        })
        .unwrap_or(0);
    assert!(
        figures >= 2,
        "fort-bench {name} printed no figures: {report}"
    );
    assert!(
        report["targets"].is_object(),
        "fort-bench {name} printed no targets: {report}"
    );
    eprintln!("fort-bench {name}: {:?}", started.elapsed());
    assert!(
        started.elapsed() < Duration::from_secs(180),
        "a smoke run must take seconds, not minutes"
    );
}

macro_rules! smoke_tests {
    ($($test:ident => $name:literal),* $(,)?) => {
        $(
            #[test]
            fn $test() {
                smoke($name);
            }
        )*
    };
}

smoke_tests! {
    smoke_status => "status",
    smoke_burst => "burst",
    smoke_failover => "failover",
    smoke_fulfill_cycle => "fulfill-cycle",
    smoke_deliver => "deliver",
    smoke_gc => "gc",
    smoke_converge => "converge",
    smoke_schema => "schema",
    smoke_plan => "plan",
    smoke_dns_record => "dns-record",
    smoke_oidc => "oidc",
    smoke_postgres => "postgres",
    smoke_proxy => "proxy",
    smoke_ssh_ca => "ssh-ca",
    smoke_at_rest => "at-rest",
    smoke_unchanged => "unchanged",
    smoke_mesh => "mesh",
    smoke_backup_repo => "backup-repo",
    smoke_scrape => "scrape",
}

/// Every command `fort-bench --help` lists has a smoke run (acme's is in cli.rs, and
/// chaos runs for five minutes in chaos.rs).
#[test]
fn every_benchmark_is_smoke_tested() {
    let out = Command::new(env!("CARGO_BIN_EXE_fort-bench"))
        .arg("--help")
        .output()
        .expect("run fort-bench");
    let text = String::from_utf8_lossy(&out.stdout);
    let commands: Vec<&str> = text
        .split("Commands:")
        .nth(1)
        .unwrap_or_default()
        .split("Options:")
        .next()
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.strip_prefix("  "))
        .filter(|l| !l.starts_with(' '))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .collect();
    assert!(commands.len() >= 15, "{commands:?} from:\n{text}");
    for c in commands {
        assert!(
            c == "acme" || c == "chaos" || SMOKES.iter().any(|s| s.name == c),
            "fort-bench {c} has no smoke run in bench/tests/smoke.rs"
        );
    }
}
