//! The fake apiserver's side of the kubelet's API: TokenReview and SubjectAccessReview (the
//! kubelet's delegated authentication and authorization) and the kubelet-serving signer (a
//! node's serving certificate, left pending until an approver approves it).

use base64::Engine;
use edgehub_testsupport::certs::{cert_info, serving_csr};
use edgehub_testsupport::{
    Approval, FakeApiServer, ADMIN_TOKEN, APISERVER_KUBELET_CLIENT, KUBELET_SERVING_SIGNER,
    NODE_TOKEN, NODE_USER,
};
use serde_json::{json, Value};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

const TOKEN_REVIEWS: &str = "/apis/authentication.k8s.io/v1/tokenreviews";
const SARS: &str = "/apis/authorization.k8s.io/v1/subjectaccessreviews";
const CSRS: &str = "/apis/certificates.k8s.io/v1/certificatesigningrequests";
const PLAIN_TOKEN: &str = "jane-token";

async fn server() -> FakeApiServer {
    let s = FakeApiServer::start().await.unwrap();
    s.add_token(PLAIN_TOKEN, "jane");
    s
}

async fn post(s: &FakeApiServer, token: &str, path: &str, body: Value) -> (u16, Value) {
    s.raw(
        Some(token),
        "POST",
        path,
        Some("application/json"),
        Some(&body),
    )
    .await
    .unwrap()
}

fn token_review(token: &str) -> Value {
    json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
           "spec": {"token": token}})
}

fn sar(user: &str, groups: &[&str], verb: &str, subresource: &str) -> Value {
    json!({"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
           "spec": {"user": user, "groups": groups, "resourceAttributes": {
               "verb": verb, "resource": "nodes", "subresource": subresource, "name": "edge-1"}}})
}

#[tokio::test]
async fn a_node_reviews_tokens_from_the_fakes_tables() {
    let s = server().await;
    let (code, got) = post(&s, NODE_TOKEN, TOKEN_REVIEWS, token_review(ADMIN_TOKEN)).await;
    assert_eq!(code, 201, "{got}");
    assert_eq!(got["kind"], "TokenReview");
    assert_eq!(got["status"]["authenticated"], true);
    assert_eq!(got["status"]["user"]["username"], "admin");
    assert_eq!(
        got["status"]["user"]["groups"],
        json!(["system:masters", "system:authenticated"])
    );
    assert_eq!(got["spec"]["token"], ADMIN_TOKEN);

    let (code, got) = post(&s, NODE_TOKEN, TOKEN_REVIEWS, token_review(PLAIN_TOKEN)).await;
    assert_eq!(code, 201, "{got}");
    assert_eq!(got["status"]["user"]["username"], "jane");
    assert_eq!(
        got["status"]["user"]["groups"],
        json!(["system:authenticated"])
    );

    // A token nobody issued: created, not authenticated, no user.
    let (code, got) = post(&s, NODE_TOKEN, TOKEN_REVIEWS, token_review("bogus")).await;
    assert_eq!(code, 201, "{got}");
    assert!(got["status"].get("authenticated").is_none(), "{got}");
    assert_eq!(got["status"]["user"], json!({}));

    // A token removed from the tables stops authenticating.
    s.remove_token(PLAIN_TOKEN);
    let (_, got) = post(&s, NODE_TOKEN, TOKEN_REVIEWS, token_review(PLAIN_TOKEN)).await;
    assert!(got["status"].get("authenticated").is_none(), "{got}");

    // An audience the apiserver's tokens are not for.
    let mut r = token_review(ADMIN_TOKEN);
    r["spec"]["audiences"] = json!(["someone-else"]);
    let (_, got) = post(&s, NODE_TOKEN, TOKEN_REVIEWS, r).await;
    assert!(got["status"].get("authenticated").is_none(), "{got}");
}

