//! The local API's routes, as a pure function of method and path, so it can be fuzzed and
//! unit-tested without a server. Names are checked here: bad input never reaches a handler.

use crate::names::{check_label, check_subdomain};

/// Longest request path accepted (414 beyond).
pub const MAX_PATH: usize = 1024;

/// A recognized request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    Pods,
    Upgrade {
        namespace: String,
        name: String,
    },
    ImagePull {
        namespace: String,
        name: String,
    },
    UpgradeStatus {
        namespace: String,
        name: String,
    },
    /// A container's log; the query string carries the options (`crate::logs::Options`).
    Logs {
        namespace: String,
        name: String,
    },
    /// `POST /v1/images/load`: an image archive streamed in the body (`crate::images`).
    ImagesLoad,
    /// `GET /v1/images`: the node's images and what garbage collection would do with them.
    Images,
    Status,
    /// `GET /v1/node`: the cached Node with the device-side `CredentialsLapsed` condition.
    Node,
    /// `PUT /v1/bootstrap-token`: a bootstrap token handed over (`crate::identity::handover`).
    BootstrapToken,
    /// `POST /v1/transactions`: upgrades the OTA manager commits or rolls back (privileged).
    StartTransaction,
    /// `GET /v1/transactions`.
    Transactions,
    /// `GET /v1/transactions/{id}`.
    Transaction {
        id: String,
    },
    /// `POST /v1/transactions/{id}/commit` (privileged).
    CommitTransaction {
        id: String,
    },
    /// `POST /v1/transactions/{id}/rollback` (privileged).
    RollbackTransaction {
        id: String,
    },
    Healthz,
    Readyz,
    Metrics,
}

impl Route {
    /// A low-cardinality name for metrics.
    pub fn name(&self) -> &'static str {
        match self {
            Route::Pods => "pods",
            Route::Upgrade { .. } => "upgrade",
            Route::ImagePull { .. } => "imagepull",
            Route::UpgradeStatus { .. } => "upgrade_status",
            Route::Logs { .. } => "logs",
            Route::ImagesLoad => "images_load",
            Route::Images => "images",
            Route::Status => "status",
            Route::Node => "node",
            Route::BootstrapToken => "bootstrap_token",
            Route::StartTransaction => "transaction_start",
            Route::Transactions => "transactions",
            Route::Transaction { .. } => "transaction",
            Route::CommitTransaction { .. } => "transaction_commit",
            Route::RollbackTransaction { .. } => "transaction_rollback",
            Route::Healthz => "healthz",
            Route::Readyz => "readyz",
            Route::Metrics => "metrics",
        }
    }

    /// Whether the route may record a request for the upgrade engine.
    pub fn records(&self) -> bool {
        matches!(
            self,
            Route::Upgrade { .. }
                | Route::ImagePull { .. }
                | Route::StartTransaction
                | Route::CommitTransaction { .. }
                | Route::RollbackTransaction { .. }
        )
    }

    /// Who may call the route. Every arm is spelled out (no `_`), so a new route does not
    /// build until someone decided its class; [`ROUTES`] repeats it, and a test keeps the two
    /// (and `docs/openapi.yaml`) in step.
    pub fn access(&self) -> Access {
        match self {
            Route::Pods
            | Route::Upgrade { .. }
            | Route::ImagePull { .. }
            | Route::UpgradeStatus { .. }
            | Route::Logs { .. }
            | Route::Images
            | Route::Status
            | Route::Node
            | Route::Transactions
            | Route::Transaction { .. }
            | Route::Healthz
            | Route::Readyz
            | Route::Metrics => Access::Open,
            // A transaction decides for the OTA manager what runs, and a rollback overrides
            // what the cloud decided.
            Route::ImagesLoad
            | Route::BootstrapToken
            | Route::StartTransaction
            | Route::CommitTransaction { .. }
            | Route::RollbackTransaction { .. } => Access::Privileged,
        }
    }
}

/// A route's access class: what a caller must hold to be served (`docs/security.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Reads, and what only triggers what the cloud decided (OpenYurt's `upgrade` and
    /// `imagepull` move a pod to a revision the apiserver sent): any local caller, as
    /// OpenYurt's OTA manager is, with the token when `[api] token_file` is set.
    Open,
    /// Brings new code or credentials onto the node (an image archive under a tag a pod
    /// runs, a bootstrap token): only a caller presenting the token of `[api] token_file`, or
    /// a unix-socket peer whose credentials (`SO_PEERCRED`, `SO_PEERGROUPS`) say root or a
    /// member of `[api] socket_group` ([`super::guard::gate`]). Anything else gets a 403 before
    /// the body is read.
    Privileged,
}

