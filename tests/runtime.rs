//! The pod runtime with real containers: containerd from scripts/cri-stack.sh, pods from the
//! cache. Needs root; without it these tests fail, loudly.

mod common;

use common::{exec, running};
use edgehub::cri::{api, labels, CriClient, CriRuntime};
use edgehub::object::Kind;
use edgehub::runtime::{BackoffPolicy, Reconciler};
use edgehub::store::{Change, OpenMode, Store, StoredObject};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

fn uid(tag: &str) -> String {
    let n = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("rt-{tag}-{}-{}", std::process::id(), n % 1_000_000_000)
}

/// A host-network DaemonSet-style pod running busybox.
fn pod(name: &str, uid: &str, image: &str) -> Value {
    json!({
        "metadata": {"name": name, "namespace": "rt", "uid": uid, "resourceVersion": "1",
            "labels": {"controller-revision-hash": "h1"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "ds", "uid": "ds-uid", "controller": true}]},
        "spec": {
            "nodeName": "edge-1",
            "hostNetwork": true,
            "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "app", "image": image, "imagePullPolicy": "IfNotPresent",
                "env": [{"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]}]
        },
        "status": {"phase": "Pending"}
    })
}

fn put(store: &Store, p: &Value) {
    let obj = StoredObject::from_raw(Kind::Pod, p.to_string()).unwrap();
    store
        .apply(Kind::Pod, &[Change::Upsert(obj)], None)
        .unwrap();
}

fn remove(store: &Store, p: &Value) {
    let ch = Change::Delete {
        namespace: p["metadata"]["namespace"].as_str().unwrap().into(),
        name: p["metadata"]["name"].as_str().unwrap().into(),
    };
    store.apply(Kind::Pod, &[ch], None).unwrap();
}

struct Env {
    /// A node name of its own: tests share one containerd and must not see each other's pods.
    node: String,
    socket: PathBuf,
    _dir: tempfile::TempDir,
    data: PathBuf,
    store: Arc<Store>,
}

fn env() -> Env {
    let socket = common::cri_stack();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let store = Arc::new(Store::open(&data.join("edgehub.db"), OpenMode::Normal).unwrap());
    let node = uid("node");
    // As after a first sync: the cache has seen the node's pod list, so it may say which
    // pods must not run. The sources-ready tests start without this.
    store
        .set_cursor(&edgehub::sync::pods_cursor_key(&node), "1")
        .unwrap();
    Env {
        node,
        socket,
        _dir: dir,
        data,
        store,
    }
}

fn cleanup(e: &Env) -> common::NodeCleanup {
    common::NodeCleanup {
        node: e.node.clone(),
        socket: e.socket.clone(),
    }
}

/// A fake apiserver and a client for it, as the node identity.
async fn cloud(
    e: &Env,
) -> (
    edgehub_testsupport::FakeApiServer,
    tempfile::TempDir,
    edgehub::kube::ApiClient,
) {
    let server = edgehub_testsupport::FakeApiServer::start().await.unwrap();
    let kdir = tempfile::tempdir().unwrap();
    let kc = server
        .write_kubeconfig(kdir.path(), edgehub_testsupport::NODE_TOKEN)
        .unwrap();
    let client = common::client(&common::test_config(&e.data, &kc));
    (server, kdir, client)
}

/// A reconciler as `edgehub run` has it: with a client, the report sender runs beside it.
fn reconciler(e: &Env, client: Option<edgehub::kube::ApiClient>) -> Reconciler<CriClient> {
    if let Some(c) = &client {
        spawn_reporter(e, c);
    }
    let mut r = Reconciler::new(
        CriClient::new(&e.socket),
        e.store.clone(),
        client,
        e.data.clone(),
        e.node.clone(),
    );
    r.backoff = BackoffPolicy {
        initial: Duration::from_millis(300),
        max: Duration::from_secs(2),
    };
    r
}

/// The fetcher of what pods reference, running beside the reconciler as in `edgehub run`.
fn spawn_fetcher(e: &Env, client: &edgehub::kube::ApiClient, every: Duration) {
    let mut f = edgehub::sources::fetch::Fetcher::new(client.clone(), e.store.clone());
    f.refresh = every;
    f.retry = every;
    let (tx, rx) = tokio::sync::watch::channel(false);
    // The test ends the runtime, and with it the task; the sender must outlive it.
    std::mem::forget(tx);
    tokio::spawn(f.run(rx));
}

/// The report sender, running beside the reconciler as in `edgehub run`.
fn spawn_reporter(e: &Env, client: &edgehub::kube::ApiClient) {
    let (tx, rx) = tokio::sync::watch::channel(false);
    std::mem::forget(tx);
    tokio::spawn(edgehub::outbox::Sender::new(client.clone(), e.store.clone()).run(None, rx));
}

fn outbox_empty(store: &Store) -> bool {
    store.outbox().unwrap().is_empty()
}

/// After a pass that should have queued nothing: the outbox is empty, and then the server has
/// still seen only what `unchanged` expects. The report sender removes a row only once the
/// apiserver answered it, so a row the pass queued is either still in the outbox or already
/// in the server's log: no wait stands in for "nothing was sent".
fn assert_nothing_sent(store: &Store, unchanged: impl Fn() -> bool) {
    assert!(
        outbox_empty(store),
        "the pass queued a report: {:?}",
        store.outbox().unwrap()
    );
    assert!(unchanged(), "a report reached the apiserver");
}

fn status_patches(server: &edgehub_testsupport::FakeApiServer) -> usize {
    server.count(|r| r.verb == "patch" && r.resource == "pods/status")
}

fn log_has(data: &Path, uid: &str, file: &str, text: &str) -> bool {
    std::fs::read_to_string(data.join("pods").join(uid).join("logs").join(file))
        .unwrap_or_default()
        .contains(text)
}

/// Reconciles until `f` holds, or fails after `secs`.
async fn reconcile_until<F, Fut>(r: &mut Reconciler<CriClient>, secs: u64, what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = std::time::Instant::now() + Duration::from_secs(secs);
    loop {
        r.reconcile().await.unwrap();
        if f().await {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "timed out after {secs}s waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
}

#[tokio::test]
async fn a_cached_pod_runs_and_a_killed_container_is_restarted() {
    let e = env();
    let c = CriClient::new(&e.socket);
    let id = uid("run");
    let p = pod("runner", &id, "127.0.0.1:5000/busybox:1.0");
    put(&e.store, &p);
    let mut r = reconciler(&e, None);
    let pass = r.reconcile().await.unwrap();
    assert_eq!(
        (pass.sandboxes_created, pass.containers_started),
        (1, 1),
        "{pass:?}"
    );
    let first = running(&c, &id).await;
    assert_eq!(first.len(), 1);
    let data = e.data.clone();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !log_has(&data, &id, "app_0.log", "hello from 1.0") {
        assert!(
            std::time::Instant::now() < deadline,
            "the container's process writes its log"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The env from the downward API reached the process.
    let out = c
        .exec_sync(
            &first[0].id,
            vec!["sh".into(), "-c".into(), "echo $NODE".into()],
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), e.node);
    // A second pass changes nothing.
    assert_eq!(r.reconcile().await.unwrap(), Default::default());

    // Kill the container's process from the host, as an OOM kill or crash would.
    let runc_root = e.socket.parent().unwrap().join("runc/k8s.io");
    let st = std::process::Command::new("runc")
        .arg("--root")
        .arg(&runc_root)
        .args(["kill", &first[0].id, "KILL"])
        .status()
        .unwrap();
    assert!(st.success(), "runc kill");
    reconcile_until(
        &mut r,
        20,
        "a new attempt runs after the crash-loop backoff",
        || async {
            running(&c, &id)
                .await
                .iter()
                .any(|x| x.metadata.as_ref().unwrap().attempt == 1)
        },
    )
    .await;

    // No longer desired: stopped and removed.
    remove(&e.store, &p);
    let pass = r.reconcile().await.unwrap();
    assert_eq!(pass.pods_removed, 1);
    assert!(common::containers_of(&c, &id).await.is_empty());
}

#[tokio::test]
async fn after_a_reboot_without_a_link_pods_come_back_from_the_cache() {
    let e = env();
    let c = CriClient::new(&e.socket);
    let id = uid("reboot");
    let p = pod("reboot", &id, "127.0.0.1:5000/busybox:2.0");
    put(&e.store, &p);
    reconciler(&e, None).reconcile().await.unwrap();
    assert_eq!(running(&c, &id).await.len(), 1);
    // The reboot: every container and sandbox of the pod is gone.
    for sb in c
        .list_pod_sandbox(HashMap::from([(labels::POD_UID.to_string(), id.clone())]))
        .await
        .unwrap()
    {
        c.stop_pod_sandbox(&sb.id).await.unwrap();
        c.remove_pod_sandbox(&sb.id).await.unwrap();
    }
    assert!(running(&c, &id).await.is_empty());
    // A fresh edgehub with no apiserver at all rebuilds the pod from its cache.
    let mut r = reconciler(&e, None);
    let pass = r.reconcile().await.unwrap();
    assert_eq!(pass.sandboxes_created, 1);
    assert_eq!(running(&c, &id).await.len(), 1);
    remove(&e.store, &p);
    r.reconcile().await.unwrap();
}

#[tokio::test]
async fn a_pod_deleted_in_the_cloud_is_stopped_and_its_deletion_finished() {
    let e = env();
    let c = CriClient::new(&e.socket);
    let (server, _kdir, client) = cloud(&e).await;
    let id = uid("del");
    let p = pod("deleted", &id, "127.0.0.1:5000/busybox:1.0");
    server.apply("pods", p.clone());
    put(&e.store, &server.get("pods", "rt", "deleted").unwrap());
    let mut r = reconciler(&e, Some(client));
    r.reconcile().await.unwrap();
    assert_eq!(running(&c, &id).await.len(), 1);

    // The operator deletes the pod: the apiserver sets deletionTimestamp (grace 1 s).
    let (code, _) = server
        .raw(
            Some(edgehub_testsupport::ADMIN_TOKEN),
            "DELETE",
            "/api/v1/namespaces/rt/pods/deleted",
            Some("application/json"),
            Some(&json!({"gracePeriodSeconds": 1})),
        )
        .await
        .unwrap();
    assert_eq!(code, 200);
    let deleting = server.get("pods", "rt", "deleted").unwrap();
    assert!(deleting["metadata"]["deletionTimestamp"].is_string());
    put(&e.store, &deleting);
    let pass = r.reconcile().await.unwrap();
    assert_eq!(pass.pods_removed, 1, "{pass:?}");
    assert!(common::containers_of(&c, &id).await.is_empty());
    // Once its sandbox is gone, the next pass finishes the deletion.
    let pass = r.reconcile().await.unwrap();
    assert_eq!(pass.pods_finalized, 1, "{pass:?}");
    assert!(
        server.get("pods", "rt", "deleted").is_none(),
        "the node finished the delete"
    );
    let del = server
        .requests()
        .into_iter()
        .rfind(|x| x.method == "DELETE")
        .unwrap();
    assert_eq!(
        (del.user.as_deref(), del.status),
        (Some(edgehub_testsupport::NODE_USER), 200)
    );
}

#[tokio::test]
async fn an_unsupported_pod_is_reported_and_the_others_run() {
    let e = env();
    let c = CriClient::new(&e.socket);
    let (bad_id, good_id) = (uid("bad"), uid("good"));
    let mut bad = pod("bad", &bad_id, "127.0.0.1:5000/busybox:1.0");
    bad["spec"]["volumes"] = json!([{"name": "cfg", "cephfs": {"monitors": ["10.0.0.1"]}}]);
    let good = pod("good", &good_id, "127.0.0.1:5000/busybox:1.0");
    put(&e.store, &bad);
    put(&e.store, &good);
    let mut r = reconciler(&e, None);
    let pass = r.reconcile().await.unwrap();
    assert_eq!(pass.unsupported.len(), 1);
    assert_eq!(pass.unsupported[0].0, "bad");
    assert_eq!(pass.unsupported[0].1.field, "spec.volumes[0].cephfs");
    assert!(common::containers_of(&c, &bad_id).await.is_empty());
    assert_eq!(running(&c, &good_id).await.len(), 1);
    remove(&e.store, &bad);
    remove(&e.store, &good);
    r.reconcile().await.unwrap();
}

#[tokio::test]
async fn objects_without_edgehubs_label_are_never_touched() {
    let e = env();
    let c = CriClient::new(&e.socket);
    let logs = tempfile::tempdir().unwrap();
    let foreign = common::host_network_sandbox(
        "foreign",
        &uid("foreign"),
        "other",
        logs.path(),
        HashMap::from([("owner".to_string(), "someone-else".to_string())]),
    );
    let sb = c.run_pod_sandbox(foreign).await.unwrap();
    // The cache is empty: edgehub wants nothing, yet removes nothing that is not its own.
    reconciler(&e, None).reconcile().await.unwrap();
    let st = c.pod_sandbox_status(&sb).await.unwrap().unwrap();
    assert_eq!(st.state, api::PodSandboxState::SandboxReady as i32);
    c.stop_pod_sandbox(&sb).await.unwrap();
    c.remove_pod_sandbox(&sb).await.unwrap();
}

#[tokio::test]
async fn a_missing_cri_socket_is_an_error_and_reconciling_recovers() {
    let e = env();
    let dir = tempfile::tempdir().unwrap();
    let late = dir.path().join("late.sock");
    let mut r = Reconciler::new(
        CriClient::new(&late),
        e.store.clone(),
        None,
        e.data.clone(),
        e.node.clone(),
    );
    let err = r.reconcile().await.unwrap_err();
    assert!(
        err.to_string().contains("late.sock") && err.to_string().contains("unavailable"),
        "{err}"
    );
    std::os::unix::fs::symlink(&e.socket, &late).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while r.reconcile().await.is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "reconciling recovers once the socket appears"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn pod_status_reaches_the_apiserver_and_waits_while_offline() {
    let e = env();
    let c = CriClient::new(&e.socket);
    let (server, _kdir, client) = cloud(&e).await;
    let id = uid("status");
    let mut p = pod("status", &id, "127.0.0.1:5000/busybox:1.0");
    p["spec"]["nodeName"] = json!("edge-1");
    server.apply("pods", p);
    put(&e.store, &server.get("pods", "rt", "status").unwrap());
    let mut r = reconciler(&e, Some(client.clone()));
    r.host_ip = Some("127.0.0.1".into());
    reconcile_until(&mut r, 20, "status Running on the apiserver", || async {
        server.get("pods", "rt", "status").unwrap()["status"]["phase"] == "Running"
    })
    .await;
    let st = server.get("pods", "rt", "status").unwrap()["status"].clone();
    assert_eq!(st["podIP"], "127.0.0.1");
    assert_eq!(
        st["containerStatuses"][0]["image"],
        "127.0.0.1:5000/busybox:1.0"
    );
    assert!(st["containerStatuses"][0]["imageID"]
        .as_str()
        .unwrap()
        .starts_with("127.0.0.1:5000/busybox@sha256:"));
    assert!(st["containerStatuses"][0]["state"]["running"]["startedAt"].is_string());
    assert!(
        st["containerStatuses"][0]["state"].get("waiting").is_none(),
        "the old state is gone"
    );
    let ready = st["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "Ready")
        .unwrap()
        .clone();
    assert_eq!(ready["status"], "True");
    // The cache holds what the apiserver answered: nothing more is queued or sent.
    put(&e.store, &server.get("pods", "rt", "status").unwrap());
    common::wait_until(10, "the reports so far delivered", || {
        outbox_empty(&e.store)
    })
    .await;
    let patches = status_patches(&server);
    r.reconcile().await.unwrap();
    assert_nothing_sent(&e.store, || status_patches(&server) == patches);

    // Offline: the container dies and is restarted; the new status waits in the queue.
    server.set_offline(true).await.unwrap();
    let running_now = running(&c, &id).await;
    runc_kill(&e, &running_now[0].id);
    reconcile_until(&mut r, 20, "a status queued while offline", || async {
        !e.store.queued_statuses().unwrap().is_empty()
    })
    .await;
    server.set_offline(false).await.unwrap();
    reconcile_until(
        &mut r,
        30,
        "the queue drains once the link is back",
        || async { e.store.queued_statuses().unwrap().is_empty() },
    )
    .await;
    remove(&e.store, &server.get("pods", "rt", "status").unwrap());
    r.reconcile().await.unwrap();
}

#[tokio::test]
async fn an_unsupported_pod_gets_a_condition_naming_the_field() {
    let e = env();
    let (server, _kdir, client) = cloud(&e).await;
    let id = uid("unsup");
    let mut p = pod("unsup", &id, "127.0.0.1:5000/busybox:1.0");
    p["spec"]["volumes"] = json!([{"name": "s", "iscsi": {"targetPortal": "10.0.0.1:3260"}}]);
    server.apply("pods", p);
    put(&e.store, &server.get("pods", "rt", "unsup").unwrap());
    let mut r = reconciler(&e, Some(client.clone()));
    reconcile_until(
        &mut r,
        10,
        "the condition and the Event on the apiserver",
        || async {
            server
                .get("events", "rt", "unsup.edgehub-unsupportedfield")
                .is_some()
                && server.get("pods", "rt", "unsup").unwrap()["status"]["conditions"]
                    .as_array()
                    .is_some_and(|c| c.iter().any(|c| c["reason"] == "UnsupportedField"))
        },
    )
    .await;
    assert_eq!(status_patches(&server), 1);
    let ready = server.get("pods", "rt", "unsup").unwrap()["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "Ready")
        .unwrap()
        .clone();
    assert_eq!(
        (ready["status"].as_str(), ready["reason"].as_str()),
        (Some("False"), Some("UnsupportedField"))
    );
    assert!(
        ready["message"]
            .as_str()
            .unwrap()
            .contains("spec.volumes[0].iscsi"),
        "{ready}"
    );
    // And a Warning Event about it, posted by the node.
    let ev = server
        .get("events", "rt", "unsup.edgehub-unsupportedfield")
        .expect("the Event exists");
    assert_eq!(
        (ev["type"].as_str(), ev["reason"].as_str()),
        (Some("Warning"), Some("UnsupportedField"))
    );
    assert_eq!(ev["involvedObject"]["uid"], id.as_str());
    assert!(ev["message"]
        .as_str()
        .unwrap()
        .contains("spec.volumes[0].iscsi"));
    common::wait_until(10, "the reports so far delivered", || {
        outbox_empty(&e.store)
    })
    .await;
    r.reconcile().await.unwrap();
    assert_nothing_sent(&e.store, || {
        server.count(|r| r.verb == "create" && r.resource == "events") == 1
            && status_patches(&server) == 1
    });
}

/// The recorded pod, as the apiserver served it: a ConfigMap volume and the projected
/// service-account token volume. edgehub fetches both, writes them, and keeps them after
/// the link goes.
#[tokio::test]
async fn the_recorded_pod_runs_as_recorded_with_its_configmap_and_token() {
    let e = env();
    let (server, _kdir, client) = cloud(&e).await;
    server.seed_recorded_cluster();
    server.remove("pods", "vehicle", "gateway-v9hb2");
    // Its own uid: other tests may run the recorded pods in the same containerd.
    let id = uid("recorded");
    server.modify("pods", "vehicle", "telemetry-sv74m", |p| {
        p["metadata"]["uid"] = json!(id)
    });
    let recorded = server.get("pods", "vehicle", "telemetry-sv74m").unwrap();
    put(&e.store, &recorded);
    let cri = CriClient::new(&e.socket);
    spawn_fetcher(&e, &client, Duration::from_millis(200));
    let mut r = reconciler(&e, Some(client.clone()));
    reconcile_until(&mut r, 60, "both containers run", || async {
        running(&cri, &id).await.len() == 2
    })
    .await;

    let vol = e.data.join("pods").join(&id).join("volumes");
    let read = |p: &str| std::fs::read_to_string(vol.join(p)).unwrap();
    assert_eq!(read("configmap/cfg/app.conf"), "level=info\n");
    let token = "projected/kube-api-access-7f6wp";
    assert_eq!(
        read(&format!("{token}/token")),
        "fake-token-for-telemetry-sv74m"
    );
    assert_eq!(read(&format!("{token}/namespace")), "vehicle");
    assert_eq!(read(&format!("{token}/ca.crt")), server.pki.ca_pem);
    assert_eq!(read(&format!("{token}/service-ca.crt")), server.pki.ca_pem);

    // The container sees them where the pod mounts them.
    let app = running(&cri, &id)
        .await
        .into_iter()
        .find(|c| c.labels.get(labels::CONTAINER_NAME).map(String::as_str) == Some("app"))
        .unwrap();
    assert_eq!(
        exec(&cri, &app.id, &["cat", "/etc/app/app.conf"]).await,
        "level=info\n"
    );
    assert_eq!(
        exec(
            &cri,
            &app.id,
            &[
                "cat",
                "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
            ]
        )
        .await,
        "vehicle"
    );

    // An edit of the ConfigMap reaches the running container, atomically.
    server.modify("configmaps", "vehicle", "telemetry-cfg", |c| {
        c["data"]["app.conf"] = json!("level=debug\n")
    });
    let (cri2, app_id) = (cri.clone(), app.id.clone());
    reconcile_until(&mut r, 30, "the edit is in the container", || {
        let (cri2, app_id) = (cri2.clone(), app_id.clone());
        async move { exec(&cri2, &app_id, &["cat", "/etc/app/app.conf"]).await == "level=debug\n" }
    })
    .await;

    // The node asked for the token once (it is cached), read and watched each object by
    // name, and never listed Secrets or ConfigMaps (the Node authorizer forbids it).
    let token_posts =
        server.count(|q| q.method == "POST" && q.path.ends_with("/serviceaccounts/default/token"));
    assert_eq!(token_posts, 1);
    assert_eq!(
        server.count(
            |q| (q.path.ends_with("/configmaps") || q.path.ends_with("/secrets"))
                && !q
                    .query
                    .get("fieldSelector")
                    .is_some_and(|f| f == "metadata.name=telemetry-cfg"
                        || f == "metadata.name=kube-root-ca.crt"
                        || f == "metadata.name=openshift-service-ca.crt")
        ),
        0
    );
    assert!(server.count(|q| q.verb == "watch" && q.resource == "configmaps") >= 1);

    // A reboot without a link: the sandbox is gone, the apiserver unreachable. The pod comes
    // back with its ConfigMap and token from the cache.
    server.set_offline(true).await.unwrap();
    for sb in cri
        .list_pod_sandbox(HashMap::from([(labels::POD_UID.to_string(), id.clone())]))
        .await
        .unwrap()
    {
        cri.stop_pod_sandbox(&sb.id).await.unwrap();
        cri.remove_pod_sandbox(&sb.id).await.unwrap();
    }
    // A reboot empties the tmpfs volumes too.
    edgehub::volumes::remove_pod_dir(&vol).unwrap();
    let mut r = reconciler(&e, Some(client));
    reconcile_until(&mut r, 60, "the pod is back offline", || async {
        running(&cri, &id).await.len() == 2
    })
    .await;
    assert_eq!(read("configmap/cfg/app.conf"), "level=debug\n");
    assert_eq!(
        read(&format!("{token}/token")),
        "fake-token-for-telemetry-sv74m"
    );

    remove(&e.store, &recorded);
    r.reconcile().await.unwrap();
    assert!(common::containers_of(&cri, &id).await.is_empty());
}

/// A pod whose ConfigMap does not exist waits with a condition that says so, and starts
/// once the ConfigMap appears.
#[tokio::test]
async fn a_pod_waits_for_a_missing_configmap_and_starts_when_it_appears() {
    let e = env();
    let (server, _kdir, client) = cloud(&e).await;
    let id = uid("waitcm");
    let mut p = pod("waitcm", &id, "127.0.0.1:5000/busybox:1.0");
    p["spec"]["containers"][0]["envFrom"] =
        json!([{"configMapRef": {"name": "later"}, "prefix": "CFG_"}]);
    server.apply("pods", p);
    put(&e.store, &server.get("pods", "rt", "waitcm").unwrap());
    let cri = CriClient::new(&e.socket);
    spawn_fetcher(&e, &client, Duration::from_millis(100));
    let mut r = reconciler(&e, Some(client));
    // The fetcher runs beside the reconciler: first "not cached yet" (quietly), then the
    // apiserver's answer.
    let mut pass = r.reconcile().await.unwrap();
    for _ in 0..50 {
        if pass.missing.first().is_some_and(|m| m.1.known_absent) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        pass = r.reconcile().await.unwrap();
    }
    assert_eq!(pass.missing.len(), 1, "{pass:?}");
    assert_eq!(
        pass.missing[0].1.message,
        "configmap \"rt/later\" not found"
    );
    reconcile_until(
        &mut r,
        10,
        "the condition and Event reach the apiserver",
        || async {
            let ready = server.get("pods", "rt", "waitcm").unwrap()["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|c| c["type"] == "Ready")
                .cloned()
                .unwrap_or_default();
            (ready["reason"].as_str(), ready["status"].as_str())
                == (Some("ConfigMapUnavailable"), Some("False"))
                && server
                    .get("events", "rt", "waitcm.edgehub-configmapunavailable")
                    .is_some()
        },
    )
    .await;
    assert!(common::containers_of(&cri, &id).await.is_empty());

    server.apply(
        "configmaps",
        json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "later", "namespace": "rt"},
               "data": {"LEVEL": "warn"}}),
    );
    reconcile_until(&mut r, 30, "the pod runs", || async {
        running(&cri, &id).await.len() == 1
    })
    .await;
    let c = &running(&cri, &id).await[0];
    assert!(exec(&cri, &c.id, &["env"]).await.contains("CFG_LEVEL=warn"));
    remove(&e.store, &server.get("pods", "rt", "waitcm").unwrap());
    r.reconcile().await.unwrap();
}

fn ready_of(server: &edgehub_testsupport::FakeApiServer, name: &str) -> (String, bool) {
    let st = server.get("pods", "rt", name).unwrap()["status"].clone();
    let cond = st["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == "Ready")
        .map(|c| c["status"].as_str().unwrap_or("").to_string())
        .unwrap_or_default();
    let ready = st["containerStatuses"][0]["ready"]
        .as_bool()
        .unwrap_or(false);
    (cond, ready)
}

/// Readiness gates the pod's Ready condition; a failing liveness probe restarts the
/// container. Both are exec probes run through CRI ExecSync in real containers.
#[tokio::test]
async fn probes_gate_readiness_and_restart_unhealthy_containers() {
    let e = env();
    let (server, _kdir, client) = cloud(&e).await;
    let cri = CriClient::new(&e.socket);
    let id = uid("probe");
    let mut p = pod("probe", &id, "127.0.0.1:5000/busybox:1.0");
    p["spec"]["containers"][0]["command"] = json!(["sh", "-c", "while true; do sleep 1; done"]);
    p["spec"]["containers"][0]["readinessProbe"] = json!({
        "exec": {"command": ["cat", "/tmp/ready"]}, "periodSeconds": 1, "failureThreshold": 1});
    p["spec"]["containers"][0]["livenessProbe"] = json!({
        "exec": {"command": ["sh", "-c", "[ ! -e /tmp/sick ]"]}, "periodSeconds": 1, "failureThreshold": 2});
    server.apply("pods", p);
    put(&e.store, &server.get("pods", "rt", "probe").unwrap());
    let mut r = reconciler(&e, Some(client));

    reconcile_until(&mut r, 30, "the container runs", || async {
        running(&cri, &id).await.len() == 1
    })
    .await;
    // Running but not ready: the readiness probe fails.
    let (server2, mut probes) = (&server, 0);
    reconcile_until(&mut r, 10, "a few probes ran", || {
        probes += 1;
        async move { probes > 8 }
    })
    .await;
    assert_eq!(ready_of(server2, "probe"), ("False".to_string(), false));

    let first = running(&cri, &id).await[0].clone();
    exec(&cri, &first.id, &["sh", "-c", "echo ok > /tmp/ready"]).await;
    reconcile_until(&mut r, 10, "the pod is Ready", || async {
        ready_of(&server, "probe") == ("True".to_string(), true)
    })
    .await;

    // Unhealthy: the liveness probe fails twice, the container is stopped and replaced by
    // the next attempt (a fresh root filesystem: healthy, and not ready again).
    exec(&cri, &first.id, &["sh", "-c", "echo > /tmp/sick"]).await;
    reconcile_until(&mut r, 30, "a new attempt runs", || async {
        running(&cri, &id)
            .await
            .iter()
            .any(|c| c.id != first.id && c.metadata.as_ref().unwrap().attempt == 1)
    })
    .await;
    reconcile_until(
        &mut r,
        10,
        "the restarted container is not ready",
        || async { ready_of(&server, "probe").0 == "False" },
    )
    .await;
    assert!(server
        .get("events", "rt", "probe.edgehub-unhealthy")
        .is_some());
    remove(&e.store, &server.get("pods", "rt", "probe").unwrap());
    r.reconcile().await.unwrap();
}

/// A pod without hostNetwork gets its own network namespace and an address from the
/// runtime's CNI (a bridge in the test stack): status.podIP, the POD_IP variable and an
/// httpGet readiness probe to that address all agree.
#[tokio::test]
async fn a_pod_network_pod_gets_an_address_from_cni() {
    let e = env();
    let (server, _kdir, client) = cloud(&e).await;
    let cri = CriClient::new(&e.socket);
    let id = uid("cni");
    let mut p = pod("cni", &id, "127.0.0.1:5000/busybox:1.0");
    p["spec"]["hostNetwork"] = json!(false);
    p["spec"]["containers"][0]["command"] = json!([
        "sh",
        "-c",
        "echo ok > /tmp/index.html; exec /bin/busybox httpd -f -p 8080 -h /tmp"
    ]);
    p["spec"]["containers"][0]["env"] = json!([
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]);
    p["spec"]["containers"][0]["readinessProbe"] = json!({
        "httpGet": {"path": "/index.html", "port": 8080}, "periodSeconds": 1});
    server.apply("pods", p);
    put(&e.store, &server.get("pods", "rt", "cni").unwrap());
    let mut r = reconciler(&e, Some(client));
    reconcile_until(
        &mut r,
        30,
        "the pod is Ready through its own address",
        || async { ready_of(&server, "cni") == ("True".to_string(), true) },
    )
    .await;
    let st = server.get("pods", "rt", "cni").unwrap()["status"].clone();
    let ip = st["podIP"].as_str().unwrap().to_string();
    assert!(ip.starts_with("10.88.42."), "{st}");
    assert_ne!(st["podIP"], st["hostIP"]);
    let c = &running(&cri, &id).await[0];
    assert!(exec(&cri, &c.id, &["env"])
        .await
        .contains(&format!("POD_IP={ip}")));
    assert_eq!(exec(&cri, &c.id, &["hostname"]).await.trim(), "cni");
    remove(&e.store, &server.get("pods", "rt", "cni").unwrap());
    r.reconcile().await.unwrap();
    assert!(common::containers_of(&cri, &id).await.is_empty());
}

/// imagePullSecrets: the anonymous pull from the password-protected registry is refused and
/// the pod says ErrImagePull (and nothing else stops); with the Secret it runs.
#[tokio::test]
async fn image_pull_secrets_open_a_private_registry() {
    use base64::Engine;
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let e = env();
    let (server, _kdir, client) = cloud(&e).await;
    let cri = CriClient::new(&e.socket);
    let id = uid("private");
    let mut p = pod("private", &id, "127.0.0.1:5001/private/busybox:1.0");
    // Always: a copy left in containerd by an earlier run must not hide the credentials.
    p["spec"]["containers"][0]["imagePullPolicy"] = json!("Always");
    p["spec"]["imagePullSecrets"] = json!([{"name": "regcred"}]);
    server.apply("pods", p);
    put(&e.store, &server.get("pods", "rt", "private").unwrap());
    let good_id = uid("public");
    let good = pod("public", &good_id, "127.0.0.1:5000/busybox:1.0");
    put(&e.store, &good);
    spawn_fetcher(&e, &client, Duration::from_millis(100));
    let mut r = reconciler(&e, Some(client));

    reconcile_until(&mut r, 30, "the pod reports ErrImagePull", || async {
        server.get("pods", "rt", "private").unwrap()["status"]["conditions"][0]["reason"]
            == "ErrImagePull"
    })
    .await;
    assert_eq!(running(&cri, &good_id).await.len(), 1, "the other pod runs");
    assert!(common::containers_of(&cri, &id).await.is_empty());

    let cfg = json!({"auths": {"127.0.0.1:5001": {"auth": b64("edgehub:edgehub-pull")}}});
    server.apply(
        "secrets",
        json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "regcred", "namespace": "rt"},
               "type": "kubernetes.io/dockerconfigjson",
               "data": {".dockerconfigjson": b64(&cfg.to_string())}}),
    );
    reconcile_until(
        &mut r,
        60,
        "the pod runs from the private registry",
        || async { running(&cri, &id).await.len() == 1 },
    )
    .await;
    remove(&e.store, &server.get("pods", "rt", "private").unwrap());
    remove(&e.store, &good);
    r.reconcile().await.unwrap();
}

// ---------------------------------------------------------------------------------------------
// The runtime as `edgehub run` drives it: its loop in the background, the fetcher and the
// report sender beside it.

/// Runs the reconciler's loop in the background; dropping the sender stops it.
fn spawn_loop(r: Reconciler<CriClient>) -> tokio::sync::watch::Sender<bool> {
    let (tx, rx) = tokio::sync::watch::channel(false);
    tokio::spawn(r.run(Duration::from_secs(10), rx));
    tx
}

fn runc_kill(e: &Env, id: &str) {
    let runc_root = e.socket.parent().unwrap().join("runc/k8s.io");
    assert!(std::process::Command::new("runc")
        .arg("--root")
        .arg(&runc_root)
        .args(["kill", id, "KILL"])
        .status()
        .unwrap()
        .success());
}

/// A sandbox recreated with a new address (a reboot, a crashed pause container): the status
/// patch replaces the old IP instead of adding to it, and the apiserver refuses nothing.
#[tokio::test]
async fn a_new_pod_ip_replaces_the_old_one_on_the_apiserver() {
    let e = env();
    let (server, _kdir, client) = cloud(&e).await;
    let cri = CriClient::new(&e.socket);
    let id = uid("newip");
    let mut p = pod("newip", &id, "127.0.0.1:5000/busybox:1.0");
    p["spec"]["hostNetwork"] = json!(false);
    server.apply("pods", p);
    put(&e.store, &server.get("pods", "rt", "newip").unwrap());
    let mut r = reconciler(&e, Some(client));
    r.host_ip = Some("127.0.0.1".into());
    let ip_of = || {
        server.get("pods", "rt", "newip").unwrap()["status"]["podIP"]
            .as_str()
            .unwrap_or("")
            .to_string()
    };
    reconcile_until(&mut r, 30, "the first IP on the apiserver", || async {
        ip_of().starts_with("10.88.42.")
    })
    .await;
    let first = ip_of();
    // The sandbox goes; the runtime starts a new one, and CNI hands out another address.
    for sb in cri
        .list_pod_sandbox(HashMap::from([(labels::POD_UID.to_string(), id.clone())]))
        .await
        .unwrap()
    {
        cri.stop_pod_sandbox(&sb.id).await.unwrap();
        cri.remove_pod_sandbox(&sb.id).await.unwrap();
    }
    reconcile_until(&mut r, 30, "the new IP on the apiserver", || async {
        let ip = ip_of();
        ip.starts_with("10.88.42.") && ip != first
    })
    .await;
    let st = server.get("pods", "rt", "newip").unwrap()["status"].clone();
    assert_eq!(st["podIPs"], json!([{"ip": ip_of()}]), "exactly the new IP");
    assert_eq!(
        server.count(|q| q.resource == "pods/status" && q.status != 200),
        0,
        "no status patch was refused"
    );
    remove(&e.store, &server.get("pods", "rt", "newip").unwrap());
    r.reconcile().await.unwrap();
}

/// A registry stand-in that accepts connections and never answers.
async fn black_hole() -> (u16, tokio::task::JoinHandle<()>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = l.accept().await {
            held.push(s);
        }
    });
    (port, task)
}

/// One pod's pull hangs; another pod's container dies meanwhile and is back within its
/// backoff, long before the pull's deadline. The hanging pod gets its pull error at the
/// deadline. The deadline leaves room for a slow machine (under qemu the restart took 8.6 s
/// once): the proof is the order of the two, not how fast either is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_pull_holds_up_no_other_pod() {
    let e = env();
    let (server, _kdir, client) = cloud(&e).await;
    let (port, _hole) = black_hole().await;
    let cri = CriClient::new(&e.socket);
    let (hang_id, live_id) = (uid("hang"), uid("live"));
    let mut hang = pod("hang", &hang_id, &format!("127.0.0.1:{port}/hang:1.0"));
    hang["spec"]["containers"][0]["imagePullPolicy"] = json!("Always");
    server.apply("pods", hang);
    server.apply("pods", pod("live", &live_id, "127.0.0.1:5000/busybox:1.0"));
    put(&e.store, &server.get("pods", "rt", "live").unwrap());
    let mut r = reconciler(&e, Some(client));
    r.cri = Arc::new(CriClient::new(&e.socket).with_pull_deadline(Duration::from_secs(25)));
    let stop = spawn_loop(r);
    common::wait_until(30, "the live pod runs", || {
        futures_now(running(&cri, &live_id)).len() == 1
    })
    .await;
    let before = running(&cri, &live_id).await[0].id.clone();
    // The hanging pod arrives and its pull starts; then the live pod's container dies.
    put(&e.store, &server.get("pods", "rt", "hang").unwrap());
    tokio::time::sleep(Duration::from_millis(500)).await;
    let killed_at = std::time::Instant::now();
    runc_kill(&e, &before);
    common::wait_until(
        22,
        "the killed container is back while the pull hangs",
        || {
            futures_now(running(&cri, &live_id))
                .iter()
                .any(|c| c.id != before)
        },
    )
    .await;
    eprintln!(
        "killed container back after {:?} (backoff 300 ms) with a pull hanging",
        killed_at.elapsed()
    );
    assert!(
        common::containers_of(&cri, &hang_id).await.is_empty(),
        "still pulling"
    );
    assert!(
        !server.get("pods", "rt", "hang").unwrap()["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["reason"] == "ErrImagePull"),
        "the other pod did not wait for the pull to fail"
    );
    common::wait_until(40, "the hanging pod reports ErrImagePull", || {
        server.get("pods", "rt", "hang").unwrap()["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["reason"] == "ErrImagePull")
    })
    .await;
    drop(stop);
    for p in ["hang", "live"] {
        remove(&e.store, &server.get("pods", "rt", p).unwrap());
    }
    reconciler(&e, None).reconcile().await.unwrap();
}

/// Runs a future to completion from a synchronous closure (the polling helpers take one).
fn futures_now<F: std::future::Future>(f: F) -> F::Output {
    tokio::task::block_in_place(|| tokio::runtime::Handle::current().block_on(f))
}

/// With the Node authorizer lagging 2 s behind a pod's binding, a new pod with a ConfigMap
/// and the token volume runs within about that lag, not after the fetcher's long retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_pod_runs_soon_after_the_authorizer_catches_up() {
    let e = env();
    let (server, _kdir, client) = cloud(&e).await;
    server.seed_recorded_cluster();
    server.remove("pods", "vehicle", "gateway-v9hb2");
    server.set_authorizer_lag(Duration::from_secs(2));
    let cri = CriClient::new(&e.socket);
    spawn_fetcher(&e, &client, Duration::from_secs(60));
    let stop = spawn_loop(reconciler(&e, Some(client)));
    // The pod is bound now (the lag counts from here) and reaches the cache at once.
    let id = uid("lag");
    server.modify("pods", "vehicle", "telemetry-sv74m", |p| {
        p["metadata"]["uid"] = json!(id)
    });
    let arrived = std::time::Instant::now();
    put(
        &e.store,
        &server.get("pods", "vehicle", "telemetry-sv74m").unwrap(),
    );
    common::wait_until(6, "the pod runs", || {
        futures_now(running(&cri, &id)).len() == 2
    })
    .await;
    eprintln!(
        "pod with a ConfigMap and a token running {:?} after it arrived (authorizer lag 2 s)",
        arrived.elapsed()
    );
    assert!(server.count(|q| q.status == 403) >= 1, "the lag was hit");
    drop(stop);
    remove(
        &e.store,
        &server.get("pods", "vehicle", "telemetry-sv74m").unwrap(),
    );
    reconciler(&e, None).reconcile().await.unwrap();
}

/// Two probed pods, settled and idle for a minute: not one status patch. Then one pod's
/// readiness flips: exactly one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_node_patches_nothing_and_a_flip_patches_once() {
    let e = env();
    let (server, _kdir, client) = cloud(&e).await;
    let cri = CriClient::new(&e.socket);
    let names = ["quiet-a", "quiet-b"];
    let mut ids = Vec::new();
    for n in names {
        let id = uid(n);
        let mut p = pod(n, &id, "127.0.0.1:5000/busybox:1.0");
        p["spec"]["containers"][0]["command"] =
            json!(["sh", "-c", "touch /tmp/ready; while true; do sleep 1; done"]);
        p["spec"]["containers"][0]["readinessProbe"] = json!({
            "exec": {"command": ["cat", "/tmp/ready"]}, "periodSeconds": 1, "failureThreshold": 1});
        server.apply("pods", p);
        put(&e.store, &server.get("pods", "rt", n).unwrap());
        ids.push(id);
    }
    let mut r = reconciler(&e, Some(client));
    r.host_ip = Some("127.0.0.1".into());
    let stop = spawn_loop(r);
    common::wait_until(30, "both pods Ready on the apiserver", || {
        names
            .iter()
            .all(|n| ready_of(&server, n) == ("True".to_string(), true))
    })
    .await;
    // The cache follows the apiserver, as the watch would.
    for n in names {
        put(&e.store, &server.get("pods", "rt", n).unwrap());
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    server.clear_log();
    tokio::time::sleep(Duration::from_secs(60)).await;
    eprintln!("requests in 60 idle seconds: {:?}", server.count_by_verb());
    assert_eq!(server.count(|_| true), 0, "an idle node sends nothing");
    let c = running(&cri, &ids[0]).await[0].clone();
    exec(&cri, &c.id, &["/bin/busybox", "rm", "/tmp/ready"]).await;
    common::wait_until(10, "the flip reaches the apiserver", || {
        ready_of(&server, names[0]).0 == "False"
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        server.count(|q| q.resource == "pods/status"),
        1,
        "{:?}",
        server.count_by_verb()
    );
    drop(stop);
    for n in names {
        remove(&e.store, &server.get("pods", "rt", n).unwrap());
    }
    reconciler(&e, None).reconcile().await.unwrap();
}

fn mount_type(path: &Path) -> Option<String> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    info.lines().find_map(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        let dash = f.iter().position(|x| *x == "-")?;
        (Path::new(f[4]) == path).then(|| f[dash + 1].to_string())
    })
}

