use super::*;
use crate::revision::Strategy;
use serde_json::Value;

const NOW: i64 = 1_800_000_000;

fn rev(hash: &str, number: i64) -> Revision {
    Revision {
        name: format!("gateway-{hash}"),
        hash: hash.into(),
        number,
        created: "2026-11-29T18:22:49Z".into(),
        template: Value::Null,
    }
}

fn revisions() -> Vec<Revision> {
    vec![rev("old1", 1), rev("new2", 2)]
}

fn ds(strategy: Option<Strategy>, max_unavailable: Option<&str>) -> DaemonSetView {
    DaemonSetView {
        facts: DaemonSetFacts {
            strategy,
            on_delete: true,
        },
        max_unavailable: max_unavailable.map(str::to_string),
        min_ready_seconds: 0,
        terminating: false,
    }
}

fn aru(max_unavailable: Option<&str>) -> DaemonSetView {
    ds(Some(Strategy::AdvancedRollingUpdate), max_unavailable)
}

/// A Ready pod on `node` at revision `hash`, Ready for an hour.
fn pod(node: &str, hash: &str) -> PodView {
    PodView {
        name: format!("gateway-{node}-{hash}"),
        uid: format!("uid-{node}-{hash}"),
        node: Some(node.into()),
        hash: Some(hash.into()),
        terminating: false,
        ready: true,
        ready_since: Some(NOW - 3600),
        need_upgrade: None,
    }
}

fn nodes(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("node-{i:02}")).collect()
}

struct Case {
    ds: DaemonSetView,
    revisions: Vec<Revision>,
    pods: Vec<PodView>,
    not_ready: Vec<String>,
    in_flight: InFlight,
}

impl Case {
    fn new(ds: DaemonSetView, pods: Vec<PodView>) -> Case {
        Case {
            ds,
            revisions: revisions(),
            pods,
            not_ready: Vec::new(),
            in_flight: InFlight::default(),
        }
    }

    fn decide(&self) -> Decision {
        let not_ready = self.not_ready.clone();
        let ready = move |n: &str| n.starts_with("node-") && !not_ready.iter().any(|x| x == n);
        decide(&Input {
            ds: &self.ds,
            revisions: &self.revisions,
            pods: &self.pods,
            node_ready: &ready,
            in_flight: &self.in_flight,
            now: NOW,
        })
    }

    fn rolling(&self) -> RollingPlan {
        match self.decide() {
            Decision::RollingUpdate(p) => p,
            other => panic!("expected a rolling plan, got {other:?}"),
        }
    }

    fn ota(&self) -> OtaPlan {
        match self.decide() {
            Decision::Ota(p) => p,
            other => panic!("expected an OTA plan, got {other:?}"),
        }
    }
}

fn deleted_nodes(plan: &RollingPlan) -> Vec<&str> {
    plan.deletes.iter().map(|d| d.node.as_str()).collect()
}

#[test]
fn budget_is_an_int_or_a_percentage_of_the_nodes_rounded_up() {
    for (value, nodes, want) in [
        (Some("30%"), 10, 3),
        (Some("30%"), 7, 3),
        (Some("10%"), 7, 1),
        (Some("25%"), 4, 1),
        (Some("25%"), 5, 2),
        (Some("1%"), 1000, 10),
        (Some("100%"), 3, 3),
        (Some("150%"), 2, 3),
        (Some("2"), 10, 2),
        (Some("2"), 1, 2),
        (Some(" 5 "), 10, 5),
        (Some("30%"), 0, 0),
    ] {
        assert_eq!(
            max_unavailable(value, nodes),
            Ok(want),
            "{value:?} of {nodes}"
        );
    }
}

#[test]
fn absent_zero_and_zero_percent_mean_ten_percent() {
    for value in [None, Some("0"), Some("0%"), Some("00")] {
        assert_eq!(max_unavailable(value, 10), Ok(1), "{value:?}");
        assert_eq!(max_unavailable(value, 25), Ok(3), "{value:?}");
        assert_eq!(max_unavailable(value, 1000), Ok(100), "{value:?}");
    }
}

