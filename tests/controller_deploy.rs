//! `deploy/controller.yaml` fits the binary: the Deployment runs `edgehub controller` with
//! the Lease identity and namespace from the downward API, its probes hit the paths the
//! controller serves on the port it listens on, and the service account is the one bound.
//! (That its RBAC covers every request is checked in tests/controller.rs, against what the
//! controller actually sent.)

use serde_json::Value;

fn docs() -> Vec<Value> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/controller.yaml");
    let text = std::fs::read_to_string(path).unwrap();
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect()
}

fn find<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

#[test]
fn the_deployment_runs_the_controller_as_the_bound_service_account() {
    let docs = docs();
    let sa = find(&docs, "ServiceAccount")[0];
    let (sa_name, sa_ns) = (&sa["metadata"]["name"], &sa["metadata"]["namespace"]);
    for binding in find(&docs, "ClusterRoleBinding")
        .into_iter()
        .chain(find(&docs, "RoleBinding"))
    {
        let subject = &binding["subjects"][0];
        assert_eq!(
            (&subject["kind"], &subject["name"], &subject["namespace"]),
            (&Value::from("ServiceAccount"), sa_name, sa_ns)
        );
        let role_kind = binding["roleRef"]["kind"].as_str().unwrap();
        let role_name = &binding["roleRef"]["name"];
        assert!(
            find(&docs, role_kind)
                .iter()
                .any(|r| &r["metadata"]["name"] == role_name),
            "{binding}"
        );
    }
    let deploy = find(&docs, "Deployment")[0];
    assert_eq!(&deploy["metadata"]["namespace"], sa_ns);
    let pod = &deploy["spec"]["template"]["spec"];
    assert_eq!(&pod["serviceAccountName"], sa_name);
    let c = &pod["containers"][0];
    let args: Vec<&str> = c["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(args[0], "controller");
    let addr = args
        .iter()
        .find_map(|a| a.strip_prefix("--metrics-addr="))
        .unwrap();
    let port: u64 = addr.rsplit(':').next().unwrap().parse().unwrap();
    assert_eq!(c["ports"][0]["containerPort"], port);
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    let env: Vec<(&str, &str)> = c["env"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| {
            Some((
                e["name"].as_str()?,
                e.pointer("/valueFrom/fieldRef/fieldPath")?.as_str()?,
            ))
        })
        .collect();
    assert!(env.contains(&("POD_NAME", "metadata.name")));
    assert!(env.contains(&("POD_NAMESPACE", "metadata.namespace")));
    // The Lease Role lives where the controller looks for the Lease: its own namespace.
    let role = find(&docs, "Role")[0];
    assert_eq!(&role["metadata"]["namespace"], sa_ns);
    let lease = args
        .iter()
        .find_map(|a| a.strip_prefix("--lease-name="))
        .unwrap();
    assert!(role["rules"]
        .as_array()
        .unwrap()
        .iter()
        .any(|r| r["resourceNames"][0] == lease));
}
