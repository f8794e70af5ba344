//! What a consumer asks the postgres capability for: the same shape as the NixOS
//! interface (`nixos-module/interfaces/postgres.nix`) and its request schema.

use serde::Deserialize;
use serde_json::Value;

use super::names;

/// `{}` is a database and role under the derived name; `rotate` and `name` are optional.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Request {
    /// A counter the consumer raises to get a new password (its old one stops working).
    /// Unset: 0.
    #[serde(default)]
    pub rotate: u64,
    /// A name of its own for the role and database, which the provider must allow this
    /// caller (`allow`). Unset: `<prefix>_<origin>_<need id>`.
    #[serde(default)]
    pub name: Option<String>,
}

impl Request {
    /// Parses and checks a request; the error is a one-line reason for the consumer
    /// (naming the field, never echoing a long value).
    pub fn parse(value: &Value, prefix: &str) -> Result<Request, String> {
        if !value.is_object() {
            return Err("request: must be a JSON object".into());
        }
        let request = Request::deserialize(value).map_err(|e| format!("request: {e}"))?;
        if let Some(name) = &request.name {
            if !names::is_requested_name(name) {
                return Err(
                    "request.name: 1 to 63 of a-z, 0-9, _ and -, starting with a letter, not pg_…"
                        .into(),
                );
            }
            if name.starts_with(&format!("{prefix}_")) {
                return Err(format!(
                    "request.name: names starting with {prefix}_ are the derived names of other entries"
                ));
            }
        }
        Ok(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn requests() {
        assert_eq!(
            Request::parse(&json!({}), "fort").unwrap(),
            Request::default()
        );
        let r = Request::parse(&json!({"rotate": 3, "name": "gitea"}), "fort").unwrap();
        assert_eq!((r.rotate, r.name.as_deref()), (3, Some("gitea")));
        for bad in [
            json!({"rotate": -1}),
            json!({"rotate": 1.5}),
            json!({"rotate": "1"}),
            json!({"name": "x\"; DROP ROLE postgres; --"}),
            json!({"name": "fort_web_db"}),
            json!({"name": "pg_read_all_data"}),
            json!({"colour": "red"}),
            json!([]),
            json!(null),
        ] {
            assert!(Request::parse(&bad, "fort").is_err(), "{bad}");
        }
        let long = Request::parse(&json!({"name": "x".repeat(5000)}), "fort").unwrap_err();
        assert!(long.len() < 200, "{long}");
    }
}
