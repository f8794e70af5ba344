//! X.509 certificates in payloads and delivered files, found where OpenSSL finds them
//! (docs/protocol.md §11.10): a certificate block starts wherever a
//! `-----BEGIN CERTIFICATE-----` line (or `X509 CERTIFICATE`, `TRUSTED CERTIFICATE`, which
//! OpenSSL reads as certificates too) is, whatever comes before it, so text in front of a
//! certificate hides nothing from these checks that a server would read.

use x509_parser::certificate::X509Certificate;

/// The labels OpenSSL reads a certificate from (nginx reads the first certificate of a
/// file with `PEM_read_bio_X509_AUX`, which takes all three).
const LABELS: [&[u8]; 3] = [b"CERTIFICATE", b"X509 CERTIFICATE", b"TRUSTED CERTIFICATE"];

/// Longest label looked at: anything longer is no label.
const MAX_LABEL: usize = 64;

/// How far issuers are followed from a certificate.
const MAX_CHAIN: usize = 8;

/// Most signatures checked while following issuers, however many certificates share a name.
const MAX_SIGNATURE_CHECKS: usize = 64;

/// A clock-skew allowance: a certificate whose `notBefore` is at most this far ahead of
/// the host's clock is taken as valid (a CA's clock a little ahead of the host's).
pub const NOT_BEFORE_SKEW: i64 = 300;

/// One certificate block of a text: its DER, or why it cannot be read.
type Block = Result<Vec<u8>, String>;

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Every certificate block of `text`, in order. A block begins where a certificate
/// label's `-----BEGIN …-----` is followed by nothing but blanks up to the end of its line
/// (OpenSSL reads a header so, and also finds one in the middle of a line longer than its
/// line buffer; so this looks everywhere, not only at line starts); its body runs to the
/// matching `-----END …-----` and must be base64 of an X.509 certificate.
fn scan(text: &[u8]) -> Vec<Block> {
    const BEGIN: &[u8] = b"-----BEGIN ";
    const DASHES: &[u8] = b"-----";
    let mut out = Vec::new();
    let mut pos = 0;
    while let Some(i) = find(&text[pos..], BEGIN) {
        let start = pos + i;
        pos = start + 1;
        let after = start + BEGIN.len();
        let window = &text[after..text.len().min(after + MAX_LABEL + DASHES.len())];
        let Some(j) = find(window, DASHES) else {
            continue;
        };
        let label = &window[..j];
        if !LABELS.contains(&label) {
            continue;
        }
        let header_end = after + j + DASHES.len();
        let line_end = text[header_end..]
            .iter()
            .position(|&b| b == b'\n')
            .map_or(text.len(), |k| header_end + k);
        if text[header_end..line_end].iter().any(|&b| b > b' ') {
            continue;
        }
        let n = out.len() + 1;
        let mut end_line = b"-----END ".to_vec();
        end_line.extend_from_slice(label);
        end_line.extend_from_slice(DASHES);
        let Some(k) = find(&text[line_end..], &end_line) else {
            out.push(Err(format!("certificate {n} has no END line")));
            break;
        };
        let body: Vec<u8> = text[line_end..line_end + k]
            .iter()
            .copied()
            .filter(|b| !b.is_ascii_whitespace())
            .collect();
        pos = line_end + k + end_line.len();
        use base64::Engine;
        let block = match base64::engine::general_purpose::STANDARD.decode(&body) {
            Err(_) => Err(format!("certificate {n} is not base64")),
            Ok(der) => match x509_parser::parse_x509_certificate(&der) {
                Ok(_) => Ok(der),
                Err(e) => Err(format!("certificate {n} does not parse ({e})")),
            },
        };
        out.push(block);
    }
    out
}

/// Every certificate in `text` as DER, in order; an error names the first block that
/// cannot be read (a server would stop there, or worse, skip it).
pub(crate) fn all(text: &[u8]) -> Result<Vec<Vec<u8>>, String> {
    scan(text).into_iter().collect()
}

/// The certificates of `text` that can be read; the others are passed over.
pub(crate) fn readable(text: &[u8]) -> impl Iterator<Item = Vec<u8>> {
    scan(text).into_iter().filter_map(Result::ok)
}

/// A certificate that `all` or `readable` returned.
pub(crate) fn parse(der: &[u8]) -> X509Certificate<'_> {
    x509_parser::parse_x509_certificate(der)
        .map(|(_, c)| c)
        .expect("only certificates that parse are returned")
}

