//! Helpers shared by the integration tests: an edgehub configuration pointed at a fake
//! apiserver, a sync harness, and polling with a deadline.

#![allow(dead_code)]

use edgehub::config::{Config, Overrides};
use edgehub::kube::ApiClient;
use edgehub::store::{OpenMode, Store};
use edgehub::sync::Sync;
use edgehub_testsupport::{FakeApiServer, NODE_TOKEN};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A config for node edge-1 with fast timers, so tests finish quickly.
pub fn test_config(data_dir: &Path, kubeconfig: &Path) -> Config {
    let toml =
        "[sync]\nbackoff_initial_ms = 50\nbackoff_max_secs = 1\ncursor_checkpoint_secs = 1\n\
                request_timeout_secs = 3\nwatch_idle_timeout_secs = 3\n\
                [report]\nreconnect_jitter_secs = 1\n";
    let flags = Overrides {
        node_name: Some("edge-1".into()),
        data_dir: Some(data_dir.to_path_buf()),
        kubeconfig: Some(kubeconfig.to_path_buf()),
        ..Default::default()
    };
    Config::resolve(Some(toml), Path::new("test.toml"), &[], &flags, None).expect("test config")
}

pub fn client(config: &Config) -> ApiClient {
    config.api_client().expect("client")
}

