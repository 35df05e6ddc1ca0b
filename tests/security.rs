//! What edgehub keeps on the device's flash, and who can read it: the modes of the files and
//! directories of its data dir, and Secrets and service-account tokens sealed with the device
//! key, on real SQLite files, with real containers (scripts/cri-stack.sh; needs root, and
//! fails loudly without it).

mod common;
#[path = "common/edge.rs"]
mod edge;

use common::{exec, running};
use edgehub::cri::{labels, CriClient, CriRuntime};
use edgehub::object::Kind;
use edgehub::runtime::{BackoffPolicy, Reconciler};
use edgehub::store::{
    CachedSource, CachedToken, Change, DeviceKey, KeySource, OpenMode, Store, StoredObject,
};
use serde_json::json;
use std::collections::HashMap;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

fn with_suffix(p: &Path, suffix: &str) -> PathBuf {
    let mut s = p.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

/// A data dir as a crash leaves it after someone with umask 022 touched it (a `sqlite3`
/// session, a restore from a backup): the directory 0755, the database, its WAL and its
/// shared-memory index 0644. Reopened, edgehub makes every one of them its own again before
/// it writes a byte, and the files SQLite creates afterwards are 0600 too.
#[test]
fn a_reopened_data_dir_is_0700_and_every_store_file_0600() {
    let tmp = tempfile::tempdir().unwrap();
    let live = tmp.path().join("live/edgehub.db");
    let store = Store::open(&live, OpenMode::Normal).unwrap();
    store.set_cursor("pods?fieldSelector=x", "1").unwrap();
    // The crash image: the files as they are while the store is open (the WAL holds the
    // commit; SQLite removes it at a clean close).
    let data = tmp.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let db = data.join("edgehub.db");
    for suffix in ["", "-wal", "-shm"] {
        let from = with_suffix(&live, suffix);
        assert!(from.exists(), "{} exists while open", from.display());
        std::fs::copy(&from, with_suffix(&db, suffix)).unwrap();
    }
    drop(store);
    for p in [
        db.clone(),
        with_suffix(&db, "-wal"),
        with_suffix(&db, "-shm"),
    ] {
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o755)).unwrap();

    let store = Store::open(&db, OpenMode::Normal).unwrap();
    assert_eq!(
        store.cursor("pods?fieldSelector=x").unwrap().as_deref(),
        Some("1"),
        "the crash image's commit survived"
    );
    assert_eq!(mode(&data), 0o700, "the data dir");
    for suffix in ["", "-wal", "-shm"] {
        let p = with_suffix(&db, suffix);
        if p.exists() {
            assert_eq!(mode(&p), 0o600, "{}", p.display());
        }
    }
    // What SQLite creates from here on: a WAL after a clean close, written again.
    drop(store);
    let store = Store::open(&db, OpenMode::Normal).unwrap();
    store.set_cursor("pods?fieldSelector=x", "2").unwrap();
    for suffix in ["", "-wal", "-shm"] {
        let p = with_suffix(&db, suffix);
        assert!(p.exists(), "{} exists while open", p.display());
        assert_eq!(mode(&p), 0o600, "{}", p.display());
    }
}

/// A Secret value, as its base64 appears in the Secret's JSON.
const SECRET_B64: &str = "aHVudGVyMi1kby1ub3Qtc3RvcmUtaW4tdGhlLWNsZWFy";
const SECRET_TEXT: &str = "hunter2-do-not-store-in-the-clear";

fn key(byte: u8) -> DeviceKey {
    DeviceKey::from_bytes(&[byte; 32], KeySource::File(format!("/keys/{byte}").into())).unwrap()
}

/// Every byte of the database, its WAL and its index, and of any moved-aside copy of them.
fn data_dir_bytes(data: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    std::fs::read_dir(data)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("edgehub.db"))
        })
        .map(|p| {
            let b = std::fs::read(&p).unwrap();
            (p, b)
        })
        .collect()
}

/// The files of `data` that hold `needle`.
fn files_holding(data: &Path, needle: &str) -> Vec<PathBuf> {
    data_dir_bytes(data)
        .into_iter()
        .filter(|(_, b)| b.windows(needle.len()).any(|w| w == needle.as_bytes()))
        .map(|(p, _)| p)
        .collect()
}