/// Every string in a JSON value, at any depth.
pub(crate) fn strings(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::String(s) => out.push(s.clone()),
        serde_json::Value::Array(a) => a.iter().for_each(|v| strings(v, out)),
        serde_json::Value::Object(o) => o.values().for_each(|v| strings(v, out)),
        _ => {}
    }
}

/// The certificates that issued `leaf` (DER), nearest first: followed from `leaf` through
/// `pool`, each one's subject the previous one's issuer and its key verifying the previous
/// one's signature, until a self-issued one, one not in `pool`, or [`MAX_CHAIN`].
pub(crate) fn issuers<'a>(leaf: &[u8], pool: &'a [Vec<u8>]) -> Vec<&'a [u8]> {
    let parsed: Vec<X509Certificate<'_>> = pool.iter().map(|der| parse(der)).collect();
    let mut chain: Vec<&'a [u8]> = Vec::new();
    let mut checks = 0;
    let mut current = parse(leaf);
    for _ in 0..MAX_CHAIN {
        if current.subject().as_raw() == current.issuer().as_raw() {
            break;
        }
        let found = parsed.iter().zip(pool).find(|(candidate, der)| {
            if candidate.subject().as_raw() != current.issuer().as_raw()
                || chain.contains(&der.as_slice())
                || checks >= MAX_SIGNATURE_CHECKS
            {
                return false;
            }
            checks += 1;
            current
                .verify_signature(Some(candidate.public_key()))
                .is_ok()
        });
        let Some((_, der)) = found else {
            break;
        };
        chain.push(der.as_slice());
        current = parse(der);
    }
    chain
}

/// Every file that holds certificates must start with one for a key of the need
/// (`keys`, SubjectPublicKeyInfo), valid now, or with one that issued a key's certificate
/// (`leaves`), verified by its signature among the certificates the payload carries
/// (a `chain` starts with the issuer): a provider cannot pair a matching `certificate`
/// with a `fullchain` for another key. And every certificate in such a file must parse.
pub(crate) fn check_files(
    files: &[fort_core::schema::FileSpec],
    json: &serde_json::Value,
    payload: &[u8],
    keys: &[Vec<u8>],
    leaves: &[Vec<u8>],
    now: i64,
) -> Result<(), String> {
    let mut pool = Vec::new();
    let mut texts = Vec::new();
    strings(json, &mut texts);
    for text in &texts {
        pool.extend(readable(text.as_bytes()));
    }
    let issuers: Vec<&[u8]> = leaves
        .iter()
        .flat_map(|leaf| issuers(leaf, &pool))
        .collect();
    for f in files {
        // A pointer with nothing at it is reported when the files are written.
        let Ok(content) = crate::files::content(payload, &f.pointer) else {
            continue;
        };
        let label = f.label();
        let found = all(&content).map_err(|e| format!("file {label}: {e}; not installed"))?;
        let Some(first) = found.first() else {
            continue;
        };
        let cert = parse(first);
        if keys.iter().any(|k| cert.public_key().raw == k.as_slice()) {
            check_validity(&cert, now).map_err(|e| {
                format!("file {label}: its certificate for the need's key {e}; not installed")
            })?;
        } else if !issuers.contains(&first.as_slice()) {
            return Err(format!(
                "file {label} starts with a certificate that is neither for a key of the need nor one that issued its certificate; not installed"
            ));
        }
    }
    Ok(())
}

/// Unix seconds for a reason line (before 1970 counts as 1970).
fn when(at: i64) -> String {
    crate::status::when(u64::try_from(at).unwrap_or(0))
}

/// Whether a certificate is valid at `now` (unix seconds): `Err` says why not.
pub(crate) fn check_validity(cert: &X509Certificate<'_>, now: i64) -> Result<(), String> {
    let validity = cert.validity();
    check_window(
        validity.not_before.timestamp(),
        validity.not_after.timestamp(),
        now,
    )
}

/// Whether `not_before ..= not_after` (unix seconds) holds `now`, with the allowance for
/// a clock a little behind the issuer's.
pub(crate) fn check_window(not_before: i64, not_after: i64, now: i64) -> Result<(), String> {
    if not_after <= now {
        return Err(format!("expired at {}", when(not_after)));
    }
    if not_before > now.saturating_add(NOT_BEFORE_SKEW) {
        return Err(format!("is not valid before {}", when(not_before)));
    }
    Ok(())
}

