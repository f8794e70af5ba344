//! The provider operator's config of the oidc capability (JSON, written by the NixOS
//! module from `fort.host.capabilities.<name>.oidc`): the OpenID provider, the file with
//! its initial access token, and what each caller may register.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use reqwest::Url;
use serde::Deserialize;

use super::request::{is_normal_https_url, GrantType};
use crate::common::Allowances;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The provider's issuer URL, as its discovery document states it and as every
    /// response carries it (`https://id.example.org`). Required.
    pub issuer: String,
    /// The RFC 7591 registration endpoint. Unset: `registration_endpoint` of
    /// `<issuer>/.well-known/openid-configuration`, read when a run has work.
    #[serde(default)]
    pub registration_endpoint: Option<String>,
    /// A file holding the initial access token registrations are authorised with (read at
    /// run time, sent only to the registration endpoint, never logged). Required.
    pub initial_access_token_file: PathBuf,
    /// Where the handler records the clients it registered, with their registration
    /// access tokens (JSON, mode 0600). Required: those tokens are its only proof of
    /// ownership.
    pub state_file: PathBuf,
    /// A PEM file with the root certificates the provider's TLS certificate chains to.
    /// Unset: the platform's trusted roots.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// Client names each caller may register, per caller and `"*"`; `{origin}` is the
    /// caller. Unset: every request is refused.
    #[serde(default)]
    pub allow: Allowances,
    /// Redirect URIs each caller may register, per caller and `"*"`: a URI ending in `/`
    /// allows every URI below it, any other allows exactly itself; `{origin}` is the
    /// caller. Unset: no redirect URI is allowed.
    #[serde(default)]
    pub allow_redirect_uris: BTreeMap<String, Vec<String>>,
    /// Grant types each caller may ask for, per caller and `"*"`. Unset:
    /// `{"*": ["authorization_code", "refresh_token"]}` (`client_credentials` must be
    /// granted by name).
    #[serde(default = "default_grant_types")]
    pub allow_grant_types: BTreeMap<String, Vec<GrantType>>,
    /// How long one HTTP request to the provider may take. Unset: 10 s.
    #[serde(default = "default_timeout", with = "humantime_serde")]
    pub timeout: Duration,
    /// How long one run may spend on the provider; entries left over are answered
    /// `$fort_pending` and the handler asks to run again in a second. Unset: 40 s (the
    /// agent kills a handler after 60).
    #[serde(default = "default_budget", with = "humantime_serde")]
    pub run_budget: Duration,
}

fn default_grant_types() -> BTreeMap<String, Vec<GrantType>> {
    BTreeMap::from([(
        "*".to_owned(),
        vec![GrantType::AuthorizationCode, GrantType::RefreshToken],
    )])
}
fn default_timeout() -> Duration {
    Duration::from_secs(10)
}
fn default_budget() -> Duration {
    Duration::from_secs(40)
}

impl Config {
    /// Loads and validates `path`, and reads the initial access token file (so `--check`
    /// finds a missing one).
    /// Loads and validates the config without reading the files it names (secrets,
    /// roots): what decides which requests a caller may make.
    pub fn load_policy(path: &Path) -> anyhow::Result<Config> {
        let config: Config = crate::common::config::load(path)?;
        config
            .validate()
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        Ok(config)
    }

    pub fn load(path: &Path) -> anyhow::Result<Config> {
        let config = Config::load_policy(path)?;
        config.initial_access_token()?;
        if let Some(ca) = &config.ca_file {
            let pem = std::fs::read(ca)
                .map_err(|e| anyhow::anyhow!("ca_file: cannot read {}: {e}", ca.display()))?;
            reqwest::Certificate::from_pem_bundle(&pem)
                .ok()
                .filter(|certs| !certs.is_empty())
                .ok_or_else(|| {
                    anyhow::anyhow!("ca_file: {} holds no PEM certificate", ca.display())
                })?;
        }
        Ok(config)
    }

    /// The initial access token, read now (an operator may replace the file between runs).
    pub fn initial_access_token(&self) -> anyhow::Result<String> {
        let token = crate::common::config::read_secret(&self.initial_access_token_file)?;
        if !token.bytes().all(|b| b.is_ascii_graphic()) || token.len() > 4096 {
            anyhow::bail!(
                "the initial access token in {} is not one line of up to 4096 printable characters",
                self.initial_access_token_file.display()
            );
        }
        Ok(token)
    }

