//! The translated sandbox and containers: namespaces, ports, security, init containers, probes, resources, and the fields refused by name.

use super::*;

#[test]
fn pod_network_pods_get_their_own_namespace_and_address() {
    let mut pod = runnable("telemetry-sv74m");
    pod["spec"]["hostNetwork"] = json!(false);
    pod["spec"]["containers"][0]["env"] = json!([{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
               {"name": "HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}}]);
    let mut c = ctx();
    c.pod_ip = Some("10.88.0.5".into());
    let plan = translate(&pod, &c).unwrap();
    let ns = namespaces(&plan);
    assert_eq!(ns.network, api::NamespaceMode::Pod as i32);
    assert_eq!(plan.sandbox.hostname, "telemetry-sv74m");
    assert_eq!(plan.pod_ip.as_deref(), Some("10.88.0.5"));
    let env = &plan.containers[0].config.envs;
    assert_eq!(env[0].value, "10.88.0.5");
    assert_eq!(env[1].value, "10.0.0.7");
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
            Box::new(|p| p["spec"]["ephemeralContainers"] = json!([{}])),
            "spec.ephemeralContainers",
        ),
        (
            Box::new(|p| p["spec"]["containers"][0]["lifecycle"] = json!({"preStop": {}})),
            "spec.containers[0].lifecycle",
        ),
        (
            Box::new(|p| p["spec"]["containers"][0]["envFrom"] = json!([{"prefix": "X_"}])),
            "spec.containers[0].envFrom[0]",
        ),
        (
            Box::new(|p| p["spec"]["volumes"] = json!([{"name": "v", "iscsi": {}}])),
            "spec.volumes[0].iscsi",
        ),
        (
            Box::new(|p| {
                p["spec"]["containers"][0]["env"] =
                    json!([{"name": "S", "valueFrom": {"fileKeyRef": {"path": "p", "key": "k"}}}])
            }),
            "spec.containers[0].env[0].valueFrom.fileKeyRef",
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
        let f = unsupported_field(translate(&p, &ctx()).unwrap_err());
        assert_eq!(f, field);
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

#[test]
fn probes_take_the_api_defaults_and_named_ports() {
    use crate::podspec::ProbeAction;
    use std::time::Duration;
    let plan = translate(&runnable("telemetry-sv74m"), &ctx()).unwrap();
    let r = plan.containers[0].readiness.clone().unwrap();
    assert_eq!(r.action, ProbeAction::Exec(vec!["/bin/true".into()]));
    assert_eq!(
        (
            r.period,
            r.timeout,
            r.success_threshold,
            r.failure_threshold
        ),
        (Duration::from_secs(2), Duration::from_secs(1), 1, 3)
    );
    assert!(plan.containers[0].liveness.is_none());
    assert!(plan.containers[1].readiness.is_none());

    let mut pod = runnable("telemetry-sv74m");
    pod["spec"]["containers"][0]["livenessProbe"] = json!({"httpGet": {"path": "healthz", "port": "http",
        "httpHeaders": [{"name": "X-A", "value": "1"}]}});
    pod["spec"]["containers"][0]["readinessProbe"] =
        json!({"tcpSocket": {"port": 9000}, "initialDelaySeconds": 5});
    let plan = translate(&pod, &ctx()).unwrap();
    let l = plan.containers[0].liveness.clone().unwrap();
    assert_eq!(
        l.action,
        ProbeAction::HttpGet {
            https: false,
            host: None,
            port: 8080,
            path: "/healthz".into(),
            headers: vec![("X-A".into(), "1".into())]
        }
    );
    assert_eq!(
        (l.period, l.failure_threshold),
        (Duration::from_secs(10), 3)
    );
    let r = plan.containers[0].readiness.clone().unwrap();
    assert_eq!(
        r.action,
        ProbeAction::TcpSocket {
            host: None,
            port: 9000
        }
    );
    assert_eq!(r.initial_delay, Duration::from_secs(5));

    for (probe, field) in [
        (
            json!({"grpc": {"port": 1}}),
            "spec.containers[0].livenessProbe.grpc",
        ),
        (
            json!({"httpGet": {"port": 1, "scheme": "GOPHER"}}),
            "spec.containers[0].livenessProbe.httpGet.scheme",
        ),
        (
            json!({"httpGet": {"port": "nope"}}),
            "spec.containers[0].livenessProbe.httpGet.port",
        ),
        (
            json!({"exec": {"command": []}}),
            "spec.containers[0].livenessProbe.exec.command",
        ),
    ] {
        let mut p = runnable("telemetry-sv74m");
        p["spec"]["containers"][0]["livenessProbe"] = probe;
        assert_eq!(unsupported_field(translate(&p, &ctx()).unwrap_err()), field);
    }
}

#[test]
fn volume_and_container_names_that_are_not_labels_never_become_paths() {
    let base = json!({
        "metadata": {"name": "p", "namespace": "ns", "uid": "u"},
        "spec": {
            "volumes": [{"name": "data", "emptyDir": {}}],
            "containers": [{"name": "app", "image": "busybox:1.0",
                "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
            "initContainers": [{"name": "init", "image": "busybox:1.0"}]
        }
    });
    assert!(translate(&base, &ctx()).is_ok());
    for (path, bad, field) in [
        (
            "/spec/volumes/0/name",
            "../../../../escape",
            "spec.volumes[0].name",
        ),
        ("/spec/volumes/0/name", "a/b", "spec.volumes[0].name"),
        ("/spec/volumes/0/name", "..", "spec.volumes[0].name"),
        (
            "/spec/containers/0/name",
            "../../../evil",
            "spec.containers[0].name",
        ),
        ("/spec/containers/0/name", "a/b", "spec.containers[0].name"),
        (
            "/spec/initContainers/0/name",
            "..",
            "spec.initContainers[0].name",
        ),
    ] {
        let mut p = base.clone();
        *p.pointer_mut(path).unwrap() = json!(bad);
        if path.starts_with("/spec/volumes") {
            p["spec"]["containers"][0]["volumeMounts"][0]["name"] = json!(bad);
        }
        let e = translate(&p, &ctx()).unwrap_err();
        assert_eq!(unsupported_field(e.clone()), field, "{bad}: {e}");
        assert!(e.to_string().contains(&format!("{bad:?}")), "{e}");
    }
}
