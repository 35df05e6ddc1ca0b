use super::*;
use serde_json::json;

fn fixture_pod(name: &str) -> Value {
    let path = format!(
        "{}/tests/fixtures/apiserver/pods_list_node.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    v["response"]["body"]["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["metadata"]["name"] == name)
        .unwrap()
        .clone()
}

fn ctx() -> PodContext {
    PodContext {
        node_name: "edge-1".into(),
        host_ip: Some("10.0.0.7".into()),
        volume_dir: PathBuf::from("/var/lib/edgehub/pods/u/volumes"),
        log_dir: PathBuf::from("/var/lib/edgehub/pods/u/logs"),
        attempt: 0,
        pod_ip: None,
        sources: Sources::default(),
    }
}

fn data(pairs: &[(&str, &str)]) -> Data {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.as_bytes().to_vec()))
        .collect()
}

/// What the recorded pods reference, as the fetcher would have cached it.
fn recorded_sources() -> Sources {
    let mut s = Sources::default();
    s.configmaps.insert(
        "telemetry-cfg".into(),
        Some(data(&[("app.conf", "level=info\n")])),
    );
    s.configmaps.insert(
        "kube-root-ca.crt".into(),
        Some(data(&[("ca.crt", "CA PEM")])),
    );
    s.configmaps.insert(
        "openshift-service-ca.crt".into(),
        Some(data(&[("service-ca.crt", "SERVICE CA PEM")])),
    );
    s.tokens.insert((String::new(), 3607), "tok-1".into());
    s
}

fn namespaces(plan: &PodPlan) -> api::NamespaceOption {
    plan.sandbox
        .linux
        .as_ref()
        .and_then(|l| l.security_context.as_ref())
        .and_then(|sc| sc.namespace_options.clone())
        .unwrap()
}

fn unsupported_field(e: PlanError) -> String {
    match e {
        PlanError::Unsupported(u) => u.field,
        PlanError::Missing(m) => panic!("expected Unsupported, got Missing: {m}"),
    }
}

fn missing(e: PlanError) -> Missing {
    match e {
        PlanError::Missing(m) => m,
        PlanError::Unsupported(u) => panic!("expected Missing, got Unsupported: {u}"),
    }
}

/// The recorded pod without the volumes that need the API (ConfigMap, projected token).
fn runnable(name: &str) -> Value {
    let mut p = fixture_pod(name);
    let vols: Vec<Value> = p["spec"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|v| v.get("hostPath").is_some())
        .cloned()
        .collect();
    let keep: Vec<String> = vols
        .iter()
        .map(|v| v["name"].as_str().unwrap().to_string())
        .collect();
    p["spec"]["volumes"] = Value::Array(vols);
    for c in p["spec"]["containers"].as_array_mut().unwrap() {
        if let Some(ms) = c.get_mut("volumeMounts").and_then(Value::as_array_mut) {
            ms.retain(|m| keep.contains(&m["name"].as_str().unwrap().to_string()));
        }
    }
    p
}

mod containers;
mod sources;
