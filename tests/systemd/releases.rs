//! A generation switch between releases under systemd: the host switched to the
//! previous release (RELEASES' last line, built by scripts/previous-release.sh) and back,
//! as `nixos-rebuild switch --rollback` and the next `switch` do it: the unit's store
//! path changes, systemd reloads its units and restarts the agent on the state the other
//! release wrote.

use fort_tests::releases::{self, Release};

use crate::fleet::{self, Lane, SOON};

/// Where the previous release's binaries sit inside the machines: a store path of its
/// own, as its generation would have it.
fn store_path(old: &Release) -> String {
    format!(
        "/nix/store/00000000000000000000000000000000-fort-{}",
        old.version
    )
}

/// Switches `m`'s agent to the fort package at `to` (fort `version`): the unit file
/// rewritten (its store path, nothing else), `daemon-reload`, and a restart of the
/// changed unit.
fn switch(m: &fort_tests::lane::Machine, from: &str, to: &str, version: &str) {
    let unit = "/etc/systemd/system/fort-agent.service";
    m.succeed(&format!(
        "sed -i 's|{from}/|{to}/|g' {unit} && systemctl daemon-reload && systemctl restart fort-agent.service"
    ));
    let exec = m.prop("fort-agent.service", "ExecStart");
    assert!(exec.contains(&format!("{to}/bin/fort-agent")), "{exec}");
    m.wait_until("the agent runs again", SOON, || {
        m.prop("fort-agent.service", "ActiveState") == "active"
    });
    let status: serde_json::Value =
        serde_json::from_str(&fleet::fort_agent(m, "app", &["status", "--json"]))
            .expect("status --json");
    assert_eq!(
        status["status"]["version"], version,
        "{}: the release running",
        m.name
    );
}

/// Every need of app satisfied with its token at `generation`; what the token files are
/// (inode and modification time, to the nanosecond: a delivery that changes a file
/// replaces it).
fn every_need_at(lane: &Lane, generation: u32) -> String {
    for n in fleet::NEEDS {
        lane.wait_token(n, generation);
        fleet::wait_need_satisfied(&lane.app, n);
    }
    lane.app
        .succeed("stat -c '%n %i %y' /run/fort/needs/secret/*/token")
}

#[test]
fn a_host_switched_to_the_previous_release_and_back_keeps_every_need() {
    const TEST: &str = "a_host_switched_to_the_previous_release_and_back_keeps_every_need";
    let old = match releases::previous() {
        Ok(r) => r,
        Err(why) => return fort_tests::skip(TEST, &why),
    };
    let old_path = store_path(&old);
    let Some(lane) = Lane::boot_trees(TEST, "forge", "app", &mut |_, forge, app| {
        for m in [forge, app] {
            for bin in ["fort-agent", "fort"] {
                m.bind_ro(&old.dir.join(bin), &format!("{old_path}/bin/{bin}"));
            }
        }
        Ok(())
    }) else {
        return;
    };
    let new_path = fleet::fort_package("app");
    lane.wait_satisfied();
    let delivered = every_need_at(&lane, 1);
    let pid = |m: &fort_tests::lane::Machine| m.prop("fort-agent.service", "MainPID");

    // Rollback: both hosts to the previous release, on the state this one wrote. Nothing
    // is asked again or delivered again; then a rotation goes through the old releases.
    for m in [&lane.forge, &lane.app] {
        let before = pid(m);
        switch(m, &new_path, &old_path, &old.version);
        assert_ne!(pid(m), before, "{}: restarted", m.name);
    }
    std::thread::sleep(fleet::QUIET);
    assert_eq!(
        every_need_at(&lane, 1),
        delivered,
        "nothing delivered again"
    );
    lane.rotate(2);
    let delivered = every_need_at(&lane, 2);

    // Forward again, the consumer first (a fleet mid-upgrade: for a moment an old
    // provider serves a new consumer), then the provider; a rotation through the new
    // releases.
    switch(&lane.app, &old_path, &new_path, fort_core::VERSION);
    switch(&lane.forge, &old_path, &new_path, fort_core::VERSION);
    std::thread::sleep(fleet::QUIET);
    assert_eq!(
        every_need_at(&lane, 2),
        delivered,
        "nothing delivered again"
    );
    lane.rotate(3);
    every_need_at(&lane, 3);
    for m in [&lane.forge, &lane.app] {
        assert_eq!(
            m.prop("fort-agent.service", "NRestarts"),
            "0",
            "{}: no crash on either release",
            m.name
        );
    }
}
