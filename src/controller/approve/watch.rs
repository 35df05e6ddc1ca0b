//! The approver's I/O: one watch of the node client signer's CSRs (a list, then a watch; no
//! request per CSR but its `/approval` write), the fleet CA read from a ConfigMap or Secret
//! (at most once a minute, and only when a CSR needs it), and the Approved or Denied
//! condition written through the `/approval` subresource as `kubectl certificate` does.

use super::csr_loop::{self, CsrHandler, Outcome};
use super::replay_store::{Claim, For, Records};
use super::{decide, ours, CsrView, Verdict, APPROVED_REASON, SIGNER};
use crate::attest::{self, FleetCa};
use crate::controller::metrics::{inc, Metrics};
use k8s_openapi::api::certificates::v1::{
    CertificateSigningRequest, CertificateSigningRequestCondition,
};
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// The key of the fleet CA's PEM in the ConfigMap or Secret.
pub const CA_KEY: &str = "ca.crt";
/// The fleet CA is read again when a CSR needs it and the copy is older than this.
const CA_REFRESH: Duration = Duration::from_secs(60);

/// Where the fleet CA is: key [`CA_KEY`] of a ConfigMap or a Secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CaSource {
    ConfigMap { namespace: String, name: String },
    Secret { namespace: String, name: String },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?}: expected configmap/<namespace>/<name> or secret/<namespace>/<name>")]
pub struct CaSourceError(String);

impl std::str::FromStr for CaSource {
    type Err = CaSourceError;
    fn from_str(s: &str) -> Result<CaSource, CaSourceError> {
        let bad = || CaSourceError(s.to_string());
        let mut parts = s.split('/');
        let (Some(kind), Some(ns), Some(name), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(bad());
        };
        if crate::names::check_label(ns).is_err() || crate::names::check_subdomain(name).is_err() {
            return Err(bad());
        }
        let (namespace, name) = (ns.to_string(), name.to_string());
        match kind.to_ascii_lowercase().as_str() {
            "configmap" | "cm" => Ok(CaSource::ConfigMap { namespace, name }),
            "secret" => Ok(CaSource::Secret { namespace, name }),
            _ => Err(bad()),
        }
    }
}

impl std::fmt::Display for CaSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CaSource::ConfigMap { namespace, name } => write!(f, "configmap/{namespace}/{name}"),
            CaSource::Secret { namespace, name } => write!(f, "secret/{namespace}/{name}"),
        }
    }
}

/// Why the fleet CA could not be had; the CSRs waiting for it stay pending.
#[derive(Debug, thiserror::Error)]
enum CaError {
    #[error("cannot read {source_}: {error}")]
    Get { source_: String, error: kube::Error },
    #[error("{0} has no key {CA_KEY}")]
    NoKey(String),
    #[error("{source_}: {error}")]
    Pem {
        source_: String,
        error: attest::FleetCaError,
    },
}

async fn fetch_ca(client: &Client, source: &CaSource) -> Result<FleetCa, CaError> {
    let get = |error| CaError::Get {
        source_: source.to_string(),
        error,
    };
    let pem: Option<Vec<u8>> = match source {
        CaSource::ConfigMap { namespace, name } => {
            let cm = Api::<ConfigMap>::namespaced(client.clone(), namespace)
                .get(name)
                .await
                .map_err(get)?;
            cm.data
                .and_then(|mut d| d.remove(CA_KEY))
                .map(String::into_bytes)
                .or_else(|| {
                    cm.binary_data
                        .and_then(|mut d| d.remove(CA_KEY))
                        .map(|b| b.0)
                })
        }
        CaSource::Secret { namespace, name } => {
            Api::<Secret>::namespaced(client.clone(), namespace)
                .get(name)
                .await
                .map_err(get)?
                .data
                .and_then(|mut d| d.remove(CA_KEY))
                .map(|b| b.0)
        }
    };
    let pem = pem.ok_or_else(|| CaError::NoKey(source.to_string()))?;
    FleetCa::from_pem(&pem).map_err(|error| CaError::Pem {
        source_: source.to_string(),
        error,
    })
}

/// The fleet CA, read when needed and kept for [`CA_REFRESH`].
struct CaCache {
    source: CaSource,
    held: Option<(Instant, FleetCa)>,
}

impl CaCache {
    /// The fleet CA, read again if the copy is stale (a copy: a few trust anchors).
    async fn get(&mut self, client: &Client) -> Result<FleetCa, CaError> {
        match &self.held {
            Some((at, ca)) if at.elapsed() < CA_REFRESH => Ok(ca.clone()),
            _ => {
                let ca = fetch_ca(client, &self.source).await?;
                tracing::debug!(source = %self.source, certificates = ca.len(), "read the fleet CA");
                self.held = Some((Instant::now(), ca.clone()));
                Ok(ca)
            }
        }
    }
}

fn decided(csr: &CertificateSigningRequest) -> bool {
    csr.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| {
            cs.iter().any(|c| {
                matches!(c.type_.as_str(), "Approved" | "Denied" | "Failed") && c.status != "False"
            })
        })
}

