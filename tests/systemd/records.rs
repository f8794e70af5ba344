//! The `dns-record` capability under systemd: forge's agent (strictSandbox) runs
//! `fort-handler dns-record` against Knot DNS on the lane's loopback, signing its updates
//! with the TSIG secret the lane installs, as the NixOS module declares it
//! (`fort.host.capabilities.dns-record.dnsRecord`); app asks for a record of its own.

use fort_tests::dns::{DnsServer, Flavor};

use crate::fleet::{self, Lane};

/// Where the lane's fleet expects the zone's primary (nixos-module/tests/lane/fleet.nix).
const PRIMARY: &str = "127.0.0.1:5300";

#[test]
fn dns_record_reaches_the_primary_under_systemd() {
    let test = "dns_record_reaches_the_primary_under_systemd";
    let mut primary: Option<DnsServer> = None;
    let Some(lane) = Lane::boot_trees(
        test,
        "records/forge",
        "records/app",
        &mut |net, forge, _| {
            let server = DnsServer::start_in_namespace(
                Flavor::Knot,
                "lane.test",
                "hand IN A 192.0.2.7",
                &net.path(),
                PRIMARY.parse().expect("address"),
            )?;
            // As a secret deployment tool would place it: root's alone.
            forge.write("/etc/lane/tsig", format!("{}\n", server.secret), 0o400);
            primary = Some(server);
            Ok(())
        },
    ) else {
        return;
    };
    let (forge, app) = (&lane.forge, &lane.app);
    let primary = primary.as_ref().expect("started before the machines");
    fleet::wait_need_satisfied(app, "dns-record/www");
    // The record is at the primary, with app's own address from hosts.json; the one an
    // administrator made is untouched.
    assert_eq!(primary.dig("www.lane.test", "A"), vec!["127.0.0.2"]);
    assert_eq!(primary.dig("hand.lane.test", "A"), vec!["192.0.2.7"]);
    let record: serde_json::Value =
        serde_json::from_str(&app.succeed("cat /run/fort/needs/dns-record/www/record.json"))
            .expect("the record set as JSON");
    assert_eq!(
        record["values"],
        serde_json::json!(["127.0.0.2"]),
        "{record}"
    );
    // The handler kept its state in the agent's state directory, under the sandbox.
    fleet::assert_private_under_sandbox(forge, "/var/lib/fort/handlers/dns-record.json", "600");
    let journal = forge.journal("fort-agent.service", 400);
    assert!(
        !journal.contains(&primary.secret),
        "the TSIG secret is in the log"
    );
    drop(lane);
}
