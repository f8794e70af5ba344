//! OpenSSH key revocation lists (OpenSSH's PROTOCOL.krl), the binary file `sshd` reads
//! through `RevokedKeys` and `ssh` through `RevokedHostKeys`: written from the serials
//! this CA revoked, and checked (structure only) before a consumer installs one. No crate
//! writes this format; it is small and fully specified, so it lives here.
//!
//! Layout (all integers big-endian, `string` = uint32 length + bytes):
//!
//! ```text
//! uint64 KRL_MAGIC (0x5353484b524c0a00, "SSHKRL\n\0")   uint32 KRL_FORMAT_VERSION (1)
//! uint64 krl_version   uint64 generated_date   uint64 flags   string reserved   string comment
//! then sections: byte section_type, string section_data
//!   KRL_SECTION_CERTIFICATES (1): string ca_key, string reserved,
//!     then sub-sections: byte type, string data
//!       KRL_SECTION_CERT_SERIAL_LIST (0x20): uint64 serial ...
//!       KRL_SECTION_CERT_SERIAL_RANGE (0x21): uint64 serial_min, uint64 serial_max
//! ```

use std::collections::BTreeMap;

const MAGIC: &[u8; 8] = b"SSHKRL\n\0";
const FORMAT_VERSION: u32 = 1;
const SECTION_CERTIFICATES: u8 = 1;
const SECTION_SIGNATURE: u8 = 4;
const CERT_SERIAL_LIST: u8 = 0x20;
const CERT_SERIAL_RANGE: u8 = 0x21;
const CERT_SERIAL_BITMAP: u8 = 0x22;
const CERT_KEY_ID: u8 = 0x23;

/// Runs of at least this many consecutive serials are written as one range (16 bytes)
/// instead of a list (8 bytes each).
const RANGE_MIN: usize = 3;

/// A KRL's contents, as this CA writes it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Krl {
    /// Increases with every change (`krl_version`).
    pub version: u64,
    /// Unix seconds of the last change (`generated_date`).
    pub generated: u64,
    pub comment: String,
    /// Revoked serials per CA: the CA's public key blob (SSH wire encoding) → serials.
    /// Serial 0 cannot be revoked by serial (OpenSSH refuses it) and is left out.
    pub serials: BTreeMap<Vec<u8>, Vec<u64>>,
}

impl Krl {
    /// The binary KRL. The same contents always give the same bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&FORMAT_VERSION.to_be_bytes());
        out.extend_from_slice(&self.version.to_be_bytes());
        out.extend_from_slice(&self.generated.to_be_bytes());
        out.extend_from_slice(&0u64.to_be_bytes()); // flags: none are defined
        put_string(&mut out, b""); // reserved
        put_string(&mut out, self.comment.as_bytes());
        for (ca, serials) in &self.serials {
            let mut serials: Vec<u64> = serials.iter().copied().filter(|s| *s != 0).collect();
            serials.sort_unstable();
            serials.dedup();
            if serials.is_empty() {
                continue;
            }
            let mut section = Vec::new();
            put_string(&mut section, ca);
            put_string(&mut section, b""); // reserved
            let mut singles = Vec::new();
            for run in runs(&serials) {
                if run.len() >= RANGE_MIN {
                    let mut range = Vec::with_capacity(16);
                    range.extend_from_slice(&run[0].to_be_bytes());
                    range.extend_from_slice(&run[run.len() - 1].to_be_bytes());
                    section.push(CERT_SERIAL_RANGE);
                    put_string(&mut section, &range);
                } else {
                    singles.extend(run.iter().flat_map(|s| s.to_be_bytes()));
                }
            }
            if !singles.is_empty() {
                section.push(CERT_SERIAL_LIST);
                put_string(&mut section, &singles);
            }
            out.push(SECTION_CERTIFICATES);
            put_string(&mut out, &section);
        }
        out
    }
}

/// Consecutive runs of a sorted, duplicate-free list.
fn runs(sorted: &[u64]) -> impl Iterator<Item = &[u64]> {
    let mut rest = sorted;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let mut n = 1;
        while n < rest.len() && rest[n - 1].checked_add(1) == Some(rest[n]) {
            n += 1;
        }
        let (run, tail) = rest.split_at(n);
        rest = tail;
        Some(run)
    })
}

fn put_string(out: &mut Vec<u8>, bytes: &[u8]) {
    let len = u32::try_from(bytes.len()).expect("KRL parts are far below 4 GiB");
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(bytes);
}

/// What a structurally sound KRL holds, for logs and tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Summary {
    pub version: u64,
    pub generated: u64,
    /// Serials revoked by list or range, per CA key blob (ranges expanded up to a bound).
    pub serials: BTreeMap<Vec<u8>, Vec<u64>>,
    /// Serials covered by ranges (which are not expanded past `RANGE_EXPAND`).
    pub revoked_count: u64,
}

/// Ranges are counted, but expanded into `Summary::serials` only when this small.
const RANGE_EXPAND: u64 = 4096;

