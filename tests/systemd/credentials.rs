//! A delivered secret kept as a systemd encrypted credential (`encrypt = true`,
//! docs/at-rest.md), under a booted systemd: the DynamicUser service keeper reads it
//! through `LoadCredentialEncrypted=`, is restarted once when it rotates and not at all
//! for an unchanged redelivery, starts with it after a reboot without anything being
//! asked again, and the plaintext is nowhere on app's disk (`/var/lib`, the credential's
//! directory, `/run/fort`).

use fort_core::canonical::sha256_hex;

use crate::fleet::{self, Lane, QUIET, SOON};

const NEED: &str = "secret/keeper";
const CRED: &str = "/var/lib/fort/credentials/secret/keeper/token.cred";

/// The token forge issues keeper at `generation`.
fn token(generation: u32) -> String {
    format!("{generation} app:{NEED}")
}

/// What keeper noted it received: the SHA-256 of its credential, as `sha256sum` prints it.
fn received_by_keeper(lane: &Lane) -> String {
    let out = lane.app.exec(&["cat", "/run/keeper/token.sha256"]);
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

fn keeper_holds(lane: &Lane, generation: u32) -> bool {
    received_by_keeper(lane) == format!("{}  -", sha256_hex(token(generation).as_bytes()))
}

/// Every file on app, below the places a copy of its disk or its delivery paths would
/// show, that holds `secret`'s bytes.
fn holding(lane: &Lane, secret: &str) -> String {
    let out = lane.app.exec(&[
        "grep",
        "-rlaF",
        "--",
        secret,
        "/var/lib",
        "/run/fort",
        "/var/lib/fort/credentials",
    ]);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The credential file's inode and modification time.
fn stamp(lane: &Lane) -> String {
    lane.app.succeed(&format!("stat -c '%i %Y %U %a' {CRED}"))
}

#[test]
fn an_encrypted_credential_reaches_a_dynamic_user_service_and_no_disk() {
    let test = "an_encrypted_credential_reaches_a_dynamic_user_service_and_no_disk";
    let Some(mut lane) =
        Lane::boot_trees(test, "encrypted/forge", "encrypted/app", &mut |_, _, _| {
            Ok(())
        })
    else {
        return;
    };
    lane.wait_satisfied();
    lane.app.wait_for_unit("keeper.service", SOON);
    assert_eq!(lane.app.prop("keeper.service", "DynamicUser"), "yes");
    lane.app
        .wait_until("keeper noted its credential", SOON, || {
            keeper_holds(&lane, 1)
        });
    // A systemd credential of that name, root's alone; it does not load as another.
    assert!(stamp(&lane).ends_with(" root 400\n"), "{}", stamp(&lane));
    assert_eq!(
        lane.app
            .succeed(&format!("systemd-creds decrypt --name=token {CRED} -")),
        token(1)
    );
    let other = lane
        .app
        .fail(&format!("systemd-creds decrypt --name=other {CRED} -"));
    assert!(other.contains("does not match"), "{other}");
    assert_eq!(
        holding(&lane, &token(1)),
        "",
        "the plaintext is on app's disk"
    );
    // The search sees what is there: wiki's token, delivered without encrypt.
    assert_eq!(
        holding(&lane, "1 app:secret/wiki"),
        "/run/fort/needs/secret/wiki/token\n"
    );
    std::thread::sleep(QUIET);
    assert_eq!(lane.app.starts("keeper.service"), 1, "started once");

    // forge restarted (triggers.initialize): the same token again. Nothing is written,
    // nothing restarts, though every encryption would give other bytes.
    let (starts, before) = (lane.app.starts("keeper.service"), stamp(&lane));
    let received = fleet::need(&lane.app, NEED)["received"].as_u64();
    lane.forge.succeed("systemctl restart fort-agent.service");
    lane.app
        .wait_until("keeper's token delivered again", SOON, || {
            fleet::need(&lane.app, NEED)["received"].as_u64() > received
        });
    std::thread::sleep(QUIET);
    assert_eq!(stamp(&lane), before, "an unchanged token was written again");
    assert_eq!(lane.app.starts("keeper.service"), starts);

    // A new token: the credential is replaced and keeper restarted with it, once.
    lane.rotate(2);
    lane.app.wait_until("keeper holds the new token", SOON, || {
        keeper_holds(&lane, 2)
    });
    std::thread::sleep(QUIET);
    assert_eq!(
        lane.app.starts("keeper.service"),
        starts + 1,
        "{}",
        lane.app.journal("keeper.service", 20)
    );
    assert_ne!(stamp(&lane), before);
    for generation in [1, 2] {
        assert_eq!(holding(&lane, &token(generation)), "");
    }

    // A reboot: the credential is still there, keeper starts with it at boot, and
    // nothing is asked of forge again.
    let received = fleet::need(&lane.app, NEED)["received"].as_u64();
    lane.app.reboot().expect("reboot app");
    lane.app.wait_for_unit("fort-agent.service", SOON);
    lane.app.wait_for_unit("keeper.service", SOON);
    lane.app
        .wait_until("keeper noted its credential after the reboot", SOON, || {
            keeper_holds(&lane, 2)
        });
    lane.wait_satisfied();
    std::thread::sleep(QUIET);
    assert_eq!(lane.app.starts("keeper.service"), 1);
    assert_eq!(fleet::need(&lane.app, NEED)["received"].as_u64(), received);
    assert_eq!(holding(&lane, &token(2)), "");
}
