//! Keys the consumer makes for its needs (docs/protocol.md §11.10). A key is made here,
//! kept as the need's *next* key in the agent's own directory until a certificate for it
//! arrives, then installed at its path together with the payload's files. Requests carry
//! only its public half or a CSR; a payload whose certificate is for another key is not
//! applied. A WireGuard key has no certificate: its payload names its public key back
//! (`crate::wireguard_key`).

use std::collections::BTreeMap;
use std::io::Read;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use ed25519_dalek::pkcs8::{DecodePrivateKey, EncodePrivateKey};
use fort_core::canonical::sha256_hex;
use fort_core::names::NeedKey;
use fort_core::schema::keys::{KeyForm, KeyFormat, KeySpec, KeyType};
use fort_core::schema::{FileSpec, NeedSpec};
use rcgen::{CertificateParams, DistinguishedName, DnType, KeyPair, PublicKeyData};
use serde::{Deserialize, Serialize};

use crate::safe_path::{open_parent, open_regular};
use crate::wireguard_key::WireguardKey;

/// A key file larger than this is not one fort wrote.
const MAX_KEY_FILE: u64 = 64 * 1024;

/// What the need's state keeps about a key: its public half and the CSR made with it,
/// so that every request carries the same bytes (an ECDSA signature differs each time).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct KeyRecord {
    /// SHA-256 of the raw public key the CSR was made with.
    pub public_sha256: String,
    /// The names the CSR was made for.
    pub names: Vec<String>,
    /// The CSR, PEM.
    pub csr: String,
}

/// A private key in memory.
pub(crate) struct Material {
    pair: Pair,
    key_type: KeyType,
}

/// The key itself: one that signs (a CSR, a certificate's key), or a WireGuard key,
/// which signs nothing and has no certificate.
enum Pair {
    Signing(Box<KeyPair>),
    Wireguard(WireguardKey),
}

fn algorithm(t: KeyType) -> Result<&'static rcgen::SignatureAlgorithm, String> {
    match t {
        KeyType::EcdsaP256 => Ok(&rcgen::PKCS_ECDSA_P256_SHA256),
        KeyType::Ed25519 => Ok(&rcgen::PKCS_ED25519),
        KeyType::Rsa2048 | KeyType::Rsa3072 => Ok(&rcgen::PKCS_RSA_SHA256),
        KeyType::Wireguard => Err("a wireguard key signs nothing".to_owned()),
    }
}

/// The modulus of an RSA public key (PKCS#1 DER), in bits.
fn rsa_bits(public: &[u8]) -> Option<usize> {
    use rsa::pkcs1::DecodeRsaPublicKey;
    use rsa::traits::PublicKeyParts;
    rsa::RsaPublicKey::from_pkcs1_der(public)
        .ok()
        .map(|k| k.size() * 8)
}

impl Material {
    /// A new key from the operating system's random source (ring).
    pub(crate) fn generate(t: KeyType) -> Result<Material, String> {
        if t == KeyType::Wireguard {
            return Ok(Material {
                pair: Pair::Wireguard(WireguardKey::generate()),
                key_type: t,
            });
        }
        let failed = |e: String| format!("cannot make a {} key: {e}", t.as_str());
        let pair = match t.rsa_bits() {
            // ring signs with RSA keys but does not make them: the rsa crate does, from
            // the operating system's random source.
            Some(bits) => {
                use rsa::pkcs8::EncodePrivateKey;
                let key = rsa::RsaPrivateKey::new(&mut rsa::rand_core::OsRng, bits)
                    .map_err(|e| failed(e.to_string()))?;
                let der = key.to_pkcs8_der().map_err(|e| failed(e.to_string()))?;
                KeyPair::from_pkcs8_der_and_sign_algo(
                    &rustls_pki_types::PrivatePkcs8KeyDer::from(der.as_bytes()),
                    algorithm(t)?,
                )
                .map_err(|e| failed(e.to_string()))?
            }
            None => KeyPair::generate_for(algorithm(t)?).map_err(|e| failed(e.to_string()))?,
        };
        Ok(Material {
            pair: Pair::Signing(Box::new(pair)),
            key_type: t,
        })
    }

