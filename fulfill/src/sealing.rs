//! What `fulfillment-state.json` keeps of payloads, sealed with the state key
//! (docs/at-rest.md): a payload recorded before it is applied (`inbox`) and one kept for
//! the needs that refer to it (`payload`) hold the secrets providers sent. With a key
//! each is sealed alone, bound to the file, the need and the member, so a copy of the
//! state directory (or a log not yet folded) gives none away; everything else stays
//! plain for status and plan. A payload already encrypted by `systemd-creds` is left as it
//! is.

use std::path::Path;
use std::sync::Arc;

use fort_core::sealed::{StateKey, ValueSealer};
use fort_core::store::{Seal, Sealing};

use crate::state::NeedState;

pub struct SealedPayloads(ValueSealer);

impl SealedPayloads {
    /// For the consumer state at `path`.
    pub fn new(key: &StateKey, path: &Path) -> SealedPayloads {
        SealedPayloads(key.value_sealer(path))
    }

    /// How the consumer state at `path` is sealed: with `key`, or not at all (without a
    /// key a sealed file is refused, never read as plain).
    pub fn sealing(key: Option<&StateKey>, path: &Path) -> Sealing<NeedState> {
        match key {
            Some(k) => Sealing::With(Arc::new(SealedPayloads::new(k, path))),
            None => Sealing::WithoutKey,
        }
    }
}

/// The associated data of a need's sealed member: the need's key, the member, and for
/// the inbox the callback's number (a sealed inbox copied to another callback does not
/// open).
fn context(seq: Option<u64>) -> String {
    seq.map_or_else(|| "payload".to_owned(), |s| format!("inbox {s}"))
}

impl Seal<NeedState> for SealedPayloads {
    fn key_id(&self) -> &str {
        self.0.key_id()
    }

    fn seal(&self, key: &str, st: &NeedState) -> NeedState {
        let mut out = st.clone();
        if let Some(p) = &st.payload {
            out.payload = Some(self.0.seal(&[key, &context(None)], p.as_bytes()));
        }
        if let Some(inbox) = out.inbox.as_mut().filter(|i| !i.encrypted) {
            inbox.payload = self
                .0
                .seal(&[key, &context(Some(inbox.seq))], inbox.payload.as_bytes());
        }
        out
    }

    fn open(&self, key: &str, mut st: NeedState) -> Result<NeedState, String> {
        if let Some(sealed) = &st.payload {
            let plain = self
                .0
                .open(&[key, &context(None)], sealed)
                .ok_or_else(|| "payload".to_owned())?;
            st.payload = Some(String::from_utf8(plain.to_vec()).map_err(|_| "payload")?);
        }
        if let Some(inbox) = st.inbox.as_mut().filter(|i| !i.encrypted) {
            let plain = self
                .0
                .open(&[key, &context(Some(inbox.seq))], &inbox.payload)
                .ok_or_else(|| "inbox.payload".to_owned())?;
            inbox.payload = String::from_utf8(plain.to_vec()).map_err(|_| "inbox.payload")?;
        }
        Ok(st)
    }
}
