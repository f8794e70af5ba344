//! The name grammars of docs/protocol.md §1, checked by hand (no regex engine on the hot path).

use std::fmt;

/// `^[a-z0-9][a-z0-9-]{0,62}$`
pub fn is_host_name(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b[1..]
            .iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
}

/// `^[a-z_][a-z0-9_-]{0,31}$`
pub fn is_principal_name(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 32
        && (b[0].is_ascii_lowercase() || b[0] == b'_')
        && b[1..]
            .iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'_' || *c == b'-')
}

/// `^[a-z0-9][a-z0-9_-]{0,63}$`, for capability names, need types and need ids.
pub fn is_capability_name(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 64
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b[1..]
            .iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'_' || *c == b'-')
}

/// `^[A-Za-z0-9@._:\\-]{1,255}$`, not starting with `-` (so it can never be an option),
/// and ending in a known unit suffix when it has a dot.
pub fn is_unit_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 255
        && !s.starts_with('-')
        && !s.starts_with('.')
        && s.bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"@._:-".contains(&c))
}

/// A consumer-side need key, `<type>/<id>`. It keeps its text: state, logs and the wire
/// all use it as such, thousands of times a second on a busy host. Ordered as that text,
/// so lists of needs are sorted as strings (docs/protocol.md §8).
#[derive(Clone, Debug)]
pub struct NeedKey {
    full: String,
    slash: usize,
}

impl NeedKey {
    /// Parses `<type>/<id>`; `None` when either half breaks the grammar.
    pub fn parse(s: &str) -> Option<NeedKey> {
        let (kind, id) = s.split_once('/')?;
        (is_capability_name(kind) && is_capability_name(id)).then(|| NeedKey {
            full: s.to_owned(),
            slash: kind.len(),
        })
    }

    /// The type: the name of the capability that serves it.
    pub fn kind(&self) -> &str {
        &self.full[..self.slash]
    }

    pub fn id(&self) -> &str {
        &self.full[self.slash + 1..]
    }

    /// `<type>/<id>`.
    pub fn as_str(&self) -> &str {
        &self.full
    }
}

impl PartialEq for NeedKey {
    fn eq(&self, other: &Self) -> bool {
        self.full == other.full
    }
}

impl Eq for NeedKey {}

impl std::hash::Hash for NeedKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.full.hash(state);
    }
}

impl PartialOrd for NeedKey {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for NeedKey {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.full.cmp(&other.full)
    }
}

impl fmt::Display for NeedKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.full)
    }
}

/// A provider-side entry key, `<origin>:<type>/<id>`.
pub fn entry_key(origin: &str, need: &NeedKey) -> String {
    format!("{origin}:{need}")
}

/// Splits an entry key back into origin and need.
pub fn parse_entry_key(s: &str) -> Option<(&str, NeedKey)> {
    let (origin, need) = s.split_once(':')?;
    Some((origin, NeedKey::parse(need)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grammars() {
        assert!(is_host_name("drhorrible"));
        assert!(is_host_name("0a-b"));
        assert!(!is_host_name("-a"));
        assert!(!is_host_name("Abc"));
        assert!(!is_host_name(&"a".repeat(64)));
        assert!(is_host_name(&"a".repeat(63)));
        assert!(is_principal_name("dev-sandbox"));
        assert!(is_principal_name("_ci"));
        assert!(!is_principal_name("1ci"));
        assert!(!is_principal_name(&"a".repeat(33)));
        assert!(is_capability_name("ssl-cert"));
        assert!(is_capability_name("a_b"));
        assert!(!is_capability_name("_a"));
        assert!(!is_capability_name(""));
    }

    #[test]
    fn keys() {
        let k = NeedKey::parse("oidc/outline").unwrap();
        assert_eq!(k.to_string(), "oidc/outline");
        assert!(NeedKey::parse("oidc").is_none());
        assert!(NeedKey::parse("oidc/out/line").is_none());
        assert_eq!(entry_key("joker", &k), "joker:oidc/outline");
        let (o, n) = parse_entry_key("joker:oidc/outline").unwrap();
        assert_eq!((o, n), ("joker", k));
    }
}
