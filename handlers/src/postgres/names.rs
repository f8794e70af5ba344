//! Names and text that reach the server: role and database names derived from the caller
//! and its need, identifier and literal quoting, the owner's marker, generated passwords
//! and connection URIs.

use rand::distributions::Alphanumeric;
use rand::Rng;
use sha2::{Digest, Sha256};

/// PostgreSQL's identifier limit (NAMEDATALEN − 1): longer names are silently truncated
/// by the server, which could make two names one.
pub const MAX_NAME: usize = 63;

/// Hex digits of the hash suffix of a name that cannot be spelled out: 64 bits.
const HASH_HEX: usize = 16;

/// The role and database name of `origin`'s need `id`.
///
/// `<prefix>_<origin>_<id>` when the origin has no `_` (every host name) and it fits in
/// 63 bytes: the prefix has no `_` either, so the name splits back into exactly one
/// origin and id, and two callers never get the same name. Otherwise (principals with
/// `_`, long names) `<prefix>__<as much of origin_id as fits>_<16 hex of SHA-256>`: the
/// double underscore never starts a spelled-out name (origins start with a letter or
/// digit), so the two forms never meet, and the hash tells the rest apart.
pub fn derived(prefix: &str, origin: &str, id: &str) -> String {
    let plain = format!("{prefix}_{origin}_{id}");
    if !origin.contains('_') && plain.len() <= MAX_NAME {
        return plain;
    }
    let mut hash = Sha256::new();
    hash.update(origin.as_bytes());
    hash.update([0]);
    hash.update(id.as_bytes());
    let digest = hex(&hash.finalize());
    let room = MAX_NAME - prefix.len() - 2 - 1 - HASH_HEX;
    let readable: String = format!("{origin}_{id}").chars().take(room).collect();
    format!("{prefix}__{readable}_{}", &digest[..HASH_HEX])
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `^[a-z][a-z0-9]{0,15}$`: no `_`, which keeps derived names unambiguous.
pub fn is_prefix(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 16
        && b[0].is_ascii_lowercase()
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
}

/// A name a request may ask for by itself: `^[a-z][a-z0-9_-]{0,62}$`, not `pg_…` (the
/// server reserves those for roles).
pub fn is_requested_name(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= MAX_NAME
        && b[0].is_ascii_lowercase()
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'_' || *c == b'-')
        && !s.starts_with("pg_")
}

/// A role name the config may name (the admin): any non-empty name up to 63 bytes without
/// NUL; it is always quoted.
pub fn is_role_name(s: &str) -> bool {
    !s.is_empty() && s.len() <= MAX_NAME && !s.contains('\0')
}

/// `s` as a quoted identifier: in double quotes, each `"` doubled. The server reads it
/// back as exactly `s`, whatever it holds; `None` for NUL (no identifier can hold it).
pub fn quote_ident(s: &str) -> Option<String> {
    if s.contains('\0') {
        return None;
    }
    Some(format!("\"{}\"", s.replace('"', "\"\"")))
}

/// `s` as a string literal, as libpq's `PQescapeLiteral` writes it: in single quotes,
/// each `'` doubled; with a backslash in it, as an `E'…'` literal with each `\` doubled,
/// so the reading is the same whatever `standard_conforming_strings` says. `None` for NUL.
pub fn quote_literal(s: &str) -> Option<String> {
    if s.contains('\0') {
        return None;
    }
    let body = s.replace('\'', "''");
    Some(if s.contains('\\') {
        format!(" E'{}'", body.replace('\\', "\\\\"))
    } else {
        format!("'{body}'")
    })
}

/// The comment that marks a role or database as made by this handler for `entry`, on the
/// provider `provider`: what lets a later run (after a lost state file or a killed run)
/// tell its own objects from any made by hand.
pub fn marker(provider: &str, entry: &str) -> String {
    format!("made by fort on {provider} for {entry}; released entries keep their data")
}

/// The markers `peers` (providers sharing the server) put on what they made for `entry`:
/// the only roles this handler takes over, since each names both a peer the operator
/// listed and this very entry, so another caller's role never matches.
pub fn peer_markers(peers: &[String], entry: &str) -> Vec<String> {
    peers.iter().map(|p| marker(p, entry)).collect()
}

