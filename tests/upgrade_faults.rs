//! The upgrade engine where the field breaks it: init containers in place, inputs that never
//! arrive, a runtime that goes away, a database that starts again, a cache reset mid-upgrade,
//! a wall clock that jumps, a registry that never answers. Each with the edgehub binary,
//! real containerd and the fake apiserver; needs root, and fails loudly without it.

mod common;
#[path = "common/criproxy.rs"]
mod criproxy;
#[path = "common/edge.rs"]
mod edge;

use criproxy::CriProxy;
use edge::{node, node_shaped, Node, Shape};
use edgehub::cri::{api, labels, CriRuntime};
use std::path::PathBuf;
use std::time::{Duration, Instant};

const TERMINAL: &[&str] = &["Done", "RolledBack", "Failed"];

/// The containers of the pod named `name`, in any state.
async fn named(n: &Node, name: &str) -> Vec<api::Container> {
    n.containers()
        .await
        .into_iter()
        .filter(|c| c.labels.get(labels::CONTAINER_NAME).map(String::as_str) == Some(name))
        .collect()
}

/// Exactly one running container per app container name, the app of the image the journal
/// says, in one sandbox (waited for: the runtime may still be converging).
async fn one_revision_runs(n: &Node, app_image: &str) {
    let want = app_image.to_string();
    n.wait_for(
        60,
        &format!("one running container per name, {app_image}, one sandbox"),
        |n| {
            let want = want.clone();
            async move {
                let all = n.containers().await;
                let running = |name: &str| -> Vec<&api::Container> {
                    all.iter()
                        .filter(|c| {
                            c.labels.get(labels::CONTAINER_NAME).map(String::as_str) == Some(name)
                                && c.state == api::ContainerState::ContainerRunning as i32
                        })
                        .collect()
                };
                let app = running("app");
                app.len() == 1
                    && running("sidecar").len() == 1
                    && app[0].image.as_ref().is_some_and(|i| i.image == want)
                    && n.sandboxes().await.len() == 1
            }
        },
    )
    .await;
}

/// An init container that shares the app's image: both change, in place. The new init
/// container runs to completion (exit 0) in the running sandbox, then the app is swapped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_init_container_sharing_the_apps_image_runs_to_completion_in_place() {
    let mut n = node_shaped("initip", Shape::WithInit).await;
    n.rolled_and_offline().await;
    let sandboxes = n.sandboxes().await;
    let old_init = named(&n, "prepare").await;
    assert_eq!(old_init.len(), 1, "the pod ran its init container");
    let (code, body) = n.http("POST", &n.upgrade_path());
    assert_eq!(code, 200, "{body}");
    let end = n.wait_state(60, TERMINAL).await;
    assert_eq!(end["state"], "Done", "{end}\n{}", n.log());
    assert_eq!(n.sandboxes().await, sandboxes, "in place: the same sandbox");
    let init = named(&n, "prepare").await;
    assert_eq!(
        init.len(),
        1,
        "the old init container was removed at commit"
    );
    assert_ne!(init[0].id, old_init[0].id, "a new init container ran");
    assert_eq!(init[0].state, api::ContainerState::ContainerExited as i32);
    assert_eq!(
        init[0].image.as_ref().unwrap().image,
        "127.0.0.1:5000/busybox:2.0"
    );
    let code = n.cri.container_status(&init[0].id).await.unwrap().unwrap();
    assert_eq!(code.exit_code, 0);
    one_revision_runs(&n, "127.0.0.1:5000/busybox:2.0").await;
    n.clean().await;
}

/// A revision whose template references a ConfigMap the node never gets: the upgrade waits
/// for it within the Requested deadline (saying why), then ends with the pod as it was, and
/// a reason the OTA manager can read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_whose_configmap_never_arrives_ends_with_the_reason() {
    let mut n = node("noinput").await;
    n.edited_and_offline(|spec| {
        spec["volumes"][1]["configMap"]["name"] = "telemetry-cfg-v2".into();
    })
    .await;
    let app = n.running("app").await[0].id.clone();
    let (code, body) = n.http("POST", &n.upgrade_path());
    assert_eq!(code, 200, "{body}");
    n.wait_for(
        10,
        "GET .../upgrade says what it waits for",
        |n| async move {
            n.state().is_some_and(|s| {
                s["waiting"]
                    .as_str()
                    .is_some_and(|w| w.contains("telemetry-cfg-v2"))
                    || TERMINAL.iter().any(|t| s["state"] == *t)
            })
        },
    )
    .await;
    let end = n.wait_state(30, TERMINAL).await;
    assert_eq!(end["state"], "RolledBack", "{end}");
    assert!(
        end["error"]
            .as_str()
            .is_some_and(|e| e.contains("telemetry-cfg-v2")),
        "{end}"
    );
    assert_eq!(n.running("app").await[0].id, app, "nothing changed");
    n.clean().await;
}

