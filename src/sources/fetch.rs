//! Keeps the cache of what pods reference fresh while the link is up, and reads it back.
//!
//! A node may GET the ConfigMaps and Secrets its pods reference (one by one: the Node
//! authorizer refuses lists) and create tokens for its pods' service accounts. Each is
//! fetched when a pod first needs it and then every `refresh`; tokens are renewed after 80 %
//! of their lifetime, as the kubelet does. Failures are retried after `retry`. Offline, the
//! pass stops at the first request and the cache is used as it is.

use super::{decode_data, references, Data, SourceRef, Sources};
use crate::kube::resource::{CONFIGMAPS, SECRETS, SERVICE_ACCOUNTS};
use crate::kube::{ApiClient, KubeError};
use crate::store::{CachedSource, CachedToken, Store, StoreError, StoredObject};
use serde_json::Value;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What one refresh did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct FetchStats {
    /// ConfigMaps and Secrets fetched (found or not found).
    pub fetched: usize,
    /// Of those, the ones whose cached copy changed.
    pub changed: usize,
    pub tokens: usize,
    pub failed: usize,
    /// The pass stopped because the apiserver could not be reached.
    pub offline: bool,
}

type Key = (String, String, String);

pub struct Fetcher {
    client: ApiClient,
    store: Arc<Store>,
    pub refresh: Duration,
    pub retry: Duration,
    /// When each source was last tried, and whether that worked.
    attempts: HashMap<Key, (Instant, bool)>,
    /// Failures already logged, so a refused reference warns once, not every pass.
    warned: HashSet<Key>,
}

/// Whether a token issued at `issued_ms` and valid until `expires_ms` should be renewed.
/// A clock that went backwards (a device without a real-time clock, before NTP) makes the
/// record meaningless, so it is renewed too.
pub fn token_due(now_ms: i64, issued_ms: i64, expires_ms: i64) -> bool {
    let life = (expires_ms - issued_ms).max(0);
    now_ms < issued_ms || now_ms >= issued_ms + life * 8 / 10 || now_ms >= expires_ms
}

/// The TokenRequest body for a pod's projected token.
pub fn token_request(pod: &StoredObject, audience: &str, expiration_secs: i64) -> Value {
    let mut spec = serde_json::json!({
        "expirationSeconds": expiration_secs,
        "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": pod.index.name, "uid": pod.index.uid},
    });
    if !audience.is_empty() {
        spec["audiences"] = serde_json::json!([audience]);
    }
    serde_json::json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec})
}

