//! The record of attested keys in the cluster ([`super::replay`]): read a node's ConfigMap,
//! and claim a key for a CSR in it (create the ConfigMap, or replace it with the read's
//! resourceVersion) before the CSR is approved. One GET, then one POST or PUT, per approval;
//! one GET per replay.

use super::replay::{self, Seen, Use, NODE_ANNOTATION, RECORD_LABEL};
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, PostParams};
use kube::Client;
use std::collections::BTreeMap;

/// Conflicting writes (another replica, a moment ago) tried again at most this often.
const ATTEMPTS: usize = 3;

/// What claiming a key gave.
#[derive(Debug)]
pub(super) enum Claim {
    /// Recorded for this CSR (now, or by an earlier try): approve.
    Claimed,
    /// Not recorded: deny with this reason and message.
    Refused {
        reason: &'static str,
        message: String,
    },
}

/// Why the record could not be read or written; the CSR stays pending and is tried again.
#[derive(Debug, thiserror::Error)]
pub(super) enum StoreError {
    #[error("the record {namespace}/{name}: {error}")]
    Kube {
        namespace: String,
        name: String,
        error: kube::Error,
    },
    #[error("the record {namespace}/{name} changed under {ATTEMPTS} writes in a row")]
    Contended { namespace: String, name: String },
}

/// The node's record, in `namespace`.
pub(super) struct Records {
    api: Api<ConfigMap>,
    namespace: String,
}

/// The CSR a key is claimed for.
pub(super) struct For<'a> {
    pub node: &'a str,
    pub fingerprint: &'a str,
    pub csr: &'a str,
    pub uid: &'a str,
    pub factory_serial: &'a str,
}

impl Records {
    pub(super) fn new(client: Client, namespace: &str) -> Records {
        Records {
            api: Api::namespaced(client, namespace),
            namespace: namespace.to_string(),
        }
    }

    /// Claims `f.fingerprint` for the CSR in the node's record, unless another CSR has it.
    pub(super) async fn claim(&self, f: &For<'_>) -> Result<Claim, StoreError> {
        let name = replay::record_name(f.node);
        let err = |error| StoreError::Kube {
            namespace: self.namespace.clone(),
            name: name.clone(),
            error,
        };
        for _ in 0..ATTEMPTS {
            let current = self.api.get_opt(&name).await.map_err(err)?;
            let data = current.as_ref().map(|c| c.data.clone().unwrap_or_default());
            match replay::seen(data.as_ref(), f.fingerprint, f.uid) {
                Seen::ThisCsr => return Ok(Claim::Claimed),
                Seen::Replayed(first) => {
                    return Ok(Claim::Refused {
                        reason: "AttestationReplayed",
                        message: replay::replayed_message(f.node, f.fingerprint, &first),
                    })
                }
                Seen::Full => {
                    return Ok(Claim::Refused {
                        reason: "AttestationRecordFull",
                        message: replay::full_message(
                            f.node,
                            &format!("{}/{name}", self.namespace),
                        ),
                    })
                }
                Seen::New => {}
            }
            let entry = Use {
                csr: f.csr.to_string(),
                uid: f.uid.to_string(),
                factory_serial: f.factory_serial.to_string(),
                at: crate::time::now(),
            }
            .to_value();
            let written = match current {
                None => {
                    let cm = ConfigMap {
                        metadata: ObjectMeta {
                            name: Some(name.clone()),
                            namespace: Some(self.namespace.clone()),
                            labels: Some(BTreeMap::from([(
                                RECORD_LABEL.to_string(),
                                "true".to_string(),
                            )])),
                            annotations: Some(BTreeMap::from([(
                                NODE_ANNOTATION.to_string(),
                                f.node.to_string(),
                            )])),
                            ..ObjectMeta::default()
                        },
                        data: Some(BTreeMap::from([(f.fingerprint.to_string(), entry)])),
                        ..ConfigMap::default()
                    };
                    self.api.create(&PostParams::default(), &cm).await
                }
                // The read's resourceVersion goes with it: a write in between is a 409.
                Some(mut cm) => {
                    cm.data
                        .get_or_insert_with(BTreeMap::new)
                        .insert(f.fingerprint.to_string(), entry);
                    self.api.replace(&name, &PostParams::default(), &cm).await
                }
            };
            match written {
                Ok(_) => return Ok(Claim::Claimed),
                // Created or changed by another writer since the read: read it again.
                Err(kube::Error::Api(s)) if s.code == 409 => continue,
                Err(e) => return Err(err(e)),
            }
        }
        Err(StoreError::Contended {
            namespace: self.namespace.clone(),
            name,
        })
    }
}
