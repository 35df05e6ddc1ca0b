//! Who may talk to the local API, decided from the request's head before any route or name
//! is looked at. Pure functions of header bytes, so they are unit-tested and fuzzed without a
//! server (fuzz/fuzz_targets/router.rs).
//!
//! The order is the point: [`check_origin_and_host`] first (a web page gets nothing, not
//! even a 401), then the bearer token ([`needs_token`]: an unauthenticated client learns
//! nothing about routes or names: no 400, 404 or 405), then the router, then the route's
//! access class ([`gate`]: a privileged route without a credential is a 403), and only then
//! is the body read.

use super::router::Access;
use std::net::IpAddr;

/// Where a connection came in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// TCP, on this local address (what the client connected to). Any local process can
    /// connect to a loopback port, hostNetwork pods included: TCP says nothing of the caller.
    Tcp { local: IpAddr },
    /// The unix socket: no browser can reach it, and what its clients put in `Host` varies
    /// (curl sends `localhost`, others the socket's path or nothing). The kernel says who the
    /// peer is.
    Unix { peer: Peer },
}

/// A unix-socket peer as the kernel reported it when it connected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    /// Its uid (`SO_PEERCRED`); `None` when the kernel would not say.
    pub uid: Option<u32>,
    /// Root, or a member of `[api] socket_group` ([`privileged_peer`]).
    pub privileged: bool,
}

/// Whether a unix-socket peer may call privileged routes: uid 0, or `group` (the gid of
/// `[api] socket_group`) among its primary gid and supplementary groups. The groups are the
/// peer's own at `connect()` (`SO_PEERGROUPS`), not the group database's idea of its user,
/// so a process that dropped a group does not keep it here.
pub fn privileged_peer(uid: u32, gid: u32, groups: &[u32], group: Option<u32>) -> bool {
    uid == 0 || group.is_some_and(|g| gid == g || groups.contains(&g))
}

/// What a caller holds that opens privileged routes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Credential {
    /// The token of `[api] token_file`.
    Token,
    /// A privileged unix-socket peer.
    Socket,
}

/// The caller's credential, if it has one. `token_set`: `[api] token_file` is configured
/// (without one, [`authenticate`] says `Ok` to everyone, and that is no credential).
pub fn credential(token_set: bool, auth: Auth, via: Via) -> Option<Credential> {
    match via {
        Via::Unix { peer } if peer.privileged => Some(Credential::Socket),
        _ if token_set && auth == Auth::Ok => Some(Credential::Token),
        _ => None,
    }
}

/// Before the router: with a token configured, a caller with no credential reaches only the
/// health probes; the rest is a 401 that names nothing behind it. A privileged socket peer
/// holds a credential stronger than the token (it may load images), so it needs none.
pub fn needs_token(token_set: bool, auth: Auth, via: Via, path: &str) -> bool {
    token_set && credential(token_set, auth, via).is_none() && !is_open_path(path)
}

/// After the router, before the body is read: a privileged route is served only to a caller
/// with a credential.
pub fn gate(access: Access, token_set: bool, auth: Auth, via: Via) -> Result<(), Forbidden> {
    match (access, credential(token_set, auth, via)) {
        (Access::Open, _) | (Access::Privileged, Some(_)) => Ok(()),
        (Access::Privileged, None) => Err(Forbidden { via, token_set }),
    }
}

/// A privileged route refused: what the caller lacked, to say how to get access.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Forbidden {
    pub via: Via,
    pub token_set: bool,
}

/// How privileged routes can be reached on this node, for the 403's message.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SocketAccess {
    /// `[api] socket`.
    pub path: Option<std::path::PathBuf>,
    /// `[api] socket_group`, by name and gid.
    pub group: Option<(String, u32)>,
}

