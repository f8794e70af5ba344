//! The exact bytes that are signed (docs/protocol.md §3 and §4). Both sides build them
//! themselves; nothing here is ever parsed back.

use sha2::{Digest, Sha256};

/// SSHSIG namespace for every fort signature.
pub const NAMESPACE: &str = "fort-agent";

/// Lower-case hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex_lower(&Sha256::digest(bytes))
}

/// Lower-case hex of a digest. `hex::encode` goes through a `char` iterator; hashes are
/// taken per record, per payload and per request, so this one fills a buffer of the
/// right length at once.
pub fn hex_lower(digest: &[u8]) -> String {
    let mut out = vec![0u8; digest.len() * 2];
    hex::encode_to_slice(digest, &mut out).expect("the buffer is twice the input");
    String::from_utf8(out).expect("hex digits are ASCII")
}

/// The manifest hash of §11.7: SHA-256 of `hosts.json`, `\n`, `needs.json`, `\n`,
/// `capabilities.json`, each as the bytes loaded (an absent file is empty).
pub fn manifest_sha256(hosts: &[u8], needs: &[u8], capabilities: &[u8]) -> String {
    let mut h = Sha256::new();
    h.update(hosts);
    h.update(b"\n");
    h.update(needs);
    h.update(b"\n");
    h.update(capabilities);
    hex_lower(&h.finalize())
}

/// The eight-line request string of §3.
pub fn request_bytes(
    target: &str,
    path: &str,
    origin: &str,
    timestamp: &str,
    nonce: &str,
    body: &[u8],
) -> Vec<u8> {
    format!(
        "fort-agent-v1\nPOST\n{target}\n{path}\n{origin}\n{timestamp}\n{nonce}\n{}\n",
        sha256_hex(body)
    )
    .into_bytes()
}

/// The five-line response string of §4.
pub fn response_bytes(responder: &str, nonce: &str, status: u16, body: &[u8]) -> Vec<u8> {
    format!(
        "fort-agent-v1-response\n{responder}\n{nonce}\n{status}\n{}\n",
        sha256_hex(body)
    )
    .into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_is_lower_case_as_hex_encode_writes_it() {
        let bytes: Vec<u8> = (0..=255).collect();
        assert_eq!(hex_lower(&bytes), hex::encode(&bytes));
        assert_eq!(hex_lower(&[]), "");
    }

    #[test]
    fn the_manifest_hash_example_of_the_protocol_document() {
        let hosts = br#"{"hosts":{"forge":{"address":"https://10.0.0.1:7770","keys":["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAID1AF8PoQ4lakrcKp00bfrycmCzPLsSWjMDNVfEq9GYM"]}}}"#;
        assert_eq!(
            manifest_sha256(hosts, b"", b""),
            "98489afa3d9c22f45e581575dfacbd9b57258bdf69d7f6bf2646ebc5fe412fbc"
        );
    }

    #[test]
    fn manifest_hash_joins_the_three_files_with_newlines() {
        assert_eq!(
            manifest_sha256(b"{\"hosts\":{}}", b"", b"{}"),
            sha256_hex(b"{\"hosts\":{}}\n\n{}")
        );
    }

    #[test]
    fn request_layout() {
        let b = request_bytes("forge", "/agent/needs", "app", "1700000000", "ab", b"{}");
        let s = String::from_utf8(b).unwrap();
        assert_eq!(s.lines().count(), 8);
        assert!(s.ends_with(&format!("{}\n", sha256_hex(b"{}"))));
        assert!(s.starts_with("fort-agent-v1\nPOST\nforge\n/agent/needs\napp\n"));
    }
}
