//! What a consumer asks the backup-repo capability for: the same shape as the NixOS
//! interface (`nixos-module/interfaces/backup-repo.nix`) and its request schema.

use serde::Deserialize;
use serde_json::Value;

use super::size::Size;

/// `{"public_key": "ssh-ed25519 AAAA…", "quota": "50G", "append_only": true}`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    /// The public half of the key the consumer's agent made (`$fort_key`, `as =
    /// "openssh"`): the only key that reaches the repository.
    public_key: Option<String>,
    /// The repository's quota; unset or null: the provider's.
    #[serde(default)]
    quota: Option<Size>,
    /// Whether the key may only add archives (never delete, prune or compact). Unset
    /// or null: true; false only where the provider grants full access.
    #[serde(default)]
    append_only: Option<bool>,
}

/// A request, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// The key as `<type> <base64>`, whatever comment or spacing it came with: what the
    /// `authorized_keys` line and the response carry.
    pub public_key: String,
    pub quota: Option<u64>,
    pub append_only: bool,
}

impl Request {
    /// The request as sent, or a one-line reason naming the field.
    pub fn parse(value: &Value) -> Result<Request, String> {
        if !value.is_object() {
            return Err("request: must be a JSON object".into());
        }
        let raw = Raw::deserialize(value).map_err(|e| format!("request: {e}"))?;
        let line = raw.public_key.ok_or(
            "request: public_key is missing (the consumer's own key, as its agent makes it)",
        )?;
        let key = crate::ssh_ca::request::public_key(&line)?;
        let public_key = ssh_key::PublicKey::new(key.key_data().clone(), "")
            .to_openssh()
            .map_err(|e| format!("public_key: cannot be written again ({e})"))?;
        Ok(Request {
            public_key,
            quota: raw.quota.map(|s| s.0),
            append_only: raw.append_only.unwrap_or(true),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const KEY: &str =
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAID1AF8PoQ4lakrcKp00bfrycmCzPLsSWjMDNVfEq9GYM";

    #[test]
    fn requests() {
        let r = Request::parse(&json!({"public_key": format!("  {KEY} laptop  ")})).unwrap();
        assert_eq!(r.public_key, KEY);
        assert!(r.append_only && r.quota.is_none());
        // As the NixOS module ships it: unset options are null.
        let r = Request::parse(&json!({"public_key": KEY, "quota": null, "append_only": null}))
            .unwrap();
        assert!(r.append_only);
        let r = Request::parse(&json!({"public_key": KEY, "quota": "50G", "append_only": false}))
            .unwrap();
        assert_eq!((r.quota, r.append_only), (Some(50_000_000_000), false));
        // Whatever follows the key is never carried on: a second line cannot become
        // another authorized key.
        if let Ok(r) = Request::parse(&json!({"public_key": format!("{KEY} x\nssh-ed25519 AAAA")}))
        {
            assert_eq!(r.public_key, KEY);
        }
        for bad in [
            json!({}),
            json!({"public_key": "ssh-dss AAAAB3NzaC1kc3MAAACBAP"}),
            json!({"public_key": format!("command=\"sh\" {KEY}")}),
            json!({"public_key": KEY, "quota": "lots"}),
            json!({"public_key": KEY, "path": "/etc"}),
            json!({"public_key": KEY, "append_only": "no"}),
            json!([]),
        ] {
            let why = Request::parse(&bad).unwrap_err();
            assert!(why.len() < 300, "{why}");
        }
    }
}
