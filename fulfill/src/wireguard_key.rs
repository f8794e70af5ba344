//! WireGuard keys made for needs (docs/protocol.md §11.10, `type: wireguard`): an X25519
//! key pair from the operating system's random source, its file written as `wg genkey`
//! prints a key (base64 of the 32 private bytes, then a newline) and its public half as
//! `wg pubkey` prints it. The provider never sees more than the public half; instead of a
//! certificate, its payload names that public key back.

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use x25519_dalek::{PublicKey, StaticSecret};

/// The DER prefix of an X25519 SubjectPublicKeyInfo (RFC 8410: id-X25519, 1.3.101.110),
/// before the 32 key bytes: how a file of the payload that held certificates would name
/// this key, had it one.
const SPKI_PREFIX: [u8; 12] = [
    0x30, 0x2a, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x6e, 0x03, 0x21, 0x00,
];

/// A WireGuard private key in memory (wiped when dropped).
pub(crate) struct WireguardKey(StaticSecret);

impl WireguardKey {
    pub(crate) fn generate() -> WireguardKey {
        WireguardKey(StaticSecret::random_from_rng(rand::rngs::OsRng))
    }

    /// A key as `wg genkey` writes it: base64 of 32 bytes, blanks around it ignored.
    pub(crate) fn from_text(text: &str) -> Result<WireguardKey, String> {
        let bytes = zeroize::Zeroizing::new(
            STANDARD
                .decode(text.trim().as_bytes())
                .map_err(|_| "not a WireGuard key (base64)".to_owned())?,
        );
        let raw: [u8; 32] = bytes
            .as_slice()
            .try_into()
            .map_err(|_| "not a WireGuard key (32 bytes)".to_owned())?;
        Ok(WireguardKey(StaticSecret::from(raw)))
    }

    /// The key file's content: what `wg set … private-key FILE` and networkd read.
    pub(crate) fn file_content(&self) -> Vec<u8> {
        let mut text = STANDARD.encode(self.0.as_bytes());
        text.push('\n');
        text.into_bytes()
    }

    pub(crate) fn public_raw(&self) -> [u8; 32] {
        PublicKey::from(&self.0).to_bytes()
    }

    /// The public key as `wg pubkey` prints it (without its newline).
    pub(crate) fn public_base64(&self) -> String {
        STANDARD.encode(self.public_raw())
    }

    pub(crate) fn spki(&self) -> Vec<u8> {
        let mut der = SPKI_PREFIX.to_vec();
        der.extend_from_slice(&self.public_raw());
        der
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_what_wg_reads() {
        let k = WireguardKey::generate();
        let file = k.file_content();
        assert_eq!(file.len(), 45, "44 base64 characters and a newline");
        assert!(file.ends_with(b"=\n"));
        let back = WireguardKey::from_text(std::str::from_utf8(&file).unwrap()).unwrap();
        assert_eq!(back.public_base64(), k.public_base64());
        assert_ne!(WireguardKey::generate().public_base64(), k.public_base64());
        assert_eq!(k.spki().len(), 44);
        assert!(WireguardKey::from_text("not base64!").is_err());
        assert!(WireguardKey::from_text(&STANDARD.encode([1u8; 31])).is_err());
        // RFC 7748 §6.1's test vector: Alice's private key and its public key.
        let alice = WireguardKey::from_text(
            &STANDARD.encode(
                hex::decode("77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a")
                    .unwrap(),
            ),
        )
        .unwrap();
        assert_eq!(
            hex::encode(alice.public_raw()),
            "8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a"
        );
    }
}
