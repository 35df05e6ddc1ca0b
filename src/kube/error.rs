//! Errors of the apiserver client. A non-2xx answer becomes [`KubeError::Status`] carrying the
//! apiserver's own Status body, so the caller can branch on the code and a person reading the
//! log sees the apiserver's words.

use serde::Deserialize;
use std::time::Duration;

/// What a request was, for error messages: "list daemonsets.apps".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub verb: &'static str,
    /// Qualified resource, e.g. `pods` or `daemonsets.apps`, with `/status` for subresources.
    pub resource: String,
    pub namespace: Option<String>,
    pub name: Option<String>,
}

impl std::fmt::Display for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.verb, self.resource)?;
        match (&self.namespace, &self.name) {
            (Some(ns), Some(n)) => write!(f, " {ns}/{n}"),
            (None, Some(n)) => write!(f, " {n}"),
            (Some(ns), None) => write!(f, " in namespace {ns}"),
            (None, None) => Ok(()),
        }
    }
}

/// The `Status` object the apiserver sends with a failure.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct Status {
    #[serde(default)]
    pub code: u16,
    #[serde(default)]
    pub reason: String,
    #[serde(default)]
    pub message: String,
    /// `details`, when the server sent them (causes, retryAfterSeconds).
    #[serde(default)]
    pub details: Option<StatusDetails>,
}

/// `Status.details`: what the apiserver adds to some failures.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StatusDetails {
    #[serde(default)]
    pub causes: Vec<StatusCause>,
    #[serde(default)]
    pub retry_after_seconds: u32,
}

/// One `details.causes` entry; the cause's type is serialized as `reason`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct StatusCause {
    #[serde(default)]
    pub reason: String,
    #[serde(default)]
    pub message: String,
}

impl Status {
    /// The apiserver's answer to a request for a resourceVersion newer than any it has: the
    /// 504 of `storage.NewTooLargeResourceVersionError` (k8s.io/apiserver), "Timeout: Too
    /// large resource version: <asked>, current: <current>", with cause
    /// `ResourceVersionTooLarge`. After an etcd restore from a backup the server's versions
    /// go back, and a client's cursor is ahead of them. Recognized as client-go's reflector
    /// does: by the cause, else (servers before 1.18.6) by the message.
    pub fn is_resource_version_too_large(&self) -> bool {
        const MSG: &str = "Too large resource version";
        if self.code != 504 {
            return false;
        }
        self.details
            .iter()
            .flat_map(|d| &d.causes)
            .any(|c| c.reason == "ResourceVersionTooLarge" || c.message == MSG)
            || self.message.contains(MSG)
    }
}

