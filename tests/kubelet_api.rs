//! The node's API on 10250 against the fake apiserver: real TLS with a serving certificate
//! issued through a kubelet-serving CSR, bearer tokens through TokenReview, client
//! certificates against the cluster CA, every request through a SubjectAccessReview, and
//! `/containerLogs` with each of the kubelet's options, read from CRI-format log files in a
//! pod's log directory (what containerd writes; here written by the test).

#[path = "common/kubelet_env.rs"]
mod kubelet_env;

use edgehub::kubelet_api::KubeletApiConfig;
use edgehub_testsupport::{ADMIN_TOKEN, APISERVER_KUBELET_CLIENT, NODE_TOKEN};
use http_body_util::BodyExt;
use kubelet_env::*;
use std::io::Write;
use std::time::Duration;

#[tokio::test]
async fn container_logs_with_each_of_the_kubelets_options() {
    let e = env(config()).await;
    assert_eq!(e.logs("").await, (200, "one\ntwo\nthree\nfour\n".into()));
    assert_eq!(e.logs("?tailLines=2").await, (200, "three\nfour\n".into()));
    assert_eq!(e.logs("?tailLines=0").await, (200, String::new()));
    assert_eq!(
        e.logs("?sinceSeconds=60").await,
        (200, "three\nfour\n".into())
    );
    assert_eq!(e.logs("?limitBytes=6").await, (200, "one\ntw".into()));
    assert_eq!(
        e.logs("?previous=true").await,
        (200, "first run\ncrashed\n".into())
    );
    let (code, body) = e.logs("?timestamps=true&tailLines=1").await;
    assert_eq!(code, 200);
    let (ts, line) = body.trim_end().split_once(' ').unwrap();
    assert_eq!(line, "four");
    assert!(edgehub::logs::rfc3339_nanos(ts).is_some(), "{body}");
    // The kubelet's refusals.
    assert_eq!(e.logs("?tailLines=x").await.0, 400);
    let (code, body) = e
        .get(Cred::Token(ADMIN_TOKEN), "/containerLogs/vehicle/web/nope")
        .await;
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("is not valid for pod"), "{body}");
    assert_eq!(
        e.get(Cred::Token(ADMIN_TOKEN), "/containerLogs/vehicle/gone/app")
            .await
            .0,
        404
    );
}

/// The next chunk of a streamed body into `got`; `false` at its end.
async fn next(body: &mut hyper::body::Incoming, got: &mut String) -> bool {
    let f = tokio::time::timeout(Duration::from_secs(5), body.frame())
        .await
        .expect("a chunk in time");
    match f {
        Some(f) => {
            if let Ok(d) = f.unwrap().into_data() {
                got.push_str(&String::from_utf8_lossy(&d));
            }
            true
        }
        None => false,
    }
}

#[tokio::test]
async fn a_follow_streams_new_lines_and_ends_when_the_container_restarts() {
    let e = env(config()).await;
    let cred = Cred::Token(ADMIN_TOKEN);
    let mut send = connect(e.addr, &e.s.pki.ca_pem, &cred).await.unwrap();
    let resp = send
        .send_request(request(
            &cred,
            "GET",
            "/containerLogs/vehicle/web/app?follow=true&tailLines=1",
        ))
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut got = String::new();
    while !got.ends_with("four\n") {
        assert!(next(&mut body, &mut got).await);
    }
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(log_dir(&e.data).join("app_1.log"))
        .unwrap();
    writeln!(f, "{} stdout F five", rfc3339(now())).unwrap();
    while !got.ends_with("five\n") {
        assert!(next(&mut body, &mut got).await);
    }
    assert_eq!(got, "four\nfive\n");
    // The container restarts: a new attempt's file; the follow ends.
    std::fs::write(log_dir(&e.data).join("app_2.log"), "").unwrap();
    while next(&mut body, &mut got).await {}
    assert_eq!(got, "four\nfive\n");
}

