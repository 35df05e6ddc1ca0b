//! TLS bootstrap and rotation against the fake apiserver (real TLS, real CSRs signed by its
//! CA): first boot with only a bootstrap kubeconfig, rotation with short certificates, a
//! certificate that lapsed, and the errors a CSR round can meet.

use edgehub::identity::request::{obtain, RequestError};
use edgehub::identity::{Identity, IdentityConfig};
use edgehub::kube::resource::{NODES, PODS};
use edgehub::kube::{ApiClient, ClientOptions, Kubeconfig, ListParams};
use edgehub_testsupport::{Approval, BootstrapToken, FakeApiServer, TestOnlyCertWindow};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

fn token() -> BootstrapToken {
    BootstrapToken::new("edge01", "0123456789abcdef")
}

fn opts() -> ClientOptions {
    ClientOptions {
        timeout: Duration::from_secs(5),
        watch_idle_timeout: Duration::from_secs(30),
        max_body: 4 << 20,
        node_name: "edge-1".into(),
    }
}

struct Device {
    _dir: tempfile::TempDir,
    data: PathBuf,
    boot: PathBuf,
}

async fn fake() -> (FakeApiServer, Device) {
    let s = FakeApiServer::start().await.unwrap();
    s.add_bootstrap_token(token());
    let dir = tempfile::tempdir().unwrap();
    let boot = s
        .write_kubeconfig(&dir.path().join("etc"), &token().bearer())
        .unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    (
        s,
        Device {
            _dir: dir,
            data,
            boot,
        },
    )
}

fn setup(d: &Device) -> (ApiClient, Identity) {
    let cfg = IdentityConfig {
        bootstrap_kubeconfig: Some(d.boot.clone()),
        cert_expiration_secs: None,
        ..IdentityConfig::default()
    };
    let (c, mut i) = Identity::setup(&cfg, &d.boot, &d.data, "edge-1", opts()).unwrap();
    i.backoff.initial = Duration::from_millis(100);
    i.backoff.max = Duration::from_millis(500);
    i.confirm_within = Duration::from_secs(5);
    (c, i)
}

