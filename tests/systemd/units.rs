//! Every unit and drop-in the lane installs, parsed by systemd itself
//! (`systemd-analyze verify`), with the store paths they name in place: a directive
//! systemd cannot parse, an unknown key or a missing executable fails. Needs no
//! container, only systemd-analyze; the trees are the committed renderings
//! (nixos_module.rs checks that they are what the module renders).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use fort_tests::lane;

/// Every tree the lane installs.
const TREES: [&str; 5] = ["forge", "app", "app-fort", "next/forge", "next/app"];

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|dir| dir.join(program).is_file()))
}

/// Copies `tree` with its directories and links into `root`.
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for e in std::fs::read_dir(from).expect("read tree") {
        let e = e.expect("entry");
        let (src, dst) = (e.path(), to.join(e.file_name()));
        let meta = std::fs::symlink_metadata(&src).expect("metadata");
        if meta.file_type().is_symlink() {
            std::os::unix::fs::symlink(std::fs::read_link(&src).expect("link"), &dst)
                .expect("symlink");
        } else if meta.is_dir() {
            copy_tree(&src, &dst);
        } else {
            std::fs::copy(&src, &dst).expect("copy");
        }
    }
}

/// An executable at `inside` in `root`: the file of the same name on this machine.
fn provide(root: &Path, inside: &str, from: &Path) {
    let dst = root.join(inside.trim_start_matches('/'));
    if dst.exists() {
        return;
    }
    std::fs::create_dir_all(dst.parent().expect("parent")).expect("mkdir");
    // /usr/bin/sh and the like are links (to dash): take what they point at.
    let real = std::fs::canonicalize(from).unwrap_or_else(|e| panic!("{}: {e}", from.display()));
    if std::fs::hard_link(&real, &dst).is_err() {
        std::fs::copy(&real, &dst).unwrap_or_else(|e| panic!("{}: {e}", real.display()));
    }
}

/// A root holding `tree`, the lane's own units as a package ships them, and every
/// executable the units name: what the booted lane has, for `--root`.
fn verify_root(tree: &str, root: &Path) -> Vec<String> {
    let tree = lane::tree(tree);
    for top in ["etc", "nix"] {
        copy_tree(&tree.join(top), &root.join(top));
    }
    copy_tree(&lane::units_dir(), &root.join("usr/lib/systemd/system"));
    // Merged /usr, as Debian and the lane's root.
    for dir in ["bin", "sbin", "lib"] {
        std::fs::create_dir_all(root.join("usr").join(dir)).expect("mkdir");
        std::os::unix::fs::symlink(format!("usr/{dir}"), root.join(dir)).expect("symlink");
    }
    let packages: std::collections::BTreeMap<String, String> = serde_json::from_str(
        &std::fs::read_to_string(tree.join("packages.json")).expect("packages.json"),
    )
    .expect("json");
    for (path, kind) in &packages {
        let dir = root.join(path.trim_start_matches('/'));
        std::fs::create_dir_all(&dir).expect("mkdir");
        if kind == "fort" {
            for bin in ["fort-agent", "fort"] {
                provide(root, &format!("{path}/bin/{bin}"), &fort_tests::bin(bin));
            }
        } else {
            std::os::unix::fs::symlink("/usr/bin", dir.join("bin")).expect("symlink");
            std::os::unix::fs::symlink("/usr/sbin", dir.join("sbin")).expect("symlink");
        }
    }
    // Units by name (drop-ins are found through their unit), and the executables they
    // run, taken from this machine (the same release as the lane's root).
    let mut units = Vec::new();
    let mut files = Vec::new();
    for dir in ["etc/systemd/system", "usr/lib/systemd/system"] {
        for e in std::fs::read_dir(root.join(dir))
            .expect("unit dir")
            .flatten()
        {
            let name = e.file_name().to_string_lossy().into_owned();
            let unit = name.strip_suffix(".d").unwrap_or(&name).to_owned();
            if (unit.ends_with(".service") || unit.ends_with(".path")) && !units.contains(&unit) {
                units.push(unit);
            }
            if e.path().is_dir() && name.ends_with(".d") {
                files.extend(
                    std::fs::read_dir(e.path())
                        .expect("drop-ins")
                        .flatten()
                        .map(|f| f.path()),
                );
            } else if e.path().is_file() {
                files.push(e.path());
            }
        }
    }
    for file in files {
        for line in std::fs::read_to_string(&file).expect("unit").lines() {
            let Some((key, value)) = line.split_once('=') else {
                continue;
            };
            if !key.starts_with("Exec") {
                continue;
            }
            let exe = value.trim_start_matches(['-', '@', '+', '!', ':']);
            let exe = exe.split_whitespace().next().unwrap_or_default();
            let name = Path::new(exe).file_name().expect("an executable");
            if let Some(store) = packages
                .iter()
                .find(|(p, k)| *k == "system" && exe.starts_with(p.as_str()))
            {
                let sub = if exe.starts_with(&format!("{}/sbin/", store.0)) {
                    "sbin"
                } else {
                    "bin"
                };
                provide(
                    root,
                    &format!("/usr/{sub}/{}", name.to_string_lossy()),
                    &host_executable(name),
                );
            } else if exe.starts_with("/bin/") || exe.starts_with("/usr/bin/") {
                provide(
                    root,
                    &format!("/usr/bin/{}", name.to_string_lossy()),
                    &host_executable(name),
                );
            }
        }
    }
    units.sort();
    units
}

