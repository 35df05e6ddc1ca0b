//! One CSR round: create it, watch it by name until the signer issued it (or it was denied,
//! failed, or deleted), as the kubelet's certificate manager does.

use super::csr;
use crate::kube::resource::Resource;
use crate::kube::{ApiClient, KubeError, ListParams, WatchEvent};
use serde_json::Value;

pub const CSRS: Resource = Resource {
    group: "certificates.k8s.io",
    version: "v1",
    plural: "certificatesigningrequests",
    namespaced: false,
};

#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error(transparent)]
    Kube(#[from] KubeError),
    #[error(transparent)]
    Csr(#[from] csr::CsrError),
    #[error("CSR {name} was denied: {reason}: {message}")]
    Denied {
        name: String,
        reason: String,
        message: String,
    },
    #[error("CSR {name} failed at signing: {reason}: {message}")]
    Failed {
        name: String,
        reason: String,
        message: String,
    },
    #[error("CSR {name} was deleted before it was issued")]
    Gone { name: String },
    #[error("CSR {name}: {reason}")]
    Bad { name: String, reason: String },
}

impl RequestError {
    /// The link, not the request: try again as for any offline error.
    pub fn is_offline(&self) -> bool {
        matches!(self, RequestError::Kube(e) if e.is_offline())
    }

    /// The credential the CSR was made with was refused (401).
    pub fn is_unauthorized(&self) -> bool {
        matches!(self, RequestError::Kube(e) if e.code() == Some(401))
    }
}

/// What a round gives.
pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
    pub csr_name: String,
}

impl std::fmt::Debug for Issued {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the key.
        f.debug_struct("Issued")
            .field("csr_name", &self.csr_name)
            .finish_non_exhaustive()
    }
}

/// What a CSR's status says now.
#[derive(Debug, PartialEq, Eq)]
pub enum Progress {
    Pending,
    Issued(String),
    Denied(String, String),
    Failed(String, String),
}

/// Reads a CSR object's status (pure).
pub fn progress(obj: &Value) -> Result<Progress, String> {
    let conds = obj
        .pointer("/status/conditions")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let text = |c: &Value, f: &str| c[f].as_str().unwrap_or("").to_string();
    for c in &conds {
        match c["type"].as_str() {
            Some("Denied") => return Ok(Progress::Denied(text(c, "reason"), text(c, "message"))),
            Some("Failed") => return Ok(Progress::Failed(text(c, "reason"), text(c, "message"))),
            _ => {}
        }
    }
    match obj.pointer("/status/certificate").and_then(Value::as_str) {
        Some(b64) if !b64.is_empty() => {
            use base64::Engine;
            let pem = base64::engine::general_purpose::STANDARD
                .decode(b64)
                .map_err(|e| format!("status.certificate is not base64: {e}"))?;
            let pem =
                String::from_utf8(pem).map_err(|_| "status.certificate is not PEM".to_string())?;
            Ok(Progress::Issued(pem))
        }
        _ => Ok(Progress::Pending),
    }
}

/// Creates a CSR for `node_name` with `client` (the bootstrap credential, or the node's own
/// for a rotation) and waits for its certificate.
pub async fn obtain(
    client: &ApiClient,
    node_name: &str,
    expiration_secs: Option<u32>,
    annotations: &std::collections::BTreeMap<String, String>,
    attestation: Option<&crate::attest::FactoryKey>,
) -> Result<Issued, RequestError> {
    let mut req = csr::build(node_name, expiration_secs, annotations)?;
    if let Some(key) = attestation {
        // The factory key signs this CSR's key and node name (attest::message); the
        // attested approver in `edgehub controller` checks it against the fleet CA.
        let a = key
            .sign(&req.public_key_der, node_name)
            .map_err(|e| RequestError::Bad {
                name: "node-csr-".into(),
                reason: format!("the device attestation: {e}"),
            })?;
        req.object["metadata"]["annotations"][crate::attest::ANNOTATION] = a.into();
    }
    submit(client, req, node_name).await
}

