//! The controller's half: an attestation, checked against the fleet CA, the CSR's key and the
//! node name the CSR asks for.

use super::{message, parse_chain, Algorithm, Wire, MAX_ANNOTATION, VERSION};
use base64::Engine;
use rustls::pki_types::{CertificateDer, SignatureVerificationAlgorithm, TrustAnchor, UnixTime};
use std::time::Duration;

/// Signature schemes accepted on the certificates of the chain (the fleet CA's and any
/// intermediate's): those of rustls's *ring* provider, RSA included.
static CHAIN_ALGS: &[&dyn SignatureVerificationAlgorithm] = &[
    webpki::ring::ECDSA_P256_SHA256,
    webpki::ring::ECDSA_P256_SHA384,
    webpki::ring::ECDSA_P384_SHA256,
    webpki::ring::ECDSA_P384_SHA384,
    webpki::ring::ED25519,
    webpki::ring::RSA_PKCS1_2048_8192_SHA256,
    webpki::ring::RSA_PKCS1_2048_8192_SHA384,
    webpki::ring::RSA_PKCS1_2048_8192_SHA512,
    webpki::ring::RSA_PSS_2048_8192_SHA256_LEGACY_KEY,
    webpki::ring::RSA_PSS_2048_8192_SHA384_LEGACY_KEY,
    webpki::ring::RSA_PSS_2048_8192_SHA512_LEGACY_KEY,
];

/// Why the fleet CA cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum FleetCaError {
    #[error("fleet CA: {0}")]
    Pem(String),
    #[error("fleet CA certificate {index}: {error}")]
    Anchor { index: usize, error: webpki::Error },
}

/// The fleet CA certificates a factory certificate must chain to (one or more, e.g. the old
/// and the new CA while the fleet's CA is rotated).
#[derive(Debug, Clone)]
pub struct FleetCa {
    anchors: Vec<TrustAnchor<'static>>,
}

impl FleetCa {
    pub fn from_pem(pem: &[u8]) -> Result<FleetCa, FleetCaError> {
        let certs = parse_chain(pem).map_err(FleetCaError::Pem)?;
        let anchors = certs
            .iter()
            .enumerate()
            .map(|(index, c)| {
                webpki::anchor_from_trusted_cert(c)
                    .map(|a| a.to_owned())
                    .map_err(|error| FleetCaError::Anchor { index, error })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(FleetCa { anchors })
    }

    pub fn len(&self) -> usize {
        self.anchors.len()
    }

    pub fn is_empty(&self) -> bool {
        self.anchors.is_empty()
    }
}

/// What a verified attestation says about the device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifiedDevice {
    /// The node name the factory certificate names (its dNSName), as the CSR asked for it.
    pub node_name: String,
    /// The factory certificate's serial number, lowercase hex.
    pub serial: String,
}

/// Why an attestation is refused. [`Denial::reason`] is the CSR condition's `reason`, the
/// `Display` text its `message`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Denial {
    #[error("the attestation is malformed: {0}")]
    Malformed(String),
    #[error("the factory certificate does not chain to the fleet CA: {0}")]
    Untrusted(String),
    #[error("the factory certificate expired at {not_after} (unix seconds)")]
    Expired { not_after: u64 },
    #[error("the factory certificate is not valid before {not_before} (unix seconds)")]
    NotYetValid { not_before: u64 },
    #[error("the factory certificate names no node: {0}")]
    NoNodeName(String),
    #[error("the CSR asks for node {asked:?}, the factory certificate names {named:?}")]
    NameMismatch { asked: String, named: String },
    #[error("the attestation's signature does not verify with the factory certificate's key over this CSR's key and node name: {0}")]
    BadSignature(String),
}

impl Denial {
    /// A CamelCase reason, as the CSR API's conditions have.
    pub fn reason(&self) -> &'static str {
        match self {
            Denial::Malformed(_) => "AttestationMalformed",
            Denial::Untrusted(_) => "FactoryCertificateUntrusted",
            Denial::Expired { .. } => "FactoryCertificateExpired",
            Denial::NotYetValid { .. } => "FactoryCertificateNotYetValid",
            Denial::NoNodeName(_) => "FactoryCertificateNamesNoNode",
            Denial::NameMismatch { .. } => "NodeNameMismatch",
            Denial::BadSignature(_) => "AttestationSignatureInvalid",
        }
    }
}

