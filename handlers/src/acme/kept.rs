//! The hashes of the responses the `acme` handler prints (protocol §11.11), so an entry
//! whose agent already holds its certificate is kept without printing it again, and
//! without hashing 4 KiB of certificates per entry on every run either.
//!
//! A cache, in a file of its own beside the state file (`<state>.kept`): the state file
//! keeps its form, so a handler that predates this still reads it. Each hash is
//! recorded with a fingerprint of what it was computed from (the CSR's hash, the expiry,
//! the lengths of leaf and chain and the ends of both, which hold their signatures), so a
//! certificate issued since, or a state file restored or edited, gets its hash computed
//! again; a missing, unreadable or outdated file only costs hashing again.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::response_sha256;
use super::state::Issued;
use crate::common::state::StateFile;

/// The form of the response the hashes are of: a change to what [`super::response`]
/// prints must change this, so no hash of the old form is used.
const RESPONSE_FORM: u32 = 1;

#[derive(Default, Serialize, Deserialize)]
struct Hashes {
    entries: BTreeMap<String, Recorded>,
}

#[derive(Clone, PartialEq, Serialize, Deserialize)]
struct Recorded {
    /// Which certificate and chain (see [`fingerprint`]).
    certificate: String,
    sha256: String,
}

/// The cache for one run.
pub struct Kept {
    file: StateFile,
    hashes: Hashes,
    changed: bool,
}

/// The CSR's hash, the expiry, the lengths of leaf and chain, and the last characters of
/// each before its final END line: their signatures, different for every certificate.
fn fingerprint(i: &Issued) -> String {
    fn tail(pem: &str) -> String {
        let body = pem.trim_end();
        let body = body
            .strip_suffix("-----END CERTIFICATE-----")
            .unwrap_or(body);
        let body = body.trim_end();
        let start = body.char_indices().rev().nth(47).map_or(0, |(i, _)| i);
        body[start..].to_owned()
    }
    format!(
        "{}/{}/{}:{}/{}:{}",
        i.csr_sha256,
        i.not_after,
        i.certificate.len(),
        tail(&i.certificate),
        i.chain.len(),
        tail(&i.chain)
    )
}

pub fn path_for(state: &Path) -> PathBuf {
    crate::common::state::beside(state, ".kept")
}

impl Kept {
    /// The hashes recorded beside `state`; none when there are none usable.
    pub fn load(state: &Path) -> Kept {
        let file = StateFile::new(path_for(state));
        let hashes: Hashes = file.load_or_forget(
            RESPONSE_FORM,
            "acme",
            "hashing every held certificate again",
        );
        Kept {
            file,
            hashes,
            changed: false,
        }
    }

    /// The hash of `i`'s response for entry `key`: recorded, or computed and recorded.
    pub fn sha256(&mut self, key: &str, i: &Issued) -> String {
        let certificate = fingerprint(i);
        if let Some(r) = self.hashes.entries.get(key) {
            if r.certificate == certificate {
                return r.sha256.clone();
            }
        }
        let sha256 = response_sha256(i);
        self.hashes.entries.insert(
            key.to_owned(),
            Recorded {
                certificate,
                sha256: sha256.clone(),
            },
        );
        self.changed = true;
        sha256
    }

    /// Forgets entries that are not in `present`, and writes the file when anything
    /// changed. A failure to write is reported and costs only hashing again next run.
    pub fn save(mut self, present: &BTreeSet<&str>) {
        let before = self.hashes.entries.len();
        self.hashes
            .entries
            .retain(|k, _| present.contains(k.as_str()));
        if !self.changed && self.hashes.entries.len() == before {
            return;
        }
        self.file
            .save_or_report(RESPONSE_FORM, &self.hashes, "acme");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn issued(certificate: &str, not_after: i64) -> Issued {
        Issued {
            csr_sha256: "c5".into(),
            names: vec!["a.test".into()],
            certificate: certificate.into(),
            chain: "-----BEGIN CERTIFICATE-----\nMIIC\n-----END CERTIFICATE-----\n".into(),
            not_after,
        }
    }

    #[test]
    fn a_recorded_hash_is_used_only_for_its_certificate() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("acme.json");
        let first = issued(
            "-----BEGIN CERTIFICATE-----\nMIIB\nAAAA\n-----END CERTIFICATE-----\n",
            10,
        );
        let mut kept = Kept::load(&state);
        let sha = kept.sha256("app:c/a", &first);
        assert_eq!(sha, response_sha256(&first));
        kept.save(&BTreeSet::from(["app:c/a"]));
        let written = std::fs::read(path_for(&state)).unwrap();

        // Read back: the same hash, nothing written again.
        let mut kept = Kept::load(&state);
        assert_eq!(kept.sha256("app:c/a", &first), sha);
        kept.save(&BTreeSet::from(["app:c/a"]));
        assert_eq!(std::fs::read(path_for(&state)).unwrap(), written);

        // Another certificate for the same CSR and expiry: hashed anew.
        let other = issued(
            "-----BEGIN CERTIFICATE-----\nMIIB\nBBBB\n-----END CERTIFICATE-----\n",
            10,
        );
        let mut kept = Kept::load(&state);
        assert_eq!(kept.sha256("app:c/a", &other), response_sha256(&other));
        assert_ne!(response_sha256(&other), sha);
        // The same leaf with another chain, or another line ending: hashed anew.
        let mut rechained = issued(
            "-----BEGIN CERTIFICATE-----\nMIIB\nAAAA\n-----END CERTIFICATE-----\n",
            10,
        );
        rechained.chain.push('\n');
        assert_eq!(
            kept.sha256("app:c/a", &rechained),
            response_sha256(&rechained)
        );
        assert_ne!(response_sha256(&rechained), sha);
        // Released entries are forgotten; a broken file is only a cache miss.
        kept.save(&BTreeSet::new());
        std::fs::write(path_for(&state), "{").unwrap();
        let mut kept = Kept::load(&state);
        assert_eq!(kept.sha256("app:c/a", &first), sha);
    }
}
