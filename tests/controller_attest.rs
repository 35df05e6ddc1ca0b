//! Attested approval end to end (issue 22 item 4): `edgehub controller --attest-fleet-ca`
//! against the fake apiserver set up as deploy/bootstrap-attested.yaml says (the kubeadm
//! auto-approval of bootstrap CSRs removed, selfnodeclient kept), with devices that sign
//! their CSR's key and node name with a factory key (`edgehub::attest::FactoryKey`, the
//! device's code) and post the CSR with the fleet's one bootstrap token, as a vehicle does.

#![cfg(feature = "controller")]

mod controller_common;

use base64::Engine;
use controller_common::*;
use edgehub::attest::{FactoryKey, ANNOTATION};
use edgehub::identity::request::{obtain, RequestError};
use edgehub::identity::{Identity, IdentityConfig};
use edgehub::kube::resource::NODES;
use edgehub::kube::{ApiClient, ClientOptions, Kubeconfig};
use edgehub_testsupport::certs::node_csr;
use edgehub_testsupport::{fixture, BootstrapToken, ClientPem, FakeApiServer};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, PublicKeyData,
};
use serde_json::{json, Value};
use std::time::Duration;

const CSRS: &str = "/apis/certificates.k8s.io/v1/certificatesigningrequests";
const FLEET_CA: &str = "configmap/kube-system/edgehub-fleet-ca";

/// A fleet CA, as the factory's PKI has it.
struct Ca {
    pem: String,
    issuer: Issuer<'static, KeyPair>,
}

fn ca(cn: &str) -> Ca {
    let key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, cn);
    p.distinguished_name = dn;
    let cert = p.self_signed(&key).unwrap();
    Ca {
        pem: cert.pem(),
        issuer: Issuer::new(p, key),
    }
}

/// A vehicle's factory key and certificate (dNSName = its node name), from `ca`: PEMs.
fn factory_pems(ca: &Ca, node: &str) -> (String, String) {
    let key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::new(vec![node.to_string()]).unwrap();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, format!("VIN-{node}"));
    p.distinguished_name = dn;
    p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let cert = p.signed_by(&key, &ca.issuer).unwrap();
    (key.serialize_pem(), cert.pem())
}

fn factory(ca: &Ca, node: &str) -> FactoryKey {
    let (key, chain) = factory_pems(ca, node);
    FactoryKey::from_pem(key.as_bytes(), chain.as_bytes()).unwrap()
}

fn fleet_ca_configmap(ca: &Ca) -> Value {
    json!({"apiVersion": "v1", "kind": "ConfigMap",
           "metadata": {"name": "edgehub-fleet-ca", "namespace": "kube-system"},
           "data": {"ca.crt": ca.pem}})
}

/// A CSR as the device posts it: the recorded bootstrap request's body with a fresh key for
/// `node`, attested by `sign(csr spki)` when it gives an annotation. Returns (body, key PEM).
fn csr(node: &str, sign: impl FnOnce(&[u8]) -> Option<String>) -> (Value, String) {
    let mut body = fixture("csr_create_as_bootstrap")["request"]["body"].clone();
    let (pem, key) = node_csr(&format!("system:node:{node}"), "system:nodes").unwrap();
    body["spec"]["request"] = base64::engine::general_purpose::STANDARD
        .encode(&pem)
        .into();
    let spki = KeyPair::from_pem(&key).unwrap().subject_public_key_info();
    if let Some(a) = sign(&spki) {
        body["metadata"]["annotations"] = json!({ ANNOTATION: a });
    }
    (body, key)
}

async fn post(
    s: &FakeApiServer,
    bearer: Option<&str>,
    me: Option<&ClientPem<'_>>,
    body: &Value,
) -> String {
    let (code, created) = s
        .raw_as(
            bearer,
            me,
            "POST",
            CSRS,
            Some("application/json"),
            Some(body),
        )
        .await
        .unwrap();
    assert_eq!(code, 201, "{created}");
    created["metadata"]["name"].as_str().unwrap().to_string()
}

