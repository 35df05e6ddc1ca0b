//! `kubectl logs --tail 100` as the apiserver asks a node for it, `GET
//! /containerLogs/{ns}/{pod}/{container}?tailLines=100`, against edgehub's node API and against
//! a real kubelet's own, each on a containerd of its own of the same build and configuration,
//! each serving the same kind of pod (hostNetwork busybox that wrote 5000 lines of 100 bytes,
//! then sleeps). Median and p95 over N requests each, alternating between the two, both on a
//! new TLS connection per request (as an apiserver without a pooled connection) and on one
//! kept-alive connection.
//!
//! The kubelet runs standalone: no apiserver, its pod a static pod from `--pod-manifest-path`
//! (`staticPodPath`), anonymous authentication and `AlwaysAllow` authorization, its own root
//! and pod-log directories, `failCgroupV1: false` (these VMs are cgroup v1),
//! `protectKernelDefaults: true` and, so it changes no host sysctl, started in a mount
//! namespace of its own where the six sysctls it checks read the values it wants. It is never
//! pointed at the shared CRI stack's containerd: a kubelet kills the pods it does not own.
//! edgehub authenticates the bench's bearer token through a TokenReview and authorizes it
//! through a SubjectAccessReview at the fake apiserver, both cached after the first request;
//! the kubelet, configured `AlwaysAllow`, checks nothing.
//!
//! Needs root, the test stack's registry (`scripts/cri-stack.sh start`: images
//! `127.0.0.1:5000/busybox:1.0` and `pause:1.0`), `containerd`, `unshare`, and a kubelet binary:
//! `EDGEHUB_KUBELET=/path/to/kubelet` (a release's `kubelet` from dl.k8s.io, or `make
//! WHAT=cmd/kubelet` in a kubernetes checkout; this was run with v1.36.2). Knob:
//! `EDGEHUB_KUBELET_LOG_REQUESTS` (200). Prints numbers and `METRIC` lines; asserts nothing.
//!
//!   EDGEHUB_KUBELET=... cargo bench --bench kubelet_logs

mod support;

use edgehub::cri::{CriClient, CriRuntime};
use edgehub_testsupport::{FakeApiServer, ADMIN_TOKEN};
use http_body_util::BodyExt;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use support::metric;

const NS: &str = "default";
const LINES: u32 = 5000;

/// The pod both serve: 5000 numbered lines of 100 bytes, then quiet.
fn pod_spec() -> serde_json::Value {
    let pad = "x".repeat(88);
    json!({
        "hostNetwork": true,
        "automountServiceAccountToken": false,
        "terminationGracePeriodSeconds": 0,
        "containers": [{"name": "app", "image": "127.0.0.1:5000/busybox:1.0", "imagePullPolicy": "IfNotPresent",
            "command": ["sh", "-c", format!("i=10000; while [ $i -lt {} ]; do i=$((i+1)); echo \"line $i {pad}\"; done; while true; do sleep 3600; done", 10000 + LINES)]}]
    })
}

/// A containerd of the bench's own (its own root, state, sockets), configured as the test
/// stack's; killed on drop after its pods are removed.
struct Containerd {
    child: Child,
    socket: PathBuf,
}

