//! The fake apiserver answers the recorded requests with the same status codes and shapes as
//! the real kube-apiserver did (tests/fixtures/apiserver, recorded against v1.36.2 with the
//! Node authorizer and NodeRestriction).

mod common;

use base64::Engine;
use edgehub_testsupport::{
    fixture, fixture_body, fixtures_dir, FakeApiServer, ADMIN_TOKEN, NODE_TOKEN,
};
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::time::Duration;

fn token_for(identity: &str) -> Option<&'static str> {
    match identity {
        "system:node:edge-1" => Some(NODE_TOKEN),
        "admin" => Some(ADMIN_TOKEN),
        _ => Some("not-a-valid-token"),
    }
}

async fn server() -> FakeApiServer {
    let s = FakeApiServer::start().await.unwrap();
    s.seed_recorded_cluster();
    s.apply("configmaps", fixture_body("configmap_get_as_node"));
    s
}

/// Replays a fixture's request; `body` overrides the recorded body.
async fn replay(s: &FakeApiServer, name: &str, body: Option<Value>) -> (u16, Value, Value) {
    let f = fixture(name);
    let req = &f["request"];
    let body = body.or_else(|| Some(req["body"].clone()).filter(|b| !b.is_null()));
    let (code, got) = s
        .raw(
            token_for(f["identity"].as_str().unwrap()),
            req["method"].as_str().unwrap(),
            req["path"].as_str().unwrap(),
            req["content_type"].as_str(),
            body.as_ref(),
        )
        .await
        .unwrap();
    (code, got, f["response"].clone())
}

fn keys(v: &Value) -> BTreeSet<String> {
    v.as_object()
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default()
}

fn names(list: &Value) -> Vec<String> {
    list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["metadata"]["name"].as_str().unwrap().to_string())
        .collect()
}

/// Same code; a Status must match in reason, code, message (first line) and details; an object
/// in kind, apiVersion, name and top-level fields.
fn assert_same(name: &str, code: u16, got: &Value, want: &Value) {
    assert_eq!(
        code,
        want["status"].as_u64().unwrap() as u16,
        "{name}: status code; body {got}"
    );
    let want = &want["body"];
    assert_eq!(got["kind"], want["kind"], "{name}: kind");
    assert_eq!(got["apiVersion"], want["apiVersion"], "{name}: apiVersion");
    if want["kind"] == "Status" {
        assert_eq!(keys(got), keys(want), "{name}: Status fields");
        assert_eq!(got["reason"], want["reason"], "{name}: reason");
        assert_eq!(got["code"], want["code"], "{name}: code");
        let first = |v: &Value| {
            v["message"]
                .as_str()
                .unwrap()
                .lines()
                .next()
                .unwrap_or("")
                .to_string()
        };
        assert_eq!(first(got), first(want), "{name}: message");
        // Causes are compared where a test cares about them.
        let without_causes = |d: &Value| {
            let mut d = d.clone();
            if let Some(m) = d.as_object_mut() {
                m.remove("causes");
            }
            d
        };
        assert_eq!(
            without_causes(&got["details"]),
            without_causes(&want["details"]),
            "{name}: details"
        );
    } else if want.get("items").is_some() {
        assert_eq!(
            keys(&got["metadata"]),
            keys(&want["metadata"]),
            "{name}: list metadata fields"
        );
        assert_eq!(names(got), names(want), "{name}: items");
        for (g, w) in got["items"]
            .as_array()
            .unwrap()
            .iter()
            .zip(want["items"].as_array().unwrap())
        {
            assert_eq!(
                keys(g),
                keys(w),
                "{name}: item fields (no kind/apiVersion in list items)"
            );
        }
    } else {
        assert_eq!(
            got["metadata"]["name"], want["metadata"]["name"],
            "{name}: name"
        );
        assert_eq!(keys(got), keys(want), "{name}: object fields");
    }
}

