//! `capabilities.json`: what this host serves, to whom, and what a request must look like
//! (docs/protocol.md §5, §10, §11.2, §11.6).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::hosts::Registry;
use super::{invalid, parse_json, read, SchemaError, BUILTIN_CAPABILITIES};
use crate::names::{is_capability_name, is_unit_name};

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    Async,
    Rpc,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Triggers {
    /// Run the handler over all entries after start.
    #[serde(default)]
    pub initialize: bool,
    /// Units whose success triggers a run (wired by the NixOS module).
    #[serde(default)]
    pub systemd: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CapabilitySpec {
    pub handler: PathBuf,
    /// Arguments the handler is started with (one program serving several capabilities:
    /// `fort-handler acme --config FILE`). Omitted when empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    pub mode: Mode,
    /// Pass each entry's last response back to the handler.
    #[serde(rename = "cacheResponse", default)]
    pub cache_response: bool,
    /// Principals and hosts allowed besides the callers; their entries are capped per
    /// origin (`max_entries_per_origin`).
    #[serde(default)]
    pub allowed: Vec<String>,
    /// Host → the need ids it declares of this type from this host (§11.2). A set: the
    /// check runs on every request, and a host may declare thousands.
    #[serde(default)]
    pub callers: BTreeMap<String, BTreeSet<String>>,
    #[serde(default)]
    pub triggers: Triggers,
    #[serde(default)]
    pub description: Option<String>,
    /// What a request must look like (§11.6); checked before anything is stored or run.
    #[serde(default)]
    pub request_schema: Option<RequestSchema>,
}

impl CapabilitySpec {
    /// Whether `origin` may call this capability at all.
    pub fn permits(&self, origin: &str) -> bool {
        self.allowed.iter().any(|n| n == origin) || self.callers.contains_key(origin)
    }

    /// Whether `origin` is listed in `allowed` (and so holds a capped number of entries).
    pub fn allows(&self, origin: &str) -> bool {
        self.allowed.iter().any(|n| n == origin)
    }

    /// Whether host `origin` declares the need id `id` of this capability from here.
    pub fn declares(&self, origin: &str, id: &str) -> bool {
        self.callers.get(origin).is_some_and(|ids| ids.contains(id))
    }
}

/// A request schema, compiled once at load. Serialises as the schema it was given.
#[derive(Clone)]
pub struct RequestSchema {
    source: Value,
    validator: Arc<jsonschema::Validator>,
}

impl RequestSchema {
    /// Compiles a draft 2020-12 schema. Remote references cannot be followed (no
    /// resolver is built in): a schema must be self-contained.
    pub fn compile(source: Value) -> Result<RequestSchema, String> {
        // Patterns are matched by the `regex` engine, in time linear in the input: a
        // pattern that needs backtracking (backreferences, look-around) is refused here,
        // rather than let one request cost seconds of CPU.
        let validator = jsonschema::draft202012::options()
            .with_pattern_options(jsonschema::PatternOptions::regex())
            .build(&source)
            .map_err(|e| format!("request_schema is not a usable JSON Schema: {e}"))?;
        Ok(RequestSchema {
            source,
            validator: Arc::new(validator),
        })
    }

    pub fn source(&self) -> &Value {
        &self.source
    }

    /// `Err` names the JSON pointer of the first violation and the rule it breaks, but
    /// never the offending value: requests built from other needs' payloads can carry
    /// credentials, and this text goes to the caller and the log.
    pub fn check(&self, instance: &Value) -> Result<(), String> {
        self.validator
            .validate(instance)
            .map_err(|e| describe(&e).1)
    }

    /// Every violation as `(JSON pointer, message)`, worded as [`RequestSchema::check`]
    /// words the first.
    pub fn violations(&self, instance: &Value) -> Vec<(String, String)> {
        self.validator
            .iter_errors(instance)
            .map(|e| describe(&e))
            .collect()
    }
}

fn describe(e: &jsonschema::ValidationError<'_>) -> (String, String) {
    use jsonschema::error::ValidationErrorKind as Kind;
    let at = e.instance_path().to_string();
    let what = match e.kind() {
        Kind::Required { property } => match property.as_str() {
            Some(name) => format!("{name} is required"),
            None => format!("{property} is required"),
        },
        Kind::AdditionalProperties { unexpected } => {
            format!("unexpected field {}", unexpected.join(", "))
        }
        other => format!("breaks the schema's `{}`", other.keyword()),
    };
    let shown = if at.is_empty() { "/" } else { at.as_str() };
    let message = format!("at {shown}: {what} (schema {})", e.schema_path());
    (at, message)
}

impl std::fmt::Debug for RequestSchema {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RequestSchema({})", self.source)
    }
}

