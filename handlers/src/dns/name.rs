//! DNS names as fort takes them from requests and configs: ASCII letters, digits, `-` and
//! `_` (for `_acme-challenge` and other service labels), an optional leading `*` label,
//! lower-cased and without the trailing dot. Anything else (spaces, quotes, escapes,
//! non-ASCII, empty labels) is refused before it can reach a message to the primary.

use std::fmt;

use hickory_client::proto::rr::Name;

/// The longest name in presentation form without the trailing dot (RFC 1035: 255 octets
/// on the wire).
const NAME_MAX: usize = 253;
const LABEL_MAX: usize = 63;

/// A checked, lower-case DNS name without the trailing dot.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DnsName(String);

impl DnsName {
    /// Parses `text` (one trailing dot allowed), or says what is wrong with it.
    pub fn parse(text: &str) -> Result<DnsName, String> {
        let bare = text.strip_suffix('.').unwrap_or(text);
        if bare.is_empty() {
            return Err("a DNS name may not be empty".into());
        }
        if bare.len() > NAME_MAX {
            return Err(format!("a DNS name has at most {NAME_MAX} characters"));
        }
        for (i, label) in bare.split('.').enumerate() {
            if label.is_empty() {
                return Err(format!("{:?} has an empty label", short(text)));
            }
            if label.len() > LABEL_MAX {
                return Err(format!(
                    "{:?} has a label longer than {LABEL_MAX} characters",
                    short(text)
                ));
            }
            if label == "*" && i == 0 {
                continue;
            }
            if !label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            {
                return Err(format!(
                    "{:?} is not a DNS name (letters, digits, '-' and '_' only; '*' only as the first label)",
                    short(text)
                ));
            }
        }
        Ok(DnsName(bare.to_ascii_lowercase()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether the first label is `*`.
    pub fn is_wildcard(&self) -> bool {
        self.0 == "*" || self.0.starts_with("*.")
    }

    /// Whether this name is `zone` or below it.
    pub fn is_in(&self, zone: &DnsName) -> bool {
        self.0 == zone.0
            || self
                .0
                .strip_suffix(zone.0.as_str())
                .is_some_and(|head| head.ends_with('.'))
    }

    /// The name as hickory encodes it: fully qualified.
    pub fn to_name(&self) -> Name {
        // Checked above: only LDH, '_' and a leading '*', which hickory always accepts.
        let mut name = Name::from_ascii(&self.0).expect("a checked name parses");
        name.set_fqdn(true);
        name
    }

    /// From a name in an answer of the primary (anything the wire allows); `None` when it
    /// is outside the grammar above, which no record of ours ever is.
    pub fn from_name(name: &Name) -> Option<DnsName> {
        DnsName::parse(&name.to_ascii()).ok()
    }
}

impl fmt::Display for DnsName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A hostile value is quoted back in a reason only so far.
fn short(text: &str) -> String {
    let mut out: String = text.chars().take(80).collect();
    if text.chars().count() > 80 {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grammar() {
        let n = DnsName::parse("App.Example.ORG.").unwrap();
        assert_eq!(n.as_str(), "app.example.org");
        assert_eq!(n.to_name().to_ascii(), "app.example.org.");
        assert!(DnsName::parse("_acme-challenge.app.example.org").is_ok());
        assert!(DnsName::parse("*.app.example.org").unwrap().is_wildcard());
        for bad in [
            "",
            ".",
            "a..b",
            ".a",
            "a b.org",
            "a\"b.org",
            "a\\.b.org",
            "a;b.org",
            "a.*.org",
            "ä.org",
            "a\n.org",
            "a.org..",
            "@.org",
        ] {
            assert!(DnsName::parse(bad).is_err(), "{bad:?}");
        }
        assert!(DnsName::parse(&"a".repeat(64)).is_err());
        assert!(DnsName::parse(&vec!["a".repeat(63); 4].join(".")).is_err());
        assert!(DnsName::parse(
            &[
                "a".repeat(63),
                "b".repeat(63),
                "c".repeat(63),
                "d".repeat(61)
            ]
            .join(".")
        )
        .is_ok());
    }

    #[test]
    fn zones() {
        let zone = DnsName::parse("example.org").unwrap();
        assert!(DnsName::parse("example.org").unwrap().is_in(&zone));
        assert!(DnsName::parse("a.b.example.org").unwrap().is_in(&zone));
        assert!(!DnsName::parse("badexample.org").unwrap().is_in(&zone));
        assert!(!DnsName::parse("org").unwrap().is_in(&zone));
    }
}