/// The CRI socket of the shared stack, and a node whose edgehub reaches it through a proxy
/// the test can cut.
async fn behind_proxy(tag: &str) -> (Node, CriProxy) {
    let n = node(tag).await;
    let real: PathBuf = common::cri_stack();
    let path = n.dir.path().join("cri-proxy.sock");
    let proxy = CriProxy::start(&real, &path);
    n.edit_config(|c| {
        c.replace(
            &format!("cri_socket = \"{}\"", real.display()),
            &format!("cri_socket = \"{}\"", path.display()),
        )
    });
    (n, proxy)
}

/// With the container runtime gone, an upgrade is refused with a 503 that names it, and
/// nothing is recorded; one accepted just before the runtime goes says why it waits in
/// GET .../upgrade, and its deadline ends it with that reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_runtime_gone_an_upgrade_is_refused_or_says_why_it_waits() {
    let (mut n, mut proxy) = behind_proxy("nocri").await;
    n.rolled_and_offline().await;
    proxy.cut();
    let (code, body) = n.http("POST", &n.upgrade_path());
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("container runtime"), "{body}");
    assert_eq!(n.state(), None, "nothing was recorded");

    proxy.restore();
    n.wait_for(30, "the runtime answers again", |n| async move {
        n.http("GET", "/v1/readyz").0 == 200
    })
    .await;
    let (code, body) = n.http("POST", &n.upgrade_path());
    assert_eq!(code, 200, "{body}");
    proxy.cut();
    let end = n.wait_state(60, TERMINAL).await;
    if end["state"] != "Done" {
        // Accepted, then the runtime went: the reason was shown while it waited, and the
        // deadline ended it with it.
        assert_eq!(end["state"], "RolledBack", "{end}");
        assert!(
            end["error"]
                .as_str()
                .is_some_and(|e| e.contains("container runtime")),
            "{end}"
        );
    }
    proxy.restore();
    n.clean().await;
}

/// A new database (a corrupt one moved aside, a new data dir) while the containers of an
/// upgrade it knew run on: the next upgrade's id is new too, so it never takes the old
/// upgrade's container for its own, and the target image really runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_in_a_new_database_never_takes_an_old_upgrades_container() {
    let mut n = node("newdb").await;
    // Only upgrades take ids, so the new database gives the next one the first one's.
    n.edit_config(|c| c.replace("[upgrade]\n", "[upgrade]\nprepull = false\n"));
    n.rolled_and_offline().await;
    let (code, _) = n.http("POST", &n.upgrade_path());
    assert_eq!(code, 200);
    let first = n.wait_state(60, TERMINAL).await;
    assert_eq!(first["state"], "Done");
    n.kill9();
    for suffix in ["", "-wal", "-shm", ".lock"] {
        let mut p = n.db().into_os_string();
        p.push(suffix);
        let _ = std::fs::remove_file(p);
    }
    n.server.set_offline(false).await.unwrap();
    n.start();
    n.wait_for(60, "the new cache has the pod", |n| async move {
        n.need().is_some()
    })
    .await;
    let hash = n.third_revision_with("newdb", |spec| {
        spec["containers"][0]["image"] = "127.0.0.1:5000/web:1.0".into();
    });
    let want = format!("controllerrevision: {hash}");
    n.wait_for(30, "PodNeedUpgrade names the third revision", |n| {
        let want = want.clone();
        async move {
            n.need()
                .is_some_and(|c| c["status"] == "True" && c["message"] == want.as_str())
        }
    })
    .await;
    n.server.set_offline(true).await.unwrap();
    let (code, body) = n.http("POST", &n.upgrade_path());
    assert_eq!(code, 200, "{body}");
    let end = n.wait_state(60, TERMINAL).await;
    assert_eq!(end["state"], "Done", "{end}");
    assert_eq!(
        end["id"], first["id"],
        "the new database numbers its rows from 1 again"
    );
    assert_ne!(end["uid"], first["uid"]);
    one_revision_runs(&n, "127.0.0.1:5000/web:1.0").await;
    n.clean().await;
}

