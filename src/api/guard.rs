//! Who may talk to the local API, decided from the request's head before any route or name
//! is looked at. Pure functions of header bytes, so they are unit-tested and fuzzed without a
//! server (fuzz/fuzz_targets/router.rs).
//!
//! The order is the point: [`check_origin_and_host`] first (a web page gets nothing, not
//! even a 401), then the bearer token (an unauthenticated client learns nothing about routes
//! or names: no 400, 404 or 405), then the router.

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
}
