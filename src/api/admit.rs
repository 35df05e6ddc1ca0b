//! Everything decided about a request before a handler runs or its body is read, in order,
//! as one pure function of its head and its connection ([`admit`]), so the order itself is
//! unit-tested and fuzzed (fuzz/fuzz_targets/router.rs):
//!
//! 1. a web page or a foreign `Host` gets a 403 ([`guard::check_origin_and_host`]);
//! 2. with a token configured, a caller without a credential gets a 401 on every path but
//!    the health probes, before any name is looked at ([`guard::needs_token`]);
//! 3. the router: 400, 404, 405, 414 ([`router::route`]);
//! 4. the route's access class: a privileged route without a credential is a 403
//!    ([`guard::gate`]).

use super::guard::{self, Auth, Forbidden, Refusal, Via};
use super::router::{self, Reject, Route};

/// What of a request's head admission reads. Each header is `None` when absent; `host` also
/// when the request has more than one.
#[derive(Debug, Clone, Copy, Default)]
pub struct Head<'a> {
    pub method: &'a str,
    pub path: &'a str,
    pub host: Option<&'a [u8]>,
    pub origin: Option<&'a [u8]>,
    pub sec_fetch_site: Option<&'a [u8]>,
    pub authorization: Option<&'a [u8]>,
}

/// Why a request was not admitted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Denial {
    /// 403: a web page's request, or a foreign `Host`.
    Refused(Refusal),
    /// 401: the token is configured and the caller has no credential.
    Unauthorized(Auth),
    /// The router's 400, 404, 405 or 414.
    Rejected(Reject),
    /// 403: a privileged route, and the caller has no credential.
    Forbidden(Forbidden),
}

impl Denial {
    /// The metrics' name for it.
    pub fn name(&self) -> &'static str {
        match self {
            Denial::Refused(_) => "refused",
            Denial::Unauthorized(_) => "unauthorized",
            Denial::Rejected(_) => "rejected",
            Denial::Forbidden(_) => "forbidden",
        }
    }
}

/// The route a request may be served, or why not. `token`: the configured token, if any.
pub fn admit(head: &Head<'_>, via: Via, token: Option<&[u8]>) -> Result<Route, Denial> {
    guard::check_origin_and_host(head.origin, head.sec_fetch_site, head.host, via)
        .map_err(Denial::Refused)?;
    let token_set = token.is_some();
    let auth = guard::authenticate(token, head.authorization);
    if guard::needs_token(token_set, auth, via, head.path) {
        return Err(Denial::Unauthorized(auth));
    }
    let route = router::route(head.method, head.path).map_err(Denial::Rejected)?;
    guard::gate(route.access(), token_set, auth, via).map_err(Denial::Forbidden)?;
    Ok(route)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::guard::Peer;
    use crate::api::router::Access;

    const TCP: Via = Via::Tcp {
        local: std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
    };
    fn unix(uid: u32, privileged: bool) -> Via {
        Via::Unix {
            peer: Peer {
                uid: Some(uid),
                privileged,
            },
        }
    }

    fn head<'a>(method: &'a str, path: &'a str, auth: Option<&'a [u8]>) -> Head<'a> {
        Head {
            method,
            path,
            host: Some(b"127.0.0.1:10267"),
            authorization: auth,
            ..Head::default()
        }
    }

    /// Every route in the table, with each kind of caller: who gets in, and what the others
    /// get. The shipped case (no token, TCP for OpenYurt, the socket for root) first.
    #[test]
    fn every_route_and_every_caller() {
        let good: &[u8] = b"Bearer s3cret";
        let bad: &[u8] = b"Bearer nope";
        for (pattern, method, access, _) in router::ROUTES {
            let path = pattern
                .replace("{ns}", "vehicle")
                .replace("{name}", "p")
                .replace("{id}", "0123456789abcdef");
            let privileged = *access == Access::Privileged;
            let probe = guard::is_open_path(&path);
            let ok =
                |via, token: Option<&[u8]>, auth| admit(&head(method, &path, auth), via, token);
            // No token configured.
            assert_eq!(ok(TCP, None, None).is_ok(), !privileged, "{method} {path}");
            assert_eq!(ok(unix(1000, false), None, None).is_ok(), !privileged);
            assert!(ok(unix(0, true), None, None).is_ok());
            if privileged {
                assert!(matches!(ok(TCP, None, None), Err(Denial::Forbidden(_))));
                // A token sent where none is configured opens nothing.
                assert!(matches!(
                    ok(TCP, None, Some(good)),
                    Err(Denial::Forbidden(_))
                ));
            }
            // A token configured: it opens everything, a privileged peer needs none.
            let t = Some(&b"s3cret"[..]);
            assert!(ok(TCP, t, Some(good)).is_ok());
            assert!(ok(unix(0, true), t, None).is_ok());
            for auth in [None, Some(bad)] {
                let r = ok(TCP, t, auth);
                assert_eq!(r.is_ok(), probe, "{method} {path}");
                if !probe {
                    assert!(matches!(r, Err(Denial::Unauthorized(_))), "401 first");
                }
                assert_eq!(ok(unix(1000, false), t, auth).is_ok(), probe);
            }
        }
    }

    /// The order: a page is refused before the token is asked for, the token before the
    /// router says anything, the router before the access class.
    #[test]
    fn the_order_of_refusals() {
        let page = Head {
            origin: Some(b"http://example.org"),
            ..head("POST", "/v1/images/load", None)
        };
        assert!(matches!(
            admit(&page, unix(0, true), None),
            Err(Denial::Refused(_))
        ));
        let h = head("GET", "/openyurt.io/v1/namespaces/Bad/pods/x/upgrade", None);
        assert!(matches!(
            admit(&h, TCP, Some(b"t")),
            Err(Denial::Unauthorized(Auth::Missing))
        ));
        assert!(matches!(admit(&h, TCP, None), Err(Denial::Rejected(r)) if r.status == 400));
        let h = head("GET", "/v1/images/load", None);
        assert!(
            matches!(admit(&h, TCP, None), Err(Denial::Rejected(r)) if r.status == 405),
            "a wrong method is a 405 before the class is looked at"
        );
        let h = head("POST", "/v1/images/load", None);
        let Err(Denial::Forbidden(f)) = admit(&h, unix(1000, false), None) else {
            panic!("a 403")
        };
        assert_eq!(f.via, unix(1000, false));
        assert_eq!(Denial::Forbidden(f).name(), "forbidden");
    }
}
