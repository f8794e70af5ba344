//! The fleet a chaos run starts: several providers of an independent issuer (`ssh-ca`,
//! each its own CA) serving needs that name two or three of them; providers sharing one
//! real PostgreSQL (`postgres` with `peers`); a single provider of a token issuer that
//! keeps its own record (chaos::token); consumers with several needs each, credentials
//! living a minute or two; a state key on every provider and on half the consumers; the
//! audit trail everywhere; GC sweeping often with a short grace. A few consumers can be
//! rolled back to the previous release: their needs name one provider each and they
//! hold no state key, as that release requires.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use fort_tests::Fleet;
use serde_json::{json, Value};

pub const SSH: &str = "ssh-ca";
pub const PG: &str = "postgres";
pub const TOK: &str = "tok";
pub const HOST_CERT: &str = "ssh-ca/host";
pub const DB: &str = "postgres/db";
pub const API: &str = "tok/api";
pub const EXTRA: &str = "tok/extra";
pub const OPS: &str = "ops";

#[derive(Debug, Clone, Copy)]
pub struct Timing {
    pub nag: u64,
    pub failover_after: u64,
    /// Of certificates and tokens.
    pub lifetime: u64,
    pub gc_grace: u64,
    pub gc_interval: u64,
}

impl Timing {
    /// Consumers renew at half-life.
    pub fn renew_before(&self) -> u64 {
        self.lifetime / 2
    }

    /// How long after the last fault that concerned it a need must be satisfied again:
    /// failover time plus two nag intervals.
    pub fn recovery(&self) -> u64 {
        self.failover_after + 2 * self.nag
    }
}

#[derive(Debug, Clone)]
pub struct Consumer {
    pub name: String,
    pub ssh_from: Vec<String>,
    pub pg_from: Vec<String>,
    pub keyed: bool,
    /// May be rolled back to the previous release.
    pub rollback: bool,
}

/// What a reload changes in a consumer's needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Variant {
    /// `tok/api`'s request round: a new round asks for a new token.
    pub round: u64,
    /// Whether `tok/extra` is declared.
    pub extra: bool,
}

impl Default for Variant {
    fn default() -> Variant {
        Variant {
            round: 0,
            extra: true,
        }
    }
}

/// How one host's agent.toml is written now.
#[derive(Debug, Clone, Default)]
pub struct TomlOptions {
    pub state_key: Option<PathBuf>,
    /// The previous release's generation (a rollback): without what it refuses.
    pub previous_generation: bool,
    /// libfaketime and its offset for the handlers too (a clock off).
    pub clock: Option<(PathBuf, String)>,
}

pub struct Layout {
    pub cas: Vec<String>,
    pub pgs: Vec<String>,
    pub vault: String,
    pub consumers: Vec<Consumer>,
    pub timing: Timing,
}

impl Layout {
    pub fn new(
        consumers: usize,
        rollback: usize,
        cas: usize,
        postgres: bool,
        timing: Timing,
    ) -> Layout {
        let cas: Vec<String> = (1..=cas.max(2)).map(|i| format!("ca{i}")).collect();
        let pgs: Vec<String> = if postgres {
            vec!["pg1".into(), "pg2".into()]
        } else {
            Vec::new()
        };
        let mut list = Vec::new();
        for i in 0..consumers {
            let n = cas.len();
            let len = if i % 4 == 3 { 3.min(n) } else { 2 };
            let ssh_from = (0..len).map(|k| cas[(i + k) % n].clone()).collect();
            let mut pg_from = pgs.clone();
            if i % 2 == 1 {
                pg_from.reverse();
            }
            list.push(Consumer {
                name: format!("c{:02}", i + 1),
                ssh_from,
                pg_from,
                keyed: i % 2 == 0,
                rollback: false,
            });
        }
        for j in 0..rollback {
            list.push(Consumer {
                name: format!("r{:02}", j + 1),
                ssh_from: vec![cas[j % cas.len()].clone()],
                pg_from: Vec::new(),
                keyed: false,
                rollback: true,
            });
        }
        Layout {
            cas,
            pgs,
            vault: "vault".into(),
            consumers: list,
            timing,
        }
    }

    pub fn providers(&self) -> Vec<String> {
        let mut p = self.cas.clone();
        p.extend(self.pgs.iter().cloned());
        p.push(self.vault.clone());
        p
    }

    /// Every host, providers first.
    pub fn hosts(&self) -> Vec<String> {
        let mut h = self.providers();
        h.extend(self.consumers.iter().map(|c| c.name.clone()));
        h
    }

