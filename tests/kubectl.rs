//! A real kubectl (Debian 12's kubernetes-client, 1.20; scripts/setup.sh unpacks it under
//! target/tools) against the fake apiserver, whose node proxy forwards to a running
//! `edgehub run`'s node API as kube-apiserver forwards to port 10250: `kubectl logs` in its
//! forms, `kubectl top node` and `kubectl top pod` (metrics.k8s.io from the node's
//! `/metrics/resource`), the Forbidden messages kubectl prints, `nodes/proxy` through
//! `kubectl get --raw`, and `kubectl exec` (with stdin) and `kubectl port-forward` over
//! SPDY. Needs root and the CRI stack; without them it fails, loudly.

mod common;
#[path = "common/node_api.rs"]
mod node_api;

use edgehub_testsupport::{FakeApiServer, ADMIN_TOKEN, APISERVER_KUBELET_CLIENT};
use serde_json::{json, Value};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const NS: &str = "kubectl-test";
const JANE_TOKEN: &str = "jane-token";

fn kubectl_bin() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("target/tools/kubernetes-client/usr/bin/kubectl");
    assert!(
        p.is_file(),
        "kubectl 1.20 is not at {}: run `bash scripts/setup.sh test` (it unpacks Debian's kubernetes-client there)",
        p.display()
    );
    p
}

/// kubectl with a kubeconfig for `token` and a discovery cache of its own.
struct Kubectl {
    bin: PathBuf,
    kubeconfig: PathBuf,
    home: PathBuf,
}

impl Kubectl {
    fn new(s: &FakeApiServer, dir: &Path, token: &str) -> Kubectl {
        let kubeconfig = s.write_kubeconfig(&dir.join(token), token).unwrap();
        let home = dir.join(format!("{token}-home"));
        std::fs::create_dir_all(&home).unwrap();
        Kubectl {
            bin: kubectl_bin(),
            kubeconfig,
            home,
        }
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(&self.bin);
        c.env("HOME", &self.home)
            .env_remove("KUBECONFIG")
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(args);
        c
    }

