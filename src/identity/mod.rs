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
//!
//! What lapsed, and when, is kept current in [`status::IdentityStatus`] for the status
//! surfaces; a bootstrap token handed over locally ([`handover`]) wakes the task and is the
//! first candidate of the next bootstrap round.

pub mod cert;
pub mod check;
pub mod csr;
pub mod files;
pub mod handover;
pub mod request;
pub mod serving;
pub mod status;

use crate::backoff::BackoffPolicy;
use crate::kube::kubeconfig::TokenSource;
use crate::kube::{ApiClient, ClientOptions, Kubeconfig, KubeconfigError};
use handover::{Candidate, Handover, KubeconfigCredential};
use status::{BootstrapSeen, IdentityStatus, LastDenial};
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
    handover: Arc<Handover>,
    /// Where the next bootstrap round's first candidate comes from, for the status.
    bootstrap_source: &'static str,
    bootstrap_seen: BootstrapSeen,
    /// The apiserver answered 401 to the node certificate since this unix second.
    cert_refused_since: Option<i64>,
    /// The last CSR an approver denied, until a certificate is issued.
    last_denial: Option<LastDenial>,
    status: tokio::sync::watch::Sender<IdentityStatus>,
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
                handover: Arc::new(Handover::new(handover::token_path(data_dir), None)),
                bootstrap_source: "kubeconfig",
                bootstrap_seen: BootstrapSeen::Unused,
                cert_refused_since: None,
                last_denial: None,
                status: tokio::sync::watch::channel(IdentityStatus::starting()).0,
            },
        ))
    }

    /// Seals the handed-over bootstrap token with the device key (call before
    /// [`Identity::handover`] is shared).
    pub fn set_seal(&mut self, seal: Option<Arc<dyn handover::TokenSeal>>) {
        self.handover = Arc::new(Handover::new(self.handover.path.clone(), seal));
    }

    /// The handover's file and wakeup, for `PUT /v1/bootstrap-token`.
    pub fn handover(&self) -> Arc<Handover> {
        self.handover.clone()
    }

    /// Which credential is in use and which lapsed when, kept current by [`Identity::run`].
    pub fn status(&self) -> tokio::sync::watch::Receiver<IdentityStatus> {
        self.publish();
        self.status.subscribe()
    }

    /// Puts what the task has seen into the status channel (receivers wake only on a change).
    fn publish(&self) {
        let next = status::compute(&status::Inputs {
            now: unix_now(),
            cert: self.current.as_ref().map(|c| &c.times),
            cert_refused_since: self.cert_refused_since,
            bootstrap: &self.bootstrap_seen,
            bootstrap_source: self.bootstrap_source,
            last_denial: self.last_denial.as_ref(),
        });
        self.status.send_if_modified(|cur| {
            if *cur == next {
                return false;
            }
            for l in next.lapsed.iter().filter(|l| !cur.lapsed.contains(l)) {
                tracing::warn!(credential = ?l.credential, reason = %l.reason, since = %l.since,
                    "credential lapsed");
            }
            *cur = next;
            true
        });
    }

    /// Runs rounds until shutdown.
    pub async fn run(mut self, mut shutdown: tokio::sync::watch::Receiver<bool>) {
        let mut failures = 0u32;
        let handover = self.handover.clone();
        loop {
            if *shutdown.borrow() {
                return;
            }
            if self.client.credential_state().unauthorized > 0 && self.current.is_some() {
                self.cert_refused_since.get_or_insert_with(unix_now);
            }
            self.publish();
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
                            self.last_denial = None;
                            Duration::ZERO
                        }
                        Err(e) => {
                            failures += 1;
                            let wait = request::retry_wait(&e, &self.backoff, failures);
                            if let request::RequestError::Denied {
                                name,
                                reason,
                                message,
                                at,
                            } = &e
                            {
                                tracing::warn!(csr = %name, reason, %message, retry_in = ?wait,
                                    "node certificate request denied; asking again after the longest backoff");
                                self.last_denial = Some(LastDenial {
                                    csr: name.clone(),
                                    reason: reason.clone(),
                                    message: message.clone(),
                                    at: at.clone().unwrap_or_else(crate::time::now),
                                });
                            } else if e.is_offline() {
                                tracing::info!(error = %e, retry_in = ?wait, "node certificate round: apiserver unreachable");
                            } else {
                                tracing::warn!(error = %e, retry_in = ?wait, "node certificate round failed");
                            }
                            wait
                        }
                    }
                }
            };
            // Waits in slices of at most a second, so the status stays current (a certificate
            // that expires during a long backoff is shown as expired when it does).
            let until = tokio::time::Instant::now() + wait;
            loop {
                let slice = until
                    .saturating_duration_since(tokio::time::Instant::now())
                    .min(Duration::from_secs(1));
                tokio::select! {
                    _ = tokio::time::sleep(slice) => {}
                    // A token handed over: bootstrap now, not at the end of the backoff.
                    _ = handover.woken() => {
                        failures = 0;
                        break;
                    }
                    _ = shutdown.changed() => break,
                }
                if self.client.credential_state().unauthorized > 0 && self.current.is_some() {
                    self.cert_refused_since.get_or_insert_with(unix_now);
                }
                self.publish();
                if tokio::time::Instant::now() >= until {
                    break;
                }
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
            self.bootstrap_round().await?
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
        self.cert_refused_since = None;
        if !rotation {
            // Not needed again until the node certificate lapses.
            self.bootstrap_seen = BootstrapSeen::Unused;
        }
        Ok(())
    }

    /// A bootstrap round: each candidate ([`handover::bootstrap_candidates`]) in turn until
    /// one is not refused (401); what the bootstrap credential met goes into the status.
    async fn bootstrap_round(&mut self) -> Result<request::Issued, request::RequestError> {
        // Read again: a token handed over or a file replaced since the last round.
        if let Ok(kc) = Kubeconfig::load(&self.bootstrap_path) {
            self.bootstrap = kc;
        }
        let handed = self.handover.read().unwrap_or_else(|e| {
            tracing::warn!(error = %e, "cannot read the handed-over bootstrap token");
            None
        });
        let (candidates, missing) = handover::bootstrap_candidates(
            &KubeconfigCredential::of(&self.bootstrap),
            handed.as_deref(),
            &self.handover.path,
        );
        self.bootstrap_source = match candidates.first() {
            Some(Candidate::HandedOver(_)) => "handedOver",
            Some(Candidate::Kubeconfig) => "kubeconfig",
            None => "none",
        };
        let now = unix_now();
        if let Some(what) = missing {
            let since = match &self.bootstrap_seen {
                BootstrapSeen::Missing { since, .. } => *since,
                _ => now,
            };
            self.bootstrap_seen = BootstrapSeen::Missing {
                since,
                what: what.clone(),
            };
            return Err(request::RequestError::Bad {
                name: "node-csr-".into(),
                reason: format!("no bootstrap credential: {what}"),
            });
        }
        let mut refused = None;
        for c in candidates {
            let mut kc = self.bootstrap.clone();
            if let Candidate::HandedOver(t) = &c {
                kc.token = Some(TokenSource::Inline(t.clone()));
                kc.client_cert = None;
            }
            let boot =
                ApiClient::new(&kc, self.opts.clone()).map_err(|e| request::RequestError::Bad {
                    name: "node-csr-".into(),
                    reason: format!("bootstrap_kubeconfig: {e}"),
                })?;
            match request::obtain(
                &boot,
                &self.node_name,
                self.expiration_secs,
                &self.annotations,
                self.attestation.as_deref(),
            )
            .await
            {
                Ok(issued) => {
                    self.bootstrap_seen = BootstrapSeen::Usable;
                    return Ok(issued);
                }
                Err(e) if e.is_unauthorized() => {
                    tracing::warn!(candidate = ?CandidateName(&c), error = %e, "bootstrap credential refused");
                    refused = Some(e);
                }
                Err(e) => {
                    if !e.is_offline() {
                        // Authenticated: the CSR was refused for another reason.
                        self.bootstrap_seen = BootstrapSeen::Usable;
                    }
                    return Err(e);
                }
            }
        }
        let since = match &self.bootstrap_seen {
            BootstrapSeen::Refused { since } => *since,
            _ => now,
        };
        self.bootstrap_seen = BootstrapSeen::Refused { since };
        Err(refused.unwrap_or_else(|| request::RequestError::Bad {
            name: "node-csr-".into(),
            reason: "no bootstrap credential".into(),
        }))
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

/// A candidate in the log, without its token.
struct CandidateName<'a>(&'a Candidate);

impl std::fmt::Debug for CandidateName<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.0 {
            Candidate::HandedOver(_) => "handed-over token",
            Candidate::Kubeconfig => "bootstrap_kubeconfig",
        })
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
