//! The local API's admission and routing on arbitrary request heads: the Origin, Sec-Fetch-Site
//! and Host checks, the bearer token's parsing, the router and its path parser.
#![no_main]

use edgehub::api::guard::{self, Via};
use libfuzzer_sys::fuzz_target;

fn header(l: Option<&[u8]>) -> Option<&[u8]> {
    l.filter(|v| !v.is_empty())
}

fuzz_target!(|data: &[u8]| {
    // Lines: request line, Host, Origin, Sec-Fetch-Site, Authorization (empty: absent).
    let mut lines = data.split(|b| *b == b'\n');
    let request = lines.next().unwrap_or_default();
    let (host, origin, site, auth) = (
        header(lines.next()),
        header(lines.next()),
        header(lines.next()),
        header(lines.next()),
    );
    for via in [
        Via::Tcp {
            local: std::net::Ipv4Addr::LOCALHOST.into(),
        },
        Via::Tcp {
            local: std::net::Ipv6Addr::LOCALHOST.into(),
        },
        Via::Unix,
    ] {
        if guard::check_origin_and_host(origin, site, host, via).is_err() {
            continue;
        }
        assert!(origin.is_none(), "a request with an Origin was admitted");
        assert!(
            site.is_none_or(|s| s.eq_ignore_ascii_case(b"none")),
            "a page's Sec-Fetch-Site was admitted"
        );
        if matches!(via, Via::Tcp { .. }) {
            // What DNS rebinding needs is a name it controls in Host: over TCP only
            // `localhost` and IP literals (bracketed or dotted/numeric) get in.
            let h = host.expect("over TCP a request without Host was admitted");
            let lower = h.to_ascii_lowercase();
            assert!(
                lower.starts_with(b"localhost")
                    || lower.starts_with(b"[")
                    || std::str::from_utf8(&lower)
                        .ok()
                        .and_then(|v| v.rsplit_once(':').map_or(Some(v), |(a, _)| Some(a)))
                        .is_some_and(|a| a.parse::<std::net::IpAddr>().is_ok()),
                "a foreign Host was admitted: {:?}",
                String::from_utf8_lossy(h)
            );
        }
    }
    let _ = guard::authenticate(Some(b"token"), auth);
    if let Some(t) = auth.and_then(guard::bearer_token) {
        assert!(!t.is_empty() && t[0] != b' ');
    }
    let Ok(s) = std::str::from_utf8(request) else {
        return;
    };
    let (method, path) = s.split_once(' ').unwrap_or(("GET", s));
    if let Ok(route) = edgehub::api::router::route(method, path) {
        // Whatever is routed has names that passed the DNS-1123 checks.
        let _ = route.name();
    }
    let _ = guard::is_open_path(path);
    let _ = edgehub::local_client::upgrade_path(s, "upgrade");
});