impl Forbidden {
    /// The 403's text: what was refused, why, and the ways in that this node offers.
    pub fn message(&self, what: &str, socket: &SocketAccess) -> String {
        let who = match (&socket.group, self.via) {
            (Some((g, _)), _) => format!("as root or as a member of group {g}"),
            (None, _) => "as root".to_string(),
        };
        let mut ways = Vec::new();
        match &socket.path {
            Some(p) => ways.push(format!(
                "connect to the unix socket {} {who} (edgehub's own commands do, e.g. `sudo \
                 edgehub images load FILE`)",
                p.display()
            )),
            None => ways.push(format!(
                "set [api] socket in edgehub's config and connect to it {who}"
            )),
        }
        if self.token_set {
            ways.push("send the token of [api] token_file (Authorization: Bearer)".into());
        }
        let this = match self.via {
            Via::Tcp { .. } if self.token_set => "this TCP connection sent no valid token",
            Via::Tcp { .. } => {
                "this TCP connection carries none (any local process can connect to it)"
            }
            Via::Unix { peer } => match peer.uid {
                Some(_) => "this socket peer is neither root nor in the group",
                None => "the kernel did not say who this socket peer is",
            },
        };
        let uid = match self.via {
            Via::Unix {
                peer: Peer { uid: Some(u), .. },
            } => format!(" (uid {u})"),
            _ => String::new(),
        };
        format!(
            "Forbidden: {what} brings new code or credentials onto the node, or decides what \
             runs on it, so it needs a credential, and {this}{uid}. To get access, {}.",
            ways.join(", or ")
        )
    }
}

/// Why a request was refused before authentication.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    pub status: u16,
    pub message: &'static str,
}

pub const FROM_A_WEB_PAGE: Refusal = Refusal {
    status: 403,
    message: "Forbidden: requests from web pages are refused (the request carries an Origin \
              or a cross-site Sec-Fetch-Site header); the local API is for programs on the device",
};

pub const FOREIGN_HOST: Refusal = Refusal {
    status: 403,
    message: "Forbidden: the Host header must name a loopback address or localhost (a request \
              for another host name is what a DNS-rebinding web page sends)",
};

/// A browser's request carries `Origin` whenever it is cross-origin or not a GET (a form
/// POST, a `fetch` in `no-cors` mode), and a page served by edgehub itself does not exist, so
/// any `Origin` is a web page's. `Sec-Fetch-Site` catches the cross-site GETs that carry no
/// `Origin` (`<img src>`, `<script src>`): only `none` (the user typed the address) is not a
/// page's doing. No program the API is for sends either header.
///
/// `Host` is what defeats DNS rebinding: a page on `http://attacker.example:10267` whose name
/// the attacker re-points at 127.0.0.1 reads the API as its own origin, with no `Origin`
/// header, but its requests say `Host: attacker.example:10267`. On TCP the host must be a
/// loopback address, `localhost`, or the address the connection came in on (an IP literal
/// cannot be rebound); the port is not compared. `host` is `None` when the request has no
/// `Host`, or more than one.
pub fn check_origin_and_host(
    origin: Option<&[u8]>,
    sec_fetch_site: Option<&[u8]>,
    host: Option<&[u8]>,
    via: Via,
) -> Result<(), Refusal> {
    if origin.is_some() || sec_fetch_site.is_some_and(|s| !s.eq_ignore_ascii_case(b"none")) {
        return Err(FROM_A_WEB_PAGE);
    }
    match via {
        Via::Unix { .. } => Ok(()),
        Via::Tcp { local } => match host.and_then(host_name) {
            Some(h) if local_host(h, local) => Ok(()),
            _ => Err(FOREIGN_HOST),
        },
    }
}

/// The host part of a `Host` value: without its port, an IPv6 literal without its brackets.
/// `None` when the value is not a host and an optional numeric port.
fn host_name(value: &[u8]) -> Option<&str> {
    let v = std::str::from_utf8(value).ok()?;
    let (host, port) = match v.strip_prefix('[') {
        Some(rest) => {
            let (h, after) = rest.split_once(']')?;
            match after {
                "" => (h, None),
                a => (h, Some(a.strip_prefix(':')?)),
            }
        }
        None => match v.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (v, None),
        },
    };
    if let Some(p) = port {
        if p.is_empty() || p.len() > 5 || !p.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
    }
    (!host.is_empty()).then_some(host)
}