/// Waits for the CSR's decision: (condition type, reason, message).
async fn decision(s: &FakeApiServer, name: &str) -> (String, String, String) {
    let decided = |o: &Value| {
        o.pointer("/status/conditions")
            .and_then(Value::as_array)
            .is_some_and(|c| !c.is_empty())
    };
    let got = s
        .wait_for_object(
            "certificatesigningrequests",
            "",
            name,
            Duration::from_secs(30),
            decided,
        )
        .await
        .unwrap_or_else(|last| panic!("{name} not decided: {last}"));
    let c = &got["status"]["conditions"][0];
    let s = |k: &str| c[k].as_str().unwrap_or("").to_string();
    (s("type"), s("reason"), s("message"))
}

async fn issued_cert(s: &FakeApiServer, name: &str) -> String {
    let got = s
        .wait_for_object(
            "certificatesigningrequests",
            "",
            name,
            Duration::from_secs(10),
            |o| o.pointer("/status/certificate").is_some(),
        )
        .await
        .unwrap_or_else(|last| panic!("{name} not issued: {last}"));
    let b = base64::engine::general_purpose::STANDARD
        .decode(got["status"]["certificate"].as_str().unwrap())
        .unwrap();
    String::from_utf8(b).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_device_whose_factory_certificate_names_it_gets_a_first_certificate() {
    let server = FakeApiServer::start().await.unwrap();
    let token = BootstrapToken::new("edge01", "0123456789abcdef");
    server.add_bootstrap_token(token.clone());
    let bearer = token.bearer();
    // deploy/bootstrap-attested.yaml: no kubeadm:node-autoapprove-bootstrap, rotation kept.
    server.set_csr_autoapprove_bindings(false, true);
    let fleet = ca("fleet-ca");
    let dir = tempfile::tempdir().unwrap();
    let kc = admin_kubeconfig(&server, dir.path());
    let ctl = Controller::start(&kc, "replica-a", &["--attest-fleet-ca", FLEET_CA]);
    wait_until(30, "the controller leads", || ctl.leading()).await;

    // Before the fleet CA is there, nothing is decided: the CSR waits, it is not denied.
    let edge1 = factory(&fleet, "edge-1");
    let (body, key1) = csr("edge-1", |spki| Some(edge1.sign(spki, "edge-1").unwrap()));
    let first = post(&server, Some(&bearer), None, &body).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let pending = server
        .get("certificatesigningrequests", "", &first)
        .unwrap();
    assert!(
        pending.pointer("/status/conditions").is_none(),
        "decided without a fleet CA: {pending}"
    );
    server.apply("configmaps", fleet_ca_configmap(&fleet));

    // 1. A device with a valid factory certificate for its name: approved, then issued.
    let (kind, reason, message) = decision(&server, &first).await;
    assert_eq!(
        (kind.as_str(), reason.as_str()),
        ("Approved", "AttestedDeviceApproved"),
        "{message}"
    );
    assert!(message.contains("names node edge-1"), "{message}");
    let cert1 = issued_cert(&server, &first).await;

    // 2. The same bootstrap token asking for another vehicle's name (the device signs
    //    honestly for edge-2, but its factory certificate names edge-1): denied.
    let (body, _) = csr("edge-2", |spki| Some(edge1.sign(spki, "edge-2").unwrap()));
    let other_name = post(&server, Some(&bearer), None, &body).await;
    // 3. A factory certificate from another CA: denied.
    let stranger = factory(&ca("fleet-ca"), "edge-3");
    let (body, _) = csr("edge-3", |spki| {
        Some(stranger.sign(spki, "edge-3").unwrap())
    });
    let other_ca = post(&server, Some(&bearer), None, &body).await;
    // 4. A signature over a different key (an attestation lifted from another CSR): denied.
    let edge4 = factory(&fleet, "edge-4");
    let lifted = csr("edge-4", |spki| Some(edge4.sign(spki, "edge-4").unwrap())).0;
    let (mut body, _) = csr("edge-4", |_| None);
    body["metadata"]["annotations"] = lifted["metadata"]["annotations"].clone();
    let other_key = post(&server, Some(&bearer), None, &body).await;
    // 5. The token alone, no attestation: denied.
    let (body, _) = csr("edge-5", |_| None);
    let bare = post(&server, Some(&bearer), None, &body).await;

    for (name, want) in [
        (&other_name, "NodeNameMismatch"),
        (&other_ca, "FactoryCertificateUntrusted"),
        (&other_key, "AttestationSignatureInvalid"),
        (&bare, "AttestationMissing"),
    ] {
        let (kind, reason, message) = decision(&server, name).await;
        assert_eq!(
            (kind.as_str(), reason.as_str()),
            ("Denied", want),
            "{message}"
        );
        println!("{want}: {message}");
        let csr = server.get("certificatesigningrequests", "", name).unwrap();
        assert!(csr.pointer("/status/certificate").is_none(), "{csr}");
    }

    // A renewal by the node with its issued certificate is selfnodeclient's: approved by the
    // cluster, untouched by the controller.
    let me = ClientPem {
        cert: &cert1,
        key: &key1,
    };
    let (body, _) = csr("edge-1", |_| None);
    let renewal = post(&server, None, Some(&me), &body).await;
    let (kind, reason, _) = decision(&server, &renewal).await;
    assert_eq!(
        (kind.as_str(), reason.as_str()),
        ("Approved", "AutoApproved")
    );
    issued_cert(&server, &renewal).await;
    tokio::time::sleep(Duration::from_millis(500)).await;

    // The controller's requests for this: one list and one watch of the signer's CSRs, one
    // /approval write per bootstrap CSR and none for the renewal, the fleet CA read twice:
    // missing when the first CSR came, found 10 s later, then kept for a minute; and for the
    // one approval, the node's record of attested keys read and written once (the denials
    // read no record).
    let by_kind = requests_by_kind(&server);
    println!("controller requests: {by_kind:#?}");
    let n = |k: &str| by_kind.get(k).copied().unwrap_or(0);
    assert_eq!(n("GET certificatesigningrequests"), 1, "{by_kind:?}");
    assert_eq!(
        n("GET certificatesigningrequests (watch)"),
        1,
        "{by_kind:?}"
    );
    assert_eq!(
        n("PUT certificatesigningrequests/approval"),
        5,
        "{by_kind:?}"
    );
    let configmaps = |method: &str, ns: &str| {
        server.count(|r| {
            r.user.as_deref() == Some("admin")
                && r.method == method
                && r.path.contains(&format!("/namespaces/{ns}/configmaps"))
        })
    };
    assert_eq!(configmaps("GET", "kube-system"), 2, "{by_kind:?}");
    assert_eq!(configmaps("GET", "edgehub-attest"), 1, "{by_kind:?}");
    assert_eq!(configmaps("POST", "edgehub-attest"), 1, "{by_kind:?}");
    assert_eq!(n("GET configmaps"), 3, "{by_kind:?}");
    // Both the list and the watch are narrowed to the kubelet client signer.
    let selectors: Vec<Option<String>> = server
        .requests()
        .into_iter()
        .filter(|r| {
            r.user.as_deref() == Some("admin") && r.resource == "certificatesigningrequests"
        })
        .map(|r| r.query.get("fieldSelector").cloned())
        .collect();
    assert_eq!(selectors.len(), 2, "{selectors:?}");
    assert!(
        selectors
            .iter()
            .all(|f| f.as_deref()
                == Some("spec.signerName=kubernetes.io/kube-apiserver-client-kubelet")),
        "{selectors:?}"
    );
    // Counted once the apiserver answered each decision's write (after the test sees it).
    let decided = |d: &str| {
        ctl.metric(&format!(
            "edgehub_controller_csr_decisions_total{{decision=\"{d}\"}}"
        ))
    };
    wait_until(10, "one approval and four denials counted", || {
        decided("approved") == Some(1.0) && decided("denied") == Some(4.0)
    })
    .await;
    assert_deploy_rbac_allows_every_request(&server);
}

fn opts(node: &str) -> ClientOptions {
    ClientOptions {
        timeout: Duration::from_secs(5),
        watch_idle_timeout: Duration::from_secs(30),
        max_body: 4 << 20,
        node_name: node.into(),
    }
}

/// The device's own code: `[identity]` with the factory key and chain files, the identity
/// task's TLS bootstrap (identity::csr::build, then the attestation, then the create) and the
/// controller's decision. The right vehicle registers its Node; one whose factory certificate
/// names another vehicle gets the denial, with its reason, from its own CSR round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edgehubs_own_bootstrap_carries_the_attestation_the_controller_approves() {
    let server = FakeApiServer::start().await.unwrap();
    let token = BootstrapToken::new("edge01", "0123456789abcdef");
    server.add_bootstrap_token(token.clone());
    server.set_csr_autoapprove_bindings(false, true);
    let fleet = ca("fleet-ca");
    server.apply("configmaps", fleet_ca_configmap(&fleet));
    let dir = tempfile::tempdir().unwrap();
    let kc = admin_kubeconfig(&server, dir.path());
    let ctl = Controller::start(&kc, "replica-a", &["--attest-fleet-ca", FLEET_CA]);
    wait_until(30, "the controller leads", || ctl.leading()).await;

    let boot = server
        .write_kubeconfig(&dir.path().join("etc"), &token.bearer())
        .unwrap();
    let factory_dir = dir.path().join("factory");
    std::fs::create_dir_all(&factory_dir).unwrap();
    let (key, chain) = factory_pems(&fleet, "edge-1");
    std::fs::write(factory_dir.join("key.pem"), key).unwrap();
    std::fs::write(factory_dir.join("chain.pem"), chain).unwrap();
    let cfg = IdentityConfig {
        bootstrap_kubeconfig: Some(boot.clone()),
        factory_key_file: Some(factory_dir.join("key.pem")),
        factory_cert_file: Some(factory_dir.join("chain.pem")),
        ..IdentityConfig::default()
    };
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let (client, identity) = Identity::setup(&cfg, &boot, &data, "edge-1", opts("edge-1")).unwrap();
    let attestation = identity.attestation.clone().unwrap();
    let stats = identity.stats.clone();
    let (_stop_tx, stop) = tokio::sync::watch::channel(false);
    tokio::spawn(identity.run(stop));
    wait_until(30, "edge-1's first certificate", || {
        stats.bootstraps.load(std::sync::atomic::Ordering::Relaxed) == 1
    })
    .await;
    let node = json!({"apiVersion": "v1", "kind": "Node",
        "metadata": {"name": "edge-1", "labels": {"kubernetes.io/hostname": "edge-1"}}});
    client
        .create(&NODES, None, serde_json::to_vec(&node).unwrap())
        .await
        .unwrap();
    let csrs = server.csrs();
    assert_eq!(csrs.len(), 1);
    let (kind, reason, _) = decision(&server, csrs[0]["metadata"]["name"].as_str().unwrap()).await;
    assert_eq!(
        (kind.as_str(), reason.as_str()),
        ("Approved", "AttestedDeviceApproved")
    );
    assert!(csrs[0]["metadata"]["annotations"][ANNOTATION].is_string());

    // The same firmware (token, factory key of edge-1) configured as edge-2: denied, and the
    // device's round says why.
    let boot_client = ApiClient::new(&Kubeconfig::load(&boot).unwrap(), opts("edge-2")).unwrap();
    let e = obtain(
        &boot_client,
        "edge-2",
        None,
        &Default::default(),
        Some(&attestation),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(&e, RequestError::Denied { reason, .. } if reason == "NodeNameMismatch"),
        "{e}"
    );
    println!("edge-2's round: {e}");
    // A factory key that is not its certificate's is refused at setup, before any request.
    let (other_key, _) = factory_pems(&fleet, "edge-1");
    std::fs::write(factory_dir.join("key.pem"), other_key).unwrap();
    let e = Identity::setup(&cfg, &boot, &data, "edge-1", opts("edge-1"))
        .err()
        .unwrap();
    assert!(e.to_string().contains("does not match"), "{e}");
    assert_deploy_rbac_allows_every_request(&server);
}

