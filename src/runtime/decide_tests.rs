use super::*;
use crate::object::Kind;
use crate::pod::observe::Snapshot;
use crate::pod::probes::{ProbeAction, ProbeState};
use crate::podspec::{Missing, PodContext};
use crate::sources::Sources;
use crate::store::StoredObject;
use serde_json::json;

const NODE: &str = "n1";

fn pod_json(name: &str, containers: &[&str]) -> serde_json::Value {
    json!({
        "metadata": {"name": name, "namespace": "ns", "uid": format!("uid-{name}"), "resourceVersion": "1"},
        "spec": {"hostNetwork": true, "terminationGracePeriodSeconds": 7,
            "containers": containers.iter().map(|c| json!({"name": c, "image": "img:1"})).collect::<Vec<_>>()},
    })
}

fn desired(v: serde_json::Value, snap: &Snapshot) -> DesiredPod {
    let obj = StoredObject::from_raw(Kind::Pod, v.to_string()).unwrap();
    let ctx = PodContext {
        node_name: NODE.into(),
        host_ip: Some("10.0.0.1".into()),
        volume_dir: "/tmp/v".into(),
        log_dir: "/tmp/l".into(),
        attempt: snap.pod(&obj.index.uid).next_sandbox_attempt(),
        pod_ip: None,
        sources: Sources::default(),
    };
    let plan = crate::podspec::translate(&v, &ctx);
    DesiredPod {
        grace_secs: crate::pod::desired::grace_of(&v),
        plan: Some(plan),
        ctx: Some(ctx),
        status: serde_json::Value::Null,
        obj,
    }
}

fn sandbox(id: &str, uid: &str, ready: bool, attempt: u32) -> api::PodSandbox {
    api::PodSandbox {
        id: id.into(),
        metadata: Some(api::PodSandboxMetadata {
            attempt,
            ..Default::default()
        }),
        state: if ready {
            api::PodSandboxState::SandboxReady as i32
        } else {
            api::PodSandboxState::SandboxNotready as i32
        },
        labels: HashMap::from([(labels::POD_UID.to_string(), uid.to_string())]),
        annotations: HashMap::from([(labels::GRACE_PERIOD.to_string(), "9".to_string())]),
        ..Default::default()
    }
}

fn container(
    id: &str,
    sb: &str,
    uid: &str,
    name: &str,
    state: api::ContainerState,
    attempt: u32,
) -> api::Container {
    api::Container {
        id: id.into(),
        pod_sandbox_id: sb.into(),
        metadata: Some(api::ContainerMetadata {
            name: name.into(),
            attempt,
        }),
        state: state as i32,
        labels: HashMap::from([
            (labels::POD_UID.to_string(), uid.to_string()),
            (labels::CONTAINER_NAME.to_string(), name.to_string()),
        ]),
        ..Default::default()
    }
}

struct World {
    snap: Snapshot,
    desired: Vec<DesiredPod>,
    restarts: HashMap<(String, String), Restarts>,
    refused: HashMap<String, Restarts>,
    probes: HashMap<(String, String), ContainerProbes>,
    volumes: HashMap<String, u64>,
    held: HashSet<String>,
    ready: bool,
    now: Instant,
    awaiting: Vec<Awaiting>,
    ended: HashSet<String>,
}

impl World {
    fn new() -> World {
        World {
            snap: Snapshot::default(),
            desired: Vec::new(),
            restarts: HashMap::new(),
            refused: HashMap::new(),
            probes: HashMap::new(),
            volumes: HashMap::new(),
            held: HashSet::new(),
            ready: true,
            now: Instant::now(),
            awaiting: Vec::new(),
            ended: HashSet::new(),
        }
    }

    fn add(&mut self, v: serde_json::Value) {
        let d = desired(v, &self.snap);
        // Volumes already written, so a settled pod gets no RefreshVolumes.
        if let Some(Ok(p)) = &d.plan {
            self.volumes.insert(d.uid().to_string(), volumes_digest(p));
        }
        self.desired.push(d);
    }

    fn decide(&self) -> Vec<Action> {
        decide(&Inputs {
            desired: &self.desired,
            snapshot: &self.snap,
            memory: Memory {
                restarts: &self.restarts,
                refused: &self.refused,
                probes: &self.probes,
                volumes: &self.volumes,
            },
            held: &self.held,
            sources_ready: self.ready,
            policy: BackoffPolicy::CRASH_LOOP,
            now: self.now,
            awaiting: &self.awaiting,
            ended_upgrades: &self.ended,
        })
    }
}

