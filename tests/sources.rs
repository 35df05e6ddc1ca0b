//! What pods reference, fetched from a real (fake) apiserver over TLS into a real SQLite file:
//! the Node authorizer's rules and lag, watches that keep objects current, token renewal,
//! pruning, and offline behaviour.

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
    client: edgehub::kube::ApiClient,
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
    let mut fetcher = Fetcher::new(client.clone(), store.clone());
    fetcher.refresh = Duration::ZERO;
    fetcher.retry = Duration::ZERO;
    Env {
        server,
        store,
        fetcher,
        client,
        _dirs: (kdir, data),
    }
}

async fn refresh(e: &mut Env) -> edgehub::sources::fetch::FetchStats {
    let pods = e.store.list(Kind::Pod).unwrap();
    let refs = edgehub::sources::fetch::pod_references(pods);
    e.fetcher.refresh(&refs).await.unwrap()
}

/// Lists of ConfigMaps or Secrets not narrowed to one name: the Node authorizer refuses them.
fn plain_lists(s: &FakeApiServer) -> usize {
    s.count(|q| {
        (q.path.ends_with("/configmaps") || q.path.ends_with("/secrets"))
            && !q
                .query
                .get("fieldSelector")
                .is_some_and(|f| f.starts_with("metadata.name="))
    })
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
async fn the_recorded_pods_sources_are_watched_by_name_and_tokens_renewed_late() {
    let mut e = env().await;
    let st = refresh(&mut e).await;
    // Three ConfigMaps shared by both pods, read once each and then watched; one token per
    // pod.
    assert_eq!(
        (st.fetched, st.tokens, st.failed, st.offline),
        (3, 2, 0, false),
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
    assert_eq!(plain_lists(&e.server), 0);
    let sv = uid_of(&e.server, "telemetry-sv74m");
    let t = e.store.get_token(&sv, "", 3607).unwrap().unwrap();
    assert_eq!(t.token, "fake-token-for-telemetry-sv74m");
    assert!(t.expires_ms - t.issued_ms > 3_500_000, "{t:?}");

    // Unchanged objects are not read again (their watches keep them current), and tokens
    // are not asked for again.
    let st = refresh(&mut e).await;
    assert_eq!((st.fetched, st.changed, st.tokens), (0, 0, 0));
    assert_eq!(token_posts(&e.server), 2);
    // An edit arrives through the watch, with no new read.
    let lists = e.server.count(|q| q.verb == "list");
    e.server
        .modify("configmaps", "vehicle", "telemetry-cfg", |c| {
            c["data"]["app.conf"] = serde_json::json!("level=trace\n")
        });
    common::wait_until(5, "the edit is cached", || {
        e.store
            .get_source("configmaps", "vehicle", "telemetry-cfg")
            .unwrap()
            .unwrap()
            .raw
            .unwrap()
            .contains("level=trace")
    })
    .await;
    assert_eq!(e.server.count(|q| q.verb == "list"), lists);

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

    // Once one token is due, the others past 40 % of their life are renewed with it, and
    // all of them are stored in one write (one commit on flash).
    let gw = uid_of(&e.server, "gateway-v9hb2");
    let g = e.store.get_token(&gw, "", 3607).unwrap().unwrap();
    e.store
        .put_token(&CachedToken {
            issued_ms: now - 3_000_000,
            expires_ms: now + 607_000,
            ..renewed
        })
        .unwrap();
    e.store
        .put_token(&CachedToken {
            issued_ms: now - 1_500_000,
            expires_ms: now + 2_107_000,
            ..g.clone()
        })
        .unwrap();
    let changes = e.store.subscribe();
    let before = *changes.borrow();
    let st = refresh(&mut e).await;
    assert_eq!(st.tokens, 2, "{st:?}");
    assert_eq!(token_posts(&e.server), 5);
    assert_eq!(
        changes.borrow().wrapping_sub(before),
        1,
        "one write for both"
    );
    for uid in [&sv, &gw] {
        assert!(e.store.get_token(uid, "", 3607).unwrap().unwrap().issued_ms >= now);
    }
    // A token at 30 % of its life is left alone when nothing else is due.
    e.store
        .put_token(&CachedToken {
            issued_ms: now - 1_000_000,
            expires_ms: now + 2_607_000,
            ..g
        })
        .unwrap();
    assert_eq!(refresh(&mut e).await.tokens, 0);
    assert_eq!(token_posts(&e.server), 5);
}

#[tokio::test]
async fn offline_keeps_the_cache_and_gone_pods_take_their_sources_with_them() {
    let mut e = env().await;
    refresh(&mut e).await;
    e.server.set_offline(true).await.unwrap();
    refresh(&mut e).await;
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
    common::wait_until(10, "the deletion is cached as absent", || {
        e.store
            .get_source("configmaps", "vehicle", "telemetry-cfg")
            .unwrap()
            .is_some_and(|c| c.raw.is_none())
    })
    .await;
    // The pods leave the server: once their watches end, reading again is refused.
    e.server.remove("pods", "vehicle", "telemetry-sv74m");
    e.server.remove("pods", "vehicle", "gateway-v9hb2");
    e.server.drop_connections();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let st = refresh(&mut e).await;
    assert_eq!((st.fetched, st.failed), (0, 3), "{st:?}");
    assert!(
        e.server
            .count(|q| q.status == 403 && q.path.contains("/configmaps"))
            >= 3
    );
}

/// Right after a pod is bound the Node authorizer answers 403 for what it references; the
/// fetcher retries within a second instead of waiting out its long retry.
#[tokio::test]
async fn the_authorizers_lag_is_retried_quickly() {
    let e = env().await;
    e.server.set_authorizer_lag(Duration::from_millis(1500));
    // The only pod that references the ConfigMaps is one bound just now (the fake counts
    // the lag from here).
    e.server.remove("pods", "vehicle", "gateway-v9hb2");
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
    e.server.modify("pods", "vehicle", "telemetry-sv74m", |p| {
        p["metadata"]["uid"] = serde_json::json!("fresh-uid")
    });
    for p in e.server.list("pods") {
        e.store
            .apply(
                Kind::Pod,
                &[Change::Upsert(
                    StoredObject::from_raw(Kind::Pod, p.to_string()).unwrap(),
                )],
                None,
            )
            .unwrap();
    }
    let start = std::time::Instant::now();
    let (tx, rx) = tokio::sync::watch::channel(false);
    // As `edgehub run` has it: a 10 s retry, a quick one for the authorizer's lag.
    let fetcher = Fetcher::new(e.client.clone(), e.store.clone());
    assert_eq!(fetcher.retry, Duration::from_secs(10));
    let task = tokio::spawn(fetcher.run(rx));
    common::wait_until(6, "the ConfigMap is cached", || {
        e.store
            .get_source("configmaps", "vehicle", "telemetry-cfg")
            .unwrap()
            .is_some()
    })
    .await;
    let took = start.elapsed();
    assert!(e.server.count(|q| q.status == 403) >= 1, "the lag was hit");
    eprintln!("ConfigMap cached {took:?} after the pod arrived (authorizer lag 1.5 s)");
    tx.send(true).unwrap();
    task.await.unwrap();
}
