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
        let mut wd = want["details"].clone();
        if let Some(m) = wd.as_object_mut() {
            m.remove("causes");
        }
        assert_eq!(got["details"], wd, "{name}: details");
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

#[tokio::test]
async fn the_vendored_fixtures_match_the_shared_ones() {
    // The repo carries a copy so it builds alone; where the project's shared fixtures sit beside
    // the checkout, they must be identical.
    let shared = fixtures_dir().join("../../../../shared/fixtures/apiserver");
    let Ok(entries) = std::fs::read_dir(&shared) else {
        eprintln!("shared fixtures not present beside the checkout; nothing to compare");
        return;
    };
    for e in entries {
        let e = e.unwrap();
        let ours = std::fs::read(fixtures_dir().join(e.file_name())).unwrap_or_default();
        assert_eq!(
            ours,
            std::fs::read(e.path()).unwrap(),
            "{:?} differs",
            e.file_name()
        );
    }
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
    s.set_bookmark_interval(Duration::from_millis(300));

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
