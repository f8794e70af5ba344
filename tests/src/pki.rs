//! Certificates for tests of keys made on the consumer's host (docs/protocol.md §11.10): a
//! CA that signs whatever public key a consumer sent, with any validity, and the check a
//! service would make, that a key file and a certificate file are one pair.

use std::time::Duration;

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};

/// Sets the validity of `params` to unix seconds `not_before` to `not_after`.
fn set_validity(params: &mut CertificateParams, not_before: i64, not_after: i64) {
    let epoch = rcgen::date_time_ymd(1970, 1, 1);
    let at = |unix: i64| {
        if unix >= 0 {
            epoch + Duration::from_secs(unix as u64)
        } else {
            epoch - Duration::from_secs(unix.unsigned_abs())
        }
    };
    params.not_before = at(not_before);
    params.not_after = at(not_after);
}

/// A P-256 public key, as its point's bytes (the consumers of these tests make P-256 keys).
struct P256(Vec<u8>);

impl rcgen::PublicKeyData for P256 {
    fn der_bytes(&self) -> &[u8] {
        &self.0
    }

    fn algorithm(&self) -> &'static rcgen::SignatureAlgorithm {
        &rcgen::PKCS_ECDSA_P256_SHA256
    }
}

/// The key bits of a PEM `PUBLIC KEY`.
fn public_key_bits(public_pem: &str) -> Vec<u8> {
    use x509_parser::prelude::FromDer;
    let (_, pem) = x509_parser::pem::parse_x509_pem(public_pem.as_bytes()).expect("PEM");
    assert_eq!(pem.label, "PUBLIC KEY");
    let (_, spki) = x509_parser::x509::SubjectPublicKeyInfo::from_der(&pem.contents)
        .expect("SubjectPublicKeyInfo");
    spki.subject_public_key.data.to_vec()
}

/// A certificate authority of one self-signed certificate.
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    /// Its certificate, PEM.
    pub pem: String,
}

impl Ca {
    pub fn new(name: &str) -> Ca {
        let key = KeyPair::generate().expect("a CA key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let pem = params.self_signed(&key).expect("self-signed").pem();
        Ca {
            issuer: Issuer::new(params, key),
            pem,
        }
    }

    /// A certificate for `public_pem` (a PEM `PUBLIC KEY`) valid from `not_before` to
    /// `not_after` (unix seconds), for `name`; `ca` marks it `CA:TRUE`.
    pub fn sign_with(
        &self,
        public_pem: &str,
        name: &str,
        not_before: i64,
        not_after: i64,
        ca: bool,
    ) -> String {
        let public = P256(public_key_bits(public_pem));
        let mut params = CertificateParams::new(vec![name.to_owned()]).expect("params");
        params.distinguished_name.push(DnType::CommonName, name);
        set_validity(&mut params, not_before, not_after);
        if ca {
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        }
        params
            .signed_by(&public, &self.issuer)
            .expect("signed")
            .pem()
    }

    /// A certificate for `public_pem`, valid from an hour ago for `days`.
    pub fn sign(&self, public_pem: &str, name: &str, days: i64) -> String {
        let now = fort_core::wire::unix_now() as i64;
        self.sign_with(public_pem, name, now - 3600, now + days * 86400, false)
    }
}

/// A new key's public half, PEM, for certificates of another key than the consumer's.
pub fn stranger_public_pem() -> String {
    KeyPair::generate().expect("a key").public_key_pem()
}

/// The SubjectPublicKeyInfo (DER) of the first certificate in `cert_pem`, if it parses.
pub fn certificate_key(cert_pem: &[u8]) -> Option<Vec<u8>> {
    let (_, pem) = x509_parser::pem::parse_x509_pem(cert_pem).ok()?;
    let cert = pem.parse_x509().ok()?;
    Some(cert.public_key().raw.to_vec())
}

/// The SubjectPublicKeyInfo (DER) of a PKCS#8 PEM private key, if it parses.
pub fn private_key_public(key_pem: &str) -> Option<Vec<u8>> {
    use rcgen::PublicKeyData;
    let key = KeyPair::from_pem(key_pem).ok()?;
    Some(key.subject_public_key_info())
}

/// Whether the first certificate in `cert_pem` is for the private key in `key_pem`.
pub fn pair_matches(key_pem: &str, cert_pem: &[u8]) -> bool {
    match (private_key_public(key_pem), certificate_key(cert_pem)) {
        (Some(a), Some(b)) => a == b,
        _ => false,
    }
}
