//! Which route a request to the node API names, from its method and path (pure): the
//! kubelet's routes edgehub serves, anything else 404. The query is read by each route's
//! own parser (`logs::LogQuery`, `streams::StreamOptions`, `streams::forward_ports`); all of
//! them are fuzzed (`fuzz/fuzz_targets/node_api_request.rs`).

use super::streams::Target;

/// A request's route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route<'a> {
    Healthz,
    MetricsResource,
    StatsSummary,
    /// `GET /containerLogs/{namespace}/{pod}/{container}`, each part non-empty.
    ContainerLogs {
        namespace: &'a str,
        pod: &'a str,
        container: &'a str,
    },
    /// `GET` or `POST` `/exec`, `/attach`, `/portForward`.
    Stream(Target),
    /// Anything else: the kubelet's `404 page not found`.
    NotFound,
}

/// The route `method` and `path` (without its query) name.
pub fn parse<'a>(method: &str, path: &'a str) -> Route<'a> {
    let segs: Vec<&'a str> = path.trim_start_matches('/').split('/').collect();
    if let ("GET" | "POST", Some(target)) = (method, Target::from_segments(&segs)) {
        return Route::Stream(target);
    }
    match (method, segs.as_slice()) {
        ("GET", ["healthz"]) => Route::Healthz,
        ("GET", ["metrics", "resource"]) => Route::MetricsResource,
        ("GET", ["stats", "summary"]) => Route::StatsSummary,
        ("GET", ["containerLogs", namespace, pod, container])
            if !namespace.is_empty() && !pod.is_empty() && !container.is_empty() =>
        {
            Route::ContainerLogs {
                namespace,
                pod,
                container,
            }
        }
        _ => Route::NotFound,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kubelet_api::streams::Route as StreamRoute;

    #[test]
    fn the_kubelets_routes() {
        assert_eq!(parse("GET", "/healthz"), Route::Healthz);
        assert_eq!(parse("GET", "/metrics/resource"), Route::MetricsResource);
        assert_eq!(parse("GET", "/stats/summary"), Route::StatsSummary);
        assert_eq!(
            parse("GET", "/containerLogs/vehicle/web/app"),
            Route::ContainerLogs {
                namespace: "vehicle",
                pod: "web",
                container: "app"
            }
        );
        for m in ["GET", "POST"] {
            match parse(m, "/exec/vehicle/web/app") {
                Route::Stream(t) => assert_eq!(t.route, StreamRoute::Exec),
                other => panic!("{other:?}"),
            }
        }
        for (m, p) in [
            ("POST", "/healthz"),
            ("GET", "/containerLogs/vehicle//app"),
            ("GET", "/containerLogs/vehicle/web"),
            ("GET", "/containerLogs/vehicle/web/app/more"),
            ("DELETE", "/exec/vehicle/web/app"),
            ("GET", "/stats"),
            ("GET", ""),
            ("GET", "/"),
        ] {
            assert_eq!(parse(m, p), Route::NotFound, "{m} {p}");
        }
    }
}
