//! The `backup-repo` capability under systemd: forge's agent (strictSandbox, root) runs
//! `fort-handler backup-repo` as the NixOS module declares it
//! (`fort.host.capabilities.borg.backupRepo`): a repository directory for app's entry,
//! given to the `borg` user the module makes, and sshd's `authorized_keys` for that user
//! with app's key restricted to that repository, append-only. app backs up with a key its
//! own agent made (`fort.host.backups.etc`): the private half stays on app.

use crate::fleet::{self, Lane};

const REPOS: &str = "/var/lib/fort-backup/borg";
const KEYS_DIR: &str = "/etc/ssh/fort-authorized-keys/borg";
const CLIENT: &str = "/var/lib/fort-backup-client/etc";

#[test]
fn a_backup_declared_on_app_gets_a_repository_and_a_restricted_key_on_forge_under_systemd() {
    let test =
        "a_backup_declared_on_app_gets_a_repository_and_a_restricted_key_on_forge_under_systemd";
    let host_key = fort_core::sign::Signer::generate().public_openssh();
    let Some(lane) = Lane::boot_trees(test, "backups/forge", "backups/app", &mut |_, forge, _| {
        // What the module's tmpfiles rules make at boot on NixOS, and sshd's host key.
        forge.mkdir(REPOS, 0o750);
        forge.mkdir(KEYS_DIR, 0o755);
        forge.write(
            "/etc/lane/ssh_host_ed25519_key.pub",
            format!("{host_key}\n"),
            0o644,
        );
        Ok(())
    }) else {
        return;
    };
    let (forge, app) = (&lane.forge, &lane.app);
    fleet::wait_need_satisfied(app, "borg/etc");

    // The repository is the borg user's; sshd's file names app's key, for it alone.
    let repository = format!("{REPOS}/app/etc");
    assert_eq!(
        forge.succeed(&format!("stat -c '%U' {repository}")),
        "borg\n"
    );
    let authorized = forge.succeed(&format!("cat {KEYS_DIR}/borg"));
    let line = authorized
        .lines()
        .find(|l| l.contains(&repository))
        .unwrap_or_else(|| panic!("no line for {repository}:\n{authorized}"));
    assert!(line.contains("--restrict-to-repository"), "{line}");
    assert!(line.contains("--append-only"), "{line}");
    assert!(line.contains("restrict"), "{line}");
    assert!(line.contains("ssh-ed25519 "), "{line}");

    // app holds its key (root's alone), the repository's URL and the server's host key.
    assert_eq!(
        app.succeed(&format!("stat -c '%U %a' {CLIENT}/ssh_key")),
        "root 400\n"
    );
    let public = line
        .split_whitespace()
        .skip_while(|w| *w != "ssh-ed25519")
        .nth(1)
        .expect("the key's base64");
    let private = app.succeed(&format!("cat {CLIENT}/ssh_key"));
    assert!(private.contains("OPENSSH PRIVATE KEY"), "{private}");
    let repo = app.succeed(&format!("cat {CLIENT}/repo"));
    assert!(
        repo.contains("forge.lane.test") && repo.contains(&repository),
        "{repo}"
    );
    let known = app.succeed(&format!("cat {CLIENT}/known_hosts"));
    assert!(
        known.contains(host_key.split_whitespace().nth(1).unwrap()),
        "{known}"
    );
    // Only the public half travelled: forge holds no private key of app's.
    let on_forge = forge.succeed("grep -rl 'OPENSSH PRIVATE KEY' /var/lib/fort /etc/ssh || true");
    assert!(on_forge.trim().is_empty(), "{on_forge}");
    assert!(!public.is_empty());
    fleet::assert_private_under_sandbox(forge, "/var/lib/fort/handlers/borg.json", "600");
    drop(lane);
}
