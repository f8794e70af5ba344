//! The `fort` operator CLI: signed calls to any host, and the fleet view. Also the table
//! renderers shared with `fort-agent status`.

pub mod audit_pull;
mod fleet;
mod graph;
pub mod human;
pub mod offline;
mod ops;
mod table;
pub mod versions;

use std::fmt::Write;
use std::path::PathBuf;
use std::sync::Arc;

use fort_core::client::{ClientOptions, Reply, ResponseAuth, SignedClient, Target};
use fort_core::schema::Registry;
use fort_core::sign::Signer;
use fort_core::text::printable;
use serde_json::Value;

pub use fleet::{
    fleet, fleet_json, fleet_table, healthy, load_expected, with_expected_hosts, Expected,
    FleetRow, ManifestCheck, ManifestState,
};
pub use graph::fleet_graph;
pub use ops::{gc_text, journal_lines, resend_text, trigger_text};
pub use table::status_table;

/// Where to find the registry and who to sign as.
pub struct Identity {
    pub hosts: PathBuf,
    pub key: PathBuf,
    pub origin: String,
    /// Accept `http://` addresses (only on a network that already encrypts).
    pub plaintext: bool,
}

/// Exit codes: 0 on 2xx, 2 on 401/403 or signing trouble, 1 otherwise.
pub const EXIT_OK: u8 = 0;
pub const EXIT_FAIL: u8 = 1;
pub const EXIT_AUTH: u8 = 2;

#[derive(Clone)]
pub struct Session {
    pub registry: Arc<Registry>,
    pub client: SignedClient,
    /// Who signs, with which key, and whether the registry used here lists that key for
    /// it: for messages that point at the cause of a refusal.
    pub signing: Arc<Signing>,
}

pub struct Signing {
    pub key: PathBuf,
    pub origin: String,
    pub hosts: PathBuf,
    /// `SHA256:…` of the key's public half, as `ssh-keygen -l` prints it.
    pub fingerprint: String,
    /// The registry used here lists this key for the origin.
    pub listed: bool,
}

impl Signing {
    /// What to check when a host answers 401 to a signed request.
    pub fn unauthorized_hint(&self, host: &str) -> String {
        let pubfile = format!("{}.pub", self.key.display());
        let mut hint = format!(
            "{host} did not accept the signature of {origin:?} made with {key} ({fp}): check that its public half ({pubfile}) is listed for {origin:?} in {host}'s hosts.json (NixOS: fort.cluster.principals.{origin}.publicKeys) and that {host} runs that configuration",
            origin = self.origin,
            key = self.key.display(),
            fp = self.fingerprint,
        );
        if !self.listed {
            let _ = write!(
                hint,
                "; {} here does not list it for {:?} either",
                self.hosts.display(),
                self.origin
            );
        }
        hint
    }
}

/// Names in `candidates` close to `name` (a typo away), closest first, at most three.
pub fn close_names<'a>(name: &str, candidates: impl Iterator<Item = &'a str>) -> Vec<&'a str> {
    let mut scored: Vec<(f64, &str)> = candidates
        .map(|c| (strsim::jaro_winkler(name, c), c))
        .filter(|(score, c)| {
            *score >= 0.8 || strsim::damerau_levenshtein(name, c) <= (name.len() / 3).max(1)
        })
        .collect();
    scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(b.1)));
    scored.into_iter().take(3).map(|(_, c)| c).collect()
}

/// `"frog" is not a host in FILE; did you mean forge?` (or the hosts it lists).
pub fn unknown_host(registry: &Registry, hosts: &std::path::Path, host: &str) -> String {
    let names: Vec<&str> = registry.hosts().map(|(n, _)| n.as_str()).collect();
    let mut msg = if registry.get(host).is_some() {
        format!("{host:?} is a principal in {}, not a host", hosts.display())
    } else {
        format!("{host:?} is not a host in {}", hosts.display())
    };
    let close = close_names(host, names.iter().copied());
    if !close.is_empty() {
        let _ = write!(msg, "; did you mean {}?", close.join(" or "));
    } else if names.len() <= 12 {
        let _ = write!(msg, " (hosts: {})", names.join(", "));
    }
    msg
}

impl Session {
    pub fn open(id: &Identity) -> Result<Session, (u8, String)> {
        let registry = Registry::load(&id.hosts).map_err(|e| (EXIT_FAIL, e.to_string()))?;
        let signer = Signer::from_file(&id.key).map_err(|e| (EXIT_AUTH, e.to_string()))?;
        let Some(me) = registry.get(&id.origin) else {
            let close = close_names(&id.origin, registry.principals().map(|(n, _)| n.as_str()));
            let hint = if close.is_empty() {
                " (set --origin or FORT_ORIGIN to the name hosts.json lists for your key)"
                    .to_owned()
            } else {
                format!("; did you mean {}?", close.join(" or "))
            };
            return Err((
                EXIT_AUTH,
                format!(
                    "origin {:?} is not in {}{hint}",
                    id.origin,
                    id.hosts.display()
                ),
            ));
        };
        let public = signer.public_key();
        let listed = me.keys.iter().any(|k| k.key_data() == public.key_data());
        let signing = Signing {
            key: id.key.clone(),
            origin: id.origin.clone(),
            hosts: id.hosts.clone(),
            fingerprint: public.fingerprint(ssh_key::HashAlg::Sha256).to_string(),
            listed,
        };
        let client = SignedClient::new(
            &id.origin,
            signer,
            &ClientOptions {
                allow_plaintext: id.plaintext,
                ..ClientOptions::default()
            },
        );
        Ok(Session {
            registry: Arc::new(registry),
            client,
            signing: Arc::new(signing),
        })
    }

