//! The OTA upgrade end to end, with the edgehub binary, real containerd and the fake
//! apiserver seeded with the recorded cluster: the operator rolls the `telemetry` DaemonSet
//! to busybox 2.0, the link goes down, and the OTA manager asks for the upgrade. Needs root;
//! without it these tests fail, loudly.

mod common;
#[path = "common/edge.rs"]
mod edge;

use edge::{node, node_shaped, Shape};
use edgehub::cri::{api, labels, CriRuntime};
use std::time::{Duration, Instant};

/// A short tag per shape, for node names.
fn tag(shape: Shape) -> &'static str {
    match shape {
        Shape::HostNetwork => "",
        Shape::PodNetwork => "pn",
        Shape::WithInit => "init",
    }
}

/// Adds a variable to the app container's environment.
fn add_env(spec: &mut serde_json::Value, name: &str, value: &str) {
    let app = &mut spec["containers"][0];
    if !app["env"].is_array() {
        app["env"] = serde_json::json!([]);
    }
    if let Some(env) = app["env"].as_array_mut() {
        env.push(serde_json::json!({"name": name, "value": value}));
    }
}

/// busybox 1.0 -> 2.0 with the link down: only the changed container is replaced, in the
/// same sandbox; the new process prints the new line; `GET /pods` says the pod is current.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offline_upgrade_swaps_the_changed_container_in_place() {
    in_place(Shape::HostNetwork).await
}

/// The same on the pod network: the new container's httpGet readiness probe reaches it at
/// the sandbox's address, and `POD_IP` is that address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offline_upgrade_in_place_on_the_pod_network_probes_the_pod_and_keeps_its_ip() {
    in_place(Shape::PodNetwork).await
}

async fn in_place(shape: Shape) {
    let mut n = node_shaped(&format!("inplace{}", tag(shape)), shape).await;
    n.rolled_and_offline().await;
    let sandboxes = n.sandboxes().await;
    let sidecar = n.running("sidecar").await[0].id.clone();
    let old_app = n.running("app").await[0].clone();

    let (code, body) = n.http("POST", &n.upgrade_path());
    assert_eq!(
        (code, body.as_str()),
        (200, "Start updating pod vehicle/telemetry-sv74m")
    );
    let done = n.wait_state(60, &["Done", "RolledBack", "Failed"]).await;
    assert_eq!(done["state"], "Done", "{done}\n{}", n.log());

    let app = n.running("app").await;
    assert_eq!(app.len(), 1);
    assert_ne!(app[0].id, old_app.id, "the app container was replaced");
    assert_eq!(app[0].image.as_ref().unwrap().image, n.image("2.0"));
    let attempt = app[0].metadata.as_ref().unwrap().attempt;
    n.wait_for(10, "the new process prints the new line", |n| async move {
        n.pod_log("app", attempt).contains("hello from 2.0")
    })
    .await;
    assert_eq!(n.sandboxes().await, sandboxes, "same sandbox (and pod IP)");
    if shape == Shape::PodNetwork {
        let ip = n.sandbox_ip(&sandboxes[0]).await;
        assert!(!ip.is_empty(), "the sandbox has a pod-network address");
        let env = n.env_of(&app[0].id).await;
        assert!(
            env.lines().any(|l| l == format!("POD_IP={ip}")),
            "the new container's POD_IP is the pod's address {ip}:\n{env}"
        );
    }
    assert_eq!(
        n.running("sidecar").await[0].id,
        sidecar,
        "the sidecar was not touched"
    );
    assert!(
        n.containers().await.iter().all(|c| c.id != old_app.id),
        "the old container was removed at commit"
    );
    let need = n.need().unwrap();
    assert_eq!(
        (need["status"].as_str(), need["reason"].as_str()),
        (Some("False"), Some("RunningLatestRevision")),
        "{need}"
    );
    // GET /pods serves the device's truth offline: the new image in the container status.
    n.wait_for(10, "the served status has the new image", |n| async move {
        n.served().is_some_and(|p| {
            p["status"]["containerStatuses"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["name"] == "app" && c["image"] == n.image("2.0").as_str())
        })
    })
    .await;
    // The runtime keeps running the new image: a second later nothing was swapped back.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(n.running("app").await[0].id, app[0].id);
    n.clean().await;
}

