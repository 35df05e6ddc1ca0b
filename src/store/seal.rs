//! Secrets at rest: the Secret objects and service-account tokens the cache keeps for offline
//! starts are sealed with a device key before they reach the database file.
//!
//! They must survive an offline reboot, so memory alone will not do, and flash keeps what was
//! written to it (the WAL, freed pages, a moved-aside copy of the database). So the value of
//! each such row is stored as an AEAD box (AES-256-GCM from ring, already in the binary for
//! rustls), bound to the row it belongs to (its table and key columns are the associated
//! data: a box copied into another row does not open).
//!
//! The key comes from a file the firmware keeps on a protected partition, or from a systemd
//! credential (`$CREDENTIALS_DIRECTORY/<name>`, which systemd can seal to the TPM); its bytes
//! are input keying material for HKDF-SHA256, which derives the AEAD key, the nonce key and
//! an 8-byte key id. Each box names the key id it was sealed with, so a box sealed with
//! another key (a rotation, a wrong file) is told apart from a damaged one.
//!
//! The nonce is synthetic: HMAC-SHA256 of the associated data and the plaintext under the
//! nonce key (as in SIV). Sealing the same value for the same row gives the same bytes, so a
//! Secret that did not change is not rewritten (`WHERE raw IS NOT excluded.raw`): a random
//! nonce would rewrite every Secret at every fetch, and each commit costs 20–28 KiB of flash.
//! Two different values get the same nonce only if HMAC collides on 96 bits. The price is
//! that an observer of the file sees when a row's value did not change, which the row's own
//! write times show anyway.

use ring::{aead, hkdf, hmac};
use std::path::{Path, PathBuf};

/// First bytes of a sealed value: format version 1.
const MAGIC: &[u8; 4] = b"EHS1";
const KEY_ID_LEN: usize = 8;
const NONCE_LEN: usize = aead::NONCE_LEN;
const HEADER_LEN: usize = MAGIC.len() + KEY_ID_LEN + NONCE_LEN;
/// Less than this is not a key: 256 bits, what AES-256 wants.
pub const MIN_KEY_BYTES: usize = 32;
/// More than this is not a key file either (a wrong path, a certificate bundle).
const MAX_KEY_BYTES: usize = 4096;
/// The systemd credential edgehub looks for when none is named.
pub const DEFAULT_CREDENTIAL: &str = "edgehub-seal-key";

#[derive(Debug, thiserror::Error)]
pub enum SealError {
    #[error("device key {source_name}: {reason}")]
    Key { source_name: String, reason: String },
    #[error("cannot seal a value of {0} bytes")]
    TooLong(usize),
}

/// Where the device key was read from, for logs and `edgehub status`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    File(PathBuf),
    Credential(String),
}

impl std::fmt::Display for KeySource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeySource::File(p) => write!(f, "file {}", p.display()),
            KeySource::Credential(n) => write!(f, "systemd credential {n}"),
        }
    }
}

/// The device key, ready to seal and open.
pub struct DeviceKey {
    aead: aead::LessSafeKey,
    nonce: hmac::Key,
    id: [u8; KEY_ID_LEN],
    pub source: KeySource,
}

impl std::fmt::Debug for DeviceKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceKey")
            .field("id", &hex(&self.id))
            .field("source", &self.source)
            .finish()
    }
}

/// Why a stored value could not be opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpenError {
    /// Sealed with another key: rotated, or the wrong key file.
    OtherKey,
    /// Not a sealed value, or its bytes were changed.
    Damaged,
}

/// A length for `hkdf::Prk::expand`.
struct Len(usize);

