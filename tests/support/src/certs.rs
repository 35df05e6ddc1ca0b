//! Test PKI generated at test time: a CA, a server certificate for 127.0.0.1/localhost, and
//! client certificates whose DER the fake apiserver maps to identities.

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};

/// A CA with its issued server certificate.
pub struct TestPki {
    pub ca_pem: String,
    pub server_cert_pem: String,
    pub server_key_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

/// A client certificate and key (PEM), and its DER for identity lookup.
pub struct ClientCert {
    pub cert_pem: String,
    pub key_pem: String,
    pub der: Vec<u8>,
}

impl TestPki {
    pub fn generate() -> anyhow::Result<TestPki> {
        let ca_key = KeyPair::generate()?;
        let mut ca = CertificateParams::new(Vec::<String>::new())?;
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, "edgehub-test-ca");
        ca.distinguished_name = dn;
        let ca_cert = ca.self_signed(&ca_key)?;
        let issuer = Issuer::new(ca, ca_key);

        let server_key = KeyPair::generate()?;
        let mut sp = CertificateParams::new(vec!["localhost".to_string()])?;
        sp.subject_alt_names
            .push(SanType::IpAddress(std::net::Ipv4Addr::LOCALHOST.into()));
        sp.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, "kube-apiserver");
        sp.distinguished_name = dn;
        let server_cert = sp.signed_by(&server_key, &issuer)?;
        Ok(TestPki {
            ca_pem: ca_cert.pem(),
            server_cert_pem: server_cert.pem(),
            server_key_pem: server_key.serialize_pem(),
            issuer,
        })
    }

    /// A client certificate as Kubernetes issues them to nodes: CN=user, O=group.
    pub fn client_cert(&self, user: &str, group: &str) -> anyhow::Result<ClientCert> {
        let key = KeyPair::generate()?;
        let mut p = CertificateParams::new(Vec::<String>::new())?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, user);
        dn.push(DnType::OrganizationName, group);
        p.distinguished_name = dn;
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let cert = p.signed_by(&key, &self.issuer)?;
        Ok(ClientCert {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            der: cert.der().to_vec(),
        })
    }
}

/// A second, unrelated CA: a kubeconfig that trusts it must fail verification.
pub fn unrelated_ca_pem() -> anyhow::Result<String> {
    Ok(TestPki::generate()?.ca_pem)
}

/// What the fake's signer read from a PEM CSR.
pub struct ParsedCsr {
    pub common_name: Option<String>,
    pub organizations: Vec<String>,
    /// Whether the CSR asks for subject alternative names (a kubelet client CSR may not).
    pub has_sans: bool,
    /// Its DNS names and IP addresses (what a kubelet serving CSR asks for).
    pub dns_names: Vec<String>,
    pub ip_addresses: Vec<std::net::IpAddr>,
    /// Whether it asks for email, URI or other names (a kubelet serving CSR may not).
    pub other_sans: bool,
    params: rcgen::CertificateSigningRequestParams,
}

/// Parses a PEM `CERTIFICATE REQUEST` (its signature checked).
pub fn parse_csr(pem: &str) -> Result<ParsedCsr, String> {
    let params =
        rcgen::CertificateSigningRequestParams::from_pem(pem).map_err(|e| e.to_string())?;
    let text = |v: &rcgen::DnValue| match v {
        rcgen::DnValue::Utf8String(s) => s.clone(),
        rcgen::DnValue::PrintableString(s) => s.as_str().to_string(),
        rcgen::DnValue::Ia5String(s) => s.as_str().to_string(),
        rcgen::DnValue::TeletexString(s) => s.as_str().to_string(),
        other => format!("{other:?}"),
    };
    let mut common_name = None;
    let mut organizations = Vec::new();
    for (ty, v) in params.params.distinguished_name.iter() {
        match ty {
            DnType::CommonName => common_name = Some(text(v)),
            DnType::OrganizationName => organizations.push(text(v)),
            _ => {}
        }
    }
    let mut dns_names = Vec::new();
    let mut ip_addresses = Vec::new();
    let mut other_sans = false;
    for san in &params.params.subject_alt_names {
        match san {
            SanType::DnsName(d) => dns_names.push(d.as_str().to_string()),
            SanType::IpAddress(ip) => ip_addresses.push(*ip),
            _ => other_sans = true,
        }
    }
    Ok(ParsedCsr {
        common_name,
        organizations,
        has_sans: !params.params.subject_alt_names.is_empty(),
        dns_names,
        ip_addresses,
        other_sans,
        params,
    })
}

/// A certificate the fake's CSR signer issued: its PEM and DER.
pub struct Issued {
    pub cert_pem: String,
    pub der: Vec<u8>,
}

impl TestPki {
    /// Signs a CSR as kube-controller-manager's kubelet-client signer does: the CSR's subject
    /// and key, Key Usage digital signature (+ key encipherment when asked), Extended Key Usage
    /// client auth, CA:FALSE, an Authority Key Identifier, a 128-bit serial, no SANs.
    pub fn sign_csr(
        &self,
        csr: &ParsedCsr,
        key_encipherment: bool,
        not_before: std::time::SystemTime,
        not_after: std::time::SystemTime,
    ) -> anyhow::Result<Issued> {
        self.sign(csr, key_encipherment, false, not_before, not_after)
    }

