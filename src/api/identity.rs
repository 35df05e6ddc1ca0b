//! The node's identity on the local API: the `identity` section of `/v1/status`, the Node's
//! local view (`GET /v1/node`, with the device-side `CredentialsLapsed` and
//! `CertificateRequestDenied` conditions, never sent to the apiserver), and the handover of a
//! bootstrap token (`PUT /v1/bootstrap-token`).

use super::{ApiState, Reply};
use crate::identity::handover::{Handover, HandoverError};
use crate::identity::status::IdentityStatus;
use crate::object::Kind;
use serde_json::{json, Value};
use std::sync::Arc;
use tokio::sync::watch;

/// What the API reads of the identity task: its status, and the handover's door.
#[derive(Debug, Clone)]
pub struct IdentityHandle {
    pub status: watch::Receiver<IdentityStatus>,
    pub handover: Arc<Handover>,
}

/// The `identity` section of `/v1/status`: `null` when the node credential is made by hand
/// (no `[identity] bootstrap_kubeconfig`).
pub fn status_json(state: &ApiState) -> Value {
    match &state.identity {
        Some(h) => serde_json::to_value(&*h.status.borrow()).unwrap_or(Value::Null),
        None => Value::Null,
    }
}

/// The device-side condition: `True` while a credential lapsed and nothing replaced it.
pub fn lapsed_condition(status: Option<&IdentityStatus>, now: &str) -> Value {
    let (st, reason, message) = match status {
        None => (
            "Unknown",
            "NotManaged",
            "the node credential is made by hand ([identity] bootstrap_kubeconfig is not set)"
                .to_string(),
        ),
        Some(s) if s.lapsed.is_empty() => (
            "False",
            "CredentialsValid",
            "no credential has lapsed".to_string(),
        ),
        Some(s) => (
            "True",
            if s.needs_bootstrap() && s.lapsed.len() > 1 {
                "BothCredentialsLapsed"
            } else {
                "CredentialLapsed"
            },
            s.lapsed
                .iter()
                .map(|l| {
                    let which = match l.credential {
                        crate::identity::status::Which::NodeCertificate => "node certificate",
                        crate::identity::status::Which::Bootstrap => "bootstrap credential",
                    };
                    format!("{which} {} since {}", l.reason, l.since)
                })
                .collect::<Vec<_>>()
                .join("; "),
        ),
    };
    json!({
        "type": "CredentialsLapsed",
        "status": st,
        "reason": reason,
        "message": message,
        "lastHeartbeatTime": now,
        "lastTransitionTime": now,
    })
}

/// The device-side condition: `True` while the last CSR an approver denied is the latest
/// word on the node's certificate (until one is issued), with the denial's reason.
pub fn denied_condition(status: Option<&IdentityStatus>, now: &str) -> Value {
    let (st, reason, message) = match status.map(|s| s.last_denial.as_ref()) {
        None => (
            "Unknown",
            "NotManaged".to_string(),
            "the node credential is made by hand ([identity] bootstrap_kubeconfig is not set)"
                .to_string(),
        ),
        Some(None) => (
            "False",
            "NotDenied".to_string(),
            "no certificate request was denied since the last certificate was issued".to_string(),
        ),
        Some(Some(d)) => (
            "True",
            d.reason.clone(),
            format!(
                "CSR {} was denied at {}: {} (the node asks again after the longest backoff)",
                d.csr, d.at, d.message
            ),
        ),
    };
    json!({
        "type": "CertificateRequestDenied",
        "status": st,
        "reason": reason,
        "message": message,
        "lastHeartbeatTime": now,
        "lastTransitionTime": now,
    })
}

/// `GET /v1/node`: the cached Node (or a stub naming it before it was ever cached), with
/// `CredentialsLapsed` and `CertificateRequestDenied` added to its conditions.
pub fn node(state: &ApiState) -> Reply {
    let cached = match state.store.get(Kind::Node, "", &state.node_name) {
        Ok(n) => n,
        Err(e) => return Reply::internal("Get node failed", &e),
    };
    let mut node: Value = match cached.as_ref().map(|n| serde_json::from_str(&n.raw)) {
        Some(Ok(v)) => v,
        Some(Err(e)) => return Reply::internal("Get node failed", &e),
        None => json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": state.node_name}}),
    };
    let status = state.identity.as_ref().map(|h| h.status.borrow().clone());
    let now = crate::time::now();
    let conds = [
        lapsed_condition(status.as_ref(), &now),
        denied_condition(status.as_ref(), &now),
    ];
    let Some(obj) = node.as_object_mut() else {
        return Reply::internal("Get node failed", &"the cached Node is not an object");
    };
    let st = obj.entry("status").or_insert_with(|| json!({}));
    if let Some(st) = st.as_object_mut() {
        let list = st.entry("conditions").or_insert_with(|| json!([]));
        if let Some(list) = list.as_array_mut() {
            list.retain(|c| {
                c["type"] != "CredentialsLapsed" && c["type"] != "CertificateRequestDenied"
            });
            list.extend(conds);
        }
    }
    Reply::json(200, node.to_string())
}