impl hkdf::KeyType for Len {
    fn len(&self) -> usize {
        self.0
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl DeviceKey {
    /// Derives the keys from the key file's bytes.
    pub fn from_bytes(ikm: &[u8], source: KeySource) -> Result<DeviceKey, SealError> {
        let err = |reason: String| SealError::Key {
            source_name: source.to_string(),
            reason,
        };
        if ikm.len() < MIN_KEY_BYTES {
            return Err(err(format!(
                "holds {} bytes, at least {MIN_KEY_BYTES} are needed (e.g. `head -c 32 /dev/urandom`)",
                ikm.len()
            )));
        }
        if ikm.len() > MAX_KEY_BYTES {
            return Err(err(format!(
                "holds {} bytes, more than a key ({MAX_KEY_BYTES} at most)",
                ikm.len()
            )));
        }
        let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, b"edgehub seal v1").extract(ikm);
        // expand fails only for an output longer than 255 hash lengths; these are 8 to 32 bytes.
        let derive = |info: &'static [u8], out: &mut [u8]| {
            prk.expand(&[info], Len(out.len()))
                .and_then(|okm| okm.fill(out))
                .map_err(|_| err("key derivation failed".into()))
        };
        let mut aead_key = [0u8; 32];
        derive(b"aead", &mut aead_key)?;
        let mut nonce_key = [0u8; 32];
        derive(b"nonce", &mut nonce_key)?;
        let mut id = [0u8; KEY_ID_LEN];
        derive(b"key id", &mut id)?;
        let unbound = aead::UnboundKey::new(&aead::AES_256_GCM, &aead_key)
            .map_err(|_| err("not an AES-256 key".into()))?;
        Ok(DeviceKey {
            aead: aead::LessSafeKey::new(unbound),
            nonce: hmac::Key::new(hmac::HMAC_SHA256, &nonce_key),
            id,
            source,
        })
    }

    /// Reads the key from `path` (a protected partition's file, or a systemd credential).
    pub fn read(path: &Path, source: KeySource) -> Result<DeviceKey, SealError> {
        use std::os::unix::fs::PermissionsExt;
        let err = |reason: String| SealError::Key {
            source_name: source.to_string(),
            reason,
        };
        let meta = std::fs::metadata(path).map_err(|e| err(e.to_string()))?;
        if !meta.is_file() {
            return Err(err("is not a regular file".into()));
        }
        if meta.len() > MAX_KEY_BYTES as u64 {
            return Err(err(format!(
                "holds {} bytes, more than a key ({MAX_KEY_BYTES} at most)",
                meta.len()
            )));
        }
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            tracing::warn!(key = %source, mode = format_args!("{mode:o}"),
                "the device key file is readable by others than its owner");
        }
        let bytes = std::fs::read(path).map_err(|e| err(e.to_string()))?;
        DeviceKey::from_bytes(&bytes, source)
    }

    /// The key id, as it appears in sealed values.
    pub fn id(&self) -> &[u8; KEY_ID_LEN] {
        &self.id
    }

    fn nonce_for(&self, aad: &[u8], plaintext: &[u8]) -> [u8; NONCE_LEN] {
        let mut ctx = hmac::Context::with_key(&self.nonce);
        ctx.update(&(aad.len() as u64).to_be_bytes());
        ctx.update(aad);
        ctx.update(plaintext);
        let tag = ctx.sign();
        let mut n = [0u8; NONCE_LEN];
        n.copy_from_slice(&tag.as_ref()[..NONCE_LEN]);
        n
    }

    /// Seals `plaintext` for the row `aad` names.
    pub fn seal(&self, aad: &[u8], plaintext: &[u8]) -> Result<Vec<u8>, SealError> {
        let nonce = self.nonce_for(aad, plaintext);
        let mut out =
            Vec::with_capacity(HEADER_LEN + plaintext.len() + aead::AES_256_GCM.tag_len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.id);
        out.extend_from_slice(&nonce);
        let mut body = plaintext.to_vec();
        // Fails only for a plaintext over GCM's 64 GiB limit; these are at most a Secret
        // (1 MiB by the apiserver's limit).
        self.aead
            .seal_in_place_append_tag(
                aead::Nonce::assume_unique_for_key(nonce),
                aead::Aad::from(aad),
                &mut body,
            )
            .map_err(|_| SealError::TooLong(plaintext.len()))?;
        out.extend_from_slice(&body);
        Ok(out)
    }

    /// Opens a value [`DeviceKey::seal`] made for the row `aad` names.
    pub fn open(&self, aad: &[u8], sealed: &[u8]) -> Result<Vec<u8>, OpenError> {
        match key_id(sealed) {
            None => return Err(OpenError::Damaged),
            Some(id) if id != self.id => return Err(OpenError::OtherKey),
            Some(_) => {}
        }
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(&sealed[MAGIC.len() + KEY_ID_LEN..HEADER_LEN]);
        let mut body = sealed[HEADER_LEN..].to_vec();
        let plain = self
            .aead
            .open_in_place(
                aead::Nonce::assume_unique_for_key(nonce),
                aead::Aad::from(aad),
                &mut body,
            )
            .map_err(|_| OpenError::Damaged)?;
        Ok(plain.to_vec())
    }
}

