//! Keeps the cache of what pods reference current while the link is up, and reads it back.
//!
//! A node may read the ConfigMaps and Secrets its pods reference one by one (the Node
//! authorizer refuses plain lists) and create tokens for its pods' service accounts. The
//! ConfigMaps and Secrets are kept current the way the kubelet's watch-based manager does it:
//! a list narrowed to the object (`fieldSelector=metadata.name=<name>`, which the authorizer
//! treats as a read of that object), then a watch from that version. An idle watch costs no
//! request until the server ends it (30 to 60 minutes here), where polling every object every
//! minute cost one request per object per minute. Tokens are renewed after 80 % of their
//! lifetime, as the kubelet does, and a node's tokens together, in one write
//! ([`tokens_to_renew`]).
//!
//! Right after a pod is bound, the Node authorizer may not know yet that it references an
//! object and answers 403 "no relationship found"; that is retried quietly every 250 ms for
//! its first two seconds, instead of waiting out a long retry. Offline, the cache is used as
//! it is.

mod tokens;

use tokens::WantedToken;
pub use tokens::{token_due, token_request, tokens_to_renew};

use super::{decode_data, references, Data, SourceRef, Sources};
use crate::backoff::Backoff;
use crate::kube::resource::{CONFIGMAPS, SECRETS, SERVICE_ACCOUNTS};
use crate::kube::{ApiClient, KubeError, ListParams, Resource, WatchEvent};
use crate::object::ObjectIndex;
use crate::store::{CachedSource, CachedToken, Store, StoreError, StoredObject};
use serde_json::Value;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;

/// What one refresh did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct FetchStats {
    /// ConfigMaps and Secrets read (found or not found) to start their watch.
    pub fetched: usize,
    /// Of those, the ones whose cached copy changed.
    pub changed: usize,
    pub tokens: usize,
    pub failed: usize,
    /// The pass stopped because the apiserver could not be reached.
    pub offline: bool,
}

type Key = (String, String, String);

/// When a failed source is tried again.
#[derive(Debug)]
struct Retry {
    at: Instant,
    backoff: Backoff,
}

pub struct Fetcher {
    client: ApiClient,
    store: Arc<Store>,
    /// The longest wait before a failed read or token request is tried again.
    pub retry: Duration,
    /// The first wait after the Node authorizer's "no relationship found" (it doubles).
    pub lag_retry: Duration,
    /// How often tokens are checked for renewal when nothing else wakes the fetcher.
    pub refresh: Duration,
    /// The watch keeping each referenced ConfigMap and Secret current.
    watches: HashMap<Key, JoinHandle<()>>,
    retries: HashMap<Key, Retry>,
    /// Failures already logged, so a refused reference warns once, not every pass.
    warned: HashSet<Key>,
}

fn resource(kind: &str) -> &'static Resource {
    if kind == "secrets" {
        &SECRETS
    } else {
        &CONFIGMAPS
    }
}

fn by_name(name: &str) -> ListParams {
    ListParams {
        field_selector: Some(format!("metadata.name={name}")),
        label_selector: None,
    }
}

/// Stores what a list or watch said of one object; returns whether the cache changed.
fn put(store: &Store, key: &Key, raw: Option<String>) -> Result<bool, StoreError> {
    store.put_source(&CachedSource {
        kind: key.0.clone(),
        namespace: key.1.clone(),
        name: key.2.clone(),
        raw,
        fetched_ms: crate::time::now_ms(),
    })
}

/// Reads one object through a list narrowed to its name: the object (or `None`, absent) and
/// the version to watch from.
async fn read_one(client: &ApiClient, key: &Key) -> Result<(Option<String>, String), KubeError> {
    let page = client
        .list(resource(&key.0), Some(&key.1), &by_name(&key.2), None, None)
        .await?;
    Ok((page.items.into_iter().next(), page.resource_version))
}

