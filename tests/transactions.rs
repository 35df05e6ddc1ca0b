//! Transactions end to end: the OTA manager's two-phase upgrade through edgehub's own CLI
//! (`upgrade --manual-commit`, `commit`, `rollback`), with the edgehub binary, real containerd
//! and the fake apiserver, the link down unless a test says otherwise. Needs root; without it
//! these tests fail, loudly.

mod common;
#[path = "common/edge.rs"]
mod edge;
#[path = "common/txn.rs"]
mod txn;

use edge::{node, node_shaped, Node, Shape};
use edgehub::cri::{api, labels};
use std::time::Duration;

const POD: &str = "vehicle/telemetry-sv74m";
/// The recorded roll's revision (busybox 2.0).
const REV2: &str = "55778fbb9f";
const EXITED: i32 = api::ContainerState::ContainerExited as i32;

fn tag(shape: Shape) -> &'static str {
    match shape {
        Shape::HostNetwork => "hn",
        Shape::PodNetwork => "pn",
        Shape::WithInit => "in",
    }
}

/// Adds a variable to the app container's environment (a change beyond images: recreate).
fn add_env(spec: &mut serde_json::Value) {
    let app = &mut spec["containers"][0];
    if !app["env"].is_array() {
        app["env"] = serde_json::json!([]);
    }
    app["env"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({"name": "LEVEL", "value": "debug"}));
}

/// The containers this upgrade made, by its label.
async fn upgrade_made(n: &Node) -> usize {
    n.containers()
        .await
        .iter()
        .filter(|c| c.labels.contains_key(labels::UPGRADE_ID))
        .count()
}

