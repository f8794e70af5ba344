//! The agent as a systemd service: readiness, its key, reload, kill -9, the strict
//! sandbox, triggers and dry-activate.

use crate::fleet::{self, Lane, SOON};

#[test]
fn type_notify_readiness() {
    let Some(lane) = Lane::boot("type_notify_readiness", "app") else {
        return;
    };
    let app = &lane.app;
    let props = app.show(
        "fort-agent.service",
        &["Type", "NotifyAccess", "ActiveState", "SubState"],
    );
    assert_eq!(props["Type"], "notify");
    assert_eq!(props["NotifyAccess"], "main");
    assert_eq!(props["ActiveState"], "active");
    assert_eq!(props["SubState"], "running");
    // `systemctl restart` returns when the start job is done, which for Type=notify is
    // READY=1: the agent must answer on its admin socket at once, without a retry.
    for _ in 0..3 {
        app.succeed("systemctl restart fort-agent.service");
        let status = fleet::status(app);
        assert!(
            status["needs"]["total"].as_u64().is_some(),
            "the agent did not answer right after systemd saw it ready: {status}"
        );
    }
}

#[test]
fn host_key_through_load_credential() {
    let Some(lane) = Lane::boot("host_key_through_load_credential", "app-fort") else {
        return;
    };
    let app = &lane.app;
    assert_eq!(app.prop("fort-agent.service", "User"), "fort");
    // The key file is root's alone: the agent's user cannot open it...
    let denied = app.fail("setpriv --reuid=fort --regid=fort --init-groups cat /etc/lane/host_key");
    assert!(denied.contains("Permission denied"), "{denied}");
    // ...systemd hands it over as a credential, where agent.toml says the key is...
    app.succeed("cmp /etc/lane/host_key /run/credentials/fort-agent.service/host-key");
    let config = app.succeed("cat /etc/fort/agent.toml");
    assert!(
        config.contains("host_key = \"/run/credentials/fort-agent.service/host-key\""),
        "{config}"
    );
    // ...and forge, which knows app by that key, answers what app signed with it.
    lane.wait_satisfied();
}

#[test]
fn reload_picks_up_new_needs() {
    let Some(lane) = Lane::boot("reload_picks_up_new_needs", "app") else {
        return;
    };
    lane.wait_satisfied();
    let app = &lane.app;
    let props = ["MainPID", "InvocationID", "NRestarts"];
    let before = app.show("fort-agent.service", &props);
    // The next deployment, as switch-to-configuration makes it: new /etc/fort links,
    // and a reload (the files are the unit's reloadTriggers). forge first: it must know
    // app's new need before app asks for it.
    for (m, tree) in [(&lane.forge, "next/forge"), (app, "next/app")] {
        let tree = fort_tests::lane::tree(tree);
        m.install_tree_part(&tree, "nix/store");
        m.install_tree_part(&tree, "etc/fort");
        m.succeed("systemctl reload fort-agent.service");
    }
    app.wait_until("secret/later satisfied", SOON, || {
        fleet::need(app, "secret/later")["state"] == "satisfied"
    });
    lane.wait_token("secret/later", 1);
    assert_eq!(
        app.show("fort-agent.service", &props),
        before,
        "reloaded, not restarted"
    );
    assert!(fleet::all_satisfied(app));
}