    /// A key as it is kept (the next key): PKCS#8 PEM, which must be of type `t`; a
    /// WireGuard key as its file holds it.
    fn from_pem(t: KeyType, pem: &str) -> Result<Material, String> {
        if t == KeyType::Wireguard {
            return Ok(Material {
                pair: Pair::Wireguard(WireguardKey::from_text(pem)?),
                key_type: t,
            });
        }
        let pair = KeyPair::from_pkcs8_pem_and_sign_algo(pem, algorithm(t)?)
            .map_err(|e| format!("not a PKCS#8 {} key: {e}", t.as_str()))?;
        if t.rsa_bits()
            .is_some_and(|bits| rsa_bits(pair.der_bytes()) != Some(bits))
        {
            return Err(format!("not an {} key", t.as_str()));
        }
        Ok(Material {
            pair: Pair::Signing(Box::new(pair)),
            key_type: t,
        })
    }

    /// The signing key pair (every type but `wireguard`).
    fn signing(&self) -> Result<&KeyPair, String> {
        match &self.pair {
            Pair::Signing(pair) => Ok(pair.as_ref()),
            Pair::Wireguard(_) => Err("a wireguard key signs nothing".to_owned()),
        }
    }

    /// A key as it was installed, in `format`.
    fn from_file(t: KeyType, format: KeyFormat, bytes: &[u8]) -> Result<Material, String> {
        let text = std::str::from_utf8(bytes).map_err(|_| "not a key file".to_owned())?;
        if t == KeyType::Wireguard {
            return Material::from_pem(t, text);
        }
        match format {
            KeyFormat::Pem => Material::from_pem(t, text),
            KeyFormat::Openssh => {
                let key = ssh_key::PrivateKey::from_openssh(text)
                    .map_err(|e| format!("not an OpenSSH key: {e}"))?;
                let pair = key
                    .key_data()
                    .ed25519()
                    .ok_or_else(|| "not an ed25519 key".to_owned())?;
                let signing = ed25519_dalek::SigningKey::from_bytes(&pair.private.to_bytes());
                let der = signing
                    .to_pkcs8_der()
                    .map_err(|e| format!("cannot encode the key: {e}"))?;
                let pair = KeyPair::try_from(der.as_bytes())
                    .map_err(|e| format!("cannot read the key: {e}"))?;
                Ok(Material {
                    pair: Pair::Signing(Box::new(pair)),
                    key_type: t,
                })
            }
        }
    }

    /// The private key as PKCS#8 PEM (how the next key is kept); a WireGuard key as its
    /// file holds it.
    fn pem(&self) -> String {
        match &self.pair {
            Pair::Signing(pair) => pair.serialize_pem(),
            Pair::Wireguard(key) => String::from_utf8_lossy(&key.file_content()).into_owned(),
        }
    }

    /// The private key file's content in `format` (a WireGuard key's is always `wg`'s).
    pub(crate) fn file_content(&self, format: KeyFormat) -> Result<Vec<u8>, String> {
        if let Pair::Wireguard(key) = &self.pair {
            return Ok(key.file_content());
        }
        match format {
            KeyFormat::Pem => Ok(self.pem().into_bytes()),
            KeyFormat::Openssh => {
                let signing =
                    ed25519_dalek::SigningKey::from_pkcs8_der(self.signing()?.serialized_der())
                        .map_err(|e| format!("not an ed25519 key: {e}"))?;
                let pair = ssh_key::private::Ed25519Keypair::from_seed(&signing.to_bytes());
                let key = ssh_key::PrivateKey::from(pair);
                let text = key
                    .to_openssh(ssh_key::LineEnding::LF)
                    .map_err(|e| format!("cannot encode the key: {e}"))?;
                Ok(text.as_bytes().to_vec())
            }
        }
    }

    fn public_raw(&self) -> Vec<u8> {
        match &self.pair {
            Pair::Signing(pair) => pair.der_bytes().to_vec(),
            Pair::Wireguard(key) => key.public_raw().to_vec(),
        }
    }

    fn public_sha256(&self) -> String {
        sha256_hex(&self.public_raw())
    }

