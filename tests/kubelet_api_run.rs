//! `edgehub run` with `[node] node_api_addr`: real pods in containerd (the stack of
//! scripts/cri-stack.sh), read through the node's API as the apiserver would. The first test
//! asks for the serving certificate, holds it pending (no handshake meanwhile) and approves it
//! as `kubectl certificate approve` does; the others have it approved at once. Logs with each
//! of the kubelet's options on the files containerd writes, `previous` and `follow` across a
//! real restart, `follow` across real rotations; stats checked against what containerd (the
//! CRI) and the host report. Needs root; without it this fails, loudly.

mod common;
#[path = "common/node_api.rs"]
mod node_api;

use edgehub_testsupport::{FakeApiServer, ADMIN_TOKEN, KUBELET_SERVING_SIGNER};
use http_body_util::{BodyExt, Empty};
use serde_json::json;
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_edgehub");
const NS: &str = "nodeapi-test";
const CSRS: &str = "/apis/certificates.k8s.io/v1/certificatesigningrequests";

fn free_addr() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

struct Run {
    child: Child,
    socket: PathBuf,
    node: String,
}

impl Drop for Run {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        common::remove_node_sandboxes(&self.socket, &self.node);
    }
}

/// GET `path` on the node API with the admin token, the server verified against `ca_pem`
/// for 127.0.0.1: the status and the body, as it streams.
async fn open(
    addr: SocketAddr,
    ca_pem: &str,
    path: &str,
) -> anyhow::Result<hyper::Response<hyper::body::Incoming>> {
    let tls = node_api::connect(addr, ca_pem).await?;
    let (mut send, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls)).await?;
    tokio::spawn(conn);
    let req = hyper::Request::builder()
        .uri(path)
        .header("host", "127.0.0.1")
        .header("authorization", format!("Bearer {ADMIN_TOKEN}"))
        .body(Empty::<bytes::Bytes>::new())?;
    Ok(send.send_request(req).await?)
}

/// GET `path`: the status and the whole body.
async fn get(addr: SocketAddr, ca_pem: &str, path: &str) -> anyhow::Result<(u16, String)> {
    let resp = open(addr, ca_pem, path).await?;
    let code = resp.status().as_u16();
    let body = tokio::time::timeout(Duration::from_secs(10), resp.into_body().collect())
        .await??
        .to_bytes();
    Ok((code, String::from_utf8_lossy(&body).into_owned()))
}

fn now_nanos() -> i128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as i128
}

/// A CRI log file's whole-line records as `kubectl logs --timestamps` prints them.
fn stamped(file: &std::path::Path) -> Vec<String> {
    std::fs::read_to_string(file)
        .unwrap()
        .lines()
        .filter_map(|l| {
            let mut f = l.splitn(4, ' ');
            let (ts, _stream, tag) = (f.next()?, f.next()?, f.next()?);
            (tag == "F").then(|| format!("{ts} {}", f.next().unwrap_or("")))
        })
        .collect()
}

/// An edgehub running pods of its own node, its node API on a port of its own.
struct Edge {
    s: FakeApiServer,
    _dir: tempfile::TempDir,
    data: PathBuf,
    node: String,
    node_api: SocketAddr,
    run: Run,
}

