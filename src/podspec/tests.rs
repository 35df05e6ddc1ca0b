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

#[test]
fn the_recorded_pod_names_the_volume_it_cannot_run() {
    let e = translate(&fixture_pod("telemetry-sv74m"), &ctx()).unwrap_err();
    assert_eq!(e.field, "spec.volumes[1].configMap");
}

#[test]
fn a_recorded_pod_translates() {
    let pod = runnable("telemetry-sv74m");
    let plan = translate(&pod, &ctx()).unwrap();
    assert_eq!(
        (plan.namespace.as_str(), plan.name.as_str()),
        ("vehicle", "telemetry-sv74m")
    );
    assert_eq!(plan.restart_policy, RestartPolicy::Always);
    assert_eq!(plan.grace_period_secs, 5);
    let sb = &plan.sandbox;
    assert_eq!(
        sb.hostname, "",
        "host-network pods leave the hostname empty"
    );
    let ns = sb
        .linux
        .as_ref()
        .unwrap()
        .security_context
        .as_ref()
        .unwrap()
        .namespace_options
        .as_ref()
        .unwrap();
    assert_eq!(ns.network, api::NamespaceMode::Node as i32);
    assert_eq!(
        sb.labels[labels::POD_UID],
        pod["metadata"]["uid"].as_str().unwrap()
    );
    assert_eq!(sb.labels[labels::REVISION_HASH], "768bcc7446");
    assert_eq!(sb.labels[labels::MANAGED_BY], "edgehub");
    assert_eq!(sb.labels[labels::NODE], "edge-1");
    assert_eq!(plan.containers[0].config.labels[labels::NODE], "edge-1");

    let app = &plan.containers[0];
    assert_eq!(app.image, "127.0.0.1:5000/busybox:1.0");
    assert_eq!(app.pull_policy, PullPolicy::IfNotPresent);
    let cfg = &app.config;
    assert_eq!(cfg.labels[labels::CONTAINER_NAME], "app");
    let env: HashMap<_, _> = cfg
        .envs
        .iter()
        .map(|kv| (kv.key.as_str(), kv.value.as_str()))
        .collect();
    assert_eq!(env["NODE_NAME"], "edge-1", "fieldRef spec.nodeName");
    assert_eq!(env["MODE"], "edge");
    let res = cfg.linux.as_ref().unwrap().resources.as_ref().unwrap();
    assert_eq!((res.cpu_period, res.cpu_quota), (100_000, 20_000), "200m");
    assert_eq!(res.memory_limit_in_bytes, 64 << 20);
    assert_eq!(res.cpu_shares, 51, "50m requested");
    assert_eq!(cfg.mounts.len(), 1);
    assert_eq!(cfg.mounts[0].container_path, "/data");
    assert_eq!(cfg.mounts[0].host_path, "/var/lib/telemetry");
    assert!(
        matches!(&plan.volumes[0], VolumePlan::HostPath { kind, .. } if kind == "DirectoryOrCreate")
    );
}

#[test]
fn ports_security_and_downward_env() {
    let mut pod = runnable("gateway-v9hb2");
    let c = &mut pod["spec"]["containers"][0];
    c["securityContext"] = json!({"privileged": true, "runAsUser": 1000, "runAsGroup": 100,
        "readOnlyRootFilesystem": true, "capabilities": {"add": ["NET_ADMIN"], "drop": ["ALL"]}});
    c["env"] = json!([
        {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
        {"name": "MEM", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}}},
        {"name": "CPU", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
    ]);
    c["command"] = json!(["/bin/sh"]);
    c["args"] = json!(["-c", "true"]);
    c["workingDir"] = json!("/tmp");
    let plan = translate(&pod, &ctx()).unwrap();
    assert_eq!(
        plan.sandbox.port_mappings,
        vec![api::PortMapping {
            protocol: api::Protocol::Tcp as i32,
            container_port: 8081,
            host_port: 8081,
            host_ip: String::new(),
        }]
    );
    let cfg = &plan.containers[0].config;
    assert_eq!(
        (
            cfg.command.clone(),
            cfg.args.clone(),
            cfg.working_dir.as_str()
        ),
        (
            vec!["/bin/sh".to_string()],
            vec!["-c".to_string(), "true".to_string()],
            "/tmp"
        )
    );
    let sc = cfg
        .linux
        .as_ref()
        .unwrap()
        .security_context
        .as_ref()
        .unwrap();
    assert!(sc.privileged && sc.readonly_rootfs);
    assert_eq!(sc.run_as_user.as_ref().unwrap().value, 1000);
    assert_eq!(sc.run_as_group.as_ref().unwrap().value, 100);
    assert_eq!(
        sc.capabilities.as_ref().unwrap().add_capabilities,
        ["NET_ADMIN"]
    );
    assert_eq!(sc.capabilities.as_ref().unwrap().drop_capabilities, ["ALL"]);
    let env: HashMap<_, _> = cfg
        .envs
        .iter()
        .map(|kv| (kv.key.as_str(), kv.value.as_str()))
        .collect();
    assert_eq!(env["POD"], "gateway-v9hb2");
    assert_eq!(env["NS"], "vehicle");
    assert_eq!(env["IP"], "10.0.0.7");
    assert_eq!(env["MEM"], "64");
    assert_eq!(env["CPU"], "1", "200m rounds up to 1 core");
}

