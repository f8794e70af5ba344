//! The admin connection to the provider's PostgreSQL (its Unix socket, `tokio-postgres`):
//! making a role and its database, changing its password, releasing it, and reading what
//! exists. Values travel as bound parameters; the statements that cannot take parameters
//! (`CREATE ROLE`, `ALTER ROLE … PASSWORD`, `COMMENT`) get quoted identifiers and
//! literals, and only names this handler checked against its own grammar.

use std::collections::HashMap;
use std::time::Duration;

use tokio_postgres::{Client, NoTls};

use super::config::Config;
use super::names::{quote_ident, quote_literal};

/// Why one entry's server work did not happen.
#[derive(Debug)]
pub enum Failure {
    /// The server (or what exists on it) rejects this entry: refused, others go on.
    Refused(String),
    /// The server is unreachable or failing: the run fails and nothing is revoked.
    Down(anyhow::Error),
    /// A lock on the entry's own role or database was not free within `lock_timeout`
    /// (a session of its consumer holds it): the entry waits for a later run.
    Waited(String),
}

impl Failure {
    /// Sorts a server error: a rejected statement refuses the entry; a lost connection, a
    /// server shutting down or out of resources fails the run.
    fn from_pg(what: &str, e: tokio_postgres::Error) -> Failure {
        let Some(db) = e.as_db_error() else {
            return Failure::Down(anyhow::anyhow!("{what}: {e}"));
        };
        // 55P03 lock_not_available: `lock_timeout` ran out.
        if db.code().code() == "55P03" {
            return Failure::Waited(format!("{what}: {}", db.message()));
        }
        let class = &db.code().code()[..2];
        // 08 connection, 53 resources, 57 operator intervention, 58 system, XX internal.
        if matches!(class, "08" | "53" | "57" | "58" | "XX") {
            return Failure::Down(anyhow::anyhow!("{what}: {}", db.message()));
        }
        Failure::Refused(format!("{what}: {}", db.message()))
    }
}

/// What the server holds under one name, as far as this handler cares.
#[derive(Debug, Clone, PartialEq)]
pub struct Seen {
    pub can_login: bool,
    pub connection_limit: i32,
    /// The role's comment (this handler's marker on its own roles).
    pub comment: Option<String>,
    /// A database of that name owned by that role exists.
    pub database: bool,
}

/// What releasing a role found.
#[derive(Debug, PartialEq)]
pub enum Released {
    /// Disabled (or dropped) as asked.
    Done,
    /// The role is gone already: nothing to do.
    Gone,
    /// A role of that name exists without this handler's marker: not touched.
    NotOurs,
}

pub struct Server {
    client: Client,
    /// Other providers make roles on this server too (`peers`): each role's work runs
    /// under the server's advisory lock for its name, so a peer's takeover and this
    /// handler's release of one role never interleave.
    shared: bool,
}

/// What `ensure` did to a role that existed already.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ensured {
    /// Made, or this handler's own: set up as asked.
    Ours,
    /// Made by a peer for this very entry: marked as this handler's and set up as asked.
    TakenOver,
}

/// The advisory lock class of this handler's per-role locks ("fort"), the second key
/// being the hash of the role's name: apart from any lock the server's other users take
/// with one key.
const LOCK_CLASS: i32 = 0x666f_7274;

/// How many connections the server has, and how many of them the callers' roles share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    pub max_connections: i64,
    /// Kept for superusers (`superuser_reserved_connections`).
    pub superuser_reserved: i64,
    /// Kept for roles of `pg_use_reserved_connections` (`reserved_connections`, from
    /// PostgreSQL 16; 0 before).
    pub reserved: i64,
    /// Whether the admin role is a superuser: if not, its own connection is one of those
    /// the callers' roles use too.
    pub admin_is_superuser: bool,
}

impl Capacity {
    /// Connections left for the callers' roles.
    pub fn for_callers(&self) -> i64 {
        self.max_connections
            .saturating_sub(self.superuser_reserved)
            .saturating_sub(self.reserved)
            .saturating_sub(i64::from(!self.admin_is_superuser))
    }

