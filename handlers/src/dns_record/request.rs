//! What a consumer asks of `dns-record` (the same shape as the NixOS interface
//! `nixos-module/interfaces/dns-record.nix`), and the record set it resolves to for one
//! caller: its name checked against the zone and the caller's allowance, its values
//! defaulted to the caller's own address, every value checked before anything is sent.

use std::collections::BTreeSet;
use std::net::IpAddr;

use serde::Deserialize;
use serde_json::Value;

use crate::common::Allowances;
use crate::dns::record::{SET_WIRE_MAX, VALUES_MAX};
use crate::dns::{DnsName, Kind, RecordSet};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Request {
    /// The record's owner name, in the provider's zone.
    pub name: String,
    /// `A`, `AAAA`, `CNAME` or `TXT`; null: A or AAAA, as the caller's address is.
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
    /// The values; null or empty: the caller's own address (A and AAAA only).
    #[serde(default)]
    pub values: Option<Vec<String>>,
    /// Seconds; null: the provider's default.
    #[serde(default)]
    pub ttl: Option<u32>,
}

/// What a request resolves against: the zone, the caller's allowance and address, TTLs.
pub struct Policy<'a> {
    pub zone: &'a DnsName,
    pub allow: &'a Allowances,
    pub default_ttl: u32,
    pub max_ttl: u32,
}

impl Policy<'_> {
    /// The record set `origin` asks for, or the one-line reason it is refused.
    /// `address` is the caller's address from hosts.json, if it has one.
    pub fn resolve(
        &self,
        origin: &str,
        address: Option<IpAddr>,
        request: &Value,
    ) -> Result<RecordSet, String> {
        let request = Request::deserialize(request).map_err(|e| format!("the request: {e}"))?;
        let name = DnsName::parse(&request.name)?;
        if !name.is_in(self.zone) {
            return Err(format!("{name} is not in the zone {}", self.zone));
        }
        if !self.allow.permits(origin, name.as_str()) {
            return Err(format!(
                "{origin} may not hold records at {name} ({})",
                self.allow.describe(origin)
            ));
        }
        let kind = match request.kind.as_deref() {
            Some(text) => Kind::parse(text)
                .ok_or_else(|| format!("type {:?} is not A, AAAA, CNAME or TXT", clip(text)))?,
            None => match address {
                Some(IpAddr::V4(_)) => Kind::A,
                Some(IpAddr::V6(_)) => Kind::Aaaa,
                None => {
                    return Err(format!(
                        "no type given, and hosts.json gives {origin} no IP address"
                    ))
                }
            },
        };
        let given = request.values.unwrap_or_default();
        if given.len() > VALUES_MAX {
            return Err(format!("at most {VALUES_MAX} values"));
        }
        let values: BTreeSet<String> = if given.is_empty() {
            let own = match (kind, address) {
                (Kind::A, Some(ip @ IpAddr::V4(_))) | (Kind::Aaaa, Some(ip @ IpAddr::V6(_))) => ip,
                (Kind::A | Kind::Aaaa, _) => {
                    return Err(format!(
                        "no values given, and hosts.json gives {origin} no {} address",
                        if kind == Kind::A { "IPv4" } else { "IPv6" }
                    ))
                }
                _ => return Err(format!("a {kind} record needs values")),
            };
            BTreeSet::from([kind.canonical(&own.to_string())?])
        } else {
            given
                .iter()
                .map(|v| kind.canonical(v))
                .collect::<Result<_, _>>()?
        };
        if kind == Kind::Cname {
            if values.len() != 1 {
                return Err("a CNAME record has exactly one value".into());
            }
            if name == *self.zone {
                return Err(format!("a CNAME cannot sit at the zone apex {name}"));
            }
        }
        let wire: usize = values.iter().map(|v| kind.wire_len(v)).sum();
        if wire > SET_WIRE_MAX {
            return Err(format!(
                "the values take {wire} bytes of record data; a record set holds at most \
                 {SET_WIRE_MAX}, so that a change of it always fits in one DNS message"
            ));
        }
        let ttl = request.ttl.unwrap_or(self.default_ttl);
        if !(1..=self.max_ttl).contains(&ttl) {
            return Err(format!("ttl {ttl} is not 1 to {}", self.max_ttl));
        }
        Ok(RecordSet {
            name,
            kind,
            ttl,
            values,
        })
    }
}

