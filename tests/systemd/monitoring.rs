//! The `scrape` capability under systemd: forge's agent (strictSandbox) runs
//! `fort-handler scrape` into the target directory the NixOS module makes writable for it
//! (`fort.host.capabilities.metrics.scrape`), and app declares its node exporter
//! (`fort.host.exporters.node`). The target Prometheus would read names app's own
//! address from hosts.json, whatever app asked.

use crate::fleet::{self, Lane};

/// Where the module puts the capability's target files (its `targetsDir` default).
const TARGETS: &str = "/var/lib/fort-scrape/metrics";

#[test]
fn an_exporter_declared_on_app_is_a_target_on_forge_under_systemd() {
    let test = "an_exporter_declared_on_app_is_a_target_on_forge_under_systemd";
    let Some(lane) = Lane::boot_trees(
        test,
        "monitoring/forge",
        "monitoring/app",
        &mut |_, forge, _| {
            // What the module's tmpfiles rule makes at boot on NixOS.
            forge.mkdir(TARGETS, 0o755);
            Ok(())
        },
    ) else {
        return;
    };
    let (forge, app) = (&lane.forge, &lane.app);
    fleet::wait_need_satisfied(app, "metrics/node");
    let file: serde_json::Value =
        serde_json::from_str(&forge.succeed(&format!("cat {TARGETS}/app.json")))
            .expect("the target file is JSON");
    let group = &file[0];
    assert_eq!(
        group["targets"],
        serde_json::json!(["127.0.0.2:9100"]),
        "{file}"
    );
    assert_eq!(group["labels"]["fort_host"], "app", "{file}");
    assert_eq!(group["labels"]["env"], "lane", "{file}");
    // Prometheus (another user) reads it; the handler's state stays root's alone.
    assert_eq!(
        forge.succeed(&format!("stat -c '%a' {TARGETS}/app.json")),
        "644\n"
    );
    fleet::assert_private_under_sandbox(forge, "/var/lib/fort/handlers/metrics.json", "600");
    // app holds the target it was given, as the module's exporter option delivers it.
    let target = app.succeed("cat /run/fort/needs/metrics/node/target");
    assert!(target.contains("127.0.0.2:9100"), "{target}");
    drop(lane);
}
