//! What a consumer asks the scrape capability for: the same shape as the NixOS interface
//! (`nixos-module/interfaces/scrape.nix`) and its request schema. There is no address:
//! the target is always the caller's own.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::config::is_label_name;

/// Most labels one target may set.
pub const MAX_LABELS: usize = 8;
/// Longest label value.
const MAX_VALUE: usize = 128;

/// `{"port": 9100, "path": "/metrics", "job": "node", "labels": {"env": "prod"}}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    port: u16,
    #[serde(default)]
    path: Option<String>,
    #[serde(default)]
    job: Option<String>,
    #[serde(default)]
    labels: Option<BTreeMap<String, String>>,
}

/// An exporter to scrape, checked in itself (not yet against the provider's policy).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Exporter {
    pub port: u16,
    pub path: String,
    /// The job asked for (or the need's id); its label is the caller's under it.
    pub job: String,
    pub labels: BTreeMap<String, String>,
}

impl Exporter {
    /// The request of need `id`, or a one-line reason naming the field.
    pub fn parse(value: &Value, id: &str) -> Result<Exporter, String> {
        if !value.is_object() {
            return Err("request: must be a JSON object".into());
        }
        let raw = Raw::deserialize(value).map_err(|e| format!("request: {e}"))?;
        if raw.port == 0 {
            return Err("request.port: 1 to 65535".into());
        }
        let path = raw.path.unwrap_or_else(|| "/metrics".into());
        let path_ok = path.starts_with('/')
            && path.len() <= 256
            && path
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"/._~-".contains(&b));
        if !path_ok {
            return Err(
                "request.path: a path of letters, digits and / . _ ~ - (at most 256)".into(),
            );
        }
        let job = raw.job.unwrap_or_else(|| id.to_owned());
        let job_ok = !job.is_empty()
            && job.len() <= 64
            && (job.as_bytes()[0].is_ascii_alphabetic() || job.starts_with('_'))
            && job
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_-".contains(&b));
        if !job_ok {
            return Err(
                "request.job: a letter or _, then letters, digits, _ and - (at most 64)".into(),
            );
        }
        let labels = raw.labels.unwrap_or_default();
        if labels.len() > MAX_LABELS {
            return Err(format!("request.labels: at most {MAX_LABELS}"));
        }
        for (name, value) in &labels {
            if !is_label_name(name) {
                return Err(format!(
                    "request.labels: {:?} is not a label name",
                    name.chars().take(64).collect::<String>()
                ));
            }
            if value.len() > MAX_VALUE || value.chars().any(|c| c.is_control()) {
                return Err(format!(
                    "request.labels.{name}: at most {MAX_VALUE} bytes, no control characters"
                ));
            }
        }
        Ok(Exporter {
            port: raw.port,
            path,
            job,
            labels,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn requests() {
        let e = Exporter::parse(&json!({"port": 9100}), "node").unwrap();
        assert_eq!((e.path.as_str(), e.job.as_str()), ("/metrics", "node"));
        // As the NixOS module ships it: unset options are null.
        let e = Exporter::parse(
            &json!({"port": 9100, "path": "/m", "job": null, "labels": {"env": "prod"}}),
            "node",
        )
        .unwrap();
        assert_eq!(e.labels["env"], "prod");
        for bad in [
            json!({"port": 0}),
            json!({"port": 70000}),
            json!({"port": 9100, "address": "10.0.0.9"}),
            json!({"port": 9100, "path": "metrics"}),
            json!({"port": 9100, "path": "/m?x=1"}),
            json!({"port": 9100, "job": "9x"}),
            json!({"port": 9100, "labels": {"a-b": "x"}}),
            json!({"port": 9100, "labels": {"env": "a\nb"}}),
            json!({"port": 9100, "labels": (0..9).map(|i| (format!("l{i}"), "x")).collect::<BTreeMap<_, _>>()}),
            json!([]),
        ] {
            assert!(Exporter::parse(&bad, "node").is_err(), "{bad}");
        }
    }
}