    /// What to tell the operator when the `callers`' roles, whose limits add up to
    /// `total`, may together hold more connections than the server leaves them: then
    /// callers using their whole share can leave another (and this handler, unless its
    /// role is a superuser) without one. Other users of the server are not known here;
    /// what they need comes on top.
    pub fn shortfall(&self, config: &Config, total: i64, callers: usize) -> Option<String> {
        let left = self.for_callers();
        if total <= left {
            return None;
        }
        let reserved = if self.reserved > 0 {
            format!(" − reserved_connections {}", self.reserved)
        } else {
            String::new()
        };
        let (admin, and_this_handler) = if self.admin_is_superuser {
            (String::new(), "")
        } else {
            (
                format!(" − 1 for {}, not a superuser", config.admin_role),
                ", and this handler,",
            )
        };
        Some(format!(
            "the connection limits of {callers} callers' roles add up to {total} \
             (connections_per_caller {}), more than the {left} the server leaves them \
             (max_connections {} − superuser_reserved_connections {}{reserved}{admin}): \
             callers using their whole share can leave others{and_this_handler} without a \
             connection; raise max_connections or lower connections_per_caller",
            config.connections_per_caller, self.max_connections, self.superuser_reserved,
        ))
    }
}

impl Server {
    /// Connects as the admin role over the socket; failing to is the run's failure.
    pub async fn connect(config: &Config) -> anyhow::Result<Server> {
        let mut pg = tokio_postgres::Config::new();
        pg.host_path(&config.socket_dir)
            .port(config.port)
            .user(&config.admin_role)
            .dbname(&config.admin_database)
            .application_name("fort-handler")
            .connect_timeout(Duration::from_secs(10));
        if let Some(file) = &config.admin_password_file {
            pg.password(crate::common::config::read_secret(file)?);
        }
        let (client, connection) = pg.connect(NoTls).await.map_err(|e| {
            anyhow::anyhow!(
                "cannot connect to PostgreSQL at {}/.s.PGSQL.{} as {}: {e}",
                config.socket_dir.display(),
                config.port,
                config.admin_role
            )
        })?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::warn!("PostgreSQL connection: {e}");
            }
        });
        // A lock held elsewhere (a consumer's open transaction on its own role or
        // database) costs that entry a few seconds, never the run's budget.
        client
            .batch_execute("SET lock_timeout = '5s'; SET statement_timeout = '30s'")
            .await
            .map_err(|e| anyhow::anyhow!("cannot set up the admin session: {e}"))?;
        Ok(Server {
            client,
            shared: !config.peers.is_empty(),
        })
    }

    /// Holds the advisory lock of role `name` (waiting at most `lock_timeout`) while
    /// `work` runs, when peers share the server; released after it, or with the session.
    async fn locked<T>(
        &self,
        name: &str,
        work: impl std::future::Future<Output = Result<T, Failure>>,
    ) -> Result<T, Failure> {
        if !self.shared {
            return work.await;
        }
        self.client
            .execute(
                "SELECT pg_advisory_lock($1, hashtext($2))",
                &[&LOCK_CLASS, &name],
            )
            .await
            .map_err(|e| Failure::from_pg("waiting for a peer's work on the role", e))?;
        let done = work.await;
        if let Err(e) = self
            .client
            .execute(
                "SELECT pg_advisory_unlock($1, hashtext($2))",
                &[&LOCK_CLASS, &name],
            )
            .await
        {
            // Released with the session at the end of the run at the latest.
            tracing::warn!("{name}: cannot release its advisory lock: {e}");
        }
        done
    }

    /// Whether the admin connection still answers: after one entry's statement failed
    /// in a way that may be the server's, this tells a server that is down (the run
    /// fails) from a failure that was that entry's alone.
    pub async fn alive(&self) -> bool {
        self.client.simple_query("SELECT 1").await.is_ok()
    }

    /// The server's connection settings and whether the admin role is a superuser.
    pub async fn capacity(&self) -> Result<Capacity, Failure> {
        let row = self
            .client
            .query_one(
                "SELECT current_setting('max_connections')::bigint, \
                        current_setting('superuser_reserved_connections')::bigint, \
                        coalesce(current_setting('reserved_connections', true), '0')::bigint, \
                        (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)",
                &[],
            )
            .await
            .map_err(|e| Failure::from_pg("reading max_connections", e))?;
        Ok(Capacity {
            max_connections: row.get(0),
            superuser_reserved: row.get(1),
            reserved: row.get(2),
            admin_is_superuser: row.get::<_, Option<bool>>(3).unwrap_or(false),
        })
    }

    /// What exists under `names` (roles, with their database), in one query.
    pub async fn survey(&self, names: &[String]) -> Result<HashMap<String, Seen>, Failure> {
        let rows = self
            .client
            .query(
                "SELECT r.rolname::text, r.rolcanlogin, r.rolconnlimit, \
                        shobj_description(r.oid, 'pg_authid'), \
                        EXISTS (SELECT 1 FROM pg_database d \
                                WHERE d.datname = r.rolname AND d.datdba = r.oid) \
                 FROM pg_roles r WHERE r.rolname = ANY($1::text[])",
                &[&names],
            )
            .await
            .map_err(|e| Failure::from_pg("reading roles", e))?;
        Ok(rows
            .iter()
            .map(|r| {
                (
                    r.get::<_, String>(0),
                    Seen {
                        can_login: r.get(1),
                        connection_limit: r.get(2),
                        comment: r.get(3),
                        database: r.get(4),
                    },
                )
            })
            .collect())
    }

    /// Makes role `name` and its database exist, marked `marker`, with `LOGIN`, the
    /// password `password` (sent as its SCRAM-SHA-256 verifier) and `connection_limit`.
    /// A role that carries one of `adopt` (a peer's marker for this same entry) is taken
    /// over: marked as this handler's, with the new password. Any other role or database
    /// of that name that this handler did not make is never touched: the entry is
    /// refused instead.
    pub async fn ensure(
        &self,
        name: &str,
        marker: &str,
        adopt: &[String],
        password: &str,
        connection_limit: i32,
    ) -> Result<Ensured, Failure> {
        self.locked(
            name,
            self.ensure_now(name, marker, adopt, password, connection_limit),
        )
        .await
    }

    async fn ensure_now(
        &self,
        name: &str,
        marker: &str,
        adopt: &[String],
        password: &str,
        connection_limit: i32,
    ) -> Result<Ensured, Failure> {
        let ident = ident(name)?;
        let role = self
            .client
            .query_opt(
                "SELECT shobj_description(oid, 'pg_authid') FROM pg_roles WHERE rolname = $1",
                &[&name],
            )
            .await
            .map_err(|e| Failure::from_pg("reading the role", e))?
            .map(|r| r.get::<_, Option<String>>(0));
        let taken_over = match &role {
            Some(Some(comment)) if comment == marker => false,
            Some(Some(comment)) if adopt.contains(comment) => true,
            Some(_) => {
                return Err(Failure::Refused(format!(
                    "role {name} exists and was not made by fort for this entry"
                )));
            }
            None => false,
        };
        let owner = self
            .client
            .query_opt(
                "SELECT pg_get_userbyid(datdba)::text FROM pg_database WHERE datname = $1",
                &[&name],
            )
            .await
            .map_err(|e| Failure::from_pg("reading the database", e))?
            .map(|r| r.get::<_, String>(0));
        if let Some(owner) = &owner {
            if owner != name || role.is_none() {
                return Err(Failure::Refused(format!(
                    "database {name} exists and belongs to {owner}"
                )));
            }
        }
        let comment = literal(marker)?;
        if role.is_none() {
            // Without LOGIN until its database exists: a run stopped half-way leaves a
            // marked role nobody can use, which the next run adopts.
            self.exec(
                "creating the role",
                &format!(
                    "CREATE ROLE {ident} NOLOGIN; COMMENT ON ROLE {ident} IS {comment}; \
                     GRANT {ident} TO CURRENT_USER"
                ),
            )
            .await?;
        }
        if owner.is_none() {
            // CREATE DATABASE … OWNER wants the admin to be a member of the owner role.
            if role.is_some() {
                self.exec(
                    "joining the role",
                    &format!("GRANT {ident} TO CURRENT_USER"),
                )
                .await?;
            }
            self.exec(
                "creating the database",
                // From template0, which nobody may connect to: a database is copied only
                // while no session is in its template, and template1 takes sessions of
                // every role (its CONNECT is PUBLIC's), so any consumer could otherwise
                // hold back every other caller's new database.
                &format!("CREATE DATABASE {ident} OWNER {ident} TEMPLATE template0"),
            )
            .await?;
            self.exec(
                "marking the database",
                &format!(
                    "COMMENT ON DATABASE {ident} IS {comment}; \
                     REVOKE ALL ON DATABASE {ident} FROM PUBLIC"
                ),
            )
            .await?;
        }
        if taken_over && owner.is_some() {
            // Marked as this handler's before it gets a password: the peer, back again,
            // then finds its marker gone and leaves the role and its data alone.
            self.exec(
                "taking the role over",
                &format!("COMMENT ON ROLE {ident} IS {comment}; COMMENT ON DATABASE {ident} IS {comment}"),
            )
            .await?;
        } else if taken_over {
            self.exec(
                "taking the role over",
                &format!("COMMENT ON ROLE {ident} IS {comment}"),
            )
            .await?;
        }
        let verifier = literal(&postgres_protocol::password::scram_sha_256(
            password.as_bytes(),
        ))?;
        self.exec(
            "enabling the role",
            &format!(
                "ALTER ROLE {ident} WITH LOGIN PASSWORD {verifier} CONNECTION LIMIT {connection_limit}"
            ),
        )
        .await?;
        Ok(if taken_over {
            Ensured::TakenOver
        } else {
            Ensured::Ours
        })
    }

    /// Releases role `name` if it still carries `marker`: `drop` drops its database (if
    /// the role owns it) and the role; otherwise the role loses `LOGIN` and its password
    /// and its sessions end, and the data stays.
    pub async fn release(&self, name: &str, marker: &str, drop: bool) -> Result<Released, Failure> {
        self.locked(name, self.release_now(name, marker, drop))
            .await
    }

    async fn release_now(&self, name: &str, marker: &str, drop: bool) -> Result<Released, Failure> {
        let ident = ident(name)?;
        let Some(row) = self
            .client
            .query_opt(
                "SELECT shobj_description(oid, 'pg_authid') FROM pg_roles WHERE rolname = $1",
                &[&name],
            )
            .await
            .map_err(|e| Failure::from_pg("reading the role", e))?
        else {
            return Ok(Released::Gone);
        };
        if row.get::<_, Option<String>>(0).as_deref() != Some(marker) {
            return Ok(Released::NotOurs);
        }
        if drop {
            let owned = self
                .client
                .query_opt(
                    "SELECT 1 FROM pg_database d JOIN pg_roles r ON r.oid = d.datdba \
                     WHERE d.datname = $1 AND r.rolname = $1",
                    &[&name],
                )
                .await
                .map_err(|e| Failure::from_pg("reading the database", e))?
                .is_some();
            if owned {
                self.exec(
                    "dropping the database",
                    &format!("DROP DATABASE {ident} WITH (FORCE)"),
                )
                .await?;
            }
            self.exec("dropping the role", &format!("DROP ROLE {ident}"))
                .await?;
        } else {
            self.exec(
                "disabling the role",
                &format!("ALTER ROLE {ident} WITH NOLOGIN PASSWORD NULL"),
            )
            .await?;
            self.client
                .query(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                     WHERE usename = $1 AND pid <> pg_backend_pid()",
                    &[&name],
                )
                .await
                .map_err(|e| Failure::from_pg("ending the role's sessions", e))?;
        }
        Ok(Released::Done)
    }

    async fn exec(&self, what: &str, sql: &str) -> Result<(), Failure> {
        self.client
            .batch_execute(sql)
            .await
            .map_err(|e| Failure::from_pg(what, e))
    }
}

