//! The node's serving certificate against the fake apiserver (real TLS, real CSRs signed by
//! its CA with the kubelet-serving signer): pending until approved, written 0600, renewed in
//! its window and when the Node's address changes, kept across a restart; self-signed only
//! when asked for.

use base64::Engine;
use edgehub::identity::serving::{Sans, SansSource, ServingCert, ServingPair};
use edgehub::kube::{ApiClient, ClientOptions, Kubeconfig};
use edgehub_testsupport::certs::cert_info;
use edgehub_testsupport::{
    Approval, FakeApiServer, TestOnlyCertWindow, KUBELET_SERVING_SIGNER, NODE_TOKEN, NODE_USER,
};
use serde_json::{json, Value};
use std::net::IpAddr;
use std::os::unix::fs::PermissionsExt;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;

const CSRS: &str = "/apis/certificates.k8s.io/v1/certificatesigningrequests";

fn opts() -> ClientOptions {
    ClientOptions {
        timeout: Duration::from_secs(5),
        watch_idle_timeout: Duration::from_secs(30),
        max_body: 4 << 20,
        node_name: "edge-1".into(),
    }
}

struct Device {
    dir: tempfile::TempDir,
    client: ApiClient,
    ip: Arc<Mutex<IpAddr>>,
}

impl Device {
    fn data(&self) -> std::path::PathBuf {
        self.dir.path().join("data")
    }

    fn sans(&self) -> SansSource {
        let ip = self.ip.clone();
        Arc::new(move || Sans {
            dns: vec!["edge-1".into()],
            ips: vec![*ip.lock().unwrap()],
        })
    }

    fn setup(&self, self_signed: bool) -> (ServingCert, watch::Receiver<Option<Arc<ServingPair>>>) {
        let (mut t, rx) = ServingCert::setup(
            self.client.clone(),
            &self.data(),
            "edge-1",
            self.sans(),
            None,
            self_signed,
        )
        .unwrap();
        t.backoff.initial = Duration::from_millis(100);
        t.backoff.max = Duration::from_millis(500);
        (t, rx)
    }
}

async fn device(s: &FakeApiServer) -> Device {
    let dir = tempfile::tempdir().unwrap();
    let kc = s
        .write_kubeconfig(&dir.path().join("etc"), NODE_TOKEN)
        .unwrap();
    let client = ApiClient::new(&Kubeconfig::load(&kc).unwrap(), opts()).unwrap();
    Device {
        dir,
        client,
        ip: Arc::new(Mutex::new("10.0.2.15".parse().unwrap())),
    }
}

fn serving_csrs(s: &FakeApiServer) -> Vec<Value> {
    s.csrs()
        .into_iter()
        .filter(|c| c["spec"]["signerName"] == KUBELET_SERVING_SIGNER)
        .collect()
}

