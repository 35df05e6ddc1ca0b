//! The node's serving certificate, for its API on port 10250 (the kubelet's
//! `--rotate-server-certificates`): a kubelet-serving CSR ([`super::csr::build_serving`]) with
//! the Node's addresses as SANs and an EC P-256 key made on the device, sent as the node; the
//! issued certificate is kept 0600 in the data dir ([`super::files::serving_path`]) and
//! renewed with a new key at a random point between 70 % and 90 % of its window, or at once
//! when the Node reports an address the certificate does not name.
//!
//! What it has is published on a watch channel; the server serves nothing until a
//! certificate is there. A self-signed certificate is made only when the operator asks for it
//! (`self_signed`), and then loudly: nothing in the cluster can verify it.

use super::cert::{self, CertTimes, Standing};
use super::{csr, files, request};
use crate::backoff::BackoffPolicy;
use crate::kube::ApiClient;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// A serving certificate and its key, as the server loads them.
#[derive(Clone, PartialEq, Eq)]
pub struct ServingPair {
    /// PEM, the leaf first.
    pub cert_pem: String,
    /// PEM (PKCS#8).
    pub key_pem: String,
    /// Made on the device, signed by nobody the cluster trusts.
    pub self_signed: bool,
}

impl std::fmt::Debug for ServingPair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the key.
        f.debug_struct("ServingPair")
            .field("self_signed", &self.self_signed)
            .finish_non_exhaustive()
    }
}

/// The Node's addresses as SANs: DNS names (its Hostname) and IPs (its InternalIP).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Sans {
    pub dns: Vec<String>,
    pub ips: Vec<IpAddr>,
}

/// What the server watches: the certificate to serve, `None` until one exists.
pub type ServingWatch = watch::Receiver<Option<Arc<ServingPair>>>;

/// Where the addresses come from, asked before every round (the InternalIP may change).
pub type SansSource = Arc<dyn Fn() -> Sans + Send + Sync>;

/// Whether the certificate (DER) names every one of `sans` (pure).
pub fn covers(cert_der: &[u8], sans: &Sans) -> bool {
    use rustls::pki_types::{CertificateDer, DnsName, IpAddr as PkiIp, ServerName};
    let der = CertificateDer::from(cert_der);
    let Ok(cert) = webpki::EndEntityCert::try_from(&der) else {
        return false;
    };
    let dns_ok = sans.dns.iter().all(|d| {
        DnsName::try_from(d.as_str()).is_ok_and(|n| {
            cert.verify_is_valid_for_subject_name(&ServerName::DnsName(n.to_owned()))
                .is_ok()
        })
    });
    let ips_ok = sans.ips.iter().all(|ip| {
        cert.verify_is_valid_for_subject_name(&ServerName::IpAddress(PkiIp::from(*ip)))
            .is_ok()
    });
    dns_ok && ips_ok
}

/// What to do next about the serving certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Ask for one (none yet, expired, due for renewal, or missing an address).
    Request,
    Wait(Duration),
}

/// The next step (pure): `current` is the certificate's window and whether it names the
/// Node's addresses now.
pub fn decide(current: Option<(&CertTimes, bool)>, now: i64, jitter: f64) -> Step {
    let Some((times, covers)) = current else {
        return Step::Request;
    };
    if !covers {
        return Step::Request;
    }
    match cert::standing(times, now, jitter) {
        // A clock behind the signer's: served as it is, the client judges it.
        Standing::NotYetValid => Step::Wait(Duration::from_secs(30)),
        Standing::Expired => Step::Request,
        Standing::Valid { rotate_at } if now >= rotate_at => Step::Request,
        Standing::Valid { rotate_at } => {
            Step::Wait(Duration::from_secs(((rotate_at - now) as u64).clamp(1, 60)))
        }
    }
}

/// A self-signed serving certificate for `node_name` with `sans` (a year, as the kubelet's).
pub fn self_signed(node_name: &str, sans: &Sans) -> Result<ServingPair, csr::CsrError> {
    let crypto = |e: rcgen::Error| csr::CsrError::Crypto(e.to_string());
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(crypto)?;
    let mut p = rcgen::CertificateParams::new(sans.dns.clone()).map_err(crypto)?;
    p.subject_alt_names
        .extend(sans.ips.iter().map(|ip| rcgen::SanType::IpAddress(*ip)));
    let mut dn = rcgen::DistinguishedName::new();
    dn.push(
        rcgen::DnType::CommonName,
        format!("{node_name}@self-signed"),
    );
    p.distinguished_name = dn;
    p.key_usages = vec![rcgen::KeyUsagePurpose::DigitalSignature];
    p.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    // A day back for clocks a little behind; a year ahead.
    let now = unix_now().max(86_400) as u64;
    let epoch = rcgen::date_time_ymd(1970, 1, 1);
    p.not_before = epoch + Duration::from_secs(now - 86_400);
    p.not_after = epoch + Duration::from_secs(now + 365 * 86_400);
    let cert = p.self_signed(&key).map_err(crypto)?;
    Ok(ServingPair {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
        self_signed: true,
    })
}

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