/// Secret and token volumes live on a tmpfs, never on flash; a pod that leaves the cache
/// without a deletion takes its directory (and those mounts) with it once its sandbox is gone.
#[tokio::test]
async fn secrets_stay_in_memory_and_a_gone_pods_directory_is_removed() {
    let e = env();
    let (server, _kdir, client) = cloud(&e).await;
    let cri = CriClient::new(&e.socket);
    let id = uid("secret");
    let mut p = pod("secret", &id, "127.0.0.1:5000/busybox:1.0");
    p["spec"]["volumes"] = json!([{"name": "creds", "secret": {"secretName": "creds"}},
                                  {"name": "cfg", "configMap": {"name": "cfg"}}]);
    p["spec"]["containers"][0]["volumeMounts"] = json!([
        {"name": "creds", "mountPath": "/creds"}, {"name": "cfg", "mountPath": "/cfg"}]);
    server.apply("pods", p);
    server.apply(
        "secrets",
        json!({"metadata": {"name": "creds", "namespace": "rt"}, "data": {"pw": "c2VjcmV0"}}),
    );
    server.apply(
        "configmaps",
        json!({"metadata": {"name": "cfg", "namespace": "rt"}, "data": {"a": "b"}}),
    );
    put(&e.store, &server.get("pods", "rt", "secret").unwrap());
    spawn_fetcher(&e, &client, Duration::from_secs(60));
    let mut r = reconciler(&e, Some(client));
    reconcile_until(&mut r, 30, "the pod runs", || async {
        running(&cri, &id).await.len() == 1
    })
    .await;
    let dir = e.data.join("pods").join(&id);
    let secret = dir.join("volumes/secret/creds");
    assert_eq!(mount_type(&secret).as_deref(), Some("tmpfs"));
    assert_eq!(
        mount_type(&dir.join("volumes/configmap/cfg")),
        None,
        "ConfigMaps stay on disk, as the kubelet keeps them"
    );
    let c = &running(&cri, &id).await[0];
    assert_eq!(exec(&cri, &c.id, &["cat", "/creds/pw"]).await, "secret");

    // The pod leaves the cache without a deletion (a relist no longer has it).
    remove(&e.store, &server.get("pods", "rt", "secret").unwrap());
    let pass = r.reconcile().await.unwrap();
    assert_eq!(pass.pods_removed, 1);
    assert!(
        dir.exists(),
        "the directory waits for the sandbox to be gone"
    );
    r.reconcile().await.unwrap();
    assert!(!dir.exists(), "then it goes");
    assert_eq!(mount_type(&secret), None, "and the tmpfs with it");
}

