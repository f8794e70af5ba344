//! The agent's TOML configuration. Every tunable has a named default and a `///` saying
//! what happens when it is unset.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// This host's name in hosts.json; the signed target of every request it accepts.
    pub host: String,
    /// Address the signed HTTP control plane listens on.
    #[serde(deserialize_with = "addr::listen")]
    pub listen: SocketAddr,
    /// Unencrypted OpenSSH ed25519 private key; its public half must be in hosts.json.
    pub host_key: PathBuf,
    /// The peer registry (§10).
    pub hosts: PathBuf,
    /// Needs this host declares. Unset or missing file: no needs.
    #[serde(default)]
    pub needs: Option<PathBuf>,
    /// Capabilities this host serves. Unset or missing file: built-ins only.
    #[serde(default)]
    pub capabilities: Option<PathBuf>,
    /// Holds provider-state.json, fulfillment-state.json and the nonce journal.
    pub state_dir: PathBuf,
    /// The file this was read from (not a key): messages name it in the commands they give.
    #[serde(skip)]
    pub config_file: PathBuf,
    /// `serve --recover` (not a key): a state file this release refuses is moved aside
    /// and what it can read of it is kept, instead of not starting.
    #[serde(skip)]
    pub recover: bool,
    /// Unix socket (mode 0600) for `fort-agent status|trigger|gc|reload`.
    pub admin_socket: PathBuf,
    /// Accepted |now − timestamp|. Unset: 300 s.
    #[serde(default = "defaults::clock_skew", with = "humantime_serde")]
    pub clock_skew: Duration,
    /// Largest request body; larger is 413 before any signature work. Unset: 1 MiB.
    #[serde(default = "defaults::body_limit")]
    pub body_limit: usize,
    /// Longest a handler (provider, rpc, consumer, check) may run. Unset: 60 s.
    #[serde(default = "defaults::handler_timeout", with = "humantime_serde")]
    pub handler_timeout: Duration,
    /// Requests served at once; more are shed with 503. Unset: 256.
    #[serde(default = "defaults::max_concurrent_requests")]
    pub max_concurrent_requests: usize,
    /// Unexpired nonces remembered; when full, new requests get 503. Each is kept about
    /// `clock_skew`, so this sustains capacity / 300 s ≈ 6,600 requests/s at the
    /// defaults, at ~70 bytes each (~140 MB when full). Unset: 2,000,000.
    #[serde(default = "defaults::nonce_capacity")]
    pub nonce_capacity: usize,
    /// A connection that has not sent its headers by then is closed. Unset: 10 s.
    #[serde(default = "defaults::header_read_timeout", with = "humantime_serde")]
    pub header_read_timeout: Duration,
    /// A request whose body has not fully arrived by then gets 408. Unset: 10 s.
    #[serde(default = "defaults::body_read_timeout", with = "humantime_serde")]
    pub body_read_timeout: Duration,
    /// Allow `http://` addresses in hosts.json (an overlay network such as WireGuard
    /// already encrypts). This host then serves plain HTTP when its own address is
    /// `http://`. Unset: false, every address must be `https://` (TLS 1.3 pinned to the
    /// hosts' keys).
    #[serde(default)]
    pub plaintext: bool,
    /// Send and accept batches (§11.8 of the protocol): a consumer's requests to one
    /// capability, and a provider's callbacks to one consumer, travel many to one signed
    /// request. Peers that do not take batches are sent items one by one. Unset: true;
    /// false speaks protocol 1.1 only.
    #[serde(default = "defaults::yes")]
    pub batches: bool,
    /// Connections the control plane holds at once (TLS handshakes included); more are
    /// closed at once. Capped at half the descriptor limit, so state files, handler pipes
    /// and outgoing calls always have descriptors. Unset: 4096.
    #[serde(default = "defaults::max_connections")]
    pub max_connections: usize,
    /// Connections one peer address may hold at once. Unset: 64.
    #[serde(default = "defaults::max_connections_per_address")]
    pub max_connections_per_address: usize,
    /// Bytes of request bodies being read before their signature is checked, all peers
    /// together; a request that does not fit gets 503 at once. Unset: 64 MiB.
    #[serde(default = "defaults::unverified_body_bytes")]
    pub unverified_body_bytes: usize,
    /// The same, for one peer address. Unset: 16 MiB.
    #[serde(default = "defaults::unverified_body_bytes_per_address")]
    pub unverified_body_bytes_per_address: usize,
    /// Unexpired nonces one origin may hold, so no origin can fill the store for the
    /// others; past it that origin gets 429 with Retry-After. ≈ 830 requests/s sustained
    /// per origin at the default `clock_skew`. Unset: 250,000.
    #[serde(default = "defaults::nonce_quota_per_origin")]
    pub nonce_quota_per_origin: usize,
    /// Entries a principal, or a host listed only in `allowed`, may hold per capability;
    /// past it, 429 and nothing is stored. Hosts among a capability's `callers` may hold
    /// exactly the need ids they declare. Unset: 64.
    #[serde(default = "defaults::max_entries_per_origin")]
    pub max_entries_per_origin: usize,
    /// The least time between two renewals (§11.4) of one entry: a `renew` asked sooner
    /// after the entry's last renewed response is not passed to the handler, so a caller
    /// asking to renew over and over costs the provider (and a CA's rate limits) one new
    /// credential per interval, not one per request. The consumer asks again at its next
    /// nag. Counted from the agent's start, in memory. Unset: 10 minutes.
    #[serde(default = "defaults::renew_interval", with = "humantime_serde")]
    pub renew_interval: Duration,
    /// Largest stored async request (its `request` object as compact JSON); larger is
    /// 413. Unset: 64 KiB.
    #[serde(default = "defaults::max_request_bytes")]
    pub max_request_bytes: usize,
    /// The state key's file (docs/at-rest.md): handler state holding secrets is sealed
    /// with it, and the agent does not start when it cannot be read. Unset: the
    /// credential `state-key` in `$CREDENTIALS_DIRECTORY` when systemd gives one, else
    /// state is kept in plaintext (and the log says so at start).
    #[serde(default)]
    pub state_key_file: Option<PathBuf>,
    /// Extra environment variables every handler gets, besides `PATH` and the `FORT_*`
    /// variables. Unset: none.
    #[serde(default)]
    pub handler_environment: std::collections::BTreeMap<String, String>,
    /// The program that restarts and reloads units for delivered files. Unset:
    /// `systemctl` from PATH.
    #[serde(default = "defaults::systemctl")]
    pub systemctl: PathBuf,
    /// The program that encrypts the files delivered as encrypted credentials
    /// (`encrypt` in needs.json). Unset: `systemd-creds` from PATH; where there is none,
    /// such a need fails with that reason (never a plaintext file).
    #[serde(default = "defaults::systemd_creds")]
    pub systemd_creds: PathBuf,
    /// Prometheus text endpoint on a separate local listener. Unset: no metrics.
    #[serde(default, deserialize_with = "addr::metrics_listen")]
    pub metrics_listen: Option<SocketAddr>,
    /// Who may call the operator built-ins (`journal`, `systemd`, `trigger`, `resend`,
    /// `audit`).
    #[serde(default)]
    pub access: Access,
    /// Provider garbage collection.
    #[serde(default)]
    pub gc: GcConfig,
    /// Delivery of callbacks to consumers.
    #[serde(default)]
    pub callbacks: CallbackConfig,
    /// The consumer's fulfiller.
    #[serde(default)]
    pub fulfill: FulfillConfig,
    /// The signed audit trail (docs/protocol.md §12).
    #[serde(default)]
    pub audit: AuditConfig,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AuditConfig {
    /// Record what this host issues, receives and is asked to do. Unset: true.
    #[serde(default = "defaults::yes")]
    pub enable: bool,
    /// Where the trail's files go (made 0700). Unset: `<state_dir>/audit`.
    #[serde(default)]
    pub dir: Option<PathBuf>,
    /// A file this large is closed with a checkpoint and the next one begun. Unset: 16 MiB.
    #[serde(default = "defaults::audit_max_file_bytes")]
    pub max_file_bytes: u64,
    /// Files kept; when one more is begun the oldest is removed (the chain goes on
    /// across files). Unset: 8.
    #[serde(default = "defaults::audit_max_files")]
    pub max_files: usize,
    /// How often the head of the trail is signed with the host key, when records were
    /// added; also at shutdown and when a file is full. Unset: 5 min.
    #[serde(
        default = "defaults::audit_checkpoint_interval",
        with = "humantime_serde"
    )]
    pub checkpoint_interval: Duration,
    /// Records waiting to be written; past it records are counted as lost, and the
    /// count recorded, rather than making the agent wait. Unset: 65,536.
    #[serde(default = "defaults::audit_queue")]
    pub queue: usize,
    /// Each record also goes to the agent's log (the journal under systemd), as one
    /// line of JSON with the target `fort_audit`. Unset: false.
    #[serde(default)]
    pub journal: bool,
    /// Each record also goes to this syslog server, `udp://HOST:PORT` or
    /// `tcp://HOST:PORT` (RFC 5424, facility authpriv, program `fort-agent`, message id
    /// `audit`, the record's JSON line as the message). A copy: the trail's files stay the
    /// record, and a server that cannot be reached only costs the copy. Unset: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub syslog: Option<fort_core::audit::SyslogTarget>,
    /// While the trail cannot be written, this host issues nothing: async requests get
    /// 503 with Retry-After and handler runs wait. Unset: false (it issues, and logs
    /// that the trail is not written).
    #[serde(default)]
    pub required: bool,
}