/// A new password: 43 characters from a CSPRNG over `[A-Za-z0-9]` (256 bits), safe in a
/// URI, a shell and a `.pgpass` line without escaping.
pub fn new_password() -> String {
    rand::rngs::OsRng
        .sample_iter(&Alphanumeric)
        .take(43)
        .map(char::from)
        .collect()
}

/// `postgresql://user:password@host:port/dbname`, each part percent-encoded where it must
/// be; an IPv6 host in brackets.
pub fn uri(host: &str, port: u16, user: &str, password: &str, dbname: &str) -> String {
    let host = if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        encode(host, true)
    };
    format!(
        "postgresql://{}:{}@{host}:{port}/{}",
        encode(user, false),
        encode(password, false),
        encode(dbname, false)
    )
}

/// Percent-encodes all but RFC 3986's unreserved characters (and `[`/`]` in a host).
fn encode(s: &str, host: bool) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) || (host && b"[]".contains(&b)) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_names_are_distinct_and_fit() {
        assert_eq!(derived("fort", "app", "wiki"), "fort_app_wiki");
        assert_eq!(derived("fort", "a-b", "c_d"), "fort_a-b_c_d");
        // A principal with `_` could read as another origin: hashed instead.
        let p = derived("fort", "a_b", "c");
        let h = derived("fort", "a", "b_c");
        assert_eq!(h, "fort_a_b_c");
        assert_ne!(p, h);
        assert!(p.starts_with("fort__a_b_c_"), "{p}");
        // Longest host and need id: hashed, 63 bytes, distinct for a last differing byte.
        let host = "h".repeat(63);
        let a = derived("fort", &host, &"x".repeat(64));
        let b = derived("fort", &host, &format!("{}y", "x".repeat(63)));
        assert_eq!(a.len(), MAX_NAME);
        assert_eq!(b.len(), MAX_NAME);
        assert_ne!(a, b);
        assert!(a.starts_with("fort__hhh"));
        let long_prefix = "p".repeat(16);
        assert!(derived(&long_prefix, &host, "x").len() <= MAX_NAME);
        // The two forms never meet: a spelled-out name never has `__` after the prefix.
        assert!(!derived("fort", "app", "_x").starts_with("fort__"));
        assert!(!derived("fort", "0app", "x").starts_with("fort__"));
    }

    #[test]
    fn identifiers_and_literals_are_quoted() {
        assert_eq!(quote_ident("app").unwrap(), "\"app\"");
        assert_eq!(
            quote_ident("x\"; DROP ROLE admin; --").unwrap(),
            "\"x\"\"; DROP ROLE admin; --\""
        );
        assert_eq!(quote_ident("a\0b"), None);
        assert_eq!(quote_literal("it's").unwrap(), "'it''s'");
        assert_eq!(quote_literal("a\\'b").unwrap(), " E'a\\\\''b'");
        assert_eq!(quote_literal("\0"), None);
    }

    #[test]
    fn a_peer_marker_names_the_peer_and_the_entry() {
        let peers = ["db2".to_owned()];
        let m = peer_markers(&peers, "app:postgres/wiki");
        assert_eq!(m, [marker("db2", "app:postgres/wiki")]);
        assert!(!m.contains(&marker("db2", "web:postgres/wiki")));
        assert!(!m.contains(&marker("db3", "app:postgres/wiki")));
    }

    #[test]
    fn grammars() {
        assert!(is_prefix("fort"));
        assert!(!is_prefix("fort_x"));
        assert!(!is_prefix("1fort"));
        assert!(is_requested_name("gitea"));
        assert!(is_requested_name("app-db_2"));
        assert!(!is_requested_name("pg_monitor"));
        assert!(!is_requested_name("Gitea"));
        assert!(!is_requested_name("x\"y"));
        assert!(!is_requested_name(&"a".repeat(64)));
    }

    #[test]
    fn passwords_and_uris() {
        let a = new_password();
        assert_eq!(a.len(), 43);
        assert!(a.bytes().all(|b| b.is_ascii_alphanumeric()));
        assert_ne!(a, new_password());
        assert_eq!(
            uri(
                "db.example.org",
                5432,
                "fort_app_wiki",
                "pw",
                "fort_app_wiki"
            ),
            "postgresql://fort_app_wiki:pw@db.example.org:5432/fort_app_wiki"
        );
        assert_eq!(
            uri("fd00::1", 5433, "a b", "p@ss", "d/b"),
            "postgresql://a%20b:p%40ss@[fd00::1]:5433/d%2Fb"
        );
    }
}