/// A warning that repeats is one Event with a growing count (the kubelet's series), not a
/// new Event, and not a dropped one.
#[tokio::test]
async fn a_repeated_warning_bumps_the_events_count() {
    let e = env();
    let (server, _kdir, client) = cloud(&e).await;
    let id = uid("nope");
    server.apply(
        "pods",
        pod("nope", &id, "127.0.0.1:5000/does-not-exist:1.0"),
    );
    put(&e.store, &server.get("pods", "rt", "nope").unwrap());
    let mut r = reconciler(&e, Some(client));
    reconcile_until(&mut r, 30, "the Event's count grows", || async {
        server
            .get("events", "rt", "nope.edgehub-errimagepull")
            .is_some_and(|ev| ev["count"].as_i64().unwrap_or(0) >= 3)
    })
    .await;
    assert_eq!(
        server.count(|q| q.verb == "create" && q.resource == "events" && q.status == 201),
        1
    );
    assert!(server.count(|q| q.verb == "patch" && q.resource == "events") >= 1);
    remove(&e.store, &server.get("pods", "rt", "nope").unwrap());
    r.reconcile().await.unwrap();
}

// ---------------------------------------------------------------------------------------------
// The real containerd, seen from beside the runtime: every call recorded with when it began
// and ended, and one ListContainers that can be held at the moment it has its answer.

