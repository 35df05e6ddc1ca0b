//! The device's key and its CertificateSigningRequest, in one place: the kubelet's shape
//! (signer `kubernetes.io/kube-apiserver-client-kubelet`, `O=system:nodes`,
//! `CN=system:node:<name>`, usages digital signature + client auth, EC P-256, no SANs).
//! Extra annotations are the extension point: the attested-approval setup adds its factory
//! certificate chain and signature there ([`build`]'s `annotations`).

use base64::Engine;
use std::collections::BTreeMap;

/// The signer of kubelet client certificates.
pub const SIGNER: &str = "kubernetes.io/kube-apiserver-client-kubelet";

/// The signer of kubelet serving certificates (the node's API on port 10250). The built-in
/// approver leaves these pending: `edgehub controller`'s approver, or an operator, approves.
pub const SERVING_SIGNER: &str = "kubernetes.io/kubelet-serving";

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
    make(
        node_name,
        expiration_secs,
        annotations,
        Kind::Client,
        &[],
        &[],
    )
}

/// A new EC P-256 key and the kubelet-serving CSR for `node_name`, with the Node's DNS names
/// and IP addresses as SANs (usages digital signature + server auth: no key encipherment
/// for an EC key, as the kubelet asks).
pub fn build_serving(
    node_name: &str,
    dns_names: &[String],
    ips: &[std::net::IpAddr],
    expiration_secs: Option<u32>,
) -> Result<Request, CsrError> {
    make(
        node_name,
        expiration_secs,
        &BTreeMap::new(),
        Kind::Serving,
        dns_names,
        ips,
    )
}

#[derive(Clone, Copy)]
enum Kind {
    Client,
    Serving,
}

fn make(
    node_name: &str,
    expiration_secs: Option<u32>,
    annotations: &BTreeMap<String, String>,
    kind: Kind,
    dns_names: &[String],
    ips: &[std::net::IpAddr],
) -> Result<Request, CsrError> {
    let crypto = |e: rcgen::Error| CsrError::Crypto(e.to_string());
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(crypto)?;
    let mut params = rcgen::CertificateParams::new(dns_names.to_vec()).map_err(crypto)?;
    params
        .subject_alt_names
        .extend(ips.iter().map(|ip| rcgen::SanType::IpAddress(*ip)));
    let mut dn = rcgen::DistinguishedName::new();
    dn.push(rcgen::DnType::OrganizationName, "system:nodes");
    dn.push(
        rcgen::DnType::CommonName,
        format!("system:node:{node_name}"),
    );
    params.distinguished_name = dn;
    let csr = params.serialize_request(&key).map_err(crypto)?;
    let csr_pem = csr.pem().map_err(crypto)?;
    let (signer, usages, generate_name) = match kind {
        Kind::Client => (SIGNER, ["digital signature", "client auth"], "node-csr-"),
        Kind::Serving => (SERVING_SIGNER, ["digital signature", "server auth"], "csr-"),
    };
    let mut spec = serde_json::json!({
        "request": base64::engine::general_purpose::STANDARD.encode(csr_pem.as_bytes()),
        "signerName": signer,
        "usages": usages,
    });
    if let Some(e) = expiration_secs {
        spec["expirationSeconds"] = e.max(600).into();
    }
    let mut metadata = serde_json::json!({"generateName": generate_name});
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

    #[test]
    fn the_serving_shape_names_the_nodes_addresses() {
        let ips = ["10.0.2.15".parse().unwrap()];
        let r = build_serving("edge-1", &["edge-1".to_string()], &ips, None).unwrap();
        let o = &r.object;
        assert_eq!(o["spec"]["signerName"], SERVING_SIGNER);
        assert_eq!(
            o["spec"]["usages"],
            serde_json::json!(["digital signature", "server auth"])
        );
        assert_eq!(o["metadata"]["generateName"], "csr-");
        // The DER carries the IP SAN's four bytes, the DNS SAN and the node's name.
        let b64: String = r
            .csr_pem
            .lines()
            .filter(|l| !l.starts_with("-----"))
            .collect();
        let der = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .unwrap();
        let has = |needle: &[u8]| der.windows(needle.len()).any(|w| w == needle);
        assert!(has(&[0x87, 4, 10, 0, 2, 15]), "IP SAN");
        assert!(has(b"\x82\x06edge-1"), "DNS SAN");
        assert!(has(b"system:node:edge-1"));
    }
}