/// `PUT /v1/bootstrap-token`: the body is the token. 409 when the node holds a node
/// certificate that has not lapsed (the token is not needed; hand it over once one lapsed).
pub fn put_token(state: &ApiState, body: &[u8]) -> Reply {
    let Some(h) = &state.identity else {
        return Reply::text(
            409,
            "This node does not bootstrap its credential ([identity] bootstrap_kubeconfig is \
             not set): a bootstrap token is of no use to it",
        );
    };
    let Ok(token) = std::str::from_utf8(body) else {
        return Reply::text(400, HandoverError::Format.to_string());
    };
    if !crate::identity::handover::valid_token(token.trim()) {
        return Reply::text(400, HandoverError::Format.to_string());
    }
    let current = h.status.borrow().clone();
    if !current.needs_bootstrap() {
        let until = current
            .node_certificate
            .as_ref()
            .map(|c| c.not_after.clone())
            .unwrap_or_default();
        return Reply::text(
            409,
            format!(
                "The node holds a valid node certificate (notAfter {until}); a bootstrap token \
                 is needed only once it has lapsed"
            ),
        );
    }
    match h.handover.store(token) {
        Ok(()) => Reply::text(202, "Bootstrap token stored; the node bootstraps now"),
        Err(HandoverError::Format) => Reply::text(400, HandoverError::Format.to_string()),
        Err(e) => Reply::internal("Store bootstrap token failed", &e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::status::{compute, BootstrapSeen, Inputs};

    #[test]
    fn the_condition_names_what_lapsed() {
        let c = crate::identity::cert::CertTimes {
            not_before: 0,
            not_after: 100,
            common_name: None,
        };
        let s = compute(&Inputs {
            now: 200,
            cert: Some(&c),
            cert_refused_since: Some(150),
            bootstrap: &BootstrapSeen::Refused { since: 160 },
            bootstrap_source: "kubeconfig",
            last_denial: None,
        });
        let v = lapsed_condition(Some(&s), "now");
        assert_eq!(v["status"], "True");
        assert_eq!(v["reason"], "BothCredentialsLapsed");
        let m = v["message"].as_str().unwrap();
        assert!(
            m.contains("node certificate expired since 1970-01-01T00:01:40Z"),
            "{m}"
        );
        assert!(
            m.contains("bootstrap credential bootstrap token refused"),
            "{m}"
        );
        assert_eq!(lapsed_condition(None, "now")["status"], "Unknown");
        let v = denied_condition(Some(&s), "now");
        assert_eq!(
            (&v["status"], &v["reason"]),
            (&json!("False"), &json!("NotDenied"))
        );
        assert_eq!(denied_condition(None, "now")["status"], "Unknown");
    }

    #[test]
    fn the_denial_condition_names_the_csr_and_its_reason() {
        let d = crate::identity::status::LastDenial {
            csr: "node-csr-bk44f".into(),
            reason: "NodeNameMismatch".into(),
            message: "the factory certificate names \"edge-7\"".into(),
            at: "2026-12-02T01:18:28Z".into(),
        };
        let s = compute(&Inputs {
            now: 200,
            cert: None,
            cert_refused_since: None,
            bootstrap: &BootstrapSeen::Usable,
            bootstrap_source: "kubeconfig",
            last_denial: Some(&d),
        });
        let v = denied_condition(Some(&s), "now");
        assert_eq!(v["status"], "True");
        assert_eq!(v["reason"], "NodeNameMismatch");
        let m = v["message"].as_str().unwrap();
        assert!(
            m.contains("node-csr-bk44f") && m.contains("2026-12-02T01:18:28Z"),
            "{m}"
        );
        assert!(m.contains("edge-7"), "{m}");
    }
}
