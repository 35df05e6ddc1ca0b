//! The device's key and its CertificateSigningRequest, in one place: the kubelet's shape
//! (signer `kubernetes.io/kube-apiserver-client-kubelet`, `O=system:nodes`,
//! `CN=system:node:<name>`, usages digital signature + client auth, EC P-256, no SANs).
//! Extra annotations are the extension point: the attested-approval setup adds its factory
//! certificate chain and signature there ([`build`]'s `annotations`).

use base64::Engine;
use std::collections::BTreeMap;

/// The signer of kubelet client certificates.
pub const SIGNER: &str = "kubernetes.io/kube-apiserver-client-kubelet";

#[derive(Debug, thiserror::Error)]
pub enum CsrError {
    #[error("cannot make the device key or its CSR: {0}")]
    Crypto(String),
}

/// A fresh key and the CSR object that asks for a certificate for it.
pub struct Request {
    /// PEM (PKCS#8) private key: written 0600 in the data dir with the certificate, never sent.
    pub key_pem: String,
    /// The PEM CSR, as the `spec.request` carries it (base64 of it).
    pub csr_pem: String,
    /// The DER SubjectPublicKeyInfo of the key, for whoever signs over it (attestation).
    pub public_key_der: Vec<u8>,
    /// The `CertificateSigningRequest` to POST.
    pub object: serde_json::Value,
}

/// A new EC P-256 key and the CSR for `node_name`. `expiration_secs` is the
/// `expirationSeconds` asked for (at least 600; the signer may give less). `annotations` go
/// on the object as they are.
pub fn build(
    node_name: &str,
    expiration_secs: Option<u32>,
    annotations: &BTreeMap<String, String>,
) -> Result<Request, CsrError> {
    let crypto = |e: rcgen::Error| CsrError::Crypto(e.to_string());
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(crypto)?;
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(crypto)?;
    let mut dn = rcgen::DistinguishedName::new();
    dn.push(rcgen::DnType::OrganizationName, "system:nodes");
    dn.push(
        rcgen::DnType::CommonName,
        format!("system:node:{node_name}"),
    );
    params.distinguished_name = dn;
    let csr = params.serialize_request(&key).map_err(crypto)?;
    let csr_pem = csr.pem().map_err(crypto)?;
    let mut spec = serde_json::json!({
        "request": base64::engine::general_purpose::STANDARD.encode(csr_pem.as_bytes()),
        "signerName": SIGNER,
        "usages": ["digital signature", "client auth"],
    });
    if let Some(e) = expiration_secs {
        spec["expirationSeconds"] = e.max(600).into();
    }
    let mut metadata = serde_json::json!({"generateName": "node-csr-"});
    if !annotations.is_empty() {
        metadata["annotations"] = serde_json::json!(annotations);
    }
    Ok(Request {
        key_pem: key.serialize_pem(),
        csr_pem,
        public_key_der: rcgen::PublicKeyData::subject_public_key_info(&key),
        object: serde_json::json!({
            "apiVersion": "certificates.k8s.io/v1",
            "kind": "CertificateSigningRequest",
            "metadata": metadata,
            "spec": spec,
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kubelet_shape_with_a_fresh_key_each_time() {
        let mut ann = BTreeMap::new();
        ann.insert("example.com/attestation".to_string(), "x".to_string());
        let a = build("edge-1", Some(300), &ann).unwrap();
        let b = build("edge-1", None, &BTreeMap::new()).unwrap();
        assert_ne!(a.key_pem, b.key_pem);
        assert!(a.key_pem.contains("BEGIN PRIVATE KEY"));
        assert!(a.csr_pem.contains("BEGIN CERTIFICATE REQUEST"));
        let o = &a.object;
        assert_eq!(o["spec"]["signerName"], SIGNER);
        assert_eq!(
            o["spec"]["usages"],
            serde_json::json!(["digital signature", "client auth"])
        );
        assert_eq!(o["spec"]["expirationSeconds"], 600, "raised to the minimum");
        assert_eq!(o["metadata"]["generateName"], "node-csr-");
        assert_eq!(o["metadata"]["annotations"]["example.com/attestation"], "x");
        assert!(b.object["spec"].get("expirationSeconds").is_none());
        assert!(b.object["metadata"].get("annotations").is_none());
        assert!(!a.public_key_der.is_empty());
    }
}
