//! What `edgehub check-config` says of a kubeconfig's credentials: that a `tokenFile` exists
//! and holds a token, and a client certificate's dates against the device clock. Pure but for
//! reading the token file.

use super::cert;
use crate::kube::kubeconfig::TokenSource;
use crate::kube::Kubeconfig;
use std::time::{Duration, SystemTime};

/// One line per credential, or the first problem that makes the kubeconfig unusable.
pub fn credentials(kc: &Kubeconfig, now: SystemTime) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    match &kc.token {
        Some(TokenSource::File(p)) => match std::fs::read_to_string(p) {
            Ok(t) if !t.trim().is_empty() => out.push(format!("tokenFile {} (read)", p.display())),
            Ok(_) => return Err(format!("tokenFile {} is empty", p.display())),
            Err(e) => return Err(format!("tokenFile {}: {e}", p.display())),
        },
        Some(TokenSource::Inline(_)) => out.push("token (inline)".into()),
        None => {}
    }
    if let Some((pem, _)) = &kc.client_cert {
        let text = String::from_utf8_lossy(pem);
        out.push(client_cert_dates(&text, now)?);
    }
    Ok(out)
}

/// The dates of a PEM client certificate: an error once it expired; a line that warns when
/// the device clock is behind its notBefore (kept: the apiserver judges by its own clock).
pub fn client_cert_dates(pem: &str, now: SystemTime) -> Result<String, String> {
    let der = cert::first_pem_cert(pem).map_err(|e| format!("client certificate: {e}"))?;
    let c = cert::parse(&der).map_err(|e| format!("client certificate: {e}"))?;
    let at = |s: i64| {
        crate::time::rfc3339(SystemTime::UNIX_EPOCH + Duration::from_secs(s.max(0) as u64))
    };
    let now_s = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let who = c.common_name.clone().unwrap_or_else(|| "no CN".into());
    match cert::standing(&c, now_s, 0.0) {
        cert::Standing::Expired => Err(format!(
            "client certificate {who} expired at {} (now {})",
            at(c.not_after),
            at(now_s)
        )),
        cert::Standing::NotYetValid => Ok(format!(
            "client certificate {who} not valid before {}, the device clock says {}: the clock is behind; the certificate is kept",
            at(c.not_before),
            at(now_s)
        )),
        cert::Standing::Valid { .. } => Ok(format!(
            "client certificate {who} valid {} to {}",
            at(c.not_before),
            at(c.not_after)
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert(from: (i32, u8, u8), to: (i32, u8, u8)) -> String {
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        p.distinguished_name
            .push(rcgen::DnType::CommonName, "system:node:edge-1");
        p.not_before = rcgen::date_time_ymd(from.0, from.1, from.2);
        p.not_after = rcgen::date_time_ymd(to.0, to.1, to.2);
        p.self_signed(&key).unwrap().pem()
    }

    fn at(y: i64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(((y - 1970) * 365 * 86_400) as u64)
    }

    #[test]
    fn a_client_certificates_dates_against_the_clock() {
        let pem = cert((2026, 1, 1), (2027, 1, 1));
        let ok = client_cert_dates(&pem, at(2026) + Duration::from_secs(30 * 86_400)).unwrap();
        assert!(
            ok.contains("valid 2026-01-01T00:00:00Z to 2027-01-01T00:00:00Z"),
            "{ok}"
        );
        let e = client_cert_dates(&pem, at(2028)).unwrap_err();
        assert!(
            e.contains("system:node:edge-1 expired at 2027-01-01T00:00:00Z"),
            "{e}"
        );
        let behind = client_cert_dates(&pem, at(1970)).unwrap();
        assert!(
            behind.contains("the clock is behind") && behind.contains("kept"),
            "{behind}"
        );
        assert!(client_cert_dates("nothing", at(2026)).is_err());
    }

    #[test]
    fn a_token_file_must_exist_and_hold_a_token() {
        let d = tempfile::tempdir().unwrap();
        let mut kc = Kubeconfig {
            server: "https://10.0.0.1:6443".into(),
            ca_pem: Vec::new(),
            tls_server_name: None,
            token: Some(TokenSource::File(d.path().join("token"))),
            client_cert: None,
        };
        let e = credentials(&kc, SystemTime::now()).unwrap_err();
        assert!(e.contains("tokenFile") && e.contains("token"), "{e}");
        std::fs::write(d.path().join("token"), "\n").unwrap();
        assert!(credentials(&kc, SystemTime::now())
            .unwrap_err()
            .contains("is empty"));
        std::fs::write(d.path().join("token"), "edge01.0123456789abcdef\n").unwrap();
        assert_eq!(credentials(&kc, SystemTime::now()).unwrap().len(), 1);
        kc.client_cert = Some((cert((2020, 1, 1), (2021, 1, 1)).into_bytes(), Vec::new()));
        assert!(credentials(&kc, SystemTime::now())
            .unwrap_err()
            .contains("expired at 2021"));
    }
}
