//! The local handover of a bootstrap token (`PUT /v1/bootstrap-token`, `edgehub bootstrap`):
//! the token checked by format, kept in `<data_dir>/identity/bootstrap-token` (0600, written
//! atomically, sealed with the device key when one is configured), and the identity task woken
//! so the node bootstraps at once. [`bootstrap_candidates`] decides, purely, which bootstrap
//! credentials a round tries, in order.

use super::files;
use crate::kube::kubeconfig::TokenSource;
use crate::kube::Kubeconfig;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The handed-over token's file under `data_dir`.
pub fn token_path(data_dir: &Path) -> PathBuf {
    data_dir.join("identity").join("bootstrap-token")
}

/// A bootstrap token's format: `<id>.<secret>`, 6 and 16 characters of `[a-z0-9]` (as the
/// apiserver's bootstrap token authenticator reads it).
pub fn valid_token(t: &str) -> bool {
    let ok = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
    };
    match t.split_once('.') {
        Some((id, secret)) => ok(id, 6) && ok(secret, 16),
        None => false,
    }
}

/// Seals the token at rest: the store's device key ([`crate::store::seal`] implements it, a
/// layer above this one).
pub trait TokenSeal: Send + Sync {
    fn seal(&self, plain: &[u8]) -> Result<Vec<u8>, String>;
    fn open(&self, sealed: &[u8]) -> Result<Vec<u8>, String>;
    /// Whether `bytes` are a sealed value (not the token in the clear).
    fn is_sealed(&self, bytes: &[u8]) -> bool;
}

#[derive(Debug, thiserror::Error)]
pub enum HandoverError {
    #[error("not a bootstrap token: want <id>.<secret>, 6 and 16 characters of a-z and 0-9")]
    Format,
    #[error("cannot seal the bootstrap token: {0}")]
    Seal(String),
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The handover's file and its wakeup, shared by the local API and the identity task.
pub struct Handover {
    pub path: PathBuf,
    pub seal: Option<Arc<dyn TokenSeal>>,
    wake: tokio::sync::Notify,
}

impl std::fmt::Debug for Handover {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handover")
            .field("path", &self.path)
            .field("sealed", &self.seal.is_some())
            .finish()
    }
}

impl Handover {
    pub fn new(path: PathBuf, seal: Option<Arc<dyn TokenSeal>>) -> Handover {
        Handover {
            path,
            seal,
            wake: tokio::sync::Notify::new(),
        }
    }

    /// Checks, seals and writes the token, then wakes the identity task.
    pub fn store(&self, token: &str) -> Result<(), HandoverError> {
        let token = token.trim();
        if !valid_token(token) {
            return Err(HandoverError::Format);
        }
        let bytes = match &self.seal {
            Some(s) => s.seal(token.as_bytes()).map_err(HandoverError::Seal)?,
            None => format!("{token}\n").into_bytes(),
        };
        files::write_private(&self.path, &bytes).map_err(|source| HandoverError::Write {
            path: self.path.clone(),
            source,
        })?;
        tracing::info!(path = %self.path.display(), sealed = self.seal.is_some(),
            "bootstrap token handed over; bootstrapping now");
        self.wake.notify_one();
        Ok(())
    }

    /// The handed-over token: `Ok(None)` when none was.
    pub fn read(&self) -> Result<Option<String>, String> {
        let bytes = match std::fs::read(&self.path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("{}: {e}", self.path.display())),
        };
        let plain = match &self.seal {
            Some(s) if s.is_sealed(&bytes) => s
                .open(&bytes)
                .map_err(|e| format!("{}: {e}", self.path.display()))?,
            _ => bytes,
        };
        let t = String::from_utf8(plain).map_err(|_| {
            format!(
                "{}: not text (sealed, and no device key?)",
                self.path.display()
            )
        })?;
        let t = t.trim();
        if valid_token(t) {
            Ok(Some(t.to_string()))
        } else {
            Err(format!(
                "{}: not a bootstrap token (sealed with another key, or damaged)",
                self.path.display()
            ))
        }
    }

    /// Resolves once a token was handed over (at once if one was since the last call).
    pub async fn woken(&self) {
        self.wake.notified().await
    }
}

/// A credential a bootstrap round may try.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Candidate {
    /// The handed-over token, on the bootstrap kubeconfig's server and CA.
    HandedOver(String),
    /// The bootstrap kubeconfig's own credential.
    Kubeconfig,
}

/// What the bootstrap kubeconfig carries, as [`bootstrap_candidates`] needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KubeconfigCredential {
    Token,
    TokenFile { path: PathBuf, exists: bool },
    ClientCert,
    None,
}

impl KubeconfigCredential {
    /// Reads the facts off a kubeconfig (the one I/O: whether a token file exists).
    pub fn of(kc: &Kubeconfig) -> KubeconfigCredential {
        match (&kc.token, &kc.client_cert) {
            (Some(TokenSource::File(p)), _) => KubeconfigCredential::TokenFile {
                path: p.clone(),
                exists: p.exists(),
            },
            (Some(TokenSource::Inline(_)), _) => KubeconfigCredential::Token,
            (None, Some(_)) => KubeconfigCredential::ClientCert,
            (None, None) => KubeconfigCredential::None,
        }
    }
}