    pub fn consumer(&self, name: &str) -> Option<&Consumer> {
        self.consumers.iter().find(|c| c.name == name)
    }

    pub fn is_provider(&self, name: &str) -> bool {
        self.providers().iter().any(|p| p == name)
    }

    /// Each need `consumer` may declare, with the providers it names.
    pub fn needs_of(&self, consumer: &str) -> BTreeMap<String, Vec<String>> {
        let Some(c) = self.consumer(consumer) else {
            return BTreeMap::new();
        };
        let mut needs = BTreeMap::new();
        needs.insert(HOST_CERT.to_owned(), c.ssh_from.clone());
        if c.ssh_from.len() > 1 {
            for p in &c.ssh_from {
                needs.insert(format!("ssh-ca/host-ca-{p}"), vec![p.clone()]);
            }
        }
        if !c.pg_from.is_empty() {
            needs.insert(DB.to_owned(), c.pg_from.clone());
        }
        needs.insert(API.to_owned(), vec![self.vault.clone()]);
        needs.insert(EXTRA.to_owned(), vec![self.vault.clone()]);
        needs
    }

    /// Where `consumer`'s files for `need` land.
    pub fn run_dir(fleet: &Fleet, consumer: &str) -> PathBuf {
        fleet.dir.path().join("run").join(consumer)
    }

    /// Declares every capability and every need any variant has (so that each provider's
    /// callers list them all).
    pub fn declare(
        &self,
        fleet: &mut Fleet,
        handler: &Path,
        token_handler: &Path,
        pg: Option<(&Path, u16)>,
    ) {
        fleet.principal(OPS);
        for ca in &self.cas {
            let state = fleet.host_dir(ca).join("state/handlers/ssh-ca");
            let config = fleet.dir.path().join(format!("{ca}-ssh-ca.json"));
            std::fs::create_dir_all(fleet.dir.path()).expect("fleet dir");
            std::fs::write(
                &config,
                json!({"ca_key_file": state.join("ca_key"), "generate_ca_key": true,
                       "state_file": state.join("state.json"),
                       "hosts_file": fleet.host_dir(ca).join("hosts.json"),
                       "host_principals": {"*": ["{origin}"]},
                       "host_validity": format!("{}s", self.timing.lifetime),
                       "max_new_certificates_per_caller_per_hour": 10000})
                .to_string(),
            )
            .expect("write ssh-ca config");
            fleet.capability(
                ca,
                SSH,
                json!({"handler": handler, "args": ["ssh-ca", "--config", config],
                       "mode": "async", "cacheResponse": true}),
            );
        }
        if let Some((socket_dir, port)) = pg {
            for p in &self.pgs {
                let peers: Vec<&String> = self.pgs.iter().filter(|q| *q != p).collect();
                let config = fleet.dir.path().join(format!("{p}-postgres.json"));
                std::fs::write(
                    &config,
                    json!({"state_file": fleet.host_dir(p).join("state/handlers/postgres/state.json"),
                           "host": "127.0.0.1", "socket_dir": socket_dir, "port": port,
                           "admin_role": fort_tests::postgres::ADMIN, "peers": peers,
                           "connections_per_caller": 4})
                    .to_string(),
                )
                .expect("write postgres config");
                fleet.capability(
                    p,
                    PG,
                    json!({"handler": handler, "args": ["postgres", "--config", config],
                           "mode": "async", "cacheResponse": true}),
                );
            }
        }
        let record = fleet.dir.path().join("tok-record");
        fleet.capability(
            &self.vault,
            TOK,
            json!({"handler": token_handler,
                   "args": ["chaos-token-handler", "--record", record,
                            "--lifetime", self.timing.lifetime.to_string()],
                   "mode": "async", "cacheResponse": true}),
        );
        let t = self.timing;
        for c in self.consumers.clone() {
            let run = Layout::run_dir(fleet, &c.name);
            let ssh = run.join("ssh");
            let public = fleet.host(&c.name).signer.public_openssh();
            let mut host_need = json!({
                "request": {"kind": "host", "public_key": public, "principals": null,
                            "validity_seconds": null},
                "renew_before_seconds": t.renew_before(),
                "nag_seconds": t.nag,
                "files": [{"name": "certificate", "path": ssh.join("host-cert.pub"),
                           "pointer": "/certificate", "mode": "0644"}],
            });
            if c.ssh_from.len() > 1 {
                let trust = fleet.script(
                    &format!("trust-{}", c.name),
                    &format!(
                        "exec {} ssh-ca-krl --out {} --providers {} --ca-keys {} --known-hosts {}",
                        handler.display(),
                        ssh.join("krl").display(),
                        c.ssh_from.join(","),
                        ssh.join("ca.pub").display(),
                        ssh.join("known_hosts").display()
                    ),
                );
                host_need["handler"] = json!(trust);
                host_need["failover_after_seconds"] = json!(t.failover_after);
                let from: Vec<&str> = c.ssh_from.iter().map(String::as_str).collect();
                fleet.need_from(&c.name, HOST_CERT, &from, host_need);
                for p in &c.ssh_from {
                    fleet.need(
                        &c.name,
                        &format!("ssh-ca/host-ca-{p}"),
                        p,
                        json!({"request": {"kind": "ca", "public_key": null,
                                           "principals": null, "validity_seconds": null},
                               "nag_seconds": t.nag, "handler": trust}),
                    );
                }
            } else {
                fleet.need(&c.name, HOST_CERT, &c.ssh_from[0], host_need);
            }
            if !c.pg_from.is_empty() && pg.is_some() {
                let from: Vec<&str> = c.pg_from.iter().map(String::as_str).collect();
                fleet.need_from(
                    &c.name,
                    DB,
                    &from,
                    json!({"nag_seconds": t.nag, "failover_after_seconds": t.failover_after,
                           "request": {},
                           "files": fort_tests::pointer_files(&run.join("pg"),
                                                              &["user", "password", "dbname"])}),
                );
            }
            for (need, file) in [(API, "api"), (EXTRA, "extra")] {
                fleet.need(
                    &c.name,
                    need,
                    &self.vault,
                    json!({"request": {"scope": file, "round": 0},
                           "renew_before_seconds": t.renew_before(),
                           "nag_seconds": t.nag,
                           "files": [{"name": "token", "path": run.join("tok").join(file),
                                      "pointer": "/token", "mode": "0600"}]}),
                );
            }
        }
    }