async fn wait_for(secs: u64, what: &str, f: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(secs);
    while !f() {
        assert!(std::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn approve_serving(s: &FakeApiServer) {
    s.set_csr_approver(Some(Arc::new(|req: &edgehub_testsupport::CsrRequest| {
        if req.signer_name == KUBELET_SERVING_SIGNER && req.username == NODE_USER {
            Approval::Approve {
                reason: "TestApproved".into(),
                message: "the test approves serving CSRs".into(),
            }
        } else {
            Approval::Pending
        }
    })));
}

#[tokio::test]
async fn pending_until_approved_then_served_and_kept_0600() {
    let s = FakeApiServer::start().await.unwrap();
    let d = device(&s).await;
    let (task, rx) = d.setup(false);
    assert!(
        rx.borrow().is_none(),
        "nothing to serve until a certificate exists"
    );
    let (stop_tx, stop_rx) = watch::channel(false);
    let h = tokio::spawn(task.run(stop_rx));

    wait_for(10, "a serving CSR", || serving_csrs(&s).len() == 1).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let csr = serving_csrs(&s).remove(0);
    assert_eq!(
        csr["status"],
        json!({}),
        "left pending by the built-in approver"
    );
    assert_eq!(csr["spec"]["username"], NODE_USER);
    assert_eq!(
        csr["spec"]["usages"],
        json!(["digital signature", "server auth"])
    );
    assert!(rx.borrow().is_none());

    // What an operator without the controller does: `kubectl certificate approve`.
    let name = csr["metadata"]["name"].as_str().unwrap();
    let mut approval = csr.clone();
    approval["status"]["conditions"] = json!([{"type": "Approved", "status": "True",
        "reason": "KubectlApprove", "message": "This CSR was approved by kubectl certificate approve."}]);
    let (code, got) = s
        .raw(
            Some(edgehub_testsupport::ADMIN_TOKEN),
            "PUT",
            &format!("{CSRS}/{name}/approval"),
            Some("application/json"),
            Some(&approval),
        )
        .await
        .unwrap();
    assert_eq!(code, 200, "{got}");
    wait_for(10, "the certificate published", || rx.borrow().is_some()).await;
    let pair = rx.borrow().clone().unwrap();
    assert!(!pair.self_signed);
    let info = cert_info(&pair.cert_pem).unwrap();
    assert!(info.server_auth, "{info:?}");
    assert_eq!(info.sans, vec!["edge-1", "10.0.2.15"]);
    assert!(pair.key_pem.contains("BEGIN PRIVATE KEY"));
    let issued = base64::engine::general_purpose::STANDARD
        .decode(
            s.get("certificatesigningrequests", "", name).unwrap()["status"]["certificate"]
                .as_str()
                .unwrap(),
        )
        .unwrap();
    assert_eq!(
        pair.cert_pem.trim(),
        std::str::from_utf8(&issued).unwrap().trim()
    );

    let file = d.data().join("identity/node-serving.pem");
    let mode = std::fs::metadata(&file).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(text.contains("BEGIN CERTIFICATE") && text.contains("BEGIN PRIVATE KEY"));
    // One CSR: a year's certificate is not renewed now.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(serving_csrs(&s).len(), 1);
    stop_tx.send_replace(true);
    h.await.unwrap();

    // A restart serves the stored certificate at once, and asks for nothing.
    let (task, rx) = d.setup(false);
    assert_eq!(rx.borrow().as_deref(), Some(&*pair));
    let (stop_tx, stop_rx) = watch::channel(false);
    let h = tokio::spawn(task.run(stop_rx));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(serving_csrs(&s).len(), 1);
    stop_tx.send_replace(true);
    h.await.unwrap();
}

#[tokio::test]
async fn renewed_in_its_window_and_when_the_nodes_address_changes() {
    let s = FakeApiServer::start().await.unwrap();
    approve_serving(&s);
    s.set_test_only_certificate_window(Some(TestOnlyCertWindow {
        backdate: Duration::ZERO,
        valid_for: Duration::from_secs(5),
    }));
    let d = device(&s).await;
    let (task, mut rx) = d.setup(false);
    let (stop_tx, stop_rx) = watch::channel(false);
    let h = tokio::spawn(task.run(stop_rx));
    rx.changed().await.unwrap();
    let first = rx.borrow_and_update().clone().unwrap();
    // Renewed between 70 % and 90 % of five seconds, with a new key.
    tokio::time::timeout(Duration::from_secs(10), rx.changed())
        .await
        .expect("renewed in its window")
        .unwrap();
    let second = rx.borrow_and_update().clone().unwrap();
    assert_ne!(first.key_pem, second.key_pem);
    assert_eq!(serving_csrs(&s).len(), 2);

    // A new InternalIP: a new certificate naming it, long before the window says so.
    s.set_test_only_certificate_window(Some(TestOnlyCertWindow {
        backdate: Duration::ZERO,
        valid_for: Duration::from_secs(3600),
    }));
    tokio::time::timeout(Duration::from_secs(10), rx.changed())
        .await
        .expect("renewed again")
        .unwrap();
    rx.borrow_and_update();
    *d.ip.lock().unwrap() = "10.0.2.99".parse().unwrap();
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            rx.changed().await.unwrap();
            let p = rx.borrow_and_update().clone().unwrap();
            if cert_info(&p.cert_pem)
                .unwrap()
                .sans
                .contains(&"10.0.2.99".to_string())
            {
                break;
            }
        }
    })
    .await
    .expect("a certificate for the new address");
    stop_tx.send_replace(true);
    h.await.unwrap();
}

#[tokio::test]
async fn self_signed_only_when_asked_and_then_no_csr() {
    let s = FakeApiServer::start().await.unwrap();
    let d = device(&s).await;
    let (task, rx) = d.setup(true);
    let pair = rx.borrow().clone().expect("served at once");
    assert!(pair.self_signed);
    let info = cert_info(&pair.cert_pem).unwrap();
    assert_eq!(info.subject, info.issuer, "self-signed");
    assert!(info.subject.contains("edge-1@self-signed"), "{info:?}");
    assert_eq!(info.sans, vec!["edge-1", "10.0.2.15"]);
    let (stop_tx, stop_rx) = watch::channel(false);
    let h = tokio::spawn(task.run(stop_rx));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(serving_csrs(&s).is_empty());
    assert!(!d.data().join("identity/node-serving.pem").exists());
    stop_tx.send_replace(true);
    h.await.unwrap();
}
