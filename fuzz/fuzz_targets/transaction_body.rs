//! The bodies of `POST /v1/transactions` and `POST /v1/transactions/{id}/rollback`, as a
//! hostile caller may send them: never a panic, and what is accepted keeps the limits.
#![no_main]

use edgehub::api::transactions::{parse_rollback, parse_start, MAX_PODS, MAX_REASON, MAX_TIMEOUT_SECS};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(start) = parse_start(data) {
        assert!(!start.pods.is_empty() && start.pods.len() <= MAX_PODS);
        for (i, p) in start.pods.iter().enumerate() {
            assert!(edgehub::names::check_label(&p.namespace).is_ok());
            assert!(edgehub::names::check_subdomain(&p.name).is_ok());
            assert!(p.revision.as_ref().is_none_or(|r| !r.is_empty() && r.len() <= 63));
            assert!(start.pods[..i]
                .iter()
                .all(|q| (&q.namespace, &q.name) != (&p.namespace, &p.name)));
        }
        assert!(start
            .commit_timeout_secs
            .is_none_or(|t| (1..=MAX_TIMEOUT_SECS).contains(&t)));
    }
    if let Ok(Some(reason)) = parse_rollback(data) {
        assert!(reason.chars().count() <= MAX_REASON);
        assert!(!reason.chars().any(char::is_control));
    }
});