impl Status {
    /// Parses a Status body; a body that is not one (a proxy's HTML page, say) still gives a
    /// Status with the HTTP code and the first bytes of the body as the message.
    pub fn from_body(code: u16, body: &[u8]) -> Status {
        match serde_json::from_slice::<Status>(body) {
            Ok(mut s) if !s.reason.is_empty() || !s.message.is_empty() => {
                if s.code == 0 {
                    s.code = code;
                }
                s
            }
            _ => Status {
                code,
                reason: String::new(),
                message: String::from_utf8_lossy(&body[..body.len().min(200)])
                    .trim()
                    .to_string(),
                details: None,
            },
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    /// DNS, TCP or TLS-handshake failure, or the connection dropped: the device is offline or
    /// the apiserver is down. Never fatal.
    #[error("{request}: apiserver {server} unreachable: {reason}")]
    Unreachable {
        request: Request,
        server: String,
        reason: String,
    },
    /// The TLS handshake failed: the server's certificate did not verify (unknown CA, dates,
    /// name), the server refused the client certificate, or it does not speak TLS. Not
    /// "offline": `reason` names what failed and what to check.
    #[error("{request}: TLS with {server} failed: {reason}")]
    Tls {
        request: Request,
        server: String,
        reason: String,
    },
    #[error("{request}: no answer within {0:?}", .timeout)]
    Timeout { request: Request, timeout: Duration },
    #[error("{}", status_message(.request, .status, .node))]
    Status {
        request: Request,
        status: Status,
        /// From a `Retry-After` header (429, 503).
        retry_after: Option<Duration>,
        /// The node name edgehub runs as, for 401/403 hints.
        node: String,
    },
    #[error("{request}: response is not valid JSON: {source}")]
    Decode {
        request: Request,
        #[source]
        source: serde_json::Error,
    },
    #[error("{request}: response larger than {limit} bytes")]
    TooLarge { request: Request, limit: usize },
    #[error("{request}: {reason}")]
    Stream { request: Request, reason: String },
}

fn status_message(request: &Request, s: &Status, node: &str) -> String {
    let head = format!("{request}: {} {}: {}", s.code, s.reason, s.message);
    match s.code {
        401 => format!(
            "{head} (the apiserver rejected edgehub's credentials: check the token, token file or client certificate in the kubeconfig)"
        ),
        403 if is_authorizer_lag(s) => format!(
            "{head} (the Node authorizer links a pod's ConfigMaps, Secrets and service account to node {node} \
             moments after the pod is bound; edgehub retries)"
        ),
        403 => format!(
            "{head} (edgehub runs as user system:node:{node} in group system:nodes and needs permission to {} {}; \
             apply deploy/rbac.yaml, which grants get/list/watch on daemonsets and controllerrevisions to system:nodes, \
             and check that the kubeconfig's identity is system:node:{node})",
            request.verb, request.resource
        ),
        _ => head,
    }
}

/// The Node authorizer's 403 for an object no pod bound to this node references yet: right
/// after a pod is bound it is the authorizer's graph catching up, not missing RBAC (fixture
/// `configmap_get_unreferenced_forbidden`).
fn is_authorizer_lag(s: &Status) -> bool {
    s.code == 403 && s.message.contains("no relationship found between node")
}

impl KubeError {
    /// A 403 from the Node authorizer's graph lag; worth a quick, quiet retry.
    pub fn is_authorizer_lag(&self) -> bool {
        matches!(self, KubeError::Status { status, .. } if is_authorizer_lag(status))
    }

    /// A 422 refusing a write because its `metadata.uid` is not the object's: the object was
    /// replaced by another of the same name (fixture `pod_status_patch_stale_uid`).
    pub fn is_stale_uid(&self) -> bool {
        matches!(self, KubeError::Status { status, .. }
            if status.code == 422 && status.message.contains("metadata.uid"))
    }

    /// The HTTP code of an apiserver answer, if this is one.
    pub fn code(&self) -> Option<u16> {
        match self {
            KubeError::Status { status, .. } => Some(status.code),
            _ => None,
        }
    }

    /// 410 Gone/Expired: the resourceVersion is too old; list again.
    pub fn is_expired(&self) -> bool {
        self.code() == Some(410)
    }

    /// 504 "Too large resource version": the server is behind the version asked for (its
    /// etcd was restored from a backup); only a list without a version corrects the cache.
    pub fn is_resource_version_too_large(&self) -> bool {
        matches!(self, KubeError::Status { status, .. } if status.is_resource_version_too_large())
    }

    /// The link is down (as opposed to the apiserver answering with an error).
    pub fn is_offline(&self) -> bool {
        matches!(
            self,
            KubeError::Unreachable { .. } | KubeError::Timeout { .. } | KubeError::Stream { .. }
        )
    }

    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            KubeError::Status { retry_after, .. } => *retry_after,
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> Request {
        Request {
            verb: "list",
            resource: "daemonsets.apps".into(),
            namespace: None,
            name: None,
        }
    }

    #[test]
    fn forbidden_names_the_permission_and_the_fix() {
        let body = br#"{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"daemonsets.apps is forbidden: User \"system:node:edge-1\" cannot list resource \"daemonsets\"","reason":"Forbidden","details":{"group":"apps","kind":"daemonsets"},"code":403}"#;
        let e = KubeError::Status {
            request: req(),
            status: Status::from_body(403, body),
            retry_after: None,
            node: "edge-1".into(),
        };
        let m = e.to_string();
        assert!(m.contains("list daemonsets.apps"), "{m}");
        assert!(m.contains("deploy/rbac.yaml"), "{m}");
        assert!(m.contains("system:node:edge-1"), "{m}");
        assert_eq!(e.code(), Some(403));
        assert!(!e.is_offline());
    }

    #[test]
    fn unauthorized_points_at_credentials() {
        let body = br#"{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"Unauthorized","reason":"Unauthorized","code":401}"#;
        let e = KubeError::Status {
            request: req(),
            status: Status::from_body(401, body),
            retry_after: None,
            node: "edge-1".into(),
        };
        assert!(e.to_string().contains("credentials"));
    }

    #[test]
    fn non_status_body_keeps_code_and_text() {
        let s = Status::from_body(502, b"<html>bad gateway</html>");
        assert_eq!(s.code, 502);
        assert_eq!(s.message, "<html>bad gateway</html>");
        let s = Status::from_body(500, &[0xff; 1000]);
        assert_eq!(s.code, 500);
    }

    #[test]
    fn too_large_resource_version_is_recognized() {
        // What k8s.io/apiserver's NewTooLargeResourceVersionError becomes on the wire
        // (apimachinery NewTimeoutError + the ResourceVersionTooLarge cause).
        let body = br#"{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"Timeout: Too large resource version: 1012, current: 1003","reason":"Timeout","details":{"causes":[{"reason":"ResourceVersionTooLarge","message":"Too large resource version"}],"retryAfterSeconds":1},"code":504}"#;
        let e = KubeError::Status {
            request: req(),
            status: Status::from_body(504, body),
            retry_after: None,
            node: "n".into(),
        };
        assert!(e.is_resource_version_too_large());
        assert!(!e.is_expired());
        let s = Status::from_body(504, body);
        assert_eq!(s.details.as_ref().map(|d| d.retry_after_seconds), Some(1));
        // Older servers: the message only, or the cause's message without its type.
        for old in [
            &br#"{"kind":"Status","message":"Timeout: Too large resource version: 5, current: 3","reason":"Timeout","code":504}"#[..],
            br#"{"kind":"Status","message":"Timeout","reason":"Timeout","details":{"causes":[{"message":"Too large resource version"}]},"code":504}"#,
        ] {
            assert!(Status::from_body(504, old).is_resource_version_too_large());
        }
        // Any other 504 is a plain timeout, retried as one.
        let other = br#"{"kind":"Status","message":"Timeout: request did not complete within 60s","reason":"Timeout","code":504}"#;
        assert!(!Status::from_body(504, other).is_resource_version_too_large());
        let same_words = br#"{"kind":"Status","message":"Too large resource version","code":500}"#;
        assert!(!Status::from_body(500, same_words).is_resource_version_too_large());
    }

    #[test]
    fn expired_is_recognized() {
        let body = br#"{"kind":"Status","status":"Failure","message":"too old","reason":"Expired","code":410}"#;
        let e = KubeError::Status {
            request: req(),
            status: Status::from_body(410, body),
            retry_after: None,
            node: "n".into(),
        };
        assert!(e.is_expired());
    }
}
