//! A scratch PostgreSQL cluster for tests and benchmarks: `initdb` in a temporary
//! directory, its Unix socket there and a free loopback port, run as the `postgres` system
//! user when the tests run as root (the server refuses to run as root), stopped on drop
//! and however the test ends (`pg_ctl` detaches the server from the test: only
//! `pg_ctl stop` ends it; crate::cleanup).
//!
//! Authentication as a provider would set it up: the superuser `postgres` by trust on the
//! socket (for the test's own setup), the handler's admin role `fort_admin` (CREATEROLE,
//! CREATEDB) by peer authentication mapped from the user running the tests, the role
//! `fort_pwadmin` by password on the socket, and every other role by SCRAM over TCP.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The admin role the handler connects as (peer authentication).
pub const ADMIN: &str = "fort_admin";
/// An admin role that authenticates by password on the socket.
pub const PASSWORD_ADMIN: &str = "fort_pwadmin";

pub struct Postgres {
    dir: tempfile::TempDir,
    bin: PathBuf,
    /// uid and gid the server runs as, when not the test's own.
    user: Option<(u32, u32)>,
    pub port: u16,
    _on_signal: Option<crate::cleanup::OnSignal>,
}

/// The directory of `initdb`, `pg_ctl` and `psql`: `$FORT_PG_BIN`, the newest
/// `/usr/lib/postgresql/*/bin` (Debian), or the `PATH` (NixOS).
fn find_bin() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("FORT_PG_BIN") {
        return Some(PathBuf::from(dir));
    }
    let mut debian: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let v = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((v, bin))
        })
        .collect();
    debian.sort();
    if let Some((_, bin)) = debian.pop() {
        return Some(bin);
    }
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p).find(|d| d.join("initdb").exists() && d.join("pg_ctl").exists())
    })
}