/// Keeps one object current from `rv` on: watches, re-watches when the server ends a watch,
/// reads it again after a 410, and backs off while the link is down. Ends when the apiserver
/// refuses it (the pod that referenced it is gone) or the task is aborted.
async fn keep_current(client: ApiClient, store: Arc<Store>, key: Key, mut rv: String) {
    let mut backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(30));
    loop {
        // Like the apiserver's own default: a long, random timeout spreads re-watches.
        let timeout = fastrand::u32(1800..3600);
        let mut stream = match client
            .watch(
                resource(&key.0),
                Some(&key.1),
                &by_name(&key.2),
                &rv,
                timeout,
            )
            .await
        {
            Ok(s) => s,
            Err(e) if e.is_offline() || e.retry_after().is_some() => {
                tokio::time::sleep(crate::kube::delay_after(&e, &mut backoff)).await;
                continue;
            }
            Err(e) if e.is_expired() => match read_one(&client, &key).await {
                Ok((raw, next)) => {
                    store_logged(&store, &key, raw);
                    rv = next;
                    continue;
                }
                Err(e) => {
                    tracing::debug!(kind = %key.0, namespace = %key.1, name = %key.2, error = %e, "source watch ends");
                    return;
                }
            },
            Err(e) => {
                tracing::debug!(kind = %key.0, namespace = %key.1, name = %key.2, error = %e, "source watch ends");
                return;
            }
        };
        loop {
            match stream.next().await {
                Ok(Some(WatchEvent::Added(raw) | WatchEvent::Modified(raw))) => {
                    backoff.reset();
                    if let Some(v) = rv_of(&raw) {
                        rv = v;
                    }
                    store_logged(&store, &key, Some(raw));
                }
                Ok(Some(WatchEvent::Deleted(raw))) => {
                    if let Some(v) = rv_of(&raw) {
                        rv = v;
                    }
                    store_logged(&store, &key, None);
                }
                Ok(Some(WatchEvent::Bookmark {
                    resource_version, ..
                })) => rv = resource_version,
                Ok(Some(WatchEvent::Error(st))) if st.code == 410 => {
                    // Too old: read it again and watch from there.
                    match read_one(&client, &key).await {
                        Ok((raw, next)) => {
                            store_logged(&store, &key, raw);
                            rv = next;
                        }
                        Err(_) => tokio::time::sleep(backoff.next_delay()).await,
                    }
                    break;
                }
                Ok(Some(WatchEvent::Error(_) | WatchEvent::Malformed { .. })) => {}
                Ok(None) => break,
                Err(_) => {
                    tokio::time::sleep(backoff.next_delay()).await;
                    break;
                }
            }
        }
    }
}

fn rv_of(raw: &str) -> Option<String> {
    serde_json::from_str::<Value>(raw)
        .ok()?
        .pointer("/metadata/resourceVersion")?
        .as_str()
        .map(str::to_string)
}

fn store_logged(store: &Store, key: &Key, raw: Option<String>) {
    match put(store, key, raw) {
        Ok(true) => {
            tracing::info!(kind = %key.0, namespace = %key.1, name = %key.2, "pod source changed")
        }
        Ok(false) => {}
        Err(e) => tracing::warn!(kind = %key.0, namespace = %key.1, name = %key.2, error = %e,
            "cannot cache a pod source"),
    }
}

