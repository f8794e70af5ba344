//! The lane's fleet booted for a scenario: forge (provider) and app (consumer), each a
//! machine with the units and /etc/fort files the module rendered
//! (nixos-module/tests/lane), the lane's own units, the test host keys and the binaries
//! just built, sharing one loopback.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use fort_tests::lane::{self, Machine, Net};
use serde_json::Value;

/// How long a scenario waits for something systemd or an agent does in seconds.
pub const SOON: Duration = Duration::from_secs(30);

/// Long enough for a second round of restarts to show if there were one: a round
/// closes 300 ms after the last request and rounds are 1 s apart.
pub const QUIET: Duration = Duration::from_millis(2500);

pub struct Lane {
    // Machines first: they are killed before the network they share goes away.
    pub forge: Machine,
    pub app: Machine,
    _net: Net,
}

/// The secret/* needs app declares in generation 1.
pub const NEEDS: [&str; 4] = [
    "secret/multi-a",
    "secret/multi-b",
    "secret/multi-c",
    "secret/wiki",
];

/// The store path of the fort package in `tree` (packages.json), where the lane
/// bind-mounts the binaries just built.
pub fn fort_package(tree: &str) -> String {
    let text = std::fs::read_to_string(lane::tree(tree).join("packages.json")).expect("packages");
    let packages: BTreeMap<String, String> = serde_json::from_str(&text).expect("json");
    packages
        .into_iter()
        .find_map(|(path, kind)| (kind == "fort").then_some(path))
        .expect("a fort package")
}

fn keys_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../nixos-module/tests/keys")
}

/// A machine for `host` from the rendered tree `tree`, not yet booted.
pub fn machine(root: &lane::Root, net: &Net, host: &str, tree: &str) -> Machine {
    let mut m = Machine::new(root, net, host);
    let tree = lane::tree(tree);
    m.install_tree(&tree);
    m.provide_packages(&tree);
    for unit in std::fs::read_dir(lane::units_dir()).expect("units") {
        let unit = unit.expect("entry").path();
        let name = unit
            .file_name()
            .expect("name")
            .to_string_lossy()
            .into_owned();
        m.write(
            &format!("/usr/lib/systemd/system/{name}"),
            std::fs::read(&unit).expect("unit"),
            0o644,
        );
    }
    // As a secret deployment tool would place it: root's, readable by root only.
    m.write(
        "/etc/lane/host_key",
        std::fs::read(keys_dir().join(host)).expect("test key"),
        0o400,
    );
    // readWritePaths must exist for the unit to start; the handler's probe needs a
    // directory outside of them that root could write without the sandbox.
    m.mkdir("/var/lib/lane-provider", 0o755);
    m.mkdir("/var/lib/lane-outside", 0o755);
    m
}

impl Lane {
    /// Boots forge, then app from the rendered tree `app_tree` ("app", or "app-fort"
    /// for the agent running as user fort); `None` (a recorded skip) where the lane
    /// cannot run.
    pub fn boot(test: &str, app_tree: &str) -> Option<Lane> {
        Lane::boot_trees(test, "forge", app_tree, &mut |_, _, _| Ok(()))
    }

    /// Boots forge and app from the rendered trees named, after `prepare` has done what
    /// they need before they start (a server on their loopback, a file); an `Err` from
    /// it is a recorded skip with that reason.
    pub fn boot_trees(
        test: &str,
        forge_tree: &str,
        app_tree: &str,
        prepare: &mut dyn FnMut(&Net, &mut Machine, &mut Machine) -> Result<(), String>,
    ) -> Option<Lane> {
        let root = lane::root_or_skip(test)?;
        let net = Net::new().expect("network namespace");
        let mut forge = machine(&root, &net, "forge", forge_tree);
        let mut app = machine(&root, &net, "app", app_tree);
        if let Err(why) = prepare(&net, &mut forge, &mut app) {
            fort_tests::skip(test, &why);
            return None;
        }
        if let Err(e) = forge.boot() {
            fort_tests::skip(test, &format!("cannot boot a container here: {e}"));
            return None;
        }
        forge.wait_for_unit("fort-agent.service", SOON);
        app.boot().expect("boot app");
        app.wait_for_unit("fort-agent.service", SOON);
        Some(Lane {
            forge,
            app,
            _net: net,
        })
    }