#[test]
fn dry_activate_prints_a_plan_against_the_running_agent() {
    let Some(lane) = Lane::boot(
        "dry_activate_prints_a_plan_against_the_running_agent",
        "app",
    ) else {
        return;
    };
    lane.wait_satisfied();
    let app = &lane.app;
    let next = fort_tests::lane::tree("next/app");
    // `nixos-rebuild dry-activate`: the new generation's store paths exist, /etc still
    // holds the running one.
    app.install_tree_part(&next, "nix/store");
    let script = std::fs::read(next.join("dry-activate.sh")).expect("dry-activate.sh");
    let dry_activate = || {
        let out = app.exec_input(&["env", "NIXOS_ACTION=dry-activate", "bash"], &script);
        assert!(out.status.success(), "dry-activate failed: {out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let plan = dry_activate();
    assert!(
        plan.contains("fort: what loading the new configuration would change:"),
        "{plan}"
    );
    assert!(
        plan.contains("secret/later"),
        "the plan names the new need:\n{plan}"
    );
    // Nothing changed in the running agent.
    let status = fleet::status(app);
    assert_eq!(status["needs"]["total"], 4, "{status}");
    assert!(fleet::need(app, "secret/later").is_null());
    // A stopped agent: no plan, and activation goes on.
    app.succeed("systemctl stop fort-agent.service");
    let plan = dry_activate();
    assert!(
        plan.contains("fort: the agent is not running; no plan to show"),
        "{plan}"
    );
}

#[test]
fn kill_9_agent_is_restarted_and_loses_nothing_acknowledged() {
    let Some(lane) = Lane::boot(
        "kill_9_agent_is_restarted_and_loses_nothing_acknowledged",
        "app",
    ) else {
        return;
    };
    lane.wait_satisfied();
    let app = &lane.app;
    let before = app.show("fort-agent.service", &["MainPID", "NRestarts"]);
    assert_eq!(before["NRestarts"], "0");
    // A rotation, acknowledged (applied and durable: `received` counts it) ...
    lane.rotate(2);
    app.wait_until("every rotation acknowledged", SOON, || {
        fleet::NEEDS
            .iter()
            .all(|n| fleet::need(app, n)["received"] == 2)
    });
    // ... then the agent dies at once.
    app.succeed("kill -9 \"$(systemctl show -p MainPID --value fort-agent.service)\"");
    app.wait_until("systemd restarted the agent", SOON, || {
        let p = app.show(
            "fort-agent.service",
            &["ActiveState", "NRestarts", "MainPID"],
        );
        p["ActiveState"] == "active" && p["NRestarts"] == "1" && p["MainPID"] != before["MainPID"]
    });
    for n in fleet::NEEDS {
        let row = fleet::need(app, n);
        assert_eq!(row["state"], "satisfied", "{n}: {row}");
        assert_eq!(row["received"], 2, "{n}: {row}");
        assert_eq!(
            fleet::token(app, n).as_deref(),
            Some(format!("2 app:{n}").as_str())
        );
    }
}

#[test]
fn strict_sandbox_handler_writes_only_into_read_write_paths() {
    let Some(lane) = Lane::boot(
        "strict_sandbox_handler_writes_only_into_read_write_paths",
        "app",
    ) else {
        return;
    };
    // forge's handler has run for app's needs.
    lane.wait_satisfied();
    let forge = &lane.forge;
    let props = forge.show(
        "fort-agent.service",
        &["ProtectSystem", "ReadWritePaths", "User"],
    );
    assert_eq!(props["ProtectSystem"], "strict");
    assert_eq!(props["ReadWritePaths"], "/var/lib/lane-provider");
    assert_eq!(props["User"], "root");
    let probes = forge.succeed("cat /var/lib/lane-provider/probes");
    assert!(
        probes.contains("/var/lib/lane-provider/probe: written"),
        "{probes}"
    );
    for outside in ["/var/lib/lane-outside/probe", "/etc/lane-probe"] {
        assert!(
            probes.contains(&format!("{outside}: Read-only file system")),
            "{outside}: {probes}"
        );
        forge.fail(&format!("test -e {outside}"));
    }
    // Root outside the sandbox could have written there.
    forge.succeed("touch /var/lib/lane-outside/root && rm /var/lib/lane-outside/root");
}

#[test]
fn systemd_trigger_runs_the_capability_after_a_oneshot_succeeds() {
    let Some(lane) = Lane::boot(
        "systemd_trigger_runs_the_capability_after_a_oneshot_succeeds",
        "app",
    ) else {
        return;
    };
    lane.wait_satisfied();
    let forge = &lane.forge;
    assert_eq!(
        forge.prop("lane-source.service", "OnSuccess"),
        "fort-trigger-secret.service"
    );
    forge.write("/etc/lane/generation", "2\n", 0o644);
    forge.succeed("systemctl start lane-source.service");
    forge.wait_until("fort-trigger-secret.service ran", SOON, || {
        forge.starts("fort-trigger-secret.service") == 1
    });
    let trigger = forge.show(
        "fort-trigger-secret.service",
        &["Result", "ExecMainStatus", "ActiveState"],
    );
    assert_eq!(trigger["Result"], "success", "{trigger:?}");
    assert_eq!(trigger["ExecMainStatus"], "0", "{trigger:?}");
    // The capability's handler ran for that reason, and its answers reached app.
    forge.wait_until("a run triggered by systemd", SOON, || {
        forge
            .succeed("cat /var/lib/lane-provider/triggers")
            .lines()
            .any(|l| l == "systemd")
    });
    for n in fleet::NEEDS {
        lane.wait_token(n, 2);
    }
}
