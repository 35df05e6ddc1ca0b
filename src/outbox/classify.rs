//! What a failed delivery means, pure: the one place that reads the apiserver's answers.

use crate::kube::KubeError;
use std::time::Duration;

/// What to do with a row the apiserver did not take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The link is down: stop draining, keep everything.
    Offline,
    /// A passing failure (5xx, 429, a timeout the server reported): try again later, after
    /// the server's `Retry-After` when it gave one.
    Retry(Option<Duration>),
    /// The target is gone (404; a Node authorizer 403 for a pod no longer bound here; a 422
    /// on a stale `metadata.uid`, the pod replaced under the same name): nothing to deliver.
    Drop,
    /// Refused for good (any other 4xx): kept with its error, out of the way of the rest.
    Park,
}

/// The verdict on a failed delivery.
pub fn classify(e: &KubeError) -> Verdict {
    if e.is_offline() {
        return Verdict::Offline;
    }
    match e.code() {
        Some(404) => Verdict::Drop,
        // The Node authorizer answers 403 for a pod not bound to this node any more; its own
        // lag right after binding reads "no relationship found" too, and is retried.
        Some(403) if e.is_authorizer_lag() => Verdict::Drop,
        Some(422) if e.is_stale_uid() => Verdict::Drop,
        Some(408 | 429) => Verdict::Retry(e.retry_after()),
        Some(c) if (400..500).contains(&c) => Verdict::Park,
        Some(_) => Verdict::Retry(e.retry_after()),
        // A response that could not be read, a TLS problem: worth another try.
        None => Verdict::Retry(None),
    }
}

/// An apiserver answer of `code` with `message`, for the outbox's tests.
#[cfg(test)]
pub(super) fn refused(code: u16, message: &str, retry_after: Option<u64>) -> KubeError {
    use crate::kube::{Request, Status};
    KubeError::Status {
        request: Request {
            verb: "patch",
            resource: "pods".into(),
            namespace: None,
            name: None,
        },
        status: Status {
            code,
            reason: String::new(),
            message: message.into(),
            details: None,
        },
        retry_after: retry_after.map(Duration::from_secs),
        node: "n".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::refused as status;
    use super::*;

    #[test]
    fn answers_and_their_verdicts() {
        assert_eq!(classify(&status(404, "not found", None)), Verdict::Drop);
        assert_eq!(
            classify(&status(
                403,
                "pods \"p\" is forbidden: no relationship found between node 'n' and this object",
                None
            )),
            Verdict::Drop
        );
        assert_eq!(
            classify(&status(
                422,
                "metadata.uid: Invalid value: \"x\": field is immutable",
                None
            )),
            Verdict::Drop
        );
        assert_eq!(
            classify(&status(422, "status.podIPs: Invalid value", None)),
            Verdict::Park
        );
        assert_eq!(classify(&status(400, "bad", None)), Verdict::Park);
        assert_eq!(
            classify(&status(403, "forbidden: RBAC", None)),
            Verdict::Park
        );
        assert_eq!(
            classify(&status(429, "slow down", Some(7))),
            Verdict::Retry(Some(Duration::from_secs(7)))
        );
        assert_eq!(classify(&status(500, "oops", None)), Verdict::Retry(None));
        assert_eq!(
            classify(&status(503, "busy", Some(2))),
            Verdict::Retry(Some(Duration::from_secs(2)))
        );
    }
}