fn secret_row(ns: &str) -> CachedSource {
    CachedSource {
        kind: "secrets".into(),
        namespace: ns.into(),
        name: "creds".into(),
        raw: Some(
            json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "creds", "namespace": ns},
                "data": {"pw": SECRET_B64}})
            .to_string(),
        ),
        fetched_ms: 1,
    }
}

fn token_row(uid: &str, token: &str) -> CachedToken {
    CachedToken {
        pod_uid: uid.into(),
        audience: String::new(),
        expiration_secs: 3607,
        token: token.into(),
        issued_ms: 1,
        expires_ms: 4_000_000_000_000,
    }
}

/// Sets the file's schema version beyond this edgehub's, so that `--reset-cache` moves it
/// aside (as it would a corrupt file).
fn make_too_new(db: &Path) {
    let c = rusqlite::Connection::open(db).unwrap();
    c.pragma_update(None, "user_version", 999).unwrap();
}

/// With a device key, the file holds no Secret value and no token in the clear: not the
/// database, not its WAL, and not the copy `--reset-cache` moves aside; they read back
/// through the key, and a Secret fetched again unchanged is not rewritten. Without a key
/// they are in the clear, and a moved-aside copy is scrubbed of them.
#[test]
fn sealed_secrets_and_tokens_are_nowhere_in_the_files_in_the_clear() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let db = data.join("edgehub.db");
    let token = "eyJhbGciOiJSUzI1NiJ9.sealed-token-for-pod-a.sig";

    let store = Store::open_with(&db, OpenMode::Normal, Some(key(1))).unwrap();
    assert!(store.put_source(&secret_row("ns")).unwrap());
    store.put_token(&token_row("uid-a", token)).unwrap();
    assert!(
        !store.put_source(&secret_row("ns")).unwrap(),
        "an unchanged Secret is not rewritten"
    );
    // While open: the commits are in the WAL.
    assert_eq!(files_holding(&data, token), Vec::<PathBuf>::new());
    assert_eq!(files_holding(&data, SECRET_B64), Vec::<PathBuf>::new());
    let st = store.seal_status().unwrap();
    assert_eq!(
        (st.counts.sealed, st.counts.clear, st.counts.unreadable),
        (2, 0, 0)
    );
    assert_eq!(st.key.as_deref(), Some("file /keys/1"));
    let back = store.get_source("secrets", "ns", "creds").unwrap().unwrap();
    assert!(back.raw.unwrap().contains(SECRET_B64));
    assert_eq!(
        store.get_token("uid-a", "", 3607).unwrap().unwrap().token,
        token
    );
    drop(store);
    assert_eq!(files_holding(&data, token), Vec::<PathBuf>::new());

    // A moved-aside copy keeps them sealed.
    make_too_new(&db);
    let store = Store::open_with(&db, OpenMode::ResetCache, Some(key(1))).unwrap();
    drop(store);
    let aside: Vec<_> = data_dir_bytes(&data)
        .into_iter()
        .filter(|(p, _)| p.to_string_lossy().contains(".bad-"))
        .collect();
    assert!(!aside.is_empty(), "the file was moved aside");
    assert_eq!(files_holding(&data, token), Vec::<PathBuf>::new());
    assert_eq!(files_holding(&data, SECRET_B64), Vec::<PathBuf>::new());

    // Without a key they are in the clear (edgehub says so at start and in its status) ...
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let db = data.join("edgehub.db");
    let store = Store::open(&db, OpenMode::Normal).unwrap();
    store.put_source(&secret_row("ns")).unwrap();
    store.put_token(&token_row("uid-a", token)).unwrap();
    let st = store.seal_status().unwrap();
    assert_eq!((st.key, st.counts.clear), (None, 2));
    drop(store);
    assert!(!files_holding(&data, token).is_empty());
    // ... but a copy moved aside keeps none of them.
    make_too_new(&db);
    drop(Store::open(&db, OpenMode::ResetCache).unwrap());
    assert_eq!(files_holding(&data, token), Vec::<PathBuf>::new());
    assert_eq!(files_holding(&data, SECRET_B64), Vec::<PathBuf>::new());
}