/// One CRI call the runtime made.
#[derive(Debug, Clone)]
struct Call {
    method: &'static str,
    id: String,
    began: std::time::Instant,
    ended: std::time::Instant,
}

/// At the next ListContainers: told when the answer is in, and waits for the word to go on.
type Gate = (
    tokio::sync::oneshot::Sender<()>,
    tokio::sync::oneshot::Receiver<()>,
);

/// The shared containerd, every call passed on as it is.
#[derive(Clone)]
struct Watched {
    inner: CriClient,
    calls: Arc<std::sync::Mutex<Vec<Call>>>,
    gate: Arc<std::sync::Mutex<Option<Gate>>>,
}

impl Watched {
    fn new(socket: &Path) -> Watched {
        Watched {
            inner: CriClient::new(socket),
            calls: Default::default(),
            gate: Default::default(),
        }
    }

    /// Holds the next ListContainers once its answer is in: the receiver hears when, and the
    /// call returns that answer when the sender says so.
    fn hold_next_list(
        &self,
    ) -> (
        tokio::sync::oneshot::Receiver<()>,
        tokio::sync::oneshot::Sender<()>,
    ) {
        let (listed_tx, listed_rx) = tokio::sync::oneshot::channel();
        let (go_tx, go_rx) = tokio::sync::oneshot::channel();
        *self.gate.lock().unwrap() = Some((listed_tx, go_rx));
        (listed_rx, go_tx)
    }