impl Fetcher {
    /// Refreshes on every cache change, when a retry or token check is due, until shutdown.
    /// It runs beside the pod runtime, which reads only the cache: a dead or blackholed link
    /// never delays a pod start, and what is fetched wakes the runtime through the store.
    pub async fn run(mut self, mut shutdown: tokio::sync::watch::Receiver<bool>) {
        let mut changes = self.store.subscribe();
        let mut offline = false;
        let mut wait = Duration::ZERO;
        let mut known = References::default();
        loop {
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                r = changes.changed() => { if r.is_err() { break; } }
                _ = shutdown.changed() => break,
            }
            // Only the pods' indexes and references stay for the refresh, which awaits the
            // apiserver: the pods' JSON is read a few at a time and dropped, and parsed only
            // when it changed (the fetcher wakes on every change of the cache, mostly its own
            // writes and other objects', and on every token check).
            let mut refs = Vec::new();
            let mut seen = HashSet::new();
            let read = self
                .store
                .for_each_chunk(crate::object::Kind::Pod, 16, |pods| {
                    refs.extend(known.of(pods, &mut seen))
                });
            known.retain(&seen);
            if let Err(e) = read {
                tracing::warn!(error = %e, "cannot read the cached pods");
                wait = self.refresh;
                continue;
            }
            match self.refresh(&refs).await {
                Ok(st) => {
                    if st.offline != offline {
                        tracing::debug!(offline = st.offline, "pod sources fetcher");
                        offline = st.offline;
                    }
                }
                Err(e) => tracing::warn!(error = %e, "cannot cache what pods reference"),
            }
            wait = self.next_wake();
        }
        for (_, w) in self.watches.drain() {
            w.abort();
        }
    }

    pub fn new(client: ApiClient, store: Arc<Store>) -> Fetcher {
        Fetcher {
            client,
            store,
            retry: Duration::from_secs(10),
            lag_retry: Duration::from_millis(250),
            refresh: Duration::from_secs(60),
            watches: HashMap::new(),
            retries: HashMap::new(),
            warned: HashSet::new(),
        }
    }

    /// How long until something is due: the earliest retry, else the token check.
    fn next_wake(&self) -> Duration {
        let now = Instant::now();
        self.retries
            .values()
            .map(|r| r.at.saturating_duration_since(now))
            .min()
            .unwrap_or(self.refresh)
            .min(self.refresh)
    }

    fn due(&self, key: &Key) -> bool {
        self.retries.get(key).is_none_or(|r| Instant::now() >= r.at)
    }

    fn succeeded(&mut self, key: &Key) {
        self.retries.remove(key);
        self.warned.remove(key);
    }

    fn failed(&mut self, key: Key, e: &KubeError) {
        let lag = e.is_authorizer_lag();
        let (lag_retry, retry) = (self.lag_retry, self.retry);
        let r = self.retries.entry(key.clone()).or_insert_with(|| Retry {
            at: Instant::now(),
            backoff: Backoff::steady(crate::backoff::BackoffPolicy {
                initial: if lag { lag_retry } else { retry },
                max: retry,
            }),
        });
        let wait = r.backoff.next_delay();
        // The authorizer catches up with a new pod within moments: every `lag_retry` for its
        // first couple of seconds, quietly, then the usual backoff.
        let early = lag && r.backoff.failures() <= 8;
        r.at = Instant::now() + if early { lag_retry } else { wait };
        let quiet = early;
        if !quiet && self.warned.insert(key.clone()) {
            tracing::warn!(kind = %key.0, namespace = %key.1, name = %key.2, error = %e,
                "cannot fetch what a pod references; retrying");
        } else {
            tracing::debug!(kind = %key.0, namespace = %key.1, name = %key.2, error = %e,
                "pod source not readable yet; retrying");
        }
    }

    /// Starts keeping what the given pods reference current (a read, then a watch, per
    /// ConfigMap and Secret), renews tokens that are due, then drops cached sources and
    /// tokens no cached pod references any more.
    pub async fn refresh(
        &mut self,
        pods: &[(ObjectIndex, Vec<SourceRef>)],
    ) -> Result<FetchStats, StoreError> {
        let mut st = FetchStats::default();
        let mut referenced: HashSet<Key> = HashSet::new();
        let mut uids = Vec::new();
        let mut tokens = Vec::new();
        for (pod, refs) in pods {
            uids.push(pod.uid.as_str());
            let ns = &pod.namespace;
            for r in refs {
                match &r {
                    SourceRef::ConfigMap { name } | SourceRef::Secret { name } => {
                        let key: Key = (r.kind().into(), ns.clone(), name.clone());
                        referenced.insert(key.clone());
                        let watched = self.watches.get(&key).is_some_and(|w| !w.is_finished());
                        if st.offline || pod.deleting || watched || !self.due(&key) {
                            continue;
                        }
                        match read_one(&self.client, &key).await {
                            Ok((raw, rv)) => {
                                st.fetched += 1;
                                if put(&self.store, &key, raw)? {
                                    st.changed += 1;
                                    tracing::info!(kind = %key.0, namespace = %key.1, name = %key.2, "pod source cached");
                                }
                                self.succeeded(&key);
                                let task = tokio::spawn(keep_current(
                                    self.client.clone(),
                                    self.store.clone(),
                                    key.clone(),
                                    rv,
                                ));
                                if let Some(old) = self.watches.insert(key, task) {
                                    old.abort();
                                }
                            }
                            Err(e) if e.is_offline() => st.offline = true,
                            Err(e) => {
                                st.failed += 1;
                                self.failed(key, &e);
                            }
                        }
                    }
                    SourceRef::Token {
                        service_account,
                        audience,
                        expiration_secs,
                    } => {
                        if !pod.deleting {
                            tokens.push(WantedToken {
                                pod,
                                service_account,
                                audience,
                                expiration_secs: *expiration_secs,
                            });
                        }
                    }
                }
            }
        }
        if !st.offline {
            self.renew_tokens(&tokens, &mut st).await?;
        }
        // Hygiene: Secrets and tokens of pods that are gone leave the disk, and their watches
        // end.
        for key in self.store.source_keys()? {
            if !referenced.contains(&key) {
                self.store.delete_source(&key.0, &key.1, &key.2)?;
            }
        }
        self.watches.retain(|k, w| {
            let keep = referenced.contains(k);
            if !keep {
                w.abort();
            }
            keep
        });
        self.retries
            .retain(|k, _| k.0 == "token" || referenced.contains(k));
        self.store.retain_tokens(&uids)?;
        Ok(st)
    }
}