/// A cache written before the device key was configured is sealed when edgehub next opens it
/// with the key, and the WAL that held the clear frames is emptied: no byte of the files
/// holds them afterwards (secure_delete zeroes the old cells).
#[test]
fn a_cache_from_before_the_key_is_sealed_when_it_opens_with_one() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let db = data.join("edgehub.db");
    let token = "eyJhbGciOiJSUzI1NiJ9.clear-token-for-pod-b.sig";
    let store = Store::open(&db, OpenMode::Normal).unwrap();
    store.put_source(&secret_row("ns")).unwrap();
    store.put_token(&token_row("uid-b", token)).unwrap();
    drop(store);
    assert!(!files_holding(&data, token).is_empty());

    let store = Store::open_with(&db, OpenMode::Normal, Some(key(1))).unwrap();
    assert_eq!(
        files_holding(&data, token),
        Vec::<PathBuf>::new(),
        "sealed, and no clear copy left in the file or its WAL"
    );
    assert_eq!(files_holding(&data, SECRET_B64), Vec::<PathBuf>::new());
    assert_eq!(
        store.get_token("uid-b", "", 3607).unwrap().unwrap().token,
        token
    );
    assert_eq!(store.seal_status().unwrap().counts.sealed, 2);
}

/// Without a key (and for rows an old key sealed), what a renewal replaces and what a
/// dropped pod or Secret leaves behind does not linger in freed cells or overflow pages:
/// `secure_delete` zeroes them, so once the WAL is checkpointed at close no byte of the
/// files holds the old token or the deleted Secret, while the renewed token is there.
#[test]
fn a_renewed_token_and_a_deleted_secret_leave_no_bytes_in_freed_pages() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let db = data.join("edgehub.db");
    // As long as real bound tokens (1.1 KB), and a Secret larger than a page, so that its
    // value sits in overflow pages.
    let long = |tag: &str| format!("eyJhbGciOiJSUzI1NiJ9.{tag}.{}", "x".repeat(1100));
    let (old, new, gone) = (
        long("old-token"),
        long("renewed-token"),
        long("dropped-pod"),
    );
    let big_secret = format!("{SECRET_B64}{}", "QUJD".repeat(2000));
    let mut secret = secret_row("big");
    secret.raw = Some(
        json!({"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": "creds", "namespace": "big"}, "data": {"pw": big_secret}})
        .to_string(),
    );

    let store = Store::open(&db, OpenMode::Normal).unwrap();
    store.put_token(&token_row("uid-keep", &old)).unwrap();
    store.put_token(&token_row("uid-gone", &gone)).unwrap();
    store.put_source(&secret).unwrap();
    drop(store);
    assert!(
        !files_holding(&data, &old).is_empty(),
        "in the clear: no key"
    );
    assert!(!files_holding(&data, &big_secret[..200]).is_empty());

    let store = Store::open(&db, OpenMode::Normal).unwrap();
    store.put_token(&token_row("uid-keep", &new)).unwrap();
    assert_eq!(store.retain_tokens(&["uid-keep"]).unwrap(), 1);
    store.delete_source("secrets", "big", "creds").unwrap();
    drop(store);
    assert!(
        !files_holding(&data, &new).is_empty(),
        "the renewed token is kept"
    );
    assert_eq!(files_holding(&data, &old), Vec::<PathBuf>::new(), "renewed");
    assert_eq!(
        files_holding(&data, &gone),
        Vec::<PathBuf>::new(),
        "pod dropped"
    );
    assert_eq!(
        files_holding(&data, &big_secret[..200]),
        Vec::<PathBuf>::new(),
        "Secret deleted"
    );
}

/// Another key (a rotation, the wrong file) is not a crash: the store opens, says how many
/// rows it cannot read, and they read as not cached, so they are fetched again; written
/// again, they are sealed with the new key.
#[test]
fn another_key_opens_the_store_and_reads_the_old_rows_as_not_cached() {
    let tmp = tempfile::tempdir().unwrap();
    let db = tmp.path().join("data/edgehub.db");
    let store = Store::open_with(&db, OpenMode::Normal, Some(key(1))).unwrap();
    store.put_source(&secret_row("ns")).unwrap();
    store.put_token(&token_row("uid-c", "t1")).unwrap();
    drop(store);
    for other in [Some(key(2)), None] {
        let store = Store::open_with(&db, OpenMode::Normal, other).unwrap();
        assert_eq!(store.seal_status().unwrap().counts.unreadable, 2);
        assert_eq!(store.get_source("secrets", "ns", "creds").unwrap(), None);
        assert_eq!(store.get_token("uid-c", "", 3607).unwrap(), None);
    }
    let store = Store::open_with(&db, OpenMode::Normal, Some(key(2))).unwrap();
    assert!(
        store.put_source(&secret_row("ns")).unwrap(),
        "fetched again"
    );
    store.put_token(&token_row("uid-c", "t2")).unwrap();
    let st = store.seal_status().unwrap();
    assert_eq!((st.counts.sealed, st.counts.unreadable), (2, 0));
    assert_eq!(
        store.get_token("uid-c", "", 3607).unwrap().unwrap().token,
        "t2"
    );
}