    fn ssh_public(&self) -> Result<ssh_key::public::KeyData, String> {
        let raw = &self.public_raw()[..];
        match self.key_type {
            KeyType::Ed25519 => {
                let bytes: [u8; 32] = raw
                    .try_into()
                    .map_err(|_| "an ed25519 public key is 32 bytes".to_owned())?;
                Ok(ssh_key::public::KeyData::Ed25519(
                    ssh_key::public::Ed25519PublicKey(bytes),
                ))
            }
            KeyType::EcdsaP256 => ssh_key::public::EcdsaPublicKey::from_sec1_bytes(raw)
                .map(ssh_key::public::KeyData::Ecdsa)
                .map_err(|e| format!("not a P-256 point: {e}")),
            KeyType::Rsa2048 | KeyType::Rsa3072 => {
                use rsa::pkcs1::DecodeRsaPublicKey;
                use rsa::traits::PublicKeyParts;
                let key = rsa::RsaPublicKey::from_pkcs1_der(raw)
                    .map_err(|e| format!("not an RSA public key: {e}"))?;
                let mpint = |b: &[u8]| {
                    ssh_key::Mpint::from_positive_bytes(b)
                        .map_err(|e| format!("cannot encode the RSA key: {e}"))
                };
                Ok(ssh_key::public::KeyData::Rsa(
                    ssh_key::public::RsaPublicKey {
                        e: mpint(&key.e().to_bytes_be())?,
                        n: mpint(&key.n().to_bytes_be())?,
                    },
                ))
            }
            KeyType::Wireguard => Err("a wireguard key has no OpenSSH form".to_owned()),
        }
    }

    /// The public key as an OpenSSH line, without a comment.
    fn openssh(&self) -> Result<String, String> {
        ssh_key::PublicKey::new(self.ssh_public()?, "")
            .to_openssh()
            .map_err(|e| format!("cannot encode the public key: {e}"))
    }

    /// A PKCS#10 request for `names`; the first is the common name.
    fn csr(&self, names: &[String]) -> Result<String, String> {
        let mut params = CertificateParams::new(names.to_vec())
            .map_err(|e| format!("cannot make a CSR for {names:?}: {e}"))?;
        let mut dn = DistinguishedName::new();
        if let Some(first) = names.first() {
            dn.push(DnType::CommonName, first.as_str());
        }
        params.distinguished_name = dn;
        params
            .serialize_request(self.signing()?)
            .and_then(|csr| csr.pem())
            .map_err(|e| format!("cannot make a CSR: {e}"))
    }

    /// Whether `certificate` (PEM X.509 certificates, the first one counting, or an
    /// OpenSSH certificate) is for this key.
    #[cfg(test)]
    fn certifies(&self, certificate: &str) -> Result<bool, String> {
        Certificate::read(certificate)?.certifies(self)
    }

    /// The key's SubjectPublicKeyInfo: the algorithm and curve too, not only the key's
    /// bits (an X25519 key has the same 32 bytes as an ed25519 one).
    fn spki(&self) -> Vec<u8> {
        match &self.pair {
            Pair::Signing(pair) => pair.subject_public_key_info(),
            Pair::Wireguard(key) => key.spki(),
        }
    }

    /// The public key as a `public` reference stands for it: PEM SubjectPublicKeyInfo, or
    /// a WireGuard key's base64 (`wg pubkey`).
    fn public_text(&self) -> String {
        match &self.pair {
            Pair::Signing(pair) => pair.public_key_pem(),
            Pair::Wireguard(key) => key.public_base64(),
        }
    }
}

/// A key's certificate, as the payload carries it at the key's `certificate` pointer.
enum Certificate {
    /// PEM X.509 certificates (DER), the first one the key's.
    X509(Vec<Vec<u8>>),
    Openssh(Box<ssh_key::Certificate>),
    /// For a key the provider authorizes rather than certifies (`authorized`): the
    /// public key it says it authorized. No validity window: the provider's record of
    /// the key is what lapses.
    Authorized(ssh_key::public::KeyData),
}

