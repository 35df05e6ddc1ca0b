//! What pods reference, fetched from a real (fake) apiserver over TLS into a real SQLite file:
//! the Node authorizer's rules, token renewal, pruning, and offline behaviour.

mod common;

use edgehub::object::Kind;
use edgehub::sources::fetch::Fetcher;
use edgehub::store::{CachedToken, Change, OpenMode, Store, StoredObject};
use edgehub_testsupport::FakeApiServer;
use std::sync::Arc;
use std::time::Duration;

struct Env {
    server: FakeApiServer,
    store: Arc<Store>,
    fetcher: Fetcher,
    _dirs: (tempfile::TempDir, tempfile::TempDir),
}

async fn env() -> Env {
    let server = FakeApiServer::start().await.unwrap();
    server.seed_recorded_cluster();
    let kdir = tempfile::tempdir().unwrap();
    let kc = server
        .write_kubeconfig(kdir.path(), edgehub_testsupport::NODE_TOKEN)
        .unwrap();
    let data = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open(&data.path().join("edgehub.db"), OpenMode::Normal).unwrap());
    for p in server.list("pods") {
        let obj = StoredObject::from_raw(Kind::Pod, p.to_string()).unwrap();
        store
            .apply(Kind::Pod, &[Change::Upsert(obj)], None)
            .unwrap();
    }
    let client = common::client(&common::test_config(data.path(), &kc));
    let mut fetcher = Fetcher::new(client, store.clone());
    fetcher.refresh = Duration::ZERO;
    fetcher.retry = Duration::ZERO;
    Env {
        server,
        store,
        fetcher,
        _dirs: (kdir, data),
    }
}

async fn refresh(e: &mut Env) -> edgehub::sources::fetch::FetchStats {
    let pods = e.store.list(Kind::Pod).unwrap();
    let refs = edgehub::sources::fetch::pod_references(&pods);
    e.fetcher.refresh(&refs).await.unwrap()
}

fn token_posts(s: &FakeApiServer) -> usize {
    s.count(|q| q.method == "POST" && q.path.ends_with("/token"))
}

fn uid_of(s: &FakeApiServer, name: &str) -> String {
    s.get("pods", "vehicle", name).unwrap()["metadata"]["uid"]
        .as_str()
        .unwrap()
        .to_string()
}

#[tokio::test]
async fn the_recorded_pods_sources_are_fetched_by_name_and_tokens_renewed_late() {
    let mut e = env().await;
    let st = refresh(&mut e).await;
    // Three ConfigMaps shared by both pods, fetched once each per pass; one token per pod.
    assert_eq!(
        (st.fetched, st.tokens, st.failed, st.offline),
        (6, 2, 0, false),
        "{st:?}"
    );
    assert_eq!(st.changed, 3);
    let cm = e
        .store
        .get_source("configmaps", "vehicle", "telemetry-cfg")
        .unwrap()
        .unwrap();
    assert!(cm.raw.unwrap().contains("level=info"));
    // By name only: the Node authorizer refuses lists.
    assert_eq!(
        e.server
            .count(|q| q.path.ends_with("/configmaps") || q.path.ends_with("/secrets")),
        0
    );
    let sv = uid_of(&e.server, "telemetry-sv74m");
    let t = e.store.get_token(&sv, "", 3607).unwrap().unwrap();
    assert_eq!(t.token, "fake-token-for-telemetry-sv74m");
    assert!(t.expires_ms - t.issued_ms > 3_500_000, "{t:?}");

    // Unchanged objects are not rewritten, and tokens are not asked for again.
    let st = refresh(&mut e).await;
    assert_eq!((st.changed, st.tokens), (0, 0));
    assert_eq!(token_posts(&e.server), 2);

    // Past 80 % of its life, the token is renewed.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    e.store
        .put_token(&CachedToken {
            issued_ms: now - 3_000_000,
            expires_ms: now + 607_000,
            ..t
        })
        .unwrap();
    let st = refresh(&mut e).await;
    assert_eq!(st.tokens, 1);
    assert_eq!(token_posts(&e.server), 3);
    let renewed = e.store.get_token(&sv, "", 3607).unwrap().unwrap();
    assert!(renewed.issued_ms >= now);
}

#[tokio::test]
async fn offline_keeps_the_cache_and_gone_pods_take_their_sources_with_them() {
    let mut e = env().await;
    refresh(&mut e).await;
    e.server.set_offline(true).await.unwrap();
    let st = refresh(&mut e).await;
    assert!(st.offline);
    assert!(e
        .store
        .get_source("configmaps", "vehicle", "telemetry-cfg")
        .unwrap()
        .is_some());
    e.server.set_offline(false).await.unwrap();

    // The gateway pod goes: its token goes; the ConfigMaps stay, the telemetry pod uses them.
    let gw = uid_of(&e.server, "gateway-v9hb2");
    e.store
        .apply(
            Kind::Pod,
            &[Change::Delete {
                namespace: "vehicle".into(),
                name: "gateway-v9hb2".into(),
            }],
            None,
        )
        .unwrap();
    refresh(&mut e).await;
    assert!(e.store.get_token(&gw, "", 3607).unwrap().is_none());
    assert_eq!(e.store.source_keys().unwrap().len(), 3);

    // An object the apiserver does not have is remembered as absent; one the node may not
    // read (not referenced by any of its pods on the server's side) is a failure, retried.
    e.server.remove("configmaps", "vehicle", "telemetry-cfg");
    let st = refresh(&mut e).await;
    assert_eq!(st.failed, 0);
    let cm = e
        .store
        .get_source("configmaps", "vehicle", "telemetry-cfg")
        .unwrap()
        .unwrap();
    assert_eq!(cm.raw, None);
    e.server.remove("pods", "vehicle", "telemetry-sv74m");
    e.server.remove("pods", "vehicle", "gateway-v9hb2");
    let st = refresh(&mut e).await;
    assert_eq!((st.fetched, st.failed), (0, 3), "{st:?}");
    assert!(
        e.server
            .count(|q| q.status == 403 && q.path.contains("/configmaps/"))
            >= 3
    );
}