fn ident(name: &str) -> Result<String, Failure> {
    quote_ident(name).ok_or_else(|| Failure::Refused(format!("{name:?} cannot be a name")))
}

fn literal(text: &str) -> Result<String, Failure> {
    quote_literal(text).ok_or_else(|| Failure::Refused("a text with NUL cannot be sent".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shortfall_counts_what_the_server_keeps_back() {
        let config: Config =
            serde_json::from_value(serde_json::json!({"state_file": "/x", "host": "db.lan"}))
                .unwrap();
        let mut c = Capacity {
            max_connections: 100,
            superuser_reserved: 3,
            reserved: 0,
            admin_is_superuser: false,
        };
        assert_eq!(c.for_callers(), 96);
        assert!(c.shortfall(&config, 96, 5).is_none());
        let note = c.shortfall(&config, 100, 5).unwrap();
        assert!(
            note.contains("add up to 100")
                && note.contains("the 96 the server leaves them")
                && note.contains("1 for postgres, not a superuser")
                && note.contains("and this handler"),
            "{note}"
        );
        c.admin_is_superuser = true;
        c.reserved = 5;
        assert_eq!(c.for_callers(), 92);
        let note = c.shortfall(&config, 100, 5).unwrap();
        assert!(
            note.contains("reserved_connections 5") && !note.contains("this handler"),
            "{note}"
        );
    }
}
