//! rustls client configuration from kubeconfig material, with the `ring` provider (smaller
//! than aws-lc-rs on the device; see shared notes on crate sizes).

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum TlsSetupError {
    #[error("certificate-authority: {0}")]
    Ca(String),
    #[error("client certificate: {0}")]
    ClientCert(String),
    #[error("TLS setup: {0}")]
    Rustls(#[from] rustls::Error),
}

/// A client config that trusts exactly the CAs in `ca_pem` and, if given, presents the client
/// certificate chain and key (both PEM).
pub fn client_config(
    ca_pem: &[u8],
    client_cert: Option<(&[u8], &[u8])>,
) -> Result<rustls::ClientConfig, TlsSetupError> {
    let mut roots = rustls::RootCertStore::empty();
    let mut found = 0;
    for cert in CertificateDer::pem_slice_iter(ca_pem) {
        let cert = cert.map_err(|e| TlsSetupError::Ca(format!("not valid PEM: {e}")))?;
        roots
            .add(cert)
            .map_err(|e| TlsSetupError::Ca(format!("unusable certificate: {e}")))?;
        found += 1;
    }
    if found == 0 {
        return Err(TlsSetupError::Ca("no PEM certificate found".into()));
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots);
    let config = match client_cert {
        None => builder.with_no_client_auth(),
        Some((cert_pem, key_pem)) => {
            let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem)
                .collect::<Result<_, _>>()
                .map_err(|e| {
                    TlsSetupError::ClientCert(format!("certificate is not valid PEM: {e}"))
                })?;
            if chain.is_empty() {
                return Err(TlsSetupError::ClientCert("no PEM certificate found".into()));
            }
            let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| {
                TlsSetupError::ClientCert(format!("key is not a valid PEM private key: {e}"))
            })?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| TlsSetupError::ClientCert(e.to_string()))?
        }
    };
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn garbage_ca_is_refused() {
        assert!(matches!(
            client_config(b"hello", None),
            Err(TlsSetupError::Ca(_))
        ));
        let bad = b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
        assert!(matches!(
            client_config(bad, None),
            Err(TlsSetupError::Ca(_))
        ));
    }
}
