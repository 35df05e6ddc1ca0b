//! API discovery (`/api`, `/api/v1`, `/apis`, `/apis/{group}/{version}`), which kubectl reads
//! before most commands: the recorded documents (`discovery_*` fixtures) cut down to what the
//! fake serves, plus `metrics.k8s.io/v1beta1` as metrics-server registers it.

use super::*;

/// Per group version: the fixture holding its APIResourceList and the resources (with
/// subresources) the fake serves of it.
const SERVED: &[(&str, &str, &[&str])] = &[
    (
        "v1",
        "discovery_api_v1",
        &[
            "pods",
            "pods/status",
            "pods/log",
            "pods/exec",
            "pods/attach",
            "pods/portforward",
            "nodes",
            "nodes/status",
            "nodes/proxy",
            "configmaps",
            "secrets",
            "events",
            "serviceaccounts",
            "serviceaccounts/token",
        ],
    ),
    (
        "apps/v1",
        "discovery_apis_apps_v1",
        &["daemonsets", "controllerrevisions"],
    ),
    (
        "coordination.k8s.io/v1",
        "discovery_apis_coordination_v1",
        &["leases"],
    ),
    (
        "certificates.k8s.io/v1",
        "discovery_apis_certificates_v1",
        &[
            "certificatesigningrequests",
            "certificatesigningrequests/approval",
            "certificatesigningrequests/status",
        ],
    ),
    (
        "authentication.k8s.io/v1",
        "discovery_apis_authentication_v1",
        &["tokenreviews", "selfsubjectreviews"],
    ),
    (
        "authorization.k8s.io/v1",
        "discovery_apis_authorization_v1",
        &["subjectaccessreviews"],
    ),
];

pub(super) const METRICS_GROUP_VERSION: &str = "metrics.k8s.io/v1beta1";

/// metrics-server's APIResourceList (its APIService registers the group with the aggregator).
fn metrics_resources() -> Value {
    json!({
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": METRICS_GROUP_VERSION,
        "resources": [
            {"name": "nodes", "singularName": "", "namespaced": false, "kind": "NodeMetrics", "verbs": ["get", "list"]},
            {"name": "pods", "singularName": "", "namespaced": true, "kind": "PodMetrics", "verbs": ["get", "list"]}
        ]
    })
}

fn resource_list(fixture: &str, keep: &[&str]) -> Value {
    let mut doc = crate::fixture_body(fixture);
    if let Some(list) = doc.get_mut("resources").and_then(Value::as_array_mut) {
        list.retain(|r| r["name"].as_str().is_some_and(|n| keep.contains(&n)));
    }
    doc
}

fn group_list() -> Value {
    let mut doc = crate::fixture_body("discovery_apis");
    if let Some(groups) = doc.get_mut("groups").and_then(Value::as_array_mut) {
        groups.retain(|g| {
            g["preferredVersion"]["groupVersion"]
                .as_str()
                .is_some_and(|gv| SERVED.iter().any(|(s, _, _)| *s == gv))
        });
        let gv = METRICS_GROUP_VERSION;
        groups.push(json!({
            "name": "metrics.k8s.io",
            "versions": [{"groupVersion": gv, "version": "v1beta1"}],
            "preferredVersion": {"groupVersion": gv, "version": "v1beta1"}
        }));
    }
    doc
}

/// The discovery document at `path`, if it is one.
pub(super) fn document(state: &State, path: &str) -> Option<Value> {
    let path = path.trim_end_matches('/');
    match path {
        "/api" => {
            let mut doc = crate::fixture_body("discovery_api");
            doc["serverAddressByClientCIDRs"] =
                json!([{"clientCIDR": "0.0.0.0/0", "serverAddress": state.addr.to_string()}]);
            Some(doc)
        }
        "/apis" => Some(group_list()),
        _ => {
            let gv = path
                .strip_prefix("/api/")
                .or_else(|| path.strip_prefix("/apis/"))?;
            if gv == METRICS_GROUP_VERSION {
                return Some(metrics_resources());
            }
            let (_, fixture, keep) = SERVED.iter().find(|(s, _, _)| *s == gv)?;
            // "/api/apps/v1" and "/apis/v1" are not discovery paths.
            let core = path.starts_with("/api/");
            (core == (gv == "v1")).then(|| resource_list(fixture, keep))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_what_the_fake_serves() {
        let core = resource_list("discovery_api_v1", SERVED[0].2);
        let names: Vec<&str> = core["resources"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["name"].as_str().unwrap())
            .collect();
        // Every one the fake serves is in the recorded list.
        assert_eq!(names.len(), SERVED[0].2.len(), "{names:?}");
        assert!(names.contains(&"pods/log") && !names.contains(&"services"));
        for (gv, fixture, keep) in SERVED {
            let doc = resource_list(fixture, keep);
            assert_eq!(doc["groupVersion"], *gv);
            assert_eq!(
                doc["resources"].as_array().unwrap().len(),
                keep.len(),
                "{gv}"
            );
        }
        let groups: Vec<String> = group_list()["groups"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| g["name"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(
            groups,
            [
                "apps",
                "authentication.k8s.io",
                "authorization.k8s.io",
                "certificates.k8s.io",
                "coordination.k8s.io",
                "metrics.k8s.io"
            ]
        );
    }
}
