//! What a consumer asks the `acme` capability for: `{"csr": "<PEM CERTIFICATE REQUEST>"}`
//! and optionally `"names"` (else the CSR's DNS names). The consumer made the key; only
//! the CSR travels, so the handler never sees a private key. The CSR is hostile until
//! checked: its size, its signature, and that it asks for exactly the names requested.

use std::collections::BTreeSet;

use serde::Deserialize;
use serde_json::Value;
use sha2::{Digest, Sha256};
use x509_parser::certification_request::X509CertificationRequest;
use x509_parser::extensions::{GeneralName, ParsedExtension};
use x509_parser::prelude::FromDer;

use crate::dns::DnsName;

/// Longest CSR accepted (an RSA-4096 CSR with 100 names is under 8 KiB).
pub const CSR_MAX: usize = 16 * 1024;
/// Most names in one certificate (Let's Encrypt's limit).
pub const NAMES_MAX: usize = 100;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    csr: String,
    #[serde(default)]
    names: Option<Vec<String>>,
}

/// A checked request.
#[derive(Debug, Clone)]
pub struct Request {
    /// The CSR in DER, as the CA gets it at finalization.
    pub csr_der: Vec<u8>,
    /// SHA-256 of the DER, hex: an entry whose CSR changed gets a new certificate.
    pub csr_sha256: String,
    /// The names, lower-cased, sorted, without duplicates (`*.x` for wildcards).
    pub names: Vec<String>,
}

/// Parses and checks `value`; the error is the one-line reason the consumer sees.
pub fn parse(value: &Value) -> Result<Request, String> {
    let raw: Raw = serde_json::from_value(value.clone())
        .map_err(|e| format!("the request is not {{\"csr\": PEM, \"names\": [..]}}: {e}"))?;
    if raw.csr.len() > CSR_MAX {
        return Err(format!("the CSR is longer than {CSR_MAX} bytes"));
    }
    let (_, pem) = x509_parser::pem::parse_x509_pem(raw.csr.as_bytes())
        .map_err(|_| "the csr is not PEM".to_owned())?;
    if pem.label != "CERTIFICATE REQUEST" && pem.label != "NEW CERTIFICATE REQUEST" {
        return Err(format!(
            "the csr is a PEM {:?}, not a CERTIFICATE REQUEST",
            pem.label
        ));
    }
    let (rest, csr) = X509CertificationRequest::from_der(&pem.contents)
        .map_err(|_| "the CSR does not parse".to_owned())?;
    if !rest.is_empty() {
        return Err("the CSR has trailing bytes".into());
    }
    csr.verify_signature()
        .map_err(|_| "the CSR's signature does not verify".to_owned())?;
    let mut in_csr = BTreeSet::new();
    for ext in csr.requested_extensions().into_iter().flatten() {
        if let ParsedExtension::SubjectAlternativeName(san) = ext {
            for name in &san.general_names {
                match name {
                    GeneralName::DNSName(n) => {
                        in_csr.insert(checked_name(n)?);
                    }
                    other => {
                        return Err(format!(
                            "the CSR asks for {other:?}, which is not a DNS name"
                        ))
                    }
                }
            }
        }
    }
    let names: BTreeSet<String> = match raw.names {
        None => in_csr.clone(),
        Some(list) => list
            .iter()
            .map(|n| checked_name(n))
            .collect::<Result<_, _>>()?,
    };
    if names.is_empty() {
        return Err(
            "the request names no DNS name (neither names nor the CSR's subjectAltName)".into(),
        );
    }
    if names.len() > NAMES_MAX {
        return Err(format!("more than {NAMES_MAX} names"));
    }
    if names != in_csr {
        let missing: Vec<_> = names
            .symmetric_difference(&in_csr)
            .take(3)
            .cloned()
            .collect();
        return Err(format!(
            "the CSR's DNS names are not the names requested (differ in {})",
            missing.join(", ")
        ));
    }
    Ok(Request {
        csr_sha256: hex::encode(Sha256::digest(&pem.contents)),
        csr_der: pem.contents,
        names: names.into_iter().collect(),
    })
}

/// The CSR's SHA-256 and the names asked for, without checking the CSR's signature or
/// parsing it: enough to see that an entry is the one a certificate was issued for (its
/// CSR was checked then). `None` when anything is off; the full `parse` says what.
pub fn fingerprint(value: &Value) -> Option<(String, Option<Vec<String>>)> {
    let raw = Raw::deserialize(value).ok()?;
    if raw.csr.len() > CSR_MAX {
        return None;
    }
    let (_, pem) = x509_parser::pem::parse_x509_pem(raw.csr.as_bytes()).ok()?;
    let names = match raw.names {
        None => None,
        Some(list) => {
            let set: BTreeSet<String> = list
                .iter()
                .map(|n| checked_name(n))
                .collect::<Result<_, _>>()
                .ok()?;
            Some(set.into_iter().collect())
        }
    };
    Some((hex::encode(Sha256::digest(&pem.contents)), names))
}

fn checked_name(text: &str) -> Result<String, String> {
    let name = DnsName::parse(text).map_err(|e| format!("{text:?}: {e}"))?;
    let s = name.as_str().to_owned();
    if s.matches('*').count() > usize::from(s.starts_with("*.")) {
        return Err(format!("{s}: a wildcard may only be the first label"));
    }
    if !s.contains('.') {
        return Err(format!("{s}: not a fully qualified name"));
    }
    Ok(s)
}

/// The name a DNS-01 record for `name` is made at.
pub fn challenge_name(name: &str) -> String {
    format!(
        "_acme-challenge.{}",
        name.strip_prefix("*.").unwrap_or(name)
    )
}
