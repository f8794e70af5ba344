//! Files delivered as systemd encrypted credentials (docs/protocol.md §11.3, *Encrypted
//! files*): what their `encrypt` binds them to, and the rule that keeps their plaintext
//! out of what the consumer keeps for other needs' references (§11.5).

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::needs::Needs;
use super::refs::pointers_overlap;
use super::{invalid, SchemaError};

/// What `systemd-creds encrypt --with-key=` binds an encrypted file to: the host's
/// credential secret, the TPM2, both, or both when there is a TPM2 (`auto`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum CredentialKey {
    #[serde(rename = "auto")]
    Auto,
    #[serde(rename = "host")]
    Host,
    #[serde(rename = "tpm2")]
    Tpm2,
    #[serde(rename = "host+tpm2")]
    HostTpm2,
}

impl CredentialKey {
    /// As `--with-key=` takes it, and as `needs.json` writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            CredentialKey::Auto => "auto",
            CredentialKey::Host => "host",
            CredentialKey::Tpm2 => "tpm2",
            CredentialKey::HostTpm2 => "host+tpm2",
        }
    }
}

/// What other needs' requests refer to is kept in the consumer's state (§11.5): of a
/// need with an encrypted file only the values referred to are, and none of them may
/// reach what an encrypted file holds, whose plaintext must never be kept.
pub(super) fn check_encrypted_not_referred(file: &Path, needs: &Needs) -> Result<(), SchemaError> {
    for (key, spec) in needs {
        for r in spec.references() {
            let Some(encrypted) = needs.get(&r.need).and_then(|s| {
                s.files
                    .iter()
                    .find(|f| f.encrypted() && pointers_overlap(&f.pointer, &r.pointer))
            }) else {
                continue;
            };
            return Err(invalid(
                file,
                format!(
                    "need \"{key}\" refers to {r}, which reaches what its encrypted file {:?} holds: what a reference reaches is kept in the state, where an encrypted file's plaintext must never be; refer to another part of the payload, or do not encrypt the file",
                    encrypted.label()
                ),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::names::NeedKey;
    use std::collections::BTreeMap;

    use crate::schema::needs::tests::{needs, registry};
    use crate::schema::{validate_needs, NeedSpec};

    #[test]
    fn encrypted_files_are_named_and_references_stay_beside_them() {
        let ok = needs(
            r#"{"oidc/o":{"from":"forge","request":{},"nag_seconds":5,
                "files":[{"name":"secret","path":"/var/lib/fort/credentials/oidc/o/secret.cred","pointer":"/s","encrypt":"host+tpm2"}]}}"#,
        )
        .unwrap();
        let f = &ok[&NeedKey::parse("oidc/o").unwrap()].files[0];
        assert_eq!(f.encrypt, Some(CredentialKey::HostTpm2));
        assert_eq!(
            serde_json::to_value(f).unwrap()["encrypt"],
            serde_json::json!("host+tpm2")
        );
        // Absent: not written, so a plain file serialises (and hashes) as before.
        let plain = needs(
            r#"{"a/x":{"from":"forge","request":{},"nag_seconds":5,"files":[{"path":"/f"}]}}"#,
        )
        .unwrap();
        let plain = serde_json::to_value(&plain[&NeedKey::parse("a/x").unwrap()].files[0]).unwrap();
        assert!(plain.get("encrypt").is_none(), "{plain}");
        for (bad, says) in [
            (r#"{"path":"/c","encrypt":"host"}"#, "needs a name"),
            (
                r#"{"name":"c","path":"/c","encrypt":"tpm3"}"#,
                "unknown variant",
            ),
        ] {
            let json = format!(
                r#"{{"a/x":{{"from":"forge","request":{{}},"nag_seconds":5,"files":[{bad}]}}}}"#
            );
            let err = match serde_json::from_str::<BTreeMap<String, NeedSpec>>(&json) {
                Err(e) => e.to_string(),
                Ok(raw) => validate_needs(Path::new("needs.json"), raw, &registry())
                    .unwrap_err()
                    .to_string(),
            };
            assert!(err.contains(says), "{bad}: {err}");
        }
        let declared = |reference: &str| {
            needs(&format!(
                r#"{{"db/x":{{"from":"forge","request":{{}},"nag_seconds":5,
                  "files":[{{"name":"password","path":"/p.cred","pointer":"/password","encrypt":"auto"}}]}},
                "app/y":{{"from":"forge","request":{{"r":{{"$fort_ref":"{reference}"}}}},"nag_seconds":5}}}}"#
            ))
        };
        // Beside the encrypted file: kept alone, as a projection of the payload.
        assert!(declared("db/x#/user").is_ok());
        for reaching in ["db/x#/password", "db/x", "db/x#/password/0"] {
            let err = declared(reaching).unwrap_err().to_string();
            assert!(
                err.contains("reaches what its encrypted file \"password\" holds"),
                "{reaching}: {err}"
            );
        }
    }
}