impl Policy<'_> {
    /// Whether `origin` may still hold `set`, records made for it before: in the zone, at
    /// a name its allowance has, within today's bounds.
    pub fn still_allows(&self, origin: &str, set: &RecordSet) -> bool {
        set.name.is_in(self.zone)
            && self.allow.permits(origin, set.name.as_str())
            && (1..=self.max_ttl).contains(&set.ttl)
            && set.values.len() <= VALUES_MAX
            && set.wire_len() <= SET_WIRE_MAX
    }
}

fn clip(text: &str) -> String {
    text.chars().take(40).collect()
}

/// The response an entry gets for the record set it holds.
pub fn response(set: &RecordSet) -> Value {
    serde_json::json!({
        "name": set.name.as_str(),
        "type": set.kind.as_str(),
        "values": set.values,
        "ttl": set.ttl,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn policy_test(f: impl FnOnce(&Policy)) {
        let zone = DnsName::parse("example.org").unwrap();
        let allow: Allowances = serde_json::from_value(json!({
            "app": ["app.example.org", "*.app.example.org", "example.org"],
            "*": ["{origin}.h.example.org"]
        }))
        .unwrap();
        f(&Policy {
            zone: &zone,
            allow: &allow,
            default_ttl: 300,
            max_ttl: 3600,
        });
    }

    #[test]
    fn defaults_to_the_callers_address() {
        policy_test(|p| {
            let v4 = Some("10.0.0.2".parse().unwrap());
            let set = p
                .resolve("app", v4, &json!({"name": "App.example.org"}))
                .unwrap();
            assert_eq!((set.kind, set.ttl), (Kind::A, 300));
            assert_eq!(set.values, BTreeSet::from(["10.0.0.2".to_owned()]));
            let v6 = Some("fd00::2".parse().unwrap());
            let set = p
                .resolve(
                    "app",
                    v6,
                    &json!({"name": "app.example.org", "type": null, "values": [], "ttl": 60}),
                )
                .unwrap();
            assert_eq!((set.kind, set.ttl), (Kind::Aaaa, 60));
            assert!(p
                .resolve("app", v6, &json!({"name": "app.example.org", "type": "A"}))
                .unwrap_err()
                .contains("no IPv4 address"));
            assert!(p
                .resolve("app", None, &json!({"name": "app.example.org"}))
                .is_err());
        });
    }

    #[test]
    fn refusals_name_the_problem() {
        policy_test(|p| {
            let ip = Some("10.0.0.2".parse().unwrap());
            let cases = [
                (
                    json!({"name": "web.example.org"}),
                    "app may not hold records at web.example.org",
                ),
                (json!({"name": "app.example.com"}), "not in the zone"),
                (
                    json!({"name": "app.example.org\"; drop"}),
                    "is not a DNS name",
                ),
                (
                    json!({"name": "x.app.example.org", "type": "MX"}),
                    "is not A, AAAA, CNAME or TXT",
                ),
                (
                    json!({"name": "x.app.example.org", "type": "TXT"}),
                    "needs values",
                ),
                (
                    json!({"name": "x.app.example.org", "type": "TXT", "values": ["a\nb"]}),
                    "printable",
                ),
                (
                    json!({"name": "x.app.example.org", "type": "CNAME", "values": ["a.org", "b.org"]}),
                    "exactly one",
                ),
                (
                    json!({"name": "example.org", "type": "CNAME", "values": ["a.org"]}),
                    "apex",
                ),
                (
                    json!({"name": "x.app.example.org", "ttl": 7200}),
                    "ttl 7200",
                ),
                (
                    json!({"name": "x.app.example.org", "values": ["::1"]}),
                    "not an IPv4 address",
                ),
                (
                    json!({"name": "x.app.example.org", "extra": 1}),
                    "unknown field",
                ),
                (
                    json!({"name": "x.app.example.org", "values": vec!["10.0.0.1"; 17]}),
                    "at most 16",
                ),
                (
                    json!({"name": "x.app.example.org", "type": "TXT",
                           "values": (0..9).map(|i| format!("{i}{}", "k".repeat(2000))).collect::<Vec<_>>()}),
                    "at most 16384",
                ),
            ];
            for (request, says) in cases {
                let e = p.resolve("app", ip, &request).unwrap_err();
                assert!(e.contains(says), "{request}: {e}");
            }
            assert!(p
                .resolve("web", ip, &json!({"name": "web.h.example.org"}))
                .is_ok());
        });
    }
}