/// A new image that exits at once: the upgrade rolls back, and the old image runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_container_that_exits_rolls_back_to_the_old_image() {
    rolls_back_a_crash(Shape::HostNetwork).await
}

/// The same on the pod network: the restored container has its `POD_IP` again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_on_the_pod_network_restores_the_old_image_with_its_pod_ip() {
    rolls_back_a_crash(Shape::PodNetwork).await
}

async fn rolls_back_a_crash(shape: Shape) {
    let mut n = node_shaped(&format!("crash{}", tag(shape)), shape).await;
    n.rolled_to_and_offline(Some("127.0.0.1:5000/busybox:3.0-crash"))
        .await;
    let sidecar = n.running("sidecar").await[0].id.clone();
    let (code, _) = n.http("POST", &n.upgrade_path());
    assert_eq!(code, 200);
    let end = n.wait_state(60, &["Done", "RolledBack", "Failed"]).await;
    assert_eq!(end["state"], "RolledBack", "{end}");
    assert!(
        end["error"]
            .as_str()
            .unwrap_or("")
            .contains("exited with code 3"),
        "{end}"
    );
    let app = n.running("app").await;
    assert_eq!(app.len(), 1, "the old spec runs again");
    assert_eq!(app[0].image.as_ref().unwrap().image, n.image("1.0"));
    if shape == Shape::PodNetwork {
        let ip = n.sandbox_ip(&n.sandboxes().await[0]).await;
        let env = n.env_of(&app[0].id).await;
        assert!(
            !ip.is_empty() && env.lines().any(|l| l == format!("POD_IP={ip}")),
            "the restored container's POD_IP is the pod's address {ip:?}:\n{env}"
        );
    }
    assert!(
        n.containers()
            .await
            .iter()
            .all(|c| !c.labels.contains_key(labels::UPGRADE_ID)),
        "the upgrade's containers are gone"
    );
    assert_eq!(n.running("sidecar").await[0].id, sidecar);
    assert_eq!(
        n.need().unwrap()["status"],
        "True",
        "still needs the upgrade"
    );
    let reasons = n.queued_event_reasons();
    assert!(
        reasons.contains(&"UpgradeStarted".to_string())
            && reasons.contains(&"UpgradeRolledBack".to_string()),
        "{reasons:?}"
    );
    n.clean().await;
}

/// A new container that runs but never passes its readiness probe: rolled back when the
/// verification deadline passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_container_that_never_gets_ready_rolls_back() {
    let mut n = node("unready").await;
    // Ready only while the process that prints "from 1.0" runs.
    n.server.modify("pods", "vehicle", "telemetry-sv74m", |p| {
        p["spec"]["containers"][0]["readinessProbe"] = serde_json::json!({
            "exec": {"command": ["sh", "-c", "ps | grep -v grep | grep -q 'from 1.0'"]},
            "periodSeconds": 1, "failureThreshold": 1});
    });
    n.rolled_and_offline().await;
    let (code, _) = n.http("POST", &n.upgrade_path());
    assert_eq!(code, 200);
    let end = n.wait_state(60, &["Done", "RolledBack", "Failed"]).await;
    assert_eq!(end["state"], "RolledBack", "{end}");
    assert!(
        end["error"]
            .as_str()
            .unwrap_or("")
            .contains("not ready in time: app"),
        "{end}"
    );
    let app = n.running("app").await;
    assert_eq!(
        app[0].image.as_ref().unwrap().image,
        "127.0.0.1:5000/busybox:1.0"
    );
    n.clean().await;
}

