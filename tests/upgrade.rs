//! The OTA upgrade end to end, with the edgehub binary, real containerd and the fake
//! apiserver seeded with the recorded cluster: the operator rolls the `telemetry` DaemonSet
//! to busybox 2.0, the link goes down, and the OTA manager asks for the upgrade. Needs root;
//! without it these tests fail, loudly.

mod common;

use edgehub::cri::{api, labels, CriClient, CriRuntime};
use edgehub_testsupport::FakeApiServer;
use serde_json::Value;
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_edgehub");

struct Node {
    server: FakeApiServer,
    dir: tempfile::TempDir,
    config: PathBuf,
    name: String,
    api: String,
    cri: CriClient,
    uid: String,
    child: Option<Child>,
}

/// A node of its own (tests share one containerd): the recorded telemetry pod bound to it, a
/// token for its identity, and a config for `edgehub run`.
async fn node(tag: &str) -> Node {
    let server = FakeApiServer::start().await.unwrap();
    server.seed_recorded_cluster();
    server.remove("pods", "vehicle", "gateway-v9hb2");
    let name = format!("edge-up-{tag}-{}", std::process::id());
    let uid = format!("up-{tag}-{}", std::process::id());
    server.modify("pods", "vehicle", "telemetry-sv74m", |p| {
        p["spec"]["nodeName"] = name.clone().into();
        p["metadata"]["uid"] = uid.clone().into();
        // The image's own command prints its version ("hello from 1.0"), so the new process
        // shows which image it runs.
        if let Some(c) = p["spec"]["containers"][0].as_object_mut() {
            c.remove("command");
        }
    });
    let token = format!("token-{name}");
    server.add_token(&token, &format!("system:node:{name}"));
    let dir = tempfile::tempdir().unwrap();
    let kc = server
        .write_kubeconfig(&dir.path().join("kube"), &token)
        .unwrap();
    let socket = common::cri_stack();
    let api = format!("127.0.0.1:{}", common::free_port());
    let config = dir.path().join("config.toml");
    std::fs::write(
        &config,
        format!(
            "node_name = \"{name}\"\napi_addr = \"{api}\"\ndata_dir = \"{}\"\nkubeconfig = \"{}\"\ncri_socket = \"{}\"\n\
             [sync]\nbackoff_initial_ms = 50\nbackoff_max_secs = 1\n\
             [upgrade]\nverify_timeout_secs = 6\n",
            dir.path().join("data").display(),
            kc.display(),
            socket.display()
        ),
    )
    .unwrap();
    Node {
        server,
        dir,
        config,
        name,
        api,
        cri: CriClient::new(&socket),
        uid,
        child: None,
    }
}

