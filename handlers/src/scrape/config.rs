//! The provider operator's config of the scrape capability (JSON, written by the NixOS
//! module from `fort.host.capabilities.<name>.scrape`).

use std::collections::BTreeMap;
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::common::Allowances;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Where the handler records what each entry has and the target files it wrote
    /// (JSON, mode 0600). Required.
    pub state_file: PathBuf,
    /// The directory of Prometheus' `file_sd` target files the handler writes, one per
    /// caller (`<origin>.json`), and nothing else; Prometheus reads `<dir>/*.json`.
    /// Required.
    pub targets_dir: PathBuf,
    /// The fleet registry: a target's address is its caller's there, never one a
    /// request names. Unset: `/etc/fort/hosts.json`.
    #[serde(default = "default_hosts")]
    pub hosts_file: PathBuf,
    /// Ports a caller's exporters may be scraped on (`"9100"`, `"9100-9199"`), per
    /// caller and `"*"`. Unset: none, every request is refused.
    #[serde(default)]
    pub ports: BTreeMap<String, Vec<String>>,
    /// Label names a caller may set on its targets, per caller and `"*"`. Unset: none.
    #[serde(default)]
    pub labels: Allowances,
    /// Label names nobody may set, besides those always reserved (`job`, `instance`,
    /// `fort_host`, `fort_need`, and every name starting with `__`). Unset: none.
    #[serde(default)]
    pub reserved_labels: Vec<String>,
    /// The scheme Prometheus scrapes with. Unset: `http`.
    #[serde(default)]
    pub scheme: Scheme,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scheme {
    #[default]
    Http,
    Https,
}

impl Scheme {
    pub fn as_str(self) -> &'static str {
        match self {
            Scheme::Http => "http",
            Scheme::Https => "https",
        }
    }
}

fn default_hosts() -> PathBuf {
    PathBuf::from("/etc/fort/hosts.json")
}

/// `"9100"` or `"9100-9199"`.
fn port_range(text: &str) -> Result<RangeInclusive<u16>, String> {
    let port = |s: &str| match s.parse::<u16>() {
        Ok(p) if p > 0 => Ok(p),
        _ => Err(format!("{text:?} is not a port or a range of ports")),
    };
    match text.split_once('-') {
        Some((a, b)) => {
            let (a, b) = (port(a)?, port(b)?);
            if a > b {
                return Err(format!("{text:?}: the range runs backwards"));
            }
            Ok(a..=b)
        }
        None => port(text).map(|p| p..=p),
    }
}

/// A Prometheus label name: `[a-zA-Z_][a-zA-Z0-9_]*`, at most 64.
pub fn is_label_name(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b.len() <= 64
        && (b[0].is_ascii_alphabetic() || b[0] == b'_')
        && b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'_')
}

impl Config {
    pub fn load(path: &Path) -> anyhow::Result<Config> {
        let config: Config = crate::common::config::load(path)?;
        config
            .validate()
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), String> {
        for (name, p) in [
            ("state_file", &self.state_file),
            ("targets_dir", &self.targets_dir),
        ] {
            if !p.is_absolute() {
                return Err(format!("{name} must be an absolute path"));
            }
        }
        for (who, ranges) in &self.ports {
            for r in ranges {
                port_range(r).map_err(|e| format!("ports.{who}: {e}"))?;
            }
        }
        self.labels.validate().map_err(|e| format!("labels: {e}"))?;
        for (who, names) in &self.labels.0 {
            if let Some(bad) = names.iter().find(|n| !is_label_name(n)) {
                return Err(format!("labels.{who}: {bad:?} is not a label name"));
            }
        }
        if let Some(bad) = self.reserved_labels.iter().find(|n| !is_label_name(n)) {
            return Err(format!("reserved_labels: {bad:?} is not a label name"));
        }
        Ok(())
    }

    /// Whether `origin` may have a target on `port`.
    pub fn port_allowed(&self, origin: &str, port: u16) -> bool {
        [origin, "*"]
            .iter()
            .filter_map(|k| self.ports.get(*k))
            .flatten()
            .filter_map(|r| port_range(r).ok())
            .any(|r| r.contains(&port))
    }

    /// The ports `origin` may have, for a refusal that tells it.
    pub fn describe_ports(&self, origin: &str) -> String {
        let list: Vec<&str> = [origin, "*"]
            .iter()
            .filter_map(|k| self.ports.get(*k))
            .flatten()
            .map(String::as_str)
            .collect();
        if list.is_empty() {
            format!("no port is allowed for {origin}")
        } else {
            format!("allowed for {origin}: {}", list.join(", "))
        }
    }

    /// Whether nobody may set the label `name`: the target's own (`job`, `instance`,
    /// Prometheus' `__…`), the provider's (`fort_host`, `fort_need`), or one the config
    /// reserves.
    pub fn reserved(&self, name: &str) -> bool {
        matches!(name, "job" | "instance" | "fort_host" | "fort_need")
            || name.starts_with("__")
            || self.reserved_labels.iter().any(|r| r == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_labels_and_mistakes() {
        let c: Config = serde_json::from_str(
            r#"{"state_file": "/s", "targets_dir": "/t", "ports": {"*": ["9100-9199"], "app": ["8080"]},
                "labels": {"*": ["env"]}, "reserved_labels": ["tenant"]}"#,
        )
        .unwrap();
        c.validate().unwrap();
        assert!(c.port_allowed("app", 8080) && c.port_allowed("web", 9150));
        assert!(!c.port_allowed("web", 8080) && !c.port_allowed("app", 9200));
        assert_eq!(c.describe_ports("app"), "allowed for app: 8080, 9100-9199");
        for r in ["job", "instance", "__address__", "fort_host", "tenant"] {
            assert!(c.reserved(r), "{r}");
        }
        assert!(!c.reserved("env"));
        for bad in [
            r#"{"state_file": "/s", "targets_dir": "t"}"#,
            r#"{"state_file": "/s", "targets_dir": "/t", "ports": {"*": ["0"]}}"#,
            r#"{"state_file": "/s", "targets_dir": "/t", "ports": {"*": ["9200-9100"]}}"#,
            r#"{"state_file": "/s", "targets_dir": "/t", "labels": {"*": ["a-b"]}}"#,
            r#"{"state_file": "/s", "targets_dir": "/t", "scheme": "gopher"}"#,
        ] {
            let ok = serde_json::from_str::<Config>(bad)
                .map_err(|e| e.to_string())
                .and_then(|c| c.validate());
            assert!(ok.is_err(), "{bad}");
        }
    }
}
