//! The project's test apiserver as a standalone program, for the quickstart demo and manual
//! runs: it serves TLS on the given address, seeds the recorded fixtures (the node `edge-1`,
//! its pods, DaemonSets and ControllerRevisions), writes a kubeconfig for edgehub, and runs
//! until interrupted.
//!
//! With `--roll-telemetry-after SECS` it plays the fleet operator: after that many seconds it
//! rolls the `telemetry` DaemonSet to a new image (a second ControllerRevision appears), as the
//! recording did.
//!
//! It also serves what the recorded pods reference (the ConfigMap `telemetry-cfg` and the CA
//! bundles of their token volume) and answers TokenRequests, so edgehub runs them as recorded.
//!
//! It plays the DaemonSet controller's one duty the report needs: a DaemonSet's pod that is
//! deleted is replaced on its node at the update revision. SIGUSR1 cuts the link (the port
//! refuses connections, open ones drop), SIGUSR2 restores it, with the cluster's state kept.
//! An admin token for looking at the cluster with curl is written beside the kubeconfig
//! (`admin-token`).
//!
//! Usage: fake-apiserver [--listen 127.0.0.1:6443] [--kubeconfig-dir DIR] [--roll-telemetry-after SECS]

use edgehub_testsupport::daemonset_sim::{owner_uid, pod_for, update_revision};
use edgehub_testsupport::{FakeApiServer, ADMIN_TOKEN, NODE_TOKEN};
use serde_json::Value;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use tokio::signal::unix::{signal, SignalKind};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut listen = "127.0.0.1:6443".to_string();
    let mut dir = PathBuf::from("fake-apiserver");
    let mut roll_after: Option<u64> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--listen" => listen = args.next().ok_or_else(|| anyhow::anyhow!("--listen needs a value"))?,
            "--kubeconfig-dir" => {
                dir = args.next().ok_or_else(|| anyhow::anyhow!("--kubeconfig-dir needs a value"))?.into()
            }
            "--roll-telemetry-after" => {
                roll_after = Some(
                    args.next()
                        .ok_or_else(|| anyhow::anyhow!("--roll-telemetry-after needs seconds"))?
                        .parse()?,
                )
            }
            other => anyhow::bail!("unknown argument {other:?}; usage: fake-apiserver [--listen ADDR] [--kubeconfig-dir DIR] [--roll-telemetry-after SECS]"),
        }
    }
    let server = Arc::new(FakeApiServer::start_on(listen.parse()?).await?);
    server.seed_recorded_cluster();
    let kc = server.write_kubeconfig(&dir, NODE_TOKEN)?;
    std::fs::write(dir.join("admin-token"), ADMIN_TOKEN)?;
    println!(
        "fake apiserver on {} (node edge-1); kubeconfig: {}",
        server.url(),
        kc.display()
    );
    tokio::spawn(replace_deleted_pods(server.clone()));
    let mut cut = signal(SignalKind::user_defined1())?;
    let mut restore = signal(SignalKind::user_defined2())?;
    let roll = async {
        match roll_after {
            Some(secs) => tokio::time::sleep(std::time::Duration::from_secs(secs)).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(roll);
    let mut rolled = false;
    loop {
        tokio::select! {
            _ = &mut roll, if !rolled => {
                rolled = true;
                server.roll_telemetry();
                println!("operator rolled DaemonSet vehicle/telemetry to 127.0.0.1:5000/busybox:2.0");
            }
            _ = cut.recv() => {
                server.set_offline(true).await?;
                println!("link cut");
            }
            _ = restore.recv() => {
                server.set_offline(false).await?;
                println!("link restored");
            }
            r = tokio::signal::ctrl_c() => return Ok(r?),
        }
    }
}

/// The DaemonSet controller, for deletions only: a pod owned by a DaemonSet that disappears
/// is replaced on its node at the DaemonSet's update revision, under a new name, as
/// fixtures/pods_list_after_delete.json shows.
async fn replace_deleted_pods(server: Arc<FakeApiServer>) {
    // Pod name -> (namespace, DaemonSet uid, node).
    let mut known: HashMap<String, (String, String, String)> = HashMap::new();
    let mut next = 0u32;
    loop {
        let pods = server.list("pods");
        let now: HashMap<String, (String, String, String)> = pods
            .iter()
            .filter_map(|p| {
                let ds = owner_uid(p)?.to_string();
                let node = p.pointer("/spec/nodeName")?.as_str()?.to_string();
                let ns = p.pointer("/metadata/namespace")?.as_str()?.to_string();
                Some((p["metadata"]["name"].as_str()?.to_string(), (ns, ds, node)))
            })
            .collect();
        for (name, (ns, ds_uid, node)) in &known {
            let replaced = now
                .values()
                .any(|(n2, d2, node2)| n2 == ns && d2 == ds_uid && node2 == node);
            if now.contains_key(name) || replaced {
                continue;
            }
            let Some(ds) = server
                .list("daemonsets")
                .into_iter()
                .find(|d| d["metadata"]["uid"].as_str() == Some(ds_uid.as_str()))
            else {
                continue;
            };
            let crs: Vec<Value> = server.list("controllerrevisions");
            let Some(cr) = update_revision(&crs, ds_uid) else {
                continue;
            };
            next += 1;
            let pod = server.apply("pods", pod_for(&ds, &cr, node, &format!("r{next:04}")));
            println!(
                "DaemonSet controller: {ns}/{name} deleted; created {ns}/{} at revision {}",
                pod["metadata"]["name"].as_str().unwrap_or(""),
                pod.pointer("/metadata/labels/controller-revision-hash")
                    .and_then(Value::as_str)
                    .unwrap_or("")
            );
        }
        known = now;
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}