    fn calls(&self, method: &str) -> Vec<Call> {
        let calls = self.calls.lock().unwrap();
        calls
            .iter()
            .filter(|c| c.method == method)
            .cloned()
            .collect()
    }

    async fn record<T>(
        &self,
        method: &'static str,
        id: &str,
        f: impl std::future::Future<Output = T>,
    ) -> T {
        let began = std::time::Instant::now();
        let out = f.await;
        self.calls.lock().unwrap().push(Call {
            method,
            id: id.to_string(),
            began,
            ended: std::time::Instant::now(),
        });
        out
    }
}

impl CriRuntime for Watched {
    async fn version(&self) -> Result<api::VersionResponse, edgehub::cri::CriError> {
        self.inner.version().await
    }
    async fn status(&self) -> Result<api::StatusResponse, edgehub::cri::CriError> {
        self.inner.status().await
    }
    async fn pull_image(
        &self,
        image: &str,
        auth: Option<api::AuthConfig>,
    ) -> Result<String, edgehub::cri::CriError> {
        self.record("PullImage", image, self.inner.pull_image(image, auth))
            .await
    }
    async fn image_status(
        &self,
        image: &str,
    ) -> Result<Option<api::Image>, edgehub::cri::CriError> {
        self.inner.image_status(image).await
    }
    async fn list_images(&self) -> Result<Vec<api::Image>, edgehub::cri::CriError> {
        self.inner.list_images().await
    }
    async fn remove_image(&self, image: &str) -> Result<(), edgehub::cri::CriError> {
        self.inner.remove_image(image).await
    }
    async fn run_pod_sandbox(
        &self,
        config: api::PodSandboxConfig,
    ) -> Result<String, edgehub::cri::CriError> {
        self.record("RunPodSandbox", "", self.inner.run_pod_sandbox(config))
            .await
    }
    async fn pod_sandbox_status(
        &self,
        id: &str,
    ) -> Result<Option<api::PodSandboxStatus>, edgehub::cri::CriError> {
        self.inner.pod_sandbox_status(id).await
    }
    async fn list_pod_sandbox(
        &self,
        labels: HashMap<String, String>,
    ) -> Result<Vec<api::PodSandbox>, edgehub::cri::CriError> {
        self.inner.list_pod_sandbox(labels).await
    }
    async fn stop_pod_sandbox(&self, id: &str) -> Result<(), edgehub::cri::CriError> {
        self.record("StopPodSandbox", id, self.inner.stop_pod_sandbox(id))
            .await
    }
    async fn remove_pod_sandbox(&self, id: &str) -> Result<(), edgehub::cri::CriError> {
        self.record("RemovePodSandbox", id, self.inner.remove_pod_sandbox(id))
            .await
    }
    async fn create_container(
        &self,
        sandbox_id: &str,
        config: api::ContainerConfig,
        sandbox_config: api::PodSandboxConfig,
    ) -> Result<String, edgehub::cri::CriError> {
        self.record(
            "CreateContainer",
            sandbox_id,
            self.inner
                .create_container(sandbox_id, config, sandbox_config),
        )
        .await
    }
    async fn start_container(&self, id: &str) -> Result<(), edgehub::cri::CriError> {
        self.record("StartContainer", id, self.inner.start_container(id))
            .await
    }
    async fn stop_container(
        &self,
        id: &str,
        timeout_secs: i64,
    ) -> Result<(), edgehub::cri::CriError> {
        self.record(
            "StopContainer",
            id,
            self.inner.stop_container(id, timeout_secs),
        )
        .await
    }
    async fn remove_container(&self, id: &str) -> Result<(), edgehub::cri::CriError> {
        self.record("RemoveContainer", id, self.inner.remove_container(id))
            .await
    }
    async fn reopen_container_log(&self, id: &str) -> Result<(), edgehub::cri::CriError> {
        self.inner.reopen_container_log(id).await
    }
    async fn container_status(
        &self,
        id: &str,
    ) -> Result<Option<api::ContainerStatus>, edgehub::cri::CriError> {
        self.inner.container_status(id).await
    }
    async fn list_containers(
        &self,
        labels: HashMap<String, String>,
    ) -> Result<Vec<api::Container>, edgehub::cri::CriError> {
        let out = self.inner.list_containers(labels).await;
        let gate = self.gate.lock().unwrap().take();
        if let Some((listed, go)) = gate {
            let _ = listed.send(());
            let _ = go.await;
        }
        out
    }
    async fn exec_sync(
        &self,
        id: &str,
        cmd: Vec<String>,
        timeout: Duration,
    ) -> Result<api::ExecSyncResponse, edgehub::cri::CriError> {
        self.inner.exec_sync(id, cmd, timeout).await
    }
}