/// A good transaction stops at Verified with the old container kept, tells the cloud only that
/// it started, and stays there; the commit removes the old revision, queues UpgradeSucceeded,
/// and is idempotent; after an offline restart the new revision still runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_good_transaction_waits_at_verified_then_commits_and_survives_a_restart() {
    let mut n = node("txgood").await;
    n.rolled_and_offline().await;
    let (_, old) = txn::app(&n).await;
    let (id, ran) = txn::start(&n, &[&format!("{POD}@{REV2}")], &["--wait"]).await;
    assert!(ran.ok, "{}\n{}", ran.stderr, n.log());
    let id = id.expect("the transaction id alone on stdout's first line");
    assert_eq!(ran.stdout.lines().count(), 1, "{}", ran.stdout);
    let t = txn::get(&n, &id).unwrap();
    assert_eq!(t["state"], "Verified", "{t}");
    assert_eq!(t["pods"][0]["state"], "Verified");
    assert!(
        t["commitDeadlineLeftSeconds"].as_i64().unwrap() > 1700,
        "{t}"
    );
    let (image, new) = txn::app(&n).await;
    assert_eq!(image, n.image("2.0"));
    let all = n.containers().await;
    let kept = all
        .iter()
        .find(|c| c.id == old)
        .expect("the old container is kept");
    assert_eq!(kept.state, EXITED, "stopped, not removed");
    let reasons = txn::reasons(&n);
    assert!(reasons.iter().any(|r| r == "UpgradeStarted"), "{reasons:?}");
    assert!(
        !reasons.iter().any(|r| r == "UpgradeSucceeded"),
        "{reasons:?}"
    );
    assert_eq!(n.need().unwrap()["status"], "True", "not committed yet");
    // Nothing commits by itself.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(txn::get(&n, &id).unwrap()["state"], "Verified");
    // Listed.
    let list = txn::cli(&n, &["transactions"]).await;
    assert!(
        list.ok && list.stdout.contains(&id) && list.stdout.contains("Verified"),
        "{}",
        list.stdout
    );

    let ran = txn::cli(&n, &["commit", &id]).await;
    assert!(ran.ok, "{}\n{}", ran.stderr, n.log());
    let t = txn::get(&n, &id).unwrap();
    assert_eq!(t["state"], "Committed", "{t}");
    assert_eq!(t["pods"][0]["state"], "Done");
    assert!(
        n.containers().await.iter().all(|c| c.id != old),
        "the old one is gone"
    );
    assert!(txn::reasons(&n).iter().any(|r| r == "UpgradeSucceeded"));
    assert_eq!(n.need().unwrap()["status"], "False");
    // The manager asks again after its own crash: still success. A rollback now: refused.
    assert!(txn::cli(&n, &["commit", &id]).await.ok);
    let ran = txn::cli(&n, &["rollback", &id]).await;
    assert!(
        !ran.ok && ran.stderr.contains("committed"),
        "{}",
        ran.stderr
    );

    // An offline restart: the new revision runs on, untouched.
    n.kill9();
    n.start();
    n.wait_for(30, "the API is up", |n| async move {
        n.http("GET", "/v1/healthz").0 == 200
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(txn::app(&n).await, (n.image("2.0"), new));
    n.clean().await;
}

/// A new image that never passes its readiness probe: the transaction rolls back by itself,
/// and `--wait` fails with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_failing_its_readiness_probe_rolls_back_and_wait_says_why() {
    let mut n = node("txunready").await;
    // Ready only while the process that prints "from 1.0" runs.
    n.server.modify("pods", "vehicle", "telemetry-sv74m", |p| {
        p["spec"]["containers"][0]["readinessProbe"] = serde_json::json!({
            "exec": {"command": ["sh", "-c", "ps | grep -v grep | grep -q 'from 1.0'"]},
            "periodSeconds": 1, "failureThreshold": 1});
    });
    n.rolled_and_offline().await;
    let (id, ran) = txn::start(&n, &[POD], &["--wait"]).await;
    assert!(!ran.ok, "{}", ran.stdout);
    assert!(id.is_some(), "accepted first: {}", ran.stdout);
    assert!(
        ran.stderr.contains("ended RolledBack") && ran.stderr.contains("not ready in time: app"),
        "{}",
        ran.stderr
    );
    let (image, _) = txn::app(&n).await;
    assert_eq!(image, n.image("1.0"));
    assert_eq!(upgrade_made(&n).await, 0);
    let events = txn::queued_events(&n);
    assert!(
        events
            .iter()
            .any(|(r, m)| r == "UpgradeRolledBack" && m.contains("not ready in time: app")),
        "{events:?}"
    );
    assert_eq!(n.need().unwrap()["status"], "True");
    n.clean().await;
}