/// The fleet CA may be a Secret instead (key `ca.crt`, base64 in `data` as Secrets are); a
/// Secret needs its own `get` rule, which deploy/controller.yaml does not grant (the
/// documented setup uses the ConfigMap), so this test checks no RBAC.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_ca_can_be_a_secret() {
    let server = FakeApiServer::start().await.unwrap();
    let token = BootstrapToken::new("edge01", "0123456789abcdef");
    server.add_bootstrap_token(token.clone());
    server.set_csr_autoapprove_bindings(false, true);
    let fleet = ca("fleet-ca");
    server.apply(
        "secrets",
        json!({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
               "metadata": {"name": "edgehub-fleet-ca", "namespace": "kube-system"},
               "data": {"ca.crt": base64::engine::general_purpose::STANDARD.encode(&fleet.pem)}}),
    );
    let dir = tempfile::tempdir().unwrap();
    let kc = admin_kubeconfig(&server, dir.path());
    let ctl = Controller::start(
        &kc,
        "replica-a",
        &["--attest-fleet-ca", "secret/kube-system/edgehub-fleet-ca"],
    );
    wait_until(30, "the controller leads", || ctl.leading()).await;
    let edge7 = factory(&fleet, "edge-7");
    let (body, _) = csr("edge-7", |spki| Some(edge7.sign(spki, "edge-7").unwrap()));
    let name = post(&server, Some(&token.bearer()), None, &body).await;
    let (kind, reason, message) = decision(&server, &name).await;
    assert_eq!(
        (kind.as_str(), reason.as_str()),
        ("Approved", "AttestedDeviceApproved"),
        "{message}"
    );
    issued_cert(&server, &name).await;
}

