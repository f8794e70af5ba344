//! What a consumer asks the oidc capability for: the same shape as the NixOS interface
//! (`nixos-module/interfaces/oidc.nix`) and its request schema, and the client metadata
//! (RFC 7591 §2) it becomes.

use reqwest::Url;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// Grant types a client may be registered with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GrantType {
    AuthorizationCode,
    RefreshToken,
    ClientCredentials,
}

impl GrantType {
    pub fn as_str(self) -> &'static str {
        match self {
            GrantType::AuthorizationCode => "authorization_code",
            GrantType::RefreshToken => "refresh_token",
            GrantType::ClientCredentials => "client_credentials",
        }
    }
}

/// The request as it arrives.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    client_name: String,
    #[serde(default)]
    redirect_uris: Vec<String>,
    #[serde(default = "default_scopes")]
    scopes: Vec<String>,
    #[serde(default = "default_grant_types")]
    grant_types: Vec<GrantType>,
    #[serde(default)]
    rotate: u64,
}

fn default_scopes() -> Vec<String> {
    vec!["openid".into()]
}
fn default_grant_types() -> Vec<GrantType> {
    vec![GrantType::AuthorizationCode]
}

/// A checked request: the client's metadata and the rotation counter.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub metadata: Metadata,
    /// A counter the consumer raises to get a new client secret. Unset: 0.
    pub rotate: u64,
}

/// What the provider is told about the client; a change is sent as an RFC 7592 update.
/// Lists are sorted and deduplicated, so a reordered request is no change.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Metadata {
    pub client_name: String,
    pub redirect_uris: Vec<String>,
    pub scopes: Vec<String>,
    pub grant_types: Vec<GrantType>,
}

/// Bounds of a request: more is a mistake or an attack, never a client.
const MAX_URIS: usize = 16;
const MAX_URI_BYTES: usize = 512;
const MAX_SCOPES: usize = 32;
const MAX_SCOPE_BYTES: usize = 64;

impl Request {
    /// Parses and checks a request; the error is a one-line reason for the consumer
    /// (naming the field, never echoing a long value).
    pub fn parse(value: &Value) -> Result<Request, String> {
        if !value.is_object() {
            return Err("request: must be a JSON object".into());
        }
        let raw = Raw::deserialize(value).map_err(|e| format!("request: {e}"))?;
        if !is_client_name(&raw.client_name) {
            return Err(
                "request.client_name: 1 to 63 of a-z, 0-9 and -, starting with a letter or digit"
                    .into(),
            );
        }
        if raw.redirect_uris.len() > MAX_URIS {
            return Err(format!("request.redirect_uris: at most {MAX_URIS}"));
        }
        for (i, uri) in raw.redirect_uris.iter().enumerate() {
            if uri.len() > MAX_URI_BYTES || !is_redirect_uri(uri) {
                return Err(format!(
                    "request.redirect_uris[{i}]: an https URL in normal form, without fragment, user or encoded / \\ (at most {MAX_URI_BYTES} bytes)"
                ));
            }
        }
        if raw.scopes.is_empty() || raw.scopes.len() > MAX_SCOPES {
            return Err(format!("request.scopes: 1 to {MAX_SCOPES} scopes"));
        }
        if let Some(bad) = raw.scopes.iter().position(|s| !is_scope(s)) {
            return Err(format!(
                "request.scopes[{bad}]: 1 to {MAX_SCOPE_BYTES} printable characters, no space, \" or \\"
            ));
        }
        if raw.grant_types.is_empty() {
            return Err("request.grant_types: at least one".into());
        }
        let mut metadata = Metadata {
            client_name: raw.client_name,
            redirect_uris: raw.redirect_uris,
            scopes: raw.scopes,
            grant_types: raw.grant_types,
        };
        metadata.redirect_uris.sort();
        metadata.redirect_uris.dedup();
        metadata.scopes.sort();
        metadata.scopes.dedup();
        metadata.grant_types.sort();
        metadata.grant_types.dedup();
        if metadata.uses_code() && metadata.redirect_uris.is_empty() {
            return Err("request.redirect_uris: authorization_code needs at least one".into());
        }
        Ok(Request {
            metadata,
            rotate: raw.rotate,
        })
    }
}

impl Metadata {
    fn uses_code(&self) -> bool {
        self.grant_types.contains(&GrantType::AuthorizationCode)
    }

