//! Transactions where the field breaks them: edgehub killed between install and commit, a
//! power cycle while Verified, two pods of which the second fails, what is refused before
//! anything changes, and what the cloud hears when the link returns. The edgehub binary, real
//! containerd and the fake apiserver; needs root, and fails loudly without it.

mod common;
#[path = "common/edge.rs"]
mod edge;
#[path = "common/txn.rs"]
mod txn;

use edge::{node, Node};
use edgehub::cri::CriRuntime;
use serde_json::Value;
use std::collections::HashMap;
use std::time::Duration;

const POD: &str = "vehicle/telemetry-sv74m";
const GATEWAY: &str = "vehicle/gateway-v9hb2";

async fn api_up(n: &Node) {
    n.wait_for(30, "the API is up", |n| async move {
        n.http("GET", "/v1/healthz").0 == 200
    })
    .await;
}

fn left(t: &Value) -> i64 {
    t["commitDeadlineLeftSeconds"]
        .as_i64()
        .expect("a deadline left")
}

/// Killed (as a power cut kills edgehub) between install and commit: after the restart the
/// transaction is still Verified, nothing restarted, its deadline ran on; then a power cycle
/// (every sandbox of the pod stopped, as a reboot leaves them): the new revision runs again,
/// still uncommitted, the deadline where it was; the commit then holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_verified_transaction_survives_a_kill_and_a_power_cycle() {
    let mut n = node("txkill").await;
    n.rolled_and_offline().await;
    let (_, old) = txn::app(&n).await;
    let (id, ran) = txn::start(&n, &[POD], &["--wait"]).await;
    assert!(ran.ok, "{}\n{}", ran.stderr, n.log());
    let id = id.unwrap();
    let (_, new) = txn::app(&n).await;
    let before = left(&txn::get(&n, &id).unwrap());

    n.kill9();
    tokio::time::sleep(Duration::from_secs(2)).await;
    n.start();
    api_up(&n).await;
    let t = txn::get(&n, &id).unwrap();
    assert_eq!(t["state"], "Verified", "{t}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let t = txn::get(&n, &id).unwrap();
    assert_eq!(t["state"], "Verified", "{t}");
    assert!(
        left(&t) < before,
        "the deadline ran on: {} then {}",
        before,
        left(&t)
    );
    assert_eq!(
        txn::app(&n).await,
        (n.image("2.0"), new.clone()),
        "nothing restarted"
    );
    let all = n.containers().await;
    assert!(
        all.iter().any(|c| c.id == old),
        "the old container is still kept"
    );
    assert_eq!(n.sandboxes().await.len(), 1);

    // A power cycle: edgehub and every container and sandbox of the pod stop.
    n.kill9();
    let mid = left(&t);
    for sb in n
        .cri
        .list_pod_sandbox(HashMap::from([(
            edgehub::cri::labels::POD_UID.to_string(),
            n.uid.clone(),
        )]))
        .await
        .unwrap()
    {
        n.cri.stop_pod_sandbox(&sb.id).await.unwrap();
    }
    assert!(n.running("app").await.is_empty());
    n.start();
    api_up(&n).await;
    n.wait_for(60, "the new revision runs again", |n| async move {
        let app = n.running("app").await;
        app.len() == 1 && app[0].image.as_ref().unwrap().image == n.image("2.0")
    })
    .await;
    let t = txn::wait(
        &n,
        &id,
        60,
        &["Verified", "RollingBack", "RolledBack", "Failed"],
    )
    .await;
    assert_eq!(t["state"], "Verified", "{t}\n{}", n.log());
    assert!(left(&t) <= mid, "the deadline did not start over");
    assert_eq!(n.sandboxes().await.len(), 1, "one sandbox runs");
    assert!(!txn::reasons(&n).iter().any(|r| r == "UpgradeSucceeded"));

    let ran = txn::cli(&n, &["commit", &id]).await;
    assert!(ran.ok, "{}\n{}", ran.stderr, n.log());
    let (image, committed) = txn::app(&n).await;
    assert_eq!(image, n.image("2.0"));
    // The runtime keeps the committed revision: nothing is started again.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(txn::app(&n).await.1, committed);
    assert_eq!(n.need().unwrap()["status"], "False");
    n.clean().await;
}

