//! A need with two providers under a booted systemd (docs/protocol.md §11.13): forge and
//! spare both serve `lease`, a token that names its issuer and lives 30 s; app needs
//! lease/renter `from = [ "forge" "spare" ]` as a credential of its DynamicUser service
//! renter, renewed 20 s before it expires and moved after 4 s of failure, as the NixOS
//! module declares it (nixos-module/tests/lane/fleet.nix, `failover`). While forge
//! answers, every renewal comes from forge and spare hears nothing; forge's container is
//! powered off, and the next renewal comes from spare, with renter restarted on it; forge
//! back again does not take the need back.

use std::time::{Duration, Instant};

use fort_tests::lane::{self, Machine, Net};
use serde_json::Value;

use crate::fleet::{self, SOON};

const NEED: &str = "lease/renter";

/// The token renter was started with (it copies its credential at start).
fn renter_token(app: &Machine) -> String {
    let out = app.exec(&["cat", "/run/renter/token"]);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The token's issuer and issue time: "<issuer> app:lease/renter <unix time>".
fn issued(token: &str) -> Option<(String, u64)> {
    let mut parts = token.split(' ');
    let issuer = parts.next()?.to_owned();
    (parts.next()? == format!("app:{NEED}")).then_some(())?;
    Some((issuer, parts.next()?.trim().parse().ok()?))
}

/// `host`'s status document as its own agent gives it.
fn status(m: &Machine, tree: &str) -> Value {
    let out = fleet::fort_agent(m, tree, &["status", "--json"]);
    serde_json::from_str::<Value>(&out).expect("status JSON")["status"].clone()
}

/// What spare's audit trail records of app (requests accepted, issued, …).
fn spare_records_of_app(spare: &Machine) -> String {
    fleet::fort_agent(
        spare,
        "failover/spare",
        &["audit", "show", "--json", "--host", "app"],
    )
}

/// Waits until renter runs with a token from `issuer` issued after `after`; the token.
fn wait_renter_served(app: &Machine, issuer: &str, after: u64, within: Duration) -> String {
    let deadline = Instant::now() + within;
    loop {
        let token = renter_token(app);
        if issued(&token).is_some_and(|(i, t)| i == issuer && t > after)
            && app.prop("renter.service", "ActiveState") == "active"
        {
            return token;
        }
        assert!(
            Instant::now() < deadline,
            "renter holds {token:?}, not a token of {issuer} after {after}: {}\n{}",
            fleet::need(app, NEED),
            app.journal("fort-agent.service", 80)
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

#[test]
fn a_powered_off_home_hands_the_renewal_to_the_standby_under_systemd() {
    let test = "a_powered_off_home_hands_the_renewal_to_the_standby_under_systemd";
    let Some(root) = lane::root_or_skip(test) else {
        return;
    };
    let net = Net::new().expect("network namespace");
    // Machines after the network: dropped first, killed before it goes away.
    let mut forge = fleet::machine(&root, &net, "forge", "failover/forge");
    let mut spare = fleet::machine(&root, &net, "spare", "failover/spare");
    let mut app = fleet::machine(&root, &net, "app", "failover/app");
    if let Err(e) = forge.boot() {
        fort_tests::skip(test, &format!("cannot boot a container here: {e}"));
        return;
    }
    spare.boot().expect("boot spare");
    app.boot().expect("boot app");
    for m in [&forge, &spare, &app] {
        m.wait_for_unit("fort-agent.service", SOON);
    }
    fleet::wait_need_satisfied(&app, NEED);

    // The home answers: two renewals, each from forge, each restarting renter on it.
    let first = wait_renter_served(&app, "forge", 0, SOON);
    let (_, t1) = issued(&first).expect("a lease");
    let renewed = wait_renter_served(&app, "forge", t1, SOON);
    let (_, t2) = issued(&renewed).expect("a lease");
    wait_renter_served(&app, "forge", t2, SOON);
    let row = fleet::need(&app, NEED);
    assert_eq!(row["from"], "forge", "{row}");
    assert_eq!(row["moves"], 0, "{row}");
    assert_eq!(
        status(&spare, "failover/spare")["memory"]["provider_entries"],
        0,
        "spare holds an entry while forge answers"
    );
    assert_eq!(
        spare_records_of_app(&spare),
        "",
        "app asked spare while forge answered"
    );

    // forge's container goes down for good; the need comes due within 10 s of its last
    // renewal and moves once forge has failed for 4 s.
    let renter_starts = app.starts("renter.service");
    forge.poweroff();
    let off = Instant::now();
    let off_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs();
    let from_spare = wait_renter_served(&app, "spare", 0, Duration::from_secs(60));
    eprintln!(
        "renter runs with spare's token {:?} after forge's poweroff (renewal every 10 s, failover after 4 s, nag 2 s)",
        off.elapsed()
    );
    assert!(issued(&from_spare).is_some_and(|(_, t)| t + 1 >= off_at));
    assert_eq!(
        app.succeed(&format!("cat /run/fort/needs/{NEED}/token")),
        from_spare,
        "renter runs with the delivered token"
    );
    assert!(app.starts("renter.service") > renter_starts);
    let row = fleet::need(&app, NEED);
    assert_eq!(row["from"], "spare", "{row}");
    assert_eq!(row["state"], "satisfied", "{row}");
    assert_eq!(row["moves"], 1, "{row}");
    assert!(
        row["moved_because"]
            .as_str()
            .is_some_and(|w| w.starts_with("forge failing since")),
        "{row}"
    );
    assert_eq!(
        status(&spare, "failover/spare")["memory"]["provider_entries"],
        1
    );
    let records = spare_records_of_app(&spare);
    for event in ["accepted", "delivered"] {
        assert!(
            records.contains(&format!(r#""event":"{event}""#)),
            "{records}"
        );
    }

    // forge back: the need stays with spare through its next renewal.
    forge.boot().expect("boot forge again");
    forge.wait_for_unit("fort-agent.service", SOON);
    let (_, t) = issued(&from_spare).expect("a lease");
    wait_renter_served(&app, "spare", t, SOON);
    assert_eq!(fleet::need(&app, NEED)["moves"], 1);
    drop(app);
    drop(spare);
    drop(forge);
}