    /// `consumer`'s needs.json as `variant` declares them.
    pub fn needs_json(fleet: &Fleet, consumer: &str, variant: Variant) -> Value {
        let mut needs = fleet.hosts[consumer].needs.clone();
        if !variant.extra {
            needs.remove(EXTRA);
        }
        if let Some(api) = needs.get_mut(API) {
            api["request"]["round"] = json!(variant.round);
        }
        json!(needs)
    }

    /// `host`'s agent.toml.
    pub fn agent_toml(&self, fleet: &Fleet, host: &str, o: &TomlOptions) -> String {
        let d = fleet.host_dir(host);
        let h = &fleet.hosts[host];
        let t = self.timing;
        let mut s = format!(
            "host = \"{host}\"\nlisten = \"{addr}\"\nhost_key = \"{d}/key\"\nhosts = \"{d}/hosts.json\"\nneeds = \"{d}/needs.json\"\ncapabilities = \"{d}/capabilities.json\"\nstate_dir = \"{d}/state\"\nadmin_socket = \"{d}/agent.sock\"\n",
            addr = h.addr,
            d = d.display()
        );
        let provider = self.is_provider(host);
        if provider {
            // Renewals at half-life always pass; anything asked sooner waits this long.
            s.push_str("renew_interval = \"30s\"\n");
        }
        if let Some(key) = &o.state_key {
            s.push_str(&format!("state_key_file = \"{}\"\n", key.display()));
        }
        if let Some((lib, offset)) = &o.clock {
            s.push_str(&format!(
                "handler_environment = {{ LD_PRELOAD = \"{}\", FAKETIME = \"{offset}\", FAKETIME_DONT_FAKE_MONOTONIC = \"1\" }}\n",
                lib.display()
            ));
        }
        if !o.previous_generation {
            // Small trail files, so that rotation of the trail happens within a run.
            s.push_str(
                "[audit]\ncheckpoint_interval = \"10s\"\nmax_file_bytes = 1048576\nmax_files = 4\n",
            );
        }
        s.push_str(&format!("[access]\ntrigger = [\"{OPS}\"]\n"));
        if provider {
            s.push_str(&format!(
                "[gc]\ninterval = \"{}s\"\njitter = \"5s\"\ngrace = \"{}s\"\ntimeout = \"5s\"\n",
                t.gc_interval, t.gc_grace
            ));
        }
        s.push_str(
            "[callbacks]\nbackoff = \"2s\"\nredeliver_interval = \"30s\"\ntimeout = \"10s\"\n",
        );
        s.push_str("[fulfill]\nbackoff = \"2s\"\ntimeout = \"10s\"\n");
        s
    }
}
