//! Record sets as fort writes them: a name, one of the types fort manages (A, AAAA, CNAME,
//! TXT), a TTL and a set of values in one canonical text form, so that what a request asks
//! for, what the state file holds and what the primary answers compare as strings.

use std::collections::BTreeSet;
use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr};

use hickory_client::proto::rr::rdata::{A, AAAA, CNAME, TXT};
use hickory_client::proto::rr::{RData, Record, RecordType};
use serde::{Deserialize, Serialize};

use super::name::DnsName;

/// Longest TXT value: a DKIM key of 4096 bits fits, a zone full of them does not.
pub const TXT_MAX: usize = 2048;
/// Most values in one record set.
pub const VALUES_MAX: usize = 16;
/// The most record data one set may hold on the wire. A change deletes the old set and
/// adds the new one in one update message, which must stay under a DNS message's 65,535
/// bytes with its names, prerequisites and signature: two sets of this size always fit,
/// so no set a caller may hold can make its own change, or anyone else's, unsendable.
pub const SET_WIRE_MAX: usize = 16 * 1024;
/// One TXT character-string on the wire.
const TXT_CHUNK: usize = 255;

/// The record types fort manages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Kind {
    A,
    #[serde(rename = "AAAA")]
    Aaaa,
    #[serde(rename = "CNAME")]
    Cname,
    #[serde(rename = "TXT")]
    Txt,
}

impl Kind {
    pub fn parse(text: &str) -> Option<Kind> {
        match text {
            "A" => Some(Kind::A),
            "AAAA" => Some(Kind::Aaaa),
            "CNAME" => Some(Kind::Cname),
            "TXT" => Some(Kind::Txt),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::A => "A",
            Kind::Aaaa => "AAAA",
            Kind::Cname => "CNAME",
            Kind::Txt => "TXT",
        }
    }

    pub fn record_type(self) -> RecordType {
        match self {
            Kind::A => RecordType::A,
            Kind::Aaaa => RecordType::AAAA,
            Kind::Cname => RecordType::CNAME,
            Kind::Txt => RecordType::TXT,
        }
    }

    /// Parses one value of this type into its canonical text, or says why it is refused.
    pub fn canonical(self, value: &str) -> Result<String, String> {
        match self {
            Kind::A => {
                let ip: Ipv4Addr = value
                    .parse()
                    .map_err(|_| format!("{:?} is not an IPv4 address", clip(value)))?;
                if ip.is_unspecified() || ip.is_broadcast() || ip.is_multicast() {
                    return Err(format!("{ip} is not an address a host can have"));
                }
                Ok(ip.to_string())
            }
            Kind::Aaaa => {
                let ip: Ipv6Addr = value
                    .parse()
                    .map_err(|_| format!("{:?} is not an IPv6 address", clip(value)))?;
                if ip.is_unspecified() || ip.is_multicast() {
                    return Err(format!("{ip} is not an address a host can have"));
                }
                Ok(ip.to_string())
            }
            Kind::Cname => {
                let target = DnsName::parse(value)?;
                if target.is_wildcard() {
                    return Err(format!("a CNAME cannot point at {target}"));
                }
                Ok(target.as_str().to_owned())
            }
            Kind::Txt => {
                if value.len() > TXT_MAX {
                    return Err(format!("a TXT value has at most {TXT_MAX} characters"));
                }
                if !value.bytes().all(|b| (0x20..0x7f).contains(&b)) {
                    return Err("a TXT value is printable ASCII only".into());
                }
                Ok(value.to_owned())
            }
        }
    }

    /// The bytes a canonical value's record data takes on the wire.
    pub fn wire_len(self, value: &str) -> usize {
        match self {
            Kind::A => 4,
            Kind::Aaaa => 16,
            // Length-prefixed labels and the root: at most 255.
            Kind::Cname => value.len() + 2,
            // A length byte per character-string of at most 255.
            Kind::Txt => value.len() + value.len().div_ceil(TXT_CHUNK).max(1),
        }
    }

    /// The record data of a canonical value (`canonical` made it, so it parses).
    fn rdata(self, value: &str) -> RData {
        match self {
            Kind::A => RData::A(A(value.parse().expect("canonical IPv4"))),
            Kind::Aaaa => RData::AAAA(AAAA(value.parse().expect("canonical IPv6"))),
            Kind::Cname => RData::CNAME(CNAME(
                DnsName::parse(value).expect("canonical name").to_name(),
            )),
            // An empty value is one empty character-string, never none at all.
            Kind::Txt if value.is_empty() => RData::TXT(TXT::from_bytes(vec![b""])),
            Kind::Txt => RData::TXT(TXT::from_bytes(
                value.as_bytes().chunks(TXT_CHUNK).collect(),
            )),
        }
    }

