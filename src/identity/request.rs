//! One CSR round: create it, watch it by name until the signer issued it (or it was denied,
//! failed, or deleted), as the kubelet's certificate manager does.

use super::csr;
use crate::backoff::BackoffPolicy;
use crate::kube::resource::Resource;
use crate::kube::{ApiClient, KubeError, ListParams, WatchEvent};
use serde_json::Value;
use std::time::Duration;

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
        /// When, as the Denied condition says (RFC 3339), if it says.
        at: Option<String>,
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

    /// An approver decided against the CSR: a decision, not a fault.
    pub fn is_denied(&self) -> bool {
        matches!(self, RequestError::Denied { .. })
    }
}

/// How long a round that failed with `e` waits before the next: a denial waits the longest
/// backoff, as asking again at once would only be denied again (a clone of another
/// vehicle's firmware, a node name the fleet does not know) and each CSR is a write on the
/// apiserver; anything else backs off from the start, `failures` being the failures in a
/// row so far (this one included).
pub fn retry_wait(e: &RequestError, backoff: &BackoffPolicy, failures: u32) -> Duration {
    if e.is_denied() {
        backoff.jittered(u32::MAX)
    } else {
        backoff.jittered(failures)
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

/// A condition that ended a CSR, as far as the device keeps it: its reason and message (at
/// most [`MAX_REASON`] and [`MAX_MESSAGE`] characters: they are shown in the status) and
/// when (the condition's lastUpdateTime, else its lastTransitionTime, if it looks like an
/// RFC 3339 time).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ended {
    pub reason: String,
    pub message: String,
    pub at: Option<String>,
}

/// At most this many characters of a condition's reason and message are kept.
pub const MAX_REASON: usize = 128;
pub const MAX_MESSAGE: usize = 1024;

/// What a CSR's status says now.
#[derive(Debug, PartialEq, Eq)]
pub enum Progress {
    Pending,
    Issued(String),
    Denied(Ended),
    Failed(Ended),
}

/// `s` cut to `max` characters (an ellipsis marks the cut).
fn bounded(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        None => s.to_string(),
        Some((at, _)) => format!("{}…", &s[..at]),
    }
}

/// A time as the API writes it (`2026-12-02T01:18:28Z`, maybe with fractions or an
/// offset): digits and `-:.TZ+` only, 20 to 35 characters.
fn api_time(v: &Value) -> Option<String> {
    let t = v.as_str()?;
    let ok = (20..=35).contains(&t.len())
        && t.bytes()
            .all(|b| b.is_ascii_digit() || b"-:.TZ+".contains(&b));
    ok.then(|| t.to_string())
}

fn ended(c: &Value) -> Ended {
    let text = |f: &str, max| bounded(c[f].as_str().unwrap_or(""), max);
    Ended {
        reason: text("reason", MAX_REASON),
        message: text("message", MAX_MESSAGE),
        at: api_time(&c["lastUpdateTime"]).or_else(|| api_time(&c["lastTransitionTime"])),
    }
}

/// Reads a CSR object's status (pure).
pub fn progress(obj: &Value) -> Result<Progress, String> {
    let conds = obj
        .pointer("/status/conditions")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    for c in conds {
        match c["type"].as_str() {
            Some("Denied") => return Ok(Progress::Denied(ended(c))),
            Some("Failed") => return Ok(Progress::Failed(ended(c))),
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
            Progress::Denied(e) => {
                return Err(RequestError::Denied {
                    name,
                    reason: e.reason,
                    message: e.message,
                    at: e.at,
                })
            }
            Progress::Failed(e) => {
                return Err(RequestError::Failed {
                    name,
                    reason: e.reason,
                    message: e.message,
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
            Progress::Failed(Ended { reason: "SignerValidationFailure".into(), message: "usages".into(), at: None })
        );
        assert_eq!(
            progress(&json!({"status": {"conditions": [{"type": "Denied", "reason": "AdminDenied", "message": "no"}]}})).unwrap(),
            Progress::Denied(Ended { reason: "AdminDenied".into(), message: "no".into(), at: None })
        );
        assert!(progress(&json!({"status": {"certificate": "%%"}})).is_err());
    }

    #[test]
    fn a_denial_as_the_requester_sees_it() {
        let fixture: Value = serde_json::from_str(include_str!(
            "../../tests/fixtures/apiserver/csr_denied_seen_by_requester.json"
        ))
        .unwrap();
        assert_eq!(
            progress(&fixture["response"]["body"]).unwrap(),
            Progress::Denied(Ended {
                reason: "AdminDenied".into(),
                message: "not a kubelet client certificate request".into(),
                at: Some("2026-12-02T01:18:28Z".into()),
            })
        );
        // What the status shows is bounded, and a time is a time.
        let long = json!({"status": {"conditions": [{"type": "Denied", "reason": "R".repeat(500),
            "message": "é".repeat(5000), "lastUpdateTime": "<script>", "lastTransitionTime": "2026-12-02T01:18:28.123456+01:00"}]}});
        let Progress::Denied(e) = progress(&long).unwrap() else {
            panic!("denied");
        };
        assert_eq!(e.reason.chars().count(), MAX_REASON + 1);
        assert_eq!(e.message.chars().count(), MAX_MESSAGE + 1);
        assert!(e.message.ends_with('…'));
        assert_eq!(e.at.as_deref(), Some("2026-12-02T01:18:28.123456+01:00"));
    }

    #[test]
    fn a_denial_waits_the_longest_backoff() {
        let b = BackoffPolicy {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(300),
        };
        let denied = RequestError::Denied {
            name: "node-csr-x".into(),
            reason: "NodeNameMismatch".into(),
            message: "m".into(),
            at: None,
        };
        let failed = RequestError::Gone {
            name: "node-csr-x".into(),
        };
        for failures in [1, 2, 5] {
            assert!(retry_wait(&denied, &b, failures) >= Duration::from_secs(150));
            assert!(retry_wait(&denied, &b, failures) <= Duration::from_secs(300));
        }
        assert!(retry_wait(&failed, &b, 1) <= Duration::from_secs(1));
    }
}