impl Containerd {
    async fn start(dir: &Path, certs: &Path) -> Option<Containerd> {
        std::fs::create_dir_all(dir).ok()?;
        let socket = dir.join("containerd.sock");
        let d = dir.display();
        let config = dir.join("config.toml");
        std::fs::write(
            &config,
            format!(
                "version = 2\nroot = \"{d}/root\"\nstate = \"{d}/state\"\n\
                 [grpc]\n  address = \"{}\"\n[ttrpc]\n  address = \"{}.ttrpc\"\n\
                 [debug]\n  address = \"{d}/debug.sock\"\n\
                 [plugins.\"io.containerd.internal.v1.opt\"]\n  path = \"{d}/opt\"\n\
                 [plugins.\"io.containerd.grpc.v1.cri\"]\n  sandbox_image = \"127.0.0.1:5000/pause:1.0\"\n\
                 restrict_oom_score_adj = true\n  netns_mounts_under_state_dir = true\n\
                 [plugins.\"io.containerd.grpc.v1.cri\".containerd]\n    default_runtime_name = \"runc\"\n\
                 [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc]\n      runtime_type = \"io.containerd.runc.v2\"\n\
                 [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc.options]\n        Root = \"{d}/runc\"\n\
                 [plugins.\"io.containerd.grpc.v1.cri\".registry]\n    config_path = \"{}\"\n",
                socket.display(),
                socket.display(),
                certs.display()
            ),
        )
        .ok()?;
        let log = std::fs::File::create(dir.join("containerd.log")).ok()?;
        let child = Command::new("containerd")
            .arg("--config")
            .arg(&config)
            .stdout(log.try_clone().ok()?)
            .stderr(log)
            .spawn()
            .map_err(|e| println!("cannot run containerd: {e}"))
            .ok()?;
        let c = Containerd { child, socket };
        let cri = CriClient::new(&c.socket);
        for _ in 0..100 {
            if cri.version().await.is_ok() {
                return Some(c);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        println!("containerd in {d} never answered");
        None
    }

    /// Stops and removes every sandbox (the kubelet leaves its pods running when killed).
    async fn clean(&self) {
        let cri = CriClient::new(&self.socket);
        for sb in cri
            .list_pod_sandbox(Default::default())
            .await
            .unwrap_or_default()
        {
            let _ = cri.stop_pod_sandbox(&sb.id).await;
            let _ = cri.remove_pod_sandbox(&sb.id).await;
        }
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The sysctls the kubelet's container manager checks, with the values it wants; bound over
/// `/proc/sys` in the kubelet's own mount namespace only.
const SYSCTLS: [(&str, &str); 6] = [
    ("vm/overcommit_memory", "1"),
    ("vm/panic_on_oom", "0"),
    ("kernel/panic", "10"),
    ("kernel/panic_on_oops", "1"),
    ("kernel/keys/root_maxkeys", "1000000"),
    ("kernel/keys/root_maxbytes", "25000000"),
];

/// A standalone kubelet; killed on drop.
struct Kubelet {
    child: Child,
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_kubelet(bin: &Path, dir: &Path, socket: &Path, port: u16) -> Option<Kubelet> {
    let manifests = dir.join("manifests");
    let sys = dir.join("sys");
    for d in [&manifests, &sys, &dir.join("root"), &dir.join("pod-logs")] {
        std::fs::create_dir_all(d).ok()?;
    }
    let manifest = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "talker", "namespace": NS},
        "spec": pod_spec(),
    });
    std::fs::write(manifests.join("talker.json"), manifest.to_string()).ok()?;
    let d = dir.display();
    let sock = socket.display();
    std::fs::write(
        dir.join("kubelet.yaml"),
        format!(
            "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\n\
             authentication:\n  anonymous:\n    enabled: true\n  webhook:\n    enabled: false\n\
             authorization:\n  mode: AlwaysAllow\n\
             address: 127.0.0.1\nport: {port}\nreadOnlyPort: 0\nhealthzPort: 0\n\
             staticPodPath: {d}/manifests\npodLogsDir: {d}/pod-logs\n\
             cgroupDriver: cgroupfs\ncgroupsPerQOS: false\nenforceNodeAllocatable: []\n\
             failSwapOn: false\nfailCgroupV1: false\nprotectKernelDefaults: true\n\
             makeIPTablesUtilChains: false\nlocalStorageCapacityIsolation: false\n\
             containerRuntimeEndpoint: unix://{sock}\nimageServiceEndpoint: unix://{sock}\n"
        ),
    )
    .ok()?;
    let mut script = String::from("set -e\n");
    for (name, value) in SYSCTLS {
        let file = sys.join(name.replace('/', "_"));
        std::fs::write(&file, format!("{value}\n")).ok()?;
        script.push_str(&format!(
            "mount --bind '{}' /proc/sys/{name}\n",
            file.display()
        ));
    }
    script.push_str(&format!(
        "exec '{}' --config '{d}/kubelet.yaml' --root-dir '{d}/root' --hostname-override bench-kubelet --v=1\n",
        bin.display()
    ));
    let log = std::fs::File::create(dir.join("kubelet.log")).ok()?;
    let child = Command::new("unshare")
        .args(["-m", "--propagation", "private", "sh", "-c", &script])
        .stdout(log.try_clone().ok()?)
        .stderr(log)
        .spawn()
        .map_err(|e| println!("cannot run unshare: {e}"))
        .ok()?;
    Some(Kubelet { child })
}

type Sender = hyper::client::conn::http1::SendRequest<http_body_util::Empty<bytes::Bytes>>;

async fn connect(addr: &str) -> Option<Sender> {
    let tcp = tokio::net::TcpStream::connect(addr).await.ok()?;
    // As the apiserver's Go client: without it, the request after the handshake can wait
    // for the server's delayed ACK.
    tcp.set_nodelay(true).ok()?;
    let tls = tokio_rustls::TlsConnector::from(support::any_server_cert())
        .connect(
            rustls::pki_types::ServerName::try_from("127.0.0.1")
                .ok()?
                .to_owned(),
            tcp,
        )
        .await
        .ok()?;
    let (send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
        .await
        .ok()?;
    tokio::spawn(conn);
    Some(send)
}

/// One GET on `send`: status and body.
async fn get_on(send: &mut Sender, path: &str, token: Option<&str>) -> Option<(u16, String)> {
    let mut req = hyper::Request::builder()
        .uri(path)
        .header("host", "127.0.0.1");
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let resp = send
        .send_request(req.body(http_body_util::Empty::new()).ok()?)
        .await
        .ok()?;
    let code = resp.status().as_u16();
    let body = resp.into_body().collect().await.ok()?.to_bytes();
    Some((code, String::from_utf8_lossy(&body).into_owned()))
}

async fn get(addr: &str, path: &str, token: Option<&str>) -> Option<(u16, String)> {
    let mut send = connect(addr).await?;
    get_on(&mut send, path, token).await
}

/// One side of the comparison: where it listens, the log path, the token it wants.
struct Target {
    label: &'static str,
    addr: String,
    path: String,
    token: Option<&'static str>,
}

/// Waits until the target answers with the whole log: 100 lines, the last one the 5000th.
async fn ready(t: &Target, secs: u64) -> bool {
    let deadline = Instant::now() + Duration::from_secs(secs);
    let last = format!("line {} ", 10000 + LINES);
    while Instant::now() < deadline {
        if let Some((200, body)) = get(&t.addr, &t.path, t.token).await {
            if body.lines().count() == 100
                && body.lines().last().is_some_and(|l| l.starts_with(&last))
            {
                return true;
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    false
}

fn percentile(v: &[f64], p: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v.get(i).copied().unwrap_or(f64::NAN)
}

/// `n` requests to each target, alternating; on a new connection each, or all on one.
async fn measure(targets: &[Target], n: usize, fresh: bool) -> Vec<Vec<f64>> {
    let mut conns = Vec::new();
    for t in targets {
        conns.push(if fresh { None } else { connect(&t.addr).await });
    }
    let mut times = vec![Vec::with_capacity(n); targets.len()];
    for _ in 0..n {
        for (i, t) in targets.iter().enumerate() {
            let started = Instant::now();
            let r = match (fresh, conns[i].as_mut()) {
                (false, Some(send)) => get_on(send, &t.path, t.token).await,
                _ => get(&t.addr, &t.path, t.token).await,
            };
            let ms = started.elapsed().as_secs_f64() * 1e3;
            match r {
                Some((200, body)) if body.lines().count() == 100 => times[i].push(ms),
                other => println!(
                    "  {}: unexpected answer {:?}",
                    t.label,
                    other.map(|(c, _)| c)
                ),
            }
        }
    }
    times
}

async fn run(bin: &Path, kubelet: &Path, stack: &Path) -> Option<()> {
    let dir = tempfile::tempdir().ok()?;
    let certs = stack.join("certs.d");
    let n: usize = std::env::var("EDGEHUB_KUBELET_LOG_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);

    // The kubelet, on a containerd of its own.
    let kc = Containerd::start(&dir.path().join("containerd-kubelet"), &certs).await?;
    let kport = support::free_port();
    let _kubelet = start_kubelet(kubelet, &dir.path().join("kubelet"), &kc.socket, kport)?;

    // edgehub, on another containerd of the same configuration.
    let ec = Containerd::start(&dir.path().join("containerd-edgehub"), &certs).await?;
    let server = FakeApiServer::start().await.ok()?;
    support::approve_serving_csrs(&server);
    let node = "bench-edgehub";
    let eport = support::free_port();
    let mut pod = json!({
        "metadata": {"name": "talker", "namespace": NS, "uid": "bench-kubelet-logs", "resourceVersion": "1"},
        "spec": pod_spec(),
        "status": {"phase": "Pending"}
    });
    pod["spec"]["nodeName"] = node.into();
    server.apply("pods", pod);
    let mut edge = support::Edge::prepare(
        &server,
        bin,
        &dir.path().join("edgehub"),
        node,
        &ec.socket,
        &format!("[node]\nnode_api_addr = \"127.0.0.1:{eport}\"\n"),
    );
    edge.start(&[]);

    let targets = [
        Target {
            label: "edgehub",
            addr: format!("127.0.0.1:{eport}"),
            path: format!("/containerLogs/{NS}/talker/app?tailLines=100"),
            token: Some(ADMIN_TOKEN),
        },
        Target {
            label: "kubelet",
            addr: format!("127.0.0.1:{kport}"),
            // A static pod is named after its node.
            path: format!("/containerLogs/{NS}/talker-bench-kubelet/app?tailLines=100"),
            token: None,
        },
    ];
    let mut ok = true;
    for t in &targets {
        if !ready(t, 180).await {
            println!(
                "{} never served the whole log in 180 s (logs in {})",
                t.label,
                dir.path().display()
            );
            ok = false;
        }
    }
    if ok {
        // Warm both (connections, caches), then measure.
        measure(&targets, 10, true).await;
        for (fresh, mode) in [(true, "new_connection"), (false, "keepalive")] {
            let times = measure(&targets, n, fresh).await;
            for (t, v) in targets.iter().zip(&times) {
                let (p50, p95) = (percentile(v, 0.5), percentile(v, 0.95));
                println!(
                    "GET /containerLogs tailLines=100, {} ({mode}): median {p50:.2} ms, p95 {p95:.2} ms over {} requests",
                    t.label,
                    v.len()
                );
                metric(
                    &format!("logs_tail100_p50_ms_{}_{mode}", t.label),
                    p50,
                    "ms",
                );
                metric(
                    &format!("logs_tail100_p95_ms_{}_{mode}", t.label),
                    p95,
                    "ms",
                );
            }
        }
    } else {
        // Kept for a look: the tempdir is not removed.
        let _ = dir.keep();
    }
    edge.stop();
    drop(_kubelet);
    ec.clean().await;
    kc.clean().await;
    ok.then_some(())
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!("kubelet_logs benchmark: run with `EDGEHUB_KUBELET=/path/to/kubelet cargo bench --bench kubelet_logs`");
        return;
    }
    let Some(kubelet) = std::env::var_os("EDGEHUB_KUBELET").map(PathBuf::from) else {
        println!(
            "kubelet_logs: set EDGEHUB_KUBELET to a kubelet binary (a Kubernetes release's \
             kubelet, or `make WHAT=cmd/kubelet` in a kubernetes checkout); nothing measured"
        );
        return;
    };
    let Some(bin) = support::edgehub_bin() else {
        return;
    };
    let stack = std::env::var_os("EDGEHUB_STACK_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("target/cri-stack"));
    println!("edgehub: {}, kubelet: {}", bin.display(), kubelet.display());
    if let Ok(out) = Command::new(&kubelet)
        .arg("--version")
        .stderr(Stdio::null())
        .output()
    {
        println!("{}", String::from_utf8_lossy(&out.stdout).trim());
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    if rt.block_on(run(&bin, &kubelet, &stack)).is_none() {
        println!("kubelet_logs: nothing measured (see above)");
    }
}
