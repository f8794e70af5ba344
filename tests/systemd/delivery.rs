//! Delivered files and the units that use them, under systemd: credentials of a
//! DynamicUser service, restarts and reloads once per change, none for an unchanged
//! redelivery, a reboot, and an agent that does not run as root.

use std::collections::BTreeMap;

use crate::fleet::{self, Lane, NEEDS, QUIET, SOON};

#[test]
fn dynamic_user_reads_its_secret_through_credential_for() {
    let Some(lane) = Lane::boot(
        "dynamic_user_reads_its_secret_through_credential_for",
        "app",
    ) else {
        return;
    };
    let app = &lane.app;
    app.wait_for_unit("wiki.service", SOON);
    assert_eq!(app.prop("wiki.service", "DynamicUser"), "yes");
    app.wait_until("wiki noted what it could read", SOON, || {
        app.exec(&["test", "-s", "/run/wiki/direct"])
            .status
            .success()
    });
    assert_eq!(app.succeed("cat /run/wiki/token"), "1 app:secret/wiki");
    let direct = app.succeed("cat /run/wiki/direct");
    assert!(
        direct.contains("Permission denied") && direct.contains("exit 1"),
        "wiki read the delivered file itself: {direct}"
    );
    assert_eq!(
        app.succeed("stat -c '%U %a' /run/fort/needs/secret/wiki/token"),
        "root 400\n"
    );
    // A new secret: wiki is restarted with it, once.
    let starts = app.starts("wiki.service");
    lane.rotate(2);
    app.wait_until("wiki holds the new token", SOON, || {
        app.exec(&["cat", "/run/wiki/token"]).stdout == b"2 app:secret/wiki"
    });
    std::thread::sleep(QUIET);
    assert_eq!(app.starts("wiki.service"), starts + 1);
}

#[test]
fn first_delivery_starts_a_credential_service_once() {
    let Some(lane) = Lane::boot("first_delivery_starts_a_credential_service_once", "app") else {
        return;
    };
    let app = &lane.app;
    app.wait_for_unit("wiki.service", SOON);
    let invocation = app.prop("wiki.service", "InvocationID");
    std::thread::sleep(QUIET);
    assert_eq!(
        app.starts("wiki.service"),
        1,
        "wiki started more than once:\n{}",
        app.journal("wiki.service", 20)
    );
    assert_eq!(app.prop("wiki.service", "InvocationID"), invocation);
}

/// Waits for the first delivery's round of restarts to be over, then counts. The round
/// ends with reloader's reload; its `systemctl` may take seconds (an unprivileged agent's
/// first call waits for polkit to start), so being satisfied and quiet is not enough.
fn settled(lane: &Lane) {
    lane.wait_satisfied();
    for unit in ["wiki.service", "multi.service", "reloader.service"] {
        lane.app.wait_for_unit(unit, SOON);
    }
    lane.app
        .wait_until("the first delivery's reload is done", SOON, || {
            let agent = lane.app.journal("fort-agent.service", 400);
            agent.contains("reloaded for changed files")
                || agent.contains("systemctl reload failed")
        });
    std::thread::sleep(QUIET);
}

#[test]
fn needs_changed_together_restart_their_unit_once() {
    let Some(lane) = Lane::boot("needs_changed_together_restart_their_unit_once", "app") else {
        return;
    };
    settled(&lane);
    let app = &lane.app;
    let (starts, invocation) = (
        app.starts("multi.service"),
        app.prop("multi.service", "InvocationID"),
    );
    // Three needs that name multi.service change in one run of forge's handler.
    lane.rotate(2);
    for n in ["secret/multi-a", "secret/multi-b", "secret/multi-c"] {
        lane.wait_token(n, 2);
    }
    std::thread::sleep(QUIET);
    assert_eq!(
        app.starts("multi.service"),
        starts + 1,
        "{}",
        app.journal("multi.service", 20)
    );
    let after = app.show(
        "multi.service",
        &["InvocationID", "NRestarts", "ActiveState"],
    );
    assert_ne!(after["InvocationID"], invocation);
    assert_eq!(
        after["NRestarts"], "0",
        "no restart of systemd's own (Restart=)"
    );
    assert_eq!(after["ActiveState"], "active");
}

#[test]
fn reload_units_are_reloaded() {
    let Some(lane) = Lane::boot("reload_units_are_reloaded", "app") else {
        return;
    };
    settled(&lane);
    let app = &lane.app;
    let (reloads, starts, pid) = (
        app.reloads("reloader.service"),
        app.starts("reloader.service"),
        app.prop("reloader.service", "MainPID"),
    );
    lane.rotate(2);
    for n in ["secret/multi-a", "secret/multi-b", "secret/multi-c"] {
        lane.wait_token(n, 2);
    }
    std::thread::sleep(QUIET);
    assert_eq!(
        app.reloads("reloader.service"),
        reloads + 1,
        "{}",
        app.journal("reloader.service", 20)
    );
    assert_eq!(
        app.starts("reloader.service"),
        starts,
        "reloaded, not restarted"
    );
    assert_eq!(app.prop("reloader.service", "MainPID"), pid);
}

