//! What a running edgehub sends about its Node when the link returns: the Lease at once, and a
//! status post only when the Node's watch shows that the cloud changed its Ready meanwhile (the
//! node lifecycle controller's Ready=Unknown after its grace period), as the kubelet, which
//! compares its status with the Node it reads, sends nothing for a cut the controller never saw.

mod common;

use common::wait_until;
use edgehub_testsupport::apiserver::LoggedRequest;
use edgehub_testsupport::{FakeApiServer, NODE_TOKEN};
use serde_json::Value;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_edgehub");

/// A child killed when dropped, so a failing assertion does not leave it running.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

struct Env {
    server: FakeApiServer,
    dir: tempfile::TempDir,
    _edgehub: Running,
}

/// An edgehub run with no pods, its Lease renewed every second, registered and reported
/// Ready, its Node in the cache.
async fn started() -> Env {
    let server = FakeApiServer::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kc = server
        .write_kubeconfig(&dir.path().join("kube"), NODE_TOKEN)
        .unwrap();
    let socket = common::cri_stack();
    let config = dir.path().join("config.toml");
    std::fs::write(
        &config,
        format!(
            "node_name = \"edge-1\"\napi_addr = \"127.0.0.1:0\"\ndata_dir = \"{}\"\n\
             kubeconfig = \"{}\"\ncri_socket = \"{}\"\n\
             [sync]\nbackoff_initial_ms = 50\nbackoff_max_secs = 1\n\
             [node]\nlease_renew_secs = 1\n",
            dir.path().join("data").display(),
            kc.display(),
            socket.display()
        ),
    )
    .unwrap();
    let child = Command::new(BIN)
        .arg("--config")
        .arg(&config)
        .arg("run")
        .env_remove("EDGEHUB_NODE_NAME")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let env = Env {
        server,
        dir,
        _edgehub: Running(child),
    };
    wait_until(20, "the Node reported Ready", || {
        env.server
            .get("nodes", "", "edge-1")
            .is_some_and(|n| ready(&n)["status"] == "True")
    })
    .await;
    wait_until(20, "the Node cached as reported", || {
        cached_ready(&env).is_some_and(|r| r["status"] == "True")
    })
    .await;
    env
}

fn ready(node: &Value) -> Value {
    node["status"]["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == "Ready"))
        .cloned()
        .unwrap_or(Value::Null)
}

/// The Ready condition of the Node in edgehub's cache, read through a second connection.
fn cached_ready(env: &Env) -> Option<Value> {
    let conn = rusqlite::Connection::open_with_flags(
        env.dir.path().join("data/edgehub.db"),
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
    )
    .ok()?;
    let raw: String = conn
        .query_row(
            "SELECT raw FROM objects WHERE kind = 'Node' AND name = 'edge-1'",
            [],
            |r| r.get(0),
        )
        .ok()?;
    Some(ready(&serde_json::from_str(&raw).ok()?))
}

fn status_posts(log: &[LoggedRequest]) -> usize {
    log.iter()
        .filter(|r| r.verb == "patch" && r.resource == "nodes/status")
        .count()
}

/// Cuts the link until edgehub's Lease renewals have failed for a few seconds, applying
/// `meanwhile` to the apiserver's objects during the cut, then restores it and clears the
/// request log.
async fn cut(env: &Env, meanwhile: impl FnOnce(&FakeApiServer)) {
    env.server.set_offline(true).await.unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    meanwhile(&env.server);
    env.server.clear_log();
    env.server.set_offline(false).await.unwrap();
}

#[tokio::test]
async fn a_short_cut_costs_the_lease_and_the_watches_but_no_status_post() {
    let env = started().await;
    cut(&env, |_| {}).await;
    wait_until(20, "the Lease renewed and the Node's watch resumed", || {
        let log = env.server.requests();
        log.iter()
            .any(|r| r.verb == "update" && r.resource == "leases" && r.status == 200)
            && log
                .iter()
                .any(|r| r.verb == "watch" && r.resource == "nodes" && r.status == 200)
    })
    .await;
    // Time for a blind post to show, and for a store change or two to wake the agent.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let log = env.server.requests();
    assert_eq!(
        status_posts(&log),
        0,
        "nothing changed on the Node, so nothing is posted: {:?}",
        log.iter()
            .map(|r| format!("{} {}", r.method, r.path))
            .collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn a_node_the_controller_gave_up_on_during_the_cut_is_ready_again_at_once() {
    let env = started().await;
    cut(&env, |server| {
        // As the node lifecycle controller does after its grace period: every condition
        // Unknown, the last heartbeat kept.
        server.modify("nodes", "", "edge-1", |n| {
            for c in n["status"]["conditions"].as_array_mut().unwrap() {
                c["status"] = "Unknown".into();
                c["reason"] = "NodeStatusUnknown".into();
                c["message"] = "Kubelet stopped posting node status.".into();
            }
        });
    })
    .await;
    wait_until(10, "Ready=True on the Node again", || {
        env.server
            .get("nodes", "", "edge-1")
            .is_some_and(|n| ready(&n)["status"] == "True")
    })
    .await;
    let log = env.server.requests();
    assert_eq!(status_posts(&log), 1, "one status post undoes it");
    let lease = log
        .iter()
        .position(|r| r.verb == "update" && r.resource == "leases")
        .expect("the Lease was renewed");
    let post = log
        .iter()
        .position(|r| r.verb == "patch" && r.resource == "nodes/status")
        .unwrap();
    assert!(lease < post, "the Lease goes first");
}
