//! One edge node for the upgrade tests and benchmark: the edgehub binary with its own node
//! name, data dir and local API, the fake apiserver seeded with the recorded cluster (the
//! `telemetry` pod bound to this node), and the shared containerd of scripts/cri-stack.sh.
#![allow(dead_code)]

use edgehub::cri::{api, labels, CriClient, CriRuntime};
use edgehub_testsupport::FakeApiServer;
use serde_json::Value;
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_edgehub");

/// The pod shapes the upgrade tests run on: the field has both, and the engine broke on the
/// second while every test used the first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// As recorded: host network, a hostPort, an exec readiness probe.
    HostNetwork,
    /// On the pod network (CNI): no hostPort, an httpGet readiness probe the app answers on
    /// port 8080 (the `web` images), and `POD_IP` from the downward API.
    PodNetwork,
    /// As recorded, plus an init container with the app's image (its revisions change both).
    WithInit,
}

impl Shape {
    /// The app's image at a version ("1.0", "2.0") in this shape.
    pub fn image(self, version: &str) -> String {
        match self {
            Shape::HostNetwork | Shape::WithInit => format!("127.0.0.1:5000/busybox:{version}"),
            Shape::PodNetwork => format!("127.0.0.1:5000/web:{version}"),
        }
    }

    /// Turns a telemetry pod spec (the pod's, or a revision template's) into this shape.
    pub fn apply(self, spec: &mut Value) {
        // The image's own command prints its version ("hello from 1.0") and, for the web
        // images, serves HTTP: the new process shows which image it runs.
        if let Some(c) = spec["containers"][0].as_object_mut() {
            c.remove("command");
        }
        match self {
            Shape::HostNetwork => {}
            Shape::WithInit => {
                let image = spec["containers"][0]["image"].clone();
                spec["initContainers"] = serde_json::json!([{"name": "prepare", "image": image,
                    "command": ["sh", "-c", "echo prepared"], "imagePullPolicy": "IfNotPresent",
                    "terminationMessagePath": "/dev/termination-log",
                    "terminationMessagePolicy": "File"}]);
            }
            Shape::PodNetwork => {
                spec["hostNetwork"] = false.into();
                let app = &mut spec["containers"][0];
                for v in ["1.0", "2.0"] {
                    if app["image"] == Shape::HostNetwork.image(v).as_str() {
                        app["image"] = self.image(v).into();
                    }
                }
                app["ports"] =
                    serde_json::json!([{"name": "http", "containerPort": 8080, "protocol": "TCP"}]);
                app["readinessProbe"] = serde_json::json!({
                    "httpGet": {"path": "/", "port": 8080, "scheme": "HTTP"},
                    "periodSeconds": 1, "timeoutSeconds": 1, "successThreshold": 1,
                    "failureThreshold": 3});
                if let Some(env) = app["env"].as_array_mut() {
                    env.push(
                        serde_json::json!({"name": "POD_IP", "valueFrom": {"fieldRef":
                        {"apiVersion": "v1", "fieldPath": "status.podIP"}}}),
                    );
                }
            }
        }
    }
}

pub struct Node {
    pub shape: Shape,
    /// The DaemonSet's minReadySeconds from the roll on (the recorded one has none).
    pub min_ready_seconds: Option<i64>,
    pub server: FakeApiServer,
    pub dir: tempfile::TempDir,
    pub config: PathBuf,
    pub name: String,
    pub api: String,
    pub cri: CriClient,
    pub uid: String,
    pub child: Option<Child>,
}

/// A node of its own (tests share one containerd): the recorded telemetry pod bound to it, a
/// token for its identity, and a config for `edgehub run`.
pub async fn node(tag: &str) -> Node {
    node_shaped(tag, Shape::HostNetwork).await
}