#[derive(Debug, thiserror::Error)]
pub enum ServingError {
    #[error("serving certificate {path}: {reason}")]
    File { path: PathBuf, reason: String },
    #[error(transparent)]
    Csr(#[from] csr::CsrError),
}

struct Current {
    pair: ServingPair,
    times: CertTimes,
    der: Vec<u8>,
    jitter: f64,
}

impl Current {
    fn parse(pair: ServingPair) -> Result<Current, String> {
        let der = cert::first_pem_cert(&pair.cert_pem)?;
        let times = cert::parse(&der)?;
        Ok(Current {
            pair,
            times,
            der,
            jitter: fastrand::f64(),
        })
    }
}

/// The serving-certificate task.
pub struct ServingCert {
    client: ApiClient,
    node_name: String,
    path: PathBuf,
    sans: SansSource,
    expiration_secs: Option<u32>,
    current: Option<Current>,
    tx: watch::Sender<Option<Arc<ServingPair>>>,
    pub backoff: BackoffPolicy,
}

impl ServingCert {
    /// The task and the channel the server reads. A stored certificate is published at once;
    /// with `self_signed` (the operator's explicit choice) a self-signed one is made and
    /// published instead, no CSR is ever sent, and [`Self::run`] only waits for shutdown.
    pub fn setup(
        client: ApiClient,
        data_dir: &Path,
        node_name: &str,
        sans: SansSource,
        expiration_secs: Option<u32>,
        self_signed_opt_in: bool,
    ) -> Result<(ServingCert, ServingWatch), ServingError> {
        let path = files::serving_path(data_dir);
        let (tx, rx) = watch::channel(None);
        let mut current = None;
        if self_signed_opt_in {
            let pair = self_signed(node_name, &sans())?;
            tracing::warn!(
                node = node_name,
                "node API: serving a SELF-SIGNED certificate ([node] node_api_self_signed = true); \
                 no client can verify it, the apiserver's calls to this node are unauthenticated \
                 on its side"
            );
            tx.send_replace(Some(Arc::new(pair)));
        } else {
            match std::fs::read_to_string(&path) {
                Ok(text) => {
                    let bad = |reason: String| ServingError::File {
                        path: path.clone(),
                        reason,
                    };
                    let (c, k) = files::split(&text)
                        .ok_or_else(|| bad("not a certificate followed by its key".into()))?;
                    let cur = Current::parse(ServingPair {
                        cert_pem: c,
                        key_pem: k,
                        self_signed: false,
                    })
                    .map_err(bad)?;
                    tx.send_replace(Some(Arc::new(cur.pair.clone())));
                    current = Some(cur);
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(ServingError::File {
                        path,
                        reason: e.to_string(),
                    })
                }
            }
        }
        let task = ServingCert {
            client,
            node_name: node_name.to_string(),
            path,
            sans,
            expiration_secs,
            current,
            tx,
            backoff: BackoffPolicy {
                initial: Duration::from_secs(1),
                max: Duration::from_secs(300),
            },
        };
        Ok((task, rx))
    }

