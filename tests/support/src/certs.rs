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