#[test]
fn a_budget_that_is_neither_int_nor_percentage_is_refused() {
    for value in ["abc", "-1", "1.5", "%", "30%%", "", "3 0", "+3"] {
        assert!(max_unavailable(Some(value), 10).is_err(), "{value:?}");
    }
    let case = Case::new(aru(Some("lots")), vec![pod("node-00", "old1")]);
    assert!(matches!(
        case.decide(),
        Decision::Skip(Skip::InvalidMaxUnavailable(m)) if m.contains("lots")
    ));
}

#[test]
fn only_opted_in_on_delete_daemonsets_are_touched() {
    let pods = vec![pod("node-00", "old1")];
    let mut case = Case::new(ds(None, None), pods.clone());
    assert_eq!(case.decide(), Decision::Skip(Skip::NotOptedIn));
    // Annotated, but a RollingUpdate DaemonSet belongs to the DaemonSet controller.
    case.ds = aru(None);
    case.ds.facts.on_delete = false;
    assert_eq!(case.decide(), Decision::Skip(Skip::NotOptedIn));
    case.ds = aru(None);
    case.ds.terminating = true;
    assert_eq!(case.decide(), Decision::Skip(Skip::Terminating));
    case.ds = aru(None);
    case.revisions.clear();
    assert_eq!(case.decide(), Decision::Skip(Skip::NoRevision));
}

#[test]
fn the_annotation_is_read_case_insensitively() {
    let facts = |v: &str| {
        DaemonSetFacts::from_json(&serde_json::json!({
            "metadata": {"annotations": {"apps.openyurt.io/update-strategy": v}},
            "spec": {"updateStrategy": {"type": "OnDelete"}},
        }))
    };
    for (v, want) in [
        (
            "AdvancedRollingUpdate",
            Some(Strategy::AdvancedRollingUpdate),
        ),
        (
            "advancedrollingupdate",
            Some(Strategy::AdvancedRollingUpdate),
        ),
        ("ota", Some(Strategy::Ota)),
        ("OTA", Some(Strategy::Ota)),
        ("RollingUpdate", None),
    ] {
        let mut d = aru(None);
        d.facts = facts(v);
        assert_eq!(d.facts.strategy, want, "{v}");
        let case = Case::new(d, vec![pod("node-00", "old1")]);
        match want {
            Some(Strategy::AdvancedRollingUpdate) => {
                assert_eq!(case.rolling().deletes.len(), 1)
            }
            Some(Strategy::Ota) => assert_eq!(case.ota().writes.len(), 1),
            None => assert_eq!(case.decide(), Decision::Skip(Skip::NotOptedIn)),
        }
    }
}

#[test]
fn the_update_revision_is_the_highest_revision_never_the_newest_name_or_time() {
    let mut case = Case::new(aru(Some("100%")), vec![pod("node-00", "new2")]);
    // The revision with the highest number wins even when created earlier and listed first.
    case.revisions = vec![
        Revision {
            created: "2020-01-01T00:00:00Z".into(),
            ..rev("zzz3", 3)
        },
        rev("new2", 2),
        rev("old1", 1),
    ];
    let plan = case.rolling();
    assert_eq!(plan.target, "zzz3");
    assert_eq!(deleted_nodes(&plan), ["node-00"]);
}

#[test]
fn ten_nodes_three_not_ready_thirty_percent_deletes_three_ready_old_pods() {
    let all = nodes(10);
    let mut case = Case::new(
        aru(Some("30%")),
        all.iter().map(|n| pod(n, "old1")).collect(),
    );
    case.not_ready = vec!["node-01".into(), "node-04".into(), "node-07".into()];
    let plan = case.rolling();
    assert_eq!(plan.target, "new2");
    assert_eq!(plan.nodes, 10);
    assert_eq!(plan.max_unavailable, 3);
    assert_eq!(plan.unavailable, 0);
    assert_eq!(deleted_nodes(&plan), ["node-00", "node-02", "node-03"]);
    assert!(plan.deletes.iter().all(|d| d.why == DeleteWhy::Budget));
    assert_eq!(plan.deletes[0].from.as_deref(), Some("old1"));
    assert_eq!(plan.deletes[0].uid, "uid-node-00-old1");
    assert_eq!(plan.not_ready_nodes, 3);
    assert_eq!(plan.old_on_not_ready, 3);
    assert_eq!(plan.old_waiting, 4);
}

