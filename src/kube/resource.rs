//! The API resources edgehub talks to, and how their URLs are built.

use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};

/// Characters escaped in query values: everything but RFC 3986's unreserved set, so `=` and `,`
/// in selectors go out as `%3D` and `%2C`, as kubectl and client-go send them.
const QUERY: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// An API resource: group/version/plural, and whether it lives in namespaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resource {
    /// Empty for the core group.
    pub group: &'static str,
    pub version: &'static str,
    pub plural: &'static str,
    pub namespaced: bool,
}

pub const PODS: Resource = Resource {
    group: "",
    version: "v1",
    plural: "pods",
    namespaced: true,
};
pub const NODES: Resource = Resource {
    group: "",
    version: "v1",
    plural: "nodes",
    namespaced: false,
};
pub const DAEMONSETS: Resource = Resource {
    group: "apps",
    version: "v1",
    plural: "daemonsets",
    namespaced: true,
};
pub const LEASES: Resource = Resource {
    group: "coordination.k8s.io",
    version: "v1",
    plural: "leases",
    namespaced: true,
};
pub const EVENTS: Resource = Resource {
    group: "",
    version: "v1",
    plural: "events",
    namespaced: true,
};
pub const CONFIGMAPS: Resource = Resource {
    group: "",
    version: "v1",
    plural: "configmaps",
    namespaced: true,
};
pub const SECRETS: Resource = Resource {
    group: "",
    version: "v1",
    plural: "secrets",
    namespaced: true,
};
/// Only for the `token` subresource (TokenRequest).
pub const SERVICE_ACCOUNTS: Resource = Resource {
    group: "",
    version: "v1",
    plural: "serviceaccounts",
    namespaced: true,
};
pub const CONTROLLER_REVISIONS: Resource = Resource {
    group: "apps",
    version: "v1",
    plural: "controllerrevisions",
    namespaced: true,
};

impl Resource {
    /// `pods` or `daemonsets.apps`, as RBAC and error messages name it.
    pub fn qualified(&self) -> String {
        if self.group.is_empty() {
            self.plural.to_string()
        } else {
            format!("{}.{}", self.plural, self.group)
        }
    }

    fn prefix(&self) -> String {
        if self.group.is_empty() {
            format!("/api/{}", self.version)
        } else {
            format!("/apis/{}/{}", self.group, self.version)
        }
    }

    /// The collection: all namespaces when `namespace` is `None`.
    pub fn collection_path(&self, namespace: Option<&str>) -> String {
        match namespace {
            Some(ns) if self.namespaced => {
                format!("{}/namespaces/{}/{}", self.prefix(), ns, self.plural)
            }
            _ => format!("{}/{}", self.prefix(), self.plural),
        }
    }

    /// One object, optionally a subresource such as `status`.
    pub fn object_path(&self, namespace: Option<&str>, name: &str, sub: Option<&str>) -> String {
        let mut p = format!("{}/{}", self.collection_path(namespace), name);
        if let Some(s) = sub {
            p.push('/');
            p.push_str(s);
        }
        p
    }
}

/// Builds a query string from `(key, value)` pairs, escaping values; `None` values are left out.
pub fn query(pairs: &[(&str, Option<&str>)]) -> String {
    let mut out = String::new();
    for (k, v) in pairs {
        if let Some(v) = v {
            out.push(if out.is_empty() { '?' } else { '&' });
            out.push_str(k);
            out.push('=');
            out.extend(utf8_percent_encode(v, QUERY));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_match_the_apiserver() {
        assert_eq!(PODS.collection_path(None), "/api/v1/pods");
        assert_eq!(
            PODS.object_path(Some("vehicle"), "p", Some("status")),
            "/api/v1/namespaces/vehicle/pods/p/status"
        );
        assert_eq!(
            DAEMONSETS.collection_path(Some("vehicle")),
            "/apis/apps/v1/namespaces/vehicle/daemonsets"
        );
        assert_eq!(NODES.collection_path(Some("ignored")), "/api/v1/nodes");
        assert_eq!(
            NODES.object_path(None, "edge-1", None),
            "/api/v1/nodes/edge-1"
        );
        assert_eq!(CONTROLLER_REVISIONS.qualified(), "controllerrevisions.apps");
        assert_eq!(PODS.qualified(), "pods");
    }

    #[test]
    fn query_escapes_like_client_go() {
        // The same escaping as the fixtures' request paths.
        assert_eq!(
            query(&[
                ("fieldSelector", Some("spec.nodeName=edge-1")),
                ("limit", None),
                ("watch", Some("1"))
            ]),
            "?fieldSelector=spec.nodeName%3Dedge-1&watch=1"
        );
        assert_eq!(query(&[("a", None)]), "");
    }
}
