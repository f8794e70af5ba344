//! The TSIG key (RFC 8945) every message to the primary is signed with: its name and
//! algorithm from the config, its secret from a file (never from the config, never logged).
//! A key that cannot be read or decoded is an error, so no update is ever sent unsigned.

use std::path::Path;

use base64::Engine;
use hickory_client::proto::dnssec::rdata::tsig::TsigAlgorithm;
use hickory_client::proto::dnssec::tsig::TSigner;
use serde::Deserialize;

use super::name::DnsName;

/// The HMACs hickory signs and verifies with; the truncated and older ones are refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
pub enum Algorithm {
    #[default]
    #[serde(rename = "hmac-sha256")]
    HmacSha256,
    #[serde(rename = "hmac-sha384")]
    HmacSha384,
    #[serde(rename = "hmac-sha512")]
    HmacSha512,
}

impl Algorithm {
    fn tsig(self) -> TsigAlgorithm {
        match self {
            Algorithm::HmacSha256 => TsigAlgorithm::HmacSha256,
            Algorithm::HmacSha384 => TsigAlgorithm::HmacSha384,
            Algorithm::HmacSha512 => TsigAlgorithm::HmacSha512,
        }
    }
}

/// Shortest secret accepted: 128 bits (RFC 8945 §6 asks for at least the HMAC's output
/// length; `tsig-keygen` and `keymgr -t` give exactly that).
const SECRET_MIN: usize = 16;
const SECRET_MAX: usize = 512;
/// How far the primary's clock may differ from ours (RFC 8945 recommends 300 s).
const FUDGE_SECONDS: u16 = 300;

/// A TSIG key ready to sign with.
#[derive(Clone)]
pub struct TsigKey {
    pub name: DnsName,
    pub algorithm: Algorithm,
    secret: Vec<u8>,
}

impl std::fmt::Debug for TsigKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TsigKey")
            .field("name", &self.name)
            .field("algorithm", &self.algorithm)
            .field("secret", &format_args!("<{} bytes>", self.secret.len()))
            .finish()
    }
}

impl TsigKey {
    /// Reads the secret from `file`: the base64 secret alone, or the output of BIND's
    /// `tsig-keygen` (`secret "…";`) or Knot's `keymgr -t` (`secret: …`).
    pub fn load(name: &str, algorithm: Algorithm, file: &Path) -> anyhow::Result<TsigKey> {
        let name = DnsName::parse(name).map_err(|e| anyhow::anyhow!("the TSIG key name: {e}"))?;
        let text = std::fs::read_to_string(file).map_err(|e| {
            anyhow::anyhow!("cannot read the TSIG key file {}: {e}", file.display())
        })?;
        let secret = secret_of(&text)
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "the TSIG key file {} holds no secret (the base64 secret alone, or tsig-keygen or keymgr -t output)",
                    file.display()
                )
            })
            .and_then(|b64| {
                base64::engine::general_purpose::STANDARD
                    .decode(b64)
                    .map_err(|_| {
                        anyhow::anyhow!(
                            "the secret in the TSIG key file {} is not base64",
                            file.display()
                        )
                    })
            })?;
        if !(SECRET_MIN..=SECRET_MAX).contains(&secret.len()) {
            anyhow::bail!(
                "the secret in the TSIG key file {} is {} bytes; {SECRET_MIN} to {SECRET_MAX} are accepted",
                file.display(),
                secret.len()
            );
        }
        Ok(TsigKey {
            name,
            algorithm,
            secret,
        })
    }

    /// A key from its parts (tests and benchmarks that made the secret themselves).
    pub fn from_secret(name: DnsName, algorithm: Algorithm, secret: Vec<u8>) -> TsigKey {
        TsigKey {
            name,
            algorithm,
            secret,
        }
    }

    /// hickory's signer for this key.
    pub fn signer(&self) -> TSigner {
        TSigner::new(
            self.secret.clone(),
            self.algorithm.tsig(),
            self.name.to_name(),
            FUDGE_SECONDS,
        )
        // The three algorithms above are the ones hickory supports.
        .expect("hmac-sha256/384/512 are supported")
    }
}

/// The base64 secret in a key file, or `None`.
fn secret_of(text: &str) -> Option<&str> {
    let trimmed = text.trim();
    if !trimmed.is_empty() && trimmed.bytes().all(is_base64) {
        return Some(trimmed);
    }
    // `secret "…";` (BIND) or `secret: …` (Knot YAML): exactly one such line.
    let mut found = None;
    for line in text.lines() {
        let Some(rest) = line.trim().strip_prefix("secret") else {
            continue;
        };
        let value = rest
            .trim_start_matches([':', ' ', '\t'])
            .trim_end()
            .trim_end_matches(';')
            .trim_matches('"');
        if value.is_empty() || !value.bytes().all(is_base64) || found.is_some() {
            return None;
        }
        found = Some(value);
    }
    found
}

fn is_base64(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'+' | b'/' | b'=')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_files() {
        let dir = tempfile::tempdir().unwrap();
        let secret = "k0xaklPtoel14mVlmTQ2BkNKDbVHbGSTZPB1Xkl7ZUo=";
        let bind =
            format!("key \"fort\" {{\n\talgorithm hmac-sha256;\n\tsecret \"{secret}\";\n}};\n");
        let knot =
            format!("key:\n  - id: fort\n    algorithm: hmac-sha256\n    secret: {secret}\n");
        for (i, text) in [format!("{secret}\n"), bind, knot].iter().enumerate() {
            let path = dir.path().join(format!("k{i}"));
            std::fs::write(&path, text).unwrap();
            let key = TsigKey::load("fort.", Algorithm::HmacSha256, &path).unwrap();
            assert_eq!(key.secret.len(), 32, "{text}");
            assert_eq!(key.name.as_str(), "fort");
            assert!(!format!("{key:?}").contains(secret));
        }
        for (i, text) in [
            "",
            "not base64!",
            "c2hvcnQ=",
            "secret \"a\";\nsecret \"b\";",
        ]
        .iter()
        .enumerate()
        {
            let path = dir.path().join(format!("bad{i}"));
            std::fs::write(&path, text).unwrap();
            assert!(
                TsigKey::load("fort", Algorithm::HmacSha256, &path).is_err(),
                "{text:?}"
            );
        }
        let missing = TsigKey::load("fort", Algorithm::HmacSha256, &dir.path().join("none"));
        assert!(missing.unwrap_err().to_string().contains("cannot read"));
        let path = dir.path().join("k0");
        assert!(TsigKey::load("bad name", Algorithm::HmacSha256, &path).is_err());
    }
}