    /// The canonical text of a record in an answer, when it is of this type.
    pub fn value_of(self, rdata: &RData) -> Option<String> {
        match (self, rdata) {
            (Kind::A, RData::A(a)) => Some(a.0.to_string()),
            (Kind::Aaaa, RData::AAAA(a)) => Some(a.0.to_string()),
            (Kind::Cname, RData::CNAME(c)) => {
                let text = c.0.to_ascii();
                Some(text.strip_suffix('.').unwrap_or(&text).to_ascii_lowercase())
            }
            (Kind::Txt, RData::TXT(t)) => Some(
                t.txt_data()
                    .iter()
                    .map(|s| String::from_utf8_lossy(s))
                    .collect(),
            ),
            _ => None,
        }
    }

    /// Whether one holder excludes every other at its name (a CNAME) or at its name and
    /// type (an address); TXT values are shared.
    pub fn exclusive(self) -> bool {
        !matches!(self, Kind::Txt)
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A record set: every value at one name and type, with one TTL.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordSet {
    pub name: DnsName,
    #[serde(rename = "type")]
    pub kind: Kind,
    pub ttl: u32,
    pub values: BTreeSet<String>,
}

impl RecordSet {
    /// The records to add (class IN) for `values`.
    pub fn records<'a>(
        name: &DnsName,
        kind: Kind,
        ttl: u32,
        values: impl IntoIterator<Item = &'a String>,
    ) -> Vec<Record> {
        let owner = name.to_name();
        values
            .into_iter()
            .map(|v| Record::from_rdata(owner.clone(), ttl, kind.rdata(v)))
            .collect()
    }

    /// The record data of every value, in bytes on the wire.
    pub fn wire_len(&self) -> usize {
        self.values.iter().map(|v| self.kind.wire_len(v)).sum()
    }

    /// Same name and type.
    pub fn same_slot(&self, other: &RecordSet) -> bool {
        self.name == other.name && self.kind == other.kind
    }
}

impl Serialize for DnsName {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for DnsName {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        DnsName::parse(&text).map_err(serde::de::Error::custom)
    }
}

fn clip(value: &str) -> String {
    value.chars().take(80).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_values() {
        assert_eq!(Kind::A.canonical("10.0.0.2").unwrap(), "10.0.0.2");
        assert!(Kind::A.canonical("010.0.0.2").is_err());
        assert!(Kind::A.canonical("0.0.0.0").is_err());
        assert!(Kind::A.canonical("10.0.0.2\n").is_err());
        assert_eq!(Kind::Aaaa.canonical("FD00:0::2").unwrap(), "fd00::2");
        assert!(Kind::Aaaa.canonical("10.0.0.2").is_err());
        assert_eq!(
            Kind::Cname.canonical("Edge.Example.org.").unwrap(),
            "edge.example.org"
        );
        assert!(Kind::Cname.canonical("*.example.org").is_err());
        assert!(Kind::Txt.canonical("v=spf1 -all").is_ok());
        assert!(Kind::Txt.canonical("a\"; evil\n").is_err());
        assert!(Kind::Txt.canonical(&"x".repeat(TXT_MAX + 1)).is_err());
    }

    #[test]
    fn values_round_trip_through_record_data() {
        let long = "k".repeat(600);
        for (kind, value) in [
            (Kind::A, "192.0.2.7"),
            (Kind::Aaaa, "2001:db8::7"),
            (Kind::Cname, "edge.example.org"),
            (Kind::Txt, long.as_str()),
            (Kind::Txt, "quote \" and backslash \\ stay text"),
        ] {
            let rdata = kind.rdata(value);
            assert_eq!(kind.value_of(&rdata).as_deref(), Some(value));
        }
        if let RData::TXT(t) = Kind::Txt.rdata(&long) {
            assert_eq!(t.txt_data().len(), 3);
        }
        // What a value takes on the wire, as hickory encodes it.
        use hickory_client::proto::serialize::binary::BinEncodable;
        for (kind, value) in [
            (Kind::A, "192.0.2.7"),
            (Kind::Aaaa, "2001:db8::7"),
            (Kind::Cname, "edge.example.org"),
            (Kind::Txt, long.as_str()),
            (Kind::Txt, ""),
            (Kind::Txt, "x"),
        ] {
            let bytes = kind.rdata(value).to_bytes().unwrap();
            assert_eq!(kind.wire_len(value), bytes.len(), "{kind} {value:?}");
        }
    }
}