/// Creates the CSR `req` holds with `client` and waits for its certificate (any signer).
pub async fn submit(
    client: &ApiClient,
    req: csr::Request,
    node_name: &str,
) -> Result<Issued, RequestError> {
    let body = serde_json::to_vec(&req.object).map_err(|e| RequestError::Bad {
        name: "node-csr-".into(),
        reason: e.to_string(),
    })?;
    let created = client.create(&CSRS, None, body).await?;
    let created: Value = serde_json::from_str(&created).map_err(|e| RequestError::Bad {
        name: "node-csr-".into(),
        reason: format!("the create's answer is not JSON: {e}"),
    })?;
    let name = created
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let mut rv = created
        .pointer("/metadata/resourceVersion")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let signer = req
        .object
        .pointer("/spec/signerName")
        .and_then(Value::as_str)
        .unwrap_or("");
    tracing::info!(csr = %name, node = node_name, signer, "certificate signing request created; waiting for approval and signing");
    let bad = |reason: String| RequestError::Bad {
        name: name.clone(),
        reason,
    };
    let params = ListParams {
        field_selector: Some(format!("metadata.name={name}")),
        label_selector: None,
    };
    let mut obj = created.clone();
    loop {
        match progress(&obj).map_err(bad)? {
            Progress::Pending => {}
            Progress::Issued(cert_pem) => {
                return Ok(Issued {
                    cert_pem,
                    key_pem: req.key_pem,
                    csr_name: name,
                })
            }
            Progress::Denied(reason, message) => {
                return Err(RequestError::Denied {
                    name,
                    reason,
                    message,
                })
            }
            Progress::Failed(reason, message) => {
                return Err(RequestError::Failed {
                    name,
                    reason,
                    message,
                })
            }
        }
        let mut w = client.watch(&CSRS, None, &params, &rv, 300).await?;
        loop {
            match w.next().await? {
                None => break,
                Some(WatchEvent::Added(o) | WatchEvent::Modified(o)) => {
                    obj = serde_json::from_str(&o).map_err(|e| bad(e.to_string()))?;
                    if let Some(v) = obj
                        .pointer("/metadata/resourceVersion")
                        .and_then(Value::as_str)
                    {
                        rv = v.to_string();
                    }
                    if progress(&obj).map_err(bad)? != Progress::Pending {
                        break;
                    }
                }
                Some(WatchEvent::Deleted(_)) => return Err(RequestError::Gone { name }),
                Some(WatchEvent::Bookmark {
                    resource_version, ..
                }) => rv = resource_version,
                Some(WatchEvent::Error(_)) => {
                    // Too old a version: read the CSR itself and watch on from there.
                    let got = match client.get(&CSRS, None, &name).await {
                        Err(e) if e.code() == Some(404) => return Err(RequestError::Gone { name }),
                        r => r?,
                    };
                    obj = serde_json::from_str(&got).map_err(|e| bad(e.to_string()))?;
                    rv = obj
                        .pointer("/metadata/resourceVersion")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_string();
                    break;
                }
                Some(WatchEvent::Malformed { .. }) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn what_a_csr_status_says() {
        assert_eq!(progress(&json!({"status": {}})).unwrap(), Progress::Pending);
        assert_eq!(
            progress(&json!({"status": {"conditions": [{"type": "Approved"}]}})).unwrap(),
            Progress::Pending
        );
        assert_eq!(
            progress(
                &json!({"status": {"conditions": [{"type": "Approved"}], "certificate": "QUJD"}})
            )
            .unwrap(),
            Progress::Issued("ABC".into())
        );
        assert_eq!(
            progress(&json!({"status": {"conditions": [{"type": "Approved"}, {"type": "Failed", "reason": "SignerValidationFailure", "message": "usages"}]}})).unwrap(),
            Progress::Failed("SignerValidationFailure".into(), "usages".into())
        );
        assert_eq!(
            progress(&json!({"status": {"conditions": [{"type": "Denied", "reason": "AdminDenied", "message": "no"}]}})).unwrap(),
            Progress::Denied("AdminDenied".into(), "no".into())
        );
        assert!(progress(&json!({"status": {"certificate": "%%"}})).is_err());
    }
}