impl Access {
    pub fn as_str(self) -> &'static str {
        match self {
            Access::Open => "open",
            Access::Privileged => "privileged",
        }
    }
}

/// Why a request was refused before any handler ran.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reject {
    pub status: u16,
    pub message: String,
    /// For 405: the methods the path allows.
    pub allow: Option<&'static str>,
}

fn reject(status: u16, message: impl Into<String>) -> Reject {
    Reject {
        status,
        message: message.into(),
        allow: None,
    }
}

use Access::{Open, Privileged};

/// Every route: path pattern, allowed method, access class, and the status codes it answers
/// with. The OpenAPI document (`x-edgehub-access`, the codes) and [`Route::access`] are
/// checked against this table; a privileged route answers 403 to a caller without a
/// credential, so it lists 403.
pub const ROUTES: &[(&str, &str, Access, &[u16])] = &[
    ("/pods", "GET", Open, &[200, 401, 500]),
    (
        "/openyurt.io/v1/namespaces/{ns}/pods/{name}/upgrade",
        "POST",
        Open,
        &[200, 400, 401, 403, 404, 409, 412, 500, 503],
    ),
    (
        "/openyurt.io/v1/namespaces/{ns}/pods/{name}/upgrade",
        "GET",
        Open,
        &[200, 400, 401, 404, 500],
    ),
    (
        "/openyurt.io/v1/namespaces/{ns}/pods/{name}/imagepull",
        "POST",
        Open,
        &[200, 400, 401, 403, 404, 409, 500],
    ),
    (
        "/v1/namespaces/{ns}/pods/{name}/log",
        "GET",
        Open,
        &[200, 400, 401, 404, 429, 500],
    ),
    ("/v1/images", "GET", Open, &[200, 401, 500, 503]),
    (
        "/v1/images/load",
        "POST",
        Privileged,
        &[200, 400, 401, 403, 408, 413, 500, 503, 507],
    ),
    ("/v1/status", "GET", Open, &[200, 401, 500]),
    ("/v1/node", "GET", Open, &[200, 401, 500]),
    (
        "/v1/bootstrap-token",
        "PUT",
        Privileged,
        &[202, 400, 401, 403, 409, 500],
    ),
    (
        "/v1/transactions",
        "POST",
        Privileged,
        &[201, 400, 401, 403, 404, 409, 412, 500, 503],
    ),
    ("/v1/transactions", "GET", Open, &[200, 401, 500]),
    (
        "/v1/transactions/{id}",
        "GET",
        Open,
        &[200, 400, 401, 404, 500],
    ),
    (
        "/v1/transactions/{id}/commit",
        "POST",
        Privileged,
        &[200, 400, 401, 403, 404, 409, 500],
    ),
    (
        "/v1/transactions/{id}/rollback",
        "POST",
        Privileged,
        &[200, 400, 401, 403, 404, 409, 500],
    ),
    ("/v1/healthz", "GET", Open, &[200]),
    ("/v1/readyz", "GET", Open, &[200, 503]),
    ("/metrics", "GET", Open, &[200, 401]),
];

/// A namespace and pod name from a path, checked: 400 before any handler sees them.
fn pod_names(ns: &str, name: &str) -> Result<(String, String), Reject> {
    check_label(ns).map_err(|r| reject(400, format!("Invalid namespace: {r}")))?;
    check_subdomain(name).map_err(|r| reject(400, format!("Invalid pod name: {r}")))?;
    Ok((ns.to_string(), name.to_string()))
}

/// A transaction id from a path, checked: 16 lowercase hex digits, as edgehub makes them.
fn txn_id(id: &str) -> Result<String, Reject> {
    if id.len() == 16 && id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        Ok(id.to_string())
    } else {
        Err(reject(
            400,
            "Invalid transaction id: 16 lowercase hex digits",
        ))
    }
}