fn host_executable(name: &std::ffi::OsStr) -> PathBuf {
    ["/usr/bin", "/usr/sbin"]
        .iter()
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{} is not on this machine", name.to_string_lossy()))
}

/// `systemd-analyze verify` of `units` under `root`; `Err` with what it said when it
/// said anything or failed. Without --recursive-errors it exits 0 on parse errors.
fn verify(root: &Path, units: &[String]) -> Result<(), String> {
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(format!("--root={}", root.display()))
        .args(["--recursive-errors=no", "--man=no"])
        .args(units)
        .env("SYSTEMD_LOG_COLOR", "0")
        .output()
        .expect("run systemd-analyze");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() && said.trim().is_empty() {
        Ok(())
    } else {
        Err(format!("{}: {said}", out.status))
    }
}

#[test]
fn lane_units_pass_systemd_analyze_verify() {
    let test = "lane_units_pass_systemd_analyze_verify";
    if !on_path("systemd-analyze") {
        fort_tests::skip(
            test,
            "systemd-analyze not found (Debian: apt-get install systemd)",
        );
        return;
    }
    let mut checked = 0;
    for tree in TREES {
        let root = tempfile::tempdir().expect("tempdir");
        let units = verify_root(tree, root.path());
        assert!(
            units.contains(&"fort-agent.service".to_owned()),
            "{tree}: {units:?}"
        );
        if let Err(said) = verify(root.path(), &units) {
            panic!("{tree}: systemd-analyze verify {units:?}:\n{said}");
        }
        checked += units.len();
    }
    assert!(checked >= 30, "{checked} units verified");

    // The check catches what systemd would ignore with a warning: one misspelt key in
    // the agent's unit.
    let root = tempfile::tempdir().expect("tempdir");
    let units = verify_root("app", root.path());
    let unit = root.path().join("etc/systemd/system/fort-agent.service");
    let text = std::fs::read_to_string(&unit).expect("unit");
    std::fs::remove_file(&unit).expect("rm");
    std::fs::write(&unit, text.replace("ProtectClock=", "ProtectClok=")).expect("write");
    std::fs::set_permissions(&unit, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let said = verify(root.path(), &units).expect_err("a misspelt key fails");
    assert!(said.contains("ProtectClok"), "{said}");
}