/// The PodNeedUpgrade condition of pod `name` as `GET /pods` serves it.
fn need_of(n: &Node, name: &str) -> Option<Value> {
    let (code, body) = n.http("GET", "/pods");
    if code != 200 {
        return None;
    }
    let list: Value = serde_json::from_str(&body).ok()?;
    list["items"]
        .as_array()?
        .iter()
        .find(|p| p["metadata"]["name"] == name)?["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "PodNeedUpgrade")
        .cloned()
}

async fn app_image_of(n: &Node, uid: &str) -> Vec<String> {
    common::running(&n.cri, uid)
        .await
        .into_iter()
        .filter(|c| c.metadata.as_ref().is_some_and(|m| m.name == "app"))
        .map(|c| c.image.unwrap().image)
        .collect()
}

/// Two pods in one transaction, the second's new image broken: the first is Verified, the
/// second fails, and both end at their old revision; `--wait` names the pod that failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_pods_roll_back_together_when_the_second_fails() {
    let mut n = node("txtwo").await;
    let gw = txn::add_gateway(&n, "127.0.0.1:5000/busybox:3.0-crash");
    n.start();
    n.wait_for(60, "both pods run", |n| {
        let gw = gw.clone();
        async move { n.running("app").await.len() == 1 && app_image_of(n, &gw).await.len() == 1 }
    })
    .await;
    n.roll();
    n.wait_for(30, "both need an upgrade", |n| async move {
        need_of(n, "telemetry-sv74m").is_some_and(|c| c["status"] == "True")
            && need_of(n, "gateway-v9hb2").is_some_and(|c| c["status"] == "True")
    })
    .await;
    n.server.set_offline(true).await.unwrap();
    let (id, ran) = txn::start(&n, &[POD, GATEWAY], &["--wait"]).await;
    assert!(!ran.ok, "{}", ran.stdout);
    let id = id.expect("accepted");
    assert!(
        ran.stderr
            .contains("pod vehicle/gateway-v9hb2: new container app exited with code 3"),
        "{}",
        ran.stderr
    );
    // The first pod was Verified before the second started.
    assert!(
        ran.stderr
            .contains("(vehicle/telemetry-sv74m Verified, vehicle/gateway-v9hb2"),
        "{}",
        ran.stderr
    );
    let t = txn::get(&n, &id).unwrap();
    assert_eq!(t["state"], "RolledBack", "{t}");
    for p in t["pods"].as_array().unwrap() {
        assert_eq!(p["state"], "RolledBack", "{t}");
    }
    assert_eq!(txn::app(&n).await.0, n.image("1.0"));
    n.wait_for(30, "the gateway runs its old image", |n| {
        let gw = gw.clone();
        async move { app_image_of(n, &gw).await == ["127.0.0.1:5000/busybox:1.0"] }
    })
    .await;
    let events = txn::queued_events(&n);
    assert_eq!(
        events
            .iter()
            .filter(|(r, _)| r == "UpgradeRolledBack")
            .count(),
        2,
        "{events:?}"
    );
    assert!(!events.iter().any(|(r, _)| r == "UpgradeSucceeded"));
    n.clean().await;
}

/// What is refused changes nothing: a revision the cloud did not decide (409 naming both), a
/// pod the cache does not know among good ones (404), and a caller without a credential
/// (403 over TCP).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_transaction_changes_nothing() {
    let mut n = node("txrefuse").await;
    n.rolled_and_offline().await;
    let (_, app) = txn::app(&n).await;
    let (id, ran) = txn::start(&n, &[&format!("{POD}@0123abcd")], &[]).await;
    assert!(!ran.ok && id.is_none(), "{}", ran.stdout);
    assert!(
        ran.stderr.contains("0123abcd")
            && ran.stderr.contains("55778fbb9f")
            && ran.stderr.contains("409"),
        "{}",
        ran.stderr
    );
    let (id, ran) = txn::start(&n, &[POD, "vehicle/nope"], &[]).await;
    assert!(
        !ran.ok && id.is_none() && ran.stderr.contains("404"),
        "{}",
        ran.stderr
    );
    let (code, body) = n.http("POST", "/v1/transactions");
    assert_eq!(code, 403, "{body}");
    assert_eq!(
        n.http("GET", "/v1/transactions"),
        (200, r#"{"transactions":[]}"#.to_string())
    );
    assert_eq!(n.state(), None, "no upgrade was recorded");
    let ran = txn::cli(&n, &["commit", "0123456789abcdef"]).await;
    assert!(!ran.ok && ran.stderr.contains("404"), "{}", ran.stderr);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(txn::app(&n).await.1, app, "nothing changed");
    n.clean().await;
}