#[tokio::test]
async fn only_nodes_and_admins_may_create_reviews() {
    let s = server().await;
    let (code, got) = post(&s, PLAIN_TOKEN, TOKEN_REVIEWS, token_review(ADMIN_TOKEN)).await;
    assert_eq!(code, 403, "{got}");
    assert_eq!(
        got["message"],
        "tokenreviews.authentication.k8s.io is forbidden: User \"jane\" cannot create resource \"tokenreviews\" in API group \"authentication.k8s.io\" at the cluster scope"
    );
    let (code, got) = post(&s, PLAIN_TOKEN, SARS, sar("jane", &[], "get", "proxy")).await;
    assert_eq!(code, 403, "{got}");
    assert_eq!(got["reason"], "Forbidden");
    let (code, _) = post(&s, ADMIN_TOKEN, TOKEN_REVIEWS, token_review(NODE_TOKEN)).await;
    assert_eq!(code, 201);
    // No credential at all: 401.
    let (code, _) = s
        .raw(
            None,
            "POST",
            SARS,
            Some("application/json"),
            Some(&sar("jane", &[], "get", "proxy")),
        )
        .await
        .unwrap();
    assert_eq!(code, 401);
}

#[tokio::test]
async fn subject_access_reviews_answer_from_the_fakes_rbac() {
    let s = server().await;
    let ask = |user: &'static str, groups: &'static [&'static str], verb, sub| {
        let s = &s;
        async move {
            let (code, got) = post(s, NODE_TOKEN, SARS, sar(user, groups, verb, sub)).await;
            assert_eq!(code, 201, "{got}");
            assert_eq!(got["kind"], "SubjectAccessReview");
            assert_eq!(got["spec"]["user"], user);
            got["status"]["allowed"].as_bool().unwrap()
        }
    };
    // The administrator may do anything, a plain user nothing.
    assert!(
        ask(
            "admin",
            &["system:masters", "system:authenticated"],
            "get",
            "proxy"
        )
        .await
    );
    assert!(!ask("jane", &["system:authenticated"], "get", "proxy").await);
    assert!(!ask("jane", &["system:authenticated"], "get", "log").await);
    // The apiserver's kubelet-client user holds system:kubelet-api-admin, as kubeadm binds it.
    for sub in ["proxy", "log", "stats"] {
        for verb in ["get", "create"] {
            assert!(ask(APISERVER_KUBELET_CLIENT, &[], verb, sub).await);
        }
    }
    // A node has no access to the kubelet API, not even its own.
    assert!(
        !ask(
            NODE_USER,
            &["system:nodes", "system:authenticated"],
            "get",
            "stats"
        )
        .await
    );
    // A binding, by user or by group, and its removal.
    s.bind_kubelet_api_admin("jane");
    assert!(ask("jane", &["system:authenticated"], "get", "log").await);
    s.unbind_kubelet_api_admin("jane");
    assert!(!ask("jane", &["system:authenticated"], "get", "log").await);
    s.bind_kubelet_api_admin_group("operators");
    assert!(ask("bob", &["operators"], "get", "stats").await);
    // Not a kubelet subresource.
    assert!(!ask("bob", &["operators"], "get", "status").await);
}

fn node_ips() -> Vec<IpAddr> {
    vec!["10.0.2.15".parse().unwrap(), "127.0.0.1".parse().unwrap()]
}

fn serving_csr_body(cn: &str, usages: &[&str]) -> Value {
    let (pem, _) = serving_csr(cn, &["edge-1"], &node_ips()).unwrap();
    json!({"apiVersion": "certificates.k8s.io/v1", "kind": "CertificateSigningRequest",
           "metadata": {"generateName": "csr-"},
           "spec": {"request": base64::engine::general_purpose::STANDARD.encode(pem),
                    "signerName": KUBELET_SERVING_SIGNER, "usages": usages}})
}