fn local_host(host: &str, local: IpAddr) -> bool {
    if host.eq_ignore_ascii_case("localhost") {
        return true;
    }
    match host.parse::<IpAddr>() {
        Ok(ip) => {
            let ip = ip.to_canonical();
            ip.is_loopback() || ip == local.to_canonical()
        }
        Err(_) => false,
    }
}

/// Paths that stay open when a bearer token is configured: the health probes, which say
/// nothing about the node's pods and which a supervisor must reach without the token.
pub fn is_open_path(path: &str) -> bool {
    matches!(path, "/v1/healthz" | "/v1/readyz")
}

/// The token of an `Authorization` header value with the `Bearer` scheme. The scheme's name is
/// case-insensitive (RFC 7235 §2.1), one or more spaces separate it from the token.
pub fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    const SCHEME: &[u8] = b"bearer";
    if value.len() <= SCHEME.len() || !value[..SCHEME.len()].eq_ignore_ascii_case(SCHEME) {
        return None;
    }
    let rest = &value[SCHEME.len()..];
    let token = rest.strip_prefix(b" ")?;
    let start = token.iter().position(|b| *b != b' ')?;
    Some(&token[start..])
}

/// Compares without an early exit, so the token cannot be guessed byte by byte from timing.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// What the `Authorization` header says against the configured token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Auth {
    /// No token is configured, or the request carries the right one.
    Ok,
    /// No bearer token was sent.
    Missing,
    /// A bearer token was sent, and it is not the configured one.
    Invalid,
}

pub fn authenticate(configured: Option<&[u8]>, authorization: Option<&[u8]>) -> Auth {
    let Some(want) = configured else {
        return Auth::Ok;
    };
    match authorization.and_then(bearer_token) {
        None => Auth::Missing,
        Some(t) if constant_time_eq(t, want) => Auth::Ok,
        Some(_) => Auth::Invalid,
    }
}