fn names(actions: &[Action]) -> Vec<String> {
    actions
        .iter()
        .map(|a| {
            let kind = format!("{a:?}");
            let kind = kind.split([' ', '{', '(']).next().unwrap_or("").to_string();
            format!("{kind}:{}", a.uid())
        })
        .collect()
}

#[test]
fn a_pod_without_a_sandbox_is_started_and_its_old_sandboxes_go_first() {
    let mut w = World::new();
    w.snap.sandboxes.push(sandbox("old", "uid-a", false, 0));
    w.snap.containers.push(container(
        "c-old",
        "old",
        "uid-a",
        "app",
        api::ContainerState::ContainerExited,
        0,
    ));
    w.add(pod_json("a", &["app"]));
    let acts = w.decide();
    assert_eq!(names(&acts), ["StartPod:uid-a"]);
    let Action::StartPod {
        remove_sandboxes,
        remove_containers,
        spec,
        ..
    } = &acts[0]
    else {
        unreachable!()
    };
    assert_eq!(remove_sandboxes, &["old"]);
    assert_eq!(remove_containers, &["c-old"]);
    assert_eq!(spec.ctx.attempt, 1, "the next sandbox attempt");
}

#[test]
fn a_settled_pod_gets_nothing_and_a_held_pod_is_left_alone() {
    let mut w = World::new();
    w.snap.sandboxes.push(sandbox("sb", "uid-a", true, 0));
    w.snap.containers.push(container(
        "c1",
        "sb",
        "uid-a",
        "app",
        api::ContainerState::ContainerRunning,
        0,
    ));
    w.add(pod_json("a", &["app"]));
    assert!(w.decide().is_empty());
    // Held (an upgrade owns it): even a dead container is left to its owner.
    w.snap.containers[0].state = api::ContainerState::ContainerExited as i32;
    w.held.insert("uid-a".into());
    assert!(w.decide().is_empty());
}

#[test]
fn missing_containers_are_created_and_created_ones_started() {
    let mut w = World::new();
    w.snap.sandboxes.push(sandbox("sb", "uid-a", true, 0));
    w.snap.containers.push(container(
        "c1",
        "sb",
        "uid-a",
        "one",
        api::ContainerState::ContainerCreated,
        0,
    ));
    w.add(pod_json("a", &["one", "two"]));
    let acts = w.decide();
    assert!(matches!(&acts[0], Action::StartCreated { container_id, .. } if container_id == "c1"));
    assert!(
        matches!(&acts[1], Action::CreateContainer { container, attempt: 0, replace: None, .. } if container.name == "two")
    );
}

#[test]
fn an_exit_waits_its_backoff_then_gets_the_next_attempt() {
    let mut w = World::new();
    w.snap.sandboxes.push(sandbox("sb", "uid-a", true, 0));
    w.snap.containers.push(container(
        "c1",
        "sb",
        "uid-a",
        "app",
        api::ContainerState::ContainerExited,
        3,
    ));
    w.add(pod_json("a", &["app"]));
    let acts = w.decide();
    let Action::WaitRestart { restarts, .. } = &acts[0] else {
        panic!("{acts:?}")
    };
    assert_eq!(restarts.count, 1);
    assert_eq!(restarts.next_allowed, Some(w.now + Duration::from_secs(10)));
    w.restarts
        .insert(("uid-a".into(), "app".into()), restarts.clone());
    assert!(w.decide().is_empty(), "still waiting");
    w.now += Duration::from_secs(11);
    let acts = w.decide();
    assert!(
        matches!(&acts[0], Action::CreateContainer { attempt: 4, replace: Some(old), .. } if old == "c1"),
        "{acts:?}"
    );
}

#[test]
fn backoff_grows_with_each_crash_and_resets_after_ten_minutes_of_running() {
    let mut w = World::new();
    w.snap.sandboxes.push(sandbox("sb", "uid-a", true, 0));
    w.snap.containers.push(container(
        "c9",
        "sb",
        "uid-a",
        "app",
        api::ContainerState::ContainerExited,
        5,
    ));
    w.add(pod_json("a", &["app"]));
    // Five crashes so far, the last one a different container.
    w.restarts.insert(
        ("uid-a".into(), "app".into()),
        Restarts {
            count: 5,
            next_allowed: Some(w.now),
            exited: Some("c8".into()),
        },
    );
    let short = ContainerFacts {
        exit_code: 1,
        started_at: 1_000_000_000,
        finished_at: 61_000_000_000,
        ..Default::default()
    };
    w.snap.facts.insert("c9".into(), short);
    let Action::WaitRestart { restarts, .. } = &w.decide()[0] else {
        panic!()
    };
    assert_eq!(
        (restarts.count, restarts.next_allowed),
        (6, Some(w.now + Duration::from_secs(300)))
    );
    // The same container ran 10 minutes before it exited: the backoff starts over.
    w.snap.facts.get_mut("c9").unwrap().finished_at = 1_000_000_000 + 601_000_000_000;
    let Action::WaitRestart { restarts, .. } = &w.decide()[0] else {
        panic!()
    };
    assert_eq!(
        (restarts.count, restarts.next_allowed),
        (1, Some(w.now + Duration::from_secs(10)))
    );
}