/// Maps a method and path to a route.
pub fn route(method: &str, path: &str) -> Result<Route, Reject> {
    if path.len() > MAX_PATH {
        return Err(reject(414, "Request path too long"));
    }
    let segs: Vec<&str> = path.strip_prefix('/').unwrap_or(path).split('/').collect();
    let (route, allow) = match segs.as_slice() {
        ["pods"] => (Route::Pods, "GET"),
        ["v1", "status"] => (Route::Status, "GET"),
        ["v1", "node"] => (Route::Node, "GET"),
        ["v1", "bootstrap-token"] => (Route::BootstrapToken, "PUT"),
        ["v1", "images", "load"] => (Route::ImagesLoad, "POST"),
        ["v1", "images"] => (Route::Images, "GET"),
        ["v1", "healthz"] => (Route::Healthz, "GET"),
        ["v1", "readyz"] => (Route::Readyz, "GET"),
        ["metrics"] => (Route::Metrics, "GET"),
        ["v1", "transactions"] if method == "POST" => (Route::StartTransaction, "GET, POST"),
        ["v1", "transactions"] => (Route::Transactions, "GET, POST"),
        ["v1", "transactions", id] => (Route::Transaction { id: txn_id(id)? }, "GET"),
        ["v1", "transactions", id, "commit"] => {
            (Route::CommitTransaction { id: txn_id(id)? }, "POST")
        }
        ["v1", "transactions", id, "rollback"] => {
            (Route::RollbackTransaction { id: txn_id(id)? }, "POST")
        }
        ["v1", "namespaces", ns, "pods", name, "log"] => {
            let (namespace, name) = pod_names(ns, name)?;
            (Route::Logs { namespace, name }, "GET")
        }
        ["openyurt.io", "v1", "namespaces", ns, "pods", name, action] => {
            let (namespace, name) = pod_names(ns, name)?;
            match (*action, method) {
                ("upgrade", "GET") => (Route::UpgradeStatus { namespace, name }, "GET, POST"),
                ("upgrade", _) => (Route::Upgrade { namespace, name }, "GET, POST"),
                ("imagepull", _) => (Route::ImagePull { namespace, name }, "POST"),
                _ => return Err(reject(404, "Not found")),
            }
        }
        _ => return Err(reject(404, "Not found")),
    };
    let allowed = match &route {
        Route::UpgradeStatus { .. } | Route::Upgrade { .. } => method == "GET" || method == "POST",
        Route::ImagePull { .. }
        | Route::ImagesLoad
        | Route::StartTransaction
        | Route::CommitTransaction { .. }
        | Route::RollbackTransaction { .. } => method == "POST",
        Route::BootstrapToken => method == "PUT",
        _ => method == "GET" || method == "HEAD",
    };
    if !allowed {
        return Err(Reject {
            status: 405,
            message: "Method not allowed".into(),
            allow: Some(allow),
        });
    }
    Ok(route)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes() {
        assert_eq!(route("GET", "/pods"), Ok(Route::Pods));
        assert_eq!(
            route(
                "POST",
                "/openyurt.io/v1/namespaces/default/pods/nginx-daemonset-bwzss/upgrade"
            ),
            Ok(Route::Upgrade {
                namespace: "default".into(),
                name: "nginx-daemonset-bwzss".into()
            })
        );
        assert!(matches!(
            route("GET", "/openyurt.io/v1/namespaces/default/pods/p/upgrade"),
            Ok(Route::UpgradeStatus { .. })
        ));
        assert!(matches!(
            route(
                "POST",
                "/openyurt.io/v1/namespaces/default/pods/p/imagepull"
            ),
            Ok(Route::ImagePull { .. })
        ));
        assert_eq!(route("GET", "/v1/healthz"), Ok(Route::Healthz));
        assert_eq!(route("GET", "/v1/readyz"), Ok(Route::Readyz));
        assert_eq!(route("GET", "/metrics"), Ok(Route::Metrics));
        assert_eq!(route("GET", "/v1/status"), Ok(Route::Status));
        assert_eq!(route("POST", "/v1/images/load"), Ok(Route::ImagesLoad));
        assert_eq!(route("GET", "/v1/images"), Ok(Route::Images));
        assert_eq!(route("GET", "/v1/node"), Ok(Route::Node));
        assert_eq!(
            route("PUT", "/v1/bootstrap-token"),
            Ok(Route::BootstrapToken)
        );
        for m in ["GET", "POST", "HEAD", "DELETE"] {
            let r = route(m, "/v1/bootstrap-token").unwrap_err();
            assert_eq!((r.status, r.allow), (405, Some("PUT")), "{m}");
        }
        assert_eq!(route("PUT", "/v1/node").unwrap_err().status, 405);
        assert_eq!(route("POST", "/v1/images").unwrap_err().status, 405);
        assert_eq!(route("GET", "/v1/images/load").unwrap_err().status, 405);
        assert_eq!(
            route("GET", "/v1/namespaces/vehicle/pods/telemetry-sv74m/log"),
            Ok(Route::Logs {
                namespace: "vehicle".into(),
                name: "telemetry-sv74m".into()
            })
        );
    }

    #[test]
    fn transaction_routes_check_the_id_and_the_method() {
        assert_eq!(
            route("POST", "/v1/transactions"),
            Ok(Route::StartTransaction)
        );
        assert_eq!(route("GET", "/v1/transactions"), Ok(Route::Transactions));
        let id = "3f9a0c1d5e7b2a64".to_string();
        assert_eq!(
            route("GET", "/v1/transactions/3f9a0c1d5e7b2a64"),
            Ok(Route::Transaction { id: id.clone() })
        );
        assert_eq!(
            route("POST", "/v1/transactions/3f9a0c1d5e7b2a64/commit"),
            Ok(Route::CommitTransaction { id: id.clone() })
        );
        assert_eq!(
            route("POST", "/v1/transactions/3f9a0c1d5e7b2a64/rollback"),
            Ok(Route::RollbackTransaction { id })
        );
        for bad in [
            "3F9A0C1D5E7B2A64",
            "3f9a0c1d5e7b2a6",
            "3f9a0c1d5e7b2a645",
            "3f9a0c1d5e7b2a6g",
            "..",
            "",
        ] {
            for path in [
                format!("/v1/transactions/{bad}"),
                format!("/v1/transactions/{bad}/commit"),
            ] {
                let method = if path.ends_with("commit") {
                    "POST"
                } else {
                    "GET"
                };
                assert_eq!(route(method, &path).unwrap_err().status, 400, "{path}");
            }
        }
        for (m, p, allow) in [
            ("DELETE", "/v1/transactions", "GET, POST"),
            ("GET", "/v1/transactions/3f9a0c1d5e7b2a64/commit", "POST"),
            ("POST", "/v1/transactions/3f9a0c1d5e7b2a64", "GET"),
            ("PUT", "/v1/transactions/3f9a0c1d5e7b2a64/rollback", "POST"),
        ] {
            let r = route(m, p).unwrap_err();
            assert_eq!((r.status, r.allow), (405, Some(allow)), "{m} {p}");
        }
        assert_eq!(
            route("POST", "/v1/transactions/3f9a0c1d5e7b2a64/delete")
                .unwrap_err()
                .status,
            404
        );
        // What starts, commits or rolls back is privileged; reading is not.
        for (pattern, method, _, _) in ROUTES {
            if !pattern.starts_with("/v1/transactions") {
                continue;
            }
            let path = pattern.replace("{id}", "0123456789abcdef");
            let r = route(method, &path).unwrap();
            let decides = *method == "POST";
            assert_eq!(r.access() == Access::Privileged, decides, "{method} {path}");
        }
    }

    #[test]
    fn wrong_methods_get_405_with_allow() {
        let r = route("POST", "/pods").unwrap_err();
        assert_eq!((r.status, r.allow), (405, Some("GET")));
        let r = route("DELETE", "/openyurt.io/v1/namespaces/a/pods/b/upgrade").unwrap_err();
        assert_eq!((r.status, r.allow), (405, Some("GET, POST")));
        let r = route("GET", "/openyurt.io/v1/namespaces/a/pods/b/imagepull").unwrap_err();
        assert_eq!((r.status, r.allow), (405, Some("POST")));
        let r = route("POST", "/v1/namespaces/a/pods/b/log").unwrap_err();
        assert_eq!((r.status, r.allow), (405, Some("GET")));
    }

    #[test]
    fn bad_names_are_400_before_anything_else() {
        for path in [
            "/openyurt.io/v1/namespaces/Bad/pods/p/upgrade",
            "/openyurt.io/v1/namespaces/a/pods/UPPER/upgrade",
            "/openyurt.io/v1/namespaces//pods/p/upgrade",
            "/openyurt.io/v1/namespaces/a/pods//upgrade",
            "/openyurt.io/v1/namespaces/a/pods/..%2f/upgrade",
            "/openyurt.io/v1/namespaces/a/pods/p%00/upgrade",
        ] {
            assert_eq!(route("POST", path).unwrap_err().status, 400, "{path}");
            let log = path.replace("/openyurt.io", "").replace("/upgrade", "/log");
            assert_eq!(route("GET", &log).unwrap_err().status, 400, "{log}");
        }
        let long_ns = format!(
            "/openyurt.io/v1/namespaces/{}/pods/p/upgrade",
            "a".repeat(64)
        );
        assert_eq!(route("POST", &long_ns).unwrap_err().status, 400);
        let long_name = format!(
            "/openyurt.io/v1/namespaces/a/pods/{}/upgrade",
            "a".repeat(254)
        );
        assert_eq!(route("POST", &long_name).unwrap_err().status, 400);
        let ok_name = format!(
            "/openyurt.io/v1/namespaces/a/pods/{}/upgrade",
            "a".repeat(253)
        );
        assert!(route("POST", &ok_name).is_ok());
    }

    #[test]
    fn unknown_and_oversized_paths() {
        for path in [
            "/",
            "",
            "/pods/",
            "/podsx",
            "/openyurt.io/v1/namespaces/a/pods/b/delete",
            "/v1/namespaces/a/pods/b/logs",
            "/v1/namespaces/a/pods/b",
            "/v1",
            "//pods",
        ] {
            assert_eq!(route("GET", path).unwrap_err().status, 404, "{path}");
        }
        assert_eq!(
            route("GET", &format!("/{}", "a".repeat(2000)))
                .unwrap_err()
                .status,
            414
        );
    }

    #[test]
    fn the_route_table_lists_every_route() {
        for (pattern, method, access, codes) in ROUTES {
            let path = pattern
                .replace("{ns}", "default")
                .replace("{name}", "p")
                .replace("{id}", "0123456789abcdef");
            let r = route(method, &path);
            assert!(r.is_ok(), "{method} {path}");
            assert!(!codes.is_empty());
            assert_eq!(
                r.unwrap().access(),
                *access,
                "{method} {path}: the table's class"
            );
            if *access == Access::Privileged {
                assert!(codes.contains(&403), "{method} {path} refuses with 403");
            }
        }
    }

    /// What brings new code or credentials is privileged; what only reads, or triggers what
    /// the cloud decided, stays open (OpenYurt's OTA manager calls those without a token).
    #[test]
    fn only_what_brings_new_bits_or_credentials_is_privileged() {
        let privileged: Vec<_> = ROUTES
            .iter()
            .filter(|r| r.2 == Access::Privileged)
            .map(|r| (r.1, r.0))
            .collect();
        assert_eq!(
            privileged,
            [
                ("POST", "/v1/images/load"),
                ("PUT", "/v1/bootstrap-token"),
                ("POST", "/v1/transactions"),
                ("POST", "/v1/transactions/{id}/commit"),
                ("POST", "/v1/transactions/{id}/rollback"),
            ]
        );
        for (m, p) in [
            ("GET", "/pods"),
            ("POST", "/openyurt.io/v1/namespaces/a/pods/b/upgrade"),
            ("POST", "/openyurt.io/v1/namespaces/a/pods/b/imagepull"),
            ("GET", "/v1/namespaces/a/pods/b/log"),
            ("GET", "/v1/status"),
        ] {
            assert_eq!(route(m, p).unwrap().access(), Access::Open, "{m} {p}");
        }
    }

    #[test]
    fn random_input_never_panics() {
        let mut rng = fastrand::Rng::with_seed(3);
        let alphabet: Vec<char> = "/abcz09-._%~?#:AZ\u{0}\u{e9}".chars().collect();
        for _ in 0..20_000 {
            let len = rng.usize(0..80);
            let p: String = (0..len)
                .map(|_| alphabet[rng.usize(..alphabet.len())])
                .collect();
            let m = ["GET", "POST", "PUT", "", "get"][rng.usize(..5)];
            let _ = route(m, &p);
            let _ = route(
                m,
                &format!("/openyurt.io/v1/namespaces/{p}/pods/{p}/upgrade"),
            );
        }
    }
}
