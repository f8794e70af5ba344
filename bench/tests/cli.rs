//! fort-bench's command line: every benchmark is listed. (Being an integration test of
//! this package, it also makes `cargo test --workspace` build the `fort-bench` binary,
//! whose help texts tests/help.rs reads.)

use std::process::Command;

#[test]
fn help_lists_every_benchmark() {
    let out = Command::new(env!("CARGO_BIN_EXE_fort-bench"))
        .arg("--help")
        .output()
        .expect("run fort-bench");
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for command in [
        "status",
        "burst",
        "fulfill-cycle",
        "deliver",
        "gc",
        "converge",
        "schema",
        "plan",
        "dns-record",
        "postgres",
        "ssh-ca",
    ] {
        assert!(
            text.lines()
                .any(|l| l.trim_start().starts_with(&format!("{command} "))),
            "{command} missing from:\n{text}"
        );
    }
}