/// As [`node`], with the pod and every revision of its DaemonSet in `shape`.
pub async fn node_shaped(tag: &str, shape: Shape) -> Node {
    let server = FakeApiServer::start().await.unwrap();
    server.seed_recorded_cluster();
    server.remove("pods", "vehicle", "gateway-v9hb2");
    let name = format!("edge-up-{tag}-{}", std::process::id());
    let uid = format!("up-{tag}-{}", std::process::id());
    server.modify("pods", "vehicle", "telemetry-sv74m", |p| {
        p["spec"]["nodeName"] = name.clone().into();
        p["metadata"]["uid"] = uid.clone().into();
        shape.apply(&mut p["spec"]);
    });
    let token = format!("token-{name}");
    server.add_token(&token, &format!("system:node:{name}"));
    let dir = tempfile::tempdir().unwrap();
    let kc = server
        .write_kubeconfig(&dir.path().join("kube"), &token)
        .unwrap();
    let socket = crate::common::cri_stack();
    let api = format!("127.0.0.1:{}", crate::common::free_port());
    let config = dir.path().join("config.toml");
    std::fs::write(
        &config,
        format!(
            // [report] stays the last table: tests append to it (tests/report.rs).
            "node_name = \"{name}\"\napi_addr = \"{api}\"\ndata_dir = \"{}\"\nkubeconfig = \"{}\"\ncri_socket = \"{}\"\n\
             [api]\nsocket = \"{}\"\nsocket_mode = \"0600\"\n\
             [sync]\nbackoff_initial_ms = 50\nbackoff_max_secs = 1\n\
             [upgrade]\nverify_timeout_secs = 6\ninputs_timeout_secs = 5\n\
             [report]\nreconnect_jitter_secs = 2\nretry_max_secs = 4\n",
            dir.path().join("data").display(),
            kc.display(),
            socket.display(),
            dir.path().join("api.sock").display()
        ),
    )
    .unwrap();
    let n = Node {
        shape,
        min_ready_seconds: None,
        server,
        dir,
        config,
        name,
        api,
        cri: CriClient::new(&socket),
        uid,
        child: None,
    };
    n.reshape();
    n
}

impl Node {
    /// Brings the seeded revision of telemetry into the node's shape (before edgehub starts).
    fn reshape(&self) {
        let shape = self.shape;
        self.server.modify(
            "controllerrevisions",
            "vehicle",
            "telemetry-768bcc7446",
            move |c| shape.apply(&mut c["data"]["spec"]["template"]["spec"]),
        );
    }

    /// The operator rolls telemetry to revision 2 (the recorded busybox 2.0), in the shape.
    /// Each revision is shaped before it is applied: a watch event of the recorded template
    /// must never reach edgehub, or the two revisions would differ in more than images.
    pub fn roll(&self) {
        for mut item in edgehub_testsupport::fixture_body("controllerrevisions_list_rev2")["items"]
            .as_array()
            .cloned()
            .unwrap_or_default()
        {
            if item["metadata"]["name"]
                .as_str()
                .is_some_and(|n| n.starts_with("telemetry-"))
            {
                self.shape
                    .apply(&mut item["data"]["spec"]["template"]["spec"]);
            }
            self.server.apply("controllerrevisions", item);
        }
        let mut ds = edgehub_testsupport::fixture_body("daemonset_after_update");
        if let Some(s) = self.min_ready_seconds {
            ds["spec"]["minReadySeconds"] = s.into();
        }
        self.server.apply("daemonsets", ds);
    }

    /// A third revision of telemetry in the node's shape, then edited by `edit`.
    pub fn third_revision_with(&self, tag: &str, edit: impl FnOnce(&mut Value)) -> String {
        let shape = self.shape;
        third_revision_with(&self.server, tag, move |spec| {
            shape.apply(spec);
            edit(spec)
        })
    }

    /// The app's image at `version` in the node's shape.
    pub fn image(&self, version: &str) -> String {
        self.shape.image(version)
    }

    /// The environment of a running container, as `env` prints it.
    pub async fn env_of(&self, id: &str) -> String {
        self.cri
            .exec_sync(id, vec!["env".into()], Duration::from_secs(5))
            .await
            .map(|r| String::from_utf8_lossy(&r.stdout).into_owned())
            .unwrap_or_default()
    }

    /// The pod-network address of a sandbox, as the runtime reports it.
    pub async fn sandbox_ip(&self, id: &str) -> String {
        self.cri
            .pod_sandbox_status(id)
            .await
            .ok()
            .flatten()
            .and_then(|s| s.network)
            .map(|n| n.ip)
            .unwrap_or_default()
    }