/// Every recorded fixture the repo carries. A new one in the shared directory fails
/// [`the_vendored_fixtures_match_the_shared_ones`] until it is copied here and listed.
const VENDORED: &[&str] = &[
    "bootstrap_other_node_cert_creates_node",
    "bootstrap_rbac_node_bootstrapper",
    "bootstrap_rbac_nodeclient",
    "bootstrap_rbac_selfnodeclient",
    "bootstrap_token_expired_unauthorized",
    "bootstrap_token_node_create_forbidden",
    "bootstrap_token_whoami",
    "configmap_get_as_node",
    "configmap_get_unreferenced_forbidden",
    "controllerrevisions_list_rev1",
    "controllerrevisions_list_rev2",
    "controllerrevisions_watch",
    "csr_as_node_for_other_node",
    "csr_bootstrap_for_other_node_name",
    "csr_bootstrap_for_other_node_name_issued",
    "csr_create_as_bootstrap",
    "csr_create_without_rbac_forbidden",
    "csr_denied",
    "csr_denied_seen_by_requester",
    "csr_expiration_too_short_invalid",
    "csr_get_issued",
    "csr_issued_cert_whoami",
    "csr_renew_as_node",
    "csr_renew_as_node_issued",
    "csr_renewed_cert_whoami",
    "csr_serving_create_as_node",
    "csr_serving_for_other_node_forbidden",
    "csr_serving_pending_as_node",
    "csr_short_lived_600s",
    "csr_short_lived_600s_issued",
    "csr_watch_timeout_bookmark",
    "csr_watch_timeout_no_bookmark",
    "csr_watch_until_issued",
    "csr_wrong_usages_admin_approved",
    "csr_wrong_usages_not_approved",
    "csr_wrong_usages_pending",
    "csr_wrong_usages_signer_failed",
    "daemonset_after_replacement",
    "daemonset_after_update",
    "daemonset_create_ota",
    "daemonset_patch_image",
    "daemonsets_list_as_node",
    "daemonsets_watch",
    "discovery_api",
    "discovery_api_v1",
    "discovery_apis",
    "discovery_apis_apps_v1",
    "discovery_apis_authentication_v1",
    "discovery_apis_authorization_v1",
    "discovery_apis_certificates_v1",
    "discovery_apis_coordination_v1",
    "event_create_again_conflict",
    "event_create_as_node",
    "event_create_fixed_name_again_conflict",
    "event_create_fixed_name_as_node",
    "event_create_warning",
    "event_get_forbidden_as_node",
    "event_patch_count",
    "event_patch_series_without_get_as_node",
    "events_list_forbidden_as_node",
    "lease_create",
    "lease_renew_conflict",
    "lease_renew_put",
    "metrics_nodes_not_served",
    "node_create_forbidden_label",
    "node_create_other_forbidden",
    "node_create_self",
    "node_create_with_issued_cert",
    "node_get_self",
    "node_proxy_forbidden_no_rbac",
    "node_proxy_loopback_not_allowed",
    "node_status_patch",
    "pod_attach_proxied_to_kubelet",
    "pod_delete_as_node",
    "pod_delete_wrong_uid_conflict",
    "pod_exec_forbidden_as_node",
    "pod_exec_forbidden_no_rbac",
    "pod_exec_kubelet_404",
    "pod_exec_no_command_forwarded",
    "pod_exec_proxied_to_kubelet",
    "pod_exec_without_upgrade_bad_request",
    "pod_get_not_found",
    "pod_label_patch_forbidden_as_node",
    "pod_log_both_since_invalid",
    "pod_log_forbidden_as_node",
    "pod_log_forbidden_no_rbac",
    "pod_log_hostname_preferred",
    "pod_log_kubelet_404",
    "pod_log_kubelet_unreachable",
    "pod_log_not_found",
    "pod_log_proxied_to_kubelet",
    "pod_log_since_time_default_container",
    "pod_log_two_containers_no_container_bad_request",
    "pod_log_unknown_container_bad_request",
    "pod_portforward_proxied_to_kubelet",
    "pod_spec_patch_env_invalid",
    "pod_spec_patch_forbidden_as_node",
    "pod_status_patch_first_ip",
    "pod_status_patch_merge",
    "pod_status_patch_new_ip_merge_patch",
    "pod_status_patch_new_ip_merged_invalid",
    "pod_status_patch_new_ip_two_way",
    "pod_status_patch_stale_uid",
    "pod_status_patch_strategic",
    "pods_list_after_delete",
    "pods_list_node",
    "pods_list_node_page1",
    "pods_list_node_page2",
    "pods_list_rv_too_old",
    "pods_watch_with_bookmark",
    "pods_watchlist_initial_events",
    "rbac_clusterrole_edgehub",
    "sar_admin_nodes_proxy_allowed_as_node",
    "sar_node_nodes_log_denied_as_node",
    "sar_user_nodes_proxy_denied_as_node",
    "secrets_list_forbidden_as_node",
    "serviceaccount_token_for_pod_as_node",
    "serviceaccount_token_unbound_forbidden",
    "serviceaccount_token_wrong_audience_forbidden",
    "tokenreview_bogus_as_node",
    "tokenreview_valid_as_node",
    "unauthorized_bad_token",
];