#[test]
fn not_ready_nodes_are_neither_counted_nor_touched() {
    // Three NotReady nodes whose pods are down: they would use up the whole budget of 3 if
    // they counted as unavailable, and would be "free" deletions if they were touched.
    let all = nodes(10);
    let mut pods: Vec<PodView> = all.iter().map(|n| pod(n, "old1")).collect();
    for p in pods.iter_mut().take(3) {
        p.ready = false;
    }
    let mut case = Case::new(aru(Some("30%")), pods);
    case.not_ready = all[..3].to_vec();
    let plan = case.rolling();
    assert_eq!(plan.unavailable, 0);
    assert_eq!(deleted_nodes(&plan), ["node-03", "node-04", "node-05"]);
    // A node the controller has never seen is NotReady too.
    let case = Case::new(aru(Some("100%")), vec![pod("gone-node", "old1")]);
    let plan = case.rolling();
    assert!(plan.deletes.is_empty());
    assert_eq!(plan.not_ready_nodes, 1);
}

#[test]
fn an_unavailable_old_pod_is_deleted_without_spending_budget() {
    let all = nodes(10);
    let mut pods: Vec<PodView> = all.iter().map(|n| pod(n, "old1")).collect();
    pods[9].ready = false;
    pods[8].ready = false;
    let case = Case::new(aru(Some("1")), pods);
    let plan = case.rolling();
    assert_eq!(plan.max_unavailable, 1);
    let why: Vec<(&str, DeleteWhy)> = plan
        .deletes
        .iter()
        .map(|d| (d.node.as_str(), d.why))
        .collect();
    assert_eq!(
        why,
        [
            ("node-08", DeleteWhy::Unavailable),
            ("node-09", DeleteWhy::Unavailable),
            ("node-00", DeleteWhy::Budget),
        ]
    );
}

#[test]
fn an_exhausted_budget_still_replaces_unavailable_old_pods() {
    let all = nodes(10);
    let mut pods: Vec<PodView> = all.iter().map(|n| pod(n, "old1")).collect();
    // node-00: a new pod that is not Ready yet; node-01: its old pod is terminating.
    pods[0] = PodView {
        ready: false,
        ..pod("node-00", "new2")
    };
    pods[1].terminating = true;
    pods[2].ready = false;
    let case = Case::new(aru(Some("2")), pods);
    let plan = case.rolling();
    assert_eq!(plan.unavailable, 2);
    assert_eq!(deleted_nodes(&plan), ["node-02"]);
    assert_eq!(plan.deletes[0].why, DeleteWhy::Unavailable);
    assert_eq!(plan.old_waiting, 7);
}

#[test]
fn updated_nodes_do_not_count_and_the_rest_of_the_budget_is_spent() {
    let all = nodes(10);
    let mut pods: Vec<PodView> = all.iter().map(|n| pod(n, "new2")).collect();
    pods[5] = pod("node-05", "old1");
    pods[6] = pod("node-06", "old1");
    pods[7] = PodView {
        ready: false,
        ..pod("node-07", "new2")
    };
    let case = Case::new(aru(Some("30%")), pods);
    let plan = case.rolling();
    assert_eq!(plan.updated, 7);
    assert_eq!(plan.unavailable, 1);
    assert_eq!(deleted_nodes(&plan), ["node-05", "node-06"]);
}

#[test]
fn min_ready_seconds_decides_availability_and_when_to_look_again() {
    let mut pods = vec![
        pod("node-00", "new2"),
        pod("node-01", "old1"),
        pod("node-02", "old1"),
        pod("node-03", "old1"),
    ];
    // Ready for 2 s of the 5 needed: not available yet, available in 4 s (strictly after).
    pods[0].ready_since = Some(NOW - 2);
    pods[1].ready_since = Some(NOW - 2);
    // Ready without a transition time: not available when minReadySeconds > 0.
    pods[2].ready_since = None;
    let mut d = aru(Some("1"));
    d.min_ready_seconds = 5;
    let case = Case::new(d, pods.clone());
    let plan = case.rolling();
    assert_eq!(plan.unavailable, 1);
    assert_eq!(plan.recheck_after, Some(4));
    // The old pods that are not available yet are replaced for free; node-03's is available
    // but the budget is spent by node-00.
    assert_eq!(deleted_nodes(&plan), ["node-01", "node-02"]);
    assert!(plan.deletes.iter().all(|d| d.why == DeleteWhy::Unavailable));
    // Without minReadySeconds, Ready is available.
    let case = Case::new(aru(Some("1")), pods);
    let plan = case.rolling();
    assert_eq!(plan.recheck_after, None);
    assert_eq!(plan.updated, 1);
    assert_eq!(deleted_nodes(&plan), ["node-01"]);
}

