//! The serving approver's I/O: one watch of the kubelet-serving signer's CSRs, the
//! requester's Node read for its addresses, and the decision written through the
//! `/approval` subresource as `kubectl certificate approve` does. A CSR whose Node is not
//! registered yet, or whose decision could not be written, is tried again.

use super::csr_loop::{self, CsrHandler, Outcome};
use super::serving::{
    decide_serving, requesting_node, serving_approval_message, NodeAddresses, ServingVerdict,
    SERVING_APPROVED_REASON, SERVING_SIGNER,
};
use super::CsrView;
use crate::controller::metrics::{inc, Metrics};
use k8s_openapi::api::certificates::v1::{
    CertificateSigningRequest, CertificateSigningRequestCondition,
};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};
use std::sync::Arc;
use tokio::sync::watch;

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
        attestation: None,
        request: &csr.spec.request.0,
    }
}

struct Approver {
    csrs: Api<CertificateSigningRequest>,
    nodes: Api<Node>,
    metrics: Arc<Metrics>,
}

impl Approver {
    async fn handle(&self, csr: &CertificateSigningRequest) -> Outcome {
        let name = csr.name_any();
        let v = view(csr);
        if v.signer != SERVING_SIGNER || v.decided {
            return Outcome::Done;
        }
        let addresses = match requesting_node(&v) {
            Ok(node) => match self.nodes.get_opt(node).await {
                Ok(n) => n.map(|n| {
                    NodeAddresses::from_pairs(
                        n.status
                            .iter()
                            .flat_map(|s| s.addresses.iter().flatten())
                            .map(|a| (a.type_.as_str(), a.address.as_str())),
                    )
                }),
                Err(e) => {
                    inc(&self.metrics.csr_errors);
                    tracing::warn!(csr = %name, error = %e, "cannot read the requester's Node; retrying");
                    return Outcome::Retry;
                }
            },
            Err(_) => None,
        };
        let (type_, reason, message) = match decide_serving(&v, addresses.as_ref()) {
            ServingVerdict::Skip(_) => return Outcome::Done,
            ServingVerdict::Wait(why) => {
                tracing::info!(csr = %name, %why, "serving CSR left pending for now");
                return Outcome::Retry;
            }
            ServingVerdict::Approve { node } => {
                tracing::info!(csr = %name, node = %node, "approving a node's serving certificate");
                (
                    "Approved",
                    SERVING_APPROVED_REASON.to_string(),
                    serving_approval_message(&node),
                )
            }
            ServingVerdict::Deny { reason, message } => {
                tracing::warn!(csr = %name, requestor = v.username, reason, %message, "denying a serving certificate");
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
            .csrs
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
            Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => Outcome::Done,
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

/// Decides the kubelet-serving signer's CSRs until `stop` turns true.
pub(in crate::controller) async fn run(
    client: Client,
    metrics: Arc<Metrics>,
    mut stop: watch::Receiver<bool>,
) {
    let csrs = Api::<CertificateSigningRequest>::all(client.clone());
    let mut approver = Approver {
        csrs: csrs.clone(),
        nodes: Api::all(client),
        metrics,
    };
    tracing::info!(
        signer = SERVING_SIGNER,
        "approving nodes' serving certificates"
    );
    csr_loop::run(csrs, SERVING_SIGNER, &mut approver, &mut stop).await;
    tracing::info!("the serving approver stopped");
}
