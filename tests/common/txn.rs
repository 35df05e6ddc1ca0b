//! Transactions as the OTA manager drives them: edgehub's own CLI (`upgrade --manual-commit`,
//! `commit`, `rollback`) against an edge node of `edge.rs`, and what the node queued for the
//! cloud.
#![allow(dead_code)]

use crate::edge::{Node, Shape};
use serde_json::Value;
use std::process::Output;
use std::time::{Duration, Instant};

/// What a CLI run printed.
pub struct Ran {
    pub ok: bool,
    pub stdout: String,
    pub stderr: String,
}

impl From<Output> for Ran {
    fn from(o: Output) -> Ran {
        Ran {
            ok: o.status.success(),
            stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
        }
    }
}

/// `edgehub ARGS` with the node's config (blocking, off the async workers).
pub async fn cli(n: &Node, args: &[&str]) -> Ran {
    let mut cmd = n.cmd(args);
    tokio::task::spawn_blocking(move || cmd.output().expect("edgehub runs").into())
        .await
        .unwrap()
}

/// `edgehub upgrade PODS --manual-commit ARGS`: the transaction id from stdout's first line
/// (when it was accepted), and the run.
pub async fn start(n: &Node, pods: &[&str], args: &[&str]) -> (Option<String>, Ran) {
    let mut all = vec!["upgrade"];
    all.extend_from_slice(pods);
    all.push("--manual-commit");
    all.extend_from_slice(args);
    let ran = cli(n, &all).await;
    let id = ran
        .stdout
        .lines()
        .next()
        .filter(|l| l.len() == 16)
        .map(str::to_string);
    (id, ran)
}

/// `GET /v1/transactions/{id}`.
pub fn get(n: &Node, id: &str) -> Option<Value> {
    let (code, body) = n.http("GET", &format!("/v1/transactions/{id}"));
    (code == 200)
        .then(|| serde_json::from_str(&body).ok())
        .flatten()
}

/// Waits until the transaction is in one of `want`.
pub async fn wait(n: &Node, id: &str, secs: u64, want: &[&str]) -> Value {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(t) = get(n, id) {
            if want.iter().any(|w| t["state"] == *w) {
                return t;
            }
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {want:?}; last {:?}\nedgehub log:\n{}",
            get(n, id),
            n.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The Events queued for the cloud: (reason, message).
pub fn queued_events(n: &Node) -> Vec<(String, String)> {
    let Ok(conn) =
        rusqlite::Connection::open_with_flags(n.db(), rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
    else {
        return Vec::new();
    };
    let mut stmt = conn
        .prepare("SELECT body FROM outbox WHERE kind = 'event' ORDER BY id")
        .unwrap();
    stmt.query_map([], |r| r.get::<_, String>(0))
        .unwrap()
        .filter_map(Result::ok)
        .filter_map(|b| serde_json::from_str::<Value>(&b).ok())
        .map(|v| {
            (
                v["reason"].as_str().unwrap_or("").to_string(),
                v["message"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect()
}

pub fn reasons(n: &Node) -> Vec<String> {
    queued_events(n).into_iter().map(|(r, _)| r).collect()
}

/// The app container's image and id, of the one running.
pub async fn app(n: &Node) -> (String, String) {
    let app = n.running("app").await;
    assert_eq!(app.len(), 1, "one app container runs: {app:?}");
    (
        app[0].image.as_ref().unwrap().image.clone(),
        app[0].id.clone(),
    )
}

/// The recorded gateway pod bound to the node too, in its shape, with a second revision whose
/// app image is `image` (before edgehub starts). Returns its uid.
pub fn add_gateway(n: &Node, image: &str) -> String {
    let list = edgehub_testsupport::fixture_body("pods_list_node");
    let mut gw = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["metadata"]["name"] == "gateway-v9hb2")
        .unwrap()
        .clone();
    let uid = format!("gw-{}", n.uid);
    gw["spec"]["nodeName"] = n.name.clone().into();
    gw["metadata"]["uid"] = uid.clone().into();
    Shape::HostNetwork.apply(&mut gw["spec"]);
    gw["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("resourceVersion");
    n.server.apply("pods", gw);
    n.server.modify(
        "controllerrevisions",
        "vehicle",
        "gateway-6c4d5f8b7c",
        |c| Shape::HostNetwork.apply(&mut c["data"]["spec"]["template"]["spec"]),
    );
    let mut cr = n
        .server
        .get("controllerrevisions", "vehicle", "gateway-6c4d5f8b7c")
        .unwrap();
    cr["metadata"]["name"] = "gateway-r2gw".into();
    cr["metadata"]["labels"]["controller-revision-hash"] = "r2gw".into();
    cr["metadata"]["uid"] = "uid-gateway-r2gw".into();
    cr["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("resourceVersion");
    cr["revision"] = 2.into();
    cr["data"]["spec"]["template"]["spec"]["containers"][0]["image"] = image.into();
    n.server.apply("controllerrevisions", cr);
    uid
}
