//! What a failed delivery means, pure: the one place that reads the apiserver's answers.

use crate::kube::KubeError;
use std::time::Duration;

/// What to do with a row the apiserver did not take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The link is down: stop draining, keep everything.
    Offline,
    /// The apiserver does not take edgehub's credentials (401): a verdict on the credentials,
    /// not on the report, and every other row would get the same. Stop draining, keep
    /// everything, and try again with backoff: credentials that lapsed offline are renewed,
    /// and then everything must be delivered.
    Unauthorized,
    /// A passing failure (5xx, 429, a timeout the server reported; the Node authorizer not
    /// yet linking a new pod to this node): try again later, after the server's
    /// `Retry-After` when it gave one.
    Retry(Option<Duration>),
    /// The target is gone (404; the Node authorizer's 403 for a pod no longer bound here,
    /// once it has outlasted the authorizer's lag; a 422 on a stale `metadata.uid`, the pod
    /// replaced under the same name): nothing to deliver.
    Drop,
    /// Refused (any other 4xx): kept with its error, out of the way of the rest, and tried
    /// again on its own with a long backoff.
    Park,
}

/// How often a Node authorizer 403 "no relationship found" is tried again before it is
/// taken to mean the pod is not bound here any more. Its graph links a pod to the node
/// moments after the binding (fixture `configmap_get_unreferenced_forbidden`), so a report
/// about a pod bound just now can get this answer; five tries with the retry backoff span
/// 15 to 30 s with the default policy.
pub const AUTHORIZER_LAG_RETRIES: i64 = 5;

/// The verdict on a failed delivery of a row already tried `attempts` times.
pub fn classify(e: &KubeError, attempts: i64) -> Verdict {
    if e.is_offline() {
        return Verdict::Offline;
    }
    match e.code() {
        Some(401) => Verdict::Unauthorized,
        Some(404) => Verdict::Drop,
        Some(403) if e.is_authorizer_lag() && attempts < AUTHORIZER_LAG_RETRIES => {
            Verdict::Retry(None)
        }
        Some(403) if e.is_authorizer_lag() => Verdict::Drop,
        Some(422) if e.is_stale_uid() => Verdict::Drop,
        Some(408 | 429) => Verdict::Retry(e.retry_after()),
        Some(c) if (400..500).contains(&c) => Verdict::Park,
        Some(_) => Verdict::Retry(e.retry_after()),
        // A response that could not be read, a TLS problem: worth another try.
        None => Verdict::Retry(None),
    }
}

/// What the answer to the DELETE of a pod object (delete-and-adopt) says about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deletion {
    /// Deleted now or before (404; the Node authorizer's 403 "no relationship found" for a
    /// pod that is no longer there), or replaced under another uid (409 on the uid
    /// precondition): its replacement is awaited.
    Done,
    /// The apiserver answered and kept the pod object (a 4xx that says why): the sandbox is
    /// not awaiting anything.
    Refused,
    /// No answer (a timeout, a dropped link, an answer cut short) or one that does not say
    /// (5xx: a 500 or 504 can follow a write that committed). The DELETE may have landed,
    /// and the watch may be about to tell of it: the sandbox keeps awaiting its replacement,
    /// and the DELETE is asked again while the pod object is still cached.
    Unknown,
}

/// The verdict on the answer to a pod DELETE.
pub fn deletion(answer: &Result<String, KubeError>) -> Deletion {
    let e = match answer {
        Ok(_) => return Deletion::Done,
        Err(e) => e,
    };
    match e.code() {
        Some(404 | 409) => Deletion::Done,
        Some(403) if e.is_authorizer_lag() => Deletion::Done,
        Some(c) if (400..500).contains(&c) => Deletion::Refused,
        _ => Deletion::Unknown,
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
        let first = |e: KubeError| classify(&e, 0);
        assert_eq!(first(status(404, "not found", None)), Verdict::Drop);
        assert_eq!(
            first(status(
                422,
                "metadata.uid: Invalid value: \"x\": field is immutable",
                None
            )),
            Verdict::Drop
        );
        assert_eq!(
            first(status(422, "status.podIPs: Invalid value", None)),
            Verdict::Park
        );
        assert_eq!(first(status(400, "bad", None)), Verdict::Park);
        assert_eq!(first(status(403, "forbidden: RBAC", None)), Verdict::Park);
        assert_eq!(
            first(status(429, "slow down", Some(7))),
            Verdict::Retry(Some(Duration::from_secs(7)))
        );
        assert_eq!(first(status(500, "oops", None)), Verdict::Retry(None));
        assert_eq!(
            first(status(503, "busy", Some(2))),
            Verdict::Retry(Some(Duration::from_secs(2)))
        );
    }

    #[test]
    fn a_401_is_about_the_credentials_and_stops_the_drain_however_often_it_came() {
        for attempts in [0, 1, 1000] {
            assert_eq!(
                classify(&status(401, "Unauthorized", None), attempts),
                Verdict::Unauthorized
            );
        }
    }

    #[test]
    fn no_relationship_is_retried_for_the_authorizers_lag_then_dropped() {
        let lag = || {
            status(
                403,
                "pods \"p\" is forbidden: User \"system:node:n\" cannot patch resource \"pods/status\" in API group \"\" in the namespace \"ns\": no relationship found between node 'n' and this object",
                None,
            )
        };
        for attempts in 0..AUTHORIZER_LAG_RETRIES {
            assert_eq!(
                classify(&lag(), attempts),
                Verdict::Retry(None),
                "{attempts}"
            );
        }
        assert_eq!(classify(&lag(), AUTHORIZER_LAG_RETRIES), Verdict::Drop);
        // Any other 403 is a refusal: RBAC, NodeRestriction.
        assert_eq!(
            classify(
                &status(
                    403,
                    "pods \"p\" is forbidden: node \"n\" can only update pod status",
                    None
                ),
                0
            ),
            Verdict::Park
        );
    }

    #[test]
    fn a_delete_is_taken_back_only_when_the_apiserver_said_it_kept_the_pod() {
        use crate::kube::Request;
        let request = || Request {
            verb: "delete",
            resource: "pods".into(),
            namespace: None,
            name: None,
        };
        let err = |e: KubeError| deletion(&Err(e));
        assert_eq!(deletion(&Ok("{}".into())), Deletion::Done);
        assert_eq!(err(status(404, "not found", None)), Deletion::Done);
        assert_eq!(
            err(status(
                409,
                "the UID in the precondition does not match",
                None
            )),
            Deletion::Done
        );
        assert_eq!(
            err(status(
                403,
                "pods \"p\" is forbidden: no relationship found between node 'n' and this object",
                None
            )),
            Deletion::Done
        );
        assert_eq!(err(status(403, "forbidden: RBAC", None)), Deletion::Refused);
        assert_eq!(err(status(429, "slow down", Some(1))), Deletion::Refused);
        assert_eq!(err(status(401, "Unauthorized", None)), Deletion::Refused);
        // The DELETE may have landed.
        assert_eq!(err(status(500, "oops", None)), Deletion::Unknown);
        assert_eq!(err(status(504, "timeout", None)), Deletion::Unknown);
        assert_eq!(
            err(KubeError::Timeout {
                request: request(),
                timeout: Duration::from_secs(10)
            }),
            Deletion::Unknown
        );
        assert_eq!(
            err(KubeError::Unreachable {
                request: request(),
                server: "s".into(),
                reason: "connection closed before message completed".into()
            }),
            Deletion::Unknown
        );
    }
}