fn uid(tag: &str) -> String {
    let n = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("sec-{tag}-{}-{}", std::process::id(), n % 1_000_000_000)
}

/// The node's edgehub, as far as pods are concerned: the store (with a key, or none), the
/// fetcher of what pods reference, and the runtime.
struct Edge {
    store: Arc<Store>,
    stop_fetcher: tokio::sync::watch::Sender<bool>,
    fetcher: Option<tokio::task::JoinHandle<()>>,
    runtime: Reconciler<CriClient>,
}

impl Edge {
    fn start(
        db: &Path,
        key: Option<DeviceKey>,
        client: &edgehub::kube::ApiClient,
        socket: &Path,
        node: &str,
    ) -> Edge {
        let store = Arc::new(Store::open_with(db, OpenMode::Normal, key).unwrap());
        // As after a first sync: the cache has seen the node's pod list.
        store
            .set_cursor(&edgehub::sync::pods_cursor_key(node), "1")
            .unwrap();
        let mut f = edgehub::sources::fetch::Fetcher::new(client.clone(), store.clone());
        f.refresh = Duration::from_millis(200);
        f.retry = Duration::from_millis(200);
        let (stop_fetcher, rx) = tokio::sync::watch::channel(false);
        let fetcher = Some(tokio::spawn(f.run(rx)));
        let mut runtime = Reconciler::new(
            CriClient::new(socket),
            store.clone(),
            Some(client.clone()),
            db.parent().unwrap().to_path_buf(),
            node.to_string(),
        );
        runtime.backoff = BackoffPolicy {
            initial: Duration::from_millis(300),
            max: Duration::from_secs(2),
        };
        Edge {
            store,
            stop_fetcher,
            fetcher,
            runtime,
        }
    }

    /// Stops, as a power cut would leave it: the store is closed.
    async fn stop(mut self) {
        let _ = self.stop_fetcher.send(true);
        if let Some(f) = self.fetcher.take() {
            f.await.unwrap();
        }
        let Edge { store, runtime, .. } = self;
        drop(runtime);
        assert_eq!(Arc::strong_count(&store), 1, "nothing else holds the store");
    }