/// Offline, an upgrade whose image is not on the node is refused before anything changes;
/// a second request while one runs is a conflict.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_images_offline_are_412_and_a_second_request_is_409() {
    let mut n = node("refuse").await;
    // A registry that cannot be reached (nothing listens on port 1).
    n.rolled_to_and_offline(Some("127.0.0.1:1/busybox:9.9"))
        .await;
    let app = n.running("app").await[0].id.clone();
    let (code, body) = n.http("POST", &n.upgrade_path());
    assert_eq!(code, 412, "{body}");
    assert!(body.contains("127.0.0.1:1/busybox:9.9"), "{body}");
    assert_eq!(n.state(), None, "no request was recorded");
    assert_eq!(n.running("app").await[0].id, app, "nothing changed");
    n.kill9();

    // Revision 2's image is on the node: accepted; asked again at once: 409.
    let mut n2 = node("twice").await;
    n2.rolled_and_offline().await;
    let (code, _) = n2.http("POST", &n2.upgrade_path());
    assert_eq!(code, 200);
    let (code, body) = n2.http("POST", &n2.upgrade_path());
    assert_eq!(code, 409, "{body}");
    n2.wait_state(60, &["Done"]).await;
    n.clean().await;
    n2.clean().await;
}

/// What a crash-point run upgrades to, and where it must end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scenario {
    /// busybox 1.0 -> 2.0 in place: Done.
    InPlace,
    /// In place to an image that exits at once: RolledBack.
    InPlaceCrash,
    /// In place to a container that runs but never gets ready (so the rollback stops it).
    InPlaceUnready,
    /// An env change: a new sandbox (host network: the old one stops first), Done.
    Recreate,
    /// A new sandbox whose app exits at once: RolledBack.
    RecreateCrash,
}

impl Scenario {
    fn want(self) -> &'static str {
        match self {
            Scenario::InPlace | Scenario::Recreate => "Done",
            _ => "RolledBack",
        }
    }

    fn tag(self) -> &'static str {
        match self {
            Scenario::InPlace => "ip",
            Scenario::InPlaceCrash => "ipc",
            Scenario::InPlaceUnready => "ipu",
            Scenario::Recreate => "rc",
            Scenario::RecreateCrash => "rcc",
        }
    }
}

/// Kills edgehub (SIGKILL, as a power cut would) the moment `point` of an upgrade is reached,
/// restarts it, and checks the end: the journal is terminal and the one `scenario` names,
/// exactly one container runs per name (of that revision) in one sandbox, nothing the upgrade
/// made is left over, and the report is queued.
async fn crash_at(point: String, scenario: Scenario) {
    let short: String = point
        .trim_start_matches("upgrade:")
        .chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .collect::<String>()
        .to_lowercase();
    let mut n = node(&format!("cp{}{short}", scenario.tag())).await;
    match scenario {
        Scenario::InPlace => n.rolled_to_and_offline(None).await,
        Scenario::InPlaceCrash => {
            n.rolled_to_and_offline(Some("127.0.0.1:5000/busybox:3.0-crash"))
                .await
        }
        Scenario::InPlaceUnready => {
            // Ready only while the process that prints "from 1.0" runs.
            n.server.modify("pods", "vehicle", "telemetry-sv74m", |p| {
                p["spec"]["containers"][0]["readinessProbe"] = serde_json::json!({
                    "exec": {"command": ["sh", "-c", "ps | grep -v grep | grep -q 'from 1.0'"]},
                    "periodSeconds": 1, "failureThreshold": 1});
            });
            n.rolled_to_and_offline(None).await
        }
        Scenario::Recreate => {
            n.edited_and_offline(|spec| add_env(spec, "LEVEL", "debug"))
                .await
        }
        Scenario::RecreateCrash => {
            n.edited_and_offline(|spec| {
                spec["containers"][0]["image"] = "127.0.0.1:5000/busybox:3.0-crash".into();
                add_env(spec, "LEVEL", "debug");
            })
            .await
        }
    }
    let want = scenario.want();
    n.kill9();
    n.start_with(Some(&point));
    n.wait_for(30, "the API is up", |n| async move {
        n.http("GET", "/v1/healthz").0 == 200
    })
    .await;
    let (code, _) = n.http("POST", &n.upgrade_path());
    assert_eq!(code, 200, "{point}");
    // The failpoint kills the process.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(status) = n.child.as_mut().and_then(|c| c.try_wait().unwrap()) {
            use std::os::unix::process::ExitStatusExt;
            assert_eq!(status.signal(), Some(9), "{point}: killed by SIGKILL");
            n.child = None;
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{point} ({scenario:?}) was never reached\n{}",
            n.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Power back: the engine finishes or rolls back from the journal and the runtime.
    n.start();
    let end = n.wait_state(90, &["Done", "RolledBack", "Failed"]).await;
    assert_eq!(
        end["state"],
        want,
        "{point} ({scenario:?}): {end}\n{}",
        n.log()
    );
    n.wait_for(
        30,
        "one running container per name, nothing else",
        |n| async move {
            let all = n.containers().await;
            ["app", "sidecar"].iter().all(|name| {
                let mine: Vec<_> = all
                    .iter()
                    .filter(|c| {
                        c.labels.get(labels::CONTAINER_NAME).map(String::as_str) == Some(name)
                    })
                    .collect();
                mine.len() == 1 && mine[0].state == api::ContainerState::ContainerRunning as i32
            })
        },
    )
    .await;
    let app = n.running("app").await;
    let image = &app[0].image.as_ref().unwrap().image;
    // Both paths go to an image of revision 2 (the recreate's revision is built from it).
    let expected = if want == "Done" {
        "127.0.0.1:5000/busybox:2.0"
    } else {
        "127.0.0.1:5000/busybox:1.0"
    };
    assert_eq!(
        image, expected,
        "{point} ({scenario:?}): exactly one revision runs, the journal's"
    );
    if scenario == Scenario::Recreate {
        let env = n.env_of(&app[0].id).await;
        assert!(env.contains("LEVEL=debug"), "{point}: the new spec runs");
    }
    n.wait_for(20, "one sandbox", |n| async move {
        n.sandboxes().await.len() == 1
    })
    .await;
    let reasons = n.queued_event_reasons();
    let last = if want == "Done" {
        "UpgradeSucceeded"
    } else {
        "UpgradeRolledBack"
    };
    assert!(
        reasons.iter().any(|r| r == "UpgradeStarted") && reasons.iter().any(|r| r == last),
        "{point}: the report is queued: {reasons:?}"
    );
    n.clean().await;
}

