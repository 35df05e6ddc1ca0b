//! Device attestation for a node's first certificate: the proof, carried in an annotation on
//! the CSR, that the CSR comes from a vehicle the factory made, for the node name it asks for.
//!
//! A bootstrap token is the same on every vehicle of a firmware image, so a token alone must
//! not be enough to get a node certificate (with it, one vehicle's firmware would impersonate
//! every vehicle). Each vehicle therefore has a per-device factory key and certificate, issued
//! by a fleet CA the cluster trusts. The device signs, with the factory key, the CSR's public
//! key and its node name; `edgehub controller` approves a first certificate only when that
//! signature verifies, the factory certificate chains to the fleet CA, and the factory
//! certificate names that node.
//!
//! **The annotation** [`ANNOTATION`] on the CertificateSigningRequest is a JSON object:
//!
//! ```json
//! {"version": 1, "algorithm": "ecdsa-p256-sha256",
//!  "chain": "-----BEGIN CERTIFICATE-----\n...", "signature": "<base64>"}
//! ```
//!
//! - `chain`: PEM, the factory certificate first, then any intermediates up to (not
//!   including) the fleet CA;
//! - `algorithm`: the factory key's signature scheme: `ecdsa-p256-sha256`, `ecdsa-p384-sha384`
//!   (ASN.1 DER signatures, as in X.509) or `ed25519`;
//! - `signature`: standard base64 of the signature over [`message`]: the domain-separation
//!   prefix [`DOMAIN`] (which names the version), then the CSR's SubjectPublicKeyInfo (DER)
//!   and the node name, each preceded by its length as a 4-byte big-endian integer, so no two
//!   (key, name) pairs sign the same bytes and no other protocol's signature passes as one.
//!
//! **The node name** is the factory certificate's one `dNSName` subjectAltName (not the
//! subject CN, which X.509 path validation ignores). A factory certificate with no dNSName,
//! or with more than one, names no node and is denied; names compare as DNS does, ignoring
//! ASCII case. A wildcard never names a node.
//!
//! The split: [`sign`] is the device's half (the factory key; only *ring*, which rustls
//! already brings), [`verify`] the controller's (the chain, the name and the signature, with
//! rustls-webpki, which rustls already brings too). Both are pure apart from reading files.

mod sign;
mod verify;

#[cfg(test)]
pub(crate) mod tests;

pub use sign::{FactoryKey, KeyError};
pub use verify::{verify, Denial, FleetCa, FleetCaError, VerifiedDevice};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, SignatureVerificationAlgorithm};

/// The CSR annotation that carries the attestation.
pub const ANNOTATION: &str = "edgehub.io/device-attestation";

/// The format version this build writes and the only one it accepts.
pub const VERSION: u32 = 1;

/// The domain-separation prefix of the signed message; it names the version.
pub const DOMAIN: &[u8] = b"edgehub device attestation v1\0";

/// At most this many bytes of annotation are read (a chain of a few certificates is ~3 KB).
pub const MAX_ANNOTATION: usize = 64 * 1024;

/// At most this many certificates in the chain (the factory certificate and intermediates).
pub const MAX_CHAIN: usize = 8;

/// A signature scheme of the factory key, by its name in the annotation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    EcdsaP256Sha256,
    EcdsaP384Sha384,
    Ed25519,
}

impl Algorithm {
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::EcdsaP256Sha256 => "ecdsa-p256-sha256",
            Algorithm::EcdsaP384Sha384 => "ecdsa-p384-sha384",
            Algorithm::Ed25519 => "ed25519",
        }
    }

    pub fn from_name(name: &str) -> Option<Algorithm> {
        [
            Algorithm::EcdsaP256Sha256,
            Algorithm::EcdsaP384Sha384,
            Algorithm::Ed25519,
        ]
        .into_iter()
        .find(|a| a.name() == name)
    }

    /// The webpki verifier of this scheme: what checks a signature the factory key made
    /// (the device checks its key against its certificate with it, the controller the
    /// attestation).
    pub fn verifier(self) -> &'static dyn SignatureVerificationAlgorithm {
        match self {
            Algorithm::EcdsaP256Sha256 => webpki::ring::ECDSA_P256_SHA256,
            Algorithm::EcdsaP384Sha384 => webpki::ring::ECDSA_P384_SHA384,
            Algorithm::Ed25519 => webpki::ring::ED25519,
        }
    }
}

/// The certificates of a PEM chain, in order; at least one, at most [`MAX_CHAIN`]. The
/// annotation's `chain` and the fleet CA are read with it.
fn parse_chain(pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("not PEM certificates: {e}"))?;
    match certs.len() {
        0 => Err("no certificate in the PEM".into()),
        n if n > MAX_CHAIN => Err(format!("{n} certificates, at most {MAX_CHAIN}")),
        _ => Ok(certs),
    }
}

/// The annotation's JSON, as written and read.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Wire {
    version: u32,
    algorithm: String,
    chain: String,
    signature: String,
}

/// The bytes the factory key signs: [`DOMAIN`], then the CSR's SubjectPublicKeyInfo (DER) and
/// the node name, each after its length as a big-endian u32.
pub fn message(csr_spki_der: &[u8], node_name: &str) -> Vec<u8> {
    let mut m = Vec::with_capacity(DOMAIN.len() + 8 + csr_spki_der.len() + node_name.len());
    m.extend_from_slice(DOMAIN);
    for part in [csr_spki_der, node_name.as_bytes()] {
        // A CSR key or a node name of 4 GiB is not a thing; saturate rather than wrap.
        let len = u32::try_from(part.len()).unwrap_or(u32::MAX);
        m.extend_from_slice(&len.to_be_bytes());
        m.extend_from_slice(part);
    }
    m
}