fn malformed(s: impl Into<String>) -> Denial {
    Denial::Malformed(s.into())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Checks `annotation` (the value of [`super::ANNOTATION`]) for a CSR whose public key is
/// `csr_spki_der` asking for `node_name`, at `now_unix_secs`: the chain verifies against
/// `ca` (and is valid now, with EKU client auth if it has EKUs), the factory certificate's one
/// dNSName is `node_name`, and the signature over [`message`] verifies with the factory
/// certificate's key.
pub fn verify(
    annotation: &str,
    ca: &FleetCa,
    csr_spki_der: &[u8],
    node_name: &str,
    now_unix_secs: u64,
) -> Result<VerifiedDevice, Denial> {
    if annotation.len() > MAX_ANNOTATION {
        return Err(malformed(format!(
            "{} bytes, at most {MAX_ANNOTATION}",
            annotation.len()
        )));
    }
    let wire: Wire =
        serde_json::from_str(annotation).map_err(|e| malformed(format!("not the JSON: {e}")))?;
    if wire.version != VERSION {
        return Err(malformed(format!(
            "version {}, this controller knows {VERSION}",
            wire.version
        )));
    }
    let alg = Algorithm::from_name(&wire.algorithm)
        .ok_or_else(|| malformed(format!("unknown algorithm {:?}", wire.algorithm)))?;
    let sig = base64::engine::general_purpose::STANDARD
        .decode(wire.signature.as_bytes())
        .map_err(|e| malformed(format!("signature is not base64: {e}")))?;
    let chain = parse_chain(wire.chain.as_bytes()).map_err(malformed)?;
    let (leaf_der, intermediates): (&CertificateDer<'_>, &[CertificateDer<'_>]) =
        match chain.split_first() {
            Some(split) => split,
            // parse_chain returns at least one certificate.
            None => return Err(malformed("no certificate")),
        };
    let leaf = webpki::EndEntityCert::try_from(leaf_der)
        .map_err(|e| malformed(format!("the factory certificate: {e}")))?;

    let now = UnixTime::since_unix_epoch(Duration::from_secs(now_unix_secs));
    leaf.verify_for_usage(
        CHAIN_ALGS,
        &ca.anchors,
        intermediates,
        now,
        webpki::KeyUsage::client_auth(),
        None,
        None,
    )
    .map_err(|e| match e {
        webpki::Error::CertExpired { not_after, .. } => Denial::Expired {
            not_after: not_after.as_secs(),
        },
        webpki::Error::CertNotValidYet { not_before, .. } => Denial::NotYetValid {
            not_before: not_before.as_secs(),
        },
        webpki::Error::BadDer | webpki::Error::BadDerTime => malformed(e.to_string()),
        e => Denial::Untrusted(e.to_string()),
    })?;

    let names: Vec<&str> = leaf
        .valid_dns_names()
        .filter(|n| !n.starts_with('*'))
        .collect();
    let named = match names.as_slice() {
        [one] => *one,
        [] => {
            return Err(Denial::NoNodeName(
                "it has no dNSName subjectAltName".into(),
            ))
        }
        many => {
            return Err(Denial::NoNodeName(format!(
                "it has {} dNSName subjectAltNames, a factory certificate names one node",
                many.len()
            )))
        }
    };
    if !named.eq_ignore_ascii_case(node_name) {
        return Err(Denial::NameMismatch {
            asked: node_name.into(),
            named: named.into(),
        });
    }

    leaf.verify_signature(alg.verifier(), &message(csr_spki_der, node_name), &sig)
        .map_err(|e| Denial::BadSignature(e.to_string()))?;
    Ok(VerifiedDevice {
        node_name: node_name.into(),
        serial: hex(leaf.serial()),
    })
}