impl Edge {
    /// Starts `edgehub run` for node `edge-<tag>-<pid>` with `pods` (given the node's name)
    /// and `more_config` appended to its config. `approve`: serving CSRs of the node are
    /// approved at once (else they stay pending, as with the real controller manager).
    async fn start(
        tag: &str,
        pods: &[&dyn Fn(&str) -> serde_json::Value],
        more_config: &str,
        approve: bool,
    ) -> Edge {
        let socket = common::cri_stack();
        let s = FakeApiServer::start().await.unwrap();
        // A node of its own (tests share one containerd), with a token for its own identity:
        // NodeRestriction lets a node ask only for its own name's certificates.
        let node = format!("edge-{tag}-{}", std::process::id());
        let token = format!("{node}-token");
        s.add_token(&token, &format!("system:node:{node}"));
        s.set_csr_approver(Some(Arc::new(
            move |_: &edgehub_testsupport::CsrRequest| {
                if approve {
                    edgehub_testsupport::Approval::Approve {
                        reason: "TestApproved".into(),
                        message: "the node's own serving certificate".into(),
                    }
                } else {
                    edgehub_testsupport::Approval::Pending
                }
            },
        )));
        let dir = tempfile::tempdir().unwrap();
        let kc = s
            .write_kubeconfig(&dir.path().join("kube"), &token)
            .unwrap();
        let ca = dir.path().join("client-ca.crt");
        std::fs::write(&ca, &s.pki.ca_pem).unwrap();
        let api_addr = free_addr();
        let node_api = free_addr();
        let data = dir.path().join("data");
        let config = dir.path().join("config.toml");
        std::fs::write(
            &config,
            format!(
                "node_name = \"{node}\"\napi_addr = \"{api_addr}\"\ndata_dir = \"{}\"\nkubeconfig = \"{}\"\ncri_socket = \"{}\"\n[sync]\nbackoff_initial_ms = 50\nbackoff_max_secs = 1\n[node]\nnode_api_addr = \"{node_api}\"\nnode_api_client_ca_file = \"{}\"\n{more_config}",
                data.display(),
                kc.display(),
                socket.display(),
                ca.display()
            ),
        )
        .unwrap();
        for pod in pods {
            s.apply("pods", pod(&node));
        }
        let child = Command::new(BIN)
            .arg("--config")
            .arg(&config)
            .arg("run")
            .env_remove("EDGEHUB_NODE_NAME")
            .env_remove("EDGEHUB_API_ADDR")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let run = Run {
            child,
            socket,
            node: node.clone(),
        };
        Edge {
            s,
            _dir: dir,
            data,
            node,
            node_api,
            run,
        }
    }

    async fn get(&self, path: &str) -> (u16, String) {
        get(self.node_api, &self.s.pki.ca_pem, path).await.unwrap()
    }

    async fn open(&self, path: &str) -> hyper::Response<hyper::body::Incoming> {
        open(self.node_api, &self.s.pki.ca_pem, path).await.unwrap()
    }

