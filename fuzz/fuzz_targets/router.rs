//! The local API's admission and routing on arbitrary request heads: the Origin, Sec-Fetch-Site
//! and Host checks, the bearer token's parsing, the router and its path parser, and the access
//! class decision (`edgehub::api::admit::admit`) for every kind of caller.
#![no_main]

use edgehub::api::admit::{admit, Denial, Head};
use edgehub::api::guard::{self, Peer, Via};
use edgehub::api::router::Access;
use libfuzzer_sys::fuzz_target;

fn header(l: Option<&[u8]>) -> Option<&[u8]> {
    l.filter(|v| !v.is_empty())
}

const TOKEN: &[u8] = b"token";

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
    let unix = |uid, privileged| Via::Unix {
        peer: Peer {
            uid: Some(uid),
            privileged,
        },
    };
    let vias = [
        Via::Tcp {
            local: std::net::Ipv4Addr::LOCALHOST.into(),
        },
        Via::Tcp {
            local: std::net::Ipv6Addr::LOCALHOST.into(),
        },
        unix(0, true),
        unix(1000, false),
        Via::Unix {
            peer: Peer {
                uid: None,
                privileged: false,
            },
        },
    ];
    for via in vias {
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
    let _ = guard::authenticate(Some(TOKEN), auth);
    let presents_token = auth.and_then(guard::bearer_token) == Some(TOKEN);
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

    // The whole admission, with and without a token configured, for every caller: what it
    // admits to a privileged route, the caller had a credential for.
    let head = Head {
        method,
        path,
        host,
        origin,
        sec_fetch_site: site,
        authorization: auth,
    };
    for via in vias {
        let socket_ok = matches!(via, Via::Unix { peer } if peer.privileged);
        for token in [None, Some(TOKEN)] {
            match admit(&head, via, token) {
                Ok(route) => {
                    if route.access() == Access::Privileged {
                        assert!(
                            socket_ok || (token.is_some() && presents_token),
                            "{method} {path} admitted to a caller without a credential: {via:?}"
                        );
                    }
                    if token.is_some() && !guard::is_open_path(path) {
                        assert!(socket_ok || presents_token, "the token was not asked for");
                    }
                    assert_eq!(
                        edgehub::api::router::route(method, path).ok(),
                        Some(route),
                        "admission routes as the router does"
                    );
                }
                Err(Denial::Forbidden(f)) => {
                    assert!(!socket_ok && !(token.is_some() && presents_token));
                    assert_eq!(f.via, via);
                    let m = f.message(path, &Default::default());
                    assert!(m.starts_with("Forbidden: "));
                }
                Err(_) => {}
            }
        }
    }
});
