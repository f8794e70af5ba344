//! Storage sizes as borg writes them (`10G`, `1.5T`: powers of 1000), or a number of
//! bytes.

use std::fmt;

use serde::{Deserialize, Deserializer};

/// A number of bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Size(pub u64);

const UNITS: [(char, u64); 5] = [
    ('K', 1_000),
    ('M', 1_000_000),
    ('G', 1_000_000_000),
    ('T', 1_000_000_000_000),
    ('P', 1_000_000_000_000_000),
];

impl Size {
    /// The least quota `borg serve --storage-quota` takes: 10M.
    pub const MIN_QUOTA: u64 = 10_000_000;

    /// `123`, `10G`, `1.5T` (at most three decimals); `Err` says why not.
    pub fn parse(text: &str) -> Result<Size, String> {
        let bad = || format!("{:?} is not a size such as 10G or 1.5T", shorten(text));
        let text = text.trim();
        let (number, unit) = match text.chars().last() {
            Some(c) if c.is_ascii_alphabetic() => {
                let u = UNITS
                    .iter()
                    .find(|(s, _)| *s == c.to_ascii_uppercase())
                    .ok_or_else(bad)?
                    .1;
                (&text[..text.len() - 1], u)
            }
            _ => (text, 1),
        };
        let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
        let digits =
            |s: &str| !s.is_empty() && s.len() <= 20 && s.bytes().all(|b| b.is_ascii_digit());
        let fraction_ok =
            fraction.is_empty() || (unit > 1 && digits(fraction) && fraction.len() <= 3);
        if !digits(whole) || !fraction_ok {
            return Err(bad());
        }
        let whole: u64 = whole.parse().map_err(|_| bad())?;
        let mut bytes = whole.checked_mul(unit).ok_or_else(bad)?;
        if !fraction.is_empty() {
            let scale = 10u64.pow(fraction.len() as u32);
            let f: u64 = fraction.parse().map_err(|_| bad())?;
            bytes = bytes
                .checked_add(f.checked_mul(unit).ok_or_else(bad)? / scale)
                .ok_or_else(bad)?;
        }
        Ok(Size(bytes))
    }
}

fn shorten(text: &str) -> String {
    text.chars().take(32).collect()
}

impl fmt::Display for Size {
    /// The largest unit it is a whole number of (`100G`), else bytes.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (suffix, unit) in UNITS.iter().rev() {
            if self.0 >= *unit && self.0.is_multiple_of(*unit) {
                return write!(f, "{}{suffix}", self.0 / unit);
            }
        }
        write!(f, "{}", self.0)
    }
}

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Size, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Bytes(u64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Bytes(b) => Ok(Size(b)),
            Raw::Text(t) => Size::parse(&t).map_err(serde::de::Error::custom),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        for (text, bytes) in [
            ("123", 123),
            ("10M", 10_000_000),
            ("10m", 10_000_000),
            ("1.5T", 1_500_000_000_000),
            ("0.001K", 1),
            ("100G", 100_000_000_000),
        ] {
            assert_eq!(Size::parse(text), Ok(Size(bytes)), "{text}");
        }
        for bad in [
            "",
            "G",
            "1.5",
            "-1G",
            "1e9",
            "1.2345G",
            "99999999999999999999P",
            "10X",
            "1 0G",
        ] {
            assert!(Size::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(Size(100_000_000_000).to_string(), "100G");
        assert_eq!(Size(1_500_000_000_000).to_string(), "1500G");
        assert_eq!(Size(1234).to_string(), "1234");
        let s: Size = serde_json::from_str("\"2T\"").unwrap();
        assert_eq!(s, Size(2_000_000_000_000));
        let s: Size = serde_json::from_str("5000000000").unwrap();
        assert_eq!(s, Size(5_000_000_000));
    }
}
