//! The fake apiserver's TLS bootstrap answers as the recorded ones (fixtures `bootstrap_*`,
//! `csr_*`, `node_create_with_issued_cert`): bootstrap tokens, SelfSubjectReview, the CSR API
//! with its approver and signer, NodeRestriction's CN check, and client certificates that
//! lapse into a 401.

use base64::Engine;
use edgehub_testsupport::certs::{cert_info, node_csr};
use edgehub_testsupport::{
    fixture, Approval, BootstrapToken, ClientPem, FakeApiServer, TestOnlyCertWindow, ADMIN_TOKEN,
};
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

const CSRS: &str = "/apis/certificates.k8s.io/v1/certificatesigningrequests";

fn token() -> BootstrapToken {
    BootstrapToken::new("edge01", "0123456789abcdef")
}

async fn server() -> FakeApiServer {
    let s = FakeApiServer::start().await.unwrap();
    s.add_bootstrap_token(token());
    s
}

fn keys(v: &Value) -> BTreeSet<String> {
    v.as_object()
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default()
}

/// Same code; a Status matches in reason, code, message and details; an object in kind,
/// apiVersion and top-level fields, and `spec` in its fields.
fn assert_same(name: &str, code: u16, got: &Value) {
    let want = &fixture(name)["response"];
    assert_eq!(
        code as u64,
        want["status"].as_u64().unwrap(),
        "{name}: {got}"
    );
    let want = &want["body"];
    assert_eq!(keys(got), keys(want), "{name}: fields of {got}");
    assert_eq!(got["kind"], want["kind"], "{name}: kind");
    if want["kind"] == "Status" {
        for f in ["reason", "code", "message", "details"] {
            assert_eq!(got[f], want[f], "{name}: {f}");
        }
    } else if want.get("spec").is_some() {
        assert_eq!(
            keys(&got["spec"]),
            keys(&want["spec"]),
            "{name}: spec fields"
        );
    }
}

/// The recorded request body with a fresh CSR of our own (the fixture's key is not ours).
fn csr_body(name: &str, cn: &str) -> (Value, String) {
    let mut body = fixture(name)["request"]["body"].clone();
    let (pem, key) = node_csr(cn, "system:nodes").unwrap();
    body["spec"]["request"] = base64::engine::general_purpose::STANDARD.encode(pem).into();
    (body, key)
}

async fn create(s: &FakeApiServer, auth: Auth<'_>, body: &Value) -> (u16, Value) {
    s.raw_as(
        auth.0,
        auth.1,
        "POST",
        CSRS,
        Some("application/json"),
        Some(body),
    )
    .await
    .unwrap()
}

#[derive(Clone, Copy)]
struct Auth<'a>(Option<&'a str>, Option<&'a ClientPem<'a>>);

async fn wait_issued(s: &FakeApiServer, name: &str) -> Value {
    s.wait_for_object(
        "certificatesigningrequests",
        "",
        name,
        Duration::from_secs(5),
        |o| o.pointer("/status/certificate").is_some(),
    )
    .await
    .unwrap_or_else(|last| panic!("{name} not issued: {last}"))
}

fn cert_pem(csr: &Value) -> String {
    let b = base64::engine::general_purpose::STANDARD
        .decode(csr["status"]["certificate"].as_str().unwrap())
        .unwrap();
    String::from_utf8(b).unwrap()
}