/// What each cached pod references, remembered by a digest of its JSON, so a pass parses only
/// the pods that changed since the last.
#[derive(Debug, Default)]
pub struct References {
    by_uid: HashMap<String, (u64, Option<Vec<SourceRef>>)>,
    /// Pods parsed so far.
    pub parsed: usize,
}

impl References {
    /// What `pods` (a chunk of the cache) reference, beside their indexes, like
    /// [`pod_references`]; their uids are added to `seen`.
    pub fn of(
        &mut self,
        pods: Vec<StoredObject>,
        seen: &mut HashSet<String>,
    ) -> Vec<(ObjectIndex, Vec<SourceRef>)> {
        use std::hash::{Hash, Hasher};
        let mut out = Vec::with_capacity(pods.len());
        for p in pods {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            p.raw.hash(&mut h);
            let digest = h.finish();
            seen.insert(p.index.uid.clone());
            let refs = match self.by_uid.get(&p.index.uid) {
                Some((d, refs)) if *d == digest => refs.clone(),
                _ => {
                    self.parsed += 1;
                    let refs = serde_json::from_str::<Value>(&p.raw)
                        .ok()
                        .map(|v| references(&v));
                    self.by_uid
                        .insert(p.index.uid.clone(), (digest, refs.clone()));
                    refs
                }
            };
            if let Some(refs) = refs {
                out.push((p.index, refs));
            }
        }
        out
    }

    /// Forgets the pods that are no longer cached.
    pub fn retain(&mut self, seen: &HashSet<String>) {
        self.by_uid.retain(|uid, _| seen.contains(uid));
    }
}

/// What each pod references, beside its index. Each pod is parsed and dropped in turn: a
/// parsed 5 KB pod is about 45 KB of `Value`, and holding 100 of them at once was most of
/// edgehub's peak heap. The JSON goes too: the refresh that follows awaits the apiserver,
/// and 1000 pods' JSON held meanwhile was 5.5 MB.
pub fn pod_references(pods: Vec<StoredObject>) -> Vec<(ObjectIndex, Vec<SourceRef>)> {
    pods.into_iter()
        .filter_map(|p| {
            let refs = serde_json::from_str::<Value>(&p.raw)
                .ok()
                .map(|v| references(&v))?;
            Some((p.index, refs))
        })
        .collect()
}

/// The pod's sources as cached. A cached object that cannot be decoded counts as unknown
/// (and is logged): the pod waits rather than running with half its configuration.
pub fn load(store: &Store, pod: &StoredObject, raw: &Value) -> Result<Sources, StoreError> {
    let mut out = Sources::default();
    let ns = &pod.index.namespace;
    for r in references(raw) {
        match &r {
            SourceRef::ConfigMap { name } | SourceRef::Secret { name } => {
                let Some(row) = store.get_source(r.kind(), ns, name)? else {
                    continue;
                };
                let data: Option<Data> = match &row.raw {
                    None => None,
                    Some(text) => match decode_data(r.kind(), text) {
                        Ok(d) => Some(d),
                        Err(e) => {
                            tracing::warn!(kind = r.kind(), namespace = %ns, name = %name, error = %e, "cached object cannot be read");
                            continue;
                        }
                    },
                };
                let map = if r.kind() == "secrets" {
                    &mut out.secrets
                } else {
                    &mut out.configmaps
                };
                map.insert(name.clone(), data);
            }
            SourceRef::Token {
                audience,
                expiration_secs,
                ..
            } => {
                if let Some(t) = store.get_token(&pod.index.uid, audience, *expiration_secs)? {
                    out.tokens
                        .insert((audience.clone(), *expiration_secs), t.token);
                }
            }
        }
    }
    Ok(out)
}