fn view(csr: &CertificateSigningRequest) -> CsrView<'_> {
    CsrView {
        signer: &csr.spec.signer_name,
        username: csr.spec.username.as_deref().unwrap_or(""),
        groups: csr.spec.groups.as_deref().unwrap_or(&[]),
        usages: csr.spec.usages.as_deref().unwrap_or(&[]),
        decided: decided(csr),
        attestation: csr
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(attest::ANNOTATION))
            .map(String::as_str),
        request: &csr.spec.request.0,
    }
}

struct Approver {
    client: Client,
    api: Api<CertificateSigningRequest>,
    ca: CaCache,
    /// The attested keys, per node: each is approved once.
    records: Records,
    metrics: Arc<Metrics>,
}

impl Approver {
    async fn handle(&mut self, csr: &CertificateSigningRequest) -> Outcome {
        let name = csr.name_any();
        if let Err(why) = ours(&view(csr)) {
            tracing::trace!(csr = %name, why, "not deciding");
            return Outcome::Done;
        }
        let ca = match self.ca.get(&self.client).await {
            Ok(ca) => ca,
            Err(e) => {
                inc(&self.metrics.csr_errors);
                tracing::warn!(csr = %name, error = %e, "no fleet CA: the CSR stays pending");
                return Outcome::Retry;
            }
        };
        let now = u64::try_from(crate::time::now_ms() / 1000).unwrap_or(0);
        let (type_, reason, message) = match decide(&view(csr), &ca, now) {
            Verdict::Skip(_) => return Outcome::Done,
            Verdict::Approve { node, serial, key } => {
                let uid = csr.metadata.uid.as_deref().unwrap_or("");
                let claim = For {
                    node: &node,
                    fingerprint: &key,
                    csr: &name,
                    uid,
                    factory_serial: &serial,
                };
                match self.records.claim(&claim).await {
                    Ok(Claim::Claimed) => {
                        tracing::info!(csr = %name, node = %node, factory_serial = %serial, key = %key, "approving an attested node certificate");
                        let message = Verdict::approval_message(&node, &serial, &key);
                        ("Approved", APPROVED_REASON.to_string(), message)
                    }
                    Ok(Claim::Refused { reason, message }) => {
                        tracing::warn!(csr = %name, node = %node, factory_serial = %serial, key = %key, reason, %message, "denying a replayed attestation");
                        ("Denied", reason.to_string(), message)
                    }
                    Err(e) => {
                        inc(&self.metrics.csr_errors);
                        tracing::warn!(csr = %name, error = %e, "cannot record the attested key: the CSR stays pending");
                        return Outcome::Retry;
                    }
                }
            }
            Verdict::Deny { reason, message } => {
                tracing::warn!(csr = %name, requestor = csr.spec.username.as_deref().unwrap_or(""), reason, %message, "denying a node certificate");
                ("Denied", reason.to_string(), message)
            }
        };
        let mut body = csr.clone();
        let now = Some(Time(Timestamp::now()));
        body.status
            .get_or_insert_with(Default::default)
            .conditions
            .get_or_insert_with(Vec::new)
            .push(CertificateSigningRequestCondition {
                type_: type_.into(),
                status: "True".into(),
                reason: Some(reason),
                message: Some(message),
                last_update_time: now.clone(),
                last_transition_time: now,
            });
        match self
            .api
            .replace_subresource("approval", &name, &PostParams::default(), &body)
            .await
        {
            Ok(_) => {
                inc(if type_ == "Approved" {
                    &self.metrics.csr_approved
                } else {
                    &self.metrics.csr_denied
                });
                Outcome::Done
            }
            // Changed since (the watch brings the new version, decided again then) or gone.
            Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => {
                tracing::debug!(csr = %name, code = s.code, "the CSR changed or went before the decision was written");
                Outcome::Done
            }
            Err(e) => {
                inc(&self.metrics.csr_errors);
                tracing::warn!(csr = %name, error = %e, "cannot write the decision; retrying");
                Outcome::Retry
            }
        }
    }
}

impl CsrHandler for Approver {
    fn handle_csr(
        &mut self,
        csr: &CertificateSigningRequest,
    ) -> impl std::future::Future<Output = Outcome> + Send {
        self.handle(csr)
    }
}

/// Decides the node client signer's bootstrap CSRs until `stop` turns true.
pub(in crate::controller) async fn run(
    client: Client,
    source: CaSource,
    record_namespace: String,
    metrics: Arc<Metrics>,
    mut stop: watch::Receiver<bool>,
) {
    let api = Api::<CertificateSigningRequest>::all(client.clone());
    tracing::info!(fleet_ca = %source, signer = SIGNER, record_namespace, "approving attested node certificates");
    let mut approver = Approver {
        records: Records::new(client.clone(), &record_namespace),
        client,
        api: api.clone(),
        ca: CaCache { source, held: None },
        metrics,
    };
    csr_loop::run(api, SIGNER, &mut approver, &mut stop).await;
    tracing::info!("the approver stopped");
}
