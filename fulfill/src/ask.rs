//! An operator's "ask again now" for one need (`fort-agent resend`, the `resend` built-in,
//! docs/protocol.md §5a).

use std::time::Duration;

use fort_core::names::NeedKey;

use crate::status::NeedStatus;
use crate::Fulfiller;

impl Fulfiller {
    /// Sends `key`'s request to its provider again as soon as the scheduler gets to it,
    /// whatever its state and back-off: a satisfied need is asked for as if its request
    /// had changed, so its provider calls it back with what it holds now. A need that
    /// waits for others stays waiting. Returns the need's row as it stands now, or `None`
    /// when this host does not declare it.
    pub fn ask_now(&self, key: &NeedKey) -> Option<NeedStatus> {
        {
            let mut view = self.inner.view.lock();
            if !view.needs.contains_key(key) {
                return None;
            }
            // Counts as a request not sent yet: attend() then sends it even when satisfied.
            view.unsent.insert(key.clone());
        }
        self.reschedule(key, Some(Duration::ZERO));
        tracing::info!(need = %key, "asking again now, as an operator asked");
        self.status()
            .into_iter()
            .find(|row| row.need == key.as_str())
    }
}