/// Runs a crash point per entry, a few at a time (each has its own node and edgehub), and
/// returns how many ran.
async fn sweep(points: &[(&str, Scenario)]) -> usize {
    for chunk in points.chunks(3) {
        let mut set = tokio::task::JoinSet::new();
        for (p, s) in chunk {
            set.spawn(crash_at(p.to_string(), *s));
        }
        while let Some(r) = set.join_next().await {
            if let Err(e) = r {
                std::panic::resume_unwind(e.into_panic());
            }
        }
    }
    points.len()
}

/// Before and after every side effect of the in-place path (a transition's "before" is the
/// step before it's "after"), on the way to Done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_at_any_point_of_an_upgrade_ends_in_one_revision() {
    use Scenario::InPlace;
    let mut points = vec![
        ("upgrade:after:Pulling", InPlace),
        ("upgrade:after:Swapping", InPlace),
        ("upgrade:after:Verifying", InPlace),
        ("upgrade:step:MarkReady", InPlace),
        ("upgrade:after:Committed", InPlace),
        ("upgrade:after:Done", InPlace),
    ];
    for step in ["CreateNew", "StopOld", "Start", "RemoveOld"] {
        points.push((leak(format!("upgrade:before:{step}")), InPlace));
        points.push((leak(format!("upgrade:step:{step}")), InPlace));
    }
    let n = sweep(&points).await;
    println!("crash points covered on the in-place way to Done: {n}");
}

/// The same for the in-place rollback: a new container that exits, and one that runs but is
/// never ready (so the rollback has to stop it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_at_any_point_of_a_rollback_ends_in_the_old_revision() {
    use Scenario::{InPlaceCrash, InPlaceUnready};
    let mut points = vec![
        ("upgrade:after:RollingBack", InPlaceCrash),
        ("upgrade:after:RolledBack", InPlaceCrash),
    ];
    for step in ["RemoveNew", "RestoreOld"] {
        points.push((leak(format!("upgrade:before:{step}")), InPlaceCrash));
        points.push((leak(format!("upgrade:step:{step}")), InPlaceCrash));
    }
    points.push(("upgrade:before:StopNew", InPlaceUnready));
    points.push(("upgrade:step:StopNew", InPlaceUnready));
    let n = sweep(&points).await;
    println!("crash points covered on the in-place way to RolledBack: {n}");
}

