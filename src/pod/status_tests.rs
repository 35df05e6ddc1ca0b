use super::*;

fn view(name: &str, state: ViewState) -> ContainerView {
    ContainerView {
        name: name.into(),
        image: "img:1".into(),
        image_id: "img@sha256:x".into(),
        container_id: String::new(),
        restart_count: 0,
        ready: matches!(state, ViewState::Running { .. }),
        state,
    }
}

fn running() -> ViewState {
    ViewState::Running {
        started_at: "t".into(),
    }
}

fn exited(code: i32) -> ViewState {
    ViewState::Terminated {
        exit_code: code,
        reason: "r".into(),
        started_at: "a".into(),
        finished_at: "b".into(),
    }
}

fn cond(s: &Value, t: &str) -> String {
    s["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == t)
        .unwrap()["status"]
        .as_str()
        .unwrap()
        .to_string()
}

#[test]
fn pod_phases_and_conditions() {
    let waiting = ViewState::Waiting {
        reason: "ContainerCreating".into(),
    };
    let s = pod_status(
        &[],
        &[view("a", waiting.clone())],
        Some("10.0.0.7"),
        Some("10.0.0.7"),
        None,
        RestartPolicy::Always,
    );
    assert_eq!(
        (s["phase"].as_str(), cond(&s, "Ready").as_str()),
        (Some("Pending"), "False")
    );
    assert_eq!(s["podIP"], "10.0.0.7");
    assert_eq!(
        s["containerStatuses"][0]["state"]["waiting"]["reason"],
        "ContainerCreating"
    );

    let s = pod_status(
        &[],
        &[view("a", running()), view("b", running())],
        None,
        None,
        Some("t0"),
        RestartPolicy::Always,
    );
    assert_eq!(
        (s["phase"].as_str(), cond(&s, "Ready").as_str()),
        (Some("Running"), "True")
    );
    assert_eq!(s["startTime"], "t0");
    assert_eq!(s["containerStatuses"][1]["imageID"], "img@sha256:x");

    let s = pod_status(
        &[],
        &[view("a", running()), view("b", exited(1))],
        None,
        None,
        None,
        RestartPolicy::Always,
    );
    assert_eq!(
        (s["phase"].as_str(), cond(&s, "ContainersReady").as_str()),
        (Some("Running"), "False")
    );

    let s = pod_status(
        &[],
        &[view("a", exited(0))],
        None,
        None,
        None,
        RestartPolicy::Never,
    );
    assert_eq!(s["phase"], "Succeeded");
    let s = pod_status(
        &[],
        &[view("a", exited(2))],
        None,
        None,
        None,
        RestartPolicy::OnFailure,
    );
    assert_eq!(s["phase"], "Failed");

    // Init containers gate everything.
    let s = pod_status(
        &[view("i", running())],
        &[view("a", waiting)],
        None,
        None,
        None,
        RestartPolicy::Always,
    );
    assert_eq!(
        (s["phase"].as_str(), cond(&s, "Initialized").as_str()),
        (Some("Pending"), "False")
    );
    assert_eq!(s["initContainerStatuses"][0]["name"], "i");
    let s = pod_status(
        &[view("i", exited(0))],
        &[view("a", running())],
        None,
        None,
        None,
        RestartPolicy::Always,
    );
    assert_eq!(cond(&s, "Initialized"), "True");
}

/// The recorded apiserver status of a pod whose sandbox got a new IP, and what edgehub wants.
fn stored_with_ip(ip: &str) -> Value {
    serde_json::json!({
        "phase": "Running",
        "conditions": [
            {"type": "Ready", "status": "True", "lastProbeTime": null, "lastTransitionTime": "2026-11-29T18:01:05Z"},
            {"type": "PodNeedUpgrade", "status": "True", "lastProbeTime": null, "lastTransitionTime": "2026-11-29T18:01:00Z", "message": "controllerrevision: h"},
        ],
        "hostIP": "10.0.2.15", "hostIPs": [{"ip": "10.0.2.15"}],
        "podIP": ip, "podIPs": [{"ip": ip}],
        "qosClass": "BestEffort",
        "containerStatuses": [{"name": "app", "state": {"running": {"startedAt": "2026-11-29T18:01:01Z"}},
            "lastState": {}, "ready": true, "restartCount": 0, "image": "i", "imageID": "i@sha256:1",
            "containerID": "containerd://a", "started": true}],
    })
}

fn ours_with_ip(ip: &str) -> Value {
    serde_json::json!({
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "True"}],
        "hostIP": "10.0.2.15", "hostIPs": [{"ip": "10.0.2.15"}],
        "podIP": ip, "podIPs": [{"ip": ip}],
        "containerStatuses": [{"name": "app", "state": {"running": {"startedAt": "2026-11-29T18:01:01Z"}},
            "lastState": {}, "ready": true, "restartCount": 0, "image": "i", "imageID": "i@sha256:1",
            "containerID": "containerd://a", "started": true}],
    })
}

