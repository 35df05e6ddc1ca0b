//! The device's half: the factory key and certificate chain, and the annotation they sign.

use super::{message, parse_chain, Algorithm, Wire, VERSION};
use base64::Engine;
use ring::rand::SystemRandom;
use ring::signature::{self, EcdsaKeyPair, Ed25519KeyPair, KeyPair};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::PrivateKeyDer;
use std::path::{Path, PathBuf};

/// Why the factory key or chain cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("cannot read {path}: {error}")]
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("factory key: {0}")]
    Key(String),
    #[error("factory certificate chain: {0}")]
    Chain(String),
    #[error("the factory key does not match the factory certificate (the chain's first)")]
    Mismatch,
    #[error("signing failed")]
    Sign,
}

enum Signer {
    Ecdsa(EcdsaKeyPair),
    Ed25519(Ed25519KeyPair),
}

/// The factory key and its certificate chain: what signs the attestation.
pub struct FactoryKey {
    signer: Signer,
    algorithm: Algorithm,
    chain_pem: String,
}

impl std::fmt::Debug for FactoryKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FactoryKey")
            .field("algorithm", &self.algorithm)
            .finish_non_exhaustive()
    }
}

fn read(path: &Path) -> Result<Vec<u8>, KeyError> {
    std::fs::read(path).map_err(|error| KeyError::Read {
        path: path.to_path_buf(),
        error,
    })
}

impl FactoryKey {
    /// Reads the factory key (PKCS#8 PEM: ECDSA P-256 or P-384, or Ed25519) and its chain (PEM,
    /// the factory certificate first), and checks that they belong together.
    pub fn load(key_file: &Path, chain_file: &Path) -> Result<FactoryKey, KeyError> {
        FactoryKey::from_pem(&read(key_file)?, &read(chain_file)?)
    }

    pub fn from_pem(key_pem: &[u8], chain_pem: &[u8]) -> Result<FactoryKey, KeyError> {
        let chain = parse_chain(chain_pem).map_err(KeyError::Chain)?;
        let pkcs8 = match PrivateKeyDer::from_pem_slice(key_pem)
            .map_err(|e| KeyError::Key(format!("not a PEM private key: {e}")))?
        {
            PrivateKeyDer::Pkcs8(k) => k,
            _ => {
                return Err(KeyError::Key(
                    "not PKCS#8 (\"BEGIN PRIVATE KEY\"); convert it with `openssl pkcs8 -topk8 -nocrypt`"
                        .into(),
                ))
            }
        };
        let der = pkcs8.secret_pkcs8_der();
        let rng = SystemRandom::new();
        let (signer, algorithm) = if let Ok(k) =
            EcdsaKeyPair::from_pkcs8(&signature::ECDSA_P256_SHA256_ASN1_SIGNING, der, &rng)
        {
            (Signer::Ecdsa(k), Algorithm::EcdsaP256Sha256)
        } else if let Ok(k) =
            EcdsaKeyPair::from_pkcs8(&signature::ECDSA_P384_SHA384_ASN1_SIGNING, der, &rng)
        {
            (Signer::Ecdsa(k), Algorithm::EcdsaP384Sha384)
        } else if let Ok(k) = Ed25519KeyPair::from_pkcs8_maybe_unchecked(der) {
            (Signer::Ed25519(k), Algorithm::Ed25519)
        } else {
            return Err(KeyError::Key(
                "not an ECDSA P-256, ECDSA P-384 or Ed25519 key".into(),
            ));
        };
        let chain_pem = String::from_utf8(chain_pem.to_vec())
            .map_err(|_| KeyError::Chain("not UTF-8".into()))?;
        let key = FactoryKey {
            signer,
            algorithm,
            chain_pem,
        };
        // The key must be the factory certificate's: a mismatch would be denied by every
        // controller, so it is better found here, at startup, with a clear message.
        let probe = b"edgehub factory key check";
        let sig = key.raw_sign(probe)?;
        let leaf = webpki::EndEntityCert::try_from(&chain[0])
            .map_err(|e| KeyError::Chain(format!("the factory certificate: {e}")))?;
        leaf.verify_signature(algorithm.verifier(), probe, &sig)
            .map_err(|_| KeyError::Mismatch)?;
        Ok(key)
    }

    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// The factory key's public key, raw (an uncompressed EC point, or 32 Ed25519 bytes).
    pub fn public_key(&self) -> &[u8] {
        match &self.signer {
            Signer::Ecdsa(k) => k.public_key().as_ref(),
            Signer::Ed25519(k) => k.public_key().as_ref(),
        }
    }

    fn raw_sign(&self, msg: &[u8]) -> Result<Vec<u8>, KeyError> {
        match &self.signer {
            Signer::Ecdsa(k) => k
                .sign(&SystemRandom::new(), msg)
                .map(|s| s.as_ref().to_vec())
                .map_err(|_| KeyError::Sign),
            Signer::Ed25519(k) => Ok(k.sign(msg).as_ref().to_vec()),
        }
    }

    /// The annotation value for a CSR whose public key is `csr_spki_der` (its
    /// SubjectPublicKeyInfo, DER) asking for `node_name`.
    pub fn sign(&self, csr_spki_der: &[u8], node_name: &str) -> Result<String, KeyError> {
        let sig = self.raw_sign(&message(csr_spki_der, node_name))?;
        let wire = Wire {
            version: VERSION,
            algorithm: self.algorithm.name().into(),
            chain: self.chain_pem.clone(),
            signature: base64::engine::general_purpose::STANDARD.encode(sig),
        };
        // Serialising a struct of strings and an integer cannot fail.
        serde_json::to_string(&wire).map_err(|_| KeyError::Sign)
    }
}
