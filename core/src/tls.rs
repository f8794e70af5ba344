//! Transport security (docs/protocol.md §11.1): TLS 1.3 pinned to every host's SSH key.
//!
//! There is no PKI. An agent serves a self-signed certificate whose key is its own ed25519
//! host key; a client accepts the handshake only when that certificate's key is one that
//! `hosts.json` lists for the host it meant to reach and the handshake signature verifies
//! with it. Names, dates, issuers and chains are never consulted: the registry is the
//! trust root, exactly as it is for request signatures.
//!
//! All cryptography is rustls with the ring provider; the certificate is built by rcgen and
//! the key encodings by ed25519-dalek. This module only wires them together.

use std::sync::Arc;

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use ed25519_dalek::pkcs8::{EncodePrivateKey, EncodePublicKey};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{verify_tls13_signature, CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, ServerConfig, SignatureScheme};
use sha2::{Digest, Sha256};
use ssh_key::PublicKey;

use crate::sign::Signer;

/// ALPN: HTTP/1.1 inside TLS, nothing else.
pub const ALPN_HTTP11: &[u8] = b"http/1.1";

/// Why a TLS configuration could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("the key is not ed25519")]
    NotEd25519,
    #[error("cannot encode the host key: {0}")]
    Encode(String),
    #[error("cannot build the certificate: {0}")]
    Certificate(String),
    #[error("rustls refused the configuration: {0}")]
    Rustls(#[from] rustls::Error),
}

/// The one crypto provider: ring (no C toolchain, one static binary).
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn verifying_key(key: &PublicKey) -> Result<ed25519_dalek::VerifyingKey, TlsError> {
    let raw = key.key_data().ed25519().ok_or(TlsError::NotEd25519)?;
    ed25519_dalek::VerifyingKey::from_bytes(raw.as_ref())
        .map_err(|e| TlsError::Encode(e.to_string()))
}

/// Makes ring the process-wide default provider, for code paths (a plain-HTTP reqwest
/// client) that build a TLS configuration of their own. Idempotent.
pub fn install_default_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// The SubjectPublicKeyInfo DER of an ed25519 key, as it appears in a certificate.
pub fn spki_der(key: &PublicKey) -> Result<Vec<u8>, TlsError> {
    Ok(verifying_key(key)?
        .to_public_key_der()
        .map_err(|e| TlsError::Encode(e.to_string()))?
        .into_vec())
}

/// The curl pin of a key: `sha256//` + base64 of SHA-256 over its SPKI DER
/// (`curl --pinnedpubkey`).
pub fn pin(key: &PublicKey) -> Result<String, TlsError> {
    Ok(format!(
        "sha256//{}",
        STANDARD.encode(Sha256::digest(spki_der(key)?))
    ))
}

/// The server side: a self-signed certificate around `signer`'s ed25519 key, TLS 1.3 only,
/// ALPN `http/1.1`. The certificate names no host: peers know whom they reached by its
/// key, and a stranger should not learn a name to put in `X-Fort-Origin`.
pub fn server_config(signer: &Signer) -> Result<Arc<ServerConfig>, TlsError> {
    let seed = signer.ed25519_seed().ok_or(TlsError::NotEd25519)?;
    let pkcs8 = ed25519_dalek::SigningKey::from_bytes(&seed)
        .to_pkcs8_der()
        .map_err(|e| TlsError::Encode(e.to_string()))?;
    let pkcs8 = PrivatePkcs8KeyDer::from(pkcs8.as_bytes().to_vec());
    let key_pair = rcgen::KeyPair::from_pkcs8_der_and_sign_algo(&pkcs8, &rcgen::PKCS_ED25519)
        .map_err(|e| TlsError::Certificate(e.to_string()))?;
    let mut params = rcgen::CertificateParams::new(Vec::new())
        .map_err(|e| TlsError::Certificate(e.to_string()))?;
    params.distinguished_name = rcgen::DistinguishedName::new();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "fort-agent");
    let cert = params
        .self_signed(&key_pair)
        .map_err(|e| TlsError::Certificate(e.to_string()))?;
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_no_client_auth()
        .with_single_cert(vec![cert.der().clone()], PrivateKeyDer::Pkcs8(pkcs8))?;
    config.alpn_protocols = vec![ALPN_HTTP11.to_vec()];
    Ok(Arc::new(config))
}

/// Accepts a server only when its certificate's key is one of `host`'s keys, and (through
/// rustls) only when the TLS 1.3 handshake signature verifies with that key.
#[derive(Debug)]
pub struct PinnedServer {
    host: String,
    spkis: Vec<Vec<u8>>,
    algorithms: WebPkiSupportedAlgorithms,
}

impl PinnedServer {
    pub fn new(host: &str, keys: &[PublicKey]) -> PinnedServer {
        PinnedServer {
            host: host.to_owned(),
            // Non-ed25519 keys never reach here: the registry refuses them.
            spkis: keys.iter().filter_map(|k| spki_der(k).ok()).collect(),
            algorithms: provider().signature_verification_algorithms,
        }
    }
}

impl ServerCertVerifier for PinnedServer {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let cert = webpki::EndEntityCert::try_from(end_entity).map_err(|e| {
            rustls::Error::General(format!(
                "{}: the server's certificate does not parse ({e})",
                self.host
            ))
        })?;
        let spki = cert.subject_public_key_info();
        if self.spkis.iter().any(|k| k.as_slice() == spki.as_ref()) {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::General(format!(
                "the server's key is not one that hosts.json lists for {}",
                self.host
            )))
        }
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Err(rustls::Error::General("TLS 1.2 is not accepted".into()))
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        vec![SignatureScheme::ED25519]
    }
}

/// A client configuration that reaches `host` only: TLS 1.3, ALPN `http/1.1`, pinned.
pub fn client_config(host: &str, keys: &[PublicKey]) -> ClientConfig {
    let mut config = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("ring supports TLS 1.3")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(PinnedServer::new(host, keys)))
        .with_no_client_auth();
    config.alpn_protocols = vec![ALPN_HTTP11.to_vec()];
    config
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pin_matches_the_spki_layout_curl_expects() {
        let s = Signer::generate();
        let spki = spki_der(s.public_key()).unwrap();
        // docs/protocol.md §11.1: 12 fixed bytes, then the 32-byte key.
        assert_eq!(
            &spki[..12],
            &[0x30, 0x2a, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x03, 0x21, 0x00]
        );
        let raw = s.public_key().key_data().ed25519().unwrap();
        assert_eq!(&spki[12..], raw.as_ref());
        assert!(pin(s.public_key()).unwrap().starts_with("sha256//"));
    }

    #[test]
    fn server_config_builds_from_a_host_key() {
        let s = Signer::generate();
        let config = server_config(&s).unwrap();
        assert_eq!(config.alpn_protocols, vec![b"http/1.1".to_vec()]);
    }
}
