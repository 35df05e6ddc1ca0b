use super::object::significant;
use super::*;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::time::Duration;

/// The defaults config.rs resolves, with 32 pods and one extra label.
fn cfg() -> NodeConfig {
    NodeConfig {
        labels: BTreeMap::from([("openyurt.io/is-edge-worker".into(), "true".into())]),
        taints: Vec::new(),
        max_pods: 32,
        memory_reserve_bytes: 256 << 20,
        lease_renew: Duration::from_secs(10),
        lease_duration_secs: 40,
        status_report: Duration::from_secs(300),
        memory_pressure_bytes: 100 << 20,
        disk_pressure_percent: 10,
        pid_pressure_percent: 90,
        kubelet_port: None,
    }
}

fn sample() -> NodeSample {
    NodeSample {
        cpus: 4,
        memory_total_bytes: 3906 << 20,
        memory_available_bytes: 2000 << 20,
        disk_free_percent: Some(50),
        pids_used: 300,
        pid_max: 32768,
        internal_ip: Some("10.1.2.3".parse().unwrap()),
        kernel_version: "6.1.0".into(),
        os_image: "Poky (Yocto Project Reference Distro)".into(),
        architecture: "arm64".into(),
        container_runtime_version: Some("containerd://1.6.20".into()),
        ..Default::default()
    }
}