impl Certificate {
    /// What the payload carries for `spec`'s key.
    fn for_key(spec: &KeySpec, text: &str) -> Result<Certificate, String> {
        if !spec.authorized {
            return Certificate::read(text);
        }
        ssh_key::PublicKey::from_openssh(text.trim())
            .map(|k| Certificate::Authorized(k.key_data().clone()))
            .map_err(|_| {
                "it is not an OpenSSH public key line (the key is authorized, not certified)"
                    .to_owned()
            })
    }

    fn read(text: &str) -> Result<Certificate, String> {
        let pem = crate::certs::all(text.as_bytes())?;
        if !pem.is_empty() {
            return Ok(Certificate::X509(pem));
        }
        ssh_key::Certificate::from_openssh(text.trim())
            .map(|c| Certificate::Openssh(Box::new(c)))
            .map_err(|_| {
                "it is neither a PEM X.509 certificate nor an OpenSSH certificate".to_owned()
            })
    }

    /// The X.509 certificate for the key.
    fn leaf(&self) -> Option<&[u8]> {
        match self {
            Certificate::X509(pem) => pem.first().map(Vec::as_slice),
            Certificate::Openssh(_) | Certificate::Authorized(_) => None,
        }
    }

    fn certifies(&self, m: &Material) -> Result<bool, String> {
        match self {
            Certificate::X509(_) => {
                let leaf = self.leaf().expect("at least one certificate");
                Ok(crate::certs::parse(leaf).public_key().raw == m.spki().as_slice())
            }
            Certificate::Openssh(cert) => Ok(*cert.public_key() == m.ssh_public()?),
            Certificate::Authorized(key) => Ok(*key == m.ssh_public()?),
        }
    }

    /// Whether it is valid at `now` (unix seconds); `Err` says why not.
    fn check_validity(&self, now: i64) -> Result<(), String> {
        match self {
            Certificate::X509(_) => crate::certs::check_validity(
                &crate::certs::parse(self.leaf().expect("at least one certificate")),
                now,
            ),
            Certificate::Openssh(cert) => {
                let unix = |t: u64| i64::try_from(t).unwrap_or(i64::MAX);
                crate::certs::check_window(unix(cert.valid_after()), unix(cert.valid_before()), now)
            }
            Certificate::Authorized(_) => Ok(()),
        }
    }
}

/// Where next keys are kept: the agent's own directory, 0700, one 0600 file per key.
#[derive(Debug, Clone)]
pub(crate) struct KeyStore {
    dir: PathBuf,
}

impl KeyStore {
    pub(crate) fn new(dir: PathBuf) -> KeyStore {
        KeyStore { dir }
    }

    /// `<type>.<id>.<key name>.pem`: need types and ids have no `.`, so the name reads
    /// back as one need and key.
    fn next_path(&self, need: &NeedKey, name: &str) -> PathBuf {
        self.dir
            .join(format!("{}.{}.{name}.pem", need.kind(), need.id()))
    }

    fn load_next(&self, need: &NeedKey, name: &str, t: KeyType) -> Option<Material> {
        let path = self.next_path(need, name);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .ok()?;
        let mut text = String::new();
        file.take(MAX_KEY_FILE).read_to_string(&mut text).ok()?;
        match Material::from_pem(t, &text) {
            Ok(m) => Some(m),
            Err(e) => {
                // A key of another type (the declaration changed) or a damaged file: a new
                // one is made in its place.
                tracing::info!(need = %need, key = name, error = %e, "next key not usable; making a new one");
                None
            }
        }
    }

    fn save_next(&self, need: &NeedKey, name: &str, m: &Material) -> Result<(), String> {
        std::fs::DirBuilder::new()
            .mode(0o700)
            .recursive(true)
            .create(&self.dir)
            .map_err(|e| format!("cannot create {}: {e}", self.dir.display()))?;
        let path = self.next_path(need, name);
        fort_core::store::write_atomic_at(
            &path,
            m.pem().as_bytes(),
            Some(fort_core::crash::replace_temp("keys.write.temp")),
        )
        .map_err(|e| format!("cannot keep the new key in {}: {e}", path.display()))
    }

