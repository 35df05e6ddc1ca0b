//! What the OTA manager tests share (tests/mender.rs, tests/swupdate.rs): a node running the
//! real edgehub against the fake apiserver and the shared containerd, its pods rolled to
//! revisions whose images no registry has (they come as archives in the update), the link
//! down, and edgehub's API as shipped: TCP and a root-only unix socket, over which the managers
//! (root) run edgehub's CLI for the privileged requests (image loads, transactions).
#![allow(dead_code)]

use crate::archive;
use crate::edge::{self, Node};
use edgehub::cri::{api, labels, CriRuntime};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub const EDGEHUB: &str = env!("CARGO_BIN_EXE_edgehub");

pub fn repo(p: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(p)
}

/// The readiness probe of every revision's app: ready unless its image says it is broken
/// (the side-loaded images carry their line in /etc/image-id; the registry's have none).
const PROBE: &str = r#"case "$(cat /etc/image-id 2>/dev/null)" in *broken*) exit 1;; esac"#;

fn probe(spec: &mut Value) {
    spec["containers"][0]["readinessProbe"] = json!({"exec": {"command": ["sh", "-c", PROBE]},
        "periodSeconds": 1, "timeoutSeconds": 1, "successThreshold": 1, "failureThreshold": 1});
}

/// What a pod's new image does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Image {
    /// Runs and passes its readiness probe.
    Good,
    /// Runs and never passes it.
    Broken,
}

/// One pod of the update.
pub struct Pod {
    pub name: &'static str,
    pub uid: String,
    /// What the app container runs now (revision 1, from the registry).
    pub old_image: String,
    /// What the update brings (a side-loaded archive).
    pub new_image: String,
    /// The ControllerRevision hash the update reaches.
    pub hash: String,
    pub archive: PathBuf,
}

impl Pod {
    /// NAMESPACE/POD, as the manifest names it.
    pub fn target(&self) -> String {
        format!("vehicle/{}", self.name)
    }
}

pub struct Fleet {
    pub n: Node,
    pub pods: Vec<Pod>,
    pub socket: PathBuf,
    /// Archives and whatever else the test builds.
    pub work: tempfile::TempDir,
}