/// The recreate path: every sandbox and container step before and after, to Done and to
/// RolledBack.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_at_any_point_of_a_recreate_ends_in_one_revision() {
    use Scenario::{Recreate, RecreateCrash};
    let mut points = vec![
        ("upgrade:after:Verifying", Recreate),
        ("upgrade:after:Committed", Recreate),
        ("upgrade:after:Done", Recreate),
        ("upgrade:after:RollingBack", RecreateCrash),
        ("upgrade:after:RolledBack", RecreateCrash),
    ];
    // Host network: the old pod's containers stop first, its sandbox stays until the commit.
    for step in [
        "CreatePod",
        "CreateNew",
        "Start",
        "StopContainers",
        "RemovePod",
    ] {
        points.push((leak(format!("upgrade:before:{step}")), Recreate));
        points.push((leak(format!("upgrade:step:{step}")), Recreate));
    }
    // In the rollback, the new sandbox goes, and the old spec runs again in the kept one.
    for step in ["RemovePod", "RestoreOld"] {
        points.push((leak(format!("upgrade:before:{step}")), RecreateCrash));
        points.push((leak(format!("upgrade:step:{step}")), RecreateCrash));
    }
    let n = sweep(&points).await;
    println!("crash points covered on the recreate path: {n}");
}

fn leak(s: String) -> &'static str {
    Box::leak(s.into_boxed_str())
}

/// While online, a new revision's images are pulled as soon as it appears, and the pod gets
/// PodImageReady; `POST .../imagepull` asks for the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_revision_is_prepulled_and_the_pod_says_so() {
    let mut n = node("prepull").await;
    n.start();
    n.wait_for(60, "the pod runs", |n| async move {
        n.running("app").await.len() == 1
    })
    .await;
    n.roll();
    n.wait_for(30, "PodImageReady True for revision 2", |n| async move {
        n.condition("PodImageReady").is_some_and(|c| {
            c["status"] == "True" && c["message"] == "controllerrevision: 55778fbb9f"
        })
    })
    .await;
    let (code, body) = n.http(
        "POST",
        "/openyurt.io/v1/namespaces/vehicle/pods/telemetry-sv74m/imagepull",
    );
    assert_eq!(code, 200, "{body}");
    n.clean().await;
}

/// A change beyond images (an environment variable) recreates the pod: a new sandbox from
/// the target template (the old one stops first: host network), verified, the old one
/// removed; the new process sees the new value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_env_change_recreates_the_pod_offline() {
    recreates(Shape::HostNetwork).await
}

/// The same on the pod network: the new sandbox starts beside the old one, its containers
/// get its address as `POD_IP`, and their httpGet probes reach them there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recreate_on_the_pod_network_probes_and_addresses_the_new_pod() {
    recreates(Shape::PodNetwork).await
}

async fn recreates(shape: Shape) {
    let mut n = node_shaped(&format!("recreate{}", tag(shape)), shape).await;
    n.edited_and_offline(|spec| {
        add_env(spec, "LEVEL", "debug");
    })
    .await;
    let before = n.sandboxes().await;
    let (code, body) = n.http("POST", &n.upgrade_path());
    assert_eq!(code, 200, "{body}");
    let end = n.wait_state(90, &["Done", "RolledBack", "Failed"]).await;
    assert_eq!(end["state"], "Done", "{end}\n{}", n.log());
    let after = n.sandboxes().await;
    assert_eq!(after.len(), 1, "one sandbox");
    assert_ne!(after, before, "a new sandbox");
    let app = n.running("app").await;
    assert_eq!(app.len(), 1);
    let env = n
        .cri
        .exec_sync(&app[0].id, vec!["env".into()], Duration::from_secs(5))
        .await
        .unwrap();
    assert!(
        String::from_utf8_lossy(&env.stdout).contains("LEVEL=debug"),
        "the new spec runs"
    );
    if shape == Shape::PodNetwork {
        let ip = n.sandbox_ip(&after[0]).await;
        assert!(
            !ip.is_empty()
                && String::from_utf8_lossy(&env.stdout).contains(&format!("POD_IP={ip}\n")),
            "the new containers' POD_IP is the new pod's address {ip:?}"
        );
    }
    assert_eq!(n.running("sidecar").await.len(), 1);
    assert_eq!(n.need().unwrap()["status"], "False");
    // The runtime keeps the new spec: nothing is recreated again.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(n.running("app").await[0].id, app[0].id);
    n.clean().await;
}

