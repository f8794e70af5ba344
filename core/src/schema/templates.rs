//! Files rendered from a template over the values of several needs (docs/protocol.md
//! §11.14): declared beside the needs in `needs.json`, under `"$templates"`. A template
//! comes from the consumer's own configuration, never from a provider; what it reads of
//! the needs' payloads is the only thing a provider contributes.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::encrypted::CredentialKey;
use super::needs::{check_file, FileSpec, Needs};
use super::{invalid, parse_json, SchemaError};
use crate::names::{is_unit_name, NeedKey};

/// The member of `needs.json` that holds the templates.
pub const TEMPLATES_KEY: &str = "$templates";

/// The longest template text taken.
pub const MAX_TEMPLATE_BYTES: usize = 64 * 1024;

/// Templates per host.
pub const MAX_TEMPLATES: usize = 256;

/// One file rendered from a template.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TemplateSpec {
    /// The template (Jinja's syntax; `needs["<type>/<id>"]` is a need's payload).
    pub template: String,
    /// The needs it reads: it is rendered once all are satisfied, and again whenever one
    /// of their payloads changes.
    pub needs: Vec<String>,
    pub path: std::path::PathBuf,
    #[serde(default = "root")]
    pub owner: String,
    #[serde(default = "root")]
    pub group: String,
    #[serde(default = "default_mode")]
    pub mode: String,
    /// Units that receive the file as a systemd credential (as a need's file's).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub credential_for: Vec<String>,
    /// Stored as a systemd encrypted credential made on this host (as a need's file's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encrypt: Option<CredentialKey>,
    /// Restarted (reloaded) once when the rendered file changes.
    #[serde(default)]
    pub restart_units: Vec<String>,
    #[serde(default)]
    pub reload_units: Vec<String>,
}

fn root() -> String {
    "root".into()
}

fn default_mode() -> String {
    "0400".into()
}

impl TemplateSpec {
    /// The rendered file, as a need's file is declared (the whole rendering, no pointer).
    pub fn file(&self, name: &str) -> FileSpec {
        FileSpec {
            name: Some(name.to_owned()),
            path: self.path.clone(),
            pointer: String::new(),
            owner: self.owner.clone(),
            group: self.group.clone(),
            mode: self.mode.clone(),
            credential_for: self.credential_for.clone(),
            encrypt: self.encrypt,
        }
    }

    /// The needs it reads, parsed (validated at load).
    pub fn inputs(&self) -> Vec<NeedKey> {
        self.needs
            .iter()
            .filter_map(|n| NeedKey::parse(n))
            .collect()
    }
}

/// The templates of a host, by name.
pub type Templates = BTreeMap<String, TemplateSpec>;

/// A template's name: what status and logs call it.
fn is_template_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

/// The templates of `needs.json`'s bytes, checked against its `needs`: each reads
/// declared needs only, none with an encrypted file (its payload is never kept where a
/// template could read it), and writes a path no need or other template writes.
pub fn templates_from_bytes(
    file: &Path,
    bytes: &[u8],
    needs: &Needs,
) -> Result<Templates, SchemaError> {
    #[derive(Deserialize)]
    struct Only {
        #[serde(rename = "$templates", default)]
        templates: Templates,
    }
    // Everything else in the file is the needs, checked on their own.
    let only: BTreeMap<String, serde_json::Value> = parse_json(file, bytes)?;
    let Some(value) = only.get(TEMPLATES_KEY) else {
        return Ok(Templates::new());
    };
    let text = serde_json::to_vec(&serde_json::json!({ TEMPLATES_KEY: value }))
        .expect("a value serialises");
    let Only { templates } = parse_json(file, &text)?;
    if templates.len() > MAX_TEMPLATES {
        return Err(invalid(
            file,
            format!("{TEMPLATES_KEY}: more than {MAX_TEMPLATES} templates"),
        ));
    }
    let mut paths: BTreeMap<&Path, String> = BTreeMap::new();
    for (key, spec) in needs {
        for f in &spec.files {
            paths.insert(&f.path, format!("need {key}"));
        }
        // A key the need's agent made and installs is no place for a rendered file.
        for (name, k) in &spec.keys {
            paths.insert(&k.path, format!("need {key}'s key {name}"));
        }
    }
    for (name, t) in &templates {
        let at = format!("{TEMPLATES_KEY}.{name}");
        if !is_template_name(name) {
            return Err(invalid(
                file,
                format!("{at}: a template's name is 1 to 64 of a-z, 0-9, - and _"),
            ));
        }
        if t.template.len() > MAX_TEMPLATE_BYTES {
            return Err(invalid(
                file,
                format!("{at}.template: longer than {MAX_TEMPLATE_BYTES} bytes"),
            ));
        }
        if t.needs.is_empty() {
            return Err(invalid(file, format!("{at}.needs: names no need")));
        }
        for n in &t.needs {
            let Some(key) = NeedKey::parse(n).filter(|k| needs.contains_key(k)) else {
                return Err(invalid(
                    file,
                    format!("{at}.needs: {n:?} is not a need this host declares"),
                ));
            };
            if needs[&key].files.iter().any(FileSpec::encrypted) {
                return Err(invalid(
                    file,
                    format!(
                        "{at}.needs: {n} has an encrypted file, and its payload is never kept in plaintext for a template to read; deliver that need's files unencrypted and encrypt the template's file instead (\"encrypt\")"
                    ),
                ));
            }
        }
        check_file(&format!("template {name}"), &t.file(name)).map_err(|m| invalid(file, m))?;
        for unit in t.restart_units.iter().chain(&t.reload_units) {
            if !is_unit_name(unit) {
                return Err(invalid(
                    file,
                    format!("{at}: {unit:?} is not a systemd unit name"),
                ));
            }
        }
        if let Some(other) = paths.insert(&t.path, format!("template {name}")) {
            return Err(invalid(
                file,
                format!(
                    "{at}.path: {} is written by {other} too; give each file one writer",
                    t.path.display()
                ),
            ));
        }
    }
    Ok(templates)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rendered file may not land where a need's agent installs a key it made.
    #[test]
    fn a_template_may_not_write_over_a_needs_key() {
        let spec: super::super::NeedSpec = serde_json::from_value(serde_json::json!({
            "from": "edge", "nag_seconds": 60,
            "request": {"csr": {"$fort_key": "tls", "as": "csr"}},
            "keys": {"tls": {"type": "ecdsa-p256", "path": "/var/lib/app/key.pem",
                             "names": ["app.example.org"]}},
            "files": [{"name": "cert", "path": "/var/lib/app/cert.pem", "pointer": "/certificate"}]
        }))
        .unwrap();
        let mut needs = Needs::new();
        needs.insert(crate::names::NeedKey::parse("tls/app").unwrap(), spec);
        let file = |path: &str| {
            serde_json::json!({"$templates": {"env": {
                "template": "{{ needs[\"tls/app\"].certificate }}",
                "needs": ["tls/app"], "path": path}}})
            .to_string()
        };
        let err = templates_from_bytes(
            Path::new("needs.json"),
            file("/var/lib/app/key.pem").as_bytes(),
            &needs,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("key tls"), "{err}");
        assert!(templates_from_bytes(
            Path::new("needs.json"),
            file("/var/lib/app/app.env").as_bytes(),
            &needs
        )
        .is_ok());
    }
}
