//! The `oidc` capability under systemd: forge's agent (strictSandbox) runs
//! `fort-handler oidc` against npm's oidc-provider on the lane's loopback, registering a
//! client with the initial access token the lane installs, as the NixOS module declares it
//! (`fort.host.capabilities.oidc.oidc`); app holds the client's credentials, and they get
//! a token at the provider.

use std::process::Command;

use fort_tests::lane::{Machine, Net};
use fort_tests::oidc::OidcProvider;

use crate::fleet::{self, Lane};

/// Where the lane's fleet expects the OpenID provider (nixos-module/tests/lane/fleet.nix).
const PORT: u16 = 7443;

/// Starts the OpenID provider where the lane's fleet expects it, and gives `forge` its
/// TLS root and initial access token.
pub fn start_oidc(net: &Net, forge: &Machine) -> Result<OidcProvider, String> {
    let p = OidcProvider::start_in_namespace(&net.path(), PORT, &|a| net.reachable(a))?;
    forge.write(
        "/etc/lane/oidc-ca.pem",
        std::fs::read(&p.ca_file).expect("the provider's TLS root"),
        0o644,
    );
    // As a secret deployment tool would place it: root's alone.
    forge.write(
        "/etc/lane/oidc-token",
        format!("{}\n", p.initial_token),
        0o400,
    );
    Ok(p)
}

/// Whether `client_id` and `secret` get an access token at `provider` (curl in `netns`).
pub fn gets_token(
    netns: Option<&std::path::Path>,
    provider: &OidcProvider,
    client_id: &str,
    secret: &str,
) -> Result<(), String> {
    let out = fort_tests::command_in(netns, "curl")
        .args(["-sS", "--max-time", "10", "--cacert"])
        .arg(&provider.ca_file)
        .args(["-u", &format!("{client_id}:{secret}")])
        .args(["-d", "grant_type=client_credentials"])
        .arg(provider.token_endpoint())
        .output()
        .expect("curl");
    let answer: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    if answer["access_token"]
        .as_str()
        .is_some_and(|t| !t.is_empty())
    {
        Ok(())
    } else {
        Err(format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

#[test]
fn oidc_client_is_registered_and_gets_a_token_under_systemd() {
    let test = "oidc_client_is_registered_and_gets_a_token_under_systemd";
    let mut provider: Option<OidcProvider> = None;
    let mut netns = None;
    let Some(lane) = Lane::boot_trees(
        test,
        "clients/forge",
        "clients/app",
        &mut |net, forge, _| {
            if Command::new("curl").arg("--version").output().is_err() {
                return Err("curl is not installed (it asks the provider for a token)".into());
            }
            netns = Some(net.path());
            provider = Some(start_oidc(net, forge)?);
            Ok(())
        },
    ) else {
        return;
    };
    let (forge, app) = (&lane.forge, &lane.app);
    let provider = provider.as_ref().expect("started before the machines");
    fleet::wait_need_satisfied(app, "oidc/lane");
    let client_id = app.succeed("cat /run/fort/needs/oidc/lane/client_id");
    let secret = app.succeed("cat /run/fort/needs/oidc/lane/client_secret");
    assert!(!client_id.is_empty() && !secret.is_empty());

    // The credentials app holds get a token at the provider.
    if let Err(e) = gets_token(netns.as_deref(), provider, &client_id, &secret) {
        panic!("no token for app's client: {e}");
    }
    // The registration access token stays in the handler's state, private, under the
    // sandbox; the secret and the initial access token are in no log line.
    fleet::assert_private_under_sandbox(forge, "/var/lib/fort/handlers/oidc.json", "600");
    for (host, m) in [("forge", forge), ("app", app)] {
        let journal = m.journal("fort-agent.service", 2000);
        assert!(
            !journal.contains(&secret),
            "the client secret is in {host}'s log"
        );
        assert!(
            !journal.contains(&provider.initial_token),
            "the initial access token is in {host}'s log"
        );
    }
    drop(lane);
}