/// A new revision whose image is the same image by digest (a tag that moved, a digest
/// reference) is no change: nothing is swapped, and the pod now runs the new revision.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_image_by_digest_is_no_swap() {
    let mut n = node("digest").await;
    let digest = n
        .cri
        .image_status("127.0.0.1:5000/busybox:1.0")
        .await
        .unwrap()
        .expect("busybox 1.0 is on the node")
        .repo_digests
        .into_iter()
        .find(|d| d.starts_with("127.0.0.1:5000/busybox@sha256:"))
        .expect("a repo digest");
    n.rolled_to_and_offline(Some(&digest)).await;
    let app = n.running("app").await[0].id.clone();
    let (code, _) = n.http("POST", &n.upgrade_path());
    assert_eq!(code, 200);
    let end = n.wait_state(60, &["Done", "RolledBack", "Failed"]).await;
    assert_eq!(end["state"], "Done", "{end}");
    assert_eq!(n.running("app").await[0].id, app, "nothing was swapped");
    assert_eq!(n.need().unwrap()["status"], "False");
    n.clean().await;
}

/// A new revision that adds an init container recreates the pod: the init container runs to
/// success in the new sandbox before the app starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recreate_runs_the_new_init_container_first() {
    let mut n = node("recinit").await;
    n.edited_and_offline(|spec| {
        spec["initContainers"] = serde_json::json!([{"name": "prepare",
            "image": "127.0.0.1:5000/busybox:1.0", "command": ["sh", "-c", "echo prepared"],
            "imagePullPolicy": "IfNotPresent", "terminationMessagePath": "/dev/termination-log",
            "terminationMessagePolicy": "File"}]);
    })
    .await;
    let (code, body) = n.http("POST", &n.upgrade_path());
    assert_eq!(code, 200, "{body}");
    let end = n.wait_state(90, &["Done", "RolledBack", "Failed"]).await;
    assert_eq!(end["state"], "Done", "{end}\n{}", n.log());
    let all = n.containers().await;
    let init = all
        .iter()
        .find(|c| c.labels.get(labels::CONTAINER_NAME).map(String::as_str) == Some("prepare"))
        .expect("the init container ran");
    assert_eq!(init.state, api::ContainerState::ContainerExited as i32);
    assert_eq!(n.running("app").await.len(), 1);
    assert_eq!(n.running("sidecar").await.len(), 1);
    n.clean().await;
}

/// A recreate whose new pod crashes rolls back: the new sandbox goes, and the pod runs its
/// old spec again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_recreate_rolls_back_to_the_old_pod() {
    recreate_fails(Shape::HostNetwork).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_recreate_on_the_pod_network_rolls_back_to_the_old_pod() {
    recreate_fails(Shape::PodNetwork).await
}

async fn recreate_fails(shape: Shape) {
    let mut n = node_shaped(&format!("recfail{}", tag(shape)), shape).await;
    n.edited_and_offline(|spec| {
        spec["containers"][0]["image"] = "127.0.0.1:5000/busybox:3.0-crash".into();
        add_env(spec, "LEVEL", "debug");
        // The image's own command, which exits at once.
        spec["containers"][0]
            .as_object_mut()
            .unwrap()
            .remove("command");
    })
    .await;
    let (code, body) = n.http("POST", &n.upgrade_path());
    assert_eq!(code, 200, "{body}");
    let end = n.wait_state(90, &["Done", "RolledBack", "Failed"]).await;
    assert_eq!(end["state"], "RolledBack", "{end}\n{}", n.log());
    n.wait_for(30, "the old spec runs again", |n| async move {
        let app = n.running("app").await;
        app.len() == 1
            && app[0].image.as_ref().unwrap().image == n.image("1.0")
            && n.running("sidecar").await.len() == 1
    })
    .await;
    assert_eq!(n.sandboxes().await.len(), 1, "the new sandbox is gone");
    assert_eq!(n.need().unwrap()["status"], "True");
    n.clean().await;
}