async fn wait_csr(s: &FakeApiServer, name: &str, f: impl Fn(&Value) -> bool) -> Value {
    for _ in 0..200 {
        let c = s
            .get("certificatesigningrequests", "", name)
            .expect("the CSR exists");
        if f(&c) {
            return c;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("CSR {name} never reached the state asked for");
}

const SERVING: &[&str] = &["digital signature", "server auth"];

#[tokio::test]
async fn a_kubelet_serving_csr_stays_pending_without_an_approver() {
    let s = server().await;
    let (code, got) = post(&s, NODE_TOKEN, CSRS, serving_csr_body(NODE_USER, SERVING)).await;
    assert_eq!(code, 201, "{got}");
    assert_eq!(got["spec"]["signerName"], KUBELET_SERVING_SIGNER);
    assert_eq!(got["spec"]["username"], NODE_USER);
    let name = got["metadata"]["name"].as_str().unwrap().to_string();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let c = s.get("certificatesigningrequests", "", &name).unwrap();
    assert_eq!(
        c["status"],
        json!({}),
        "the built-in approver leaves it alone"
    );

    // Another node's name: NodeRestriction refuses it.
    let (code, got) = post(
        &s,
        NODE_TOKEN,
        CSRS,
        serving_csr_body("system:node:edge-2", SERVING),
    )
    .await;
    assert_eq!(code, 403, "{got}");
    assert_eq!(
        got["message"],
        "certificatesigningrequests.certificates.k8s.io \"csr-\" is forbidden: can only create a node CSR with CN=system:node:edge-1"
    );

    // An administrator approves it through /approval: the signer issues it.
    let mut approval = c.clone();
    approval["status"]["conditions"] = json!([{"type": "Approved", "status": "True",
        "reason": "KubectlApprove", "message": "approved by hand"}]);
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
    let c = wait_csr(&s, &name, |c| c.pointer("/status/certificate").is_some()).await;
    let pem = base64::engine::general_purpose::STANDARD
        .decode(c["status"]["certificate"].as_str().unwrap())
        .unwrap();
    let info = cert_info(std::str::from_utf8(&pem).unwrap()).unwrap();
    assert!(info.server_auth && !info.client_auth, "{info:?}");
    assert_eq!(info.sans, vec!["edge-1", "10.0.2.15", "127.0.0.1"]);
    assert!(info.subject.contains("CN=system:node:edge-1"), "{info:?}");
}

#[tokio::test]
async fn the_pluggable_approver_decides_serving_csrs_and_the_signer_checks_them() {
    let s = server().await;
    s.set_csr_approver(Some(Arc::new(|req: &edgehub_testsupport::CsrRequest| {
        if req.signer_name == KUBELET_SERVING_SIGNER && req.username == NODE_USER {
            Approval::Approve {
                reason: "EdgehubApproved".into(),
                message: "addresses match the Node".into(),
            }
        } else {
            Approval::Deny {
                reason: "EdgehubDenied".into(),
                message: "not a node".into(),
            }
        }
    })));
    let (code, got) = post(&s, NODE_TOKEN, CSRS, serving_csr_body(NODE_USER, SERVING)).await;
    assert_eq!(code, 201, "{got}");
    let name = got["metadata"]["name"].as_str().unwrap().to_string();
    let c = wait_csr(&s, &name, |c| c.pointer("/status/certificate").is_some()).await;
    assert_eq!(c["status"]["conditions"][0]["reason"], "EdgehubApproved");

    // Client-auth usages from the serving signer: approved, then the signer fails it.
    let (_, got) = post(
        &s,
        NODE_TOKEN,
        CSRS,
        serving_csr_body(NODE_USER, &["digital signature", "client auth"]),
    )
    .await;
    let name = got["metadata"]["name"].as_str().unwrap().to_string();
    let c = wait_csr(&s, &name, |c| {
        c.pointer("/status/conditions/1/type").is_some()
    })
    .await;
    assert_eq!(c["status"]["conditions"][1]["type"], "Failed");
    assert_eq!(
        c["status"]["conditions"][1]["message"],
        "usages did not match [digital signature key encipherment server auth]"
    );
    assert!(c.pointer("/status/certificate").is_none());
}