    /// Reconciles until `f` holds, or fails after `secs`.
    async fn until<F, Fut>(&mut self, secs: u64, what: &str, mut f: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let deadline = std::time::Instant::now() + Duration::from_secs(secs);
        loop {
            self.runtime.reconcile().await.unwrap();
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
}

/// A reboot: every sandbox of the pod is gone, and its tmpfs volumes with them.
async fn reboot(cri: &CriClient, uid: &str, data: &Path) {
    for sb in cri
        .list_pod_sandbox(HashMap::from([(
            labels::POD_UID.to_string(),
            uid.to_string(),
        )]))
        .await
        .unwrap()
    {
        cri.stop_pod_sandbox(&sb.id).await.unwrap();
        cri.remove_pod_sandbox(&sb.id).await.unwrap();
    }
    edgehub::volumes::remove_pod_dir(&data.join("pods").join(uid).join("volumes")).unwrap();
}

/// The whole story with real containers and the device key: a pod with a Secret volume and a
/// service-account token runs; the database file holds neither in the clear; after a
/// reboot without a link the pod comes back and reads both from its volumes, opened from the
/// sealed cache; after a reboot with another key (a rotation), edgehub starts, the pod waits
/// for what it cannot read, and once the link is back both are fetched again, sealed with the
/// new key, and the pod runs.
#[tokio::test]
async fn a_pod_reads_its_secret_and_token_after_an_offline_reboot_with_encryption_on() {
    let socket = common::cri_stack();
    let node = uid("node");
    let _cleanup = common::NodeCleanup {
        node: node.clone(),
        socket: socket.clone(),
    };
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let db = data.join("edgehub.db");
    let server = edgehub_testsupport::FakeApiServer::start().await.unwrap();
    let kc = server
        .write_kubeconfig(&dir.path().join("kube"), edgehub_testsupport::NODE_TOKEN)
        .unwrap();
    let client = common::client(&common::test_config(&data, &kc));
    let cri = CriClient::new(&socket);
    let pod_uid = uid("pod");
    let name = format!("sealed-{}", std::process::id());
    let pod = json!({
        "metadata": {"name": name, "namespace": "sec", "uid": pod_uid, "resourceVersion": "1",
            "labels": {"controller-revision-hash": "h1"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "ds", "uid": "ds-uid", "controller": true}]},
        "spec": {
            "nodeName": "edge-1", "hostNetwork": true, "terminationGracePeriodSeconds": 1,
            "serviceAccountName": "default",
            "volumes": [
                {"name": "creds", "secret": {"secretName": "creds"}},
                {"name": "tok", "projected": {"sources": [
                    {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}}]}}],
            "containers": [{"name": "app", "image": "127.0.0.1:5000/busybox:1.0",
                "imagePullPolicy": "IfNotPresent",
                "volumeMounts": [{"name": "creds", "mountPath": "/creds"},
                                 {"name": "tok", "mountPath": "/var/run/secrets/tok"}]}]
        },
        "status": {"phase": "Pending"}
    });
    server.apply("pods", pod.clone());
    server.apply(
        "secrets",
        json!({"metadata": {"name": "creds", "namespace": "sec"}, "data": {"pw": SECRET_B64}}),
    );
    let token = format!("fake-token-for-{name}");
    let reads = |id: String| {
        let cri = cri.clone();
        async move {
            (
                exec(&cri, &id, &["cat", "/creds/pw"]).await,
                exec(&cri, &id, &["cat", "/var/run/secrets/tok/token"]).await,
            )
        }
    };

    let mut edge = Edge::start(&db, Some(key(1)), &client, &socket, &node);
    let obj = StoredObject::from_raw(
        Kind::Pod,
        server.get("pods", "sec", &name).unwrap().to_string(),
    )
    .unwrap();
    edge.store
        .apply(Kind::Pod, &[Change::Upsert(obj)], None)
        .unwrap();
    edge.until(60, "the pod runs", || async {
        running(&cri, &pod_uid).await.len() == 1
    })
    .await;
    let app = running(&cri, &pod_uid).await.remove(0);
    assert_eq!(
        reads(app.id).await,
        (SECRET_TEXT.to_string(), token.clone())
    );
    assert_eq!(
        edge.store.seal_status().unwrap().counts.sealed,
        2,
        "the Secret and the token are cached sealed"
    );
    // The file, as flash holds it now: neither in the clear.
    assert_eq!(files_holding(&data, &token), Vec::<PathBuf>::new());
    assert_eq!(files_holding(&data, SECRET_B64), Vec::<PathBuf>::new());
    edge.stop().await;

    // A reboot without a link.
    server.set_offline(true).await.unwrap();
    reboot(&cri, &pod_uid, &data).await;
    let mut edge = Edge::start(&db, Some(key(1)), &client, &socket, &node);
    edge.until(60, "the pod is back offline", || async {
        running(&cri, &pod_uid).await.len() == 1
    })
    .await;
    let app = running(&cri, &pod_uid).await.remove(0);
    assert_eq!(
        reads(app.id).await,
        (SECRET_TEXT.to_string(), token.clone()),
        "opened from the sealed cache"
    );
    edge.stop().await;

    // A reboot with another key, still offline: edgehub starts, and the pod waits.
    reboot(&cri, &pod_uid, &data).await;
    let mut edge = Edge::start(&db, Some(key(2)), &client, &socket, &node);
    assert_eq!(edge.store.seal_status().unwrap().counts.unreadable, 2);
    let pass = edge.runtime.reconcile().await.unwrap();
    assert_eq!(
        pass.missing.len(),
        1,
        "the pod waits for its Secret: {pass:?}"
    );
    assert!(running(&cri, &pod_uid).await.is_empty());
    // The link returns: both are fetched again and sealed with the new key.
    server.set_offline(false).await.unwrap();
    edge.until(60, "the pod runs with what was fetched again", || async {
        running(&cri, &pod_uid).await.len() == 1
    })
    .await;
    let app = running(&cri, &pod_uid).await.remove(0);
    let (pw, tok) = reads(app.id).await;
    assert_eq!(pw, SECRET_TEXT);
    assert!(tok.starts_with("fake-token-for-"), "{tok}");
    let st = edge.store.seal_status().unwrap();
    assert_eq!((st.counts.sealed, st.counts.unreadable), (2, 0));
    assert_eq!(files_holding(&data, SECRET_B64), Vec::<PathBuf>::new());
    edge.stop().await;
}