/// The report when the link returns: the pod object is deleted (a node may do that, not patch
/// a pod's spec), the DaemonSet controller replaces it at the revision it already runs, and
/// the replacement adopts the running sandbox: the cloud ends at the new revision with the
/// new image in the status, the Events are there, and nothing restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_the_link_returns_the_replacement_adopts_the_upgraded_pod() {
    use edgehub_testsupport::daemonset_sim::pod_for;
    let mut n = node("adopt").await;
    n.rolled_and_offline().await;
    let (code, _) = n.http("POST", &n.upgrade_path());
    assert_eq!(code, 200);
    let end = n.wait_state(60, &["Done", "RolledBack", "Failed"]).await;
    assert_eq!(end["state"], "Done", "{end}");
    let app = n.running("app").await[0].clone();
    let started = n
        .cri
        .container_status(&app.id)
        .await
        .unwrap()
        .unwrap()
        .started_at;

    // The link returns; edgehub deletes the pod object; the DaemonSet controller replaces it.
    n.server.set_offline(false).await.unwrap();
    n.wait_for(30, "edgehub deletes the pod object", |n| async move {
        n.server.get("pods", "vehicle", "telemetry-sv74m").is_none()
    })
    .await;
    let ds = n.server.get("daemonsets", "vehicle", "telemetry").unwrap();
    let cr = n
        .server
        .get("controllerrevisions", "vehicle", "telemetry-55778fbb9f")
        .unwrap();
    n.server.apply("pods", pod_for(&ds, &cr, &n.name, "x7k2p"));

    let app_status = |n: &edge::Node| {
        n.server
            .get("pods", "vehicle", "telemetry-x7k2p")
            .and_then(|p| {
                p["status"]["containerStatuses"]
                    .as_array()?
                    .iter()
                    .find(|c| c["name"] == "app")
                    .cloned()
            })
    };
    n.wait_for(
        60,
        "the replacement reports the new image, ready",
        |n| async move {
            app_status(n)
                .is_some_and(|c| c["image"] == "127.0.0.1:5000/busybox:2.0" && c["ready"] == true)
        },
    )
    .await;
    let reported = app_status(&n).unwrap();
    let all: Vec<String> = n
        .containers()
        .await
        .iter()
        .map(|c| {
            format!(
                "{} state={} attempt={:?} labels={:?}",
                c.id,
                c.state,
                c.metadata.as_ref().map(|m| m.attempt),
                c.labels
            )
        })
        .collect();
    assert_eq!(
        reported["containerID"],
        format!("containerd://{}", app.id),
        "the replacement runs the upgraded container: {reported}\n{all:#?}\n{}",
        n.log()
    );
    let now = n.running("app").await;
    assert_eq!(now.len(), 1);
    assert_eq!(now[0].id, app.id, "nothing restarted");
    let started_now = n
        .cri
        .container_status(&app.id)
        .await
        .unwrap()
        .unwrap()
        .started_at;
    assert_eq!(started_now, started, "same start time");
    n.wait_for(30, "the Events reach the cloud", |n| async move {
        ["upgradestarted", "upgradesucceeded"].iter().all(|r| {
            n.server
                .get("events", "vehicle", &format!("telemetry-sv74m.edgehub-{r}"))
                .is_some()
        })
    })
    .await;
    n.wait_for(
        30,
        "the adopted container reads the replacement's token (renewed from now on)",
        |n| {
            let id = app.id.clone();
            async move {
                let cat = vec![
                    "cat".to_string(),
                    "/var/run/secrets/kubernetes.io/serviceaccount/token".to_string(),
                ];
                n.cri
                    .exec_sync(&id, cat, Duration::from_secs(5))
                    .await
                    .is_ok_and(|r| r.stdout == b"fake-token-for-telemetry-x7k2p")
            }
        },
    )
    .await;
    n.wait_for(
        30,
        "GET /pods shows the replacement, current",
        |n| async move {
            let (code, body) = n.http("GET", "/pods");
            code == 200 && body.contains("telemetry-x7k2p") && !body.contains("telemetry-sv74m")
        },
    )
    .await;
    n.clean().await;
}
