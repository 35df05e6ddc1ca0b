//! The node's identity: TLS bootstrap and client-certificate rotation, as the kubelet does
//! them, so one firmware image serves the whole fleet.
//!
//! With `[identity] bootstrap_kubeconfig` set, edgehub makes its own node credential: an EC
//! P-256 key made on the device (never sent anywhere) and a certificate for
//! `system:node:<node_name>` from a CSR ([`csr`], [`request`]), kept 0600 in the data dir
//! ([`files`]). The bootstrap kubeconfig (a bootstrap token, or a factory client certificate)
//! is used only while no valid node credential exists. The certificate is renewed with a new
//! key at a random point between 70 % and 90 % of its window ([`cert`]), as the node; the new
//! credential is swapped into the shared [`ApiClient`] (every clone sends it next, the watches
//! resume from their cursors) and replaces the old file only once it has worked.
//!
//! Offline nothing changes: rounds fail as offline and are tried again with backoff, while
//! the pods, the local API and upgrades carry on. A credential whose notBefore is ahead of the
//! device clock (a vehicle that booted at 1970) is kept, and used: the apiserver judges it by
//! its own clock.

pub mod cert;
pub mod check;
pub mod csr;
pub mod files;
pub mod request;
pub mod serving;

use crate::backoff::BackoffPolicy;
use crate::kube::{ApiClient, ClientOptions, Kubeconfig, KubeconfigError};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// `[identity]`: where the bootstrap credential is, and what certificate to ask for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IdentityConfig {
    /// A kubeconfig with a bootstrap token or a factory client certificate; `None`: the
    /// `kubeconfig` is the node credential, made by hand, and nothing here runs.
    pub bootstrap_kubeconfig: Option<PathBuf>,
    /// The `expirationSeconds` asked for (the signer's own duration when `None`).
    pub cert_expiration_secs: Option<u32>,
    /// The factory key (PKCS#8 PEM) and its certificate chain (PEM, the factory certificate
    /// first): with both, every CSR carries the device attestation ([`crate::attest`]) that
    /// the controller's attested approval checks. Both or neither.
    pub factory_key_file: Option<PathBuf>,
    pub factory_cert_file: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("bootstrap_kubeconfig: {0}")]
    Kubeconfig(#[from] KubeconfigError),
    #[error("bootstrap_kubeconfig {path}: {source}")]
    Tls {
        path: PathBuf,
        #[source]
        source: crate::kube::tls::TlsSetupError,
    },
    #[error("node credential {path}: {reason}")]
    Credential { path: PathBuf, reason: String },
    #[error("factory_key_file / factory_cert_file: {0}")]
    Factory(#[from] crate::attest::KeyError),
}

/// What the identity task has done, for benchmarks and the status.
#[derive(Debug, Default)]
pub struct IdentityStats {
    pub bootstraps: AtomicU64,
    pub rotations: AtomicU64,
    /// Bytes written to flash for credentials.
    pub bytes_written: AtomicU64,
}

/// A node credential in memory: its PEMs and what the identity task decides on.
#[derive(Debug, Clone)]
struct Credential {
    cert_pem: String,
    key_pem: String,
    times: cert::CertTimes,
    /// Where in 70–90 % of the window this one is renewed.
    jitter: f64,
}

impl Credential {
    fn parse(cert_pem: String, key_pem: String) -> Result<Credential, String> {
        let der = cert::first_pem_cert(&cert_pem)?;
        let times = cert::parse(&der)?;
        Ok(Credential {
            cert_pem,
            key_pem,
            times,
            jitter: fastrand::f64(),
        })
    }
}

/// The identity task: owns the node credential of a shared [`ApiClient`].
pub struct Identity {
    client: ApiClient,
    bootstrap_path: PathBuf,
    bootstrap: Kubeconfig,
    opts: ClientOptions,
    node_name: String,
    path: PathBuf,
    expiration_secs: Option<u32>,
    current: Option<Credential>,
    /// Added to every CSR.
    pub annotations: BTreeMap<String, String>,
    /// Signs every CSR's key and node name into the attestation annotation.
    pub attestation: Option<Arc<crate::attest::FactoryKey>>,
    pub stats: Arc<IdentityStats>,
    pub backoff: BackoffPolicy,
    /// How long a new credential may go without an answer before it is kept anyway.
    pub confirm_within: Duration,
}

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

impl Identity {
    /// The node client and its identity task. The client presents the stored node
    /// credential if there is one (even one the device clock calls expired or not yet valid:
    /// the apiserver's clock decides), else it sends nothing until the first bootstrap round
    /// has made one (requests fail as offline meanwhile, so nothing is parked).
    pub fn setup(
        config: &IdentityConfig,
        bootstrap_path: &Path,
        data_dir: &Path,
        node_name: &str,
        opts: ClientOptions,
    ) -> Result<(ApiClient, Identity), IdentityError> {
        let bootstrap = Kubeconfig::load(bootstrap_path)?;
        let tls = |source| IdentityError::Tls {
            path: bootstrap_path.to_path_buf(),
            source,
        };
        let path = files::credential_path(data_dir);
        let current = match std::fs::read_to_string(&path) {
            Ok(text) => {
                let bad = |reason: String| IdentityError::Credential {
                    path: path.clone(),
                    reason,
                };
                let (c, k) = files::split(&text)
                    .ok_or_else(|| bad("not a certificate followed by its key".into()))?;
                Some(Credential::parse(c, k).map_err(bad)?)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => {
                return Err(IdentityError::Credential {
                    path,
                    reason: e.to_string(),
                })
            }
        };
        // Read at startup, so a factory key that does not match its certificate is a clear
        // error now, not a denial from the controller later.
        let attestation = match (&config.factory_key_file, &config.factory_cert_file) {
            (Some(key), Some(chain)) => {
                Some(Arc::new(crate::attest::FactoryKey::load(key, chain)?))
            }
            _ => None,
        };
        let client = ApiClient::new(&bootstrap, opts.clone()).map_err(tls)?;
        match &current {
            Some(c) => client
                .set_credential(&node_kubeconfig(&bootstrap, c))
                .map_err(tls)?,
            None => client.clear_credential("no node credential yet: TLS bootstrap under way"),
        }
        Ok((
            client.clone(),
            Identity {
                client,
                bootstrap_path: bootstrap_path.to_path_buf(),
                bootstrap,
                opts,
                node_name: node_name.to_string(),
                path,
                expiration_secs: config.cert_expiration_secs,
                current,
                annotations: BTreeMap::new(),
                attestation,
                stats: Arc::default(),
                backoff: BackoffPolicy {
                    initial: Duration::from_secs(1),
                    max: Duration::from_secs(300),
                },
                confirm_within: Duration::from_secs(120),
            },
        ))
    }

    /// Runs rounds until shutdown.
    pub async fn run(mut self, mut shutdown: tokio::sync::watch::Receiver<bool>) {
        let mut failures = 0u32;
        loop {
            if *shutdown.borrow() {
                return;
            }
            let wait = match self.next_step() {
                Step::Wait(d) => d,
                step => {
                    let outcome = tokio::select! {
                        r = self.round(step) => r,
                        _ = shutdown.changed() => return,
                    };
                    match outcome {
                        Ok(()) => {
                            failures = 0;
                            Duration::ZERO
                        }
                        Err(e) => {
                            failures += 1;
                            let wait = self.backoff.jittered(failures);
                            if e.is_offline() {
                                tracing::info!(error = %e, retry_in = ?wait, "node certificate round: apiserver unreachable");
                            } else {
                                tracing::warn!(error = %e, retry_in = ?wait, "node certificate round failed");
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

    fn next_step(&self) -> Step {
        let Some(c) = &self.current else {
            return Step::Bootstrap;
        };
        let state = self.client.credential_state();
        if state.unauthorized > 0 {
            // The apiserver refuses the node credential (expired by its clock, or unknown
            // to it): back to the bootstrap credential.
            return Step::Bootstrap;
        }
        let now = unix_now();
        match cert::standing(&c.times, now, c.jitter) {
            cert::Standing::NotYetValid => Step::Wait(Duration::from_secs(30)),
            cert::Standing::Expired => Step::Bootstrap,
            cert::Standing::Valid { rotate_at } if now >= rotate_at => Step::Rotate,
            cert::Standing::Valid { rotate_at } => {
                Step::Wait(Duration::from_secs(((rotate_at - now) as u64).clamp(1, 5)))
            }
        }
    }

    async fn round(&mut self, step: Step) -> Result<(), request::RequestError> {
        let rotation = matches!(step, Step::Rotate);
        let issued = if rotation {
            request::obtain(
                &self.client,
                &self.node_name,
                self.expiration_secs,
                &self.annotations,
                self.attestation.as_deref(),
            )
            .await?
        } else {
            // Read again: a token handed over or a file replaced since the last round.
            if let Ok(kc) = Kubeconfig::load(&self.bootstrap_path) {
                self.bootstrap = kc;
            }
            let boot = ApiClient::new(&self.bootstrap, self.opts.clone()).map_err(|e| {
                request::RequestError::Bad {
                    name: "node-csr-".into(),
                    reason: format!("bootstrap_kubeconfig: {e}"),
                }
            })?;
            request::obtain(
                &boot,
                &self.node_name,
                self.expiration_secs,
                &self.annotations,
                self.attestation.as_deref(),
            )
            .await?
        };
        let bad = |reason: String| request::RequestError::Bad {
            name: issued.csr_name.clone(),
            reason,
        };
        let new =
            Credential::parse(issued.cert_pem.clone(), issued.key_pem.clone()).map_err(bad)?;
        let want = format!("system:node:{}", self.node_name);
        if new.times.common_name.as_deref() != Some(want.as_str()) {
            return Err(bad(format!(
                "the issued certificate names {:?}, not {want}",
                new.times.common_name
            )));
        }
        let kc = node_kubeconfig(&self.bootstrap, &new);
        self.client
            .set_credential(&kc)
            .map_err(|e| bad(format!("the issued certificate is unusable: {e}")))?;
        if rotation {
            // The old credential stays until the new one has worked once.
            if !self.confirmed().await {
                if let Some(old) = &self.current {
                    let _ = self
                        .client
                        .set_credential(&node_kubeconfig(&self.bootstrap, old));
                }
                return Err(bad(
                    "the apiserver refused the renewed certificate (401); keeping the old one"
                        .into(),
                ));
            }
        }
        let mut file = new.cert_pem.clone();
        file.push_str(&new.key_pem);
        let written = files::write_private(&self.path, file.as_bytes())
            .map_err(|e| bad(format!("cannot write {}: {e}", self.path.display())))?;
        self.stats
            .bytes_written
            .fetch_add(written, Ordering::Relaxed);
        let counter = if rotation {
            &self.stats.rotations
        } else {
            &self.stats.bootstraps
        };
        counter.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            csr = %issued.csr_name,
            not_after = new.times.not_after,
            rotation,
            "node certificate issued and in use"
        );
        self.current = Some(new);
        Ok(())
    }

    /// Waits for the credential just swapped in to get an answer: `true` once one worked
    /// (or none came within [`Self::confirm_within`]), `false` on a 401.
    async fn confirmed(&self) -> bool {
        let deadline = tokio::time::Instant::now() + self.confirm_within;
        loop {
            let s = self.client.credential_state();
            if s.worked {
                return true;
            }
            if s.unauthorized > 0 {
                return false;
            }
            if tokio::time::Instant::now() >= deadline {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Bootstrap,
    Rotate,
    Wait(Duration),
}

/// The node kubeconfig: the bootstrap kubeconfig's server and CA, the node's certificate.
fn node_kubeconfig(bootstrap: &Kubeconfig, c: &Credential) -> Kubeconfig {
    let mut kc = bootstrap.clone();
    kc.token = None;
    kc.client_cert = Some((
        c.cert_pem.clone().into_bytes(),
        c.key_pem.clone().into_bytes(),
    ));
    kc
}