#[tokio::test]
async fn authentication_and_authorization_as_the_kubelets() {
    let e = env(config()).await;
    assert_eq!(
        e.get(Cred::Token(ADMIN_TOKEN), "/healthz").await,
        (200, "ok".into())
    );
    // No credential, a token the TokenReview rejects: 401.
    assert_eq!(
        e.get(Cred::None, "/healthz").await,
        (401, "Unauthorized".into())
    );
    assert_eq!(
        e.get(Cred::Token("bogus"), "/containerLogs/vehicle/web/app")
            .await,
        (401, "Unauthorized".into())
    );
    // A user the SubjectAccessReview denies: 403, with the kubelet's text.
    assert_eq!(
        e.get(Cred::Token(JANE), "/containerLogs/vehicle/web/app")
            .await,
        (
            403,
            "Forbidden (user=jane, verb=get, resource=nodes, subresource(s)=[proxy])\n".into()
        )
    );
    assert_eq!(
        e.get(Cred::Token(JANE), "/stats/summary").await.1,
        "Forbidden (user=jane, verb=get, resource=nodes, subresource(s)=[stats])\n"
    );
    // The node itself has no access to its own API either.
    assert_eq!(e.get(Cred::Token(NODE_TOKEN), "/healthz").await.0, 403);
    // The apiserver's kubelet-client certificate, signed by the cluster CA.
    let c =
        e.s.issue_client_cert(APISERVER_KUBELET_CLIENT, &["kubeadm:cluster-admins"])
            .unwrap();
    assert_eq!(
        e.get(
            Cred::Cert(&c.cert_pem, &c.key_pem),
            "/containerLogs/vehicle/web/app?tailLines=1"
        )
        .await,
        (200, "four\n".into())
    );
    // A client certificate from another CA: refused at the handshake.
    let other = edgehub_testsupport::certs::TestPki::generate().unwrap();
    let foreign = other
        .client_cert(APISERVER_KUBELET_CLIENT, "system:masters")
        .unwrap();
    let r = e
        .call(
            Cred::Cert(&foreign.cert_pem, &foreign.key_pem),
            "GET",
            "/healthz",
        )
        .await;
    assert!(r.is_err(), "a foreign client certificate: {r:?}");
    // Anything else, authorized: 404, as the kubelet answers.
    assert_eq!(
        e.get(Cred::Token(ADMIN_TOKEN), "/checkpoint/vehicle/web/app")
            .await,
        (404, "404 page not found\n".into())
    );
    // The streaming routes are served (their options first, as the kubelet's).
    assert_eq!(
        e.get(Cred::Token(ADMIN_TOKEN), "/exec/vehicle/web/app")
            .await,
        (
            400,
            "you must specify at least 1 of stdin, stdout, stderr".into()
        )
    );
    assert_eq!(
        e.call(Cred::Token(ADMIN_TOKEN), "POST", "/run/x/y/z")
            .await
            .unwrap()
            .0,
        404
    );
    // Every request was reviewed as the node: one TokenReview per token (cached), SARs.
    let reviews =
        e.s.count(|r| r.path == "/apis/authentication.k8s.io/v1/tokenreviews");
    assert_eq!(
        reviews, 4,
        "admin, bogus, jane, the node: each reviewed once"
    );
}

#[tokio::test]
async fn streams_are_bounded_and_idle_follows_end() {
    let e = env(KubeletApiConfig {
        max_streams: 1,
        ..config()
    })
    .await;
    let cred = Cred::Token(ADMIN_TOKEN);
    let mut send = connect(e.addr, &e.s.pki.ca_pem, &cred).await.unwrap();
    let resp = send
        .send_request(request(
            &cred,
            "GET",
            "/containerLogs/vehicle/web/app?follow=true",
        ))
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    // A second stream while the first lasts: refused.
    let (code, _) = e.logs("").await;
    assert_eq!(code, 429);
    // Nothing new for the idle timeout (2 s): the follow ends, and its place is free again.
    let started = std::time::Instant::now();
    let body = tokio::time::timeout(Duration::from_secs(10), resp.into_body().collect())
        .await
        .expect("the idle follow ends")
        .unwrap()
        .to_bytes();
    assert!(started.elapsed() >= Duration::from_secs(1));
    assert_eq!(String::from_utf8_lossy(&body), "one\ntwo\nthree\nfour\n");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(e.logs("?tailLines=1").await, (200, "four\n".into()));
}
