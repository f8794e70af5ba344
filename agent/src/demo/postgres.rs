//! The demo's PostgreSQL step: where PostgreSQL is installed, the demo makes a scratch
//! cluster in a temporary directory of its own (run as the `postgres` user when the demo
//! runs as root: the server refuses root) and forge also serves `db` with `fort-handler
//! postgres`; app's need gets a role and a database there, and the delivered URI logs in
//! with `psql`. `pg_ctl` detaches the server from the demo, so the demo stops it with
//! `pg_ctl stop` when it ends. Without PostgreSQL the step says so.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};
use serde_json::json;

use super::fleet::{CapDecl, Fleet, NeedDecl};
use super::steps::{need_row, Wait};
use crate::admin::AdminRequest;

pub(super) const NEED: &str = "db/wiki";
/// The walkthrough step that adds [`NEED`].
pub(super) const STEP: usize = 9;
/// The role the handler connects as (peer authentication over the socket).
const ADMIN: &str = "fort_admin";

/// A PostgreSQL cluster the demo started; stopped, and its directory removed, when
/// dropped.
pub(super) struct DemoPostgres {
    bin: PathBuf,
    /// uid and gid the server runs as, when not the demo's own.
    user: Option<(u32, u32)>,
    port: u16,
    // Last: removed once the server is stopped.
    dir: tempfile::TempDir,
}

/// `initdb`, `pg_ctl` and `psql`: the newest Debian `/usr/lib/postgresql/*/bin`, else
/// the `PATH`.
fn find_bin() -> Option<PathBuf> {
    let mut debian: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").is_file().then_some((version, bin))
        })
        .collect();
    debian.sort();
    debian.pop().map(|(_, bin)| bin).or_else(|| {
        let path = std::env::var_os("PATH")?;
        std::env::split_paths(&path).find(|d| d.join("initdb").is_file())
    })
}