    /// The network namespace the machines share (for a client on their loopback).
    pub fn net_path(&self) -> PathBuf {
        self._net.path()
    }

    /// Waits until every need app declares is satisfied.
    pub fn wait_satisfied(&self) {
        self.app
            .wait_until("every need satisfied", SOON, || all_satisfied(&self.app));
    }

    /// Makes forge answer every entry with generation `generation` and runs its handler
    /// (`fort-agent trigger secret`), as an operator would after changing a secret.
    pub fn rotate(&self, generation: u32) {
        self.forge
            .write("/etc/lane/generation", format!("{generation}\n"), 0o644);
        fort_agent(&self.forge, "forge", &["trigger", "secret"]);
    }

    /// Waits until app's file of `need` holds generation `generation`.
    pub fn wait_token(&self, need: &str, generation: u32) {
        let want = format!("{generation} app:{need}");
        self.app
            .wait_until(&format!("{need} at generation {generation}"), SOON, || {
                token(&self.app, need).as_deref() == Some(want.as_str())
            });
    }
}

/// `fort-agent ARGS --config /etc/fort/agent.toml` inside `m` (its tree `tree`);
/// stdout, or a panic with both streams.
pub fn fort_agent(m: &Machine, tree: &str, args: &[&str]) -> String {
    let bin = format!("{}/bin/fort-agent", fort_package(tree));
    let mut all = vec![bin.as_str()];
    all.extend_from_slice(args);
    all.extend(["--config", "/etc/fort/agent.toml"]);
    let out = m.exec(&all);
    assert!(
        out.status.success(),
        "{}: fort-agent {args:?}: {}{}",
        m.name,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// app's status document (`fort-agent status --json`), `Null` when it does not answer.
pub fn status(app: &Machine) -> Value {
    let bin = format!("{}/bin/fort-agent", fort_package("app"));
    let out = app.exec(&[&bin, "status", "--json", "--config", "/etc/fort/agent.toml"]);
    serde_json::from_slice::<Value>(&out.stdout).unwrap_or(Value::Null)["status"].clone()
}

/// One need's row in app's status.
pub fn need(app: &Machine, key: &str) -> Value {
    status(app)["needs"]["items"]
        .as_array()
        .and_then(|a| a.iter().find(|n| n["need"] == key).cloned())
        .unwrap_or(Value::Null)
}

pub fn all_satisfied(app: &Machine) -> bool {
    let s = status(app);
    s["needs"]["total"].as_u64().is_some_and(|n| n > 0)
        && s["needs"]["total"] == s["needs"]["satisfied"]
}

/// The delivered token of `need` (`secret/<id>`), read as root.
pub fn token(app: &Machine, need: &str) -> Option<String> {
    let id = need.strip_prefix("secret/").expect("a secret need");
    let out = app.exec(&["cat", &format!("/run/fort/needs/secret/{id}/token")]);
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Waits until app's need `key` is satisfied; else panics with its row and app's agent log.
pub fn wait_need_satisfied(app: &Machine, key: &str) {
    let deadline = std::time::Instant::now() + SOON;
    while need(app, key)["state"] != "satisfied" {
        assert!(
            std::time::Instant::now() < deadline,
            "{key} not satisfied within {SOON:?}: {}\n{}",
            need(app, key),
            app.journal("fort-agent.service", 60)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A capability's handler ran under strictSandbox on `forge` and left `path` (its state,
/// a key) root's alone, with `mode`.
pub fn assert_private_under_sandbox(forge: &Machine, path: &str, mode: &str) {
    assert_eq!(
        forge.succeed(&format!("stat -c '%U %a' {path}")),
        format!("root {mode}\n")
    );
    assert_eq!(forge.prop("fort-agent.service", "ProtectSystem"), "strict");
}