fn conditions(csr: &Value) -> Vec<(String, String, String)> {
    csr["status"]["conditions"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|c| {
            (
                c["type"].as_str().unwrap().to_string(),
                c["reason"].as_str().unwrap().to_string(),
                c["message"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// Bootstraps edge-1 with the token as the recording did; returns its certificate and key.
async fn bootstrap(s: &FakeApiServer, cn: &str) -> (String, String, Value) {
    let bearer = token().bearer();
    let (body, key) = csr_body("csr_create_as_bootstrap", cn);
    let (code, created) = create(s, Auth(Some(&bearer), None), &body).await;
    assert_same("csr_create_as_bootstrap", code, &created);
    let issued = wait_issued(s, created["metadata"]["name"].as_str().unwrap()).await;
    (cert_pem(&issued), key, created)
}

#[tokio::test]
async fn a_bootstrap_token_authenticates_until_it_expires() {
    let s = server().await;
    let bearer = token().bearer();
    let req = fixture("bootstrap_token_whoami")["request"].clone();
    let (code, got) = s
        .raw(
            Some(&bearer),
            "POST",
            req["path"].as_str().unwrap(),
            Some("application/json"),
            Some(&req["body"]),
        )
        .await
        .unwrap();
    assert_same("bootstrap_token_whoami", code, &got);
    let want = &fixture("bootstrap_token_whoami")["response"]["body"]["status"];
    assert_eq!(got["status"], *want);

    // An expired token (and a wrong secret, and a deleted token) is the plain 401.
    let mut old = BootstrapToken::new("edge00", "fedcba9876543210");
    old.expiration = Some(std::time::SystemTime::now() - Duration::from_secs(3600));
    s.add_bootstrap_token(old.clone());
    for t in [old.bearer(), "edge01.0000000000000000".to_string()] {
        let (code, got) = s.raw(Some(&t), "GET", CSRS, None, None).await.unwrap();
        assert_same("bootstrap_token_expired_unauthorized", code, &got);
    }
    s.remove_bootstrap_token("edge01");
    let (code, got) = s.raw(Some(&bearer), "GET", CSRS, None, None).await.unwrap();
    assert_same("bootstrap_token_expired_unauthorized", code, &got);

    // The token may not register a Node: RBAC gives it CSRs only.
    s.add_bootstrap_token(token());
    let req = fixture("bootstrap_token_node_create_forbidden")["request"].clone();
    let (code, got) = s
        .raw(
            Some(&bearer),
            "POST",
            "/api/v1/nodes",
            Some("application/json"),
            Some(&req["body"]),
        )
        .await
        .unwrap();
    assert_same("bootstrap_token_node_create_forbidden", code, &got);
}

#[tokio::test]
async fn a_bootstrap_csr_is_approved_and_issued_as_recorded() {
    let s = server().await;
    let bearer = token().bearer();
    let (body, key) = csr_body("csr_create_as_bootstrap", "system:node:edge-1");
    let (code, created) = create(&s, Auth(Some(&bearer), None), &body).await;
    assert_same("csr_create_as_bootstrap", code, &created);
    let want = &fixture("csr_create_as_bootstrap")["response"]["body"];
    assert_eq!(created["spec"]["username"], want["spec"]["username"]);
    assert_eq!(created["spec"]["groups"], want["spec"]["groups"]);
    assert_eq!(created["status"], json!({}));
    let name = created["metadata"]["name"].as_str().unwrap().to_string();
    assert!(
        name.starts_with("node-csr-") && name.len() == "node-csr-".len() + 5,
        "{name}"
    );

    // The watch by name from the create's version: two MODIFIED, Approved then issued.
    let rv = created["metadata"]["resourceVersion"].as_str().unwrap();
    let path = format!("{CSRS}?fieldSelector=metadata.name%3D{name}&watch=1&resourceVersion={rv}");
    let (code, events) = s
        .raw_watch(Some(&bearer), &path, 2, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(code, 200);
    let recorded = fixture("csr_watch_until_issued")["response"]["events"].clone();
    let types = |e: &[Value]| e.iter().map(|e| e["type"].clone()).collect::<Vec<_>>();
    assert_eq!(types(&events), types(recorded.as_array().unwrap()));
    assert_eq!(
        conditions(&events[0]["object"]),
        conditions(&recorded[0]["object"]),
        "the approver's condition"
    );
    assert!(events[0]["object"].pointer("/status/certificate").is_none());
    assert!(events[1]["object"].pointer("/status/certificate").is_some());
    let rv_of = |e: &Value| {
        e["object"]["metadata"]["resourceVersion"]
            .as_str()
            .unwrap()
            .parse::<u64>()
            .unwrap()
    };
    assert_eq!(
        (rv_of(&events[0]), rv_of(&events[1])),
        (
            rv.parse::<u64>().unwrap() + 1,
            rv.parse::<u64>().unwrap() + 2
        )
    );

    // GET: the certificate as the signer makes it.
    let (code, got) = s
        .raw(Some(&bearer), "GET", &format!("{CSRS}/{name}"), None, None)
        .await
        .unwrap();
    assert_same("csr_get_issued", code, &got);
    let info = cert_info(&cert_pem(&got)).unwrap();
    assert_eq!(info.subject, "O=system:nodes, CN=system:node:edge-1");
    assert_eq!(info.issuer, "CN=edgehub-test-ca");
    assert!(info.client_auth && info.digital_signature && !info.is_ca && !info.has_san);
    assert!(info.serial_bits > 64, "a 128-bit serial");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    assert!(
        (info.not_before - (now - 300)).abs() <= 5,
        "backdated 5 min"
    );
    assert_eq!(info.not_after - info.not_before, 86_400, "a 24 h window");

    // With it (mTLS, no token) the device is system:node:edge-1 and registers its Node.
    let pem = cert_pem(&got);
    let me = ClientPem {
        cert: &pem,
        key: &key,
    };
    let req = fixture("csr_issued_cert_whoami")["request"].clone();
    let (code, who) = s
        .raw_as(
            None,
            Some(&me),
            "POST",
            req["path"].as_str().unwrap(),
            Some("application/json"),
            Some(&req["body"]),
        )
        .await
        .unwrap();
    assert_same("csr_issued_cert_whoami", code, &who);
    let info = &who["status"]["userInfo"];
    assert_eq!(info["username"], "system:node:edge-1");
    assert!(
        info["extra"]["authentication.kubernetes.io/credential-id"][0]
            .as_str()
            .unwrap()
            .starts_with("X509SHA256=")
    );
    let req = fixture("node_create_with_issued_cert")["request"].clone();
    let (code, node) = s
        .raw_as(
            None,
            Some(&me),
            "POST",
            "/api/v1/nodes",
            Some("application/json"),
            Some(&req["body"]),
        )
        .await
        .unwrap();
    assert_eq!(code, 201, "{node}");
    assert_eq!(
        keys(&node),
        keys(&fixture("node_create_with_issued_cert")["response"]["body"])
    );
}

#[tokio::test]
async fn a_node_renews_itself_and_only_itself() {
    let s = server().await;
    let (pem, key, _) = bootstrap(&s, "system:node:edge-1").await;
    let me = ClientPem {
        cert: &pem,
        key: &key,
    };

    let (body, new_key) = csr_body("csr_renew_as_node", "system:node:edge-1");
    let (code, created) = create(&s, Auth(None, Some(&me)), &body).await;
    assert_same("csr_renew_as_node", code, &created);
    assert_eq!(created["spec"]["username"], "system:node:edge-1");
    assert_eq!(
        created["spec"]["groups"],
        json!(["system:nodes", "system:authenticated"])
    );
    let issued = wait_issued(&s, created["metadata"]["name"].as_str().unwrap()).await;
    assert_eq!(
        conditions(&issued),
        conditions(&fixture("csr_renew_as_node_issued")["response"]["body"]),
        "the selfnodeclient approval"
    );
    let renewed = cert_pem(&issued);
    let req = fixture("csr_renewed_cert_whoami")["request"].clone();
    let new_me = ClientPem {
        cert: &renewed,
        key: &new_key,
    };
    let (code, who) = s
        .raw_as(
            None,
            Some(&new_me),
            "POST",
            req["path"].as_str().unwrap(),
            Some("application/json"),
            Some(&req["body"]),
        )
        .await
        .unwrap();
    assert_same("csr_renewed_cert_whoami", code, &who);
    // Nothing is revoked: the old certificate still works.
    let (code, _) = s
        .raw_as(
            None,
            Some(&me),
            "POST",
            req["path"].as_str().unwrap(),
            Some("application/json"),
            Some(&req["body"]),
        )
        .await
        .unwrap();
    assert_eq!(code, 201);

    // NodeRestriction: not another node's name.
    let (body, _) = csr_body("csr_as_node_for_other_node", "system:node:edge-2");
    let before = s.csrs().len();
    let (code, got) = create(&s, Auth(None, Some(&me)), &body).await;
    assert_same("csr_as_node_for_other_node", code, &got);
    assert_eq!(s.csrs().len(), before, "no object is created");
}

#[tokio::test]
async fn the_shared_token_gets_any_nodes_certificate() {
    // The gap the attested approval closes: recorded, so the fake must reproduce it.
    let s = server().await;
    let (pem, key, created) = bootstrap(&s, "system:node:edge-2").await;
    let issued = s
        .get(
            "certificatesigningrequests",
            "",
            created["metadata"]["name"].as_str().unwrap(),
        )
        .unwrap();
    assert_same("csr_bootstrap_for_other_node_name_issued", 200, &issued);
    assert_eq!(
        conditions(&issued),
        conditions(&fixture("csr_bootstrap_for_other_node_name_issued")["response"]["body"])
    );
    let them = ClientPem {
        cert: &pem,
        key: &key,
    };
    let body = fixture("bootstrap_other_node_cert_creates_node")["request"]["body"].clone();
    let (code, node) = s
        .raw_as(
            None,
            Some(&them),
            "POST",
            "/api/v1/nodes",
            Some("application/json"),
            Some(&body),
        )
        .await
        .unwrap();
    assert_same("bootstrap_other_node_cert_creates_node", code, &node);

    // Without kubeadm's nodeclient binding the same request stays pending.
    s.set_csr_autoapprove_bindings(false, true);
    let (body, _) = csr_body("csr_bootstrap_for_other_node_name", "system:node:edge-3");
    let (code, created) = create(&s, Auth(Some(&token().bearer()), None), &body).await;
    assert_same("csr_bootstrap_for_other_node_name", code, &created);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let now = s
        .get(
            "certificatesigningrequests",
            "",
            created["metadata"]["name"].as_str().unwrap(),
        )
        .unwrap();
    assert_eq!(now["status"], json!({}));
}

#[tokio::test]
async fn wrong_usages_stay_pending_then_fail_at_signing() {
    let s = server().await;
    let bearer = token().bearer();
    let (body, _) = csr_body("csr_wrong_usages_not_approved", "system:node:edge-1");
    let (code, created) = create(&s, Auth(Some(&bearer), None), &body).await;
    assert_same("csr_wrong_usages_not_approved", code, &created);
    let name = created["metadata"]["name"].as_str().unwrap().to_string();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (code, got) = s
        .raw(Some(&bearer), "GET", &format!("{CSRS}/{name}"), None, None)
        .await
        .unwrap();
    assert_same("csr_wrong_usages_pending", code, &got);
    assert_eq!(got["status"], json!({}));

    // The operator approves it anyway: 200 with timestamps, then the signer's Failed.
    let mut approve = got.clone();
    approve["status"] =
        fixture("csr_wrong_usages_admin_approved")["request"]["body"]["status"].clone();
    let (code, approved) = s
        .raw(
            Some(ADMIN_TOKEN),
            "PUT",
            &format!("{CSRS}/{name}/approval"),
            Some("application/json"),
            Some(&approve),
        )
        .await
        .unwrap();
    assert_same("csr_wrong_usages_admin_approved", code, &approved);
    assert!(approved["status"]["conditions"][0]["lastUpdateTime"].is_string());
    let failed = s
        .wait_for_object(
            "certificatesigningrequests",
            "",
            &name,
            Duration::from_secs(5),
            |o| o.pointer("/status/conditions/1").is_some(),
        )
        .await
        .unwrap();
    assert_same("csr_wrong_usages_signer_failed", 200, &failed);
    assert_eq!(
        conditions(&failed),
        conditions(&fixture("csr_wrong_usages_signer_failed")["response"]["body"])
    );
    assert!(failed.pointer("/status/certificate").is_none());

    // Only an approver may use /approval; a bootstrap token may not.
    let (code, _) = s
        .raw(
            Some(&bearer),
            "PUT",
            &format!("{CSRS}/{name}/approval"),
            Some("application/json"),
            Some(&approve),
        )
        .await
        .unwrap();
    assert_eq!(code, 403);
}

#[tokio::test]
async fn a_denied_csr_is_seen_denied_by_its_requester() {
    let s = server().await;
    let (pem, key, _) = bootstrap(&s, "system:node:edge-1").await;
    let me = ClientPem {
        cert: &pem,
        key: &key,
    };
    let (body, _) = csr_body("csr_wrong_usages_not_approved", "system:node:edge-1");
    let (code, created) = create(&s, Auth(None, Some(&me)), &body).await;
    assert_eq!(code, 201);
    let name = created["metadata"]["name"].as_str().unwrap().to_string();
    let mut deny = created.clone();
    deny["status"] = fixture("csr_denied")["request"]["body"]["status"].clone();
    let (code, denied) = s
        .raw(
            Some(ADMIN_TOKEN),
            "PUT",
            &format!("{CSRS}/{name}/approval"),
            Some("application/json"),
            Some(&deny),
        )
        .await
        .unwrap();
    assert_same("csr_denied", code, &denied);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (code, seen) = s
        .raw_as(
            None,
            Some(&me),
            "GET",
            &format!("{CSRS}/{name}"),
            None,
            None,
        )
        .await
        .unwrap();
    assert_same("csr_denied_seen_by_requester", code, &seen);
    assert_eq!(
        conditions(&seen),
        conditions(&fixture("csr_denied_seen_by_requester")["response"]["body"])
    );
    assert!(seen.pointer("/status/certificate").is_none());
}

#[tokio::test]
async fn invalid_and_unauthorized_csrs_are_refused_as_recorded() {
    let s = server().await;
    let (body, _) = csr_body("csr_expiration_too_short_invalid", "system:node:edge-1");
    let (code, got) = create(&s, Auth(Some(&token().bearer()), None), &body).await;
    let want = &fixture("csr_expiration_too_short_invalid")["response"]["body"];
    assert_eq!(code, 422);
    assert_eq!(keys(&got), keys(want));
    let name = got["details"]["name"].as_str().unwrap();
    assert!(name.starts_with("node-csr-"), "the generated name: {got}");
    let want_msg = want["message"]
        .as_str()
        .unwrap()
        .replace("node-csr-8zjnf", name);
    assert_eq!(got["message"], want_msg);
    assert_eq!(got["details"]["causes"], want["details"]["causes"]);
    assert!(s.csrs().is_empty(), "no object exists");

    s.add_token("edge-agent-token", "edge-agent");
    let (body, _) = csr_body("csr_create_without_rbac_forbidden", "system:node:edge-1");
    let (code, got) = create(&s, Auth(Some("edge-agent-token"), None), &body).await;
    assert_same("csr_create_without_rbac_forbidden", code, &got);
}

#[tokio::test]
async fn a_csr_watch_bookmarks_only_a_newer_version() {
    let s = server().await;
    s.set_bookmark_interval(Duration::from_millis(300));
    let (_, _, created) = bootstrap(&s, "system:node:edge-1").await;
    let name = created["metadata"]["name"].as_str().unwrap();
    let bearer = token().bearer();
    let path = format!("{CSRS}?fieldSelector=metadata.name%3D{name}&watch=1&resourceVersion={}&allowWatchBookmarks=true&timeoutSeconds=2", s.resource_version());
    let started = std::time::Instant::now();
    let (code, events) = s
        .raw_watch(Some(&bearer), &path, 10, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(
        (code, events.len()),
        (200, 0),
        "csr_watch_timeout_no_bookmark: {events:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "the server ended it at timeoutSeconds"
    );

    // An unrelated CSR write: bookmarks carry its version, with spec.request null.
    let (events, ()) = tokio::join!(
        async {
            s.raw_watch(Some(&bearer), &path, 10, Duration::from_secs(5))
                .await
                .unwrap()
                .1
        },
        async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let (body, _) = csr_body("csr_create_as_bootstrap", "system:node:edge-9");
            create(&s, Auth(Some(ADMIN_TOKEN), None), &body).await;
        }
    );
    let recorded = fixture("csr_watch_timeout_bookmark")["response"]["events"][0].clone();
    assert!(!events.is_empty(), "a bookmark");
    for e in &events {
        assert_eq!(e["type"], "BOOKMARK");
        assert_eq!(e["object"]["spec"], recorded["object"]["spec"]);
        assert_eq!(keys(&e["object"]), keys(&recorded["object"]));
    }
}

#[tokio::test]
async fn a_replaced_approver_leaves_approval_to_the_approval_subresource() {
    let s = server().await;
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = seen.clone();
    s.set_csr_approver(Some(Arc::new(
        move |r: &edgehub_testsupport::CsrRequest| {
            log.lock()
                .unwrap()
                .push((r.username.clone(), r.common_name.clone()));
            Approval::Pending
        },
    )));
    s.add_token(
        "controller-token",
        "system:serviceaccount:edgehub:controller",
    );
    s.allow_csr_approval("system:serviceaccount:edgehub:controller");
    let (body, _) = csr_body("csr_create_as_bootstrap", "system:node:edge-1");
    let (_, created) = create(&s, Auth(Some(&token().bearer()), None), &body).await;
    let name = created["metadata"]["name"].as_str().unwrap().to_string();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        *seen.lock().unwrap(),
        [(
            "system:bootstrap:edge01".to_string(),
            Some("system:node:edge-1".to_string())
        )]
    );
    let mut approve = s.get("certificatesigningrequests", "", &name).unwrap();
    assert_eq!(
        approve["status"],
        json!({}),
        "pending for the external approver"
    );
    approve["status"] = json!({"conditions": [{"type": "Approved", "status": "True", "reason": "AttestedDevice", "message": "factory certificate verified"}]});
    let (code, _) = s
        .raw(
            Some("controller-token"),
            "PUT",
            &format!("{CSRS}/{name}/approval"),
            Some("application/json"),
            Some(&approve),
        )
        .await
        .unwrap();
    assert_eq!(code, 200);
    let issued = wait_issued(&s, &name).await;
    assert_eq!(conditions(&issued)[0].1, "AttestedDevice");
}

#[tokio::test]
async fn a_test_only_short_certificate_lapses_into_a_401() {
    let s = server().await;
    s.set_test_only_certificate_window(Some(TestOnlyCertWindow {
        backdate: Duration::from_secs(1),
        valid_for: Duration::from_secs(3),
    }));
    let (pem, key, _) = bootstrap(&s, "system:node:edge-1").await;
    let info = cert_info(&pem).unwrap();
    assert_eq!(info.not_after - info.not_before, 4);
    let me = ClientPem {
        cert: &pem,
        key: &key,
    };
    let (code, _) = s
        .raw_as(None, Some(&me), "GET", "/api/v1/nodes/edge-1", None, None)
        .await
        .unwrap();
    assert_eq!(code, 404, "authenticated while valid");
    tokio::time::sleep(Duration::from_secs(4)).await;
    // The handshake takes it; the x509 authenticator refuses it: the recorded 401.
    let (code, got) = s
        .raw_as(None, Some(&me), "GET", "/api/v1/nodes/edge-1", None, None)
        .await
        .unwrap();
    assert_eq!(code, 401);
    assert_eq!(got, fixture("unauthorized_bad_token")["response"]["body"]);
}