/// `--reset-cache` in the middle of an upgrade, with the link down: the emptied cache is not
/// a verdict, so the upgrade waits (and says so) instead of failing with the pod half-swapped;
/// when the link returns, it ends in one revision, the one its journal names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_cache_mid_upgrade_waits_for_the_pod_list_and_ends_in_one_revision() {
    let mut n = node("resetmid").await;
    n.rolled_and_offline().await;
    n.kill9();
    n.start_with(Some("upgrade:after:Verifying"));
    n.wait_for(30, "the API is up", |n| async move {
        n.http("GET", "/v1/healthz").0 == 200
    })
    .await;
    let (code, _) = n.http("POST", &n.upgrade_path());
    assert_eq!(code, 200);
    let deadline = Instant::now() + Duration::from_secs(60);
    while n
        .child
        .as_mut()
        .and_then(|c| c.try_wait().unwrap())
        .is_none()
    {
        assert!(Instant::now() < deadline, "the failpoint was never reached");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    n.child = None;
    n.start_cmd(&["run", "--reset-cache"], None, &[]);
    n.wait_for(
        30,
        "the upgrade says it waits for the pod list",
        |n| async move {
            n.state().is_some_and(|s| {
                s["waiting"]
                    .as_str()
                    .is_some_and(|w| w.contains("pod list"))
            })
        },
    )
    .await;
    let s = n.state().unwrap();
    assert_eq!(s["state"], "Verifying", "not ended on an empty cache: {s}");
    n.server.set_offline(false).await.unwrap();
    let end = n.wait_state(90, TERMINAL).await;
    let image = match end["state"].as_str() {
        Some("Done") => "127.0.0.1:5000/busybox:2.0",
        Some("RolledBack") => "127.0.0.1:5000/busybox:1.0",
        _ => panic!("{end}\n{}", n.log()),
    };
    one_revision_runs(&n, image).await;
    n.clean().await;
}

/// libfaketime, from Debian's `faketime` package (scripts/setup.sh installs it).
fn libfaketime() -> String {
    for dir in [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib",
    ] {
        let p = format!("{dir}/faketime/libfaketime.so.1");
        if std::path::Path::new(&p).exists() {
            return p;
        }
    }
    panic!(
        "libfaketime is not installed (Debian package faketime); scripts/setup.sh test installs it"
    );
}

/// edgehub under a wall clock the test moves (libfaketime reads the offset from a file on
/// every call); its monotonic clocks stay real, as a vehicle's do when GPS or NTP arrives.
fn start_with_clock(n: &mut Node) -> PathBuf {
    let offset = n.dir.path().join("clock-offset");
    std::fs::write(&offset, "+0\n").unwrap();
    let lib = libfaketime();
    let file = offset.display().to_string();
    n.start_cmd(
        &["run"],
        None,
        &[
            ("LD_PRELOAD", lib.as_str()),
            ("FAKETIME_TIMESTAMP_FILE", file.as_str()),
            ("FAKETIME_NO_CACHE", "1"),
            ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
        ],
    );
    offset
}

/// The wall clock jumps a day ahead while the new containers hold for minReadySeconds: the
/// hold is still served in full, and no deadline is overdue at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wall_clock_jumping_ahead_neither_cuts_the_hold_nor_expires_a_deadline() {
    let mut n = node("clockfwd").await;
    n.min_ready_seconds = Some(8);
    n.rolled_and_offline().await;
    n.kill9();
    let offset = start_with_clock(&mut n);
    n.wait_for(30, "the API is up", |n| async move {
        n.http("GET", "/v1/healthz").0 == 200
    })
    .await;
    let (code, _) = n.http("POST", &n.upgrade_path());
    assert_eq!(code, 200);
    n.wait_state(30, &["Verifying"]).await;
    let verifying = Instant::now();
    std::fs::write(&offset, "+1d\n").unwrap();
    let end = n.wait_state(60, TERMINAL).await;
    assert_eq!(end["state"], "Done", "{end}\n{}", n.log());
    assert!(
        verifying.elapsed() >= Duration::from_secs(7),
        "the 8 s hold was served (Verifying seen {:?} before Done)",
        verifying.elapsed()
    );
    n.clean().await;
}