    /// Forgets the next key once it is installed (or the need is gone).
    pub(crate) fn remove_next(&self, need: &NeedKey, name: &str) {
        let path = self.next_path(need, name);
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(file = %path.display(), error = %e, "cannot remove a next key")
            }
        }
    }

    /// Removes next keys (and leftover temporary files) no declared need and key owns.
    pub(crate) fn remove_undeclared(&self, needs: &fort_core::schema::Needs) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        let mine = format!(".tmp.{}.", std::process::id());
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            let keep = if name.starts_with('.') {
                // A temporary file of this process may be being written right now.
                name.contains(&mine)
            } else {
                name.strip_suffix(".pem")
                    .and_then(|rest| {
                        let mut parts = rest.splitn(3, '.');
                        let (kind, id, key) = (parts.next()?, parts.next()?, parts.next()?);
                        let need = NeedKey::parse(&format!("{kind}/{id}"))?;
                        Some(needs.get(&need)?.keys.contains_key(key))
                    })
                    .unwrap_or(false)
            };
            if !keep {
                let path = entry.path();
                match std::fs::remove_file(&path) {
                    Ok(()) => {
                        tracing::info!(file = %path.display(), "removed a key no need declares")
                    }
                    Err(e) => {
                        tracing::warn!(file = %path.display(), error = %e, "cannot remove a key no need declares")
                    }
                }
            }
        }
    }

    /// Forgets every next key of a need that is gone.
    pub(crate) fn remove_need(&self, need: &NeedKey) {
        let prefix = format!("{}.{}.", need.kind(), need.id());
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            if let Some(key) = name
                .strip_prefix(&prefix)
                .and_then(|r| r.strip_suffix(".pem"))
            {
                self.remove_next(need, key);
            }
        }
    }
}

/// The key installed at `spec.path`, if the file there still holds exactly what was
/// written (`recorded`, its SHA-256 in the need's state): a key someone else put there is
/// never used or trusted.
fn installed(spec: &KeySpec, recorded: Option<&String>) -> Option<(Material, Vec<u8>)> {
    let recorded = recorded?;
    let (dir, name) = open_parent(&spec.path, false).ok()?;
    let (fd, stat) = open_regular(&dir, name).ok()??;
    if stat.st_size < 0 || stat.st_size as u64 > MAX_KEY_FILE {
        return None;
    }
    let mut bytes = Vec::new();
    std::fs::File::from(fd)
        .take(MAX_KEY_FILE)
        .read_to_end(&mut bytes)
        .ok()?;
    if sha256_hex(&bytes) != *recorded {
        return None;
    }
    let m = Material::from_file(spec.key_type, spec.format, &bytes).ok()?;
    Some((m, bytes))
}

/// The keys a request is built with, one per declared key: the next key if there is one;
/// else the installed key, unless this is a renewal that wants a new key; else a new key,
/// kept as the next one before any request carries it.
pub(crate) fn for_request(
    store: &KeyStore,
    need: &NeedKey,
    spec: &NeedSpec,
    files: &BTreeMap<String, String>,
    renewal: bool,
) -> Result<BTreeMap<String, Material>, String> {
    let mut out = BTreeMap::new();
    for (name, k) in &spec.keys {
        let m = match store.load_next(need, name, k.key_type) {
            Some(m) => m,
            None => {
                let current = (!renewal || k.reuse)
                    .then(|| installed(k, files.get(&k.path.display().to_string())))
                    .flatten();
                match current {
                    Some((m, _)) => m,
                    None => {
                        let m = Material::generate(k.key_type)?;
                        store.save_next(need, name, &m)?;
                        tracing::info!(need = %need, key = name.as_str(), "made a new {} key", k.key_type.as_str());
                        m
                    }
                }
            }
        };
        out.insert(name.clone(), m);
    }
    Ok(out)
}

/// The string a `$fort_key` reference stands for. A CSR is taken from `records` when it
/// was made with this key for these names, else made and recorded there.
pub(crate) fn form(
    name: &str,
    spec: &KeySpec,
    m: &Material,
    form: KeyForm,
    records: &mut BTreeMap<String, KeyRecord>,
) -> Result<String, String> {
    match form {
        KeyForm::Public => Ok(m.public_text()),
        KeyForm::Openssh => m.openssh(),
        KeyForm::Csr => {
            let public = m.public_sha256();
            if let Some(r) = records.get(name) {
                if r.public_sha256 == public && r.names == spec.names {
                    return Ok(r.csr.clone());
                }
            }
            let csr = m.csr(&spec.names)?;
            records.insert(
                name.to_owned(),
                KeyRecord {
                    public_sha256: public,
                    names: spec.names.clone(),
                    csr: csr.clone(),
                },
            );
            Ok(csr)
        }
    }
}