#[test]
fn restart_policies() {
    for (policy, code, restart) in [
        ("Always", 0, true),
        ("OnFailure", 0, false),
        ("OnFailure", 1, true),
        ("Never", 1, false),
    ] {
        let mut w = World::new();
        w.snap.sandboxes.push(sandbox("sb", "uid-a", true, 0));
        w.snap.containers.push(container(
            "c1",
            "sb",
            "uid-a",
            "app",
            api::ContainerState::ContainerExited,
            0,
        ));
        w.snap.facts.insert(
            "c1".into(),
            ContainerFacts {
                exit_code: code,
                ..Default::default()
            },
        );
        let mut v = pod_json("a", &["app"]);
        v["spec"]["restartPolicy"] = json!(policy);
        w.add(v);
        assert_eq!(
            !w.decide().is_empty(),
            restart,
            "{policy} after exit {code}"
        );
    }
}

#[test]
fn init_containers_run_one_at_a_time_before_the_app() {
    let mut w = World::new();
    w.snap.sandboxes.push(sandbox("sb", "uid-a", true, 0));
    let mut v = pod_json("a", &["app"]);
    v["spec"]["initContainers"] =
        json!([{"name": "i1", "image": "img:1"}, {"name": "i2", "image": "img:1"}]);
    w.add(v);
    let acts = w.decide();
    assert_eq!(acts.len(), 1);
    assert!(
        matches!(&acts[0], Action::CreateContainer { container, .. } if container.name == "i1")
    );
    // i1 succeeded: i2 next, still not the app.
    w.snap.containers.push(container(
        "i1",
        "sb",
        "uid-a",
        "i1",
        api::ContainerState::ContainerExited,
        0,
    ));
    w.snap.facts.insert("i1".into(), ContainerFacts::default());
    let acts = w.decide();
    assert!(
        matches!(&acts[0], Action::CreateContainer { container, .. } if container.name == "i2")
    );
    assert_eq!(acts.len(), 1);
}

#[test]
fn a_refused_pod_waits_its_backoff() {
    let mut w = World::new();
    w.add(pod_json("a", &["app"]));
    w.refused.insert(
        "uid-a".into(),
        Restarts {
            count: 1,
            next_allowed: Some(w.now + Duration::from_secs(5)),
            exited: None,
        },
    );
    assert!(w.decide().is_empty(), "no new sandbox during the backoff");
    w.now += Duration::from_secs(6);
    assert_eq!(names(&w.decide()), ["StartPod:uid-a"]);
}

fn probe_spec() -> ProbeSpec {
    ProbeSpec {
        action: ProbeAction::Exec(vec!["true".into()]),
        initial_delay: Duration::ZERO,
        period: Duration::from_secs(5),
        timeout: Duration::from_secs(1),
        success_threshold: 1,
        failure_threshold: 1,
    }
}

#[test]
fn due_probes_run_and_a_failed_liveness_stops_the_container() {
    let mut w = World::new();
    w.snap.sandboxes.push(sandbox("sb", "uid-a", true, 0));
    w.snap.containers.push(container(
        "c1",
        "sb",
        "uid-a",
        "app",
        api::ContainerState::ContainerRunning,
        0,
    ));
    w.add(pod_json("a", &["app"]));
    let mut p = ContainerProbes {
        id: "c1".into(),
        liveness: Some((probe_spec(), ProbeState::new(w.now))),
        readiness: None,
    };
    w.probes.insert(("uid-a".into(), "app".into()), p.clone());
    let acts = w.decide();
    assert!(
        matches!(&acts[0], Action::Probe { kind: ProbeKind::Liveness, container_id, .. } if container_id == "c1")
    );
    p.record(ProbeKind::Liveness, w.now, Err("exit 1".into()));
    w.probes.insert(("uid-a".into(), "app".into()), p);
    let acts = w.decide();
    assert!(
        matches!(&acts[0], Action::StopContainer { container_id, grace_secs: 7, why, .. } if container_id == "c1" && why == "exit 1"),
        "{acts:?}"
    );
}