fn watched_reconciler(
    e: &Env,
    cri: Watched,
    client: Option<edgehub::kube::ApiClient>,
) -> Reconciler<Watched> {
    if let Some(c) = &client {
        spawn_reporter(e, c);
    }
    let mut r = Reconciler::new(cri, e.store.clone(), client, e.data.clone(), e.node.clone());
    r.backoff = BackoffPolicy {
        initial: Duration::from_millis(300),
        max: Duration::from_secs(2),
    };
    r
}

/// The upgrade engine holds a pod while it swaps its container, and lets go between the
/// runtime's snapshot and its decision: the runtime must not decide on the snapshot taken
/// while the engine was mid-swap (no container yet), or it starts a second one beside the
/// engine's.
#[tokio::test]
async fn a_pod_the_engine_lets_go_mid_pass_is_not_decided_on_the_stale_snapshot() {
    use edgehub::pod::{desired, observe::Observer, Holder};
    let e = env();
    let _cleanup = cleanup(&e);
    let cri = CriClient::new(&e.socket);
    let id = uid("stale");
    let mut p = pod("stale", &id, "127.0.0.1:5000/busybox:1.0");
    p["spec"]["containers"][0]["command"] = json!(["sh", "-c", "while true; do sleep 1; done"]);
    put(&e.store, &p);
    let watched = Watched::new(&e.socket);
    let mut r = watched_reconciler(&e, watched.clone(), None);
    r.reconcile().await.unwrap();
    let old = running(&cri, &id).await;
    assert_eq!(old.len(), 1);

    // The engine takes the pod and removes its container: the swap's first half.
    assert!(r.locks.try_hold(&id, Holder::Upgrade));
    cri.stop_container(&old[0].id, 0).await.unwrap();
    cri.remove_container(&old[0].id).await.unwrap();
    let (listed, go) = watched.hold_next_list();
    let locks = r.locks.clone();
    let engine = async {
        // The runtime has listed the containers (none for the pod); the engine now starts
        // the new one and lets go before the runtime decides.
        listed.await.unwrap();
        let snap = Observer::default()
            .observe(&cri, &e.node, &e.data.join("pods"))
            .await
            .unwrap();
        let want = desired::read(&e.store, &snap, &e.data, &e.node, None).unwrap();
        let plan = want[0].plan.clone().unwrap().unwrap();
        let sb = snap.pod(&id).ready_sandbox().unwrap().id.clone();
        edgehub::pod::start::create_and_start(
            &cri,
            &plan.name,
            &sb,
            &plan.sandbox,
            &plan.containers[0],
            1,
        )
        .await
        .unwrap();
        locks.release(&id, Holder::Upgrade);
        go.send(()).unwrap();
    };
    let (pass, ()) = tokio::join!(r.reconcile(), engine);
    let pass = pass.unwrap();
    let now = running(&cri, &id).await;
    assert_eq!(
        (now.len(), pass.containers_started),
        (1, 0),
        "only the engine's container runs: {pass:?}"
    );
    // The next pass sees the engine's container and leaves it be.
    assert_eq!(r.reconcile().await.unwrap(), Default::default());
    assert_eq!(running(&cri, &id).await.len(), 1);
    remove(&e.store, &p);
    r.reconcile().await.unwrap();
}