/// The `WWW-Authenticate` value of a 401 (RFC 6750 §3): the scheme, and when a token was sent,
/// that it was refused.
pub fn challenge(auth: Auth) -> &'static str {
    match auth {
        Auth::Invalid => "Bearer realm=\"edgehub\", error=\"invalid_token\"",
        _ => "Bearer realm=\"edgehub\"",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_health_probes_are_open_without_the_token() {
        use crate::api::router::{route, Route, ROUTES};
        for (pattern, method, _, _) in ROUTES {
            let path = pattern
                .replace("{ns}", "default")
                .replace("{name}", "p")
                .replace("{id}", "0123456789abcdef");
            let open = matches!(route(method, &path), Ok(Route::Healthz | Route::Readyz));
            assert_eq!(is_open_path(&path), open, "{path}");
        }
    }

    const LO: Via = Via::Tcp {
        local: IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
    };

    const UNIX_ROOT: Via = Via::Unix {
        peer: Peer {
            uid: Some(0),
            privileged: true,
        },
    };
    const UNIX_NOBODY: Via = Via::Unix {
        peer: Peer {
            uid: Some(65534),
            privileged: false,
        },
    };

    fn host(h: &str) -> Result<(), Refusal> {
        check_origin_and_host(None, None, Some(h.as_bytes()), LO)
    }

    #[test]
    fn loopback_hosts_are_accepted() {
        for h in [
            "127.0.0.1:10267",
            "127.0.0.1",
            "127.1.2.3:80",
            "localhost:10267",
            "LocalHost",
            "[::1]:10267",
            "[::1]",
            "[::ffff:127.0.0.1]:1",
        ] {
            assert_eq!(host(h), Ok(()), "{h}");
        }
    }

    #[test]
    fn other_hosts_are_refused() {
        for h in [
            "attacker.example:10267",
            "attacker.example",
            "127.0.0.1.nip.io:10267",
            "localhost.attacker.example",
            "sub.localhost",
            "localhost.",
            "10.0.0.5:10267",
            "::1",
            "[::1",
            "[::1]x",
            "127.0.0.1:",
            "127.0.0.1:port",
            "127.0.0.1:123456",
            ":10267",
            "",
            "local\u{e9}host",
        ] {
            assert_eq!(host(h), Err(FOREIGN_HOST), "{h}");
        }
        assert_eq!(
            check_origin_and_host(None, None, None, LO),
            Err(FOREIGN_HOST),
            "no Host (or two)"
        );
        assert_eq!(
            check_origin_and_host(None, None, Some(b"\xff"), LO),
            Err(FOREIGN_HOST)
        );
    }

    #[test]
    fn the_address_the_connection_came_in_on_is_a_host() {
        let lan = Via::Tcp {
            local: "192.168.7.2".parse().unwrap(),
        };
        assert_eq!(
            check_origin_and_host(None, None, Some(b"192.168.7.2:10267"), lan),
            Ok(())
        );
        assert_eq!(
            check_origin_and_host(None, None, Some(b"192.168.7.3:10267"), lan),
            Err(FOREIGN_HOST)
        );
    }

    #[test]
    fn web_pages_are_refused_on_every_listener() {
        for via in [LO, UNIX_ROOT] {
            for origin in [&b"http://127.0.0.2:8000"[..], b"null", b""] {
                assert_eq!(
                    check_origin_and_host(Some(origin), None, Some(b"127.0.0.1"), via),
                    Err(FROM_A_WEB_PAGE)
                );
            }
            for site in [&b"cross-site"[..], b"same-site", b"same-origin"] {
                assert_eq!(
                    check_origin_and_host(None, Some(site), Some(b"127.0.0.1"), via),
                    Err(FROM_A_WEB_PAGE)
                );
            }
            assert_eq!(
                check_origin_and_host(None, Some(b"none"), Some(b"localhost"), via),
                Ok(())
            );
        }
        // The unix socket takes any Host, or none.
        assert_eq!(
            check_origin_and_host(None, None, Some(b"x"), UNIX_ROOT),
            Ok(())
        );
        assert_eq!(check_origin_and_host(None, None, None, UNIX_ROOT), Ok(()));
    }

    #[test]
    fn random_heads_never_panic() {
        let mut rng = fastrand::Rng::with_seed(7);
        let alphabet = b"[]:.0123456789abclhost\xff\x00 ";
        for _ in 0..20_000 {
            let len = rng.usize(0..24);
            let v: Vec<u8> = (0..len)
                .map(|_| alphabet[rng.usize(..alphabet.len())])
                .collect();
            let _ = check_origin_and_host(None, None, Some(&v), LO);
            let _ = bearer_token(&v);
        }
    }

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        assert_eq!(bearer_token(b"Bearer abc"), Some(&b"abc"[..]));
        assert_eq!(bearer_token(b"bearer abc"), Some(&b"abc"[..]));
        assert_eq!(bearer_token(b"BEARER  abc"), Some(&b"abc"[..]));
        assert_eq!(bearer_token(b"Bearer"), None);
        assert_eq!(bearer_token(b"Bearer "), None);
        assert_eq!(bearer_token(b"Bearerabc"), None);
        assert_eq!(bearer_token(b"Basic YWJj"), None);
        assert_eq!(bearer_token(b""), None);
        assert_eq!(bearer_token("bearér x".as_bytes()), None);
    }

    #[test]
    fn authentication() {
        assert_eq!(authenticate(None, None), Auth::Ok);
        assert_eq!(authenticate(None, Some(b"Bearer x")), Auth::Ok);
        assert_eq!(authenticate(Some(b"t"), None), Auth::Missing);
        assert_eq!(authenticate(Some(b"t"), Some(b"Basic dA==")), Auth::Missing);
        assert_eq!(authenticate(Some(b"t"), Some(b"Bearer u")), Auth::Invalid);
        assert_eq!(authenticate(Some(b"t"), Some(b"bearer t")), Auth::Ok);
        assert!(challenge(Auth::Missing).starts_with("Bearer "));
        assert!(challenge(Auth::Invalid).contains("invalid_token"));
    }

    #[test]
    fn token_comparison() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
        assert!(constant_time_eq(b"", b""));
    }

    #[test]
    fn only_the_probes_are_open() {
        assert!(is_open_path("/v1/healthz"));
        assert!(is_open_path("/v1/readyz"));
        for p in [
            "/pods",
            "/metrics",
            "/v1/status",
            "/v1/healthz/",
            "//v1/healthz",
            "",
        ] {
            assert!(!is_open_path(p), "{p}");
        }
    }

    #[test]
    fn root_or_the_group_is_a_privileged_peer() {
        assert!(privileged_peer(0, 0, &[], None));
        assert!(privileged_peer(0, 1000, &[], Some(42)));
        assert!(!privileged_peer(1000, 1000, &[], None));
        assert!(
            !privileged_peer(1000, 1000, &[0, 42], None),
            "no group configured"
        );
        assert!(
            privileged_peer(1000, 42, &[], Some(42)),
            "the primary group"
        );
        assert!(
            privileged_peer(1000, 1000, &[7, 42], Some(42)),
            "a supplementary one"
        );
        assert!(!privileged_peer(1000, 1000, &[7, 43], Some(42)));
        assert!(!privileged_peer(65534, 65534, &[65534], Some(0)));
    }

    #[test]
    fn privileged_routes_need_the_token_or_a_privileged_socket_peer() {
        use Access::{Open, Privileged};
        let unknown = Via::Unix {
            peer: Peer {
                uid: None,
                privileged: false,
            },
        };
        // No token configured: only a privileged socket peer.
        for (via, ok) in [
            (LO, false),
            (UNIX_NOBODY, false),
            (unknown, false),
            (UNIX_ROOT, true),
        ] {
            assert_eq!(
                gate(Privileged, false, Auth::Ok, via).is_ok(),
                ok,
                "{via:?}"
            );
            assert_eq!(gate(Open, false, Auth::Ok, via), Ok(()));
            assert!(!needs_token(false, Auth::Ok, via, "/pods"));
        }
        // A token configured: it opens everything; without it only the socket peer passes.
        for via in [LO, UNIX_NOBODY, UNIX_ROOT] {
            assert_eq!(gate(Privileged, true, Auth::Ok, via), Ok(()));
            assert!(!needs_token(true, Auth::Ok, via, "/v1/images/load"));
        }
        for auth in [Auth::Missing, Auth::Invalid] {
            assert!(gate(Privileged, true, auth, LO).is_err());
            assert!(gate(Privileged, true, auth, UNIX_NOBODY).is_err());
            assert_eq!(gate(Privileged, true, auth, UNIX_ROOT), Ok(()));
            assert!(needs_token(true, auth, LO, "/pods"));
            assert!(needs_token(true, auth, UNIX_NOBODY, "/v1/images/load"));
            assert!(!needs_token(true, auth, UNIX_ROOT, "/v1/images/load"));
            assert!(!needs_token(true, auth, LO, "/v1/healthz"));
        }
    }

    #[test]
    fn the_403_says_how_to_get_access() {
        let socket = SocketAccess {
            path: Some("/run/edgehub/api.sock".into()),
            group: Some(("ota".into(), 42)),
        };
        let m = Forbidden {
            via: LO,
            token_set: false,
        }
        .message("POST /v1/images/load", &socket);
        assert!(m.starts_with("Forbidden: POST /v1/images/load"), "{m}");
        assert!(
            m.contains("/run/edgehub/api.sock as root or as a member of group ota"),
            "{m}"
        );
        assert!(!m.contains("token_file"), "no token configured: {m}");
        let m = Forbidden {
            via: UNIX_NOBODY,
            token_set: true,
        }
        .message("PUT /v1/bootstrap-token", &SocketAccess::default());
        assert!(
            m.contains("(uid 65534)") && m.contains("[api] token_file"),
            "{m}"
        );
        assert!(m.contains("set [api] socket"), "{m}");
    }
}