const BIN: &str = env!("CARGO_BIN_EXE_edgehub");

/// The inodes of the TCP sockets in LISTEN state on this host (IPv4 and IPv6).
fn listening_inodes() -> Vec<String> {
    let mut out = Vec::new();
    for f in ["/proc/net/tcp", "/proc/net/tcp6"] {
        for line in std::fs::read_to_string(f)
            .unwrap_or_default()
            .lines()
            .skip(1)
        {
            let cols: Vec<&str> = line.split_whitespace().collect();
            if cols.len() > 9 && cols[3] == "0A" {
                out.push(cols[9].to_string());
            }
        }
    }
    out
}

/// Whether process `pid` holds a listening TCP socket.
fn listens_on_tcp(pid: u32) -> bool {
    let listening = listening_inodes();
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| {
            l.to_str()?
                .strip_prefix("socket:[")?
                .strip_suffix(']')
                .map(str::to_string)
        })
        .any(|inode| listening.contains(&inode))
}

/// `edgehub run` as the device runs it with TCP off: `edgehub status` reaches it over the unix
/// socket and says how Secrets and tokens are kept: sealed with a key file, from a systemd
/// credential, or not at all (also said at start); and with the wrong key edgehub keeps
/// running, logs what it cannot read, and counts it in its status.
#[tokio::test]
async fn edgehub_status_over_the_socket_says_how_secrets_are_kept() {
    let server = edgehub_testsupport::FakeApiServer::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kc = server
        .write_kubeconfig(&dir.path().join("kube"), edgehub_testsupport::NODE_TOKEN)
        .unwrap();
    let data = dir.path().join("data");
    let sock = dir.path().join("run/api.sock");
    let write_key = |name: &str, byte: u8| {
        let p = dir.path().join(name);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, [byte; 32]).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        p
    };
    let key1 = write_key("keys/one", 1);
    let key2 = write_key("keys/two", 2);
    write_key("creds/edgehub-seal-key", 1);
    // What an earlier run cached, sealed with key one.
    let store = Store::open_with(
        &data.join("edgehub.db"),
        OpenMode::Normal,
        Some(DeviceKey::read(&key1, KeySource::File(key1.clone())).unwrap()),
    )
    .unwrap();
    store.put_source(&secret_row("ns")).unwrap();
    store.put_token(&token_row("uid-d", "t1")).unwrap();
    // The pod that needs them (the fetcher drops what no cached pod references). The link is
    // down throughout, so the cache stays as it is.
    let pod = json!({
        "metadata": {"name": "p", "namespace": "ns", "uid": "uid-d", "resourceVersion": "1"},
        "spec": {"nodeName": "edge-1", "volumes": [
            {"name": "creds", "secret": {"secretName": "creds"}},
            {"name": "tok", "projected": {"sources": [
                {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}}]}}],
            "containers": [{"name": "app", "image": "127.0.0.1:5000/busybox:1.0"}]}
    });
    store
        .apply(
            Kind::Pod,
            &[Change::Upsert(
                StoredObject::from_raw(Kind::Pod, pod.to_string()).unwrap(),
            )],
            None,
        )
        .unwrap();
    drop(store);
    server.set_offline(true).await.unwrap();
    let config = dir.path().join("config.toml");
    let write_config = |seal: &str| {
        std::fs::write(
            &config,
            format!(
                "node_name = \"edge-1\"\napi_addr = \"none\"\ndata_dir = \"{}\"\nkubeconfig = \"{}\"\ncri_socket = \"{}\"\n[api]\nsocket = \"{}\"\nsocket_mode = \"0600\"\n{seal}",
                data.display(),
                kc.display(),
                dir.path().join("no-cri.sock").display(),
                sock.display()
            ),
        )
        .unwrap()
    };
    let run = |creds: Option<&Path>| {
        let log = std::fs::File::create(dir.path().join("edgehub.log")).unwrap();
        let mut c = std::process::Command::new(BIN);
        c.arg("--config").arg(&config).arg("run");
        c.env_remove("CREDENTIALS_DIRECTORY");
        if let Some(d) = creds {
            c.env("CREDENTIALS_DIRECTORY", d);
        }
        c.stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap()
    };
    let status = || {
        let out = std::process::Command::new(BIN)
            .arg("--config")
            .arg(&config)
            .arg("status")
            .env_remove("CREDENTIALS_DIRECTORY")
            .output()
            .unwrap();
        (
            out.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        )
    };
    let status_when_up = |child: &mut std::process::Child| {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            assert!(
                child.try_wait().unwrap().is_none(),
                "edgehub exited: {}",
                std::fs::read_to_string(dir.path().join("edgehub.log")).unwrap_or_default()
            );
            let (ok, out) = status();
            if ok {
                return out;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "edgehub status never answered: {out}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    let stop = |mut child: std::process::Child| {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        assert!(child.wait().unwrap().success());
        std::fs::read_to_string(dir.path().join("edgehub.log")).unwrap()
    };

    // The wrong key: edgehub runs, and says what it cannot read.
    write_config(&format!("[seal]\nkey_file = \"{}\"\n", key2.display()));
    let mut child = run(None);
    let out = status_when_up(&mut child);
    assert!(
        out.contains(&format!(
            "secrets: sealed with the device key (file {})",
            key2.display()
        )) && out.contains("2 unreadable (sealed with another key; fetched again once online)"),
        "{out}"
    );
    assert!(!listens_on_tcp(child.id()), "TCP is off");
    let log = stop(child);
    assert!(log.contains("sealed with another device key"), "{log}");

    // The key as a systemd credential, which comes before the key file.
    let mut child = run(Some(&dir.path().join("creds")));
    let out = status_when_up(&mut child);
    assert!(
        out.contains(
            "secrets: sealed with the device key (systemd credential edgehub-seal-key): 2 sealed"
        ) && !out.contains("unreadable"),
        "{out}"
    );
    stop(child);

    // No key at all: said at start and in the status.
    write_config("");
    let mut child = run(None);
    let out = status_when_up(&mut child);
    assert!(out.contains("secrets: NOT sealed, no device key"), "{out}");
    let log = stop(child);
    assert!(log.contains("no device key"), "{log}");

    // A key file that is configured and missing is an error at start, naming it.
    let missing = dir.path().join("keys/missing");
    write_config(&format!("[seal]\nkey_file = \"{}\"\n", missing.display()));
    let mut child = run(None);
    let code = child.wait().unwrap();
    assert!(!code.success());
    let log = std::fs::read_to_string(dir.path().join("edgehub.log")).unwrap();
    assert!(
        log.contains(&format!("device key file {}", missing.display())),
        "{log}"
    );
}

