//! Each capability's request schema, as the NixOS module puts it in `capabilities.json`
//! (`request_schema`): the JSON Schema rendered from the capability's interface
//! (nixos-module/interfaces/<name>.nix). The module evaluation test keeps the rendered
//! copy, nixos-module/tests/expected/schemas.json, equal to what the interfaces say; it
//! is built in, so that a host without NixOS gets the same schema from
//! `fort-handler <capability> --schema`.

use serde_json::Value;

const RENDERED: &str = include_str!("../../nixos-module/tests/expected/schemas.json");

/// The request schema of the capability `name` serves.
pub fn request_schema(name: &str) -> Option<Value> {
    let rendered: Value = serde_json::from_str(RENDERED).ok()?;
    rendered.get("schemas")?.get(name).cloned()
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_capability_has_an_object_schema_the_agent_compiles() {
        for cap in crate::CAPABILITIES {
            let schema = super::request_schema(cap.name)
                .unwrap_or_else(|| panic!("no schema for {}", cap.name));
            assert_eq!(schema["type"], "object", "{}", cap.name);
            fort_core::schema::RequestSchema::compile(schema)
                .unwrap_or_else(|e| panic!("{}: {e}", cap.name));
        }
    }
}