    /// The RFC 7591 client metadata the provider gets: a confidential client that
    /// authenticates with HTTP Basic at the token endpoint.
    pub fn to_json(&self) -> Value {
        let response_types: &[&str] = if self.uses_code() { &["code"] } else { &[] };
        json!({
            "client_name": self.client_name,
            "redirect_uris": self.redirect_uris,
            "grant_types": self.grant_types.iter().map(|g| g.as_str()).collect::<Vec<_>>(),
            "response_types": response_types,
            "scope": self.scopes.join(" "),
            "token_endpoint_auth_method": "client_secret_basic",
        })
    }
}

/// A name shown on the provider's consent screen.
fn is_client_name(s: &str) -> bool {
    (1..=63).contains(&s.len())
        && s.bytes()
            .next()
            .is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        && s.bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
}

/// A scope token (RFC 6749 §3.3), bounded.
fn is_scope(s: &str) -> bool {
    (1..=MAX_SCOPE_BYTES).contains(&s.len())
        && s.bytes()
            .all(|c| c.is_ascii_graphic() && c != b'"' && c != b'\\')
}

/// An https URL that is already in its normal form (so `..`, `%2e`, upper-case hosts,
/// backslashes and default ports cannot dress one URL up as another), with a host, no
/// user or password, no port 0.
pub fn is_normal_https_url(s: &str) -> bool {
    Url::parse(s).is_ok_and(|u| {
        u.scheme() == "https"
            && u.as_str() == s
            && u.host_str().is_some_and(|h| !h.is_empty())
            && u.username().is_empty()
            && u.password().is_none()
            && u.port() != Some(0)
    })
}

/// A redirect URI a caller may register: a normal https URL without fragment, and
/// without an encoded `/` or `\` that a web server might decode into another path.
fn is_redirect_uri(s: &str) -> bool {
    let lower = s.to_ascii_lowercase();
    is_normal_https_url(s)
        && !s.contains('#')
        && !lower.contains("%2f")
        && !lower.contains("%5c")
        && s.bytes().all(|c| c.is_ascii_graphic())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests() {
        let r = Request::parse(&json!({"client_name": "wiki",
            "redirect_uris": ["https://wiki.example.org/b", "https://wiki.example.org/a"]}))
        .unwrap();
        assert_eq!(r.rotate, 0);
        assert_eq!(r.metadata.scopes, ["openid"]);
        assert_eq!(r.metadata.grant_types, [GrantType::AuthorizationCode]);
        assert_eq!(r.metadata.redirect_uris[0], "https://wiki.example.org/a");
        assert_eq!(r.metadata.to_json()["response_types"], json!(["code"]));
        let m2m = Request::parse(
            &json!({"client_name": "ci", "grant_types": ["client_credentials"],
            "rotate": 2}),
        )
        .unwrap();
        assert_eq!(m2m.rotate, 2);
        assert_eq!(m2m.metadata.to_json()["response_types"], json!([]));
        for bad in [
            json!({"client_name": "Wiki", "redirect_uris": ["https://a.org/"]}),
            json!({"client_name": "-w", "redirect_uris": ["https://a.org/"]}),
            json!({"client_name": "w"}),
            json!({"client_name": "w", "redirect_uris": ["http://a.org/"]}),
            json!({"client_name": "w", "redirect_uris": ["https://a.org"]}),
            json!({"client_name": "w", "redirect_uris": ["https://A.org/"]}),
            json!({"client_name": "w", "redirect_uris": ["https://a.org/x/../y"]}),
            json!({"client_name": "w", "redirect_uris": ["https://a.org/x/%2e%2e/y"]}),
            json!({"client_name": "w", "redirect_uris": ["https://a.org/x%2Fy"]}),
            json!({"client_name": "w", "redirect_uris": ["https://u:p@a.org/"]}),
            json!({"client_name": "w", "redirect_uris": ["https://a.org/#x"]}),
            json!({"client_name": "w", "redirect_uris": ["https://a.org/x y"]}),
            json!({"client_name": "w", "redirect_uris": ["https://a.org/"], "scopes": []}),
            json!({"client_name": "w", "redirect_uris": ["https://a.org/"], "scopes": ["a b"]}),
            json!({"client_name": "w", "redirect_uris": ["https://a.org/"], "grant_types": ["implicit"]}),
            json!({"client_name": "w", "redirect_uris": ["https://a.org/"], "grant_types": []}),
            json!({"client_name": "w", "redirect_uris": ["https://a.org/"], "rotate": -1}),
            json!({"client_name": "w", "redirect_uris": ["https://a.org/"], "colour": 1}),
            json!([]),
        ] {
            assert!(Request::parse(&bad).is_err(), "{bad}");
        }
        let long = Request::parse(&json!({"client_name": "x".repeat(5000)})).unwrap_err();
        assert!(long.len() < 200, "{long}");
    }
}
