//! The cached responses of `provider-state.json` sealed with the state key
//! (docs/at-rest.md): each entry's `response` alone, bound to the file, the entry's key
//! and its `response_hash`, so that a sealed response opens only as the response of that
//! entry. Everything else stays plain: status, plan and GC read hashes, never a secret.

use std::path::Path;
use std::sync::Arc;

use fort_core::sealed::{StateKey, ValueSealer};
use fort_core::store::{Seal, Sealing};
use serde_json::value::RawValue;

use super::state::Entry;

pub struct SealedResponses(ValueSealer);

impl SealedResponses {
    /// For the provider state at `path`.
    pub fn new(key: &StateKey, path: &Path) -> SealedResponses {
        SealedResponses(key.value_sealer(path))
    }

    /// How the provider state at `path` is sealed: with `key`, or not yet.
    pub fn sealing(key: Option<&StateKey>, path: &Path) -> Sealing<Entry> {
        match key {
            Some(k) => Sealing::With(Arc::new(SealedResponses::new(k, path))),
            None => Sealing::WithoutKey,
        }
    }
}

impl Seal<Entry> for SealedResponses {
    fn key_id(&self) -> &str {
        self.0.key_id()
    }

    fn seal(&self, key: &str, entry: &Entry) -> Entry {
        let mut out = entry.clone();
        if let Some(response) = &entry.response {
            let hash = entry.current_hash().unwrap_or_default();
            let sealed = self.0.seal(&[key, &hash], response.get().as_bytes());
            out.response = Some(Arc::from(
                serde_json::value::to_raw_value(&sealed).expect("a string serialises"),
            ));
            out.response_hash = Some(hash);
        }
        out
    }

    fn open(&self, key: &str, mut entry: Entry) -> Result<Entry, String> {
        let Some(sealed) = &entry.response else {
            return Ok(entry);
        };
        let response = || "response".to_owned();
        let text: String = serde_json::from_str(sealed.get()).map_err(|_| response())?;
        let hash = entry
            .response_hash
            .clone()
            .ok_or_else(|| "response_hash".to_owned())?;
        let mut plain = self.0.open(&[key, &hash], &text).ok_or_else(response)?;
        let json = String::from_utf8(std::mem::take(&mut *plain)).map_err(|_| response())?;
        let raw = RawValue::from_string(json).map_err(|_| response())?;
        entry.response = Some(Arc::from(raw));
        Ok(entry)
    }
}