impl Node {
    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(BIN);
        c.arg("--config").arg(&self.config).args(args);
        c
    }

    fn start(&mut self) {
        self.start_with(None)
    }

    /// `edgehub run`, armed to kill itself at `failpoint`.
    fn start_with(&mut self, failpoint: Option<&str>) {
        let mut cmd = self.cmd(&["run"]);
        if let Some(f) = failpoint {
            cmd.env("EDGEHUB_FAILPOINT", f);
        }
        let child = cmd
            .stdout(Stdio::null())
            .stderr(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(self.dir.path().join("edgehub.log"))
                    .unwrap(),
            )
            .spawn()
            .unwrap();
        self.child = Some(child);
    }

    fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("edgehub.log")).unwrap_or_default()
    }

    /// One request to the local API.
    fn http(&self, method: &str, path: &str) -> (u16, String) {
        use std::io::{Read, Write};
        let Ok(mut s) = std::net::TcpStream::connect(&self.api) else {
            return (0, String::new());
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
        let req = format!(
            "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        );
        if s.write_all(req.as_bytes()).is_err() {
            return (0, String::new());
        }
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        let code = out
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let body = out.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
        (code, body)
    }

    fn upgrade_path(&self) -> String {
        "/openyurt.io/v1/namespaces/vehicle/pods/telemetry-sv74m/upgrade".into()
    }

    /// The telemetry pod as `GET /pods` serves it.
    fn served(&self) -> Option<Value> {
        let (code, body) = self.http("GET", "/pods");
        if code != 200 {
            return None;
        }
        let list: Value = serde_json::from_str(&body).ok()?;
        list["items"]
            .as_array()?
            .iter()
            .find(|p| p["metadata"]["name"] == "telemetry-sv74m")
            .cloned()
    }

    fn condition(&self, kind: &str) -> Option<Value> {
        self.served()?["status"]["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == kind)
            .cloned()
    }

    /// The telemetry pod's PodNeedUpgrade condition from `GET /pods`.
    fn need(&self) -> Option<Value> {
        self.condition("PodNeedUpgrade")
    }

    fn state(&self) -> Option<Value> {
        let (code, body) = self.http("GET", &self.upgrade_path());
        (code == 200)
            .then(|| serde_json::from_str(&body).ok())
            .flatten()
    }

    async fn containers(&self) -> Vec<api::Container> {
        self.cri
            .list_containers(HashMap::from([
                (labels::POD_UID.to_string(), self.uid.clone()),
                (labels::NODE.to_string(), self.name.clone()),
            ]))
            .await
            .unwrap_or_default()
    }

    async fn running(&self, name: &str) -> Vec<api::Container> {
        self.containers()
            .await
            .into_iter()
            .filter(|c| {
                c.state == api::ContainerState::ContainerRunning as i32
                    && c.labels.get(labels::CONTAINER_NAME).map(String::as_str) == Some(name)
            })
            .collect()
    }

    async fn sandboxes(&self) -> Vec<String> {
        self.cri
            .list_pod_sandbox(HashMap::from([(
                labels::NODE.to_string(),
                self.name.clone(),
            )]))
            .await
            .unwrap_or_default()
            .into_iter()
            .filter(|s| s.state == api::PodSandboxState::SandboxReady as i32)
            .map(|s| s.id)
            .collect()
    }

    fn pod_log(&self, container: &str, attempt: u32) -> String {
        std::fs::read_to_string(
            self.dir
                .path()
                .join("data/pods")
                .join(&self.uid)
                .join("logs")
                .join(format!("{container}_{attempt}.log")),
        )
        .unwrap_or_default()
    }

    /// Online, running the pod at revision 1; then the operator rolls to revision 2, edgehub
    /// sees it, and the link goes down.
    async fn rolled_and_offline(&mut self) {
        self.rolled_to_and_offline(None).await
    }

    /// As [`Self::rolled_and_offline`], then on to a third revision whose app image is
    /// `image`, when given.
    async fn rolled_to_and_offline(&mut self, image: Option<&str>) {
        self.start();
        self.wait_for(60, "the pod runs", |n| async move {
            n.running("app").await.len() == 1 && n.running("sidecar").await.len() == 1
        })
        .await;
        self.server.roll_telemetry();
        let mut want = "controllerrevision: 55778fbb9f".to_string();
        if let Some(image) = image {
            want = format!(
                "controllerrevision: {}",
                third_revision(&self.server, image)
            );
        }
        let want = &want;
        self.wait_for(
            30,
            "PodNeedUpgrade True for the newest revision",
            |n| async move {
                n.need()
                    .is_some_and(|c| c["status"] == "True" && c["message"] == want.as_str())
            },
        )
        .await;
        self.server.set_offline(true).await.unwrap();
    }

    /// The edgehub database, read through a second connection.
    fn queued_event_reasons(&self) -> Vec<String> {
        let Ok(conn) = rusqlite::Connection::open_with_flags(
            self.dir.path().join("data/edgehub.db"),
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
        ) else {
            return Vec::new();
        };
        let mut stmt = conn.prepare("SELECT body FROM event_queue").unwrap();
        stmt.query_map([], |r| r.get::<_, String>(0))
            .unwrap()
            .filter_map(Result::ok)
            .filter_map(|b| serde_json::from_str::<Value>(&b).ok())
            .map(|v| v["reason"].as_str().unwrap_or("").to_string())
            .collect()
    }

    async fn wait_for<'a, F, Fut>(&'a self, secs: u64, what: &str, f: F)
    where
        F: Fn(&'a Node) -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let deadline = Instant::now() + Duration::from_secs(secs);
        while !f(self).await {
            assert!(
                Instant::now() < deadline,
                "timed out after {secs}s waiting for: {what}\nedgehub log:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn wait_state(&self, secs: u64, want: &[&str]) -> Value {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            if let Some(s) = self.state() {
                if want.iter().any(|w| s["state"] == *w) {
                    return s;
                }
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {want:?}; last {:?}\nedgehub log:\n{}",
                self.state(),
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn clean(mut self) {
        self.kill9();
        for sb in self
            .cri
            .list_pod_sandbox(HashMap::from([(
                labels::NODE.to_string(),
                self.name.clone(),
            )]))
            .await
            .unwrap_or_default()
        {
            let _ = self.cri.stop_pod_sandbox(&sb.id).await;
            let _ = self.cri.remove_pod_sandbox(&sb.id).await;
        }
    }
}

/// A third revision of telemetry whose app runs `image`; returns its hash.
fn third_revision(server: &FakeApiServer, image: &str) -> String {
    let mut cr = edgehub_testsupport::fixture_body("controllerrevisions_list_rev2")["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["metadata"]["name"] == "telemetry-55778fbb9f")
        .unwrap()
        .clone();
    let hash = format!(
        "r3{:x}",
        image.len() * 7919 + image.bytes().map(usize::from).sum::<usize>()
    );
    cr["metadata"]["name"] = format!("telemetry-{hash}").into();
    cr["metadata"]["labels"]["controller-revision-hash"] = hash.clone().into();
    cr["metadata"]["uid"] = format!("uid-{hash}").into();
    cr["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("resourceVersion");
    cr["revision"] = 3.into();
    cr["data"]["spec"]["template"]["spec"]["containers"][0]["image"] = image.into();
    server.apply("controllerrevisions", cr);
    hash
}

/// busybox 1.0 -> 2.0 with the link down: only the changed container is replaced, in the
/// same sandbox; the new process prints the new line; `GET /pods` says the pod is current.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offline_upgrade_swaps_the_changed_container_in_place() {
    let mut n = node("inplace").await;
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
    assert_eq!(
        app[0].image.as_ref().unwrap().image,
        "127.0.0.1:5000/busybox:2.0"
    );
    let attempt = app[0].metadata.as_ref().unwrap().attempt;
    n.wait_for(10, "the new process prints the new line", |n| async move {
        n.pod_log("app", attempt).contains("hello from 2.0")
    })
    .await;
    assert_eq!(n.sandboxes().await, sandboxes, "same sandbox (and pod IP)");
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
                .any(|c| c["name"] == "app" && c["image"] == "127.0.0.1:5000/busybox:2.0")
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
    let mut n = node("crash").await;
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
    assert_eq!(
        app[0].image.as_ref().unwrap().image,
        "127.0.0.1:5000/busybox:1.0"
    );
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

/// Kills edgehub (SIGKILL, as a power cut would) the moment each point of an upgrade is
/// reached, restarts it, and checks the end: the journal is terminal, exactly one container
/// runs per name (of one revision), nothing the upgrade made is left over, and the report is
/// queued.
async fn crash_at(point: &str, image: Option<&str>, want: &str) {
    let tag = point.rsplit(':').next().unwrap_or(point).to_lowercase();
    let mut n = node(&format!(
        "cp{}{tag}",
        if image.is_some() { "rb" } else { "" }
    ))
    .await;
    n.rolled_to_and_offline(image).await;
    n.kill9();
    n.start_with(Some(point));
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
            "{point} was never reached\n{}",
            n.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Power back: the engine finishes or rolls back from the journal and the runtime.
    n.start();
    let end = n.wait_state(90, &["Done", "RolledBack", "Failed"]).await;
    assert_eq!(end["state"], want, "{point}: {end}\n{}", n.log());
    n.wait_for(
        20,
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
    let expected = if want == "Done" {
        "127.0.0.1:5000/busybox:2.0"
    } else {
        "127.0.0.1:5000/busybox:1.0"
    };
    assert_eq!(
        image, expected,
        "{point}: exactly one revision runs, the journal's"
    );
    assert_eq!(n.sandboxes().await.len(), 1, "{point}: one sandbox");
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_at_any_point_of_an_upgrade_ends_in_one_revision() {
    let points = [
        "upgrade:after:Pulling",
        "upgrade:after:Swapping",
        "upgrade:step:CreateNew",
        "upgrade:step:StopOld",
        "upgrade:step:Start",
        "upgrade:after:Verifying",
        "upgrade:step:MarkReady",
        "upgrade:after:Committed",
        "upgrade:step:RemoveOld",
        "upgrade:after:Done",
    ];
    for p in points {
        crash_at(p, None, "Done").await;
    }
    println!("crash points covered on the way to Done: {}", points.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_at_any_point_of_a_rollback_ends_in_the_old_revision() {
    let points = [
        "upgrade:after:RollingBack",
        "upgrade:step:RemoveNew",
        "upgrade:step:RestoreOld",
        "upgrade:after:RolledBack",
    ];
    for p in points {
        crash_at(p, Some("127.0.0.1:5000/busybox:3.0-crash"), "RolledBack").await;
    }
    println!(
        "crash points covered on the way to RolledBack: {}",
        points.len()
    );
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
    n.server.roll_telemetry();
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