fn id(args: &[&str]) -> Option<u32> {
    let out = Command::new("id").args(args).output().ok()?;
    String::from_utf8(out.stdout).ok()?.trim().parse().ok()
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

impl Postgres {
    /// A fresh cluster, started; `Err` says why there is none (no PostgreSQL installed,
    /// no `postgres` user to run it as root). `durable: false` turns fsync off (tests);
    /// benchmarks keep the server's defaults.
    pub fn start(durable: bool) -> Result<Postgres, String> {
        Postgres::start_on(durable, crate::free_addr("127.0.0.1").port())
    }

    /// The same on a given TCP port (its socket is `.s.PGSQL.<port>` in [`Self::socket_dir`]),
    /// for a configuration written before the test runs (the systemd lane's); pick one
    /// outside the ephemeral range, where free ports are found.
    pub fn start_on(durable: bool, port: u16) -> Result<Postgres, String> {
        let bin = find_bin().ok_or("PostgreSQL is not installed (no initdb)")?;
        let me = id(&["-u"]).ok_or("cannot run `id -u`")?;
        let user = if me == 0 {
            let uid =
                id(&["-u", "postgres"]).ok_or("running as root and there is no postgres user")?;
            let gid = id(&["-g", "postgres"]).ok_or("no group of the postgres user")?;
            Some((uid, gid))
        } else {
            None
        };
        let dir = tempfile::Builder::new()
            .prefix("fort-pg")
            .tempdir()
            .map_err(|e| e.to_string())?;
        if let Some((uid, gid)) = user {
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid))
                .map_err(|e| e.to_string())?;
        }
        let mut pg = Postgres {
            dir,
            bin,
            user,
            port,
            _on_signal: None,
        };
        let data = pg.data();
        pg.run_as_server(
            "initdb",
            &[
                "-D",
                &data.to_string_lossy(),
                "-U",
                "postgres",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
                "--auth=trust",
            ],
        )?;
        let os_user = String::from_utf8_lossy(
            &Command::new("id")
                .arg("-un")
                .output()
                .map_err(|e| e.to_string())?
                .stdout,
        )
        .trim()
        .to_owned();
        std::fs::write(
            data.join("pg_hba.conf"),
            format!(
                "local all postgres trust\nlocal all {PASSWORD_ADMIN} scram-sha-256\n\
                 local all all peer map=fort\nhost all all 127.0.0.1/32 scram-sha-256\n"
            ),
        )
        .map_err(|e| e.to_string())?;
        std::fs::write(
            data.join("pg_ident.conf"),
            format!("fort {os_user} {ADMIN}\n"),
        )
        .map_err(|e| e.to_string())?;
        let mut conf = format!(
            "\nport = {port}\nunix_socket_directories = '{}'\nlisten_addresses = '127.0.0.1'\n\
             max_connections = 200\npassword_encryption = 'scram-sha-256'\n",
            pg.socket_dir().display()
        );
        if !durable {
            // And little WAL kept: each database made copies its template into the WAL.
            conf.push_str(
                "fsync = off\nsynchronous_commit = off\nfull_page_writes = off\n\
                 max_wal_size = '64MB'\nmin_wal_size = '32MB'\n",
            );
        }
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(data.join("postgresql.conf"))
            .map_err(|e| e.to_string())?;
        std::io::Write::write_all(&mut f, conf.as_bytes()).map_err(|e| e.to_string())?;
        let (bin, dir, user) = (pg.bin.clone(), pg.dir.path().to_owned(), pg.user);
        pg._on_signal = Some(crate::cleanup::on_signal(move || {
            let _ = run_as(
                &bin,
                &dir,
                user,
                "pg_ctl",
                &immediate_stop(&dir.join("data")),
            );
        }));
        pg.run_as_server(
            "pg_ctl",
            &[
                "-D",
                &data.to_string_lossy(),
                "-l",
                &pg.dir.path().join("server.log").to_string_lossy(),
                "-w",
                "-t",
                "60",
                "start",
            ],
        )?;
        pg.superuser(&format!(
            "CREATE ROLE {ADMIN} LOGIN CREATEROLE CREATEDB; \
             CREATE ROLE {PASSWORD_ADMIN} LOGIN CREATEROLE CREATEDB PASSWORD 'admin-secret'"
        ))?;
        Ok(pg)
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// The directory holding the server's Unix socket.
    pub fn socket_dir(&self) -> PathBuf {
        self.dir.path().to_path_buf()
    }

    /// The scratch directory (the server's log is `server.log` in it).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    fn run_as_server(&self, tool: &str, args: &[&str]) -> Result<String, String> {
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        run_as(&self.bin, self.dir.path(), self.user, tool, &args)
    }

    fn psql_command(&self) -> Command {
        let mut cmd = Command::new(self.bin.join("psql"));
        cmd.env_remove("PGPASSWORD")
            .env("PGCONNECT_TIMEOUT", "10")
            .args(["-X", "-w", "-q", "-At", "-v", "ON_ERROR_STOP=1"]);
        cmd
    }

    /// Runs `sql` as the superuser over the socket: the test's own setup and inspection.
    pub fn superuser(&self, sql: &str) -> Result<String, String> {
        self.superuser_in("postgres", sql)
    }

    /// Runs `sql` as the superuser in database `db`.
    pub fn superuser_in(&self, db: &str, sql: &str) -> Result<String, String> {
        let out = self
            .psql_command()
            .arg("-h")
            .arg(self.socket_dir())
            .args([
                "-p",
                &self.port.to_string(),
                "-U",
                "postgres",
                "-d",
                db,
                "-c",
                sql,
            ])
            .output()
            .map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
        } else {
            Err(text(&out))
        }
    }

    /// Logs in as a user would: `psql` over TCP to 127.0.0.1 with `password`, running `sql`.
    pub fn login(&self, user: &str, password: &str, db: &str, sql: &str) -> Result<String, String> {
        self.login_to("127.0.0.1", self.port, user, password, db, sql)
    }

    /// `psql -h host -p port` with a password, as a consumer given those values would.
    pub fn login_to(
        &self,
        host: &str,
        port: u16,
        user: &str,
        password: &str,
        db: &str,
        sql: &str,
    ) -> Result<String, String> {
        let out = self
            .psql_command()
            .env("PGPASSWORD", password)
            .args([
                "-h",
                host,
                "-p",
                &port.to_string(),
                "-U",
                user,
                "-d",
                db,
                "-c",
                sql,
            ])
            .output()
            .map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
        } else {
            Err(text(&out))
        }
    }

    /// A session a consumer holds open with its credentials: `psql` over TCP in `db`,
    /// connected until the returned guard is dropped (its process is killed then).
    pub fn session(&self, user: &str, password: &str, db: &str) -> Session {
        self.open_session(user, password, db, "SELECT pg_sleep(600)", "true")
    }

    /// A session that runs `sql` in a transaction it keeps open (holding every lock
    /// `sql` took) until the guard is dropped: a consumer's way of making the server wait.
    pub fn session_holding(&self, user: &str, password: &str, db: &str, sql: &str) -> Session {
        let held = format!("BEGIN; {sql}; SELECT pg_sleep(600)");
        // A transaction that wrote has its id: `sql` is done and its locks are held.
        self.open_session(user, password, db, &held, "backend_xid IS NOT NULL")
    }

    fn open_session(
        &self,
        user: &str,
        password: &str,
        db: &str,
        sql: &str,
        ready: &str,
    ) -> Session {
        let mut session = crate::cleanup::Running::spawn(
            self.psql_command()
                .env("PGPASSWORD", password)
                .args([
                    "-h",
                    "127.0.0.1",
                    "-p",
                    &self.port.to_string(),
                    "-U",
                    user,
                    "-d",
                    db,
                ])
                .args(["-c", sql])
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped()),
            fort_core::process::Stop::TERM,
        )
        .expect("psql starts");
        // Ready once the server lists the session as asked; a psql that could not
        // connect, or whose `sql` failed, exits first.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
        loop {
            let sql = format!(
                "SELECT count(*) FROM pg_stat_activity WHERE usename = '{user}' AND datname = '{db}' AND {ready}"
            );
            if self.superuser(&sql).is_ok_and(|n| n != "0") {
                break;
            }
            if let Some(status) = session.exited() {
                let mut err = String::new();
                if let Some(mut e) = session.child_mut().stderr.take() {
                    let _ = std::io::Read::read_to_string(&mut e, &mut err);
                }
                panic!("psql as {user} in {db} ended ({status}): {err}");
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no session of {user} in {db}"
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        Session { _psql: session }
    }

    /// `psql` with a connection URI, as a consumer given the `uri` would.
    pub fn login_uri(&self, uri: &str, sql: &str) -> Result<String, String> {
        let out = self
            .psql_command()
            .args([uri, "-c", sql])
            .output()
            .map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
        } else {
            Err(text(&out))
        }
    }

    /// Stops the server now (a backend that is down); `start_again` brings it back.
    pub fn stop(&self) -> Result<(), String> {
        self.run_as_server(
            "pg_ctl",
            &[
                "-D",
                &self.data().to_string_lossy(),
                "-m",
                "fast",
                "-w",
                // A cluster holding hundreds of databases (the benchmark's) takes longer
                // than pg_ctl's default minute to shut down.
                "-t",
                "300",
                "stop",
            ],
        )
        .map(|_| ())
    }

    pub fn start_again(&self) -> Result<(), String> {
        self.run_as_server(
            "pg_ctl",
            &[
                "-D",
                &self.data().to_string_lossy(),
                "-l",
                &self.dir.path().join("server.log").to_string_lossy(),
                "-w",
                "-t",
                "60",
                "start",
            ],
        )
        .map(|_| ())
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let _ = run_as(
            &self.bin,
            self.dir.path(),
            self.user,
            "pg_ctl",
            &immediate_stop(&self.data()),
        );
    }
}

/// `tool` from `bin` in `dir`, as `user` when there is one: its output, or why it failed.
fn run_as(
    bin: &Path,
    dir: &Path,
    user: Option<(u32, u32)>,
    tool: &str,
    args: &[String],
) -> Result<String, String> {
    let mut cmd = Command::new(bin.join(tool));
    cmd.args(args).current_dir(dir);
    if let Some((uid, gid)) = user {
        cmd.uid(uid).gid(gid);
    }
    let out = cmd.output().map_err(|e| format!("{tool}: {e}"))?;
    if out.status.success() {
        Ok(text(&out))
    } else {
        Err(format!("{tool} failed: {}", text(&out)))
    }
}

/// `pg_ctl`'s arguments to stop the cluster in `data` at once, waiting until it is down.
fn immediate_stop(data: &Path) -> Vec<String> {
    let data = data.to_string_lossy().into_owned();
    ["-D", &data, "-m", "immediate", "-w", "-t", "300", "stop"]
        .map(str::to_owned)
        .to_vec()
}

/// A consumer's open session (`Postgres::session`); ended on drop.
pub struct Session {
    _psql: crate::cleanup::Running,
}
