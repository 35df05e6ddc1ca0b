//! The node API's (port 10250) reading of a request line, as the apiserver or anyone who
//! reaches the port sends it: the route from the method and path, the authorizer's verb and
//! subresources, and every query parser the routes use (`/containerLogs`' `sinceTime`,
//! `sinceSeconds`, `tailLines`, `limitBytes`; exec and attach options; port-forward ports),
//! plus the local API's log options and the RFC 3339 reader on the raw text. None may panic
//! (a release build aborts on one); what each accepts must hold its invariants.
#![no_main]

use edgehub::kubelet_api::logs::LogQuery;
use edgehub::kubelet_api::route::{self, Route};
use edgehub::kubelet_api::{authz, streams};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(line) = std::str::from_utf8(data) else {
        return;
    };
    // `METHOD /path?query`; without a space, a GET of all of it.
    let (method, target) = line.split_once(' ').unwrap_or(("GET", line));
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (target, None),
    };
    match route::parse(method, path) {
        Route::ContainerLogs {
            namespace,
            pod,
            container,
        } => {
            assert!(!namespace.is_empty() && !pod.is_empty() && !container.is_empty());
            assert!(!(namespace.contains('/') || pod.contains('/') || container.contains('/')));
        }
        Route::Stream(t) => {
            assert!(method == "GET" || method == "POST");
            assert!(!t.namespace.is_empty() && !t.pod.is_empty());
        }
        _ => {}
    }
    let _ = authz::verb(method);
    assert!(!authz::subresources(path).is_empty());

    if let Ok(q) = LogQuery::parse(query) {
        assert!(!(q.since_seconds.is_some() && q.since_time.is_some()));
        assert!(q.limit_bytes != Some(0) && q.since_seconds != Some(0));
        // The start time from any clock, however far off.
        for now in [0, i128::from(i64::MAX), i128::from(i64::MIN)] {
            let _ = q.since_nanos(now);
        }
    }
    if let Ok(o) = streams::StreamOptions::parse(query) {
        assert!(o.stdin || o.stdout || o.stderr);
        assert!(!(o.tty && o.stderr));
    }
    for websocket in [false, true] {
        if let Ok(ports) = streams::forward_ports(query, websocket) {
            assert!(ports.iter().all(|p| (1..=65535).contains(p)));
            assert!(websocket || ports.is_empty());
        }
    }
    let _ = edgehub::logs::Options::from_query(query);
    if let Some(n) = edgehub::logs::rfc3339_nanos(line) {
        // Only an ASCII stamp of at least 20 bytes reads as one, within years 0 to 9999.
        assert!(line.is_ascii() && line.len() >= 20);
        assert!((-62_200_000_000_000_000_000..=253_500_000_000_000_000_000).contains(&n));
    }
});
