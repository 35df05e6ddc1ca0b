//! How long to wait after a failed request: what the server asked for, or the backoff. Every
//! task that talks to the apiserver waits the same way.

use super::KubeError;
use crate::backoff::Backoff;
use std::time::Duration;

/// The wait after an error: Retry-After when the server asked for one (capped), else backoff.
pub fn delay_after(e: &KubeError, backoff: &mut Backoff) -> Duration {
    match e.retry_after() {
        Some(ra) => {
            backoff.next_delay();
            ra.min(Duration::from_secs(600))
        }
        None => backoff.next_delay(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_wins_over_backoff() {
        let mut b = Backoff::new(Duration::from_millis(1), Duration::from_millis(2));
        let e = KubeError::Status {
            request: crate::kube::Request {
                verb: "list",
                resource: "pods".into(),
                namespace: None,
                name: None,
            },
            status: crate::kube::Status {
                code: 429,
                reason: "TooManyRequests".into(),
                message: "slow down".into(),
                details: None,
            },
            retry_after: Some(Duration::from_secs(3)),
            node: "n".into(),
        };
        assert_eq!(delay_after(&e, &mut b), Duration::from_secs(3));
    }
}