    fn validate(&self) -> Result<(), String> {
        let issuer = Url::parse(&self.issuer).map_err(|e| format!("issuer: {e}"))?;
        if !secure_or_loopback(&issuer) || issuer.query().is_some() || issuer.fragment().is_some() {
            return Err(format!(
                "issuer: {:?} must be an https URL without query or fragment (http only on loopback)",
                self.issuer
            ));
        }
        if let Some(endpoint) = &self.registration_endpoint {
            let url = Url::parse(endpoint).map_err(|e| format!("registration_endpoint: {e}"))?;
            if !secure_or_loopback(&url) {
                return Err(
                    "registration_endpoint: must be an https URL (http only on loopback)".into(),
                );
            }
        }
        self.allow.validate()?;
        for (who, patterns) in &self.allow_redirect_uris {
            for p in patterns {
                let filled = p.replace("{origin}", "origin");
                if !is_normal_https_url(&filled) {
                    return Err(format!(
                        "allow_redirect_uris.{who}: {p:?} is not an https URL in normal form (a host alone needs its trailing /)"
                    ));
                }
            }
        }
        if self.timeout.is_zero() || self.timeout > Duration::from_secs(60) {
            return Err("timeout: more than 0 s, at most a minute".into());
        }
        if self.run_budget.is_zero() || self.run_budget > Duration::from_secs(3600) {
            return Err("run_budget: more than 0 s, at most an hour".into());
        }
        Ok(())
    }

    /// Whether `origin` may register `uri` (a URI already checked by the request).
    pub fn permits_redirect(&self, origin: &str, uri: &str) -> bool {
        patterns(&self.allow_redirect_uris, origin).any(|p| {
            let p = p.replace("{origin}", origin);
            uri == p || (p.ends_with('/') && uri.starts_with(&p))
        })
    }

    /// Whether `origin` may ask for `grant`.
    pub fn permits_grant(&self, origin: &str, grant: GrantType) -> bool {
        patterns(&self.allow_grant_types, origin).any(|g| *g == grant)
    }
}

/// The values under `origin` and under `"*"`.
fn patterns<'a, T>(
    map: &'a BTreeMap<String, Vec<T>>,
    origin: &'a str,
) -> impl Iterator<Item = &'a T> + 'a {
    [origin, "*"]
        .into_iter()
        .filter_map(move |k| map.get(k))
        .flatten()
}

/// https, or http to a loopback address (a provider on the same host).
fn secure_or_loopback(url: &Url) -> bool {
    match url.scheme() {
        "https" => url.host().is_some(),
        "http" => url.host_str().is_some_and(|h| {
            h == "localhost"
                || h.trim_start_matches('[')
                    .trim_end_matches(']')
                    .parse::<std::net::IpAddr>()
                    .is_ok_and(|ip| ip.is_loopback())
        }),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<Config, String> {
        let c: Config = serde_json::from_str(json).map_err(|e| e.to_string())?;
        c.validate().map(|()| c)
    }

    const BASE: &str = r#""initial_access_token_file": "/t", "state_file": "/s""#;

    #[test]
    fn defaults_and_mistakes() {
        let c = parse(&format!(
            r#"{{"issuer": "https://id.example.org", {BASE},
                "allow_redirect_uris": {{"app": ["https://wiki.example.org/cb/"], "*": ["https://{{origin}}.example.org/login"]}}}}"#
        ))
        .unwrap();
        assert_eq!(c.timeout, Duration::from_secs(10));
        assert!(c.permits_grant("app", GrantType::AuthorizationCode));
        assert!(!c.permits_grant("app", GrantType::ClientCredentials));
        assert!(c.permits_redirect("app", "https://wiki.example.org/cb/x"));
        assert!(c.permits_redirect("app", "https://wiki.example.org/cb/"));
        assert!(!c.permits_redirect("app", "https://wiki.example.org/cbx"));
        assert!(c.permits_redirect("web", "https://web.example.org/login"));
        assert!(!c.permits_redirect("web", "https://web.example.org/login/more"));
        assert!(!c.permits_redirect("web", "https://wiki.example.org/cb/x"));
        assert!(parse(&format!(r#"{{"issuer": "http://127.0.0.1:8080", {BASE}}}"#)).is_ok());
        for bad in [
            format!(r#"{{"issuer": "http://id.example.org", {BASE}}}"#),
            format!(r#"{{"issuer": "ftp://id.example.org", {BASE}}}"#),
            format!(r#"{{"issuer": "https://id.example.org?x=1", {BASE}}}"#),
            format!(
                r#"{{"issuer": "https://i", "registration_endpoint": "http://i/reg", {BASE}}}"#
            ),
            format!(
                r#"{{"issuer": "https://i", {BASE}, "allow_redirect_uris": {{"a": ["https://a.org"]}}}}"#
            ),
            format!(
                r#"{{"issuer": "https://i", {BASE}, "allow_redirect_uris": {{"a": ["https://a.org/x/../"]}}}}"#
            ),
            format!(
                r#"{{"issuer": "https://i", {BASE}, "allow_grant_types": {{"a": ["implicit"]}}}}"#
            ),
            format!(r#"{{"issuer": "https://i", {BASE}, "timeout": "0s"}}"#),
            format!(r#"{{"issuer": "https://i", {BASE}, "colour": 1}}"#),
            format!(r#"{{"issuer": "https://i", {BASE}, "allow": {{"app": ["*"]}}}}"#),
            r#"{"issuer": "https://i", "state_file": "/s"}"#.to_owned(),
        ] {
            assert!(parse(&bad).is_err(), "{bad}");
        }
    }
}