/// The handed-over bootstrap token at rest (`<data_dir>/identity/bootstrap-token`), sealed
/// with the same device key as Secrets, bound to that one use.
impl crate::identity::handover::TokenSeal for DeviceKey {
    fn seal(&self, plain: &[u8]) -> Result<Vec<u8>, String> {
        DeviceKey::seal(self, &row_aad("identity", &["bootstrap-token"]), plain)
            .map_err(|e| e.to_string())
    }

    fn open(&self, sealed: &[u8]) -> Result<Vec<u8>, String> {
        DeviceKey::open(self, &row_aad("identity", &["bootstrap-token"]), sealed).map_err(|e| {
            match e {
                OpenError::OtherKey => "sealed with another device key".to_string(),
                OpenError::Damaged => "sealed value damaged".to_string(),
            }
        })
    }

    fn is_sealed(&self, bytes: &[u8]) -> bool {
        key_id(bytes).is_some()
    }
}

/// The key id a sealed value names, if it is one.
pub fn key_id(sealed: &[u8]) -> Option<[u8; KEY_ID_LEN]> {
    if sealed.len() < HEADER_LEN + aead::AES_256_GCM.tag_len() || !sealed.starts_with(MAGIC) {
        return None;
    }
    let mut id = [0u8; KEY_ID_LEN];
    id.copy_from_slice(&sealed[MAGIC.len()..MAGIC.len() + KEY_ID_LEN]);
    Some(id)
}

/// The associated data of a row: its table and key columns, NUL-separated (none of them can
/// hold a NUL: they are Kubernetes names, uids and numbers).
pub fn row_aad(table: &str, keys: &[&str]) -> Vec<u8> {
    let mut out = table.as_bytes().to_vec();
    for k in keys {
        out.push(0);
        out.extend_from_slice(k.as_bytes());
    }
    out
}

/// Where the device key comes from, by precedence: a systemd credential (the unit's
/// `LoadCredential=`/`LoadCredentialEncrypted=`, found in `$CREDENTIALS_DIRECTORY`), then
/// `[seal] key_file`. A named credential or a key file that is missing is an error: edgehub
/// must not write in the clear what it was told to seal. The default credential's name is
/// only looked for. `None`: no key is configured.
pub fn key_path(
    key_file: Option<&Path>,
    credential: Option<&str>,
    credentials_dir: Option<&Path>,
    exists: impl Fn(&Path) -> bool,
) -> Result<Option<(PathBuf, KeySource)>, SealError> {
    let name = credential.unwrap_or(DEFAULT_CREDENTIAL);
    if let Some(dir) = credentials_dir {
        let p = dir.join(name);
        if exists(&p) {
            return Ok(Some((p, KeySource::Credential(name.to_string()))));
        }
    }
    if let Some(n) = credential {
        return Err(SealError::Key {
            source_name: KeySource::Credential(n.to_string()).to_string(),
            reason: match credentials_dir {
                Some(d) => format!("not in $CREDENTIALS_DIRECTORY ({})", d.display()),
                None => "$CREDENTIALS_DIRECTORY is not set (is edgehub started by its systemd \
                         unit, with LoadCredential=?)"
                    .into(),
            },
        });
    }
    match key_file {
        Some(f) => Ok(Some((f.to_path_buf(), KeySource::File(f.to_path_buf())))),
        None => Ok(None),
    }
}

/// Where the device key that seals Secrets and tokens at rest comes from (`[seal]`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SealConfig {
    /// A file on a protected partition holding at least 32 random bytes.
    pub key_file: Option<std::path::PathBuf>,
    /// A systemd credential's name in `$CREDENTIALS_DIRECTORY`; unset: `edgehub-seal-key`
    /// when the unit provides it.
    pub credential: Option<String>,
}