/// A registry stand-in that accepts connections and never answers, counting them: each pull
/// that reached it holds one open.
async fn counting_black_hole() -> (
    u16,
    Arc<std::sync::atomic::AtomicUsize>,
    tokio::task::JoinHandle<()>,
) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let n = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = n.clone();
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = l.accept().await {
            seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            held.push(s);
        }
    });
    (port, n, task)
}

/// As many hanging pulls as the runtime runs pods' actions at once: another pod's readiness
/// probe still runs (its flip reaches the apiserver) and its killed container is still
/// restarted, both while every pull hangs. A pull waits on the registry, not on the runtime,
/// so it must not take the slot a probe or a restart needs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hanging_pulls_in_every_slot_starve_no_probe_and_no_restart() {
    let e = env();
    let _cleanup = cleanup(&e);
    let (server, _kdir, client) = cloud(&e).await;
    let (port, pulls, _hole) = counting_black_hole().await;
    let cri = CriClient::new(&e.socket);
    let live_id = uid("busy-live");
    let mut live = pod("busy-live", &live_id, "127.0.0.1:5000/busybox:1.0");
    live["spec"]["containers"][0]["command"] =
        json!(["sh", "-c", "touch /tmp/ready; while true; do sleep 1; done"]);
    live["spec"]["containers"][0]["readinessProbe"] = json!({
        "exec": {"command": ["cat", "/tmp/ready"]}, "periodSeconds": 1, "failureThreshold": 1});
    server.apply("pods", live);
    put(&e.store, &server.get("pods", "rt", "busy-live").unwrap());
    let mut r = reconciler(&e, Some(client));
    r.host_ip = Some("127.0.0.1".into());
    r.cri = Arc::new(CriClient::new(&e.socket).with_pull_deadline(Duration::from_secs(60)));
    let slots = r.parallel;
    let stop = spawn_loop(r);
    common::wait_until(30, "the live pod is Ready", || {
        ready_of(&server, "busy-live") == ("True".to_string(), true)
    })
    .await;
    let hanging: Vec<String> = (0..slots).map(|i| format!("busy-hang-{i}")).collect();
    for name in &hanging {
        let mut p = pod(name, &uid(name), &format!("127.0.0.1:{port}/{name}:1.0"));
        p["spec"]["containers"][0]["imagePullPolicy"] = json!("Always");
        server.apply("pods", p);
        put(&e.store, &server.get("pods", "rt", name).unwrap());
    }
    common::wait_until(20, "every hanging pod's pull reached the registry", || {
        pulls.load(std::sync::atomic::Ordering::SeqCst) >= slots
    })
    .await;

    // The live pod turns unready: its probe must run for the apiserver to hear it.
    let before = running(&cri, &live_id).await[0].id.clone();
    exec(&cri, &before, &["/bin/busybox", "rm", "/tmp/ready"]).await;
    common::wait_until(20, "the unready pod's status while the pulls hang", || {
        ready_of(&server, "busy-live").0 == "False"
    })
    .await;
    // Its container dies: it is back after its backoff (300 ms), not after the pulls.
    runc_kill(&e, &before);
    common::wait_until(
        20,
        "the killed container is back while the pulls hang",
        || {
            futures_now(running(&cri, &live_id))
                .iter()
                .any(|c| c.id != before)
        },
    )
    .await;
    for name in &hanging {
        let st = server.get("pods", "rt", name).unwrap()["status"].clone();
        assert!(
            !st["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["reason"] == "ErrImagePull"),
            "{name} is still pulling: {st}"
        );
    }
    drop(stop);
    for name in hanging.iter().map(String::as_str).chain(["busy-live"]) {
        remove(&e.store, &server.get("pods", "rt", name).unwrap());
    }
    reconciler(&e, None).reconcile().await.unwrap();
}