#[tokio::test]
async fn the_vendored_fixtures_match_the_shared_ones() {
    let mut ours: Vec<String> = std::fs::read_dir(fixtures_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter_map(|n| n.strip_suffix(".json").map(str::to_string))
        .collect();
    ours.sort();
    assert_eq!(
        ours, VENDORED,
        "tests/fixtures/apiserver and VENDORED differ"
    );
    // The repo carries a copy so it builds alone; where the project's shared fixtures sit beside
    // the checkout, they must be identical, and every one of them vendored.
    let shared = fixtures_dir().join("../../../../shared/fixtures/apiserver");
    let Ok(entries) = std::fs::read_dir(&shared) else {
        eprintln!("shared fixtures not present beside the checkout; compared the list only");
        return;
    };
    for e in entries {
        let e = e.unwrap();
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(stem) = name.strip_suffix(".json") else {
            continue;
        };
        assert!(
            VENDORED.contains(&stem),
            "shared fixture {name} is not vendored: copy it into tests/fixtures/apiserver and list it"
        );
        let ours = std::fs::read(fixtures_dir().join(e.file_name())).unwrap_or_default();
        assert_eq!(ours, std::fs::read(e.path()).unwrap(), "{name} differs");
    }
}

/// The pod of the new-IP fixtures, bound to edge-1 as recorded, with its first status.
fn web_pod(s: &FakeApiServer) {
    let mut pod = s.get("pods", "vehicle", "telemetry-sv74m").unwrap();
    pod["metadata"]["name"] = json!("web-d5xs8");
    pod["metadata"]["uid"] = json!("89b26f29-f66b-422c-80f0-02e8abcb8b97");
    pod["status"] =
        json!({"phase": "Pending", "hostIP": "10.0.2.15", "hostIPs": [{"ip": "10.0.2.15"}]});
    s.apply("pods", pod);
}

#[tokio::test]
async fn pod_status_patches_are_validated_as_recorded() {
    let s = server().await;
    web_pod(&s);
    let ips = |v: &Value| v["status"]["podIPs"].clone();
    let (code, got, want) = replay(&s, "pod_status_patch_first_ip", None).await;
    assert_same("pod_status_patch_first_ip", code, &got, &want);
    assert_eq!(ips(&got), ips(&want["body"]));
    // A strategic merge patch of just the new IP would leave two IPv4 addresses: 422, with the
    // merged list in the apiserver's order (the new IP first).
    let (code, got, want) = replay(&s, "pod_status_patch_new_ip_merged_invalid", None).await;
    assert_same("pod_status_patch_new_ip_merged_invalid", code, &got, &want);
    assert_eq!(got["message"], want["body"]["message"]);
    assert_eq!(got["details"]["causes"], want["body"]["details"]["causes"]);
    // The kubelet's two-way patch replaces the IP.
    let (code, got, want) = replay(&s, "pod_status_patch_new_ip_two_way", None).await;
    assert_same("pod_status_patch_new_ip_two_way", code, &got, &want);
    assert_eq!(ips(&got), ips(&want["body"]));
    assert_eq!(got["status"]["podIP"], "10.88.42.4");
    // A JSON merge patch replaces the list.
    let (code, got, want) = replay(&s, "pod_status_patch_new_ip_merge_patch", None).await;
    assert_same("pod_status_patch_new_ip_merge_patch", code, &got, &want);
    assert_eq!(ips(&got), ips(&want["body"]));
    // A patch carrying another pod's uid is refused.
    let (code, got, want) = replay(&s, "pod_status_patch_stale_uid", None).await;
    assert_same("pod_status_patch_stale_uid", code, &got, &want);
    assert_eq!(got["message"], want["body"]["message"]);
}

#[tokio::test]
async fn container_statuses_are_replaced_whole_and_stored_with_the_apiservers_defaults() {
    let s = server().await;
    let path = "/api/v1/namespaces/vehicle/pods/telemetry-sv74m/status";
    let body = json!({"status": {"containerStatuses": [{"name": "app", "ready": true, "restartCount": 0,
        "image": "i", "imageID": "i@sha256:1", "state": {"running": {"startedAt": "2026-11-30T21:00:00Z"}}}],
        "conditions": [{"type": "Ready", "status": "True"}]}});
    let (code, got) = s
        .raw(
            Some(NODE_TOKEN),
            "PATCH",
            path,
            Some("application/strategic-merge-patch+json"),
            Some(&body),
        )
        .await
        .unwrap();
    assert_eq!(code, 200, "{got}");
    // containerStatuses is an atomic list: the recorded pod had two, the patch names one.
    let cs = got["status"]["containerStatuses"].as_array().unwrap();
    assert_eq!(cs.len(), 1);
    assert_eq!(cs[0]["lastState"], json!({}));
    let ready = got["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "Ready")
        .unwrap();
    assert!(ready.get("lastProbeTime").is_some_and(Value::is_null));
}

#[tokio::test]
async fn events_answer_as_recorded_and_a_series_is_a_patch() {
    let s = server().await;
    web_pod(&s);
    for name in [
        "event_create_warning",
        "event_create_again_conflict",
        "event_patch_count",
    ] {
        let (code, got, want) = replay(&s, name, None).await;
        assert_same(name, code, &got, &want);
    }
    let ev = s
        .get("events", "vehicle", "web-d5xs8.187c0a0b0c0d0e0f")
        .unwrap();
    assert_eq!(ev["count"], 2);
    assert_eq!(ev["lastTimestamp"], "2026-11-30T21:05:00Z");
}

/// A node may create and patch Events, never read them: a second upgrade's Event of the same
/// name is a 409, a GET or LIST of Events is a 403, and the series goes on as a PATCH from
/// the sender's own count.
#[tokio::test]
async fn a_node_keeps_its_event_series_without_reading_events() {
    let s = server().await;
    for name in [
        "event_create_fixed_name_as_node",
        "event_create_fixed_name_again_conflict",
        "event_get_forbidden_as_node",
        "events_list_forbidden_as_node",
        "event_patch_series_without_get_as_node",
    ] {
        let (code, got, want) = replay(&s, name, None).await;
        assert_same(name, code, &got, &want);
        if want["body"]["kind"] == "Status" {
            assert_eq!(got["message"], want["body"]["message"], "{name}");
        }
    }
    let ev = s
        .get(
            "events",
            "vehicle",
            "telemetry-n7t6s.edgehub-upgradestarted",
        )
        .unwrap();
    let want = fixture_body("event_patch_series_without_get_as_node");
    for field in ["count", "firstTimestamp", "lastTimestamp", "message"] {
        assert_eq!(ev[field], want[field], "{field}");
    }
    // Nor watch them; the administrator may read them all.
    let (code, _) = s
        .raw(
            Some(NODE_TOKEN),
            "GET",
            "/api/v1/namespaces/vehicle/events?watch=1",
            None,
            None,
        )
        .await
        .unwrap();
    assert_eq!(code, 403);
    let (code, got) = s
        .raw(
            Some(ADMIN_TOKEN),
            "GET",
            "/api/v1/namespaces/vehicle/events/telemetry-n7t6s.edgehub-upgradestarted",
            None,
            None,
        )
        .await
        .unwrap();
    assert_eq!(code, 200, "{got}");
}

/// A token that stops authenticating gets the recorded 401 on every request, until it is
/// restored.
#[tokio::test]
async fn a_removed_token_is_401_until_restored() {
    let s = server().await;
    let get = || async {
        s.raw(Some(NODE_TOKEN), "GET", "/api/v1/nodes/edge-1", None, None)
            .await
            .unwrap()
    };
    assert_eq!(get().await.0, 200);
    s.remove_token(NODE_TOKEN);
    let (code, got) = get().await;
    let want = fixture("unauthorized_bad_token")["response"].clone();
    assert_same("unauthorized_bad_token", code, &got, &want);
    s.add_token(NODE_TOKEN, edgehub_testsupport::NODE_USER);
    assert_eq!(get().await.0, 200);
}

/// A lost answer: the write is carried out, the connection closes without an answer.
#[tokio::test]
async fn a_lost_answer_still_lands() {
    let s = server().await;
    s.lose_next_answers(1, "POST", &["/events"]);
    let body = fixture("event_create_fixed_name_as_node")["request"]["body"].clone();
    let path = "/api/v1/namespaces/vehicle/events";
    let r = s
        .raw(
            Some(NODE_TOKEN),
            "POST",
            path,
            Some("application/json"),
            Some(&body),
        )
        .await;
    assert!(r.is_err(), "no answer: {r:?}");
    assert!(s
        .get(
            "events",
            "vehicle",
            "telemetry-n7t6s.edgehub-upgradestarted"
        )
        .is_some());
    assert_eq!(s.count(|r| r.answer_lost && r.status == 201), 1);
    // Once: the same create again is answered, 409.
    let (code, _) = s
        .raw(
            Some(NODE_TOKEN),
            "POST",
            path,
            Some("application/json"),
            Some(&body),
        )
        .await
        .unwrap();
    assert_eq!(code, 409);
}

#[tokio::test]
async fn referenced_objects_answer_403_until_the_authorizer_catches_up() {
    let s = server().await;
    let (code, got, want) = replay(&s, "configmap_get_unreferenced_forbidden", None).await;
    assert_same("configmap_get_unreferenced_forbidden", code, &got, &want);
    assert_eq!(got["message"], want["body"]["message"]);

    // A pod bound just now: its ConfigMap is refused for the lag, then served.
    s.set_authorizer_lag(Duration::from_millis(800));
    let mut pod = s.get("pods", "vehicle", "telemetry-sv74m").unwrap();
    pod["metadata"]["name"] = json!("fresh");
    pod["metadata"]["uid"] = json!("fresh-uid");
    pod["spec"]["volumes"] = json!([{"name": "c", "configMap": {"name": "unreferenced"}}]);
    s.apply("pods", pod);
    s.apply(
        "configmaps",
        json!({"metadata": {"name": "unreferenced", "namespace": "vehicle"}, "data": {"k": "v"}}),
    );
    let get = || async {
        s.raw(
            Some(NODE_TOKEN),
            "GET",
            "/api/v1/namespaces/vehicle/configmaps/unreferenced",
            None,
            None,
        )
        .await
        .unwrap()
    };
    let (code, got) = get().await;
    assert_eq!(code, 403, "{got}");
    assert_eq!(got["message"], want["body"]["message"]);
    tokio::time::sleep(Duration::from_millis(900)).await;
    assert_eq!(get().await.0, 200);
    // The kubelet's watch-based manager lists and watches one object by name; the authorizer
    // treats that as a read of the object.
    let (code, got) = s
        .raw(
            Some(NODE_TOKEN),
            "GET",
            "/api/v1/namespaces/vehicle/configmaps?fieldSelector=metadata.name%3Dunreferenced",
            None,
            None,
        )
        .await
        .unwrap();
    assert_eq!(code, 200, "{got}");
    assert_eq!(got["items"].as_array().unwrap().len(), 1);
    let (code, _) = s
        .raw(
            Some(NODE_TOKEN),
            "GET",
            "/api/v1/namespaces/vehicle/configmaps?fieldSelector=metadata.name%3Dother",
            None,
            None,
        )
        .await
        .unwrap();
    assert_eq!(code, 403);
    let verbs = s.count_by_verb();
    assert_eq!(verbs[&("get".to_string(), "configmaps".to_string())], 3);
    assert_eq!(verbs[&("list".to_string(), "configmaps".to_string())], 2);
}

#[tokio::test]
async fn reads_answer_as_recorded() {
    let s = server().await;
    for name in [
        "pods_list_node",
        "pods_list_node_page1",
        "pods_list_node_page2",
        "daemonsets_list_as_node",
        "controllerrevisions_list_rev1",
        "node_get_self",
        "configmap_get_as_node",
        "pod_get_not_found",
        "unauthorized_bad_token",
        "secrets_list_forbidden_as_node",
    ] {
        let (code, got, want) = replay(&s, name, None).await;
        assert_same(name, code, &got, &want);
    }
    // The continue token has the apiserver's form and points at the same next key.
    let (_, got, want) = replay(&s, "pods_list_node_page1", None).await;
    let decode = |v: &Value| -> Value {
        let t = v["metadata"]["continue"].as_str().unwrap();
        serde_json::from_slice(
            &base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(t)
                .unwrap(),
        )
        .unwrap()
    };
    assert_eq!(decode(&got)["start"], decode(&want["body"])["start"]);
    assert_eq!(decode(&got)["v"], decode(&want["body"])["v"]);

    // A list at an exact version that has been compacted away.
    s.compact();
    let (code, got, want) = replay(&s, "pods_list_rv_too_old", None).await;
    assert_same("pods_list_rv_too_old", code, &got, &want);
}

#[tokio::test]
async fn node_restriction_answers_as_recorded() {
    let s = server().await;
    // The token fixtures were recorded for a later pod of the telemetry DaemonSet.
    let mut pod = s.get("pods", "vehicle", "telemetry-sv74m").unwrap();
    pod["metadata"]["name"] = json!("telemetry-h6wk8");
    pod["metadata"]["uid"] = json!("d2f01829-8e23-477d-9f45-44f9bbdee829");
    s.apply("pods", pod);
    for name in [
        "pod_label_patch_forbidden_as_node",
        "pod_spec_patch_forbidden_as_node",
        "pod_spec_patch_env_invalid",
        "node_create_forbidden_label",
        "node_create_other_forbidden",
        "serviceaccount_token_unbound_forbidden",
        "serviceaccount_token_wrong_audience_forbidden",
        "serviceaccount_token_for_pod_as_node",
    ] {
        let (code, got, want) = replay(&s, name, None).await;
        assert_same(name, code, &got, &want);
    }
    // Without deploy/rbac.yaml a node may not read DaemonSets.
    s.set_rbac_edgehub(false);
    let (code, got) = s
        .raw(
            Some(NODE_TOKEN),
            "GET",
            "/apis/apps/v1/daemonsets",
            None,
            None,
        )
        .await
        .unwrap();
    assert_eq!(code, 403);
    assert_eq!(
        got["message"],
        "daemonsets.apps is forbidden: User \"system:node:edge-1\" cannot list resource \"daemonsets\" in API group \"apps\" at the cluster scope"
    );
}

#[tokio::test]
async fn writes_answer_as_recorded() {
    let s = server().await;
    // Status patches: merge replaces the conditions list, strategic merge merges it by type.
    let (code, got, want) = replay(&s, "pod_status_patch_merge", None).await;
    assert_same("pod_status_patch_merge", code, &got, &want);
    let types = |v: &Value| -> Vec<String> {
        v["status"]["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["type"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(types(&got), types(&want["body"]));
    let (code, got, want) = replay(&s, "pod_status_patch_strategic", None).await;
    assert_same("pod_status_patch_strategic", code, &got, &want);
    assert_eq!(types(&got), types(&want["body"]));

    let (code, got, want) = replay(&s, "node_status_patch", None).await;
    assert_same("node_status_patch", code, &got, &want);
    assert_eq!(types(&got), types(&want["body"]));

    for name in ["event_create_as_node", "daemonset_patch_image"] {
        let (code, got, want) = replay(&s, name, None).await;
        assert_same(name, code, &got, &want);
    }

    // Lease: create, renew with the current resourceVersion, renew again with a stale one.
    let (code, created, want) = replay(&s, "lease_create", None).await;
    assert_same("lease_create", code, &created, &want);
    let mut renew = fixture("lease_renew_put")["request"]["body"].clone();
    renew["metadata"]["resourceVersion"] = created["metadata"]["resourceVersion"].clone();
    renew["metadata"]["uid"] = created["metadata"]["uid"].clone();
    let (code, got, want) = replay(&s, "lease_renew_put", Some(renew.clone())).await;
    assert_same("lease_renew_put", code, &got, &want);
    let (code, got, want) = replay(&s, "lease_renew_conflict", Some(renew)).await;
    assert_same("lease_renew_conflict", code, &got, &want);

    // Delete with a uid precondition: 409 on mismatch, 200 with the object otherwise.
    for name in ["pod_delete_wrong_uid_conflict", "pod_delete_as_node"] {
        let (code, got, want) = replay(&s, name, None).await;
        assert_same(name, code, &got, &want);
    }
    assert!(s.get("pods", "vehicle", "telemetry-sv74m").is_none());
}

fn event_types(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| e["type"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test]
async fn watches_stream_as_recorded() {
    let s = server().await;
    // Long enough for both patches to land first, even under qemu.
    s.set_bookmark_interval(Duration::from_millis(1500));

    // Streaming list: ADDED per object, then a BOOKMARK marking the end of initial events.
    let f = fixture("pods_watchlist_initial_events");
    let want = f["response"]["events"].as_array().unwrap().clone();
    let (code, got) = s
        .raw_watch(
            Some(NODE_TOKEN),
            f["request"]["path"].as_str().unwrap(),
            want.len(),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    assert_eq!(code, 200);
    assert_eq!(event_types(&got), event_types(&want));
    let last = got.last().unwrap();
    assert_eq!(keys(&last["object"]), keys(&want.last().unwrap()["object"]));
    assert_eq!(
        last["object"]["metadata"]["annotations"]["k8s.io/initial-events-end"],
        "true"
    );

    // Watch from the list's version: two status patches give two MODIFIED, then a BOOKMARK.
    let f = fixture("pods_watch_with_bookmark");
    let want = f["response"]["events"].as_array().unwrap().clone();
    let path = f["request"]["path"].as_str().unwrap().to_string();
    let watcher = {
        let path = path.clone();
        let s2 = &s;
        async move {
            s2.raw_watch(Some(NODE_TOKEN), &path, 3, Duration::from_secs(5))
                .await
        }
    };
    let patcher = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        for (i, phase) in ["Running", "Running"].iter().enumerate() {
            let body = json!({"status": {"phase": phase, "conditions": [{"type": "Ready", "status": if i == 0 {"False"} else {"True"}}]}});
            let (code, _) = s
                .raw(
                    Some(NODE_TOKEN),
                    "PATCH",
                    "/api/v1/namespaces/vehicle/pods/telemetry-sv74m/status",
                    Some("application/strategic-merge-patch+json"),
                    Some(&body),
                )
                .await
                .unwrap();
            assert_eq!(code, 200);
        }
    };
    let ((code, got), ()) = tokio::join!(async { watcher.await.unwrap() }, patcher);
    assert_eq!(code, 200);
    assert_eq!(event_types(&got), event_types(&want));
    assert_eq!(
        keys(&got[2]["object"]),
        keys(&want[2]["object"]),
        "bookmark object shape"
    );
    assert_eq!(
        keys(&got[0]["object"]),
        keys(&want[0]["object"]),
        "event object shape"
    );

    // A new ControllerRevision arrives as ADDED.
    let f = fixture("controllerrevisions_watch");
    let want = f["response"]["events"].as_array().unwrap().clone();
    let rv = s.resource_version();
    let path = format!(
        "/apis/apps/v1/controllerrevisions?watch=1&resourceVersion={rv}&allowWatchBookmarks=true"
    );
    let (got, _) = tokio::join!(
        async {
            s.raw_watch(Some(NODE_TOKEN), &path, 1, Duration::from_secs(5))
                .await
                .unwrap()
                .1
        },
        async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let mut obj = want[0]["object"].clone();
            obj["metadata"]
                .as_object_mut()
                .unwrap()
                .remove("resourceVersion");
            s.apply("controllerrevisions", obj);
        }
    );
    assert_eq!(event_types(&got), event_types(&want));
    assert_eq!(
        got[0]["object"]["metadata"]["name"],
        want[0]["object"]["metadata"]["name"]
    );
    assert_eq!(keys(&got[0]["object"]), keys(&want[0]["object"]));

    // A watch from a compacted version ends with one ERROR event carrying a 410 Status.
    s.compact();
    let (code, got) = s
        .raw_watch(Some(NODE_TOKEN), "/api/v1/pods?fieldSelector=spec.nodeName%3Dedge-1&watch=1&resourceVersion=1&allowWatchBookmarks=true", 5, Duration::from_secs(3))
        .await
        .unwrap();
    assert_eq!(code, 200);
    assert_eq!(event_types(&got), ["ERROR"]);
    let st = &got[0]["object"];
    assert_eq!(
        (
            st["kind"].as_str(),
            st["reason"].as_str(),
            st["code"].as_u64()
        ),
        (Some("Status"), Some("Expired"), Some(410))
    );
    assert!(st["message"]
        .as_str()
        .unwrap()
        .starts_with("too old resource version: 1"));
}

/// The reviews a kubelet's server asks for, and a kubelet-serving CSR, as the node: the
/// fake answers as the recording did (TokenReview from its token table, SubjectAccessReview
/// from its RBAC, the serving CSR left pending, NodeRestriction for another node's name).
#[tokio::test]
async fn kubelet_api_reviews_and_serving_csrs_answer_as_recorded() {
    let s = server().await;
    s.add_token("jane-token", "jane");
    // The recorded TokenReview carried the admin token, redacted in the file.
    let mut body = fixture("tokenreview_valid_as_node")["request"]["body"].clone();
    body["spec"]["token"] = json!(ADMIN_TOKEN);
    let (code, got, want) = replay(&s, "tokenreview_valid_as_node", Some(body)).await;
    assert_same("tokenreview_valid_as_node", code, &got, &want);
    assert_eq!(got["status"], want["body"]["status"]);
    let (code, got, want) = replay(&s, "tokenreview_bogus_as_node", None).await;
    assert_same("tokenreview_bogus_as_node", code, &got, &want);
    assert_eq!(got["status"], want["body"]["status"]);
    assert_eq!(got["spec"], want["body"]["spec"]);
    for name in [
        "sar_admin_nodes_proxy_allowed_as_node",
        "sar_user_nodes_proxy_denied_as_node",
        "sar_node_nodes_log_denied_as_node",
    ] {
        let (code, got, want) = replay(&s, name, None).await;
        assert_same(name, code, &got, &want);
        assert_eq!(got["status"], want["body"]["status"], "{name}");
        assert_eq!(got["spec"], want["body"]["spec"], "{name}");
    }
    let (code, got, want) = replay(&s, "csr_serving_create_as_node", None).await;
    // A generated name: the same prefix, not the same name.
    assert_eq!(code, 201, "{got}");
    assert_eq!(keys(&got), keys(&want["body"]));
    assert_eq!(
        got["metadata"]["generateName"],
        want["body"]["metadata"]["generateName"]
    );
    assert!(got["metadata"]["name"]
        .as_str()
        .unwrap()
        .starts_with("csr-"));
    assert_eq!(keys(&got["spec"]), keys(&want["body"]["spec"]));
    for f in ["signerName", "usages", "username", "uid", "groups"] {
        assert_eq!(got["spec"][f], want["body"]["spec"][f], "spec.{f}");
    }
    // Read back later: still pending.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let name = got["metadata"]["name"].as_str().unwrap();
    let (code, got) = s
        .raw(
            Some(NODE_TOKEN),
            "GET",
            &format!("/apis/certificates.k8s.io/v1/certificatesigningrequests/{name}"),
            None,
            None,
        )
        .await
        .unwrap();
    let want = fixture("csr_serving_pending_as_node")["response"].clone();
    assert_eq!(code, 200);
    assert_eq!(keys(&got), keys(&want["body"]));
    assert_eq!(got["status"], want["body"]["status"]);
    let (code, got, want) = replay(&s, "csr_serving_for_other_node_forbidden", None).await;
    assert_same("csr_serving_for_other_node_forbidden", code, &got, &want);
    assert_eq!(got["message"], want["body"]["message"]);
}