/// A key file to write with a payload's files.
pub(crate) struct KeyFile {
    pub name: String,
    pub file: FileSpec,
    pub content: Vec<u8>,
    /// The key was the next one: forgotten once it is installed.
    pub was_next: bool,
}

/// For a payload about to be applied (docs/protocol.md §11.10): each key's certificate
/// must be for the next key or the installed one, and valid now; every file that holds
/// certificates must hold only certificates that parse, the first one for one of those
/// keys (and valid now) or one that issued a key's certificate. The key each certificate
/// is for is the file to write beside the payload's. `Err` leaves everything in place.
pub(crate) fn to_install(
    store: &KeyStore,
    need: &NeedKey,
    spec: &NeedSpec,
    files: &BTreeMap<String, String>,
    payload: &[u8],
) -> Result<Vec<KeyFile>, String> {
    let json: serde_json::Value = serde_json::from_slice(payload).map_err(|_| {
        "the payload is not JSON, so no certificate can be found for the keys".to_owned()
    })?;
    let now = i64::try_from(fort_core::wire::unix_now()).unwrap_or(i64::MAX);
    let mut out = Vec::new();
    let mut chosen = Vec::new();
    let mut leaves = Vec::new();
    for (name, k) in &spec.keys {
        let wireguard = k.key_type == KeyType::Wireguard;
        let text = json
            .pointer(&k.certificate)
            .and_then(|v| v.as_str())
            .ok_or_else(|| {
                format!(
                    "the payload has no {} (a string) at {:?} for key {name}",
                    if wireguard {
                        "public key"
                    } else {
                        "certificate"
                    },
                    k.certificate
                )
            })?;
        if wireguard {
            let (m, content, was_next) = wireguard_named(store, need, name, k, files, text)?;
            out.push(KeyFile {
                name: name.clone(),
                file: k.as_file(name),
                content,
                was_next,
            });
            chosen.push(m.spki());
            continue;
        }
        let certificate = Certificate::for_key(k, text).map_err(|e| {
            format!(
                "key {name}: the value at {:?}: {e}; not installed",
                k.certificate
            )
        })?;
        let mismatch = || {
            format!(
                "the certificate at {:?} does not match key {name} (neither the key in use nor the one asked with); not installed",
                k.certificate
            )
        };
        let as_file = k.as_file(name);
        let next = store
            .load_next(need, name, k.key_type)
            .map(|m| certificate.certifies(&m).map(|yes| yes.then_some(m)))
            .transpose()?
            .flatten();
        let (m, file) = match next {
            Some(m) => {
                let content = m.file_content(k.format)?;
                (m, (content, true))
            }
            None => {
                let (current, bytes) =
                    installed(k, files.get(&k.path.display().to_string())).ok_or_else(mismatch)?;
                if !certificate.certifies(&current)? {
                    return Err(mismatch());
                }
                (current, (bytes, false))
            }
        };
        // A certificate a service would refuse (or that expired long ago) never
        // replaces a working one.
        certificate.check_validity(now).map_err(|e| {
            format!(
                "the certificate at {:?} for key {name} {e}; not installed",
                k.certificate
            )
        })?;
        out.push(KeyFile {
            name: name.clone(),
            file: as_file,
            content: file.0,
            was_next: file.1,
        });
        chosen.push(m.spki());
        leaves.extend(certificate.leaf().map(<[u8]>::to_vec));
    }
    crate::certs::check_files(&spec.files, &json, payload, &chosen, &leaves, now)?;
    Ok(out)
}