impl Fetcher {
    /// Refreshes on every cache change and at least every `retry`, until shutdown. It runs
    /// beside the pod runtime, which reads only the cache: a dead or blackholed link never
    /// delays a pod start, and what is fetched wakes the runtime through the store.
    pub async fn run(mut self, mut shutdown: tokio::sync::watch::Receiver<bool>) {
        let mut changes = self.store.subscribe();
        let mut tick =
            tokio::time::interval(self.retry.min(self.refresh).max(Duration::from_millis(100)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut offline = false;
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                r = changes.changed() => { if r.is_err() { return; } }
                _ = shutdown.changed() => return,
            }
            let pods = match self.store.list(crate::object::Kind::Pod) {
                Ok(p) => p,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read the cached pods");
                    continue;
                }
            };
            let refs = pod_references(&pods);
            match self.refresh(&refs).await {
                Ok(st) => {
                    if st.offline != offline {
                        tracing::debug!(offline = st.offline, "pod sources fetcher");
                        offline = st.offline;
                    }
                }
                Err(e) => tracing::warn!(error = %e, "cannot cache what pods reference"),
            }
        }
    }

    pub fn new(client: ApiClient, store: Arc<Store>) -> Fetcher {
        Fetcher {
            client,
            store,
            refresh: Duration::from_secs(60),
            retry: Duration::from_secs(10),
            attempts: HashMap::new(),
            warned: HashSet::new(),
        }
    }

    fn due(&self, key: &Key) -> bool {
        match self.attempts.get(key) {
            None => true,
            Some((at, ok)) => at.elapsed() >= if *ok { self.refresh } else { self.retry },
        }
    }

    fn failed(&mut self, key: Key, e: &KubeError) {
        if self.warned.insert(key.clone()) {
            tracing::warn!(kind = %key.0, namespace = %key.1, name = %key.2, error = %e,
                "cannot fetch what a pod references; retrying");
        }
        self.attempts.insert(key, (Instant::now(), false));
    }

    /// Fetches what the given pods reference and is due, then drops cached sources and
    /// tokens that no cached pod references any more.
    pub async fn refresh(
        &mut self,
        pods: &[(&StoredObject, Vec<SourceRef>)],
    ) -> Result<FetchStats, StoreError> {
        let mut st = FetchStats::default();
        let mut referenced: HashSet<Key> = HashSet::new();
        let mut uids = Vec::new();
        'pods: for (pod, refs) in pods {
            uids.push(pod.index.uid.as_str());
            let ns = &pod.index.namespace;
            for r in refs {
                if st.offline {
                    // Still record what is referenced, so nothing is pruned while offline.
                    if let SourceRef::ConfigMap { name } | SourceRef::Secret { name } = &r {
                        referenced.insert((r.kind().into(), ns.clone(), name.clone()));
                    }
                    continue;
                }
                match &r {
                    SourceRef::ConfigMap { name } | SourceRef::Secret { name } => {
                        let key: Key = (r.kind().into(), ns.clone(), name.clone());
                        referenced.insert(key.clone());
                        if pod.index.deleting || !self.due(&key) {
                            continue;
                        }
                        let res = if r.kind() == "secrets" {
                            &SECRETS
                        } else {
                            &CONFIGMAPS
                        };
                        let got = match self.client.get(res, Some(ns), name).await {
                            Ok(raw) => Some(raw),
                            Err(e) if e.code() == Some(404) => None,
                            Err(e) if e.is_offline() => {
                                st.offline = true;
                                continue;
                            }
                            Err(e) => {
                                st.failed += 1;
                                self.failed(key, &e);
                                continue;
                            }
                        };
                        st.fetched += 1;
                        let changed = self.store.put_source(&CachedSource {
                            kind: key.0.clone(),
                            namespace: key.1.clone(),
                            name: key.2.clone(),
                            raw: got,
                            fetched_ms: crate::time::now_ms(),
                        })?;
                        if changed {
                            st.changed += 1;
                            tracing::info!(kind = %key.0, namespace = %key.1, name = %key.2, "pod source cached");
                        }
                        self.warned.remove(&key);
                        self.attempts.insert(key, (Instant::now(), true));
                    }
                    SourceRef::Token {
                        service_account,
                        audience,
                        expiration_secs,
                    } => {
                        if pod.index.deleting {
                            continue;
                        }
                        let key: Key = (
                            "token".into(),
                            pod.index.uid.clone(),
                            format!("{audience}/{expiration_secs}"),
                        );
                        let cached =
                            self.store
                                .get_token(&pod.index.uid, audience, *expiration_secs)?;
                        let now = crate::time::now_ms();
                        let needed = cached
                            .as_ref()
                            .is_none_or(|t| token_due(now, t.issued_ms, t.expires_ms));
                        if !needed || !self.due(&key) {
                            continue;
                        }
                        let body = token_request(pod, audience, *expiration_secs);
                        match self
                            .client
                            .create_sub(
                                &SERVICE_ACCOUNTS,
                                Some(ns),
                                service_account,
                                "token",
                                body.to_string().into_bytes(),
                            )
                            .await
                        {
                            Ok(resp) => {
                                let v: Value = serde_json::from_str(&resp).unwrap_or(Value::Null);
                                let Some(token) =
                                    v.pointer("/status/token").and_then(Value::as_str)
                                else {
                                    st.failed += 1;
                                    self.attempts.insert(key, (Instant::now(), false));
                                    tracing::warn!(pod = %pod.index.name, "TokenRequest answer has no token");
                                    continue;
                                };
                                let expires_ms = v
                                    .pointer("/status/expirationTimestamp")
                                    .and_then(Value::as_str)
                                    .and_then(crate::time::parse_rfc3339)
                                    .map(|s| s * 1000)
                                    .unwrap_or(now + expiration_secs * 1000);
                                self.store.put_token(&CachedToken {
                                    pod_uid: pod.index.uid.clone(),
                                    audience: audience.clone(),
                                    expiration_secs: *expiration_secs,
                                    token: token.to_string(),
                                    issued_ms: now,
                                    expires_ms,
                                })?;
                                st.tokens += 1;
                                tracing::info!(pod = %pod.index.name, namespace = %ns, service_account = %service_account,
                                    expires_in_s = (expires_ms - now) / 1000, "service-account token cached");
                                self.warned.remove(&key);
                                self.attempts.insert(key, (Instant::now(), true));
                            }
                            Err(e) if e.is_offline() => {
                                st.offline = true;
                                continue 'pods;
                            }
                            Err(e) => {
                                st.failed += 1;
                                self.failed(key, &e);
                            }
                        }
                    }
                }
            }
        }
        // Hygiene: Secrets and tokens of pods that are gone leave the disk.
        for key in self.store.source_keys()? {
            if !referenced.contains(&key) {
                self.store.delete_source(&key.0, &key.1, &key.2)?;
                self.attempts.remove(&key);
            }
        }
        self.store.retain_tokens(&uids)?;
        Ok(st)
    }
}

/// What each pod references. Each pod is parsed and dropped in turn: a parsed 5 KB pod is
/// about 45 KB of `Value`, and holding 100 of them at once was most of edgehub's peak heap.
pub fn pod_references(pods: &[StoredObject]) -> Vec<(&StoredObject, Vec<SourceRef>)> {
    pods.iter()
        .filter_map(|p| {
            serde_json::from_str::<Value>(&p.raw)
                .ok()
                .map(|v| (p, references(&v)))
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