    /// Waits until the node API answers (its certificate approved).
    async fn served(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match get(self.node_api, &self.s.pki.ca_pem, "/healthz").await {
                Ok(r) => {
                    assert_eq!(r, (200, "ok".into()));
                    return;
                }
                Err(e) => assert!(Instant::now() < deadline, "never served: {e}"),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Polls GET `path` until a 200 whose body satisfies `f`; returns that body.
    async fn get_until(
        &self,
        secs: u64,
        what: &str,
        path: &str,
        f: impl Fn(&str) -> bool,
    ) -> String {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let (code, body) = self.get(path).await;
            if code == 200 && f(&body) {
                return body;
            }
            assert!(
                Instant::now() < deadline,
                "timed out after {secs}s waiting for: {what}; last: {code} {body:.300}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The pod's log directory, by its UID.
    fn log_dir(&self, uid: &str) -> PathBuf {
        self.data.join("pods").join(uid).join("logs")
    }
}

/// The talker pod: five numbered lines, then a tick every 0.3 s.
fn talker(node: &str) -> serde_json::Value {
    node_api::talker(
        node,
        NS,
        &format!("nodeapi-{}", std::process::id()),
        "for i in 1 2 3 4 5; do echo \"line $i\"; done; while true; do sleep 0.3; echo tick; done",
    )
}

#[tokio::test]
async fn kubectl_logs_through_the_node_api_of_a_running_edgehub() {
    let e = Edge::start("nodeapi", &[&talker], "", false).await;
    let (s, node, node_api, data) = (&e.s, &e.node, e.node_api, &e.data);

    // The Node advertises the port.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let port = s.get("nodes", "", node).and_then(|n| {
            n.pointer("/status/daemonEndpoints/kubeletEndpoint/Port")
                .cloned()
        });
        if port == Some(json!(node_api.port())) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the Node's daemonEndpoints: {port:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The serving CSR, pending: no handshake completes meanwhile.
    let deadline = Instant::now() + Duration::from_secs(30);
    let csr = loop {
        let found = s
            .csrs()
            .into_iter()
            .find(|c| c["spec"]["signerName"] == KUBELET_SERVING_SIGNER);
        if let Some(c) = found {
            break c;
        }
        assert!(Instant::now() < deadline, "no serving CSR");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(csr["spec"]["username"], format!("system:node:{node}"));
    assert!(
        get(node_api, &s.pki.ca_pem, "/healthz").await.is_err(),
        "served before a certificate exists"
    );

    // What an operator without the controller does: kubectl certificate approve.
    let name = csr["metadata"]["name"].as_str().unwrap();
    let mut approval = csr.clone();
    approval["status"]["conditions"] = json!([{"type": "Approved", "status": "True",
        "reason": "KubectlApprove", "message": "This CSR was approved by kubectl certificate approve."}]);
    let (code, got) = s
        .raw(
            Some(ADMIN_TOKEN),
            "PUT",
            &format!("{CSRS}/{name}/approval"),
            Some("application/json"),
            Some(&approval),
        )
        .await
        .unwrap();
    assert_eq!(code, 200, "{got}");
    e.served().await;
    let file = data.join("identity/node-serving.pem");
    assert_eq!(
        std::fs::metadata(&file).unwrap().permissions().mode() & 0o777,
        0o600
    );

    // The container's lines, as containerd wrote them, through the node API.
    let logs = format!("/containerLogs/{NS}/talker/app");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (code, body) = get(node_api, &s.pki.ca_pem, &logs).await.unwrap();
        if code == 200 && body.matches("tick\n").count() >= 2 {
            assert!(
                body.starts_with("line 1\nline 2\nline 3\nline 4\nline 5\ntick\n"),
                "{body}"
            );
            break;
        }
        assert!(Instant::now() < deadline, "no logs: {code} {body}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let (code, body) = get(node_api, &s.pki.ca_pem, &format!("{logs}?tailLines=2"))
        .await
        .unwrap();
    assert_eq!((code, body.as_str()), (200, "tick\ntick\n"));
    let (_, body) = get(
        node_api,
        &s.pki.ca_pem,
        &format!("{logs}?timestamps=true&limitBytes=40"),
    )
    .await
    .unwrap();
    assert_eq!(body.len(), 40, "{body}");
    let (ts, rest) = body.split_once(' ').unwrap();
    assert!(edgehub::logs::rfc3339_nanos(ts).is_some(), "{body}");
    assert!(rest.starts_with("line 1\n"), "{body}");
    let (code, body) = get(node_api, &s.pki.ca_pem, &format!("{logs}?previous=true"))
        .await
        .unwrap();
    assert_eq!(
        (code, body.as_str()),
        (
            400,
            "previous terminated container \"app\" in pod \"talker\" not found"
        ),
        "no previous attempt yet: the kubelet's answer"
    );

    // timestamps: each line with its record's own, as containerd wrote it.
    let file = e
        .log_dir(&format!("nodeapi-{}", std::process::id()))
        .join("app_0.log");
    let (_, body) = e.get(&format!("{logs}?timestamps=true&tailLines=3")).await;
    let raw = stamped(&file);
    let got: Vec<&str> = body.lines().collect();
    assert_eq!(got.len(), 3, "{body}");
    assert!(
        raw.windows(3).any(|w| w == got.as_slice()),
        "{got:?} are three records of {raw:?}"
    );
    // sinceSeconds: the records of the last 2 s, all of them, to the end of the file (once
    // the file holds older ones).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before = now_nanos();
    let (code, body) = e
        .get(&format!("{logs}?sinceSeconds=2&timestamps=true"))
        .await;
    let after = now_nanos();
    assert_eq!(code, 200, "{body}");
    let got: Vec<&str> = body.lines().collect();
    let raw = stamped(&file);
    let at = raw
        .iter()
        .position(|l| l == got[0])
        .unwrap_or_else(|| panic!("{} not in the file", got[0]));
    assert_eq!(
        &raw[at..at + got.len()],
        got.as_slice(),
        "a run of the file's records"
    );
    let ts = |l: &str| edgehub::logs::rfc3339_nanos(l.split(' ').next().unwrap()).unwrap();
    assert!(ts(got[0]) >= before - 2_000_000_000, "{got:?}");
    assert!(
        at > 0 && ts(&raw[at - 1]) < after - 2_000_000_000,
        "nothing left out"
    );
    assert!(got.len() < raw.len(), "older records are left out");
    // limitBytes on the plain lines: a prefix of them.
    let (_, all) = e.get(&logs).await;
    let (_, body) = e.get(&format!("{logs}?limitBytes=17")).await;
    assert_eq!(body, all[..17], "{body:?}");

    // Stats: the numbers containerd reports, bracketed by asking it before and after.
    use edgehub::cri::{labels, CriClient};
    let cri = CriClient::new(&e.run.socket);
    let filter = std::collections::HashMap::from([(labels::NODE.to_string(), node.clone())]);
    let cpu_of = |stats: &[edgehub::cri::api::ContainerStats]| -> u64 {
        stats
            .iter()
            .find(|s| {
                s.attributes
                    .as_ref()
                    .and_then(|a| a.labels.get(labels::CONTAINER_NAME))
                    == Some(&"app".to_string())
            })
            .and_then(|s| s.cpu.as_ref()?.usage_core_nano_seconds.as_ref())
            .map(|v| v.value)
            .expect("containerd reports app's CPU")
    };
    let before = cpu_of(&cri.list_container_stats(filter.clone()).await.unwrap());
    let (code, text) = get(node_api, &s.pki.ca_pem, "/metrics/resource")
        .await
        .unwrap();
    let after = cpu_of(&cri.list_container_stats(filter.clone()).await.unwrap());
    assert_eq!(code, 200, "{text}");
    let value = |name: &str| -> f64 {
        let prefix = format!("{name}{{container=\"app\",namespace=\"{NS}\",pod=\"talker\"}} ");
        let line = text
            .lines()
            .find(|l| l.starts_with(&prefix))
            .unwrap_or_else(|| panic!("no {prefix} in:\n{text}"));
        line[prefix.len()..]
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    let cpu = value("container_cpu_usage_seconds_total");
    assert!(
        before as f64 / 1e9 - 1e-9 <= cpu && cpu <= after as f64 / 1e9 + 1e-9,
        "{before} <= {cpu} s <= {after}"
    );
    assert!(value("container_memory_working_set_bytes") > 0.0);
    assert!(text.contains("\nnode_cpu_usage_seconds_total "), "{text}");
    assert!(text.contains("\nscrape_error 0\n"), "{text}");
    // The start time: when containerd created the container.
    use edgehub::cri::CriRuntime;
    let created = cri
        .list_containers(filter.clone())
        .await
        .unwrap()
        .into_iter()
        .find(|c| c.metadata.as_ref().is_some_and(|m| m.name == "app"))
        .expect("containerd lists app")
        .created_at;
    let start = {
        let prefix = format!(
            "container_start_time_seconds{{container=\"app\",namespace=\"{NS}\",pod=\"talker\"}} "
        );
        let line = text
            .lines()
            .find(|l| l.starts_with(&prefix))
            .unwrap_or_else(|| panic!("no {prefix} in:\n{text}"));
        line[prefix.len()..].parse::<f64>().unwrap()
    };
    assert!(
        (start - created as f64 / 1e9).abs() < 1e-3,
        "{start} s is containerd's {created} ns"
    );
    let before = cpu_of(&cri.list_container_stats(filter.clone()).await.unwrap());
    let (code, body) = get(node_api, &s.pki.ca_pem, "/stats/summary")
        .await
        .unwrap();
    let after = cpu_of(&cri.list_container_stats(filter).await.unwrap());
    assert_eq!(code, 200, "{body}");
    let summary: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(summary["node"]["nodeName"], node.as_str());
    let pod = summary["pods"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["podRef"]["name"] == "talker")
        .unwrap_or_else(|| panic!("no talker in {body}"));
    assert_eq!(pod["podRef"]["namespace"], NS);
    let c = &pod["containers"][0];
    assert_eq!(c["name"], "app");
    let n = c["cpu"]["usageCoreNanoSeconds"].as_u64().unwrap();
    assert!(before <= n && n <= after, "{before} <= {n} <= {after}");
    assert!(c["memory"]["workingSetBytes"].as_u64().unwrap() > 0);
    assert_eq!(
        edgehub::logs::rfc3339_nanos(c["startTime"].as_str().unwrap()),
        Some(created as i128 / 1_000_000_000 * 1_000_000_000),
        "startTime, to the second"
    );
}

/// A pod whose `app` counts its runs in an emptyDir, prints its run and three lines and exits
/// after 2 s: the runtime restarts it after its crash-loop backoff.
fn restarts(node: &str) -> serde_json::Value {
    json!({
        "metadata": {"name": "restarts", "namespace": NS, "uid": format!("nodeapi-rs-{}", std::process::id()), "resourceVersion": "1"},
        "spec": {
            "nodeName": node,
            "hostNetwork": true,
            "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 0,
            "volumes": [{"name": "data", "emptyDir": {}}],
            "containers": [{"name": "app", "image": "127.0.0.1:5000/busybox:1.0", "imagePullPolicy": "IfNotPresent",
                "command": ["sh", "-c", "n=$(cat /data/n 2>/dev/null || echo 0); n=$((n+1)); echo $n > /data/n; \
                    echo \"run $n\"; for i in 1 2 3; do echo \"line $i\"; done; sleep 2; exit 1"],
                "volumeMounts": [{"name": "data", "mountPath": "/data"}]}]
        },
        "status": {"phase": "Pending"}
    })
}

fn run_lines(n: u32) -> String {
    format!("run {n}\nline 1\nline 2\nline 3\n")
}

/// The whole body of a streamed answer, within `secs` (panics if it does not end by then).
async fn body_within(secs: u64, resp: hyper::Response<hyper::body::Incoming>) -> String {
    let body = tokio::time::timeout(Duration::from_secs(secs), resp.into_body().collect())
        .await
        .unwrap_or_else(|_| panic!("the answer did not end within {secs}s"))
        .unwrap()
        .to_bytes();
    String::from_utf8_lossy(&body).into_owned()
}

/// `kubectl logs -p` and `kubectl logs -f` across a real restart: before any, `previous` is
/// the kubelet's 400; a follow of the running attempt ends by itself once its container
/// stops (before the runtime starts the next one, as the kubelet's), having sent all of it;
/// after the restart, `previous` is the first attempt's lines.
#[tokio::test]
async fn previous_and_follow_across_a_real_restart() {
    let e = Edge::start("nodeapi-rs", &[&restarts], "", true).await;
    e.served().await;
    let logs = format!("/containerLogs/{NS}/restarts/app");
    e.get_until(60, "the first run's lines", &logs, |b| {
        b.starts_with("run 1\n")
    })
    .await;
    let (code, body) = e.get(&format!("{logs}?previous=true")).await;
    assert_eq!(
        (code, body.as_str()),
        (
            400,
            "previous terminated container \"app\" in pod \"restarts\" not found"
        )
    );
    // Follow the first attempt: it exits after 2 s, the next starts after the crash-loop
    // backoff (10 s). As the kubelet's, the follow ends once the container has stopped,
    // before the next attempt starts.
    let resp = e.open(&format!("{logs}?follow=true")).await;
    assert_eq!(resp.status(), 200);
    let followed = body_within(60, resp).await;
    assert_eq!(followed, run_lines(1), "the whole first run, once");
    let dir = e.log_dir(&format!("nodeapi-rs-{}", std::process::id()));
    assert!(
        !dir.join("app_1.log").exists(),
        "the follow ended when the container stopped, not when the next attempt started"
    );
    let now = e
        .get_until(30, "the second run's lines", &logs, |b| b == run_lines(2))
        .await;
    assert_eq!(now, run_lines(2));
    let (code, body) = e.get(&format!("{logs}?previous=true")).await;
    assert_eq!((code, body), (200, run_lines(1)));
    let (code, body) = e.get(&format!("{logs}?previous=true&tailLines=1")).await;
    assert_eq!((code, body.as_str()), (200, "line 3\n"));
}

/// About 200 numbered lines a second, 100 bytes each.
fn chatty(node: &str) -> serde_json::Value {
    json!({
        "metadata": {"name": "chatty", "namespace": NS, "uid": format!("nodeapi-rot-{}", std::process::id()), "resourceVersion": "1"},
        "spec": {
            "nodeName": node,
            "hostNetwork": true,
            "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 0,
            "containers": [common::chatty_container("chatty")]
        },
        "status": {"phase": "Pending"}
    })
}

/// `kubectl logs -f` across real rotations (at 16 KiB, checked every second): every line
/// once, in order, while the file is renamed, compressed and replaced under the follow.
#[tokio::test]
async fn follow_across_real_rotations() {
    let e = Edge::start(
        "nodeapi-rot",
        &[&chatty],
        "[logs]\nmax_size_kib = 16\nmax_files = 3\nmonitor_interval_secs = 1\n",
        true,
    )
    .await;
    e.served().await;
    let logs = format!("/containerLogs/{NS}/chatty/chatty");
    e.get_until(60, "the first lines", &logs, |b| !b.is_empty())
        .await;
    let resp = e.open(&format!("{logs}?follow=true")).await;
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let dir = e.log_dir(&format!("nodeapi-rot-{}", std::process::id()));
    let mut rotated = std::collections::BTreeSet::new();
    let mut pending = String::new();
    let mut last: Option<u64> = None;
    let deadline = Instant::now() + Duration::from_secs(90);
    // At least three rotations seen while following, and the lines past them.
    while rotated.len() < 3 || last.unwrap_or(0) < 3000 {
        assert!(
            Instant::now() < deadline,
            "following: {} rotations, up to {last:?}",
            rotated.len()
        );
        let frame = tokio::time::timeout(Duration::from_secs(10), body.frame())
            .await
            .expect("the follow goes on")
            .expect("the follow does not end")
            .unwrap();
        let Ok(chunk) = frame.into_data() else {
            continue;
        };
        pending.push_str(std::str::from_utf8(&chunk).unwrap());
        while let Some(at) = pending.find('\n') {
            let line: String = pending.drain(..=at).collect();
            let n = common::seq(line.trim_end());
            if let Some(l) = last {
                assert_eq!(n, l + 1, "every line once, in order, across rotations");
            }
            last = Some(n);
        }
        for name in std::fs::read_dir(&dir).unwrap().flatten() {
            let name = name.file_name().to_string_lossy().into_owned();
            if let Some(r) = name.strip_prefix("chatty_0.log.") {
                rotated.insert(
                    r.trim_end_matches(".tmp")
                        .trim_end_matches(".gz")
                        .to_string(),
                );
            }
        }
    }
    drop(body);
    // Without follow, on the rotated file: tailLines is the newest lines, whole and in order.
    let body = e
        .get_until(10, "five lines", &format!("{logs}?tailLines=5"), |b| {
            b.lines().count() == 5
        })
        .await;
    let got: Vec<u64> = body.lines().map(common::seq).collect();
    assert!(got.windows(2).all(|w| w[1] == w[0] + 1), "{body:.300}");
    let followed_to = last.unwrap();
    assert!(
        got[4] >= followed_to,
        "the newest lines, at or past the follow's last ({followed_to}): {body:.300}"
    );
}

/// A pod on the CNI bridge: 1 MiB written into its writable layer, 200 KiB into an emptyDir,
/// 50 log lines, then an HTTP server for a 200 KiB file (traffic on its eth0).
fn stats_pod(node: &str) -> serde_json::Value {
    json!({
        "metadata": {"name": "stats", "namespace": NS, "uid": format!("nodeapi-st-{}", std::process::id()), "resourceVersion": "1"},
        "spec": {
            "nodeName": node,
            "hostNetwork": false,
            "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 0,
            "volumes": [{"name": "data", "emptyDir": {}}],
            "containers": [{"name": "app", "image": "127.0.0.1:5000/busybox:1.0", "imagePullPolicy": "IfNotPresent",
                "command": ["sh", "-c", "b=/bin/busybox; $b head -c 1048576 /dev/urandom > /big; \
                    $b head -c 204800 /dev/urandom > /data/f; \
                    $b mkdir -p /www; $b head -c 204800 /dev/urandom > /www/blob; \
                    i=0; while [ $i -lt 50 ]; do i=$((i+1)); echo \"line $i\"; done; \
                    exec $b httpd -f -p 8080 -h /www"],
                "volumeMounts": [{"name": "data", "mountPath": "/data"}]}]
        },
        "status": {"phase": "Pending"}
    })
}

/// `df -B1` of `path`: its filesystem's size and what is available.
fn df(path: &std::path::Path) -> (u64, u64) {
    let out = Command::new("df")
        .args(["-B1", "--output=size,avail"])
        .arg(path)
        .output()
        .unwrap();
    assert!(out.status.success(), "df {}", path.display());
    let text = String::from_utf8(out.stdout).unwrap();
    let f: Vec<u64> = text
        .lines()
        .nth(1)
        .unwrap()
        .split_whitespace()
        .map(|x| x.parse().unwrap())
        .collect();
    (f[0], f[1])
}

/// `du -s` of `path`: bytes (512-byte blocks) and inodes.
fn du(path: &std::path::Path) -> (u64, u64) {
    let n = |args: &[&str]| -> u64 {
        let out = Command::new("du").args(args).arg(path).output().unwrap();
        assert!(out.status.success(), "du {}", path.display());
        String::from_utf8(out.stdout)
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    (n(&["-s", "-B1"]), n(&["-s", "--inodes"]))
}

/// eth0's received and sent bytes in `/proc/<pid>/net/dev` (the host's without a pid).
fn eth0(pid: Option<u32>) -> (u64, u64) {
    let path = pid.map_or("/proc/net/dev".to_string(), |p| {
        format!("/proc/{p}/net/dev")
    });
    let text = std::fs::read_to_string(&path).unwrap();
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with("eth0:"))
        .unwrap_or_else(|| panic!("no eth0 in {path}:\n{text}"));
    let f: Vec<u64> = line
        .split_once(':')
        .unwrap()
        .1
        .split_whitespace()
        .map(|x| x.parse().unwrap())
        .collect();
    (f[0], f[8])
}

/// `/stats/summary` against what containerd and the host report: the writable layer's bytes
/// (1 MiB written shows up), the runtime's image filesystem, a container's log files, an
/// emptyDir, the pod's ephemeral storage as their sum, the pod's own eth0 (the sandbox's
/// network namespace) and the node's, the data directory's filesystem, memory within drift.
#[tokio::test]
async fn stats_summary_against_containerd_and_the_host() {
    use edgehub::cri::{labels, CriClient, CriRuntime};
    let e = Edge::start("nodeapi-st", &[&stats_pod], "", true).await;
    e.served().await;
    let uid = format!("nodeapi-st-{}", std::process::id());
    let cri = CriClient::new(&e.run.socket);
    let filter = std::collections::HashMap::from([(labels::NODE.to_string(), e.node.clone())]);
    let app = |stats: Vec<edgehub::cri::api::ContainerStats>| {
        stats.into_iter().find(|s| {
            s.attributes
                .as_ref()
                .and_then(|a| a.labels.get(labels::CONTAINER_NAME))
                == Some(&"app".to_string())
        })
    };
    let layer = |s: &Option<edgehub::cri::api::ContainerStats>| -> Option<u64> {
        s.as_ref()?
            .writable_layer
            .as_ref()?
            .used_bytes
            .as_ref()
            .map(|v| v.value)
    };
    // containerd measures writable layers now and then: wait until it has seen the 1 MiB.
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let s = app(cri.list_container_stats(filter.clone()).await.unwrap());
        if layer(&s).unwrap_or(0) >= 1 << 20 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "containerd never saw the 1 MiB: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // The pod's address, from its status; traffic on its eth0.
    let deadline = Instant::now() + Duration::from_secs(30);
    let ip = loop {
        let st = e.s.get("pods", NS, "stats").unwrap()["status"].clone();
        if let Some(ip) = st["podIP"].as_str().filter(|ip| *ip != st["hostIP"]) {
            break ip.to_string();
        }
        assert!(Instant::now() < deadline, "no pod IP: {st}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let fetched = async {
            let mut c = tokio::net::TcpStream::connect((ip.as_str(), 8080)).await?;
            c.write_all(b"GET /blob HTTP/1.0\r\n\r\n").await?;
            let mut got = Vec::new();
            c.read_to_end(&mut got).await?;
            Ok::<_, std::io::Error>(got.len())
        }
        .await;
        if matches!(fetched, Ok(n) if n > 204_800) {
            break;
        }
        assert!(Instant::now() < deadline, "no blob from {ip}: {fetched:?}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let sandbox = cri
        .list_pod_sandbox(std::collections::HashMap::from([(
            labels::POD_UID.to_string(),
            uid.clone(),
        )]))
        .await
        .unwrap()
        .into_iter()
        .find(|s| s.state == edgehub::cri::api::PodSandboxState::SandboxReady as i32)
        .expect("the pod's sandbox");
    let pid = cri
        .sandbox_pid(&sandbox.id)
        .await
        .unwrap()
        .expect("its pid");
    assert_ne!(
        std::fs::read_link(format!("/proc/{pid}/ns/net")).unwrap(),
        std::fs::read_link("/proc/self/ns/net").unwrap(),
        "a network namespace of its own"
    );

    // Everything bracketed: containerd and the host asked before and after the summary.
    let c0 = app(cri.list_container_stats(filter.clone()).await.unwrap());
    let img0 = cri.image_fs_info().await.unwrap();
    let (pod0, host0) = (eth0(Some(pid)), eth0(None));
    let (code, body) = e.get("/stats/summary").await;
    let (pod1, host1) = (eth0(Some(pid)), eth0(None));
    let img1 = cri.image_fs_info().await.unwrap();
    let c1 = app(cri.list_container_stats(filter.clone()).await.unwrap());
    assert_eq!(code, 200, "{body}");
    let summary: serde_json::Value = serde_json::from_str(&body).unwrap();
    let pod = summary["pods"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["podRef"]["name"] == "stats")
        .unwrap_or_else(|| panic!("no stats pod in {body}"))
        .clone();
    let c = &pod["containers"][0];
    let n = |v: &serde_json::Value| v.as_u64().unwrap_or_else(|| panic!("not a number: {v}"));
    let within = |lo: u64, v: u64, hi: u64, what: &str| {
        assert!(lo <= v && v <= hi, "{what}: {lo} <= {v} <= {hi}");
    };

    // The writable layer: containerd's number, the 1 MiB in it, on the image filesystem.
    let rootfs = n(&c["rootfs"]["usedBytes"]);
    within(layer(&c0).unwrap(), rootfs, layer(&c1).unwrap(), "rootfs");
    assert!(rootfs >= 1 << 20);
    let mountpoint = c0
        .as_ref()
        .unwrap()
        .writable_layer
        .as_ref()
        .unwrap()
        .fs_id
        .as_ref()
        .unwrap()
        .mountpoint
        .clone();
    assert_eq!(
        n(&c["rootfs"]["capacityBytes"]),
        df(std::path::Path::new(&mountpoint)).0
    );
    // The runtime's image filesystem: what ImageFsInfo says.
    let used = |r: &[edgehub::cri::api::FilesystemUsage]| r[0].used_bytes.as_ref().unwrap().value;
    let image_fs = &summary["node"]["runtime"]["imageFs"];
    let (a, b) = (used(&img0), used(&img1));
    within(a.min(b), n(&image_fs["usedBytes"]), a.max(b), "imageFs");
    let image_mount = img0[0].fs_id.as_ref().unwrap().mountpoint.clone();
    assert_eq!(
        n(&image_fs["capacityBytes"]),
        df(std::path::Path::new(&image_mount)).0
    );
    // Memory: the working set containerd reports, within its moment-to-moment drift.
    let ws = |s: &Option<edgehub::cri::api::ContainerStats>| {
        s.as_ref()
            .unwrap()
            .memory
            .as_ref()
            .unwrap()
            .working_set_bytes
            .as_ref()
            .unwrap()
            .value
    };
    let got = n(&c["memory"]["workingSetBytes"]);
    let (lo, hi) = (ws(&c0).min(ws(&c1)), ws(&c0).max(ws(&c1)));
    within(lo - lo / 4, got, hi + hi / 4 + (256 << 10), "working set");

    // The logs: the container's files as du counts them (it logs nothing more).
    let dir = e.log_dir(&uid);
    let mut files = (0, 0);
    for f in std::fs::read_dir(&dir).unwrap().flatten() {
        if f.file_name().to_string_lossy().starts_with("app_") {
            let (b, i) = du(&f.path());
            files = (files.0 + b, files.1 + i);
        }
    }
    assert!(files.0 > 0);
    assert_eq!(
        (n(&c["logs"]["usedBytes"]), n(&c["logs"]["inodesUsed"])),
        files
    );
    // The emptyDir, as du counts it.
    let volume = pod["volume"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "data")
        .unwrap_or_else(|| panic!("no volume data in {pod}"))
        .clone();
    let vol = du(&e.data.join(format!("pods/{uid}/volumes/empty-dir/data")));
    assert_eq!((n(&volume["usedBytes"]), n(&volume["inodesUsed"])), vol);
    assert!(vol.0 >= 204_800);
    // The pod's ephemeral storage: its writable layer, logs and emptyDir, on the data
    // directory's filesystem.
    let eph = &pod["ephemeral-storage"];
    assert_eq!(n(&eph["usedBytes"]), rootfs + files.0 + vol.0, "{eph}");
    let data_fs = df(&e.data);
    assert_eq!(n(&eph["capacityBytes"]), data_fs.0);
    // The node's filesystem: the data directory's.
    let fs = &summary["node"]["fs"];
    assert_eq!(n(&fs["capacityBytes"]), data_fs.0);
    let avail = n(&fs["availableBytes"]);
    assert!(
        avail.abs_diff(data_fs.1) < 256 << 20,
        "{avail} vs {}",
        data_fs.1
    );

    // The pod's start time: when containerd created its sandbox (to the second).
    assert_eq!(
        edgehub::logs::rfc3339_nanos(pod["startTime"].as_str().unwrap()),
        Some(sandbox.created_at as i128 / 1_000_000_000 * 1_000_000_000)
    );
    // The pod's eth0, in the sandbox's namespace: the blob went out through it.
    let net = &pod["network"];
    assert_eq!(net["name"], "eth0");
    within(pod0.0, n(&net["rxBytes"]), pod1.0, "pod rx");
    within(pod0.1, n(&net["txBytes"]), pod1.1, "pod tx");
    assert!(n(&net["txBytes"]) > 204_800);
    // The node's: the host's eth0.
    let net = &summary["node"]["network"];
    within(host0.0, n(&net["rxBytes"]), host1.0, "node rx");
    within(host0.1, n(&net["txBytes"]), host1.1, "node tx");
}