    /// Runs rounds until shutdown (only waits, with a self-signed certificate).
    pub async fn run(mut self, mut shutdown: watch::Receiver<bool>) {
        if self.tx.borrow().as_ref().is_some_and(|p| p.self_signed) {
            let _ = shutdown.wait_for(|s| *s).await;
            return;
        }
        let mut failures = 0u32;
        loop {
            if *shutdown.borrow() {
                return;
            }
            let sans = (self.sans)();
            let step = decide(
                self.current
                    .as_ref()
                    .map(|c| (&c.times, covers(&c.der, &sans))),
                unix_now(),
                self.current.as_ref().map(|c| c.jitter).unwrap_or(0.0),
            );
            let wait = match step {
                Step::Wait(d) => d,
                Step::Request => {
                    let outcome = tokio::select! {
                        r = self.round(&sans) => r,
                        _ = shutdown.changed() => return,
                    };
                    match outcome {
                        Ok(()) => {
                            failures = 0;
                            Duration::ZERO
                        }
                        Err(e) => {
                            failures += 1;
                            // A denial waits the longest backoff: a decision, not a fault.
                            let wait = request::retry_wait(&e, &self.backoff, failures);
                            if e.is_offline() {
                                tracing::info!(error = %e, retry_in = ?wait, "serving certificate round: apiserver unreachable");
                            } else {
                                tracing::warn!(error = %e, retry_in = ?wait, "serving certificate round failed");
                            }
                            wait
                        }
                    }
                }
            };
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = shutdown.changed() => {}
            }
        }
    }

    async fn round(&mut self, sans: &Sans) -> Result<(), request::RequestError> {
        let req = csr::build_serving(&self.node_name, &sans.dns, &sans.ips, self.expiration_secs)?;
        let issued = request::submit(&self.client, req, &self.node_name).await?;
        let bad = |reason: String| request::RequestError::Bad {
            name: issued.csr_name.clone(),
            reason,
        };
        let new = Current::parse(ServingPair {
            cert_pem: issued.cert_pem.clone(),
            key_pem: issued.key_pem.clone(),
            self_signed: false,
        })
        .map_err(bad)?;
        let want = format!("system:node:{}", self.node_name);
        if new.times.common_name.as_deref() != Some(want.as_str()) {
            return Err(bad(format!(
                "the issued certificate names {:?}, not {want}",
                new.times.common_name
            )));
        }
        let mut file = new.pair.cert_pem.clone();
        file.push_str(&new.pair.key_pem);
        files::write_private(&self.path, file.as_bytes())
            .map_err(|e| bad(format!("cannot write {}: {e}", self.path.display())))?;
        tracing::info!(
            csr = %issued.csr_name,
            not_after = new.times.not_after,
            dns = ?sans.dns,
            ips = ?sans.ips,
            "serving certificate issued and in use"
        );
        self.tx.send_replace(Some(Arc::new(new.pair.clone())));
        self.current = Some(new);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sans() -> Sans {
        Sans {
            dns: vec!["edge-1".into()],
            ips: vec!["10.0.2.15".parse().unwrap()],
        }
    }

    #[test]
    fn a_self_signed_certificate_names_the_addresses_it_was_made_for() {
        let pair = self_signed("edge-1", &sans()).unwrap();
        assert!(pair.self_signed);
        let der = cert::first_pem_cert(&pair.cert_pem).unwrap();
        assert!(covers(&der, &sans()));
        let more = Sans {
            dns: vec!["edge-1".into()],
            ips: vec!["10.0.2.15".parse().unwrap(), "10.0.2.16".parse().unwrap()],
        };
        assert!(!covers(&der, &more), "a new address is not covered");
        let other = Sans {
            dns: vec!["edge-2".into()],
            ips: vec![],
        };
        assert!(!covers(&der, &other));
        assert!(!covers(b"not a certificate", &sans()));
        let t = cert::parse(&der).unwrap();
        assert!(t.not_after - t.not_before > 300 * 86_400);
        assert!(!format!("{pair:?}").contains("PRIVATE"));
    }

    #[test]
    fn when_to_ask_for_a_serving_certificate() {
        let t = CertTimes {
            not_before: 1_000,
            not_after: 2_000,
            common_name: Some("system:node:edge-1".into()),
        };
        assert_eq!(decide(None, 1_500, 0.5), Step::Request);
        // A missing address: at once, however young the certificate.
        assert_eq!(decide(Some((&t, false)), 1_001, 0.5), Step::Request);
        // 70 %..90 % of the window, by the jitter.
        assert!(matches!(
            decide(Some((&t, true)), 1_500, 0.0),
            Step::Wait(_)
        ));
        assert_eq!(decide(Some((&t, true)), 1_700, 0.0), Step::Request);
        assert!(matches!(
            decide(Some((&t, true)), 1_850, 1.0),
            Step::Wait(_)
        ));
        assert_eq!(decide(Some((&t, true)), 1_900, 1.0), Step::Request);
        assert_eq!(decide(Some((&t, true)), 2_001, 0.5), Step::Request);
        assert_eq!(
            decide(Some((&t, true)), 500, 0.5),
            Step::Wait(Duration::from_secs(30))
        );
    }
}
