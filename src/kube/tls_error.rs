//! What a failed TLS handshake says, in words a person can act on: which side's certificate
//! was refused and why, or that the other end does not speak TLS at all. Pure, unit-tested.

use rustls::{AlertDescription, CertificateError, Error};

/// What failed and what to check, for a rustls error of the handshake with the apiserver.
pub fn describe(e: &Error) -> String {
    use CertificateError as C;
    match e {
        Error::InvalidCertificate(c) => match c {
            C::UnknownIssuer | C::BadSignature => format!(
                "the apiserver's certificate is signed by a CA this kubeconfig does not trust (unknown CA: {e}); check certificate-authority(-data)"
            ),
            C::Expired | C::ExpiredContext { .. } => format!(
                "the apiserver's certificate has expired, or the device clock is ahead ({e})"
            ),
            C::NotValidYet | C::NotValidYetContext { .. } => format!(
                "the apiserver's certificate is not valid yet: the device clock is probably behind ({e})"
            ),
            C::NotValidForName | C::NotValidForNameContext { .. } => format!(
                "the apiserver's certificate is not for this address ({e}); check server and tls-server-name"
            ),
            _ => format!("the apiserver's certificate was refused ({e}); check certificate-authority(-data) and server"),
        },
        Error::AlertReceived(a) => match a {
            AlertDescription::CertificateExpired => format!(
                "the apiserver refused edgehub's client certificate as expired ({e}); the node credential must be renewed"
            ),
            AlertDescription::BadCertificate
            | AlertDescription::UnknownCA
            | AlertDescription::CertificateUnknown
            | AlertDescription::UnsupportedCertificate
            | AlertDescription::CertificateRevoked
            | AlertDescription::AccessDenied => format!(
                "the apiserver refused edgehub's client certificate ({e}); check client-certificate and client-key"
            ),
            _ => format!("the apiserver ended the handshake ({e})"),
        },
        Error::InvalidMessage(_) | Error::InappropriateMessage { .. } => format!(
            "the server does not speak TLS on that port ({e}): a plain HTTP port, or not an apiserver; check server"
        ),
        _ => format!("TLS handshake failed ({e})"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_failure_is_named() {
        for (e, want) in [
            (
                Error::InvalidCertificate(CertificateError::UnknownIssuer),
                "unknown CA",
            ),
            (
                Error::InvalidCertificate(CertificateError::Expired),
                "has expired",
            ),
            (
                Error::InvalidCertificate(CertificateError::NotValidYet),
                "clock is probably behind",
            ),
            (
                Error::InvalidCertificate(CertificateError::NotValidForName),
                "tls-server-name",
            ),
            (
                Error::AlertReceived(AlertDescription::CertificateExpired),
                "client certificate as expired",
            ),
            (
                Error::AlertReceived(AlertDescription::BadCertificate),
                "client-certificate",
            ),
            (
                Error::InvalidMessage(rustls::InvalidMessage::InvalidContentType),
                "does not speak TLS",
            ),
        ] {
            let d = describe(&e);
            assert!(d.contains(want), "{e:?}: {d}");
        }
    }
}