/// A pod whose containers ignore SIGTERM takes its grace period to stop: all its containers
/// wait it out together, as the kubelet stops them, not one after another.
#[tokio::test]
async fn a_pods_containers_are_stopped_together() {
    let e = env();
    let _cleanup = cleanup(&e);
    let cri = CriClient::new(&e.socket);
    let id = uid("together");
    let mut p = pod("together", &id, "127.0.0.1:5000/busybox:1.0");
    // PID 1 without a handler: SIGTERM does nothing, so each stop waits out the grace period.
    let c = json!({"name": "a", "image": "127.0.0.1:5000/busybox:1.0",
        "command": ["sh", "-c", "while true; do sleep 1; done"]});
    let mut c2 = c.clone();
    c2["name"] = json!("b");
    p["spec"]["containers"] = json!([c, c2]);
    p["spec"]["terminationGracePeriodSeconds"] = json!(2);
    put(&e.store, &p);
    let watched = Watched::new(&e.socket);
    let mut r = watched_reconciler(&e, watched.clone(), None);
    r.reconcile().await.unwrap();
    assert_eq!(running(&cri, &id).await.len(), 2);

    remove(&e.store, &p);
    let pass = r.reconcile().await.unwrap();
    assert_eq!(pass.pods_removed, 1, "{pass:?}");
    assert!(common::containers_of(&cri, &id).await.is_empty());
    let stops = watched.calls("StopContainer");
    assert_eq!(stops.len(), 2, "{stops:?}");
    assert_ne!(stops[0].id, stops[1].id, "one stop per container");
    let (first, second) = if stops[0].began <= stops[1].began {
        (&stops[0], &stops[1])
    } else {
        (&stops[1], &stops[0])
    };
    assert!(
        second.began < first.ended,
        "the second stop began {:?} after the first ended: one grace period after the other",
        second.began.duration_since(first.ended)
    );
    eprintln!(
        "two containers ignoring SIGTERM, grace 2 s: stopped in {:?}",
        stops.iter().map(|c| c.ended).max().unwrap() - first.began
    );
}

/// Unmounts a test's tmpfs when dropped (lazily: containerd may still hold a log open).
struct Unmount(PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

/// An [`Env`] whose data dir (the store, the pods' directories and logs) is a tmpfs of
/// `size_kib`, so a test can fill it.
fn env_on_tmpfs(size_kib: u64) -> (Env, Unmount) {
    let socket = common::cri_stack();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let st = std::process::Command::new("mount")
        .args([
            "-t",
            "tmpfs",
            "-o",
            &format!("size={size_kib}k,mode=0700"),
            "tmpfs",
        ])
        .arg(&data)
        .status()
        .expect("mount runs");
    assert!(st.success(), "mounting a tmpfs needs root");
    let unmount = Unmount(data.clone());
    let store = Arc::new(Store::open(&data.join("edgehub.db"), OpenMode::Normal).unwrap());
    let node = uid("node");
    store
        .set_cursor(&edgehub::sync::pods_cursor_key(&node), "1")
        .unwrap();
    (
        Env {
            node,
            socket,
            _dir: dir,
            data,
            store,
        },
        unmount,
    )
}

/// Fills the file system of `dir` to the last byte; returns the file that holds it.
fn fill(dir: &Path) -> PathBuf {
    use std::io::Write;
    let path = dir.join("filler");
    let mut f = std::fs::File::create(&path).unwrap();
    for chunk in [1 << 20, 4096, 1] {
        let buf = vec![0u8; chunk];
        while f.write_all(&buf).is_ok() {}
    }
    let _ = f.sync_all();
    path
}

fn outbox_reasons(db: &Path) -> Vec<String> {
    let conn =
        rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .unwrap();
    let mut stmt = conn
        .prepare("SELECT body FROM outbox WHERE kind = 'event'")
        .unwrap();
    stmt.query_map([], |r| r.get::<_, String>(0))
        .unwrap()
        .filter_map(Result::ok)
        .filter_map(|b| serde_json::from_str::<Value>(&b).ok())
        .map(|v| v["reason"].as_str().unwrap_or("").to_string())
        .collect()
}

fn restarts_reported(server: &edgehub_testsupport::FakeApiServer, name: &str) -> i64 {
    server.get("pods", "rt", name).unwrap()["status"]["containerStatuses"][0]["restartCount"]
        .as_i64()
        .unwrap_or(0)
}

/// The data dir's file system is full, so the store can write nothing: a crashing container
/// is still restarted and a failing liveness probe still kills, though a third pod's new
/// status (it completed) cannot be queued; the reports (the Unhealthy Event, the restart
/// counts, the completion) reach the apiserver once there is space again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_stops_no_restart_and_no_liveness_kill() {
    let (e, _unmount) = env_on_tmpfs(8 * 1024);
    let _cleanup = cleanup(&e);
    let (server, _kdir, client) = cloud(&e).await;
    let cri = CriClient::new(&e.socket);
    let (crash_id, sick_id) = (uid("full-crash"), uid("full-sick"));
    let mut crash = pod("full-crash", &crash_id, "127.0.0.1:5000/busybox:1.0");
    crash["spec"]["containers"][0]["command"] = json!(["sh", "-c", "sleep 1; exit 3"]);
    let mut sick = pod("full-sick", &sick_id, "127.0.0.1:5000/busybox:1.0");
    sick["spec"]["containers"][0]["command"] = json!(["sh", "-c", "while true; do sleep 1; done"]);
    sick["spec"]["containers"][0]["livenessProbe"] = json!({
        "exec": {"command": ["sh", "-c", "[ ! -e /tmp/sick ]"]}, "periodSeconds": 1, "failureThreshold": 2});
    let done_id = uid("full-done");
    let mut done = pod("full-done", &done_id, "127.0.0.1:5000/busybox:1.0");
    done["spec"]["restartPolicy"] = json!("Never");
    done["spec"]["containers"][0]["command"] =
        json!(["sh", "-c", "while [ ! -e /tmp/done ]; do sleep 1; done"]);
    for p in [crash, sick, done] {
        let name = p["metadata"]["name"].as_str().unwrap().to_string();
        server.apply("pods", p);
        put(&e.store, &server.get("pods", "rt", &name).unwrap());
    }
    let mut r = reconciler(&e, Some(client));
    r.host_ip = Some("127.0.0.1".into());
    let stop = spawn_loop(r);
    common::wait_until(30, "the pods run and the crashes are reported", || {
        futures_now(running(&cri, &sick_id)).len() == 1
            && futures_now(running(&cri, &done_id)).len() == 1
            && restarts_reported(&server, "full-crash") >= 1
    })
    .await;

    // The disk fills. SQLite would reuse the WAL's space for a while: it goes first.
    let db = e.data.join("edgehub.db");
    let conn = rusqlite::Connection::open(&db).unwrap();
    conn.busy_timeout(Duration::from_secs(5)).unwrap();
    conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
        .unwrap();
    drop(conn);
    let filler = fill(&e.data);
    assert!(
        e.store.set_cursor("full-disk-test", "1").is_err(),
        "the store can write nothing"
    );
    let attempt_of = |id: &str| {
        futures_now(common::containers_of(&cri, id))
            .iter()
            .map(|c| c.metadata.as_ref().unwrap().attempt)
            .max()
            .unwrap_or(0)
    };
    let crashed_before = attempt_of(&crash_id);
    // A pod completes: its status is owed from now on.
    let finishing = running(&cri, &done_id).await[0].id.clone();
    exec(&cri, &finishing, &["/bin/busybox", "touch", "/tmp/done"]).await;
    common::wait_until(
        30,
        "the crashing container is restarted while the disk is full",
        || attempt_of(&crash_id) >= crashed_before + 2,
    )
    .await;
    let sick_before = running(&cri, &sick_id).await[0].id.clone();
    exec(&cri, &sick_before, &["sh", "-c", "echo > /tmp/sick"]).await;
    common::wait_until(
        30,
        "the failing liveness probe kills while the disk is full",
        || {
            futures_now(running(&cri, &sick_id))
                .iter()
                .any(|c| c.id != sick_before)
        },
    )
    .await;
    assert!(
        e.store.set_cursor("full-disk-test", "1").is_err(),
        "the disk was full all along"
    );
    assert!(
        !outbox_reasons(&db).iter().any(|r| r == "Unhealthy"),
        "nothing reached the store meanwhile"
    );
    let reported = restarts_reported(&server, "full-crash");

    // Space again: the reports follow.
    std::fs::remove_file(&filler).unwrap();
    common::wait_until(30, "the Unhealthy Event reaches the apiserver", || {
        server
            .get("events", "rt", "full-sick.edgehub-unhealthy")
            .is_some()
    })
    .await;
    common::wait_until(
        30,
        "the restarts and the completion reach the apiserver",
        || {
            restarts_reported(&server, "full-sick") >= 1
                && restarts_reported(&server, "full-crash") > reported
                && server.get("pods", "rt", "full-done").unwrap()["status"]["phase"] == "Succeeded"
        },
    )
    .await;
    drop(stop);
    for n in ["full-crash", "full-sick", "full-done"] {
        remove(&e.store, &server.get("pods", "rt", n).unwrap());
    }
    reconciler(&e, None).reconcile().await.unwrap();
}