/// What the container `app` of the node's telemetry pod finds in its service-account volume:
/// the token, the cluster's CA and the namespace, once all three are there.
async fn wait_for_service_account_files(n: &edge::Node) -> String {
    n.wait_for(90, "the app runs", |n| async move {
        !n.running("app").await.is_empty()
    })
    .await;
    let dir = "/var/run/secrets/kubernetes.io/serviceaccount";
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let app = n.running("app").await.remove(0);
        let last = exec(
            &n.cri,
            &app.id,
            &["sh", "-c", &format!("ls {dir}; cat {dir}/token")],
        )
        .await;
        if [
            "token",
            "ca.crt",
            "namespace",
            "fake-token-for-telemetry-sv74m",
        ]
        .iter()
        .all(|w| last.contains(w))
        {
            return last;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the container's {dir} holds: {last:?}\nedgehub log:\n{}",
            n.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `edgehub run` for node `n`, wrapped in `wrapper` (a command and its arguments).
fn start_wrapped(n: &mut edge::Node, wrapper: &[&str]) {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(n.dir.path().join("edgehub.log"))
        .unwrap();
    let mut cmd = std::process::Command::new(wrapper[0]);
    cmd.args(&wrapper[1..])
        .arg(BIN)
        .arg("--config")
        .arg(&n.config)
        .arg("run")
        .stdout(std::process::Stdio::null())
        .stderr(log);
    n.child = Some(cmd.spawn().unwrap());
}

fn mount_ns(pid: &str) -> PathBuf {
    std::fs::read_link(format!("/proc/{pid}/ns/mnt")).unwrap()
}

/// The mount namespace systemd gives a unit with `PrivateTmp=` or `ProtectSystem=` (the
/// shipped unit had both): edgehub under `unshare --mount --propagation slave`, containerd
/// outside it. The tmpfs of the pod's token volume was edgehub's alone, and containerd
/// bind-mounted the empty directory under it. Now edgehub finds containerd's namespace
/// (the peer of the CRI socket), says so, and attaches the volume's tmpfs there too: the
/// container reads its token, CA and namespace; and an edgehub restarted in a fresh
/// namespace takes the running pod's tmpfs over, so the token it renews reaches it.
#[tokio::test]
async fn under_the_namespace_systemd_gave_the_unit_the_container_reads_its_token() {
    let mut n = edge::node("mntns").await;
    start_wrapped(
        &mut n,
        &["unshare", "--mount", "--propagation", "slave", "--"],
    );
    let pid = n.child.as_ref().unwrap().id().to_string();
    let files = wait_for_service_account_files(&n).await;
    assert_ne!(
        mount_ns(&pid),
        mount_ns("self"),
        "edgehub ran in a mount namespace of its own"
    );
    assert!(files.contains("fake-token-for-telemetry-sv74m"), "{files}");
    assert!(
        n.log()
            .contains("edgehub runs in another mount namespace than the container runtime"),
        "said at the first volume: {}",
        n.log()
    );
    let app = n.running("app").await.remove(0).id;

    // A restart, in a new namespace: the running container keeps its volume, and the new
    // edgehub takes that tmpfs over (rather than mounting a new one the container never
    // sees), so what it writes there from now on (renewed tokens) reaches the container.
    n.kill9();
    start_wrapped(
        &mut n,
        &["unshare", "--mount", "--propagation", "slave", "--"],
    );
    let new_pid = n.child.as_ref().unwrap().id().to_string();
    let volumes = n.dir.path().join("data/pods").join(&n.uid).join("volumes");
    let token_dir = find_dir(&volumes, edgehub::volumes::TOKEN_VOLUME_PREFIX)
        .unwrap_or_else(|| panic!("no token volume under {}", volumes.display()));
    let dev = |p: &Path| std::fs::metadata(p).ok().map(|m| m.dev());
    let theirs =
        PathBuf::from(format!("/proc/{new_pid}/root")).join(token_dir.strip_prefix("/").unwrap());
    n.wait_for(
        30,
        "the new edgehub, in its namespace, has the running pod's tmpfs",
        |_| {
            let (a, b) = (dev(&token_dir), dev(&theirs));
            let apart = std::fs::read_link(format!("/proc/{new_pid}/ns/mnt")).ok()
                != Some(mount_ns("self"));
            async move { apart && a.is_some() && a == b }
        },
    )
    .await;
    std::fs::write(theirs.join("written-by-the-new-edgehub"), "x").unwrap();
    let seen = exec(
        &n.cri,
        &app,
        &["ls", "/var/run/secrets/kubernetes.io/serviceaccount"],
    )
    .await;
    assert!(seen.contains("written-by-the-new-edgehub"), "{seen}");
    n.clean().await;
}

/// The first directory under `root` whose name starts with `prefix`.
fn find_dir(root: &Path, prefix: &str) -> Option<PathBuf> {
    for e in std::fs::read_dir(root).ok()?.flatten() {
        let p = e.path();
        if !p.is_dir() {
            continue;
        }
        if e.file_name().to_string_lossy().starts_with(prefix) {
            return Some(p);
        }
        if let Some(found) = find_dir(&p, prefix) {
            return Some(found);
        }
    }
    None
}

/// The same pod with edgehub as the fixed unit runs it, in the host's mount namespace.
#[tokio::test]
async fn in_the_hosts_namespace_the_container_reads_its_token() {
    let mut n = edge::node("hostns").await;
    n.start();
    let pid = n.child.as_ref().unwrap().id().to_string();
    wait_for_service_account_files(&n).await;
    assert_eq!(mount_ns(&pid), mount_ns("self"));
    assert!(!n.log().contains("another mount namespace"), "{}", n.log());
    n.clean().await;
}
