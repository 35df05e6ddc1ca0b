//! What a request to the node's API asks, in the authorizer's terms (pure): the verb from
//! the HTTP method and the `nodes` subresources from the path, as the kubelet maps them
//! (`pkg/kubelet/server/auth.go`, with `KubeletFineGrainedAuthz` on), and the texts of its
//! 401 and 403 answers.

/// The verb a method maps to; `None` for a method the kubelet gives no verb (refused).
pub fn verb(method: &str) -> Option<&'static str> {
    match method {
        "POST" => Some("create"),
        "GET" => Some("get"),
        "PUT" => Some("update"),
        "PATCH" => Some("patch"),
        "DELETE" => Some("delete"),
        _ => None,
    }
}

/// `path` is `prefix` or below it, as the kubelet's `isSubpath`.
fn is_subpath(path: &str, prefix: &str) -> bool {
    let prefix = prefix.trim_end_matches('/');
    path == prefix || path.starts_with(&format!("{prefix}/"))
}

/// The `nodes` subresources a request is authorized against, in the order asked: one
/// allowed is enough (a fine-grained one first, then the coarse one).
pub fn subresources(path: &str) -> Vec<&'static str> {
    let mut out = Vec::with_capacity(2);
    if is_subpath(path, "/pods") || is_subpath(path, "/runningpods") {
        out.push("pods");
    } else if is_subpath(path, "/healthz") {
        out.push("healthz");
    } else if is_subpath(path, "/configz") {
        out.push("configz");
    }
    out.push(if is_subpath(path, "/stats") {
        "stats"
    } else if is_subpath(path, "/metrics") {
        "metrics"
    } else if is_subpath(path, "/logs") {
        "log"
    } else if is_subpath(path, "/checkpoint") {
        "checkpoint"
    } else if is_subpath(path, "/statusz") {
        "statusz"
    } else if is_subpath(path, "/flagz") {
        "configz"
    } else {
        "proxy"
    });
    out
}

/// The kubelet's 403 body.
pub fn forbidden_text(user: &str, verb: &str, subresources: &[&str]) -> String {
    format!(
        "Forbidden (user={user}, verb={verb}, resource=nodes, subresource(s)=[{}])\n",
        subresources.join(" ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_map_to_the_kubelets_subresources() {
        assert_eq!(
            subresources("/containerLogs/vehicle/web/app"),
            vec!["proxy"]
        );
        assert_eq!(subresources("/stats/summary"), vec!["stats"]);
        assert_eq!(subresources("/stats"), vec!["stats"]);
        assert_eq!(subresources("/metrics/resource"), vec!["metrics"]);
        assert_eq!(subresources("/logs/messages"), vec!["log"]);
        assert_eq!(subresources("/healthz"), vec!["healthz", "proxy"]);
        assert_eq!(subresources("/pods"), vec!["pods", "proxy"]);
        assert_eq!(subresources("/exec/a/b/c"), vec!["proxy"]);
        // A prefix is a path segment, not a string prefix.
        assert_eq!(subresources("/statsfoo"), vec!["proxy"]);
        assert_eq!(subresources("/healthzz"), vec!["proxy"]);
    }

    #[test]
    fn methods_map_to_verbs() {
        assert_eq!(verb("GET"), Some("get"));
        assert_eq!(verb("POST"), Some("create"));
        assert_eq!(verb("PUT"), Some("update"));
        assert_eq!(verb("PATCH"), Some("patch"));
        assert_eq!(verb("DELETE"), Some("delete"));
        assert_eq!(verb("HEAD"), None);
    }

    #[test]
    fn the_forbidden_text_is_the_kubelets() {
        assert_eq!(
            forbidden_text("jane", "get", &["healthz", "proxy"]),
            "Forbidden (user=jane, verb=get, resource=nodes, subresource(s)=[healthz proxy])\n"
        );
    }
}