/// A PEM PKCS#10 request for `node`, signed with the key `key_pem` (PKCS#8): what a thief who
/// copied a vehicle's node key can make at will.
fn request_with_key(key_pem: &str, node: &str) -> String {
    let key = KeyPair::from_pem(key_pem).unwrap();
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "system:nodes");
    dn.push(DnType::CommonName, format!("system:node:{node}"));
    p.distinguished_name = dn;
    p.serialize_request(&key).unwrap().pem().unwrap()
}

/// Issue 31 item 9: an attestation binds the CSR's key and the node name, and the key is kept
/// in the clear on the vehicle's flash, so whoever copies the key and captures the
/// annotation (bootstrappers can watch CSRs) could ask again at will. The controller records
/// each attested key per node name in the cluster (ConfigMap `edgehub-attest-<node>` in
/// namespace `edgehub-attest`) and approves it once: the captured CSR posted again, or a new
/// request for the same key, is denied, even after the Node is deleted and by a controller
/// that restarted; the vehicle's own next bootstrap, with a new key, is approved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attestation_is_good_for_one_bootstrap() {
    let server = FakeApiServer::start().await.unwrap();
    let token = BootstrapToken::new("edge01", "0123456789abcdef");
    server.add_bootstrap_token(token.clone());
    let bearer = token.bearer();
    server.set_csr_autoapprove_bindings(false, true);
    let fleet = ca("fleet-ca");
    server.apply("configmaps", fleet_ca_configmap(&fleet));
    let dir = tempfile::tempdir().unwrap();
    let kc = admin_kubeconfig(&server, dir.path());
    let mut ctl = Controller::start(&kc, "replica-a", &["--attest-fleet-ca", FLEET_CA]);
    wait_until(30, "the controller leads", || ctl.leading()).await;

    let edge1 = factory(&fleet, "edge-1");
    let (captured, key1) = csr("edge-1", |spki| Some(edge1.sign(spki, "edge-1").unwrap()));
    let first = post(&server, Some(&bearer), None, &captured).await;
    let (kind, reason, message) = decision(&server, &first).await;
    assert_eq!(
        (kind.as_str(), reason.as_str()),
        ("Approved", "AttestedDeviceApproved"),
        "{message}"
    );
    issued_cert(&server, &first).await;
    // The vehicle registered; then the operator deletes its Node.
    server.apply(
        "nodes",
        json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "edge-1"}}),
    );
    server.remove("nodes", "", "edge-1");

    // 1. The captured CSR posted again: same request, same annotation, a new CSR object.
    let again = post(&server, Some(&bearer), None, &captured).await;
    // 2. A new request for the same key, with the captured annotation.
    let mut resigned = captured.clone();
    resigned["spec"]["request"] = base64::engine::general_purpose::STANDARD
        .encode(request_with_key(&key1, "edge-1"))
        .into();
    assert_ne!(resigned["spec"]["request"], captured["spec"]["request"]);
    let same_key = post(&server, Some(&bearer), None, &resigned).await;
    for name in [&again, &same_key] {
        let (kind, reason, message) = decision(&server, name).await;
        assert_eq!(
            (kind.as_str(), reason.as_str()),
            ("Denied", "AttestationReplayed"),
            "{message}"
        );
        assert!(
            message.contains(&first),
            "names the CSR that used it: {message}"
        );
        assert!(message.contains("edge-1"), "{message}");
        println!("AttestationReplayed: {message}");
        let csr = server.get("certificatesigningrequests", "", name).unwrap();
        assert!(csr.pointer("/status/certificate").is_none(), "{csr}");
    }

    // 3. The controller stops and another replica leads: the record is in the cluster, not
    //    in the process, and the replay is denied still.
    ctl.sigterm();
    ctl.wait_exit(20).await;
    let ctl = Controller::start(&kc, "replica-b", &["--attest-fleet-ca", FLEET_CA]);
    wait_until(30, "replica-b leads", || ctl.leading()).await;
    let later = post(&server, Some(&bearer), None, &captured).await;
    let (kind, reason, message) = decision(&server, &later).await;
    assert_eq!(
        (kind.as_str(), reason.as_str()),
        ("Denied", "AttestationReplayed"),
        "{message}"
    );

    // 4. The vehicle bootstraps again, as edgehub does, with a new key: approved.
    let (fresh, _) = csr("edge-1", |spki| Some(edge1.sign(spki, "edge-1").unwrap()));
    let second = post(&server, Some(&bearer), None, &fresh).await;
    let (kind, reason, message) = decision(&server, &second).await;
    assert_eq!(
        (kind.as_str(), reason.as_str()),
        ("Approved", "AttestedDeviceApproved"),
        "{message}"
    );
    issued_cert(&server, &second).await;

    // The record: one ConfigMap for the node, one entry per key it was given.
    let record = server
        .get("configmaps", "edgehub-attest", "edgehub-attest-edge-1")
        .expect("the record of edge-1's attested keys");
    println!("record: {record}");
    let entries = record["data"].as_object().unwrap();
    assert_eq!(entries.len(), 2, "{record}");
    assert!(entries.keys().all(|k| k.starts_with("sha256-")), "{record}");
    assert!(entries
        .values()
        .any(|v| v.as_str().unwrap().contains(&first)));
    assert!(entries
        .values()
        .any(|v| v.as_str().unwrap().contains(&second)));

    // Its cost: per approval one read and one write of the record, per replay one read; the
    // denials for other reasons read nothing.
    let record_requests = |method: &str| {
        server.count(|r| {
            r.user.as_deref() == Some("admin")
                && r.method == method
                && r.path.contains("/namespaces/edgehub-attest/configmaps")
        })
    };
    assert_eq!(record_requests("GET"), 2 + 3);
    assert_eq!(record_requests("POST") + record_requests("PUT"), 2);
    // The replica counts an approval once the apiserver has answered its write, which is
    // after the test can see the approval there: wait for the count, do not race it.
    wait_until(10, "replica-b counts its one approval", || {
        ctl.metric("edgehub_controller_csr_decisions_total{decision=\"approved\"}") == Some(1.0)
    })
    .await;
    assert_deploy_rbac_allows_every_request(&server);
}
