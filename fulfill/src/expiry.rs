//! When a payload stops being valid (docs/protocol.md §11.4): the earliest `notAfter` of
//! the X.509 certificates in a PEM payload, or a top-level `expires_at` (unix seconds) of
//! a JSON object payload. Anything else has no expiry.

/// The latest expiry taken as one: 9999-12-31T23:59:59Z. Beyond it (a certificate's
/// "no well-defined expiry", a hostile `expires_at` of 2^64 − 1) there is none.
pub const LATEST: u64 = 253_402_300_799;

/// The payload's expiry in unix seconds, if it has one.
pub fn expiry(payload: &[u8]) -> Option<u64> {
    let at = match pem_expiry(payload) {
        Some(at) => at,
        None => {
            let json: serde_json::Value = serde_json::from_slice(payload).ok()?;
            json.as_object()?.get("expires_at")?.as_u64()?
        }
    };
    (at < LATEST).then_some(at)
}

fn pem_expiry(payload: &[u8]) -> Option<u64> {
    const MARK: &[u8] = b"-----BEGIN CERTIFICATE-----";
    if !payload.windows(MARK.len()).any(|w| w == MARK) {
        return None;
    }
    x509_parser::pem::Pem::iter_from_buffer(payload)
        .filter_map(Result::ok)
        .filter(|pem| pem.label == "CERTIFICATE")
        .filter_map(|pem| {
            let (_, cert) = x509_parser::parse_x509_certificate(&pem.contents).ok()?;
            u64::try_from(cert.validity().not_after.timestamp()).ok()
        })
        .min()
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
    }
}
