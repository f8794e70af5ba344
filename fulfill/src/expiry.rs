//! When a payload stops being valid (docs/protocol.md §11.4): the earliest of the
//! `notAfter` of every X.509 certificate it carries (in a PEM payload, or in any string of
//! a JSON payload, at any depth) and a JSON object payload's top-level `expires_at` (unix
//! seconds). A provider's `expires_at` later than a certificate's own end never wins.
//! Anything else has no expiry.

/// The latest expiry taken as one: 9999-12-31T23:59:59Z. Beyond it (a certificate's
/// "no well-defined expiry", a hostile `expires_at` of 2^64 − 1) there is none.
pub const LATEST: u64 = 253_402_300_799;

/// The payload's expiry in unix seconds, if it has one.
pub fn expiry(payload: &[u8]) -> Option<u64> {
    let mut candidates = Vec::new();
    match serde_json::from_slice::<serde_json::Value>(payload) {
        Ok(json) => {
            // A JSON string escapes a PEM's newlines: the certificates are read from the
            // strings themselves.
            let mut texts = Vec::new();
            crate::certs::strings(&json, &mut texts);
            for text in &texts {
                candidates.extend(certificates_end(text.as_bytes()));
            }
            candidates.extend(
                json.as_object()
                    .and_then(|o| o.get("expires_at"))
                    .and_then(serde_json::Value::as_u64),
            );
        }
        Err(_) => candidates.extend(certificates_end(payload)),
    }
    candidates.into_iter().filter(|at| *at < LATEST).min()
}

/// The earliest end of the certificates in `text`; one that ended before 1970 ends at 0.
fn certificates_end(text: &[u8]) -> Option<u64> {
    crate::certs::earliest_not_after(text).map(|at| u64::try_from(at).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_and_garbage() {
        assert_eq!(
            expiry(br#"{"expires_at": 1800000000, "token": "t"}"#),
            Some(1800000000)
        );
        assert_eq!(expiry(br#"{"token": "t"}"#), None);
        assert_eq!(expiry(b"OK"), None);
        assert_eq!(
            expiry(b"-----BEGIN CERTIFICATE-----\ngarbage\n-----END CERTIFICATE-----\n"),
            None
        );
    }

    #[test]
    fn a_generated_certificate() {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(vec!["x.test".into()]).unwrap();
        params.not_after = rcgen::date_time_ymd(2031, 5, 6);
        let cert = params.self_signed(&key).unwrap();
        let pem = format!("{}{}", cert.pem(), key.serialize_pem());
        let at = expiry(pem.as_bytes()).unwrap();
        assert_eq!(at, 1_935_792_000, "2031-05-06T00:00:00Z");
        // In a JSON payload, at any depth, whatever `expires_at` claims later.
        let json = serde_json::json!({"expires_at": 2_000_000_000u64,
                                      "bundle": [{"certificate": cert.pem()}]});
        assert_eq!(expiry(json.to_string().as_bytes()), Some(1_935_792_000));
        let json = serde_json::json!({"expires_at": 1_800_000_000u64, "certificate": cert.pem()});
        assert_eq!(expiry(json.to_string().as_bytes()), Some(1_800_000_000));
        let json = serde_json::json!({"certificate": cert.pem()});
        assert_eq!(expiry(json.to_string().as_bytes()), Some(1_935_792_000));
    }
}