/// `id ARGS`' one line of output.
fn id(args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new("id")
        .args(args)
        .output()
        .context("cannot run id")?;
    if !out.status.success() {
        bail!(
            "id {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8(out.stdout)?.trim().to_owned())
}

impl DemoPostgres {
    /// Makes and starts the cluster; `Ok(None)` when PostgreSQL is not installed.
    pub(super) fn start() -> anyhow::Result<Option<DemoPostgres>> {
        let Some(bin) =
            find_bin().filter(|b| b.join("pg_ctl").is_file() && b.join("psql").is_file())
        else {
            return Ok(None);
        };
        let user = if id(&["-u"])? == "0" {
            let uid = id(&["-u", "postgres"]).context("running as root, with no postgres user")?;
            Some((uid.parse()?, id(&["-g", "postgres"])?.parse()?))
        } else {
            None
        };
        let dir = tempfile::Builder::new().prefix("fort-demo-pg-").tempdir()?;
        if let Some((uid, gid)) = user {
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid))?;
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let pg = DemoPostgres {
            bin,
            user,
            port,
            dir,
        };
        let data = pg.data();
        let data_arg = data.display().to_string();
        pg.run(
            "initdb",
            &[
                "-D",
                &data_arg,
                "-U",
                "postgres",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
                "--auth=trust",
            ],
        )?;
        // The superuser by trust on the socket (the demo's own setup), the handler's admin
        // role by peer authentication of the user the agents run as, consumers by
        // password over TCP.
        std::fs::write(
            data.join("pg_hba.conf"),
            "local all postgres trust\nlocal all all peer map=fort\n\
             host all all 127.0.0.1/32 scram-sha-256\n",
        )?;
        std::fs::write(
            data.join("pg_ident.conf"),
            format!("fort {} {ADMIN}\n", id(&["-un"])?),
        )?;
        let conf = format!(
            "\nport = {port}\nunix_socket_directories = '{}'\nlisten_addresses = '127.0.0.1'\n\
             password_encryption = 'scram-sha-256'\nfsync = off\nsynchronous_commit = off\n",
            pg.dir.path().display()
        );
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(data.join("postgresql.conf"))?;
        std::io::Write::write_all(&mut file, conf.as_bytes())?;
        let log = pg.dir.path().join("server.log").display().to_string();
        pg.run(
            "pg_ctl",
            &["-D", &data_arg, "-l", &log, "-w", "-t", "60", "start"],
        )?;
        pg.psql(
            &["-U", "postgres", "-d", "postgres"],
            &format!("CREATE ROLE {ADMIN} LOGIN CREATEROLE CREATEDB"),
        )?;
        Ok(Some(pg))
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// `tool` as the server's user, in its directory.
    fn run(&self, tool: &str, args: &[&str]) -> anyhow::Result<String> {
        let mut command = Command::new(self.bin.join(tool));
        command.args(args).current_dir(self.dir.path());
        if let Some((uid, gid)) = self.user {
            command.uid(uid).gid(gid);
        }
        let out = command
            .output()
            .with_context(|| format!("cannot run {tool}"))?;
        if !out.status.success() {
            bail!(
                "{tool} failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    /// `psql CONNECTION -c SQL` over the socket (`connection` starting with `-U`) or to a
    /// URI: one line of unaligned output.
    fn psql(&self, connection: &[&str], sql: &str) -> anyhow::Result<String> {
        let mut command = Command::new(self.bin.join("psql"));
        if connection.first() == Some(&"-U") {
            command
                .arg("-h")
                .arg(self.dir.path())
                .args(["-p", &self.port.to_string()]);
        }
        let out = command
            .args(["-X", "-w", "-q", "-At", "-v", "ON_ERROR_STOP=1"])
            .args(connection)
            .args(["-c", sql])
            .env_remove("PGPASSWORD")
            .output()
            .context("cannot run psql")?;
        if !out.status.success() {
            bail!("psql: {}", String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    /// forge's `db` capability (`fort-handler postgres` on this cluster) and app's need
    /// for a database, added by the step.
    pub(super) fn declarations(&self, root: &Path) -> anyhow::Result<(CapDecl, NeedDecl)> {
        let handler = std::env::current_exe()?.with_file_name("fort-handler");
        if !handler.is_file() {
            bail!("{} is not built", handler.display());
        }
        let dir = root.join("postgres");
        std::fs::create_dir_all(&dir)?;
        let config = dir.join("postgres.json");
        std::fs::write(
            &config,
            json!({
                "state_file": root.join("forge/state/postgres-roles.json"),
                "host": "127.0.0.1",
                "socket_dir": self.dir.path(),
                "port": self.port,
                "admin_role": ADMIN,
            })
            .to_string(),
        )?;
        let cap = CapDecl {
            host: "forge",
            name: "db",
            handler: "",
            command: Some((
                handler,
                vec![
                    "postgres".into(),
                    "--config".into(),
                    config.display().to_string(),
                ],
            )),
            cache_response: true,
            description: "a PostgreSQL database and login role per need",
        };
        let need = NeedDecl {
            consumer: "app",
            key: NEED,
            from: "forge",
            request: json!({}),
            handler: None,
            files: vec![("uri", "/uri", "0400")],
            more: json!({}),
            added_in: Some(STEP),
            released_in: None,
        };
        Ok((cap, need))
    }
}

impl Drop for DemoPostgres {
    fn drop(&mut self) {
        let data = self.data().display().to_string();
        if let Err(e) = self.run(
            "pg_ctl",
            &["-D", &data, "-m", "fast", "-w", "-t", "60", "stop"],
        ) {
            eprintln!("PostgreSQL did not stop: {e:#}");
        }
    }
}

/// The step: app's database is made at forge's PostgreSQL and its delivered URI logs in.
pub(super) async fn step(fleet: &Fleet, pg: Option<&DemoPostgres>) -> anyhow::Result<String> {
    let Some(pg) = pg else {
        println!("  PostgreSQL is not installed (or could not be started, as said at the start):");
        println!("  no database server to make a database on.");
        return Ok("skipped: no PostgreSQL".into());
    };
    println!(
        "  PostgreSQL runs on 127.0.0.1:{} (a scratch cluster in {});",
        pg.port,
        pg.dir.path().display()
    );
    println!("  forge serves db with fort-handler postgres; app declares {NEED}: {{}}.");
    fleet.declare_at("app", STEP)?;
    fleet
        .admin("app", &AdminRequest::Reload)
        .await
        .context("reload app")?;
    let wait = Wait::until("app holds a database at forge's PostgreSQL");
    loop {
        if need_row(fleet, NEED).await?["satisfied"] == true {
            break;
        }
        wait.tick().await?;
    }
    let path = fleet.delivered(NEED, "uri");
    let uri = std::fs::read_to_string(&path).with_context(|| format!("{NEED} has no uri"))?;
    let who = pg
        .psql(
            &[uri.trim()],
            "SELECT current_user || ' in ' || current_database()",
        )
        .context("the delivered URI does not log in")?;
    println!(
        "  app/run/needs/{NEED}/uri   postgresql://{who_user}:…@127.0.0.1:{}/…",
        pg.port,
        who_user = who.split(' ').next().unwrap_or("?")
    );
    println!("  psql with it: {who}");
    Ok(format!("a database made for app, logged in as {who}"))
}
