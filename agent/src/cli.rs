//! The `fort` operator CLI: signed calls to any host, and the fleet view. Also the table
//! renderers shared with `fort-agent status`.

mod fleet;
mod graph;
mod table;

use std::fmt::Write;
use std::path::PathBuf;
use std::sync::Arc;

use fort_core::client::{ClientOptions, Reply, ResponseAuth, SignedClient, Target};
use fort_core::schema::Registry;
use fort_core::sign::Signer;
use serde_json::Value;

pub use fleet::{
    fleet, fleet_json, fleet_table, healthy, load_expected, with_expected_hosts, Expected,
    FleetRow, ManifestCheck, ManifestState,
};
pub use graph::fleet_graph;
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

pub struct Session {
    pub registry: Arc<Registry>,
    pub client: SignedClient,
}

impl Session {
    pub fn open(id: &Identity) -> Result<Session, (u8, String)> {
        let registry = Registry::load(&id.hosts).map_err(|e| (EXIT_FAIL, e.to_string()))?;
        let signer = Signer::from_file(&id.key).map_err(|e| (EXIT_AUTH, e.to_string()))?;
        if registry.get(&id.origin).is_none() {
            return Err((
                EXIT_AUTH,
                format!("origin {:?} is not in {}", id.origin, id.hosts.display()),
            ));
        }
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
        })
    }

    /// Signs and sends `body` to `host`'s capability.
    pub async fn call(
        &self,
        host: &str,
        capability: &str,
        body: Vec<u8>,
    ) -> Result<Reply, (u8, String)> {
        let peer = self
            .registry
            .get(host)
            .ok_or_else(|| (EXIT_FAIL, format!("{host:?} is not a host in hosts.json")))?;
        let address = peer
            .address
            .as_deref()
            .ok_or_else(|| (EXIT_FAIL, format!("{host:?} is a principal, not a host")))?;
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
        .ok_or_else(|| {
            (
                EXIT_FAIL,
                format!("{host:?} is not a host in {}", hosts.display()),
            )
        })?;
    peer.keys
        .iter()
        .map(|k| fort_core::tls::pin(k).map_err(|e| (EXIT_FAIL, e.to_string())))
        .collect()
}

/// Turns a reply into (exit code, stdout text, stderr note).
pub fn judge(reply: &Reply, pretty: bool) -> (u8, String, Option<String>) {
    let body = if pretty {
        serde_json::from_slice::<Value>(&reply.body)
            .ok()
            .and_then(|v| serde_json::to_string_pretty(&v).ok())
            .unwrap_or_else(|| String::from_utf8_lossy(&reply.body).into_owned())
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
        401 | 403 => {
            let mut note = format!("HTTP {}", reply.status);
            if let Some(t) = reply.server_time {
                let _ = write!(
                    note,
                    " (clock skew? server time {t}, ours {})",
                    fort_core::wire::unix_now()
                );
            }
            (EXIT_AUTH, body, Some(note))
        }
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
        s => (EXIT_FAIL, body, Some(format!("HTTP {s}"))),
    }
}