fn node_body(name: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({"apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}}}))
    .unwrap()
}

async fn wait_for(secs: u64, what: &str, f: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(secs);
    while !f() {
        assert!(std::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn credential(data: &Path) -> PathBuf {
    edgehub::identity::files::credential_path(data)
}

#[tokio::test]
async fn first_boot_makes_the_node_credential_on_the_device() {
    let (s, d) = fake().await;
    let (client, identity) = setup(&d);
    // Before the first round the node client sends nothing: offline, so nothing is parked.
    let e = client.get(&NODES, None, "edge-1").await.unwrap_err();
    assert!(e.is_offline(), "{e}");
    assert_eq!(
        s.requests().len(),
        0,
        "no request went out with the bootstrap token"
    );

    let stats = identity.stats.clone();
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(identity.run(stop));
    wait_for(10, "the first certificate", || {
        stats.bootstraps.load(Ordering::Relaxed) == 1
    })
    .await;

    // The node registers under its own name, with the certificate (no token).
    client
        .create(&NODES, None, node_body("edge-1"))
        .await
        .unwrap();
    let last = s.requests().last().cloned().unwrap();
    assert_eq!(
        (last.status, last.user.as_deref()),
        (201, Some("system:node:edge-1"))
    );

    // The key was made here and stays here: 0600 in a 0700 directory, and the CSR carries
    // only the public half.
    let path = credential(&d.data);
    assert!(path.starts_with(&d.data));
    let meta = std::fs::metadata(&path).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    let dir_mode = std::fs::metadata(path.parent().unwrap())
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(dir_mode & 0o777, 0o700);
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains("BEGIN CERTIFICATE") && text.contains("BEGIN PRIVATE KEY"));
    let csrs = s.csrs();
    assert_eq!(csrs.len(), 1);
    let csr = &csrs[0];
    assert_eq!(csr["spec"]["username"], "system:bootstrap:edge01");
    assert!(!csr.to_string().contains("PRIVATE"), "{csr}");
    assert_eq!(
        csr["spec"]["signerName"],
        "kubernetes.io/kube-apiserver-client-kubelet"
    );

    // The bootstrap token is not the node: it may not create the Node.
    let boot = ApiClient::new(&Kubeconfig::load(&d.boot).unwrap(), opts()).unwrap();
    let e = boot
        .create(&NODES, None, node_body("edge-1"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(403), "{e}");

    // A restart uses the stored credential at once: no second CSR.
    stop_tx.send(true).unwrap();
    task.await.unwrap();
    let (again, _identity) = setup(&d);
    again.get(&NODES, None, "edge-1").await.unwrap();
    assert_eq!(s.csrs().len(), 1);
}

#[tokio::test]
async fn two_rotations_without_a_relist_or_a_401() {
    let (s, d) = fake().await;
    s.set_test_only_certificate_window(Some(TestOnlyCertWindow {
        backdate: Duration::from_secs(1),
        valid_for: Duration::from_secs(7),
    }));
    s.set_bookmark_interval(Duration::from_millis(500));
    let (client, identity) = setup(&d);
    let stats = identity.stats.clone();
    let (_stop_tx, stop) = tokio::sync::watch::channel(false);
    tokio::spawn(identity.run(stop));
    wait_for(10, "the first certificate", || {
        stats.bootstraps.load(Ordering::Relaxed) == 1
    })
    .await;

    // One list, then watches from its version, re-opened from the cursor as they end, and a
    // request every 200 ms, across two rotations.
    let params = ListParams::default();
    let page = client.list(&PODS, None, &params, None, None).await.unwrap();
    let mut rv = page.resource_version;
    let watcher = {
        let client = client.clone();
        let stats = stats.clone();
        tokio::spawn(async move {
            while stats.rotations.load(Ordering::Relaxed) < 2 {
                let mut w = client.watch(&PODS, None, &params, &rv, 2).await.unwrap();
                while let Some(ev) = w.next().await.unwrap() {
                    if let edgehub::kube::WatchEvent::Bookmark {
                        resource_version, ..
                    } = ev
                    {
                        rv = resource_version;
                    }
                }
            }
        })
    };
    let pinger = {
        let client = client.clone();
        let stats = stats.clone();
        tokio::spawn(async move {
            while stats.rotations.load(Ordering::Relaxed) < 2 {
                client.get(&NODES, None, "edge-1").await.ok();
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };
    wait_for(30, "two rotations", || {
        stats.rotations.load(Ordering::Relaxed) >= 2
    })
    .await;
    watcher.await.unwrap();
    pinger.await.unwrap();

    let reqs = s.requests();
    let unauthorized: Vec<_> = reqs.iter().filter(|r| r.status == 401).collect();
    assert!(unauthorized.is_empty(), "{unauthorized:?}");
    assert_eq!(
        reqs.iter().filter(|r| r.is_list_of("pods")).count(),
        1,
        "no relist"
    );
    // The renewals were made by the node itself and approved as selfnodeclient.
    let renewals: Vec<_> = s
        .csrs()
        .into_iter()
        .filter(|c| c["spec"]["username"] == "system:node:edge-1")
        .collect();
    assert_eq!(renewals.len(), 2);
    for c in &renewals {
        assert_eq!(
            c["status"]["conditions"][0]["message"],
            "Auto approving self kubelet client certificate after SubjectAccessReview."
        );
    }
    // The file holds the newest certificate.
    let text = std::fs::read_to_string(credential(&d.data)).unwrap();
    let newest = renewals
        .iter()
        .max_by_key(|c| {
            c["metadata"]["resourceVersion"]
                .as_str()
                .unwrap()
                .parse::<u64>()
                .unwrap()
        })
        .unwrap();
    use base64::Engine;
    let pem = base64::engine::general_purpose::STANDARD
        .decode(newest["status"]["certificate"].as_str().unwrap())
        .unwrap();
    assert!(text.starts_with(std::str::from_utf8(&pem).unwrap().trim()));
    // One file write per certificate.
    let per = stats.bytes_written.load(Ordering::Relaxed) / 3;
    assert!(per > 500 && per < 2000, "{per} bytes per credential");
}

#[tokio::test]
async fn a_lapsed_certificate_goes_back_to_the_bootstrap_token() {
    let (s, d) = fake().await;
    s.set_test_only_certificate_window(Some(TestOnlyCertWindow {
        backdate: Duration::from_secs(1),
        valid_for: Duration::from_secs(3),
    }));
    let (client, identity) = setup(&d);
    let stats = identity.stats.clone();
    let (_stop_tx, stop) = tokio::sync::watch::channel(false);
    tokio::spawn(identity.run(stop));
    wait_for(10, "the first certificate", || {
        stats.bootstraps.load(Ordering::Relaxed) == 1
    })
    .await;
    // Offline through the rest of the certificate's life: nothing can renew it.
    s.set_offline(true).await.unwrap();
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(client
        .get(&NODES, None, "edge-1")
        .await
        .unwrap_err()
        .is_offline());
    s.set_test_only_certificate_window(None);
    s.set_offline(false).await.unwrap();
    wait_for(15, "a second bootstrap", || {
        stats.bootstraps.load(Ordering::Relaxed) == 2
    })
    .await;
    client
        .create(&NODES, None, node_body("edge-1"))
        .await
        .unwrap();
    let boots = s
        .csrs()
        .into_iter()
        .filter(|c| c["spec"]["username"] == "system:bootstrap:edge01")
        .count();
    assert_eq!(
        boots, 2,
        "the second certificate came through the bootstrap token"
    );
    // A new key for every bootstrap (issue 31 item 9): the controller's attested approval
    // approves a key once, so a vehicle that bootstrapped again with its old key would be
    // denied as a replay; and the key in use is the one of the CSR whose certificate is in
    // use.
    let csrs = s.csrs();
    let keys: Vec<Vec<u8>> = csrs.iter().map(csr_key).collect();
    assert_eq!(keys.len(), 2);
    assert_ne!(
        keys[0], keys[1],
        "the second bootstrap reused the first key"
    );
    let file = std::fs::read_to_string(credential(&d.data)).unwrap();
    let key_at = file.find("-----BEGIN PRIVATE KEY-----").unwrap();
    let in_use = rcgen::KeyPair::from_pem(&file[key_at..]).unwrap();
    let issued = |c: &serde_json::Value| {
        use base64::Engine;
        base64::engine::general_purpose::STANDARD
            .decode(c["status"]["certificate"].as_str().unwrap_or(""))
            .unwrap_or_default()
    };
    let last = csrs
        .iter()
        .position(|c| issued(c) == file.as_bytes()[..key_at])
        .expect("the certificate in use came from one of the CSRs");
    assert_eq!(
        rcgen::PublicKeyData::subject_public_key_info(&in_use),
        keys[last]
    );
}

/// The SubjectPublicKeyInfo (DER) a stored CSR asks a certificate for.
fn csr_key(csr: &serde_json::Value) -> Vec<u8> {
    use base64::Engine;
    let pem = base64::engine::general_purpose::STANDARD
        .decode(csr["spec"]["request"].as_str().unwrap())
        .unwrap();
    let req = rcgen::CertificateSigningRequestParams::from_pem(std::str::from_utf8(&pem).unwrap())
        .unwrap();
    rcgen::PublicKeyData::subject_public_key_info(&req.public_key)
}

#[tokio::test]
async fn a_round_names_what_went_wrong() {
    let (s, d) = fake().await;
    let boot = ApiClient::new(&Kubeconfig::load(&d.boot).unwrap(), opts()).unwrap();
    let none = Default::default();

    s.set_csr_approver(Some(Arc::new(|_: &edgehub_testsupport::CsrRequest| {
        Approval::Deny {
            reason: "NotAttested".into(),
            message: "no factory certificate".into(),
        }
    })));
    let e = obtain(&boot, "edge-1", None, &none, None)
        .await
        .unwrap_err();
    assert!(
        matches!(e, RequestError::Denied { ref reason, .. } if reason == "NotAttested"),
        "{e}"
    );
    assert!(e.to_string().contains("no factory certificate"), "{e}");

    // A CSR deleted while pending.
    s.set_csr_approver(Some(Arc::new(|_: &edgehub_testsupport::CsrRequest| {
        Approval::Pending
    })));
    let (r, ()) = tokio::join!(obtain(&boot, "edge-1", None, &none, None), async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        for c in s.csrs() {
            s.remove(
                "certificatesigningrequests",
                "",
                c["metadata"]["name"].as_str().unwrap(),
            );
        }
    });
    assert!(matches!(r, Err(RequestError::Gone { .. })), "{:?}", r.err());

    // An expired bootstrap token: the plain 401.
    s.remove_bootstrap_token("edge01");
    let e = obtain(&boot, "edge-1", None, &none, None)
        .await
        .unwrap_err();
    assert!(e.is_unauthorized(), "{e}");
    // The apiserver down: offline, tried again later.
    s.set_offline(true).await.unwrap();
    let e = obtain(&boot, "edge-1", None, &none, None)
        .await
        .unwrap_err();
    assert!(e.is_offline(), "{e}");
}