fn fixture(name: &str) -> Value {
    let path = format!(
        "{}/tests/fixtures/apiserver/{name}.json",
        env!("CARGO_MANIFEST_DIR")
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn cond<'a>(st: &'a Value, kind: &str) -> &'a Value {
    st["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == kind)
        .unwrap()
}

#[test]
fn new_node_has_the_recorded_shape() {
    let node = new_node(&sample(), &cfg(), "edge-1", "2026-11-29T18:00:00Z");
    let want = &fixture("node_create_self")["request"]["body"];
    let keys = |v: &Value| -> Vec<String> { v.as_object().unwrap().keys().cloned().collect() };
    assert_eq!(
        keys(&node["status"]["nodeInfo"]),
        keys(&want["status"]["nodeInfo"])
    );
    assert_eq!(
        node["status"]["capacity"],
        json!({"cpu": "4", "memory": "3999744Ki", "pods": "32"})
    );
    assert_eq!(
        node["status"]["allocatable"],
        json!({"cpu": "4", "memory": "3737600Ki", "pods": "32"})
    );
    assert_eq!(node["metadata"]["labels"]["kubernetes.io/arch"], "arm64");
    assert_eq!(
        node["metadata"]["labels"]["openyurt.io/is-edge-worker"],
        "true"
    );
    assert_eq!(
        node["metadata"]["labels"]["kubernetes.io/hostname"],
        "edge-1"
    );
    assert!(node["metadata"]["annotations"][MANAGED_BY_ANNOTATION]
        .as_str()
        .unwrap()
        .starts_with("edgehub/"));
    assert_eq!(
        node["status"]["nodeInfo"]["containerRuntimeVersion"],
        "containerd://1.6.20"
    );
    assert_eq!(
        node["status"]["addresses"][0],
        json!({"type": "InternalIP", "address": "10.1.2.3"})
    );
    assert!(
        node["spec"].get("taints").is_none(),
        "no taints unless configured"
    );
    let ready = cond(&node["status"], "Ready");
    assert_eq!(
        (ready["status"].as_str(), ready["reason"].as_str()),
        (Some("True"), Some("EdgehubReady"))
    );
}

#[test]
fn pressure_conditions_follow_the_sample_and_keep_transition_times() {
    let c = cfg();
    let t0 = "2026-11-29T18:00:00Z";
    let st0 = status(&sample(), &c, "edge-1", None, t0);
    for kind in ["MemoryPressure", "DiskPressure", "PIDPressure"] {
        assert_eq!(cond(&st0, kind)["status"], "False", "{kind}");
    }
    let mut low = sample();
    low.memory_available_bytes = 50 << 20;
    low.disk_free_percent = Some(3);
    low.pids_used = 32000;
    let t1 = "2026-11-29T18:00:10Z";
    let st1 = status(&low, &c, "edge-1", st0.get("conditions"), t1);
    for kind in ["MemoryPressure", "DiskPressure", "PIDPressure"] {
        assert_eq!(cond(&st1, kind)["status"], "True", "{kind}");
        assert_eq!(
            cond(&st1, kind)["lastTransitionTime"],
            t1,
            "{kind} changed at t1"
        );
    }
    assert_eq!(
        cond(&st1, "Ready")["lastTransitionTime"],
        t0,
        "Ready did not change"
    );
    assert_eq!(cond(&st1, "Ready")["lastHeartbeatTime"], t1);
    assert_ne!(significant(&st0), significant(&st1));
    // Only heartbeat times differ: not a significant change.
    let st2 = status(
        &low,
        &c,
        "edge-1",
        st1.get("conditions"),
        "2026-11-29T18:00:20Z",
    );
    assert_eq!(significant(&st1), significant(&st2));
    // Unknown disk never claims pressure.
    let mut unknown = sample();
    unknown.disk_free_percent = None;
    assert_eq!(
        cond(&status(&unknown, &c, "e", None, t0), "DiskPressure")["status"],
        "False"
    );
}

#[test]
fn existing_node_is_reconciled_only_when_something_differs() {
    let c = cfg();
    let node = new_node(&sample(), &c, "edge-1", "t");
    assert_eq!(reconcile_patch(&node, &c, "edge-1", "arm64"), None);
    let mut other = node.clone();
    other["metadata"]["labels"]
        .as_object_mut()
        .unwrap()
        .remove("openyurt.io/is-edge-worker");
    other["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("annotations");
    let p = reconcile_patch(&other, &c, "edge-1", "arm64").unwrap();
    assert_eq!(
        p["metadata"]["labels"],
        json!({"openyurt.io/is-edge-worker": "true"})
    );
    assert!(p["metadata"]["annotations"][MANAGED_BY_ANNOTATION].is_string());
    assert!(
        p.get("spec").is_none(),
        "taints are never patched after creation"
    );
}

#[test]
fn lease_bodies() {
    let create = lease("edge-1", 40, "2026-11-29T18:00:00.000000Z", None);
    let want = &fixture("lease_create")["request"]["body"];
    assert_eq!(create, *want);
    let renew = lease("edge-1", 40, "2026-11-29T18:00:10.000000Z", Some("235"));
    assert_eq!(renew["metadata"]["resourceVersion"], "235");
    assert_eq!(
        renew["spec"],
        fixture("lease_renew_put")["request"]["body"]["spec"]
    );
}

#[test]
fn host_parsing() {
    let (t, a) =
        parse_meminfo("MemTotal:        3999744 kB\nMemFree: 1 kB\nMemAvailable:    2048000 kB\n");
    assert_eq!((t, a), (3999744 * 1024, 2048000 * 1024));
    assert_eq!(parse_meminfo("garbage"), (0, 0));
    assert_eq!(
        parse_os_release("NAME=x\nPRETTY_NAME=\"Debian GNU/Linux 12 (bookworm)\"\n"),
        "Debian GNU/Linux 12 (bookworm)"
    );
    assert_eq!(parse_os_release(""), "Linux");
    assert_eq!(
        server_host_port("https://10.0.0.1:6443").as_deref(),
        Some("10.0.0.1:6443")
    );
    assert_eq!(
        server_host_port("https://api.example.com").as_deref(),
        Some("api.example.com:443")
    );
    assert_eq!(
        server_host_port("https://[fd00::1]:6443").as_deref(),
        Some("[fd00::1]:6443")
    );
    assert_eq!(server_host_port("not a url"), None);
}

#[test]
fn the_host_probe_reads_this_machine() {
    let dir = tempfile::tempdir().unwrap();
    let (_tx, cri) = tokio::sync::watch::channel(crate::cri::CriHealth::Ready {
        version: "containerd://1.6.20".into(),
    });
    let p = HostProbe {
        data_dir: dir.path().to_path_buf(),
        apiserver: Some("127.0.0.1:6443".into()),
        cri,
        image_fs: None,
    };
    let s = p.sample();
    assert!(s.cpus >= 1);
    assert!(s.memory_total_bytes > 0 && s.memory_available_bytes <= s.memory_total_bytes);
    assert!(s.disk_free_percent.is_some());
    assert!(s.pid_max > 0 && s.pids_used > 0);
    assert!(!s.kernel_version.is_empty());
    assert_eq!(s.internal_ip, Some("127.0.0.1".parse().unwrap()));
    assert_eq!(s.architecture, goarch());
    assert_eq!(
        s.container_runtime_version.as_deref(),
        Some("containerd://1.6.20")
    );
    assert_eq!(s.runtime_problem, None);
}

#[test]
fn a_down_runtime_makes_the_node_not_ready() {
    let mut s = sample();
    s.runtime_problem =
        Some("CRI socket /run/containerd/containerd.sock: runtime unavailable".into());
    let st = status(&s, &cfg(), "edge-1", None, "t");
    let ready = cond(&st, "Ready");
    assert_eq!(
        (ready["status"].as_str(), ready["reason"].as_str()),
        (Some("False"), Some("ContainerRuntimeNotReady"))
    );
    assert!(ready["message"]
        .as_str()
        .unwrap()
        .contains("containerd.sock"));
}

#[test]
fn a_full_image_filesystem_is_disk_pressure_with_its_reason() {
    let c = cfg();
    let t0 = "2026-11-29T18:00:00Z";
    let mut full = sample();
    full.image_fs_pressure = Some("the image filesystem is 97 % full".into());
    let st = status(&full, &c, "edge-1", None, t0);
    let d = cond(&st, "DiskPressure");
    assert_eq!(d["status"], "True");
    assert_eq!(d["reason"], "NodeHasDiskPressure");
    assert!(d["message"].as_str().unwrap().contains("97 % full"), "{d}");
    // It clears when the collector says so.
    full.image_fs_pressure = None;
    let st2 = status(&full, &c, "edge-1", st.get("conditions"), t0);
    assert_eq!(cond(&st2, "DiskPressure")["status"], "False");
}

#[test]
fn the_node_advertises_its_apis_port() {
    let st = status(&sample(), &cfg(), "edge-1", None, "t");
    assert_eq!(
        st["daemonEndpoints"],
        json!({"kubeletEndpoint": {"Port": 0}}),
        "off: 0, as the recorded Node without a kubelet"
    );
    let c = NodeConfig {
        kubelet_port: Some(10250),
        ..cfg()
    };
    let st = status(&sample(), &c, "edge-1", None, "t");
    assert_eq!(st["daemonEndpoints"]["kubeletEndpoint"]["Port"], 10250);
}

#[test]
fn ready_is_overridden_only_by_another_status_under_our_last_heartbeat() {
    use super::object::ready_overridden;
    let posted = json!([
        {"type": "MemoryPressure", "status": "False", "lastHeartbeatTime": "2026-12-04T06:00:00Z"},
        {"type": "Ready", "status": "True", "lastHeartbeatTime": "2026-12-04T06:00:00Z"},
    ]);
    let node = |status: &str, beat: &str| {
        json!({"status": {"conditions": [
            {"type": "Ready", "status": status, "lastHeartbeatTime": beat,
             "reason": "NodeStatusUnknown"},
        ]}})
    };
    // The node lifecycle controller after its grace period: our heartbeat, another status.
    assert!(ready_overridden(
        &node("Unknown", "2026-12-04T06:00:00Z"),
        &posted
    ));
    // Our own post, as the watch brings it back.
    assert!(!ready_overridden(
        &node("True", "2026-12-04T06:00:00Z"),
        &posted
    ));
    // A cache not yet caught up with our post says nothing.
    assert!(!ready_overridden(
        &node("Unknown", "2026-12-04T05:59:00Z"),
        &posted
    ));
    // Nothing to compare: no Ready in either, or no heartbeat.
    assert!(!ready_overridden(&json!({}), &posted));
    assert!(!ready_overridden(
        &node("Unknown", "2026-12-04T06:00:00Z"),
        &json!([])
    ));
    let no_beat = json!([{"type": "Ready", "status": "True"}]);
    assert!(!ready_overridden(
        &json!({"status": {"conditions": [{"type": "Ready", "status": "Unknown"}]}}),
        &no_beat
    ));
}