#[test]
fn unobserved_deletions_hold_back_the_next_wave() {
    let all = nodes(10);
    let mut case = Case::new(
        aru(Some("30%")),
        all.iter().map(|n| pod(n, "old1")).collect(),
    );
    case.in_flight.unobserved_deletes = 3;
    let plan = case.rolling();
    assert!(plan.deletes.is_empty());
    assert!(plan.held_for_expectations);
    assert_eq!(plan.old_waiting, 10);
}

#[test]
fn a_node_awaiting_its_replacement_counts_as_unavailable() {
    // node-00 and node-01: their old pods are gone and the DaemonSet controller has not
    // created the replacements yet. They are in the base and use budget.
    let all = nodes(10);
    let mut case = Case::new(
        aru(Some("30%")),
        all[2..].iter().map(|n| pod(n, "old1")).collect(),
    );
    case.in_flight.awaiting_replacement = ["node-00".to_string(), "node-01".to_string()].into();
    let plan = case.rolling();
    assert_eq!(plan.nodes, 10);
    assert_eq!(plan.unavailable, 2);
    assert_eq!(deleted_nodes(&plan), ["node-02"]);
    // Awaiting on a NotReady node: skipped like the rest of the node.
    case.not_ready = vec!["node-00".into()];
    assert_eq!(deleted_nodes(&case.rolling()), ["node-02", "node-03"]);
}

#[test]
fn both_revisions_or_duplicates_on_a_node_count_as_unavailable() {
    let pods = vec![
        pod("node-00", "old1"),
        pod("node-00", "new2"),
        pod("node-01", "old1"),
        PodView {
            name: "dup".into(),
            uid: "dup".into(),
            ..pod("node-01", "old1")
        },
        pod("node-02", "old1"),
        pod("node-03", "old1"),
    ];
    let case = Case::new(aru(Some("3")), pods);
    let plan = case.rolling();
    assert_eq!(plan.unavailable, 2);
    assert_eq!(deleted_nodes(&plan), ["node-02"]);
}

#[test]
fn pods_without_a_node_or_a_hash() {
    let mut unbound = pod("x", "old1");
    unbound.node = None;
    let mut no_hash = pod("node-01", "old1");
    no_hash.hash = None;
    let case = Case::new(aru(Some("100%")), vec![unbound, no_hash]);
    let plan = case.rolling();
    // The unbound pod is not counted; the pod without a hash is not at the update revision.
    assert_eq!(plan.nodes, 1);
    assert_eq!(deleted_nodes(&plan), ["node-01"]);
    assert_eq!(plan.deletes[0].from, None);
}

#[test]
fn advanced_rolling_update_writes_no_conditions_and_ota_deletes_nothing() {
    let pods = vec![pod("node-00", "old1")];
    let case = Case::new(aru(None), pods.clone());
    assert!(matches!(case.decide(), Decision::RollingUpdate(_)));
    let case = Case::new(ds(Some(Strategy::Ota), None), pods);
    let plan = case.ota();
    assert_eq!(plan.need_upgrade, 1);
}

fn cond(status: &str, reason: &str, message: &str) -> Option<ConditionView> {
    Some(ConditionView {
        status: status.into(),
        reason: Some(reason.into()),
        message: Some(message.into()),
    })
}