/// The wall clock jumps a day back while a new container never gets ready: its deadline
/// stays where it was, and the upgrade rolls back on time instead of a day later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wall_clock_jumping_back_does_not_move_a_deadline() {
    let mut n = node("clockback").await;
    n.server.modify("pods", "vehicle", "telemetry-sv74m", |p| {
        p["spec"]["containers"][0]["readinessProbe"] = serde_json::json!({
            "exec": {"command": ["sh", "-c", "ps | grep -v grep | grep -q 'from 1.0'"]},
            "periodSeconds": 1, "failureThreshold": 1});
    });
    n.rolled_and_offline().await;
    n.kill9();
    let offset = start_with_clock(&mut n);
    n.wait_for(30, "the API is up", |n| async move {
        n.http("GET", "/v1/healthz").0 == 200
    })
    .await;
    let (code, _) = n.http("POST", &n.upgrade_path());
    assert_eq!(code, 200);
    n.wait_state(30, &["Verifying"]).await;
    std::fs::write(&offset, "-1d\n").unwrap();
    // verify_timeout_secs is 6 and the hold 2: well inside 40 s, unless the jump counted.
    let end = n.wait_state(40, TERMINAL).await;
    assert_eq!(end["state"], "RolledBack", "{end}");
    assert!(
        end["error"]
            .as_str()
            .is_some_and(|e| e.contains("not ready in time")),
        "{end}"
    );
    n.clean().await;
}

/// A registry that accepts connections and never answers.
async fn silent_registry() -> (u16, tokio::task::JoinHandle<()>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = l.accept().await {
            held.push(s);
        }
    });
    (port, task)
}

/// While the upgrade's image pulls (from a registry that never answers), the pod is not the
/// engine's yet: the runtime restarts a container that dies meanwhile. And a second request
/// then is a conflict, even once the registry is gone: 409 before 412.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_images_pull_the_runtime_keeps_the_pod_and_a_second_request_is_409() {
    let mut n = node("pullhold").await;
    let (port, registry) = silent_registry().await;
    n.rolled_to_and_offline(Some(&format!("127.0.0.1:{port}/busybox:9.9")))
        .await;
    // The OTA manager's field tool: --wait follows the request, and gives up at its timeout
    // saying where it stands.
    let out = n
        .cmd(&[
            "upgrade",
            "vehicle/telemetry-sv74m",
            "--wait",
            "--timeout",
            "2",
        ])
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{text}");
    assert!(
        text.starts_with("Start updating pod vehicle/telemetry-sv74m\n")
            && text.contains("gave up after 2s; the upgrade of vehicle/telemetry-sv74m is still "),
        "{text}"
    );
    n.wait_state(30, &["Pulling"]).await;
    let sidecar = n.running("sidecar").await[0].id.clone();
    n.cri.stop_container(&sidecar, 0).await.unwrap();
    n.wait_for(
        60,
        "the runtime restarts the sidecar while the image pulls",
        |n| {
            let old = sidecar.clone();
            async move { n.running("sidecar").await.iter().any(|c| c.id != old) }
        },
    )
    .await;
    assert_eq!(n.state().unwrap()["state"], "Pulling", "still pulling");
    registry.abort();
    let _ = registry.await;
    let (code, body) = n.http("POST", &n.upgrade_path());
    assert_eq!(code, 409, "{body}");
    n.clean().await;
}

/// The runtime goes away in the middle of verifying: the upgrade cannot be observed, but its
/// deadlines still run (Verifying, then the rollback's), so it ends Failed, saying why. When
/// the runtime is back, the runtime removes what the upgrade left and runs the old spec:
/// exactly the revision the journal and the runtime map name runs, in one sandbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runtime_lost_mid_upgrade_ends_failed_and_leaves_one_revision() {
    let (mut n, mut proxy) = behind_proxy("midcri").await;
    n.edit_config(|c| c.replace("[upgrade]\n", "[upgrade]\nrollback_timeout_secs = 5\n"));
    n.rolled_and_offline().await;
    let (code, body) = n.http("POST", &n.upgrade_path());
    assert_eq!(code, 200, "{body}");
    n.wait_state(30, &["Verifying"]).await;
    proxy.cut();
    let end = n.wait_state(60, TERMINAL).await;
    assert_eq!(end["state"], "Failed", "{end}\n{}", n.log());
    assert!(
        end["error"]
            .as_str()
            .is_some_and(|e| e.contains("container runtime")),
        "{end}"
    );
    proxy.restore();
    one_revision_runs(&n, "127.0.0.1:5000/busybox:1.0").await;
    assert!(
        n.containers()
            .await
            .iter()
            .all(|c| !c.labels.contains_key(labels::UPGRADE_ID)),
        "nothing of the failed upgrade is left"
    );
    assert_eq!(
        n.need().unwrap()["status"],
        "True",
        "the runtime map still says the old revision"
    );
    n.clean().await;
}