/// The bootstrap credentials a round tries, in order, and what is missing when there are
/// none. The handed-over token comes first (it was handed over because the other lapsed).
/// The kubeconfig's own credential follows, unless it has none, its tokenFile is missing, or
/// its tokenFile is the handover's file: read directly, that file would send the sealed bytes
/// as a token (the handed-over token is already the first candidate, read and opened).
pub fn bootstrap_candidates(
    kubeconfig: &KubeconfigCredential,
    handed_over: Option<&str>,
    handover_path: &Path,
) -> (Vec<Candidate>, Option<String>) {
    let mut out = Vec::new();
    if let Some(t) = handed_over {
        out.push(Candidate::HandedOver(t.to_string()));
    }
    let missing = match kubeconfig {
        KubeconfigCredential::Token | KubeconfigCredential::ClientCert => {
            out.push(Candidate::Kubeconfig);
            None
        }
        KubeconfigCredential::TokenFile { path, .. } if path == handover_path => None,
        KubeconfigCredential::TokenFile { exists: true, .. } => {
            out.push(Candidate::Kubeconfig);
            None
        }
        KubeconfigCredential::TokenFile {
            path,
            exists: false,
        } => Some(format!(
            "the bootstrap kubeconfig's tokenFile {} does not exist",
            path.display()
        )),
        KubeconfigCredential::None => {
            Some("the bootstrap kubeconfig has no token or client certificate".into())
        }
    };
    let missing = if out.is_empty() {
        Some(missing.unwrap_or_else(|| "no bootstrap token was handed over".into()))
    } else {
        None
    };
    (out, missing)
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: &str = "abcdef.0123456789abcdef";

    #[test]
    fn token_format() {
        assert!(valid_token(T));
        for bad in [
            "",
            "abcdef",
            "abcdef.",
            "ABCDEF.0123456789abcdef",
            "abcde.0123456789abcdef",
            "abcdef.0123456789abcde",
            "abcdef.0123456789abcdef0",
            "abcdef:0123456789abcdef",
            "abc.def.0123456789abcdef",
            "abcdef.0123456789abcdéf",
        ] {
            assert!(!valid_token(bad), "{bad:?}");
        }
    }

    #[test]
    fn handed_over_first_then_the_kubeconfig() {
        let h = Path::new("/d/identity/bootstrap-token");
        let (c, m) = bootstrap_candidates(&KubeconfigCredential::Token, Some(T), h);
        assert_eq!(
            c,
            vec![Candidate::HandedOver(T.into()), Candidate::Kubeconfig]
        );
        assert_eq!(m, None);
        let (c, _) = bootstrap_candidates(&KubeconfigCredential::ClientCert, None, h);
        assert_eq!(c, vec![Candidate::Kubeconfig]);
    }

    #[test]
    fn a_token_file_that_is_the_handover_file_is_never_read_directly() {
        let h = Path::new("/d/identity/bootstrap-token");
        let kc = KubeconfigCredential::TokenFile {
            path: h.to_path_buf(),
            exists: true,
        };
        let (c, m) = bootstrap_candidates(&kc, Some(T), h);
        assert_eq!(c, vec![Candidate::HandedOver(T.into())]);
        assert_eq!(m, None);
        let (c, m) = bootstrap_candidates(&kc, None, h);
        assert!(c.is_empty());
        assert_eq!(m.as_deref(), Some("no bootstrap token was handed over"));
    }

    #[test]
    fn a_missing_token_file_is_said() {
        let h = Path::new("/d/identity/bootstrap-token");
        let kc = KubeconfigCredential::TokenFile {
            path: "/etc/edgehub/token".into(),
            exists: false,
        };
        let (c, m) = bootstrap_candidates(&kc, None, h);
        assert!(c.is_empty());
        assert!(m.unwrap().contains("/etc/edgehub/token does not exist"));
        let (c, m) = bootstrap_candidates(&kc, Some(T), h);
        assert_eq!(c, vec![Candidate::HandedOver(T.into())]);
        assert_eq!(m, None);
        let (c, m) = bootstrap_candidates(&KubeconfigCredential::None, None, h);
        assert!(c.is_empty());
        assert!(m.unwrap().contains("no token or client certificate"));
    }

    struct Xor;
    impl TokenSeal for Xor {
        fn seal(&self, p: &[u8]) -> Result<Vec<u8>, String> {
            let mut v = b"SEAL".to_vec();
            v.extend(p.iter().map(|b| b ^ 0x55));
            Ok(v)
        }
        fn open(&self, s: &[u8]) -> Result<Vec<u8>, String> {
            Ok(s[4..].iter().map(|b| b ^ 0x55).collect())
        }
        fn is_sealed(&self, b: &[u8]) -> bool {
            b.starts_with(b"SEAL")
        }
    }

    #[test]
    fn stored_private_sealed_and_read_back() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let h = Handover::new(token_path(d.path()), Some(Arc::new(Xor)));
        assert_eq!(h.read().unwrap(), None);
        assert!(matches!(h.store("nope"), Err(HandoverError::Format)));
        h.store(&format!("{T}\n")).unwrap();
        let raw = std::fs::read(&h.path).unwrap();
        assert!(!raw.windows(T.len()).any(|w| w == T.as_bytes()));
        let mode = std::fs::metadata(&h.path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(h.read().unwrap().as_deref(), Some(T));
        // Without the key, sealed bytes are an error, not a token.
        let clear = Handover::new(h.path.clone(), None);
        assert!(clear.read().is_err());
    }
}