/// The key a payload for a WireGuard key names back (its public key, base64, at the key's
/// `certificate` pointer): the next key or the installed one, with the content its file
/// gets and whether it was the next. Any other public key installs nothing.
fn wireguard_named(
    store: &KeyStore,
    need: &NeedKey,
    name: &str,
    k: &KeySpec,
    files: &BTreeMap<String, String>,
    named: &str,
) -> Result<(Material, Vec<u8>, bool), String> {
    let named = named.trim();
    if let Some(next) = store.load_next(need, name, k.key_type) {
        if next.public_text() == named {
            let content = next.file_content(k.format)?;
            return Ok((next, content, true));
        }
    }
    match installed(k, files.get(&k.path.display().to_string())) {
        Some((current, bytes)) if current.public_text() == named => Ok((current, bytes, false)),
        _ => Err(format!(
            "the public key at {:?} is not key {name}'s (neither the key in use nor the one asked with); not installed",
            k.certificate
        )),
    }
}

/// The need's request as it would be sent, its `$fort_key` references filled from keys
/// made now and thrown away (a CSR names exactly the key's `names`): what a check before a
/// deploy holds against the provider's policy. No key is kept or written anywhere.
pub fn with_throwaway_keys(spec: &NeedSpec) -> Result<serde_json::Value, String> {
    let mut made: BTreeMap<String, Material> = BTreeMap::new();
    let mut records = BTreeMap::new();
    fort_core::schema::keys::resolve_keys(&spec.request, &mut |r| {
        let k = spec
            .keys
            .get(&r.key)
            .ok_or_else(|| format!("no key {:?}", r.key))?;
        if !made.contains_key(&r.key) {
            made.insert(r.key.clone(), Material::generate(k.key_type)?);
        }
        form(&r.key, k, &made[&r.key], r.form, &mut records)
    })
}