/// The gateway pod of the recorded cluster, bound to `node`.
fn gateway_pod(node: &str, uid: &str) -> Value {
    let mut pod = edgehub_testsupport::fixture_body("pods_list_node")["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["metadata"]["name"] == "gateway-v9hb2")
        .unwrap()
        .clone();
    pod["spec"]["nodeName"] = node.into();
    pod["metadata"]["uid"] = uid.into();
    pod["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("resourceVersion");
    probe(&mut pod["spec"]);
    pod
}

/// A node whose pods (telemetry, and gateway when `images` has two) are at revision 1 and
/// need an upgrade to a revision whose app image is one of `images`, built as an archive no
/// registry has; edgehub runs, offline.
pub async fn fleet(tag: &str, images: &[Image]) -> Fleet {
    assert!(!images.is_empty() && images.len() <= 2);
    // The node's API as the shipped config has it: TCP, and the root-only unix socket the CLI
    // sends the privileged requests (image loads, transactions) over.
    let mut n = edge::node(tag).await;
    let socket = n.socket();
    let gw_uid = format!("gw-{tag}-{}", std::process::id());
    n.server.modify("pods", "vehicle", "telemetry-sv74m", |p| {
        probe(&mut p["spec"])
    });
    n.server.modify(
        "controllerrevisions",
        "vehicle",
        "telemetry-768bcc7446",
        |c| probe(&mut c["data"]["spec"]["template"]["spec"]),
    );
    if images.len() == 2 {
        n.server.apply("pods", gateway_pod(&n.name, &gw_uid));
        n.server.modify(
            "controllerrevisions",
            "vehicle",
            "gateway-6c4d5f8b7c",
            |c| probe(&mut c["data"]["spec"]["template"]["spec"]),
        );
    }
    let work = tempfile::tempdir().unwrap();
    let fleet_tag = format!("ota-{tag}-{}", std::process::id());
    let mut pods = Vec::new();
    for (i, (name, uid)) in [
        ("telemetry-sv74m", n.uid.clone()),
        ("gateway-v9hb2", gw_uid),
    ]
    .into_iter()
    .take(images.len())
    .enumerate()
    {
        let short = name.split('-').next().unwrap();
        let new_image = format!("127.0.0.1:1/{fleet_tag}-{short}:3.0");
        let line = match images[i] {
            Image::Good => format!("hello from 3.0 ({short})"),
            Image::Broken => format!("hello from 3.0 ({short}, broken)"),
        };
        let dir = work.path().join(short);
        std::fs::create_dir_all(&dir).unwrap();
        let built = archive::build(&dir, &new_image, &line, 0);
        let archive = archive::oci_archive(&built, &work.path().join(format!("{short}-3.0.tar")));
        pods.push(Pod {
            name,
            uid,
            old_image: "127.0.0.1:5000/busybox:1.0".into(),
            new_image,
            hash: String::new(),
            archive,
        });
    }

    n.start();
    let f = Fleet {
        n,
        pods,
        socket,
        work,
    };
    f.wait_for(60, "every pod runs its old revision", |f| async move {
        for p in &f.pods {
            if f.app_images(p).await != [p.old_image.clone()] {
                return false;
            }
        }
        true
    })
    .await;
    let mut f = f;
    f.n.roll();
    // The revisions the update brings: telemetry's third, gateway's second.
    let image = f.pods[0].new_image.clone();
    f.pods[0].hash = f.n.third_revision_with(&fleet_tag, move |spec| {
        spec["containers"][0]["image"] = image.into();
        probe(spec);
    });
    if f.pods.len() == 2 {
        let mut cr =
            f.n.server
                .get("controllerrevisions", "vehicle", "gateway-6c4d5f8b7c")
                .unwrap();
        let hash = format!("g2{:x}", fleet_tag.len() * 131 + 7);
        cr["metadata"]["name"] = format!("gateway-{hash}").into();
        cr["metadata"]["labels"]["controller-revision-hash"] = hash.clone().into();
        cr["metadata"]["uid"] = format!("uid-gateway-{hash}").into();
        cr["metadata"]
            .as_object_mut()
            .unwrap()
            .remove("resourceVersion");
        cr["revision"] = 2.into();
        cr["data"]["spec"]["template"]["spec"]["containers"][0]["image"] =
            f.pods[1].new_image.clone().into();
        f.n.server.apply("controllerrevisions", cr);
        f.pods[1].hash = hash;
    }
    f.wait_for(
        30,
        "PodNeedUpgrade True for the new revisions",
        |f| async move {
            f.pods.iter().all(|p| {
                f.need(p).is_some_and(|c| {
                    c["status"] == "True"
                        && c["message"] == format!("controllerrevision: {}", p.hash).as_str()
                })
            })
        },
    )
    .await;
    f.n.server.set_offline(true).await.unwrap();
    f
}

impl Fleet {
    /// The environment an OTA manager runs the integration in: edgehub's binary and config.
    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            ("EDGEHUB".into(), EDGEHUB.into()),
            ("EDGEHUB_CONFIG".into(), self.n.config.display().to_string()),
        ]
    }

    /// The manifest's targets, in order.
    pub fn targets(&self) -> Vec<String> {
        self.pods.iter().map(Pod::target).collect()
    }

    /// The targets with the revision each must reach (`NAMESPACE/POD@HASH`).
    pub fn targets_at(&self) -> Vec<String> {
        self.pods
            .iter()
            .map(|p| format!("{}@{}", p.target(), p.hash))
            .collect()
    }

    pub fn archives(&self) -> Vec<PathBuf> {
        self.pods.iter().map(|p| p.archive.clone()).collect()
    }

    /// One GET on the local API's unix socket: (status, body).
    pub fn get(&self, path: &str) -> Option<(u16, String)> {
        use std::io::{Read, Write};
        let mut s = std::os::unix::net::UnixStream::connect(&self.socket).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
        )
        .ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        let code = out.split(' ').nth(1)?.parse().ok()?;
        let (head, body) = out.split_once("\r\n\r\n")?;
        let body = if head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
        {
            dechunk(body)
        } else {
            body.to_string()
        };
        Some((code, body))
    }

    /// The pod's PodNeedUpgrade condition, as `GET /pods` serves it.
    pub fn need(&self, p: &Pod) -> Option<Value> {
        let (code, body) = self.get("/pods")?;
        if code != 200 {
            return None;
        }
        let list: Value = serde_json::from_str(&body).ok()?;
        list["items"]
            .as_array()?
            .iter()
            .find(|x| x["metadata"]["name"] == p.name)?["status"]["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == "PodNeedUpgrade")
            .cloned()
    }

    /// The images of the pod's running app containers.
    pub async fn app_images(&self, p: &Pod) -> Vec<String> {
        self.n
            .cri
            .list_containers(HashMap::from([
                (labels::POD_UID.to_string(), p.uid.clone()),
                (labels::NODE.to_string(), self.n.name.clone()),
            ]))
            .await
            .unwrap_or_default()
            .into_iter()
            .filter(|c| {
                c.state == api::ContainerState::ContainerRunning as i32
                    && c.labels.get(labels::CONTAINER_NAME).map(String::as_str) == Some("app")
            })
            .filter_map(|c| c.image.map(|i| i.image))
            .collect()
    }

    /// Waits until every pod's app runs exactly `which` (old or new) image, once.
    pub async fn wait_all_run(&self, secs: u64, new: bool) {
        let what = if new { "the new" } else { "the old" };
        self.wait_for(
            secs,
            &format!("every pod runs {what} revision, once"),
            |f| async move {
                for p in &f.pods {
                    let want = if new { &p.new_image } else { &p.old_image };
                    if f.app_images(p).await != [want.clone()] {
                        return false;
                    }
                }
                true
            },
        )
        .await;
    }

    /// `edgehub ARGS...` with the node's config: (success, stdout, stderr).
    pub fn edgehub(&self, args: &[&str]) -> (bool, String, String) {
        let out = self.n.cmd(args).output().unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// Every transaction, as `edgehub transactions --json` prints them (newest first), or why
    /// edgehub did not answer (it may be starting).
    pub fn transactions(&self) -> Result<Vec<Value>, String> {
        let (ok, out, err) = self.edgehub(&["transactions", "--json"]);
        if !ok {
            return Err(err);
        }
        let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
        Ok(v["transactions"].as_array().cloned().unwrap_or_default())
    }

    /// The only transaction, once it is in one of `states`.
    pub async fn wait_transaction(&self, secs: u64, states: &[&str]) -> Value {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let all = self.transactions();
            if let Ok(all) = &all {
                assert!(all.len() <= 1, "one transaction: {all:?}");
                if let Some(t) = all.first() {
                    if states.iter().any(|s| t["state"] == *s) {
                        return t.clone();
                    }
                }
            }
            assert!(
                Instant::now() < deadline,
                "no transaction in {states:?} after {secs}s: {all:?}\nedgehub log:\n{}",
                self.n.log()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// edgehub killed and started again, the link still down.
    pub fn restart(&mut self) {
        self.n.kill9();
        self.n.start();
    }

    /// The link returns; then the cloud has an Event of `reason` for every pod, and each
    /// committed pod's object was deleted for its replacement at the new revision, while a
    /// rolled-back one is still there at its old revision.
    pub async fn link_returns_and_the_cloud_hears(&self, reason: &str, committed: bool) {
        self.n.server.set_offline(false).await.unwrap();
        self.wait_for(
            60,
            &format!("an Event {reason} for every pod"),
            |f| async move {
                let events = f.n.server.list("events");
                f.pods.iter().all(|p| {
                    events
                        .iter()
                        .any(|e| e["reason"] == reason && e["involvedObject"]["name"] == p.name)
                })
            },
        )
        .await;
        for p in &self.pods {
            let pod = self.n.server.get("pods", "vehicle", p.name);
            if committed {
                self.wait_for(
                    30,
                    "the committed pod's object is deleted",
                    |f| async move { f.n.server.get("pods", "vehicle", p.name).is_none() },
                )
                .await;
            } else {
                let pod = pod.unwrap_or_else(|| panic!("{} still exists", p.name));
                assert_ne!(
                    pod["metadata"]["labels"]["controller-revision-hash"],
                    p.hash.as_str(),
                    "{} keeps its old revision",
                    p.name
                );
            }
        }
    }

    pub async fn wait_for<'a, F, Fut>(&'a self, secs: u64, what: &str, f: F)
    where
        F: Fn(&'a Fleet) -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let deadline = Instant::now() + Duration::from_secs(secs);
        while !f(self).await {
            assert!(
                Instant::now() < deadline,
                "timed out after {secs}s waiting for: {what}\nedgehub log:\n{}",
                self.n.log()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    pub async fn clean(self) {
        let Fleet { n, .. } = self;
        n.clean().await;
    }
}

/// The body of a chunked HTTP/1.1 answer.
fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

/// Runs `cmd` with `env`, returning (success, stdout + stderr).
pub fn run(cmd: &mut std::process::Command, env: &[(String, String)]) -> (bool, String) {
    let out = cmd
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .output()
        .unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// Whether `path` names something in `dir`'s tree (for "nothing left" checks).
pub fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                out.extend(files_under(&p));
            } else {
                out.push(p);
            }
        }
    }
    out
}