#[test]
fn ota_conditions_are_written_only_when_they_change() {
    let mut pods = vec![
        pod("node-00", "old1"),
        pod("node-01", "new2"),
        pod("node-02", "old1"),
        pod("node-03", "new2"),
        pod("node-04", "old1"),
        pod("node-05", "old1"),
    ];
    // node-02 already says True for new2: nothing to write.
    pods[2].need_upgrade = cond("True", "NewRevisionAvailable", "controllerrevision: new2");
    // node-03 was upgraded: True -> False.
    pods[3].need_upgrade = cond("True", "NewRevisionAvailable", "controllerrevision: new2");
    // node-04 said True for an older target: same status, new message.
    pods[4].need_upgrade = cond("True", "NewRevisionAvailable", "controllerrevision: old0");
    // node-05 is being deleted: left alone.
    pods[5].terminating = true;
    let case = Case::new(ds(Some(Strategy::Ota), None), pods);
    let plan = case.ota();
    assert_eq!(plan.target, "new2");
    assert_eq!(plan.pods, 5);
    assert_eq!(plan.need_upgrade, 3);
    let writes: Vec<(&str, &str, bool)> = plan
        .writes
        .iter()
        .map(|w| (w.pod.as_str(), w.condition.status, w.status_changed))
        .collect();
    assert_eq!(
        writes,
        [
            ("gateway-node-00-old1", "True", true),
            ("gateway-node-01-new2", "False", true),
            ("gateway-node-03-new2", "False", true),
            ("gateway-node-04-old1", "True", false),
        ]
    );
    for w in &plan.writes {
        assert_eq!(w.condition.kind, "PodNeedUpgrade");
        assert_eq!(
            w.condition.message.as_deref(),
            Some("controllerrevision: new2")
        );
    }
    assert_eq!(plan.writes[0].condition.reason, "NewRevisionAvailable");
    assert_eq!(plan.writes[1].condition.reason, "RunningLatestRevision");
}

#[test]
fn ota_condition_of_a_pod_without_a_hash_is_false_and_names_the_target() {
    let mut p = pod("node-00", "old1");
    p.hash = None;
    let case = Case::new(ds(Some(Strategy::Ota), None), vec![p]);
    let plan = case.ota();
    assert_eq!(plan.writes.len(), 1);
    let c = &plan.writes[0].condition;
    assert_eq!((c.status, c.reason), ("False", "PodHasNoRevisionHash"));
    assert_eq!(c.message.as_deref(), Some("controllerrevision: new2"));
}

/// The whole rollout, decided again and again over a simulated cluster in which the
/// DaemonSet controller replaces a deleted pod at once with a Ready pod of the update revision.
/// Returns the nodes of each wave.
fn simulate(case: &mut Case, rounds: usize) -> Vec<Vec<String>> {
    let mut waves = Vec::new();
    for _ in 0..rounds {
        let plan = case.rolling();
        if plan.deletes.is_empty() {
            break;
        }
        let wave: Vec<String> = plan.deletes.iter().map(|d| d.node.clone()).collect();
        for d in &plan.deletes {
            case.pods.retain(|p| p.uid != d.uid);
            case.pods.push(pod(&d.node, &plan.target));
        }
        waves.push(wave);
    }
    waves
}

#[test]
fn a_rollout_goes_in_budget_sized_waves_and_not_ready_nodes_catch_up() {
    let all = nodes(10);
    let mut case = Case::new(
        aru(Some("30%")),
        all.iter().map(|n| pod(n, "old1")).collect(),
    );
    case.not_ready = vec!["node-01".into(), "node-04".into(), "node-07".into()];
    let waves = simulate(&mut case, 20);
    let sizes: Vec<usize> = waves.iter().map(Vec::len).collect();
    assert_eq!(sizes, [3, 3, 1]);
    let plan = case.rolling();
    assert_eq!((plan.updated, plan.old_on_not_ready), (7, 3));
    // The three NotReady nodes turn Ready: they are caught up in one wave of the budget.
    case.not_ready.clear();
    let waves = simulate(&mut case, 20);
    assert_eq!(waves, [vec!["node-01", "node-04", "node-07"]]);
    assert_eq!(case.rolling().updated, 10);
}

#[test]
fn a_thousand_nodes_at_the_default_budget_take_ten_waves() {
    let all = nodes(1000);
    let mut case = Case::new(aru(None), all.iter().map(|n| pod(n, "old1")).collect());
    let waves = simulate(&mut case, 100);
    assert_eq!(waves.len(), 10);
    assert!(waves.iter().all(|w| w.len() == 100));
}
