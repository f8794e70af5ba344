//! Names a caller may claim (DNS names, SSH principals, database names …), declared on
//! the provider per caller: the caller is the entry's authenticated origin, never a field
//! of the request.
//!
//! In a capability's config:
//!
//! ```json
//! "allow": {
//!   "app":  ["app.example.org", "*.app.example.org"],
//!   "*":    ["{origin}.hosts.example.org"]
//! }
//! ```
//!
//! A caller gets the patterns under its own name plus those under `"*"`; `{origin}` in a
//! pattern is replaced by the caller's name. A pattern is an exact name, or `*.SUFFIX`,
//! which allows every name below SUFFIX (at any depth, a wildcard name such as
//! `*.SUFFIX` itself included) but not SUFFIX. Names are compared as given, after
//! lower-casing ASCII (DNS names are case-insensitive; other names are checked by their
//! own grammar before they get here).

use std::collections::BTreeMap;

use serde::Deserialize;

/// Patterns per caller; `"*"` applies to every caller.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(transparent)]
pub struct Allowances(pub BTreeMap<String, Vec<String>>);

impl Allowances {
    /// The patterns that apply to `origin`, with `{origin}` filled in.
    pub fn patterns(&self, origin: &str) -> Vec<String> {
        [origin, "*"]
            .iter()
            .filter_map(|k| self.0.get(*k))
            .flatten()
            .map(|p| p.replace("{origin}", origin).to_ascii_lowercase())
            .collect()
    }

    /// Whether `origin` may claim `name`.
    pub fn permits(&self, origin: &str, name: &str) -> bool {
        Allowances::any_permits(&self.patterns(origin), name)
    }

    /// Whether one of `patterns` (from `patterns`) allows `name`: for checking several
    /// names of one caller without filling in its patterns each time.
    pub fn any_permits(patterns: &[String], name: &str) -> bool {
        let name = name.to_ascii_lowercase();
        patterns.iter().any(|p| matches(p, &name))
    }

    /// What `origin` may have, for a refusal that tells it: `allowed for app:
    /// *.app.example.org, wiki.example.org` (at most eight patterns, then how many more),
    /// or `nothing is allowed for app`.
    pub fn describe(&self, origin: &str) -> String {
        const SHOWN: usize = 8;
        let patterns = self.patterns(origin);
        if patterns.is_empty() {
            return format!("nothing is allowed for {origin}");
        }
        let mut text = format!(
            "allowed for {origin}: {}",
            patterns
                .iter()
                .take(SHOWN)
                .cloned()
                .collect::<Vec<_>>()
                .join(", ")
        );
        if patterns.len() > SHOWN {
            text.push_str(&format!(" and {} more", patterns.len() - SHOWN));
        }
        text
    }

    /// The first of `names` that `origin` may not claim, for a refusal that names it.
    pub fn first_refused<'a>(
        &self,
        origin: &str,
        names: impl IntoIterator<Item = &'a str>,
    ) -> Option<&'a str> {
        names.into_iter().find(|n| !self.permits(origin, n))
    }

    /// Every pattern must be an exact name or `*.SUFFIX` with a non-empty suffix.
    pub fn validate(&self) -> Result<(), String> {
        for (who, patterns) in &self.0 {
            for p in patterns {
                let bad = p.is_empty()
                    || p.chars().any(|c| c.is_whitespace() || c.is_control())
                    || p.strip_prefix("*.").map_or(p.contains('*'), |rest| {
                        rest.is_empty() || rest.contains('*')
                    });
                if bad {
                    return Err(format!("allow.{who}: {p:?} is neither a name nor *.SUFFIX"));
                }
            }
        }
        Ok(())
    }
}

fn matches(pattern: &str, name: &str) -> bool {
    match pattern.strip_prefix("*.") {
        Some(suffix) => name
            .strip_suffix(suffix)
            .and_then(|head| head.strip_suffix('.'))
            .is_some_and(|head| !head.is_empty()),
        None => pattern == name,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allow() -> Allowances {
        serde_json::from_str(
            r#"{"app": ["App.example.org", "*.app.example.org"], "*": ["{origin}.h.test"]}"#,
        )
        .unwrap()
    }

    #[test]
    fn exact_wildcard_and_template() {
        let a = allow();
        assert!(a.permits("app", "app.example.org"));
        assert!(a.permits("app", "x.app.example.org"));
        assert!(a.permits("app", "a.b.app.example.org"));
        assert!(a.permits("app", "*.app.example.org"));
        assert!(a.permits("app", "app.h.test"));
        assert!(!a.permits("app", "evilapp.example.org"));
        assert!(!a.permits("app", ".app.example.org"));
        assert!(!a.permits("web", "app.example.org"));
        assert!(a.permits("web", "web.h.test"));
        assert!(!a.permits("web", "app.h.test"));
        assert_eq!(
            a.first_refused("app", ["x.app.example.org", "example.org"]),
            Some("example.org")
        );
        assert!(a.validate().is_ok());
    }

    #[test]
    fn bad_patterns_are_refused() {
        for p in ["", "*", "*.", "a.*.b", "**.x", "a b"] {
            let a = Allowances([("app".to_owned(), vec![p.to_owned()])].into());
            assert!(a.validate().is_err(), "{p:?}");
        }
    }
}