#[test]
fn changed_file_volumes_are_rewritten() {
    let mut w = World::new();
    w.snap.sandboxes.push(sandbox("sb", "uid-a", true, 0));
    w.snap.containers.push(container(
        "c1",
        "sb",
        "uid-a",
        "app",
        api::ContainerState::ContainerRunning,
        0,
    ));
    w.add(pod_json("a", &["app"]));
    w.volumes.insert("uid-a".into(), 1);
    assert_eq!(names(&w.decide()), ["RefreshVolumes:uid-a"]);
}

#[test]
fn an_empty_cache_stops_nothing_until_the_pod_list_has_completed() {
    let mut w = World::new();
    w.ready = false;
    w.snap.sandboxes.push(sandbox("sb", "uid-x", true, 0));
    w.snap.containers.push(container(
        "c1",
        "sb",
        "uid-x",
        "app",
        api::ContainerState::ContainerRunning,
        0,
    ));
    w.snap.pod_dirs.insert("uid-x".into());
    assert!(w.decide().is_empty(), "nothing is stopped, nothing deleted");
    // The list completed and did not have it: it goes, with its pod's grace period.
    w.ready = true;
    let acts = w.decide();
    assert!(
        matches!(&acts[0], Action::KillPod { sandboxes, containers, grace_secs: 9, .. }
            if sandboxes == &["sb"] && containers == &["c1"]),
        "{acts:?}"
    );
    // Once the sandbox is gone, its directory (Secrets, tokens) goes too.
    w.snap.sandboxes.clear();
    w.snap.containers.clear();
    assert_eq!(names(&w.decide()), ["RemovePodDir:uid-x"]);
}

#[test]
fn a_pod_the_list_confirms_is_adopted_as_it_runs() {
    let mut w = World::new();
    w.ready = true;
    w.snap.sandboxes.push(sandbox("sb", "uid-a", true, 0));
    w.snap.containers.push(container(
        "c1",
        "sb",
        "uid-a",
        "app",
        api::ContainerState::ContainerRunning,
        0,
    ));
    w.add(pod_json("a", &["app"]));
    assert!(w.decide().is_empty(), "no restart, no removal");
}

#[test]
fn a_deleted_pod_is_stopped_with_its_grace_then_finalized() {
    let mut w = World::new();
    w.snap.sandboxes.push(sandbox("sb", "uid-a", true, 0));
    let mut v = pod_json("a", &["app"]);
    v["metadata"]["deletionTimestamp"] = json!("2026-11-30T00:00:00Z");
    v["metadata"]["deletionGracePeriodSeconds"] = json!(3);
    w.add(v);
    // Even before the first list: the cache says this pod is being deleted.
    w.ready = false;
    let acts = w.decide();
    assert!(
        matches!(&acts[0], Action::KillPod { grace_secs: 3, .. }),
        "{acts:?}"
    );
    w.snap.sandboxes.clear();
    assert_eq!(names(&w.decide()), ["Finalize:uid-a"]);
}

#[test]
fn an_unreadable_pod_is_left_running_and_a_blocked_one_says_why() {
    let mut w = World::new();
    w.snap.sandboxes.push(sandbox("sb", "uid-a", true, 0));
    let mut d = desired(pod_json("a", &["app"]), &w.snap);
    d.plan = None;
    w.desired.push(d);
    assert!(w.decide().is_empty());

    let mut d = desired(pod_json("b", &["app"]), &w.snap);
    d.plan = Some(Err(PlanError::Missing(Missing {
        reason: "ConfigMapUnavailable",
        message: "configmap \"ns/c\" not cached yet".into(),
        known_absent: false,
    })));
    w.desired.push(d);
    let acts = w.decide();
    assert!(
        matches!(
            &acts[0],
            Action::Blocked {
                reason: "ConfigMapUnavailable",
                warn: false,
                ..
            }
        ),
        "{acts:?}"
    );
}