/// Why bytes are not a KRL.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KrlError {
    #[error("not an OpenSSH KRL (bad magic)")]
    Magic,
    #[error("KRL format version {0}, expected 1")]
    FormatVersion(u32),
    #[error("KRL truncated at byte {0}")]
    Truncated(usize),
    #[error("KRL section {0:#04x} is not one this reader knows")]
    UnknownSection(u8),
    #[error("KRL serial range {0}..{1} is empty or starts at 0")]
    BadRange(u64, u64),
    #[error("KRL serial list has a length that is not a multiple of 8")]
    BadList,
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    base: usize,
}

impl<'a> Reader<'a> {
    fn new(bytes: &'a [u8], base: usize) -> Reader<'a> {
        Reader { bytes, at: 0, base }
    }
    fn done(&self) -> bool {
        self.at >= self.bytes.len()
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], KrlError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|e| *e <= self.bytes.len())
            .ok_or(KrlError::Truncated(self.base + self.at))?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }
    fn u8(&mut self) -> Result<u8, KrlError> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, KrlError> {
        Ok(u32::from_be_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self) -> Result<u64, KrlError> {
        Ok(u64::from_be_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    fn string(&mut self) -> Result<(usize, &'a [u8]), KrlError> {
        let len = self.u32()? as usize;
        let start = self.base + self.at;
        Ok((start, self.take(len)?))
    }
}

/// Checks that `bytes` is a KRL as OpenSSH reads it (header, certificate sections with
/// serial lists, ranges, bitmaps and key ids; other sections skipped as OpenSSH does) and
/// says what it revokes. Nothing in it can make this panic or allocate past its size.
pub fn parse(bytes: &[u8]) -> Result<Summary, KrlError> {
    let mut r = Reader::new(bytes, 0);
    if r.take(8).map_err(|_| KrlError::Magic)? != MAGIC {
        return Err(KrlError::Magic);
    }
    let format = r.u32()?;
    if format != FORMAT_VERSION {
        return Err(KrlError::FormatVersion(format));
    }
    let version = r.u64()?;
    let generated = r.u64()?;
    let _flags = r.u64()?;
    r.string()?; // reserved
    r.string()?; // comment
    let mut summary = Summary {
        version,
        generated,
        serials: BTreeMap::new(),
        revoked_count: 0,
    };
    while !r.done() {
        let kind = r.u8()?;
        if kind == SECTION_SIGNATURE {
            // Signatures end the signed part; what follows is only more signatures.
            break;
        }
        let (start, data) = r.string()?;
        if kind != SECTION_CERTIFICATES {
            continue; // explicit keys and fingerprints: not ours, skipped as OpenSSH may
        }
        let mut s = Reader::new(data, start);
        let (_, ca) = s.string()?;
        s.string()?; // reserved
        let serials = summary.serials.entry(ca.to_vec()).or_default();
        while !s.done() {
            let sub = s.u8()?;
            let (sub_start, body) = s.string()?;
            let mut b = Reader::new(body, sub_start);
            match sub {
                CERT_SERIAL_LIST => {
                    if body.len() % 8 != 0 {
                        return Err(KrlError::BadList);
                    }
                    while !b.done() {
                        serials.push(b.u64()?);
                        summary.revoked_count = summary.revoked_count.saturating_add(1);
                    }
                }
                CERT_SERIAL_RANGE => {
                    let (lo, hi) = (b.u64()?, b.u64()?);
                    if lo == 0 || lo > hi {
                        return Err(KrlError::BadRange(lo, hi));
                    }
                    let n = hi - lo + 1;
                    summary.revoked_count = summary.revoked_count.saturating_add(n);
                    if n <= RANGE_EXPAND {
                        serials.extend(lo..=hi);
                    }
                }
                CERT_SERIAL_BITMAP | CERT_KEY_ID => {}
                other => return Err(KrlError::UnknownSection(other)),
            }
        }
        serials.sort_unstable();
        serials.dedup();
    }
    Ok(summary)
}

/// One KRL that revokes everything any of `parts` revokes: their sections (one per CA,
/// as each provider's KRL has them), copied as they are after checking each part with
/// [`parse`], behind one header. OpenSSH reads several sections for one CA as their
/// union. The version is the sum of the parts' (so it grows whenever one of theirs does),
/// the date the latest of theirs; signatures are not copied (fort's KRLs have none, and
/// they would not cover the union).
pub fn combine(parts: &[&[u8]], comment: &str) -> Result<Vec<u8>, KrlError> {
    let mut version = 0u64;
    let mut generated = 0u64;
    let mut sections = Vec::new();
    for part in parts {
        let summary = parse(part)?;
        version = version.saturating_add(summary.version);
        generated = generated.max(summary.generated);
        sections.extend_from_slice(section_bytes(part)?);
    }
    let mut out = Krl {
        version,
        generated,
        comment: comment.to_owned(),
        serials: BTreeMap::new(),
    }
    .to_bytes();
    out.extend_from_slice(&sections);
    Ok(out)
}

/// The bytes of a KRL's sections after its header, up to its first signature.
fn section_bytes(bytes: &[u8]) -> Result<&[u8], KrlError> {
    let mut r = Reader::new(bytes, 0);
    r.take(8 + 4 + 8 + 8 + 8)?;
    r.string()?; // reserved
    r.string()?; // comment
    let start = r.at;
    while !r.done() {
        let at = r.at;
        if r.u8()? == SECTION_SIGNATURE {
            return Ok(&bytes[start..at]);
        }
        r.string()?;
    }
    Ok(&bytes[start..])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn krl(serials: &[u64]) -> Krl {
        Krl {
            version: 7,
            generated: 1_700_000_000,
            comment: "test".into(),
            serials: BTreeMap::from([(b"ca-blob".to_vec(), serials.to_vec())]),
        }
    }

    #[test]
    fn header_is_byte_exact() {
        let bytes = Krl::default().to_bytes();
        let mut expected = b"SSHKRL\n\0".to_vec();
        expected.extend_from_slice(&[0, 0, 0, 1]);
        expected.extend_from_slice(&[0; 24]); // version, date, flags
        expected.extend_from_slice(&[0; 8]); // reserved and comment, empty
        assert_eq!(bytes, expected);
    }

    #[test]
    fn runs_become_ranges_and_the_rest_a_list() {
        let k = krl(&[9, 1, 2, 3, 4, 7, 9, 0, u64::MAX]);
        let bytes = k.to_bytes();
        let s = parse(&bytes).unwrap();
        assert_eq!(s.version, 7);
        assert_eq!(
            s.serials[&b"ca-blob".to_vec()],
            vec![1, 2, 3, 4, 7, 9, u64::MAX]
        );
        assert_eq!(s.revoked_count, 7);
        // One range (1..=4) and one list of three: 1 + 4 + 16 and 1 + 4 + 24 bytes.
        let header = 8 + 4 + 24 + 4 + 4 + 4;
        let section = 4 + 7 + 4 + 21 + 29;
        assert_eq!(bytes.len(), header + 1 + 4 + section);
        assert_eq!(k.to_bytes(), bytes, "deterministic");
    }

    #[test]
    fn combined_krls_revoke_what_each_revokes() {
        let of = |ca: &[u8], version, serials: &[u64]| Krl {
            version,
            generated: 1_700_000_000 + version,
            comment: "one CA".into(),
            serials: BTreeMap::from([(ca.to_vec(), serials.to_vec())]),
        };
        let a = of(b"ca-a", 3, &[1, 2, 3, 9]).to_bytes();
        let b = of(b"ca-b", 5, &[4]).to_bytes();
        let empty = Krl::default().to_bytes();
        let both = combine(&[&a, &b, &empty], "union").unwrap();
        let s = parse(&both).unwrap();
        assert_eq!(s.version, 8);
        assert_eq!(s.generated, 1_700_000_005);
        assert_eq!(s.serials[&b"ca-a".to_vec()], vec![1, 2, 3, 9]);
        assert_eq!(s.serials[&b"ca-b".to_vec()], vec![4]);
        assert_eq!(s.revoked_count, 5);
        // Nothing to combine: a KRL that revokes nothing.
        assert_eq!(
            parse(&combine(&[], "none").unwrap()).unwrap().revoked_count,
            0
        );
        // A part that is not a KRL fails the whole, naming why.
        assert_eq!(combine(&[&a, b"junk"], "x"), Err(KrlError::Magic));
        // A signature section ends what is copied.
        let mut signed = a.clone();
        signed.push(SECTION_SIGNATURE);
        put_string(&mut signed, b"sig");
        assert_eq!(section_bytes(&signed).unwrap(), section_bytes(&a).unwrap());
    }

    #[test]
    fn hostile_bytes_are_errors() {
        let good = krl(&[1, 5]).to_bytes();
        assert_eq!(parse(b"SSHKRL"), Err(KrlError::Magic));
        assert_eq!(parse(b"ssh-ed25519 AAAA"), Err(KrlError::Magic));
        let header = 48; // a KRL may end after its header: it revokes nothing
        assert!(parse(&good[..header]).is_ok());
        for cut in (9..good.len()).filter(|c| *c != header) {
            assert!(parse(&good[..cut]).is_err(), "cut at {cut}");
        }
        let mut v2 = good.clone();
        v2[11] = 2;
        assert_eq!(parse(&v2), Err(KrlError::FormatVersion(2)));
        // A string length far past the end.
        let mut long = good.clone();
        let at = 8 + 4 + 24;
        long[at..at + 4].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(matches!(parse(&long), Err(KrlError::Truncated(_))));
        // A huge range is counted, not expanded.
        let mut k = krl(&[]);
        k.serials.clear();
        let mut bytes = k.to_bytes();
        let mut section = Vec::new();
        put_string(&mut section, b"ca");
        put_string(&mut section, b"");
        section.push(CERT_SERIAL_RANGE);
        let mut range = 1u64.to_be_bytes().to_vec();
        range.extend_from_slice(&u64::MAX.to_be_bytes());
        put_string(&mut section, &range);
        bytes.push(SECTION_CERTIFICATES);
        put_string(&mut bytes, &section);
        let s = parse(&bytes).unwrap();
        assert_eq!(s.revoked_count, u64::MAX);
        assert!(s.serials[&b"ca".to_vec()].is_empty());
    }
}