/// Polls `f` every 20 ms until it is true, or panics after `secs` seconds naming `what`.
pub async fn wait_until(secs: u64, what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !f() {
        if Instant::now() > deadline {
            panic!("timed out after {secs}s waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A fake apiserver, a data dir, and start/stop of the reflectors against one store file.
pub struct Harness {
    pub server: FakeApiServer,
    pub dir: tempfile::TempDir,
    pub config: Config,
    pub store: Option<Arc<Store>>,
    sync: Option<(Sync, tokio::sync::watch::Sender<bool>)>,
}

impl Harness {
    pub async fn new() -> Harness {
        let server = FakeApiServer::start().await.expect("fake apiserver");
        server.seed_recorded_cluster();
        let dir = tempfile::tempdir().expect("tempdir");
        let kc = server
            .write_kubeconfig(&dir.path().join("kube"), NODE_TOKEN)
            .expect("kubeconfig");
        let config = test_config(&dir.path().join("data"), &kc);
        Harness {
            server,
            dir,
            config,
            store: None,
            sync: None,
        }
    }

    pub fn db_path(&self) -> PathBuf {
        self.config.db_path()
    }

    pub fn store(&self) -> &Store {
        self.store.as_deref().expect("store open")
    }

    /// Opens the store (if closed) and starts the reflectors.
    pub fn start(&mut self) {
        if self.store.is_none() {
            self.store = Some(Arc::new(
                Store::open(&self.config.db_path(), OpenMode::Normal).expect("store"),
            ));
        }
        let (tx, rx) = tokio::sync::watch::channel(false);
        let sync = Sync::spawn(
            &self.config.node_name,
            &self.config.sync,
            client(&self.config),
            self.store.clone().expect("store"),
            rx,
        );
        self.sync = Some((sync, tx));
    }

    pub fn sync(&self) -> &Sync {
        &self.sync.as_ref().expect("sync running").0
    }

    /// Stops the reflectors and closes the store, as a process exit would.
    pub async fn stop(&mut self) {
        if let Some((sync, tx)) = self.sync.take() {
            let _ = tx.send(true);
            tokio::time::timeout(Duration::from_secs(10), sync.join())
                .await
                .expect("reflectors stop within 10s");
        }
        self.store = None;
    }

    pub fn count(&self, kind: edgehub::object::Kind) -> u64 {
        self.store().count(kind).expect("count")
    }

    /// The stored resourceVersion of one object.
    pub fn stored_rv(&self, kind: edgehub::object::Kind, ns: &str, name: &str) -> Option<String> {
        self.store()
            .get(kind, ns, name)
            .expect("get")
            .map(|o| o.index.resource_version)
    }

    /// Waits until the store holds exactly what the server has for every cached kind.
    pub async fn wait_converged(&self) {
        use edgehub::object::Kind;
        let want = |plural: &str| -> Vec<(String, String)> {
            let mut v: Vec<_> = self
                .server
                .list(plural)
                .iter()
                .filter(|o| {
                    plural != "pods"
                        || o.pointer("/spec/nodeName").and_then(|n| n.as_str()) == Some("edge-1")
                })
                .map(|o| {
                    (
                        o["metadata"]["name"].as_str().unwrap_or("").to_string(),
                        o["metadata"]["resourceVersion"]
                            .as_str()
                            .unwrap_or("")
                            .to_string(),
                    )
                })
                .collect();
            v.sort();
            v
        };
        let have = |kind: Kind| -> Vec<(String, String)> {
            let mut v: Vec<_> = self
                .store()
                .list(kind)
                .expect("list")
                .into_iter()
                .map(|o| (o.index.name, o.index.resource_version))
                .collect();
            v.sort();
            v
        };
        wait_until(15, "cache equals the server", || {
            have(Kind::Pod) == want("pods")
                && have(Kind::DaemonSet) == want("daemonsets")
                && have(Kind::ControllerRevision) == want("controllerrevisions")
                && have(Kind::Node) == want("nodes")
        })
        .await;
    }

    pub fn lists_of(&self, plural: &str) -> usize {
        self.server
            .count(|r| r.is_list_of(plural) && r.status == 200)
    }

    pub fn watches_of(&self, plural: &str) -> usize {
        self.server.count(|r| r.is_watch_of(plural))
    }
}

/// Starts (or finds) the isolated containerd of scripts/cri-stack.sh and returns its socket.
/// It needs root; without it the calling test fails, loudly.
pub fn cri_stack() -> PathBuf {
    let out = std::process::Command::new("bash")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/cri-stack.sh"))
        .arg("start")
        .output()
        .expect("bash runs scripts/cri-stack.sh");
    assert!(
        out.status.success(),
        "the CRI test stack did not start (it needs root, containerd and runc):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .last()
            .unwrap_or("")
            .trim(),
    )
}

/// A host-network sandbox config (empty hostname, as the kubelet leaves it for such pods),
/// for tests and benches that drive the CRI directly.
pub fn host_network_sandbox(
    name: &str,
    uid: &str,
    namespace: &str,
    log_dir: &Path,
    labels: std::collections::HashMap<String, String>,
) -> edgehub::cri::api::PodSandboxConfig {
    use edgehub::cri::api;
    api::PodSandboxConfig {
        metadata: Some(api::PodSandboxMetadata {
            name: name.into(),
            uid: uid.into(),
            namespace: namespace.into(),
            attempt: 0,
        }),
        hostname: String::new(),
        log_directory: log_dir.display().to_string(),
        labels,
        linux: Some(api::LinuxPodSandboxConfig {
            security_context: Some(api::LinuxSandboxSecurityContext {
                namespace_options: Some(api::NamespaceOption {
                    network: api::NamespaceMode::Node as i32,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A free loopback port (tiny race with other processes, acceptable in tests).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Unmounts everything mounted under `dir` (the tmpfs volumes an edgehub killed mid-run left
/// for its pods), deepest first, so the test's temporary directory can go and mounts do not
/// pile up on the machine run after run.
pub fn unmount_under(dir: &Path) {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return;
    };
    let prefix = dir.to_string_lossy().to_string();
    let mut points: Vec<&str> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|p| p.starts_with(&prefix))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.len()));
    for p in points {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(p)
            .status();
    }
}

/// Stops and removes every sandbox of `node` in the containerd at `socket`, on a thread and
/// runtime of its own (so it can run from a `Drop` inside the test's runtime). Errors are
/// ignored: it is the cleanup of a test that may already have failed.
pub fn remove_node_sandboxes(socket: &Path, node: &str) {
    let (socket, node) = (socket.to_path_buf(), node.to_string());
    let _ = std::thread::spawn(move || {
        use edgehub::cri::{labels, CriClient, CriRuntime};
        let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        rt.block_on(async {
            let c = CriClient::new(&socket);
            let mine = std::collections::HashMap::from([(labels::NODE.to_string(), node)]);
            for sb in c.list_pod_sandbox(mine).await.unwrap_or_default() {
                let _ = c.stop_pod_sandbox(&sb.id).await;
                let _ = c.remove_pod_sandbox(&sb.id).await;
            }
        })
    })
    .join();
}

/// Removes every sandbox of `node` when dropped, so a test that fails halfway leaves nothing
/// running in the shared containerd.
pub struct NodeCleanup {
    pub node: String,
    pub socket: std::path::PathBuf,
}

impl Drop for NodeCleanup {
    fn drop(&mut self) {
        remove_node_sandboxes(&self.socket, &self.node);
    }
}

/// The containers of pod `uid` in the runtime, in any state.
pub async fn containers_of(
    c: &edgehub::cri::CriClient,
    uid: &str,
) -> Vec<edgehub::cri::api::Container> {
    use edgehub::cri::{labels, CriRuntime};
    c.list_containers(std::collections::HashMap::from([(
        labels::POD_UID.to_string(),
        uid.to_string(),
    )]))
    .await
    .unwrap()
}

/// The running containers of pod `uid`.
pub async fn running(c: &edgehub::cri::CriClient, uid: &str) -> Vec<edgehub::cri::api::Container> {
    containers_of(c, uid)
        .await
        .into_iter()
        .filter(|c| c.state == edgehub::cri::api::ContainerState::ContainerRunning as i32)
        .collect()
}

/// Runs `cmd` in container `id` (5 s at most) and returns its stdout.
pub async fn exec(c: &edgehub::cri::CriClient, id: &str, cmd: &[&str]) -> String {
    use edgehub::cri::CriRuntime;
    let r = c
        .exec_sync(
            id,
            cmd.iter().map(|s| s.to_string()).collect(),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    String::from_utf8_lossy(&r.stdout).into_owned()
}

/// A container that writes numbered lines fast (`seq <n> xxx…`, ten every 50 ms, about 90
/// bytes each): the log rotation and follow tests count on every number once, in order.
pub fn chatty_container(name: &str) -> serde_json::Value {
    let pad = "x".repeat(80);
    serde_json::json!({"name": name, "image": "127.0.0.1:5000/busybox:1.0", "imagePullPolicy": "IfNotPresent",
        "command": ["sh", "-c", format!("i=0; while true; do for j in 1 2 3 4 5 6 7 8 9 10; do i=$((i+1)); echo \"seq $i {pad}\"; done; sleep 0.05; done")]})
}

/// The number of a [`chatty_container`]'s line.
pub fn seq(line: &str) -> u64 {
    line.strip_prefix("seq ")
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("not a seq line: {line:.60}"))
}
