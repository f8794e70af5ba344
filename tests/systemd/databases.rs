//! The `postgres` capability under systemd: forge's agent (strictSandbox) runs
//! `fort-handler postgres`, connecting over the server's Unix socket as its admin role by
//! peer authentication, as the NixOS module declares it
//! (`fort.host.capabilities.postgres.postgres`); app holds a database's credentials, and
//! they log in.

use fort_tests::lane::Machine;
use fort_tests::postgres::Postgres;

use crate::fleet::{self, Lane};

/// The port the lane's fleet names (nixos-module/tests/lane/fleet.nix): fixed, since the
/// configuration is written before the test runs, and outside the ephemeral range other
/// tests' free ports come from.
const PORT: u16 = 25432;

/// Starts the lane's PostgreSQL server and shows `forge` its socket directory, where
/// forge's NixOS would have /run/postgresql.
pub fn start_postgres(forge: &mut Machine) -> Result<Postgres, String> {
    let pg = Postgres::start_on(false, PORT)?;
    forge.bind_ro(&pg.socket_dir(), "/run/lane-postgresql");
    Ok(pg)
}

#[test]
fn postgres_database_logs_in_under_systemd() {
    let test = "postgres_database_logs_in_under_systemd";
    let mut server: Option<Postgres> = None;
    let Some(lane) = Lane::boot_trees(
        test,
        "databases/forge",
        "databases/app",
        &mut |_, forge, _| {
            server = Some(start_postgres(forge)?);
            Ok(())
        },
    ) else {
        return;
    };
    let (forge, app) = (&lane.forge, &lane.app);
    let pg = server.as_ref().expect("started before the machines");
    fleet::wait_need_satisfied(app, "postgres/wiki");
    let connection: serde_json::Value =
        serde_json::from_str(&app.succeed("cat /run/fort/needs/postgres/wiki/connection.json"))
            .expect("the credentials as JSON");
    let password = app.succeed("cat /run/fort/needs/postgres/wiki/password");
    assert_eq!(connection["password"], password.as_str());
    assert_eq!(connection["port"], PORT);
    let (user, db) = (
        connection["user"].as_str().expect("user"),
        connection["dbname"].as_str().expect("dbname"),
    );
    // The delivered password logs in to the delivered database, which the role owns.
    let owner = pg
        .login(
            user,
            &password,
            db,
            "SELECT pg_get_userbyid(datdba) FROM pg_database WHERE datname = current_database()",
        )
        .expect("the delivered credentials log in");
    assert_eq!(owner.trim(), user);
    assert!(pg.login(user, "wrong", db, "SELECT 1").is_err());
    // The handler kept its state in the agent's state directory, under the sandbox, and
    // the password is in no log line.
    fleet::assert_private_under_sandbox(forge, "/var/lib/fort/handlers/postgres.json", "600");
    for (host, m) in [("forge", forge), ("app", app)] {
        assert!(
            !m.journal("fort-agent.service", 2000).contains(&password),
            "the password is in {host}'s log"
        );
    }
    drop(lane);
}