/// For tests: the next key of a need, as its public OpenSSH line.
#[doc(hidden)]
pub fn next_key_public(dir: &Path, need: &NeedKey, name: &str, t: KeyType) -> Option<String> {
    KeyStore::new(dir.to_owned())
        .load_next(need, name, t)
        .and_then(|m| m.openssh().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forms_and_matching() {
        for t in [
            KeyType::EcdsaP256,
            KeyType::Ed25519,
            KeyType::Rsa2048,
            KeyType::Rsa3072,
        ] {
            let m = Material::generate(t).unwrap();
            let names = vec!["a.example.org".to_owned(), "*.b.example.org".to_owned()];
            let csr = m.csr(&names).unwrap();
            assert!(csr.starts_with("-----BEGIN CERTIFICATE REQUEST-----"));
            let line = m.openssh().unwrap();
            assert!(
                line.starts_with("ecdsa-sha2-nistp256 ")
                    || line.starts_with("ssh-ed25519 ")
                    || line.starts_with("ssh-rsa "),
                "{line}"
            );
            // A certificate for this key, and one for another.
            let params = CertificateParams::new(names.clone()).unwrap();
            let mine = params.self_signed(m.signing().unwrap()).unwrap().pem();
            assert!(m.certifies(&mine).unwrap());
            let other = Material::generate(t).unwrap();
            let theirs = params.self_signed(other.signing().unwrap()).unwrap().pem();
            assert!(!m.certifies(&theirs).unwrap());
            assert!(m.certifies("garbage").is_err());
            // Text before the certificate is passed over, as OpenSSL does.
            assert!(m
                .certifies(&format!("subject=a.example.org\n{mine}"))
                .unwrap());
            // PEM round trip, and OpenSSH for ed25519.
            let back = Material::from_pem(t, &m.pem()).unwrap();
            assert_eq!(back.public_raw(), m.public_raw());
            if t == KeyType::Ed25519 {
                let file = m.file_content(KeyFormat::Openssh).unwrap();
                assert!(file.starts_with(b"-----BEGIN OPENSSH PRIVATE KEY-----"));
                let back = Material::from_file(t, KeyFormat::Openssh, &file).unwrap();
                assert_eq!(back.public_raw(), m.public_raw());
            }
        }
        let ec = Material::generate(KeyType::EcdsaP256).unwrap();
        assert!(Material::from_pem(KeyType::Ed25519, &ec.pem()).is_err());
        // A 2048-bit key is no rsa-3072 key (a changed declaration makes a new one).
        let rsa = Material::generate(KeyType::Rsa2048).unwrap();
        assert!(Material::from_pem(KeyType::Rsa3072, &rsa.pem()).is_err());
        assert!(Material::from_pem(KeyType::Rsa2048, &rsa.pem()).is_ok());
    }

    #[test]
    fn an_authorized_key_matches_its_own_public_line_only() {
        let spec = |authorized: bool| -> KeySpec {
            serde_json::from_value(serde_json::json!({
                "type": "ed25519", "path": "/k", "format": "openssh", "authorized": authorized
            }))
            .unwrap()
        };
        let m = Material::generate(KeyType::Ed25519).unwrap();
        let other = Material::generate(KeyType::Ed25519).unwrap();
        let line = m.openssh().unwrap();
        let ack = Certificate::for_key(&spec(true), &format!("{line} fort@backup\n")).unwrap();
        assert!(ack.certifies(&m).unwrap() && !ack.certifies(&other).unwrap());
        assert!(ack.check_validity(0).is_ok() && ack.leaf().is_none());
        // A certified key is never matched by a bare public key, nor the reverse.
        assert!(Certificate::for_key(&spec(false), &line).is_err());
        let params = CertificateParams::new(vec!["a.example.org".to_owned()]).unwrap();
        let pem = params.self_signed(m.signing().unwrap()).unwrap().pem();
        assert!(Certificate::for_key(&spec(true), &pem).is_err());
        // The field is written only when set: declarations without it hash as before.
        assert!(!serde_json::to_string(&spec(false))
            .unwrap()
            .contains("authorized"));
    }

    #[test]
    fn a_wireguard_key_is_named_back_not_certified() {
        let m = Material::generate(KeyType::Wireguard).unwrap();
        let public = m.public_text();
        assert_eq!(public.len(), 44, "{public}");
        assert!(m.csr(&["a.example.org".to_owned()]).is_err());
        assert!(m.openssh().is_err());
        // Kept and installed as wg reads it.
        let file = m.file_content(KeyFormat::Pem).unwrap();
        let back = Material::from_file(KeyType::Wireguard, KeyFormat::Pem, &file).unwrap();
        assert_eq!(back.public_text(), public);
        let kept = Material::from_pem(KeyType::Wireguard, &m.pem()).unwrap();
        assert_eq!(kept.public_text(), public);
        // A kept key of another type is no wireguard key (a changed declaration).
        let ed = Material::generate(KeyType::Ed25519).unwrap();
        assert!(Material::from_pem(KeyType::Wireguard, &ed.pem()).is_err());

        // The payload must name the next key (or the installed one) back.
        let dir = tempfile::tempdir().unwrap();
        let store = KeyStore::new(dir.path().join("keys"));
        let need = NeedKey::parse("mesh/wg0").unwrap();
        let spec: NeedSpec = serde_json::from_value(serde_json::json!({
            "from": "hub", "request": {"public_key": {"$fort_key": "wg"}}, "nag_seconds": 60,
            "keys": {"wg": {"type": "wireguard", "path": dir.path().join("wg/key"),
                            "certificate": "/public_key"}}
        }))
        .unwrap();
        let keys = for_request(&store, &need, &spec, &BTreeMap::new(), false).unwrap();
        let asked = keys["wg"].public_text();
        let payload = |key: &str| serde_json::json!({"public_key": key, "peers": []}).to_string();
        let out = to_install(
            &store,
            &need,
            &spec,
            &BTreeMap::new(),
            payload(&asked).as_bytes(),
        )
        .unwrap();
        assert_eq!(out.len(), 1);
        assert!(out[0].was_next);
        assert_eq!(
            out[0].content,
            keys["wg"].file_content(KeyFormat::Pem).unwrap()
        );
        let err = to_install(
            &store,
            &need,
            &spec,
            &BTreeMap::new(),
            payload(&public).as_bytes(),
        )
        .err()
        .unwrap();
        assert!(err.contains("is not key wg's"), "{err}");
        let err = to_install(&store, &need, &spec, &BTreeMap::new(), b"{\"peers\": []}")
            .err()
            .unwrap();
        assert!(err.contains("no public key"), "{err}");
    }
}
