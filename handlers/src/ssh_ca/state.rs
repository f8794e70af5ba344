//! What the SSH CA remembers between runs: the next serial, what each entry holds, and
//! the serials it revoked (until they expire), from which the KRL is written.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::krl::Krl;

/// The version of the state document; a later release upgrades from it.
pub const VERSION: u32 = 1;

#[derive(Debug, Default, Serialize, Deserialize)]
pub struct State {
    /// The serial the next certificate gets (0: not yet set; `first_serial` then).
    pub next_serial: u64,
    /// SHA256 fingerprint of the CA key that signed the entries' certificates.
    pub ca: String,
    /// `krl_version` and `generated_date` of the KRL: they change with the revoked set.
    pub krl_version: u64,
    pub krl_generated: u64,
    /// Entry key → what it holds.
    pub entries: BTreeMap<String, Issued>,
    /// Revoked certificates that have not expired yet.
    pub revoked: Vec<Revoked>,
}

/// The certificate an entry holds, and earlier ones of it still valid (renewed, not
/// revoked: a renewal does not revoke the certificate it replaces, which may be in use
/// until the new one is installed).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Issued {
    /// SHA-256 of what was certified (kind, key, principals, validity): a request that
    /// hashes otherwise needs a new certificate.
    pub request: String,
    pub serial: u64,
    pub valid_after: u64,
    pub valid_before: u64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub older: Vec<Live>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Live {
    pub serial: u64,
    pub valid_before: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Revoked {
    pub serial: u64,
    /// Once past, the certificate is expired anyway and leaves the KRL.
    pub valid_before: u64,
    /// The issuing CA's public key line (a KRL names certificates by CA and serial).
    pub ca: String,
}

impl Issued {
    /// When the certificate should be issued again: once less than `fraction` of its
    /// validity is left.
    pub fn renew_at(&self, fraction: f64) -> u64 {
        let span = self.valid_before.saturating_sub(self.valid_after);
        let keep = (span as f64 * fraction) as u64;
        self.valid_before.saturating_sub(keep)
    }

    /// Every certificate of the entry that is still valid at `now`.
    pub fn live(&self, now: u64) -> impl Iterator<Item = Live> + '_ {
        std::iter::once(Live {
            serial: self.serial,
            valid_before: self.valid_before,
        })
        .chain(self.older.iter().copied())
        .filter(move |l| l.valid_before > now)
    }
}

impl State {
    /// Revokes every live certificate of `entry` (signed by the CA `ca_line`); true when
    /// the KRL changes.
    pub fn revoke_entry(&mut self, issued: &Issued, ca_line: &str, now: u64) -> bool {
        let before = self.revoked.len();
        let live: Vec<Live> = issued.live(now).collect();
        for l in live {
            self.revoked.push(Revoked {
                serial: l.serial,
                valid_before: l.valid_before,
                ca: ca_line.to_owned(),
            });
        }
        self.revoked.len() != before
    }

    /// Forgets what expired by `now`: revoked certificates leave the KRL, renewed ones
    /// their entry. True when the KRL changes.
    pub fn prune(&mut self, now: u64) -> bool {
        for issued in self.entries.values_mut() {
            issued.older.retain(|l| l.valid_before > now);
        }
        let before = self.revoked.len();
        self.revoked.retain(|r| r.valid_before > now);
        self.revoked.len() != before
    }

    /// Takes the next serial; an exhausted counter fails the run (never wraps to reuse).
    pub fn take_serial(&mut self, first: u64) -> anyhow::Result<u64> {
        let serial = self.next_serial.max(first);
        self.next_serial = serial
            .checked_add(1)
            .ok_or_else(|| anyhow::anyhow!("serial numbers are exhausted"))?;
        Ok(serial)
    }

    /// The KRL of every revoked certificate not yet expired. `comment` names the CA.
    pub fn krl(&self, comment: &str) -> anyhow::Result<Krl> {
        let mut serials: BTreeMap<Vec<u8>, Vec<u64>> = BTreeMap::new();
        let mut blobs: BTreeMap<&str, Vec<u8>> = BTreeMap::new();
        for r in &self.revoked {
            if !blobs.contains_key(r.ca.as_str()) {
                let key = ssh_key::PublicKey::from_openssh(&r.ca).map_err(|e| {
                    anyhow::anyhow!("a revoked serial's CA key does not parse: {e}")
                })?;
                blobs.insert(&r.ca, key.to_bytes()?);
            }
            serials
                .entry(blobs[r.ca.as_str()].clone())
                .or_default()
                .push(r.serial);
        }
        Ok(Krl {
            version: self.krl_version,
            generated: self.krl_generated,
            comment: comment.to_owned(),
            serials,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serials_revocation_and_expiry() {
        let mut s = State::default();
        assert_eq!(s.take_serial(5).unwrap(), 5);
        assert_eq!(s.take_serial(5).unwrap(), 6);
        let issued = Issued {
            request: String::new(),
            serial: 6,
            valid_after: 0,
            valid_before: 100,
            older: vec![
                Live {
                    serial: 5,
                    valid_before: 50,
                },
                Live {
                    serial: 4,
                    valid_before: 10,
                },
            ],
        };
        assert_eq!(issued.renew_at(0.25), 75);
        assert!(s.revoke_entry(&issued, "ca", 20));
        let serials: Vec<u64> = s.revoked.iter().map(|r| r.serial).collect();
        assert_eq!(serials, [6, 5]);
        assert!(!s.prune(40));
        assert!(s.prune(60));
        assert_eq!(s.revoked.len(), 1);
        s.next_serial = u64::MAX;
        assert!(s.take_serial(1).is_err());
    }
}