    /// Runs kubectl; (success, stdout, stderr).
    fn run(&self, args: &[&str]) -> (bool, String, String) {
        let out = self.command(args).output().unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    fn ok(&self, args: &[&str]) -> String {
        let (ok, out, err) = self.run(args);
        assert!(ok, "kubectl {args:?} failed: {err}{out}");
        out
    }
}

fn busybox(name: &str, script: &str) -> Value {
    json!({"name": name, "image": "127.0.0.1:5000/busybox:1.0", "imagePullPolicy": "IfNotPresent",
        "command": ["sh", "-c", script]})
}

fn pod(node: &str, name: &str, containers: Vec<Value>) -> Value {
    json!({
        "metadata": {"name": name, "namespace": NS, "uid": format!("kubectl-{name}-{}", std::process::id()),
            "resourceVersion": "1", "labels": {"app": name}},
        "spec": {"nodeName": node, "hostNetwork": true, "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 0, "containers": containers},
        "status": {"phase": "Pending"}
    })
}

/// Five numbered lines, then a tick about every 0.3 s with a little counting between, so
/// the container uses some CPU for `kubectl top`; a 4 MiB string held in the shell keeps its
/// working set steady, well above what its forks add and take.
const TALKER: &str = "for i in 1 2 3 4 5; do echo \"line $i\"; done; x=a; i=0; while [ $i -lt 22 ]; do x=$x$x; i=$((i+1)); done; while true; do i=0; while [ $i -lt 3000 ]; do i=$((i+1)); done; echo tick; sleep 0.3; done";

/// kubectl top's CPU column: `12m`.
fn millis(s: &str) -> u64 {
    s.trim_end_matches('m')
        .parse()
        .unwrap_or_else(|_| panic!("cpu {s}"))
}

/// A Kubernetes quantity as a number: `329087452n`, `12m`, `2`, `2748180Ki`, `3Mi`.
fn quantity(s: &str) -> f64 {
    let (num, mult) = [
        ("Ki", 1024f64),
        ("Mi", 1024f64.powi(2)),
        ("Gi", 1024f64.powi(3)),
        ("n", 1e-9),
        ("u", 1e-6),
        ("m", 1e-3),
    ]
    .iter()
    .find_map(|(suffix, m)| s.strip_suffix(suffix).map(|n| (n, *m)))
    .unwrap_or((s, 1.0));
    num.parse::<f64>()
        .unwrap_or_else(|_| panic!("quantity {s}"))
        * mult
}

fn mebis(s: &str) -> u64 {
    s.trim_end_matches("Mi")
        .parse()
        .unwrap_or_else(|_| panic!("memory {s}"))
}

/// kubectl runs as a blocking child process: the fake apiserver serves from other threads.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kubectl_logs_exec_port_forward_and_top_through_the_fake_apiservers_node_proxy() {
    let s = FakeApiServer::start().await.unwrap();
    s.add_token(JANE_TOKEN, "jane");
    let node = format!("edge-kubectl-{}", std::process::id());
    let talker = pod(&node, "talker", vec![busybox("app", TALKER)]);
    let pair = pod(
        &node,
        "pair",
        vec![
            busybox("app", "echo from-app; sleep 3600"),
            busybox("side", "echo from-side; sleep 3600"),
        ],
    );
    // An HTTP server for port-forward, on the host's network as the pods here are.
    let http_port = node_api::free_addr().port();
    let srv = pod(
        &node,
        "srv",
        vec![busybox(
            "httpd",
            &format!("mkdir -p /tmp/www && echo served-by-srv > /tmp/www/index.html && exec httpd -f -p 127.0.0.1:{http_port} -h /tmp/www"),
        )],
    );
    let run = node_api::start_served(&s, &node, &[talker, pair, srv]).await;
    let k = Kubectl::new(&s, run.dir.path(), ADMIN_TOKEN);

    // First, before the node API has allowed the apiserver anything (it caches an allow for
    // 5 minutes, a denial for 30 s, as the kubelet does): the node's SubjectAccessReview
    // denies the apiserver's kubelet-client user. The node API answers 403 and kubectl prints
    // the apiserver's Forbidden around the kubelet's words.
    s.unbind_kubelet_api_admin(APISERVER_KUBELET_CLIENT);
    let (ok, out, err) = k.run(&["logs", "-n", NS, "pair", "-c", "side"]);
    assert!(!ok, "{out}");
    assert!(
        err.contains("Error from server (Forbidden): Forbidden (user=kube-apiserver-kubelet-client, verb=get, resource=nodes, subresource")
            && err.contains("( pods/log pair)"),
        "{err}"
    );
    s.bind_kubelet_api_admin(APISERVER_KUBELET_CLIENT);

    // A user RBAC does not allow: kubectl's Forbidden, from the apiserver.
    let jane = Kubectl::new(&s, run.dir.path(), JANE_TOKEN);
    let (ok, _, err) = jane.run(&["logs", "-n", NS, "talker"]);
    assert!(!ok);
    assert!(
        err.contains(&format!("Error from server (Forbidden): pods \"talker\" is forbidden: User \"jane\" cannot get resource \"pods/log\" in API group \"\" in the namespace \"{NS}\"")),
        "{err}"
    );
    let (ok, _, err) = jane.run(&["top", "pod", "-n", NS]);
    assert!(!ok && err.contains("Forbidden"), "{err}");
    // kubectl logs: the whole log, once the ticks come (and the denial above has expired).
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let (ok, out, err) = k.run(&["logs", "-n", NS, "talker"]);
        if ok && out.matches("tick\n").count() >= 3 {
            assert!(
                out.starts_with("line 1\nline 2\nline 3\nline 4\nline 5\ntick\n"),
                "{out}"
            );
            break;
        }
        assert!(Instant::now() < deadline, "kubectl logs: {err}{out}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(
        k.ok(&["logs", "-n", NS, "talker", "--tail", "2"]),
        "tick\ntick\n"
    );
    let out = k.ok(&[
        "logs",
        "-n",
        NS,
        "talker",
        "--timestamps",
        "--limit-bytes",
        "40",
    ]);
    assert_eq!(out.len(), 40, "{out}");
    let (ts, rest) = out.split_once(' ').unwrap();
    assert!(edgehub::logs::rfc3339_nanos(ts).is_some(), "{out}");
    assert!(rest.starts_with("line 1\n"), "{out}");
    // --since: the numbered lines are older than a second by now; recent ticks are not.
    let out = k.ok(&["logs", "-n", NS, "talker", "--since", "1s"]);
    assert!(!out.contains("line 1") && out.contains("tick"), "{out}");
    assert!(k
        .ok(&["logs", "-n", NS, "talker", "--since", "1h"])
        .starts_with("line 1\n"));
    // No earlier attempt: the node API's 400, its words relayed as a BadRequest.
    let (ok, _, err) = k.run(&["logs", "-n", NS, "talker", "--previous"]);
    assert!(!ok);
    assert!(
        err.contains(
            "Error from server (BadRequest): previous terminated container \"app\" in pod"
        ),
        "{err}"
    );
    // -c picks the container; without it, kubectl 1.20 itself refuses a pod of two, with
    // the words the apiserver uses (fixture `pod_log_two_containers_no_container_bad_request`).
    assert_eq!(
        k.ok(&["logs", "-n", NS, "pair", "-c", "side"]),
        "from-side\n"
    );
    assert_eq!(k.ok(&["logs", "-n", NS, "pair", "-c", "app"]), "from-app\n");
    let (ok, _, err) = k.run(&["logs", "-n", NS, "pair"]);
    assert!(!ok);
    assert!(
        err.contains("a container name must be specified for pod pair, choose one of: [app side]"),
        "{err}"
    );
    // -f: new ticks keep coming until kubectl is stopped.
    let mut follow = k
        .command(&["logs", "-n", NS, "talker", "-f", "--tail", "1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdout = follow.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut got = Vec::new();
        let mut buf = [0u8; 256];
        while let Ok(n) = stdout.read(&mut buf) {
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
        String::from_utf8_lossy(&got).into_owned()
    });
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        follow.try_wait().unwrap().is_none(),
        "kubectl logs -f ended by itself"
    );
    follow.kill().unwrap();
    let _ = follow.wait();
    let followed = reader.join().unwrap();
    assert!(followed.matches("tick\n").count() >= 4, "{followed}");

    // metrics.k8s.io, scraped from the node: the container's CPU over the window is what
    // containerd counted in it (bracketed by asking containerd before and after), and its
    // working set is containerd's.
    let (cpu0, mem0) = node_api::cri_usage(&run, "talker", "app").await;
    let t0 = Instant::now();
    let (code, pm) = s
        .raw(
            Some(ADMIN_TOKEN),
            "GET",
            &format!("/apis/metrics.k8s.io/v1beta1/namespaces/{NS}/pods/talker"),
            None,
            None,
        )
        .await
        .unwrap();
    let (cpu1, mem1) = node_api::cri_usage(&run, "talker", "app").await;
    let elapsed = t0.elapsed().as_secs_f64();
    assert_eq!(code, 200, "{pm}");
    assert_eq!(pm["kind"], "PodMetrics");
    let c = &pm["containers"][0];
    assert_eq!(c["name"], "app");
    let nanocores = quantity(c["usage"]["cpu"].as_str().unwrap()) * 1e9;
    let window: f64 = pm["window"]
        .as_str()
        .unwrap()
        .trim_end_matches('s')
        .parse()
        .unwrap();
    let used = nanocores * window;
    assert!(used > 0.0, "{pm}");
    assert!(
        used <= (cpu1 - cpu0) as f64 * 1.01,
        "{used} ns in the window, {} ns in {elapsed} s",
        cpu1 - cpu0
    );
    let mem = quantity(c["usage"]["memory"].as_str().unwrap());
    let (lo, hi) = (mem0.min(mem1) as f64, mem0.max(mem1) as f64);
    assert!(
        lo / 2.0 <= mem && mem <= hi * 2.0,
        "{mem} vs containerd's {lo}..{hi}"
    );

    // kubectl top node / top pod: non-zero numbers for this node and these pods.
    let out = k.ok(&["top", "node"]);
    let row: Vec<&str> = out
        .lines()
        .find(|l| l.starts_with(&node))
        .unwrap_or_else(|| panic!("{out}"))
        .split_whitespace()
        .collect();
    assert!(millis(row[1]) > 0 && mebis(row[3]) > 0, "{out}");
    let out = k.ok(&["top", "pod", "-n", NS]);
    let row: Vec<&str> = out
        .lines()
        .find(|l| l.starts_with("talker "))
        .unwrap_or_else(|| panic!("{out}"))
        .split_whitespace()
        .collect();
    assert!(mebis(row[2]) > 0, "{out}");
    assert!(millis(row[1]) > 0, "{out}");
    assert!(out.lines().any(|l| l.starts_with("pair ")), "{out}");

    // nodes/proxy: refused for a loopback address, as kube-apiserver refuses it; with the
    // fake's test-only switch, the node API's own answer.
    let raw = format!("/api/v1/nodes/{node}/proxy/healthz");
    let (ok, _, err) = k.run(&["get", "--raw", &raw]);
    assert!(!ok && err.contains("address not allowed"), "{err}");
    s.set_test_only_loopback_node_proxy(true);
    assert_eq!(k.ok(&["get", "--raw", &raw]), "ok");

    // Granted by RBAC, jane's logs go through.
    s.grant_kubelet_proxy("jane");
    assert_eq!(
        jane.ok(&["logs", "-n", NS, "pair", "-c", "side"]),
        "from-side\n"
    );

    // kubectl exec (SPDY from kubectl 1.20, relayed by the fake, proxied by the node to the
    // runtime's streaming server): a command's output, then stdin with -i.
    assert_eq!(
        k.ok(&["exec", "-n", NS, "talker", "--", "echo", "hello from exec"]),
        "hello from exec\n"
    );
    let mut cat = k
        .command(&["exec", "-i", "-n", NS, "talker", "--", "cat"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        let mut stdin = cat.stdin.take().unwrap();
        stdin.write_all(b"line in\nanother line\n").unwrap();
    }
    let out = cat.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "line in\nanother line\n"
    );

    // kubectl port-forward: it needs the pod Running, as edgehub reports it.
    let deadline = Instant::now() + Duration::from_secs(60);
    while s
        .get("pods", NS, "srv")
        .is_none_or(|p| p["status"]["phase"] != "Running")
    {
        assert!(Instant::now() < deadline, "srv never Running");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let local = node_api::free_addr().port();
    let mut pf = k
        .command(&[
            "port-forward",
            "-n",
            NS,
            "pod/srv",
            &format!("{local}:{http_port}"),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut pf_out = pf.stdout.take().unwrap();
    // Reads kubectl's stdout to the end (a closed pipe would kill it at its next line),
    // handing over the first "Forwarding from ..." line.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut got = Vec::new();
        let mut b = [0u8; 1];
        let mut sent = false;
        while let Ok(1) = pf_out.read(&mut b) {
            got.push(b[0]);
            if !sent && b[0] == b'\n' && String::from_utf8_lossy(&got).contains("Forwarding from") {
                let _ = tx.send(String::from_utf8_lossy(&got).into_owned());
                sent = true;
            }
        }
        if !sent {
            let _ = tx.send(String::from_utf8_lossy(&got).into_owned());
        }
    });
    let said = rx.recv_timeout(Duration::from_secs(30)).unwrap_or_default();
    assert!(said.contains("Forwarding from 127.0.0.1"), "{said}");
    // httpd may still be starting: retry the GET for a while.
    let deadline = Instant::now() + Duration::from_secs(30);
    let body = loop {
        let got = http_get(local).await;
        match got {
            Ok(b) if b.contains("served-by-srv") => break b,
            other => assert!(Instant::now() < deadline, "port-forward GET: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert!(body.starts_with("HTTP/1."), "{body}");
    pf.kill().unwrap();
    let _ = pf.wait();
}

/// A plain HTTP GET of / on 127.0.0.1:`port`: the whole answer as text.
async fn http_get(port: u16) -> std::io::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut c = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    c.write_all(b"GET / HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .await?;
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), c.read_to_end(&mut out))
        .await
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
    Ok(String::from_utf8_lossy(&out).into_owned())
}