/// Reads the configured device key, if any (see [`key_path`]).
pub fn load(config: &SealConfig) -> Result<Option<DeviceKey>, SealError> {
    let dir = std::env::var_os("CREDENTIALS_DIRECTORY").map(PathBuf::from);
    match key_path(
        config.key_file.as_deref(),
        config.credential.as_deref(),
        dir.as_deref(),
        |p| p.is_file(),
    )? {
        Some((path, source)) => DeviceKey::read(&path, source).map(Some),
        None => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(b: u8) -> DeviceKey {
        DeviceKey::from_bytes(&[b; 32], KeySource::File("/k".into())).unwrap()
    }

    #[test]
    fn sealed_values_open_with_their_key_and_row_only() {
        let k = key(1);
        let aad = row_aad("sa_tokens", &["uid", "", "3607"]);
        let s = k.seal(&aad, b"eyJhbGciOi.token").unwrap();
        assert!(
            !s.windows(5).any(|w| w == b"token"),
            "no plaintext in the box"
        );
        assert_eq!(k.open(&aad, &s).unwrap(), b"eyJhbGciOi.token");
        // Another row, another key, a changed byte.
        let other_row = row_aad("sa_tokens", &["uid2", "", "3607"]);
        assert_eq!(k.open(&other_row, &s), Err(OpenError::Damaged));
        assert_eq!(key(2).open(&aad, &s), Err(OpenError::OtherKey));
        let mut bad = s.clone();
        let last = bad.len() - 1;
        bad[last] ^= 1;
        assert_eq!(k.open(&aad, &bad), Err(OpenError::Damaged));
        assert_eq!(k.open(&aad, b"plain text"), Err(OpenError::Damaged));
        assert_eq!(k.open(&aad, &s[..20]), Err(OpenError::Damaged));
    }

    #[test]
    fn the_same_value_seals_to_the_same_bytes_and_another_does_not() {
        let k = key(1);
        let aad = row_aad("pod_sources", &["secrets", "ns", "creds"]);
        assert_eq!(k.seal(&aad, b"v1").unwrap(), k.seal(&aad, b"v1").unwrap());
        let (a, b) = (k.seal(&aad, b"v1").unwrap(), k.seal(&aad, b"v2").unwrap());
        assert_ne!(a[..HEADER_LEN], b[..HEADER_LEN], "another nonce");
        let other = row_aad("pod_sources", &["secrets", "ns", "creds2"]);
        assert_ne!(
            k.seal(&aad, b"v1").unwrap()[..HEADER_LEN],
            k.seal(&other, b"v1").unwrap()[..HEADER_LEN],
            "the same value in another row gets another nonce"
        );
        assert_eq!(k.seal(&aad, b"").unwrap().len(), HEADER_LEN + 16);
        assert_eq!(k.open(&aad, &k.seal(&aad, b"").unwrap()).unwrap(), b"");
    }

    #[test]
    fn keys_are_at_least_32_bytes_and_their_ids_differ() {
        assert!(DeviceKey::from_bytes(&[0; 31], KeySource::File("/k".into())).is_err());
        assert!(DeviceKey::from_bytes(&[0; 5000], KeySource::File("/k".into())).is_err());
        assert_ne!(key(1).id(), key(2).id());
        assert_eq!(key(1).id(), key(1).id());
        let e = DeviceKey::from_bytes(b"short", KeySource::Credential("c".into()))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("systemd credential c") && e.contains("at least 32"),
            "{e}"
        );
    }

    #[test]
    fn the_credential_comes_first_and_a_named_one_must_exist() {
        let dir = Path::new("/run/credentials/edgehub.service");
        let file = Path::new("/mnt/protected/edgehub.key");
        let default_cred = dir.join(DEFAULT_CREDENTIAL);
        let has = |p: &Path| p == default_cred || p == dir.join("mine");
        assert_eq!(key_path(None, None, None, has).unwrap(), None);
        assert_eq!(
            key_path(Some(file), None, None, has).unwrap(),
            Some((file.to_path_buf(), KeySource::File(file.to_path_buf())))
        );
        assert_eq!(
            key_path(Some(file), None, Some(dir), has).unwrap(),
            Some((
                default_cred.clone(),
                KeySource::Credential(DEFAULT_CREDENTIAL.into())
            ))
        );
        assert_eq!(
            key_path(None, Some("mine"), Some(dir), has).unwrap(),
            Some((dir.join("mine"), KeySource::Credential("mine".into())))
        );
        assert!(key_path(Some(file), Some("other"), Some(dir), has).is_err());
        assert!(key_path(None, Some("mine"), None, has).is_err());
        // The default credential is only looked for: without it, the file.
        assert_eq!(
            key_path(Some(file), None, Some(dir), |_| false).unwrap(),
            Some((file.to_path_buf(), KeySource::File(file.to_path_buf())))
        );
    }
}