#[test]
fn unchanged_redelivery_restarts_nothing() {
    let Some(lane) = Lane::boot("unchanged_redelivery_restarts_nothing", "app") else {
        return;
    };
    settled(&lane);
    let app = &lane.app;
    let counts = || {
        (
            app.starts("wiki.service"),
            app.starts("multi.service"),
            app.reloads("reloader.service"),
            app.succeed("stat -c '%n %i %Y' /run/fort/needs/secret/*/token"),
        )
    };
    let before = counts();
    let received: BTreeMap<&str, u64> = NEEDS
        .iter()
        .map(|n| (*n, fleet::need(app, n)["received"].as_u64().unwrap_or(0)))
        .collect();
    // forge's capability has triggers.initialize: at its start it calls every entry
    // back with the response it holds, unchanged.
    lane.forge.succeed("systemctl restart fort-agent.service");
    app.wait_until("every need received its payload again", SOON, || {
        NEEDS
            .iter()
            .all(|n| fleet::need(app, n)["received"].as_u64() > Some(received[n]))
    });
    std::thread::sleep(QUIET);
    assert_eq!(
        counts(),
        before,
        "an unchanged payload restarted or rewrote something"
    );
}

#[test]
fn reboot_delivers_every_file_again() {
    let Some(mut lane) = Lane::boot("reboot_delivers_every_file_again", "app") else {
        return;
    };
    settled(&lane);
    lane.app.reboot().expect("reboot app");
    let app = &lane.app;
    // /run is empty after the reboot: wiki was skipped at boot, until its file was back.
    app.wait_for_unit("fort-agent.service", SOON);
    lane.wait_satisfied();
    for n in NEEDS {
        assert_eq!(
            fleet::token(app, n).as_deref(),
            Some(format!("1 app:{n}").as_str())
        );
    }
    app.wait_for_unit("wiki.service", SOON);
    std::thread::sleep(QUIET);
    let journal = app.journal("wiki.service", 20);
    assert!(
        journal.contains("ConditionPathExists=/run/fort/needs/secret/wiki/token"),
        "wiki was not skipped at boot:\n{journal}"
    );
    assert_eq!(app.starts("wiki.service"), 1, "{journal}");
    assert_eq!(app.succeed("cat /run/wiki/token"), "1 app:secret/wiki");
}

#[test]
fn unprivileged_agent_restarts_and_reloads_only_the_units_its_needs_name() {
    let Some(lane) = Lane::boot(
        "unprivileged_agent_restarts_and_reloads_only_the_units_its_needs_name",
        "app-fort",
    ) else {
        return;
    };
    settled(&lane);
    let app = &lane.app;
    assert_eq!(app.prop("fort-agent.service", "User"), "fort");
    let counts = || {
        (
            app.starts("wiki.service"),
            app.starts("multi.service"),
            app.reloads("reloader.service"),
            app.starts("reloader.service"),
        )
    };
    let (wiki, multi, reloads, reloader) = counts();
    // Every need changes: the agent, as fort, restarts wiki (credentialFor) and multi
    // (restartUnits) and reloads reloader (reloadUnits), once each.
    lane.rotate(2);
    for n in NEEDS {
        lane.wait_token(n, 2);
    }
    std::thread::sleep(QUIET);
    let agent = app.journal("fort-agent.service", 400);
    assert_eq!(
        counts(),
        (wiki + 1, multi + 1, reloads + 1, reloader),
        "(wiki starts, multi starts, reloader reloads, reloader starts); the agent:\n{agent}"
    );
    for refused in [
        "systemctl restart failed",
        "systemctl reload failed",
        "Access denied",
    ] {
        assert!(!agent.contains(refused), "{agent}");
    }
    assert_eq!(app.succeed("cat /run/wiki/token"), "2 app:secret/wiki");
    // Nothing else: another unit, or another verb on these units, is refused to fort.
    for (verb, unit) in [
        ("restart", "other.service"),
        ("reload", "other.service"),
        ("start", "other.service"),
        ("restart", "reloader.service"),
        ("stop", "wiki.service"),
        ("kill", "multi.service"),
        ("restart", "fort-agent.service"),
    ] {
        let out = app.fail(&format!(
            "setpriv --reuid=fort --regid=fort --init-groups systemctl --no-ask-password {verb} {unit}"
        ));
        assert!(
            out.contains("Access denied") || out.contains("authentication required"),
            "fort may {verb} {unit}? {out}"
        );
    }
    assert_eq!(app.prop("other.service", "ActiveState"), "inactive");
    assert_eq!(app.prop("wiki.service", "ActiveState"), "active");
    assert_eq!(counts(), (wiki + 1, multi + 1, reloads + 1, reloader));
}