    /// Signs a CSR as the kubelet-serving signer does: as [`Self::sign_csr`], but Extended Key
    /// Usage server auth and the CSR's DNS and IP subject alternative names.
    pub fn sign_serving_csr(
        &self,
        csr: &ParsedCsr,
        key_encipherment: bool,
        not_before: std::time::SystemTime,
        not_after: std::time::SystemTime,
    ) -> anyhow::Result<Issued> {
        self.sign(csr, key_encipherment, true, not_before, not_after)
    }

    fn sign(
        &self,
        csr: &ParsedCsr,
        key_encipherment: bool,
        serving: bool,
        not_before: std::time::SystemTime,
        not_after: std::time::SystemTime,
    ) -> anyhow::Result<Issued> {
        let mut p = CertificateParams::new(Vec::<String>::new())?;
        p.distinguished_name = csr.params.params.distinguished_name.clone();
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        if key_encipherment {
            p.key_usages.push(KeyUsagePurpose::KeyEncipherment);
        }
        if serving {
            p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
            p.subject_alt_names = csr.params.params.subject_alt_names.clone();
        } else {
            p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        }
        p.is_ca = IsCa::ExplicitNoCa;
        p.use_authority_key_identifier_extension = true;
        let mut serial = [0u8; 16];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut serial)
            .map_err(|_| anyhow::anyhow!("no randomness for a serial"))?;
        serial[0] &= 0x7f;
        p.serial_number = Some(rcgen::SerialNumber::from_slice(&serial));
        p.not_before = time::OffsetDateTime::from(not_before);
        p.not_after = time::OffsetDateTime::from(not_after);
        let req = rcgen::CertificateSigningRequestParams {
            params: p,
            public_key: csr.params.public_key.clone(),
        };
        let cert = req.signed_by(&self.issuer)?;
        Ok(Issued {
            cert_pem: cert.pem(),
            der: cert.der().to_vec(),
        })
    }
}

/// A node's CSR as edgehub and the kubelet make it: a fresh EC P-256 key, subject
/// `O=<org>, CN=<cn>`, no SANs. Returns (CSR PEM, key PEM).
pub fn node_csr(cn: &str, org: &str) -> anyhow::Result<(String, String)> {
    let key = KeyPair::generate()?;
    let mut p = CertificateParams::new(Vec::<String>::new())?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, org);
    dn.push(DnType::CommonName, cn);
    p.distinguished_name = dn;
    let csr = p.serialize_request(&key)?;
    Ok((csr.pem()?, key.serialize_pem()))
}

/// A kubelet serving CSR: a fresh EC P-256 key, subject `O=system:nodes, CN=<cn>`, and the
/// given DNS names and IP addresses as SANs. Returns (CSR PEM, key PEM).
pub fn serving_csr(
    cn: &str,
    dns: &[&str],
    ips: &[std::net::IpAddr],
) -> anyhow::Result<(String, String)> {
    let key = KeyPair::generate()?;
    let mut p = CertificateParams::new(dns.iter().map(|d| d.to_string()).collect::<Vec<_>>())?;
    p.subject_alt_names
        .extend(ips.iter().map(|ip| SanType::IpAddress(*ip)));
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "system:nodes");
    dn.push(DnType::CommonName, cn);
    p.distinguished_name = dn;
    let csr = p.serialize_request(&key)?;
    Ok((csr.pem()?, key.serialize_pem()))
}

/// What a test checks in an issued certificate.
#[derive(Debug, Clone)]
pub struct CertInfo {
    pub subject: String,
    pub issuer: String,
    pub not_before: i64,
    pub not_after: i64,
    pub client_auth: bool,
    pub server_auth: bool,
    pub digital_signature: bool,
    pub is_ca: bool,
    pub has_san: bool,
    /// The DNS names and IP addresses among the SANs, as text.
    pub sans: Vec<String>,
    pub serial_bits: u64,
}

/// Reads a PEM certificate.
pub fn cert_info(pem: &str) -> anyhow::Result<CertInfo> {
    use x509_parser::prelude::*;
    let (_, p) = parse_x509_pem(pem.as_bytes())?;
    let c = p.parse_x509()?;
    let eku = c.extended_key_usage()?.map(|e| e.value.client_auth);
    let server_auth = c.extended_key_usage()?.map(|e| e.value.server_auth);
    let mut sans = Vec::new();
    if let Some(s) = c.subject_alternative_name()? {
        for n in &s.value.general_names {
            match n {
                GeneralName::DNSName(d) => sans.push(d.to_string()),
                GeneralName::IPAddress(b) => match b.len() {
                    4 => sans.push(std::net::IpAddr::from(<[u8; 4]>::try_from(*b)?).to_string()),
                    16 => sans.push(std::net::IpAddr::from(<[u8; 16]>::try_from(*b)?).to_string()),
                    _ => {}
                },
                _ => {}
            }
        }
    }
    let ku = c.key_usage()?.map(|k| k.value.digital_signature());
    Ok(CertInfo {
        subject: c.subject().to_string(),
        issuer: c.issuer().to_string(),
        not_before: c.validity().not_before.timestamp(),
        not_after: c.validity().not_after.timestamp(),
        client_auth: eku.unwrap_or(false),
        server_auth: server_auth.unwrap_or(false),
        digital_signature: ku.unwrap_or(false),
        is_ca: c.is_ca(),
        has_san: c.subject_alternative_name()?.is_some(),
        sans,
        serial_bits: c.serial.bits(),
    })
}