#[test]
fn what_the_apiserver_already_holds_needs_no_patch() {
    let current = stored_with_ip("10.88.42.3");
    let ours = with_times(
        &ours_with_ip("10.88.42.3"),
        &current,
        None,
        "2026-12-01T00:00:00Z",
    );
    // The condition keeps the apiserver's transition time; nulls and {} are as good as absent.
    assert_eq!(
        ours["conditions"][0]["lastTransitionTime"],
        "2026-11-29T18:01:05Z"
    );
    assert!(!needs_patch(&current, &ours));
    assert_eq!(
        two_way_patch("u", &current, &merge_onto(&current, &ours)),
        None
    );
    assert!(same(
        &serde_json::json!({"a": {}, "b": null, "c": [1]}),
        &serde_json::json!({"c": [1]})
    ));
}

#[test]
fn a_new_ip_replaces_the_old_one_as_the_kubelet_patches_it() {
    let current = stored_with_ip("10.88.42.3");
    let ours = with_times(&ours_with_ip("10.88.42.4"), &current, None, "now");
    assert!(needs_patch(&current, &ours));
    let patch = two_way_patch("89b26f29", &current, &merge_onto(&current, &ours)).unwrap();
    // The recorded kubelet-form patch (pod_status_patch_new_ip_two_way).
    assert_eq!(
        patch,
        serde_json::json!({"metadata": {"uid": "89b26f29"}, "status": {
            "$setElementOrder/podIPs": [{"ip": "10.88.42.4"}],
            "podIP": "10.88.42.4",
            "podIPs": [{"ip": "10.88.42.4"}, {"ip": "10.88.42.3", "$patch": "delete"}],
        }})
    );
}

#[test]
fn a_changed_condition_gets_a_transition_time_others_conditions_stay() {
    let current = stored_with_ip("10.88.42.3");
    let mut ours = ours_with_ip("10.88.42.3");
    ours["conditions"] =
        serde_json::json!([{"type": "Ready", "status": "False", "reason": "X", "message": "m"}]);
    let ours = with_times(&ours, &current, None, "2026-12-01T00:00:00Z");
    let merged = merge_onto(&current, &ours);
    let types: Vec<&str> = merged["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["type"].as_str().unwrap())
        .collect();
    assert_eq!(
        types,
        ["Ready", "PodNeedUpgrade"],
        "another writer's condition stays"
    );
    let patch = two_way_patch("u", &current, &merged).unwrap();
    assert_eq!(
        patch["status"]["conditions"],
        serde_json::json!([{"type": "Ready", "status": "False", "reason": "X", "message": "m",
            "lastTransitionTime": "2026-12-01T00:00:00Z"}])
    );
    assert_eq!(
        patch["status"]["$setElementOrder/conditions"],
        serde_json::json!([{"type": "Ready"}, {"type": "PodNeedUpgrade"}])
    );
    // Back to True: the reason and message it had are removed, not left behind by the merge.
    let back = with_times(
        &ours_with_ip("10.88.42.3"),
        &merged,
        None,
        "2026-12-01T00:01:00Z",
    );
    let patch = two_way_patch("u", &merged, &merge_onto(&merged, &back)).unwrap();
    assert_eq!(
        patch["status"]["conditions"],
        serde_json::json!([{"type": "Ready", "status": "True", "reason": null, "message": null,
            "lastTransitionTime": "2026-12-01T00:01:00Z"}])
    );
}

#[test]
fn requeuing_an_undelivered_change_keeps_its_transition_time() {
    let current = stored_with_ip("10.88.42.3");
    let mut ours = ours_with_ip("10.88.42.3");
    ours["conditions"] = serde_json::json!([{"type": "Ready", "status": "False"}]);
    let first = with_times(&ours, &current, None, "t1");
    let again = with_times(&ours, &current, Some(&first), "t2");
    assert_eq!(
        first, again,
        "an offline node rewrites nothing while nothing changes"
    );
}

#[test]
fn container_statuses_are_sent_whole() {
    let current = stored_with_ip("10.88.42.3");
    let mut ours = ours_with_ip("10.88.42.3");
    ours["containerStatuses"][0]["ready"] = serde_json::json!(false);
    let ours = with_times(&ours, &current, None, "t");
    let patch = two_way_patch("u", &current, &merge_onto(&current, &ours)).unwrap();
    assert_eq!(
        patch["status"]["containerStatuses"],
        ours["containerStatuses"]
    );
}