/// `edgehub rollback` from Verified brings the old revision back from what was kept, verified:
/// in place the old spec runs again in the same sandbox; a recreate goes back into the old
/// sandbox, kept running with its containers stopped (same address on the pod network).
async fn rolls_back_from_verified(shape: Shape, recreate: bool) {
    let mut n = node_shaped(
        &format!("txrb{}{}", tag(shape), if recreate { "r" } else { "" }),
        shape,
    )
    .await;
    if recreate {
        n.edited_and_offline(add_env).await;
    } else {
        n.rolled_and_offline().await;
    }
    let sandboxes = n.sandboxes().await;
    assert_eq!(sandboxes.len(), 1);
    let ip = n.sandbox_ip(&sandboxes[0]).await;
    let (_, old) = txn::app(&n).await;
    let (id, ran) = txn::start(&n, &[POD], &["--wait"]).await;
    assert!(ran.ok, "{}\n{}", ran.stderr, n.log());
    let id = id.unwrap();
    let (_, new) = txn::app(&n).await;
    assert_ne!(new, old);
    if recreate {
        let now = n.sandboxes().await;
        assert_eq!(now.len(), 2, "the old sandbox is kept running");
        assert!(now.contains(&sandboxes[0]));
        let all = n.containers().await;
        let was = all.iter().find(|c| c.id == old).unwrap();
        assert_eq!(was.state, EXITED, "its containers stopped");
    }
    let ran = txn::cli(
        &n,
        &[
            "rollback",
            &id,
            "--reason",
            "the root filesystem failed its health check",
        ],
    )
    .await;
    assert!(ran.ok, "{}\n{}", ran.stderr, n.log());
    let t = txn::get(&n, &id).unwrap();
    assert_eq!(t["state"], "RolledBack", "{t}");
    assert_eq!(t["reason"], "the root filesystem failed its health check");
    let (image, back) = txn::app(&n).await;
    assert_eq!(image, n.image("1.0"));
    assert_eq!(n.sandboxes().await, sandboxes, "the same sandbox");
    if shape == Shape::PodNetwork {
        let env = n.env_of(&back).await;
        assert!(
            env.lines().any(|l| l == format!("POD_IP={ip}")),
            "the old address {ip}:\n{env}"
        );
    }
    if recreate {
        assert!(
            !n.env_of(&back).await.contains("LEVEL=debug"),
            "the old spec"
        );
    }
    assert_eq!(upgrade_made(&n).await, 0, "what the upgrade made is gone");
    assert_eq!(n.running("sidecar").await.len(), 1);
    let events = txn::queued_events(&n);
    assert!(
        events.iter().any(|(r, m)| r == "UpgradeRolledBack"
            && m.contains("the root filesystem failed its health check")),
        "the manager's reason reaches the cloud: {events:?}"
    );
    assert!(!events.iter().any(|(r, _)| r == "UpgradeSucceeded"));
    assert_eq!(n.need().unwrap()["status"], "True");
    // The runtime has the pod back and leaves it as it is.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(txn::app(&n).await.1, back);
    // Asked again: success.
    assert!(txn::cli(&n, &["rollback", &id]).await.ok);
    n.clean().await;
}

/// In place, host network, an exec readiness probe.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_from_verified_in_place_restores_the_old_container() {
    rolls_back_from_verified(Shape::HostNetwork, false).await
}

/// In place on the pod network, an HTTP readiness probe: the restored container has the pod's
/// address again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_from_verified_in_place_on_the_pod_network() {
    rolls_back_from_verified(Shape::PodNetwork, false).await
}

/// In place with an init container whose image changes too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_from_verified_in_place_with_an_init_container() {
    rolls_back_from_verified(Shape::WithInit, false).await
}

/// Recreate, host network: the old sandbox stays, its containers stopped, and the rollback
/// runs the old spec in it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_from_verified_of_a_recreate_goes_back_into_the_kept_sandbox() {
    rolls_back_from_verified(Shape::HostNetwork, true).await
}

/// Recreate on the pod network: back in the kept sandbox, at its address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_from_verified_of_a_recreate_on_the_pod_network_keeps_the_address() {
    rolls_back_from_verified(Shape::PodNetwork, true).await
}

/// A transaction nobody commits rolls back when its deadline passes, as a bootloader falls back
/// to the old slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unconfirmed_transaction_rolls_back_at_its_deadline() {
    let mut n = node("txdeadline").await;
    n.rolled_and_offline().await;
    let (id, ran) = txn::start(&n, &[POD], &["--timeout", "5s", "--wait"]).await;
    assert!(ran.ok, "{}\n{}", ran.stderr, n.log());
    let id = id.unwrap();
    let t = txn::get(&n, &id).unwrap();
    assert_eq!(t["commitTimeoutSeconds"], 5);
    let t = txn::wait(&n, &id, 60, &["RolledBack", "Failed"]).await;
    assert_eq!(t["state"], "RolledBack", "{t}");
    assert_eq!(t["reason"], "not committed within 5s");
    assert_eq!(txn::app(&n).await.0, n.image("1.0"));
    let ran = txn::cli(&n, &["commit", &id]).await;
    assert!(
        !ran.ok && ran.stderr.contains("not committed within 5s"),
        "{}",
        ran.stderr
    );
    n.clean().await;
}