#[test]
fn unsupported_fields_are_named() {
    let base = runnable("telemetry-sv74m");
    type Mutation = Box<dyn Fn(&mut Value)>;
    let cases: Vec<(Mutation, &str)> = vec![
        (
            Box::new(|p| p["spec"]["hostNetwork"] = json!(false)),
            "spec.hostNetwork",
        ),
        (
            Box::new(|p| p["spec"]["ephemeralContainers"] = json!([{}])),
            "spec.ephemeralContainers",
        ),
        (
            Box::new(|p| p["spec"]["containers"][0]["lifecycle"] = json!({"preStop": {}})),
            "spec.containers[0].lifecycle",
        ),
        (
            Box::new(|p| {
                p["spec"]["containers"][0]["envFrom"] = json!([{"configMapRef": {"name": "x"}}])
            }),
            "spec.containers[0].envFrom",
        ),
        (
            Box::new(|p| {
                p["spec"]["containers"][0]["env"] =
                    json!([{"name": "S", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}])
            }),
            "spec.containers[0].env[0].valueFrom.secretKeyRef",
        ),
        (
            Box::new(
                |p| p["spec"]["containers"][0]["env"] = json!([{"name": "S", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels"}}}]),
            ),
            "spec.containers[0].env[0].valueFrom.fieldRef.fieldPath",
        ),
        (
            Box::new(|p| {
                p["spec"]["volumes"] = json!([{"name": "m", "emptyDir": {"medium": "Memory"}}])
            }),
            "spec.volumes[0].emptyDir.medium",
        ),
        (
            Box::new(|p| p["spec"]["volumes"][0]["hostPath"]["type"] = json!("Weird")),
            "spec.volumes[0].hostPath.type",
        ),
        (
            Box::new(|p| p["spec"]["containers"][0]["resources"]["limits"]["cpu"] = json!("lots")),
            "spec.containers[0].resources.limits.cpu",
        ),
        (
            Box::new(|p| p["spec"]["restartPolicy"] = json!("Sometimes")),
            "spec.restartPolicy",
        ),
        (
            Box::new(|p| p["spec"]["containers"] = json!([])),
            "spec.containers",
        ),
        (
            Box::new(|p| {
                p["spec"] = json!(null);
            }),
            "spec",
        ),
    ];
    for (mutate, field) in cases {
        let mut p = base.clone();
        mutate(&mut p);
        let e = translate(&p, &ctx()).unwrap_err();
        assert_eq!(e.field, field, "{e}");
    }
}

#[test]
fn quantities() {
    assert_eq!(parse_cpu_millis("200m"), Some(200));
    assert_eq!(parse_cpu_millis("1"), Some(1000));
    assert_eq!(parse_cpu_millis("0.5"), Some(500));
    assert_eq!(parse_cpu_millis("x"), None);
    assert_eq!(parse_bytes("64Mi"), Some(64 << 20));
    assert_eq!(parse_bytes("1G"), Some(1_000_000_000));
    assert_eq!(parse_bytes("128974848"), Some(128_974_848));
    assert_eq!(parse_bytes("1.5Gi"), Some(1_610_612_736));
    assert_eq!(parse_bytes("lots"), None);
}

#[test]
fn init_containers_come_in_order_and_pull_policy_defaults() {
    let mut pod = runnable("telemetry-sv74m");
    pod["spec"]["initContainers"] = json!([
        {"name": "first", "image": "127.0.0.1:5000/busybox:1.0"},
        {"name": "second", "image": "127.0.0.1:5000/busybox"},
    ]);
    let plan = translate(&pod, &ctx()).unwrap();
    let names: Vec<_> = plan
        .init_containers
        .iter()
        .map(|c| c.name.as_str())
        .collect();
    assert_eq!(names, ["first", "second"]);
    assert_eq!(
        plan.init_containers[0].pull_policy,
        PullPolicy::IfNotPresent
    );
    assert_eq!(
        plan.init_containers[1].pull_policy,
        PullPolicy::Always,
        "untagged means latest"
    );
    assert_eq!(
        plan.init_containers[0].config.labels["edgehub.io/init"],
        "true"
    );
}