/// The earliest `notAfter` of the certificates that can be read in `text`.
pub(crate) fn earliest_not_after(text: &[u8]) -> Option<i64> {
    readable(text)
        .map(|der| parse(&der).validity().not_after.timestamp())
        .min()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};

    fn ca(name: &str) -> (Issuer<'static, KeyPair>, String) {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let pem = params.self_signed(&key).unwrap().pem();
        (Issuer::new(params, key), pem)
    }

    fn leaf(issuer: &Issuer<'static, KeyPair>) -> String {
        let key = KeyPair::generate().unwrap();
        CertificateParams::new(vec!["x.test".to_owned()])
            .unwrap()
            .signed_by(&key, issuer)
            .unwrap()
            .pem()
    }

    #[test]
    fn blocks_are_found_where_openssl_finds_them() {
        let (issuer, root) = ca("root");
        let cert = leaf(&issuer);
        // Text before, between and after: passed over.
        let text = format!("subject=x.test\n{cert}issuer=root\n{root}trailer");
        let found = all(text.as_bytes()).unwrap();
        assert_eq!(found.len(), 2);
        assert_eq!(
            parse(&found[1]).subject().as_raw(),
            parse(&found[0]).issuer().as_raw()
        );
        // In the middle of a line (past OpenSSL's line buffer), with CRLF and trailing
        // blanks: still a block.
        let crlf = cert
            .replace('\n', "\r\n")
            .replacen("-----\r\n", "-----  \r\n", 1);
        let text = format!("{}{crlf}", "x".repeat(300));
        assert_eq!(all(text.as_bytes()).unwrap().len(), 1);
        // TRUSTED CERTIFICATE is a certificate to OpenSSL.
        let trusted = cert.replace(" CERTIFICATE-----", " TRUSTED CERTIFICATE-----");
        assert_eq!(all(trusted.as_bytes()).unwrap().len(), 1);
        // A header followed by more text on its line (a JSON string's escaped newline)
        // is not one; neither is a request.
        let json = serde_json::to_string(&cert).unwrap();
        assert!(all(json.as_bytes()).unwrap().is_empty());
        let csr = "-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n";
        assert!(all(csr.as_bytes()).unwrap().is_empty());
    }

    #[test]
    fn a_block_that_does_not_parse_is_an_error() {
        let (issuer, _) = ca("root");
        let cert = leaf(&issuer);
        for bad in [
            "-----BEGIN CERTIFICATE-----\nMIIBAAECAwQ=\n-----END CERTIFICATE-----\n",
            "-----BEGIN CERTIFICATE-----\n%%%\n-----END CERTIFICATE-----\n",
            "-----BEGIN CERTIFICATE-----\nMIIB\n",
        ] {
            let text = format!("{bad}{cert}");
            let err = all(text.as_bytes()).unwrap_err();
            assert!(err.starts_with("certificate 1 "), "{err}");
            assert_eq!(
                readable(text.as_bytes()).count(),
                usize::from(!bad.ends_with("MIIB\n"))
            );
        }
    }

    #[test]
    fn issuers_are_followed_by_signature_not_by_name() {
        let (root, root_pem) = ca("root");
        // An intermediate signed by the root.
        let inter_key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params
            .distinguished_name
            .push(DnType::CommonName, "intermediate");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let inter_pem = params.signed_by(&inter_key, &root).unwrap().pem();
        let inter = Issuer::new(params, inter_key);
        let cert = leaf(&inter);
        // A stranger with the intermediate's name but another key: never an issuer.
        let (_, impostor) = ca("intermediate");
        let pool = all(format!("{impostor}{root_pem}{inter_pem}").as_bytes()).unwrap();
        let leaf_der = all(cert.as_bytes()).unwrap().remove(0);
        let chain = issuers(&leaf_der, &pool);
        assert_eq!(chain, vec![pool[2].as_slice(), pool[1].as_slice()]);
    }

    #[test]
    fn validity_with_the_allowance() {
        assert!(check_window(0, 100, 50).is_ok());
        assert!(check_window(0, 100, 100)
            .unwrap_err()
            .starts_with("expired at 1970"));
        assert!(check_window(50 + NOT_BEFORE_SKEW, 10_000, 50).is_ok());
        assert!(check_window(51 + NOT_BEFORE_SKEW, 10_000, 50)
            .unwrap_err()
            .starts_with("is not valid before"));
        assert!(check_window(i64::MIN, i64::MIN, i64::MAX).is_err());
    }
}