    /// Edits the config file edgehub starts with (before a start).
    pub fn edit_config(&self, edit: impl FnOnce(String) -> String) {
        let s = std::fs::read_to_string(&self.config).unwrap();
        std::fs::write(&self.config, edit(s)).unwrap();
    }

    /// The data dir's database path.
    pub fn db(&self) -> PathBuf {
        self.dir.path().join("data/edgehub.db")
    }

    pub fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(BIN);
        c.arg("--config").arg(&self.config).args(args);
        c
    }

    pub fn start(&mut self) {
        self.start_with(None)
    }

    /// `edgehub run`, armed to kill itself at `failpoint`.
    pub fn start_with(&mut self, failpoint: Option<&str>) {
        self.start_cmd(&["run"], failpoint, &[])
    }

    /// `edgehub` with `args`, armed to kill itself at `failpoint`, with `env` added.
    pub fn start_cmd(&mut self, args: &[&str], failpoint: Option<&str>, env: &[(&str, &str)]) {
        let mut cmd = self.cmd(args);
        if let Some(f) = failpoint {
            cmd.env("EDGEHUB_FAILPOINT", f);
        }
        cmd.envs(env.iter().copied());
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

    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("edgehub.log")).unwrap_or_default()
    }

    /// The local API's unix socket (root-only, as the shipped config has it): where the
    /// privileged routes (image loads, the bootstrap token) are served to root.
    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("api.sock")
    }

    /// One request to the local API.
    pub fn http(&self, method: &str, path: &str) -> (u16, String) {
        use std::io::{Read, Write};
        let Ok(mut s) = std::net::TcpStream::connect(&self.api) else {
            return (0, String::new());
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
        let req = format!(
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
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

    /// `POST path` with `body` over the root-only unix socket, where the privileged routes
    /// (image loads) are served to root: (status, body); status 0 when nothing answered. The
    /// body is written beside the read, since edgehub may answer (a 400) before taking it all.
    pub fn post_on_socket(&self, path: &str, body: &[u8]) -> (u16, String) {
        use std::io::{Read, Write};
        let Ok(mut s) = std::os::unix::net::UnixStream::connect(self.socket()) else {
            return (0, String::new());
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(120)));
        let Ok(mut w) = s.try_clone() else {
            return (0, String::new());
        };
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        let body = body.to_vec();
        let writer = std::thread::spawn(move || {
            let _ = w.write_all(head.as_bytes());
            let _ = w.write_all(&body);
        });
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        let _ = writer.join();
        let out = String::from_utf8_lossy(&out);
        let code = out
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        (code, out.split("\r\n\r\n").nth(1).unwrap_or("").to_string())
    }

    pub fn upgrade_path(&self) -> String {
        "/openyurt.io/v1/namespaces/vehicle/pods/telemetry-sv74m/upgrade".into()
    }

    /// The telemetry pod as `GET /pods` serves it.
    pub fn served(&self) -> Option<Value> {
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

    pub fn condition(&self, kind: &str) -> Option<Value> {
        self.served()?["status"]["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == kind)
            .cloned()
    }

    /// The telemetry pod's PodNeedUpgrade condition from `GET /pods`.
    pub fn need(&self) -> Option<Value> {
        self.condition("PodNeedUpgrade")
    }

    pub fn state(&self) -> Option<Value> {
        let (code, body) = self.http("GET", &self.upgrade_path());
        (code == 200)
            .then(|| serde_json::from_str(&body).ok())
            .flatten()
    }

    pub async fn containers(&self) -> Vec<api::Container> {
        self.cri
            .list_containers(HashMap::from([
                (labels::POD_UID.to_string(), self.uid.clone()),
                (labels::NODE.to_string(), self.name.clone()),
            ]))
            .await
            .unwrap_or_default()
    }

    pub async fn running(&self, name: &str) -> Vec<api::Container> {
        self.containers()
            .await
            .into_iter()
            .filter(|c| {
                c.state == api::ContainerState::ContainerRunning as i32
                    && c.labels.get(labels::CONTAINER_NAME).map(String::as_str) == Some(name)
            })
            .collect()
    }

    pub async fn sandboxes(&self) -> Vec<String> {
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

    pub fn pod_log(&self, container: &str, attempt: u32) -> String {
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
    pub async fn rolled_and_offline(&mut self) {
        self.rolled_to_and_offline(None).await
    }

    /// As [`Self::rolled_and_offline`], then on to a third revision whose app image is
    /// `image`, when given.
    pub async fn rolled_to_and_offline(&mut self, image: Option<&str>) {
        self.start();
        self.wait_for(60, "the pod runs", |n| async move {
            n.running("app").await.len() == 1 && n.running("sidecar").await.len() == 1
        })
        .await;
        self.roll();
        let mut want = "controllerrevision: 55778fbb9f".to_string();
        if let Some(image) = image {
            let owned = image.to_string();
            let hash = self.third_revision_with(image, move |spec| {
                spec["containers"][0]["image"] = owned.into();
            });
            want = format!("controllerrevision: {hash}");
        }
        self.offline_when_needed(want).await;
    }

    /// Online and running revision 1; then a third revision edited by `edit`; then offline.
    pub async fn edited_and_offline(&mut self, edit: impl FnOnce(&mut Value)) {
        self.start();
        self.wait_for(60, "the pod runs", |n| async move {
            n.running("app").await.len() == 1 && n.running("sidecar").await.len() == 1
        })
        .await;
        self.roll();
        let hash = self.third_revision_with("edited", edit);
        self.offline_when_needed(format!("controllerrevision: {hash}"))
            .await;
    }

    /// Waits for PodNeedUpgrade True naming `want`, then cuts the link.
    async fn offline_when_needed(&mut self, want: String) {
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
    pub fn queued_event_reasons(&self) -> Vec<String> {
        let Ok(conn) = rusqlite::Connection::open_with_flags(
            self.dir.path().join("data/edgehub.db"),
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
        ) else {
            return Vec::new();
        };
        let mut stmt = conn
            .prepare("SELECT body FROM outbox WHERE kind = 'event'")
            .unwrap();
        stmt.query_map([], |r| r.get::<_, String>(0))
            .unwrap()
            .filter_map(Result::ok)
            .filter_map(|b| serde_json::from_str::<Value>(&b).ok())
            .map(|v| v["reason"].as_str().unwrap_or("").to_string())
            .collect()
    }

    pub async fn wait_for<'a, F, Fut>(&'a self, secs: u64, what: &str, f: F)
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

    pub async fn wait_state(&self, secs: u64, want: &[&str]) -> Value {
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

    pub async fn clean(mut self) {
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

/// A test that fails panics before `clean`: its edgehub must not outlive it, running on and
/// loading the machine for the tests after it.
impl Drop for Node {
    fn drop(&mut self) {
        self.kill9();
        crate::common::unmount_under(self.dir.path());
    }
}

/// A third revision of telemetry whose app runs `image`; returns its hash.
pub fn third_revision(server: &FakeApiServer, image: &str) -> String {
    let owned = image.to_string();
    third_revision_with(server, image, move |spec| {
        spec["containers"][0]["image"] = owned.into();
    })
}

/// A third revision of telemetry, its template's spec edited by `edit`; returns its hash
/// (derived from `tag`).
pub fn third_revision_with(
    server: &FakeApiServer,
    tag: &str,
    edit: impl FnOnce(&mut Value),
) -> String {
    let mut cr = edgehub_testsupport::fixture_body("controllerrevisions_list_rev2")["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["metadata"]["name"] == "telemetry-55778fbb9f")
        .unwrap()
        .clone();
    let hash = format!(
        "r3{:x}",
        tag.len() * 7919 + tag.bytes().map(usize::from).sum::<usize>()
    );
    cr["metadata"]["name"] = format!("telemetry-{hash}").into();
    cr["metadata"]["labels"]["controller-revision-hash"] = hash.clone().into();
    cr["metadata"]["uid"] = format!("uid-{hash}").into();
    cr["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("resourceVersion");
    cr["revision"] = 3.into();
    edit(&mut cr["data"]["spec"]["template"]["spec"]);
    server.apply("controllerrevisions", cr);
    hash
}