impl PartialEq for RequestSchema {
    fn eq(&self, other: &Self) -> bool {
        self.source == other.source
    }
}

impl Serialize for RequestSchema {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.source.serialize(s)
    }
}

impl<'de> Deserialize<'de> for RequestSchema {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let source = Value::deserialize(d)?;
        RequestSchema::compile(source).map_err(serde::de::Error::custom)
    }
}

pub type Capabilities = BTreeMap<String, CapabilitySpec>;

pub fn load_capabilities(file: &Path, registry: &Registry) -> Result<Capabilities, SchemaError> {
    capabilities_from_bytes(file, &read(file)?, registry)
}

/// `capabilities.json` from bytes already read (`file` names them in errors).
pub fn capabilities_from_bytes(
    file: &Path,
    bytes: &[u8],
    registry: &Registry,
) -> Result<Capabilities, SchemaError> {
    let raw: Capabilities = parse_json(file, bytes)?;
    validate_capabilities(file, raw, registry)
}

/// Bounds on `args`: a command line, not a data channel.
const MAX_ARGS: usize = 64;
const MAX_ARG_BYTES: usize = 4096;

pub fn validate_capabilities(
    file: &Path,
    caps: Capabilities,
    registry: &Registry,
) -> Result<Capabilities, SchemaError> {
    for (name, cap) in &caps {
        let bad = |message: String| invalid(file, format!("capability {name:?}: {message}"));
        if !is_capability_name(name) {
            return Err(invalid(
                file,
                format!("capability name {name:?} breaks ^[a-z0-9][a-z0-9_-]{{0,63}}$"),
            ));
        }
        if BUILTIN_CAPABILITIES.contains(&name.as_str()) {
            return Err(bad("clashes with a built-in capability".into()));
        }
        for who in &cap.allowed {
            if registry.get(who).is_none() {
                return Err(bad(format!("allowed {who:?} is not in hosts.json")));
            }
        }
        for (who, ids) in &cap.callers {
            if !registry.is_host(who) {
                return Err(bad(format!("caller {who:?} is not a host in hosts.json")));
            }
            if let Some(id) = ids.iter().find(|i| !is_capability_name(i)) {
                return Err(bad(format!("caller {who:?}: {id:?} is not a need id")));
            }
        }
        if cap.args.len() > MAX_ARGS {
            return Err(bad(format!("more than {MAX_ARGS} args")));
        }
        if let Some(arg) = cap
            .args
            .iter()
            .find(|a| a.len() > MAX_ARG_BYTES || a.contains('\0'))
        {
            let shown: String = arg.chars().take(40).collect();
            return Err(bad(format!(
                "arg {shown:?}… is longer than {MAX_ARG_BYTES} bytes or holds a NUL"
            )));
        }
        for unit in &cap.triggers.systemd {
            if !is_unit_name(unit) {
                return Err(bad(format!("trigger {unit:?} is not a unit name")));
            }
        }
        if cap.mode == Mode::Rpc
            && (cap.cache_response || cap.triggers.initialize || !cap.triggers.systemd.is_empty())
        {
            return Err(bad(
                "cacheResponse and triggers apply to async mode only".into()
            ));
        }
    }
    Ok(caps)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::hosts::tests::hosts_json;

    fn registry() -> Registry {
        Registry::from_bytes(Path::new("h"), hosts_json().as_bytes()).unwrap()
    }

    #[test]
    fn args_are_bounded() {
        let parse = |args: serde_json::Value| {
            let caps: Capabilities = serde_json::from_value(serde_json::json!(
                {"acme": {"handler": "/x", "mode": "async", "args": args}}
            ))
            .unwrap();
            validate_capabilities(Path::new("c"), caps, &registry())
        };
        let ok = parse(serde_json::json!([
            "acme",
            "--config",
            "/etc/fort/acme.json"
        ]))
        .unwrap();
        assert_eq!(ok["acme"].args.len(), 3);
        assert!(parse(serde_json::json!(vec!["a"; 65])).is_err());
        assert!(parse(serde_json::json!(["a\u{0}b"])).is_err());
        assert!(parse(serde_json::json!(["x".repeat(4097)])).is_err());
        // Empty args are left out when written back: the bytes of older files stay.
        let text = serde_json::to_string(&parse(serde_json::json!([])).unwrap()).unwrap();
        assert!(!text.contains("args"), "{text}");
    }

    #[test]
    fn builtin_clash_is_an_error() {
        let caps: Capabilities =
            serde_json::from_str(r#"{"status":{"handler":"/x","mode":"rpc"}}"#).unwrap();
        assert!(validate_capabilities(Path::new("c"), caps, &registry()).is_err());
    }

    #[test]
    fn callers_are_hosts_with_need_ids() {
        let caps: Capabilities = serde_json::from_str(
            r#"{"oidc":{"handler":"/x","mode":"async","callers":{"forge":["wiki"]},"allowed":["ops"]}}"#,
        )
        .unwrap();
        let caps = validate_capabilities(Path::new("c"), caps, &registry()).unwrap();
        let oidc = &caps["oidc"];
        assert!(oidc.declares("forge", "wiki"));
        assert!(!oidc.declares("forge", "other"));
        assert!(oidc.permits("ops") && oidc.allows("ops") && !oidc.allows("forge"));
        let old: Result<Capabilities, _> =
            serde_json::from_str(r#"{"oidc":{"handler":"/x","mode":"async","callers":["forge"]}}"#);
        assert!(old.is_err(), "the v1 list form is refused");
        let caps: Capabilities = serde_json::from_str(
            r#"{"oidc":{"handler":"/x","mode":"async","callers":{"ops":["wiki"]}}}"#,
        )
        .unwrap();
        assert!(validate_capabilities(Path::new("c"), caps, &registry()).is_err());
    }

    #[test]
    fn request_schemas_compile_and_name_the_path() {
        let caps: Capabilities = serde_json::from_str(
            r#"{"oidc":{"handler":"/x","mode":"async","request_schema":{
                "type":"object","additionalProperties":false,"required":["client_name"],
                "properties":{"client_name":{"type":"string","pattern":"^[a-z]+$"},
                              "scopes":{"type":"array","items":{"enum":["openid","email"]}}}}}}"#,
        )
        .unwrap();
        let schema = caps["oidc"].request_schema.as_ref().unwrap();
        assert!(schema
            .check(&serde_json::json!({"client_name": "wiki"}))
            .is_ok());
        let err = schema
            .check(&serde_json::json!({"client_name": "wiki", "scopes": ["openid", "root"]}))
            .unwrap_err();
        assert!(err.contains("/scopes/1"), "{err}");
        let err = schema
            .check(&serde_json::json!({"client_name": 3}))
            .unwrap_err();
        assert!(err.contains("/client_name"), "{err}");
        let bad: Result<Capabilities, _> = serde_json::from_str(
            r#"{"oidc":{"handler":"/x","mode":"async","request_schema":{"type":"nonsense"}}}"#,
        );
        assert!(bad.is_err());
    }
}