fn event_at(n: &Node, reason: &str) -> Option<Value> {
    n.server.get(
        "events",
        "vehicle",
        &format!("telemetry-sv74m.edgehub-{}", reason.to_lowercase()),
    )
}

/// The link returns while Verified: the cloud hears the upgrade started, nothing more, and the
/// pod object stays at its old revision; after the commit it hears UpgradeSucceeded and the
/// pod is replaced at the new revision (delete-and-adopt).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cloud_hears_success_only_after_the_commit() {
    let mut n = node("txlinkok").await;
    n.rolled_and_offline().await;
    let (id, ran) = txn::start(&n, &[POD], &["--wait"]).await;
    assert!(ran.ok, "{}\n{}", ran.stderr, n.log());
    let id = id.unwrap();
    n.server.set_offline(false).await.unwrap();
    n.wait_for(30, "UpgradeStarted reaches the cloud", |n| async move {
        event_at(n, "UpgradeStarted").is_some()
    })
    .await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(
        event_at(&n, "UpgradeSucceeded").is_none(),
        "not before the commit"
    );
    let pod = n
        .server
        .get("pods", "vehicle", "telemetry-sv74m")
        .expect("not deleted");
    assert_eq!(
        pod["metadata"]["labels"]["controller-revision-hash"],
        "768bcc7446"
    );

    let ran = txn::cli(&n, &["commit", &id]).await;
    assert!(ran.ok, "{}\n{}", ran.stderr, n.log());
    n.wait_for(30, "UpgradeSucceeded reaches the cloud", |n| async move {
        event_at(n, "UpgradeSucceeded").is_some()
    })
    .await;
    n.wait_for(
        30,
        "the pod is deleted for its replacement",
        |n| async move { n.server.get("pods", "vehicle", "telemetry-sv74m").is_none() },
    )
    .await;
    n.clean().await;
}

/// A rollback from Verified, then the link: the cloud hears UpgradeRolledBack with the
/// manager's reason, the pod object keeps its old revision, and it still needs the upgrade.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cloud_hears_the_managers_reason_for_a_rollback() {
    let mut n = node("txlinkrb").await;
    n.rolled_and_offline().await;
    let (id, ran) = txn::start(&n, &[POD], &["--wait"]).await;
    assert!(ran.ok, "{}\n{}", ran.stderr, n.log());
    let id = id.unwrap();
    let ran = txn::cli(
        &n,
        &["rollback", &id, "--reason", "firmware 4.2 failed to boot"],
    )
    .await;
    assert!(ran.ok, "{}\n{}", ran.stderr, n.log());
    n.server.set_offline(false).await.unwrap();
    n.wait_for(30, "UpgradeRolledBack reaches the cloud", |n| async move {
        event_at(n, "UpgradeRolledBack").is_some()
    })
    .await;
    let ev = event_at(&n, "UpgradeRolledBack").unwrap();
    assert!(
        ev["message"]
            .as_str()
            .unwrap()
            .contains("firmware 4.2 failed to boot"),
        "{ev}"
    );
    assert!(event_at(&n, "UpgradeSucceeded").is_none());
    tokio::time::sleep(Duration::from_secs(3)).await;
    let pod = n
        .server
        .get("pods", "vehicle", "telemetry-sv74m")
        .expect("kept");
    assert_eq!(
        pod["metadata"]["labels"]["controller-revision-hash"],
        "768bcc7446"
    );
    let status = &pod["status"]["containerStatuses"];
    assert!(
        status
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["name"] == "app" && c["image"] == n.image("1.0").as_str()),
        "the revision reported is the one that runs: {status}"
    );
    assert_eq!(n.need().unwrap()["status"], "True");
    n.clean().await;
}
