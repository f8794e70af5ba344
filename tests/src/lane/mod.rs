//! The systemd lane: tests that run fort under a real, booted systemd. A Debian
//! bookworm root (systemd, D-Bus, polkit) is built once per machine with `mmdebstrap`
//! and cached under `/var/cache/fort-systemd-lane/<hash of its recipe>`; each machine
//! boots it with `systemd-nspawn --boot` over an overlay of its own, so the cache is
//! never written; machines of one test share a network namespace whose only interface
//! is loopback. Commands run inside through `nsenter`. Needs root, `systemd-nspawn`
//! (systemd-container), `mmdebstrap` and the Debian registry for the first build;
//! without them, `root_or_skip` records the reason through [`crate::skip`].
//!
//! ```no_run
//! # use std::time::Duration;
//! # use fort_tests::lane::{self, Machine, Net};
//! let Some(root) = lane::root_or_skip("my_test") else { return };
//! let net = Net::new().unwrap();
//! let mut m = Machine::new(&root, &net, "app");
//! let tree = lane::tree("app");              // units and /etc files the module renders
//! m.install_tree(&tree);                      // before boot: into the overlay
//! m.provide_packages(&tree);                  // the binaries just built, at their store paths
//! m.write("/etc/lane/host_key", b"...", 0o400);
//! m.boot().unwrap();
//! m.wait_for_unit("fort-agent.service", Duration::from_secs(30));
//! let props = m.show("fort-agent.service", &["NRestarts", "InvocationID"]);
//! let out = m.succeed("systemctl reload fort-agent");
//! // dropped: the container and everything in it is killed
//! ```

mod machine;
mod net;
mod query;
mod root;

use std::path::PathBuf;

pub use machine::Machine;
pub use net::Net;
pub use root::{cache_dir, unavailable, Root, PACKAGES, SUITE};

/// The lane's root, or `None` after recording why `test` cannot run here (not root,
/// no `systemd-nspawn` or `mmdebstrap`, the registry unreachable for the first build).
pub fn root_or_skip(test: &str) -> Option<Root> {
    match Root::get() {
        Ok(root) => Some(root),
        Err(why) => {
            crate::skip(test, &why);
            None
        }
    }
}

/// A tree of files rendered from the NixOS module for the lane
/// (`nixos-module/tests/lane/expected/<name>`).
pub fn tree(name: &str) -> PathBuf {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../nixos-module/tests/lane/expected")
        .join(name);
    assert!(path.is_dir(), "no rendered tree {}", path.display());
    path
}

/// The lane's own units (`nixos-module/tests/lane/units`): the services the fleet's
/// needs name, as a package would ship them.
pub fn units_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../nixos-module/tests/lane/units")
}
