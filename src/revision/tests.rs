use super::*;
use serde_json::json;

fn fixture(name: &str) -> Value {
    let path = format!(
        "{}/tests/fixtures/apiserver/{name}.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    v["response"]["body"].clone()
}

fn item(list: &Value, name: &str) -> Value {
    list["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["metadata"]["name"] == name)
        .unwrap()
        .clone()
}

fn revisions_of(list: &Value, ds: &Value) -> Vec<Revision> {
    let uid = &ds["metadata"]["uid"];
    list["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["metadata"]["ownerReferences"][0]["uid"] == *uid)
        .map(|r| Revision::from_json(r).unwrap())
        .collect()
}

/// The decision from whole objects, as the tests hold them.
fn decide(pod: &Value, ds: Option<&Value>, revs: &[Revision]) -> Need {
    let ds = ds.map(DaemonSetFacts::from_json);
    need_upgrade(&PodFacts::from_json(pod), ds.as_ref(), revs)
}

fn rev(name: &str, hash: &str, number: i64, created: &str) -> Revision {
    Revision {
        name: name.into(),
        hash: hash.into(),
        number,
        created: created.into(),
        template: json!({"spec": {}}),
    }
}

#[test]
fn update_revision_is_the_highest_number() {
    let dss = fixture("daemonsets_list_as_node");
    let ds = item(&dss, "telemetry");
    let revs = revisions_of(&fixture("controllerrevisions_list_rev2"), &ds);
    assert_eq!(revs.len(), 2);
    let u = update_revision(&revs).unwrap();
    assert_eq!((u.hash.as_str(), u.number), ("55778fbb9f", 2));
    assert!(u.template.get("$patch").is_none(), "$patch is stripped");
    assert_eq!(
        u.template["spec"]["containers"][0]["image"],
        "127.0.0.1:5000/busybox:2.0"
    );
}

#[test]
fn update_revision_of_nothing_is_none() {
    assert_eq!(update_revision(&[]), None);
}

#[test]
fn equal_revision_numbers_are_ordered_by_time_then_name() {
    let a = rev("ds-a", "aaa", 3, "2026-11-29T18:00:00Z");
    let b = rev("ds-b", "bbb", 3, "2026-11-29T18:00:01Z");
    let c = rev("ds-c", "ccc", 2, "2026-11-29T19:00:00Z");
    assert_eq!(
        update_revision(&[a.clone(), b.clone(), c.clone()])
            .unwrap()
            .hash,
        "bbb"
    );
    assert_eq!(
        update_revision(&[b.clone(), a.clone(), c.clone()])
            .unwrap()
            .hash,
        "bbb"
    );
    let a2 = rev("ds-z", "zzz", 3, "2026-11-29T18:00:01Z");
    assert_eq!(update_revision(&[b, a2]).unwrap().hash, "zzz");
}

#[test]
fn unreadable_revisions_are_errors() {
    let good = item(
        &fixture("controllerrevisions_list_rev1"),
        "telemetry-768bcc7446",
    );
    let mut no_hash = good.clone();
    no_hash["metadata"]["labels"]
        .as_object_mut()
        .unwrap()
        .remove(REVISION_HASH_LABEL);
    assert!(matches!(
        Revision::from_json(&no_hash),
        Err(RevisionError::NoHash(_))
    ));
    let mut no_num = good.clone();
    no_num.as_object_mut().unwrap().remove("revision");
    assert!(matches!(
        Revision::from_json(&no_num),
        Err(RevisionError::NoNumber(_))
    ));
    let mut bad_data = good.clone();
    bad_data["data"] = json!("garbage");
    assert!(matches!(
        Revision::from_json(&bad_data),
        Err(RevisionError::NoTemplate(_))
    ));
    assert!(matches!(
        Revision::from_raw("{nope"),
        Err(RevisionError::Json(_))
    ));
    assert!(Revision::from_json(&good).is_ok());
}

fn telemetry() -> (Value, Value, Vec<Revision>) {
    let pods = fixture("pods_list_node");
    let ds = item(&fixture("daemonsets_list_as_node"), "telemetry");
    let revs = revisions_of(&fixture("controllerrevisions_list_rev2"), &ds);
    (item(&pods, "telemetry-sv74m"), ds, revs)
}

#[test]
fn ota_pod_on_an_old_revision_needs_an_upgrade() {
    let (pod, ds, revs) = telemetry();
    let n = decide(&pod, Some(&ds), &revs);
    assert_eq!(
        n,
        Need::Upgrade {
            target: "55778fbb9f".into()
        }
    );
    assert_eq!(
        serde_json::to_string(&n.condition()).unwrap(),
        r#"{"type":"PodNeedUpgrade","status":"True","reason":"NewRevisionAvailable","message":"controllerrevision: 55778fbb9f"}"#
    );
}

#[test]
fn latest_pod_does_not() {
    let (mut pod, ds, revs) = telemetry();
    pod["metadata"]["labels"][REVISION_HASH_LABEL] = json!("55778fbb9f");
    let n = decide(&pod, Some(&ds), &revs);
    assert_eq!(
        n,
        Need::Latest {
            target: "55778fbb9f".into()
        }
    );
    assert_eq!(n.condition().status, "False");
    assert_eq!(
        n.condition().message.as_deref(),
        Some("controllerrevision: 55778fbb9f")
    );
}

#[test]
fn strategy_annotation_is_case_insensitive_and_needs_on_delete() {
    let (pod, mut ds, revs) = telemetry();
    for v in [
        "ota",
        "OTA",
        "Ota",
        "advancedRollingUpdate",
        "AdvancedRollingUpdate",
    ] {
        ds["metadata"]["annotations"][UPDATE_STRATEGY_ANNOTATION] = json!(v);
        assert!(decide(&pod, Some(&ds), &revs).needed(), "{v}");
    }
    for v in ["auto", "", "OTA2"] {
        ds["metadata"]["annotations"][UPDATE_STRATEGY_ANNOTATION] = json!(v);
        assert_eq!(
            decide(&pod, Some(&ds), &revs),
            Need::NotOtaStrategy {
                target: Some("55778fbb9f".into())
            },
            "{v}"
        );
    }
    ds["metadata"]["annotations"][UPDATE_STRATEGY_ANNOTATION] = json!("OTA");
    ds["spec"]["updateStrategy"] = json!({"type": "RollingUpdate"});
    assert!(matches!(
        decide(&pod, Some(&ds), &revs),
        Need::NotOtaStrategy { .. }
    ));
    ds["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("annotations");
    assert!(matches!(
        decide(&pod, Some(&ds), &revs),
        Need::NotOtaStrategy { .. }
    ));
}

#[test]
fn unusual_pods_get_a_defined_answer() {
    let (pod, ds, revs) = telemetry();
    let mut no_label = pod.clone();
    no_label["metadata"]["labels"]
        .as_object_mut()
        .unwrap()
        .remove(REVISION_HASH_LABEL);
    assert_eq!(
        decide(&no_label, Some(&ds), &revs),
        Need::NoPodHash {
            target: "55778fbb9f".into()
        }
    );
    assert_eq!(decide(&pod, Some(&ds), &[]), Need::NoRevision);
    assert_eq!(decide(&pod, None, &revs), Need::UnknownDaemonSet);

    let mut rs_pod = pod.clone();
    rs_pod["metadata"]["ownerReferences"][0]["kind"] = json!("ReplicaSet");
    assert_eq!(
        decide(&rs_pod, Some(&ds), &revs),
        Need::NotDaemonSetPod {
            owner_kind: Some("ReplicaSet".into())
        }
    );
    let mut bare = pod.clone();
    bare["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("ownerReferences");
    assert_eq!(
        decide(&bare, Some(&ds), &revs),
        Need::NotDaemonSetPod { owner_kind: None }
    );

    let mut deleting = pod.clone();
    deleting["metadata"]["deletionTimestamp"] = json!("2026-11-29T19:00:00Z");
    assert_eq!(decide(&deleting, Some(&ds), &revs), Need::Terminating);

    for weird in [json!(null), json!([]), json!({"metadata": 5}), json!({})] {
        assert!(!decide(&weird, Some(&ds), &revs).needed());
    }
    for n in [Need::NoRevision, Need::UnknownDaemonSet, Need::Terminating] {
        assert!(n.condition().message.is_none());
        assert_eq!(n.condition().status, "False");
    }
}

#[test]
fn image_only_change_is_in_place() {
    let (_, _, revs) = telemetry();
    let old = revs.iter().find(|r| r.number == 1).unwrap();
    let new = update_revision(&revs).unwrap();
    match plan(&old.template, &new.template) {
        Plan::InPlace(changes) => {
            assert_eq!(changes.len(), 1);
            assert_eq!(changes[0].container, "app");
            assert_eq!(changes[0].from, "127.0.0.1:5000/busybox:1.0");
            assert_eq!(changes[0].to, "127.0.0.1:5000/busybox:2.0");
            assert!(!changes[0].init);
        }
        other => panic!("expected in place, got {other:?}"),
    }
}

#[test]
fn other_changes_force_a_recreate() {
    let (_, _, revs) = telemetry();
    let old = &revs.iter().find(|r| r.number == 1).unwrap().template;
    let mut env = old.clone();
    env["spec"]["containers"][0]["env"][0]["value"] = json!("other");
    assert!(matches!(plan(old, &env), Plan::Recreate(r) if r[0].contains("containers[app]")));
    let mut hostnet = old.clone();
    hostnet["spec"]["hostNetwork"] = json!(false);
    assert!(matches!(plan(old, &hostnet), Plan::Recreate(r) if r == ["spec.hostNetwork changed"]));
    let mut added = old.clone();
    added["spec"]["containers"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "extra", "image": "x"}));
    assert!(matches!(plan(old, &added), Plan::Recreate(_)));
    let mut init = old.clone();
    init["spec"]["initContainers"] = json!([{"name": "i", "image": "a"}]);
    let mut init2 = init.clone();
    init2["spec"]["initContainers"][0]["image"] = json!("b");
    assert!(matches!(plan(&init, &init2), Plan::InPlace(c) if c[0].init));
    assert!(matches!(plan(&json!({}), old), Plan::Recreate(_)));
}

#[test]
fn metadata_only_change_is_identical_spec() {
    let (_, _, revs) = telemetry();
    let old = &revs.iter().find(|r| r.number == 1).unwrap().template;
    let mut meta = old.clone();
    meta["metadata"]["annotations"]["new"] = json!("x");
    assert_eq!(plan(old, &meta), Plan::Identical);
}