    /// Signs and sends `body` to `host`'s capability.
    pub async fn call(
        &self,
        host: &str,
        capability: &str,
        body: Vec<u8>,
    ) -> Result<Reply, (u8, String)> {
        let unknown = || {
            (
                EXIT_FAIL,
                unknown_host(&self.registry, &self.signing.hosts, host),
            )
        };
        let peer = self.registry.get(host).ok_or_else(unknown)?;
        let address = peer.address.as_deref().ok_or_else(unknown)?;
        let target = Target {
            name: host,
            address,
            keys: &peer.keys,
        };
        self.client
            .post(&target, &format!("/agent/capabilities/{capability}"), body)
            .await
            .map_err(|e| (EXIT_FAIL, e.to_string()))
    }
}

/// `fort pin HOST`: the curl pins (`--pinnedpubkey`) of every key `hosts.json` lists for
/// `host`, one per line. Needs no key of one's own.
pub fn pins(hosts: &std::path::Path, host: &str) -> Result<Vec<String>, (u8, String)> {
    let registry = Registry::load(hosts).map_err(|e| (EXIT_FAIL, e.to_string()))?;
    let peer = registry
        .get(host)
        .filter(|p| p.address.is_some())
        .ok_or_else(|| (EXIT_FAIL, unknown_host(&registry, hosts, host)))?;
    peer.keys
        .iter()
        .map(|k| fort_core::tls::pin(k).map_err(|e| (EXIT_FAIL, e.to_string())))
        .collect()
}

/// Turns a reply from `host` into (exit code, stdout text, stderr note).
pub fn judge(
    reply: &Reply,
    pretty: bool,
    host: &str,
    signing: &Signing,
) -> (u8, String, Option<String>) {
    let body = if pretty {
        serde_json::from_slice::<Value>(&reply.body)
            .ok()
            .and_then(|v| serde_json::to_string_pretty(&v).ok())
            // Not JSON: on a terminal, each line made printable (it came from a peer).
            .unwrap_or_else(|| {
                String::from_utf8_lossy(&reply.body)
                    .lines()
                    .map(|l| printable(l, 64 * 1024))
                    .collect::<Vec<_>>()
                    .join("\n")
            })
    } else {
        String::from_utf8_lossy(&reply.body).into_owned()
    };
    if (300..400).contains(&reply.status) {
        let to = reply.location.clone().unwrap_or_default();
        return (
            EXIT_FAIL,
            String::new(),
            Some(format!(
                "HTTP {}: redirect to {to:?} not followed",
                reply.status
            )),
        );
    }
    match reply.status {
        401 => {
            let note = match reply.server_time {
                Some(t) => format!(
                    "HTTP 401: {host} refused the request's time: its clock says {t}, ours {} (check both clocks; at most 300 s apart)",
                    fort_core::wire::unix_now()
                ),
                None => format!("HTTP 401: {}", signing.unauthorized_hint(host)),
            };
            (EXIT_AUTH, body, Some(note))
        }
        // The message says which setting grants it (docs/protocol.md §5a).
        403 => (EXIT_AUTH, body, Some(error_note(reply))),
        s if (200..300).contains(&s) => match &reply.auth {
            ResponseAuth::Verified => (EXIT_OK, body, None),
            other => (
                EXIT_FAIL,
                body,
                Some(format!(
                    "response signature NOT verified: {other:?}; not trusting this reply"
                )),
            ),
        },
        _ => (EXIT_FAIL, body, Some(error_note(reply))),
    }
}

/// `HTTP 404: <the error body's message>`, made printable (it came from a peer).
fn error_note(reply: &Reply) -> String {
    let message = serde_json::from_slice::<Value>(&reply.body)
        .ok()
        .and_then(|v| {
            v["message"]
                .as_str()
                .map(|m| printable(m, 400))
                .or_else(|| v["error"].as_str().map(|m| printable(m, 100)))
        });
    match message {
        Some(m) => format!("HTTP {}: {m}", reply.status),
        None => format!("HTTP {}", reply.status),
    }
}

/// A command that prints ends quietly when its reader goes away (`fort-agent audit verify
/// | head -1`): SIGPIPE back to its default, which ends the process as a shell's tools
/// end, instead of the runtime's "ignore", which turns the next write into a panic. Only
/// for commands that print and exit: the daemon keeps ignoring it (a peer that closes its
/// connection must never end the agent). The TCP connections a command makes are
/// unaffected (std sends on them with MSG_NOSIGNAL), and the admin socket is written one
/// request line before the daemon answers.
#[allow(unsafe_code)]
pub fn quiet_on_closed_pipe() {
    // SAFETY: signal(2) with SIG_DFL before any thread that could write has started.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}