impl Default for AuditConfig {
    fn default() -> Self {
        toml::from_str("").expect("defaults parse")
    }
}

impl Config {
    /// The directory of the audit trail.
    pub fn audit_dir(&self) -> PathBuf {
        self.audit
            .dir
            .clone()
            .unwrap_or_else(|| self.state_dir.join("audit"))
    }
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Access {
    /// Principals allowed `journal`. Unset: nobody.
    #[serde(default)]
    pub journal: Vec<String>,
    /// Principals allowed `systemd`. Unset: nobody.
    #[serde(default)]
    pub systemd: Vec<String>,
    /// Principals allowed `trigger` (run a capability's handler, for one entry or all)
    /// and `resend` (have this host send one need's request again), and to see the provider's
    /// entries in `status`. Unset: nobody.
    #[serde(default)]
    pub trigger: Vec<String>,
    /// Principals allowed `audit`: this host's audit trail, read from where their copy
    /// ends (`fort audit pull`). Unset: nobody. Written only when set, so that a config
    /// without it is read by releases that do not know it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub audit: Vec<String>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct GcConfig {
    /// Time between sweeps; `0s` disables the periodic sweep. Unset: 1 h.
    #[serde(default = "defaults::gc_interval", with = "humantime_serde")]
    pub interval: Duration,
    /// Random spread added to each interval so a fleet does not sweep in step. Unset: 5 min.
    #[serde(default = "defaults::gc_jitter", with = "humantime_serde")]
    pub jitter: Duration,
    /// How long an entry must be proven absent before it is removed. Unset: 15 min.
    #[serde(default = "defaults::gc_grace", with = "humantime_serde")]
    pub grace: Duration,
    /// Principals cannot be asked; their entries expire this long after their last
    /// request. Unset: 7 days.
    #[serde(default = "defaults::principal_ttl", with = "humantime_serde")]
    pub principal_ttl: Duration,
    /// Origins enumerated at once during a sweep. Unset: 16.
    #[serde(default = "defaults::gc_concurrency")]
    pub concurrency: usize,
    /// Timeout of one enumeration call. Unset: 10 s.
    #[serde(default = "defaults::gc_timeout", with = "humantime_serde")]
    pub timeout: Duration,
}

impl Default for GcConfig {
    fn default() -> Self {
        toml::from_str("").expect("defaults parse")
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CallbackConfig {
    /// Deliveries in flight at once. Unset: 32.
    #[serde(default = "defaults::callback_concurrency")]
    pub concurrency: usize,
    /// Deliveries in flight to one consumer, within `concurrency`: a consumer that never
    /// answers holds no more than this many. Unset: 4.
    #[serde(default = "defaults::callback_per_consumer")]
    pub per_consumer: usize,
    /// Tries per delivery before leaving it to the consumer's nag. Unset: 5.
    #[serde(default = "defaults::callback_attempts")]
    pub attempts: u32,
    /// First retry delay; doubles each try (1+2+4+8 s … ≈ 2 min with 5 tries at 8 s). Unset: 8 s.
    #[serde(default = "defaults::callback_backoff", with = "humantime_serde")]
    pub backoff: Duration,
    /// How often entries whose consumer has not acknowledged the current payload (after a
    /// crash, or after the retries gave up) are delivered again; `0s`: only at start.
    /// Unset: 5 min.
    #[serde(default = "defaults::redeliver_interval", with = "humantime_serde")]
    pub redeliver_interval: Duration,
    /// Timeout of one delivery. Unset: 30 s.
    #[serde(default = "defaults::callback_timeout", with = "humantime_serde")]
    pub timeout: Duration,
}

impl Default for CallbackConfig {
    fn default() -> Self {
        toml::from_str("").expect("defaults parse")
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FulfillConfig {
    /// Requests sent alone in flight to one provider at once (batches, §11.8 of the
    /// protocol: at most 2 per capability). Unset: 8.
    #[serde(default = "defaults::fulfill_concurrency")]
    pub per_provider_concurrency: usize,
    /// First retry after a transport failure; doubles up to the need's nag interval. Unset: 2 s.
    #[serde(default = "defaults::fulfill_backoff", with = "humantime_serde")]
    pub backoff: Duration,
    /// Timeout of one request to a provider. Unset: 30 s.
    #[serde(default = "defaults::fulfill_timeout", with = "humantime_serde")]
    pub timeout: Duration,
}

impl Default for FulfillConfig {
    fn default() -> Self {
        toml::from_str("").expect("defaults parse")
    }
}

/// `listen` and `metrics_listen` are an IP address and a port: the agent binds exactly
/// that, and resolving a name could give another address on another day.
mod addr {
    use std::net::SocketAddr;

    use serde::{Deserialize, Deserializer};

    fn parse<E: serde::de::Error>(key: &str, text: &str) -> Result<SocketAddr, E> {
        text.parse().map_err(|_| {
            E::custom(format!(
                "{key} = {text:?}: use an IP address and port such as 127.0.0.1:7770 or [::]:7770; host names are not resolved"
            ))
        })
    }

    pub fn listen<'de, D: Deserializer<'de>>(d: D) -> Result<SocketAddr, D::Error> {
        parse("listen", &String::deserialize(d)?)
    }

    pub fn metrics_listen<'de, D: Deserializer<'de>>(d: D) -> Result<Option<SocketAddr>, D::Error> {
        Option::<String>::deserialize(d)?
            .map(|t| parse("metrics_listen", &t))
            .transpose()
    }
}

pub(crate) mod defaults {
    use std::time::Duration;
    pub fn yes() -> bool {
        true
    }
    pub fn clock_skew() -> Duration {
        Duration::from_secs(300)
    }
    pub fn body_limit() -> usize {
        1024 * 1024
    }
    pub fn handler_timeout() -> Duration {
        Duration::from_secs(60)
    }
    pub fn max_concurrent_requests() -> usize {
        256
    }
    pub fn nonce_capacity() -> usize {
        2_000_000
    }
    pub fn header_read_timeout() -> Duration {
        Duration::from_secs(10)
    }
    pub fn body_read_timeout() -> Duration {
        Duration::from_secs(10)
    }
    pub fn max_connections() -> usize {
        4096
    }
    pub fn max_connections_per_address() -> usize {
        64
    }
    pub fn unverified_body_bytes() -> usize {
        64 * 1024 * 1024
    }
    pub fn unverified_body_bytes_per_address() -> usize {
        16 * 1024 * 1024
    }
    pub fn nonce_quota_per_origin() -> usize {
        250_000
    }
    pub fn max_entries_per_origin() -> usize {
        64
    }
    pub fn renew_interval() -> Duration {
        Duration::from_secs(600)
    }
    pub fn max_request_bytes() -> usize {
        64 * 1024
    }
    pub fn systemctl() -> std::path::PathBuf {
        "systemctl".into()
    }

    pub fn systemd_creds() -> std::path::PathBuf {
        "systemd-creds".into()
    }
    pub fn gc_interval() -> Duration {
        Duration::from_secs(3600)
    }
    pub fn gc_jitter() -> Duration {
        Duration::from_secs(300)
    }
    pub fn gc_grace() -> Duration {
        Duration::from_secs(900)
    }
    pub fn principal_ttl() -> Duration {
        Duration::from_secs(7 * 24 * 3600)
    }
    pub fn gc_concurrency() -> usize {
        16
    }
    pub fn gc_timeout() -> Duration {
        Duration::from_secs(10)
    }
    pub fn callback_concurrency() -> usize {
        32
    }
    pub fn callback_per_consumer() -> usize {
        4
    }
    pub fn callback_attempts() -> u32 {
        5
    }
    pub fn callback_backoff() -> Duration {
        Duration::from_secs(8)
    }
    pub fn redeliver_interval() -> Duration {
        Duration::from_secs(300)
    }
    pub fn callback_timeout() -> Duration {
        Duration::from_secs(30)
    }
    pub fn fulfill_concurrency() -> usize {
        8
    }
    pub fn fulfill_backoff() -> Duration {
        Duration::from_secs(2)
    }
    pub fn fulfill_timeout() -> Duration {
        Duration::from_secs(30)
    }
    pub fn audit_max_file_bytes() -> u64 {
        16 * 1024 * 1024
    }
    pub fn audit_max_files() -> usize {
        8
    }
    pub fn audit_checkpoint_interval() -> Duration {
        Duration::from_secs(300)
    }
    pub fn audit_queue() -> usize {
        65_536
    }
}

/// A config file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    // Not a `#[source]`: the message carries it (a chain of causes would repeat it).
    #[error("{file}: cannot read: {error}")]
    Read { file: String, error: std::io::Error },
    #[error("{file}: {message}")]
    Parse { file: String, message: String },
}

impl Config {
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|error| ConfigError::Read {
            file: file.clone(),
            error,
        })?;
        Config::from_text(path, &text)
    }

    /// Parses a config already read (`path` names it in errors).
    pub fn from_text(path: &Path, text: &str) -> Result<Config, ConfigError> {
        let file = path.display().to_string();
        let mut config: Config = toml::from_str(text).map_err(|e| ConfigError::Parse {
            file: file.clone(),
            message: e.to_string(),
        })?;
        config.config_file = path.to_path_buf();
        if !fort_core::names::is_host_name(&config.host) {
            return Err(ConfigError::Parse {
                file,
                message: format!("host {:?} is not a valid host name", config.host),
            });
        }
        if let Some((key, value)) = config
            .durations()
            .into_iter()
            .find(|(_, d)| *d > MAX_DURATION)
        {
            return Err(ConfigError::Parse {
                file,
                message: format!(
                    "{key} = {} is longer than a year; every duration is at most 365d",
                    humantime::format_duration(value)
                ),
            });
        }
        for name in config.handler_environment.keys() {
            let malformed = name.is_empty() || name.contains(['=', '\0']);
            if malformed || RESERVED_ENVIRONMENT.contains(&name.as_str()) {
                return Err(ConfigError::Parse {
                    file,
                    message: format!(
                        "handler_environment: {name:?} {}",
                        if malformed {
                            "is not a variable name"
                        } else {
                            "is set by the agent for each run and cannot be overridden"
                        }
                    ),
                });
            }
        }
        Ok(config)
    }
}

/// The longest duration any key may hold: deadlines are computed from them, and a year
/// is longer than any of them means.
const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

impl Config {
    /// Every duration key with its value, named as in agent.toml.
    fn durations(&self) -> Vec<(&'static str, Duration)> {
        vec![
            ("clock_skew", self.clock_skew),
            ("handler_timeout", self.handler_timeout),
            ("header_read_timeout", self.header_read_timeout),
            ("body_read_timeout", self.body_read_timeout),
            ("gc.interval", self.gc.interval),
            ("gc.jitter", self.gc.jitter),
            ("gc.grace", self.gc.grace),
            ("gc.principal_ttl", self.gc.principal_ttl),
            ("gc.timeout", self.gc.timeout),
            ("callbacks.backoff", self.callbacks.backoff),
            (
                "callbacks.redeliver_interval",
                self.callbacks.redeliver_interval,
            ),
            ("callbacks.timeout", self.callbacks.timeout),
            ("fulfill.backoff", self.fulfill.backoff),
            ("fulfill.timeout", self.fulfill.timeout),
            ("audit.checkpoint_interval", self.audit.checkpoint_interval),
        ]
    }
}

/// Variables the agent sets per handler run: a handler must be able to trust them, so
/// `handler_environment` may not name them.
const RESERVED_ENVIRONMENT: &[&str] = &[
    "FORT_HOST",
    "FORT_NEED",
    "FORT_ORIGIN",
    "FORT_CAPABILITY",
    "FORT_TRIGGER",
    "FORT_RUN_ID",
    fort_core::sealed::KEY_FILE_ENV,
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minimal_config_gets_defaults_and_typos_are_errors() {
        let text = r#"
host = "forge"
listen = "127.0.0.1:7770"
host_key = "/k"
hosts = "/h"
state_dir = "/s"
admin_socket = "/a"
"#;
        let c: Config = toml::from_str(text).unwrap();
        assert_eq!(c.clock_skew, Duration::from_secs(300));
        assert_eq!(c.gc.grace, Duration::from_secs(900));
        assert!(toml::from_str::<Config>(&format!("{text}\nclock_skw = \"1s\"")).is_err());
    }

    #[test]
    fn handler_environment_cannot_override_what_the_agent_sets() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.toml");
        let base = "host = \"forge\"\nlisten = \"127.0.0.1:7770\"\nhost_key = \"/k\"\nhosts = \"/h\"\nstate_dir = \"/s\"\nadmin_socket = \"/a\"\n";
        for (env, refused) in [
            ("{ FORT_NEED = \"x\" }", Some("set by the agent")),
            ("{ \"A=B\" = \"x\" }", Some("not a variable name")),
            ("{ FORT_EXAMPLE_STATE = \"/x\", PATH = \"/bin\" }", None),
        ] {
            std::fs::write(&path, format!("{base}handler_environment = {env}\n")).unwrap();
            match (Config::load(&path), refused) {
                (Ok(_), None) => {}
                (Err(e), Some(why)) => assert!(e.to_string().contains(why), "{e}"),
                (r, _) => panic!("{env}: {:?}", r.map(|_| ())),
            }
        }
    }
}