#[test]
fn what_an_upgrade_that_did_not_commit_left_goes_before_anything_else() {
    let mut w = World::new();
    w.snap.sandboxes.push(sandbox("sb", "uid-a", true, 0));
    // The old app was stopped by the swap; the failed upgrade's new one runs.
    w.snap.containers.push(container(
        "old",
        "sb",
        "uid-a",
        "app",
        api::ContainerState::ContainerExited,
        0,
    ));
    let mut new = container(
        "new",
        "sb",
        "uid-a",
        "app",
        api::ContainerState::ContainerRunning,
        1,
    );
    new.labels
        .insert(labels::UPGRADE_ID.to_string(), "u-failed".to_string());
    w.snap.containers.push(new);
    w.add(pod_json("a", &["app"]));
    // An upgrade that committed: its container is the pod's.
    assert!(!names(&w.decide()).contains(&"RemoveLeftovers:uid-a".to_string()));
    w.ended.insert("u-failed".into());
    let acts = w.decide();
    assert_eq!(names(&acts), ["RemoveLeftovers:uid-a"], "alone, first");
    let Action::RemoveLeftovers {
        sandboxes,
        containers,
        grace_secs,
        ..
    } = &acts[0]
    else {
        unreachable!()
    };
    assert!(sandboxes.is_empty());
    assert_eq!(containers, &["new"]);
    assert_eq!(*grace_secs, 7);
    // Once it is gone, the old spec's container comes back as after any exit.
    w.snap.containers.pop();
    assert!(!names(&w.decide()).contains(&"RemoveLeftovers:uid-a".to_string()));
    // Held by its upgrade, nothing of it is touched.
    w.held.insert("uid-a".into());
    assert!(w.decide().is_empty());
}

#[test]
fn of_two_ready_sandboxes_the_older_goes_unless_the_newer_is_a_failed_upgrades() {
    let mut w = World::new();
    w.snap.sandboxes.push(sandbox("old", "uid-a", true, 0));
    w.snap.sandboxes.push(sandbox("new", "uid-a", true, 1));
    for (id, sb) in [("c-old", "old"), ("c-new", "new")] {
        w.snap.containers.push(container(
            id,
            sb,
            "uid-a",
            "app",
            api::ContainerState::ContainerRunning,
            0,
        ));
    }
    w.add(pod_json("a", &["app"]));
    let acts = w.decide();
    let Action::RemoveLeftovers {
        sandboxes,
        containers,
        ..
    } = &acts[0]
    else {
        panic!("{acts:?}")
    };
    assert_eq!(
        (sandboxes.as_slice(), containers.as_slice()),
        (&["old".to_string()][..], &["c-old".to_string()][..])
    );
    // The newer one is a failed recreate's: it goes, the older one stays.
    w.snap.sandboxes[1]
        .labels
        .insert(labels::UPGRADE_ID.to_string(), "u-failed".to_string());
    w.ended.insert("u-failed".into());
    let acts = w.decide();
    let Action::RemoveLeftovers {
        sandboxes,
        containers,
        ..
    } = &acts[0]
    else {
        panic!("{acts:?}")
    };
    assert_eq!(
        (sandboxes.as_slice(), containers.as_slice()),
        (&["new".to_string()][..], &["c-new".to_string()][..])
    );
}

/// A replacement pod of the awaiting sandbox's DaemonSet, at revision `hash`.
fn replacement(hash: &str) -> serde_json::Value {
    let mut v = pod_json("b", &["app"]);
    v["metadata"]["labels"] = json!({"controller-revision-hash": hash});
    v["metadata"]["ownerReferences"] = json!([{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "ds", "uid": "ds1", "controller": true}]);
    v
}

#[test]
fn a_replacement_at_another_revision_gives_up_the_awaiting_sandbox_at_once() {
    let mut w = World::new();
    // The upgraded sandbox of pod a, whose object was deleted for the replacement to adopt it.
    w.snap.sandboxes.push(sandbox("sb-a", "uid-a", true, 0));
    w.awaiting.push(Awaiting {
        label_uid: "uid-a".into(),
        namespace: "ns".into(),
        owner_uid: "ds1".into(),
        hash: "h2".into(),
        expired: false,
    });
    // Held while it awaits, as the runtime holds it.
    w.held.insert("uid-a".into());
    // At the revision the sandbox runs: adopted.
    w.add(replacement("h2"));
    assert_eq!(names(&w.decide()), ["Adopt:uid-b"]);
    // The DaemonSet moved on: the replacement starts its own sandbox and the awaiting one is
    // given up now, not at the adopt timeout.
    w.desired.clear();
    w.add(replacement("h3"));
    let acts = names(&w.decide());
    assert!(acts.contains(&"StartPod:uid-b".to_string()), "{acts:?}");
    assert!(
        acts.contains(&"GiveUpAdoption:uid-a".to_string()),
        "{acts:?}"
    );
    // No replacement yet, not expired: it waits.
    w.desired.clear();
    assert!(!names(&w.decide()).contains(&"GiveUpAdoption:uid-a".to_string()));
}
