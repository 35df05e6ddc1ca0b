//! A CSR's PKCS#10 request, as far as the approver reads it: the subject, the public key and
//! whether it asks for subjectAltNames.

use x509_parser::certification_request::X509CertificationRequest;
use x509_parser::extensions::{GeneralName, ParsedExtension};
use x509_parser::prelude::FromDer;

/// The node client CSR's subject prefix and organisation.
pub const NODE_USER_PREFIX: &str = "system:node:";
pub const NODES_GROUP: &str = "system:nodes";

/// Why `spec.request` is not a PKCS#10 request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("spec.request is not a PEM certificate request: {0}")]
pub struct RequestError(String);

/// The parts of a PKCS#10 request the approver decides on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeRequest {
    /// The subject's common names and organisations, in order.
    pub common_names: Vec<String>,
    pub organizations: Vec<String>,
    /// The SubjectPublicKeyInfo, DER: what the attestation signs.
    pub spki_der: Vec<u8>,
    /// An RSA key (key encipherment is then an accepted usage).
    pub rsa: bool,
    /// subjectAltNames the request asks for (a node client certificate has none).
    pub alt_names: usize,
    /// Of those, the DNS names and IP addresses (what a serving certificate names).
    pub dns_names: Vec<String>,
    pub ip_addresses: Vec<std::net::IpAddr>,
}

/// rsaEncryption, 1.2.840.113549.1.1.1.
const RSA_OID: &str = "1.2.840.113549.1.1.1";

impl NodeRequest {
    pub fn parse(pem: &[u8]) -> Result<NodeRequest, RequestError> {
        let err = |s: String| RequestError(s);
        let (_, p) = x509_parser::pem::parse_x509_pem(pem).map_err(|e| err(e.to_string()))?;
        if p.label != "CERTIFICATE REQUEST" && p.label != "NEW CERTIFICATE REQUEST" {
            return Err(err(format!("a PEM {:?} block", p.label)));
        }
        let (rest, csr) =
            X509CertificationRequest::from_der(&p.contents).map_err(|e| err(e.to_string()))?;
        if !rest.is_empty() {
            return Err(err(format!("{} bytes after the request", rest.len())));
        }
        let info = &csr.certification_request_info;
        let strings =
            |it: &mut dyn Iterator<Item = &x509_parser::x509::AttributeTypeAndValue<'_>>| {
                it.map(|a| a.as_str().map(str::to_string))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| err(format!("a subject attribute is not a string: {e}")))
            };
        let common_names = strings(&mut info.subject.iter_common_name())?;
        let organizations = strings(&mut info.subject.iter_organization())?;
        let alt_names = csr
            .requested_extensions()
            .into_iter()
            .flatten()
            .map(|e| match e {
                ParsedExtension::SubjectAlternativeName(san) => san.general_names.len().max(1),
                _ => 0,
            })
            .sum();
        let mut dns_names = Vec::new();
        let mut ip_addresses = Vec::new();
        for e in csr.requested_extensions().into_iter().flatten() {
            if let ParsedExtension::SubjectAlternativeName(san) = e {
                for n in &san.general_names {
                    match n {
                        GeneralName::DNSName(d) => dns_names.push(d.to_string()),
                        GeneralName::IPAddress(b) => {
                            if let Ok(v4) = <[u8; 4]>::try_from(*b) {
                                ip_addresses.push(std::net::IpAddr::from(v4));
                            } else if let Ok(v6) = <[u8; 16]>::try_from(*b) {
                                ip_addresses.push(std::net::IpAddr::from(v6));
                            }
                        }
                        _ => {}
                    }
                }
            }
        }
        Ok(NodeRequest {
            common_names,
            organizations,
            spki_der: info.subject_pki.raw.to_vec(),
            rsa: info.subject_pki.algorithm.algorithm.to_id_string() == RSA_OID,
            alt_names,
            dns_names,
            ip_addresses,
        })
    }

    /// The node name of a node client CSR: subject `O=system:nodes, CN=system:node:<name>`,
    /// one of each, a DNS-1123 subdomain, and no subjectAltNames; else what is wrong.
    pub fn node_name(&self) -> Result<&str, String> {
        if self.organizations != [NODES_GROUP] {
            return Err(format!(
                "subject organisations {:?}: a node client CSR has exactly O={NODES_GROUP}",
                self.organizations
            ));
        }
        let [cn] = self.common_names.as_slice() else {
            return Err(format!(
                "subject common names {:?}: a node client CSR has one, CN={NODE_USER_PREFIX}<name>",
                self.common_names
            ));
        };
        let Some(name) = cn.strip_prefix(NODE_USER_PREFIX) else {
            return Err(format!(
                "subject CN {cn:?}: a node client CSR has CN={NODE_USER_PREFIX}<name>"
            ));
        };
        crate::names::check_subdomain(name)
            .map_err(|e| format!("subject CN {cn:?}: the node name is invalid: {e}"))?;
        if self.alt_names > 0 {
            return Err(format!(
                "it asks for {} subjectAltNames: a node client CSR has none",
                self.alt_names
            ));
        }
        Ok(name)
    }
}
