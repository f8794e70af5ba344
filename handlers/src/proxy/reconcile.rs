//! Deciding per entry before anything is written: which vhost each entry asks for (or why
//! it is refused), who has a server name several entries ask for, and what the state says
//! the handler wrote, so that unchanged entries cost nothing.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::config::Config;
use super::request::{resolve, Vhost};
use super::vhost;
use crate::common::Entry;

pub const STATE_VERSION: u32 = 1;

/// What the handler wrote, per entry, and what nginx refused. Only files recorded here
/// (or carrying the marker of the entry asking for them) are ever replaced or removed.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct State {
    /// Entry key → the vhost file in place for it, as nginx last accepted it.
    #[serde(default)]
    pub held: BTreeMap<String, Held>,
    /// Entry key → a vhost that made the test fail: refused again without a test while
    /// the entry asks for the same, until a run that reconciles (`initialize`, `systemd`,
    /// `manual`) tries it again.
    #[serde(default)]
    pub broken: BTreeMap<String, Broken>,
    /// Files changed and tested, but the reload failed: the next run reloads.
    #[serde(default)]
    pub reload_owed: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Held {
    pub file: String,
    /// SHA-256 of the file's content.
    pub digest: String,
    pub server_names: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Broken {
    pub digest: String,
    pub reason: String,
}

/// The vhost an entry will have: its file and content.
#[derive(Debug, Clone)]
pub struct Want {
    pub file: String,
    pub text: String,
    pub digest: String,
    pub vhost: Vhost,
}

impl Want {
    pub fn held(&self) -> Held {
        Held {
            file: self.file.clone(),
            digest: self.digest.clone(),
            server_names: self.vhost.server_names.clone(),
        }
    }
}

/// Every entry's fate before anything is written.
#[derive(Debug, Default)]
pub struct Plan {
    pub wanted: BTreeMap<String, Want>,
    /// Entry key → why it is refused.
    pub refused: BTreeMap<String, String>,
    /// Refused entries whose vhost in place the provider still allows: it stays in
    /// service until a change of theirs is accepted (a refused change never takes down
    /// what works; an allowance taken away does).
    pub kept: BTreeSet<String>,
}

/// Resolves every entry and settles who has a contested server name: an entry that has a
/// name in place keeps it; among the others the first entry key wins.
pub fn plan(
    config: &Config,
    entries: &[Entry],
    held: &BTreeMap<String, Held>,
    host_of: impl Fn(&str) -> Option<String>,
    stays: &BTreeSet<String>,
) -> Plan {
    let mut out = Plan::default();
    let mut candidates: BTreeMap<&str, Want> = BTreeMap::new();
    let mut patterns: HashMap<&str, Vec<String>> = HashMap::new();
    for e in entries {
        let Some(file) = vhost::file_name(e) else {
            out.refused.insert(
                e.key.clone(),
                "the caller or need id is not a fort name".into(),
            );
            continue;
        };
        let allowed = patterns
            .entry(&e.origin)
            .or_insert_with(|| config.allow.patterns(&e.origin));
        match resolve(
            config,
            &e.origin,
            allowed,
            host_of(&e.origin).as_deref(),
            &e.request,
        ) {
            Ok(v) => {
                let text = vhost::render(config, &e.key, &v);
                let digest = vhost::digest(&text);
                candidates.insert(
                    &e.key,
                    Want {
                        file,
                        text,
                        digest,
                        vhost: v,
                    },
                );
            }
            Err(reason) => {
                out.refused.insert(e.key.clone(), reason);
            }
        }
    }
    // Names in place stay with the entry that has them, if it still asks for them, or
    // if its vhost stays in service while a change of it is refused (`stays`).
    let mut owner: HashMap<&str, &str> = HashMap::new();
    for (key, h) in held {
        let asks = candidates.get(key.as_str());
        let kept = asks.is_none() && stays.contains(key);
        for name in &h.server_names {
            if kept || asks.is_some_and(|w| w.vhost.server_names.contains(name)) {
                owner.insert(name.as_str(), key.as_str());
            }
        }
    }
    let mut claimed: HashMap<String, &str> = HashMap::new();
    for (key, want) in candidates {
        let taken = want.vhost.server_names.iter().find(|n| {
            owner.get(n.as_str()).is_some_and(|o| *o != key)
                || claimed.get(n.as_str()).is_some_and(|o| *o != key)
        });
        if let Some(name) = taken {
            out.refused.insert(
                key.to_owned(),
                format!("the server name {name} is already served for another consumer of this provider"),
            );
            continue;
        }
        for n in &want.vhost.server_names {
            claimed.insert(n.clone(), key);
        }
        out.wanted.insert(key.to_owned(), want);
    }
    out.kept = out
        .refused
        .keys()
        .filter(|k| stays.contains(*k))
        .cloned()
        .collect();
    out
}

/// Whether the vhost `h` in place for `entry`, whose content is `text`, is still one the
/// provider would write for it: its request read back from the file passes today's checks
/// (allowances, upstream hosts, TLS sets, name lengths) and renders to the same content.
/// Such a vhost stays in service while a change of the entry is refused.
pub fn still_served(
    config: &Config,
    entry: &Entry,
    h: &Held,
    text: &str,
    own_host: Option<&str>,
) -> bool {
    let Some(request) = vhost::read_back(config, text) else {
        return false;
    };
    let patterns = config.allow.patterns(&entry.origin);
    resolve(config, &entry.origin, &patterns, own_host, &request)
        .is_ok_and(|v| vhost::digest(&vhost::render(config, &entry.key, &v)) == h.digest)
}

/// The response an entry gets for its vhost in place.
pub fn response(vhost: &Vhost) -> Value {
    json!({
        "server_names": vhost.server_names,
        "upstream": vhost.upstream(),
        "tls": vhost.tls,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::common::parse_input;

    #[test]
    fn one_entry_per_server_name_and_the_incumbent_keeps_it() {
        let config: Config = serde_json::from_value(json!({
            "include_dir": "/d", "state_file": "/s", "allow": {"*": ["*.example.org"]}}))
        .unwrap();
        let entries = parse_input(
            json!({
                "a:proxy/x": {"request": {"server_names": ["w.example.org"], "port": 1}},
                "b:proxy/x": {"request": {"server_names": ["v.example.org", "w.example.org"], "port": 1}},
                "c:proxy/x": {"request": {"server_names": ["v.example.org"], "port": 1}},
                "d:proxy/x": {"request": {"server_names": ["u.example.org"], "port": 1}},
            })
            .to_string()
            .as_bytes(),
        )
        .unwrap();
        let held = BTreeMap::from([(
            "b:proxy/x".to_owned(),
            Held {
                file: "fort.b.proxy.x.conf".into(),
                digest: "old".into(),
                server_names: vec!["w.example.org".into()],
            },
        )]);
        let p = plan(
            &config,
            &entries,
            &held,
            |_| Some("10.0.0.1".into()),
            &BTreeSet::new(),
        );
        // b had w in place: a, first by key, is refused; c comes after b for v.
        assert!(p.refused["a:proxy/x"].contains("w.example.org is already served"));
        assert!(p.wanted.contains_key("b:proxy/x"));
        assert!(p.refused["c:proxy/x"].contains("v.example.org"));
        assert_eq!(p.wanted["d:proxy/x"].file, "fort.d.proxy.x.conf");
    }
}
