//! The node task: register the Node, renew its Lease, patch its status when it changed.

use super::object::{lease, new_node, ready_overridden, reconcile_patch, significant, status};
use super::{goarch, NodeConfig, NodeProbe, NodeSample, LEASE_NAMESPACE};
use crate::kube::resource::{LEASES, NODES};
use crate::kube::{ApiClient, KubeError, PatchType};
use crate::link::LinkState;
use crate::object::Kind;
use crate::store::Store;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Instant, SystemTime};
use tokio::sync::watch;

/// Counters, for tests and metrics.
#[derive(Debug, Default)]
pub struct NodeStats {
    pub registrations: std::sync::atomic::AtomicU64,
    pub lease_renewals: std::sync::atomic::AtomicU64,
    pub status_patches: std::sync::atomic::AtomicU64,
    pub errors: std::sync::atomic::AtomicU64,
}

/// Registers the Node, renews the Lease and patches status, until shutdown.
pub struct NodeAgent {
    pub client: ApiClient,
    pub probe: Arc<dyn NodeProbe>,
    pub cfg: NodeConfig,
    pub node_name: String,
    pub stats: Arc<NodeStats>,
    registered: bool,
    lease_rv: Option<String>,
    last_status: Option<(Value, Instant)>,
    conditions: Option<Value>,
    /// The last cycle renewed the Lease.
    healthy: bool,
    /// The cache the Node's watch fills, and its change signal: with it, a returning link posts
    /// status only once the watch shows that someone changed the Node's Ready meanwhile.
    cache: Option<(Arc<Store>, watch::Receiver<u64>)>,
}

fn bump(c: &std::sync::atomic::AtomicU64) {
    c.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

impl NodeAgent {
    pub fn new(
        client: ApiClient,
        probe: Arc<dyn NodeProbe>,
        cfg: NodeConfig,
        node_name: String,
    ) -> NodeAgent {
        NodeAgent {
            client,
            probe,
            cfg,
            node_name,
            stats: Arc::default(),
            registered: false,
            lease_rv: None,
            last_status: None,
            conditions: None,
            healthy: false,
            cache: None,
        }
    }

    /// Reads the Node as the sync's watch caches it. Without it (a Node agent alone), a link
    /// that returns posts status at once, changed or not, since the node lifecycle controller
    /// may have set Ready=Unknown meanwhile and nothing else would say so.
    pub fn with_cache(mut self, store: Arc<Store>) -> NodeAgent {
        let changes = store.subscribe();
        self.cache = Some((store, changes));
        self
    }

    /// Whether the cached Node shows our Ready overridden since our last post (see
    /// [`ready_overridden`]). A store that cannot be read says no: the periodic report
    /// (`status_report`) still comes.
    fn cloud_overrode_ready(&self) -> bool {
        let (Some((store, _)), Some(posted)) = (&self.cache, &self.conditions) else {
            return false;
        };
        match store.get(Kind::Node, "", &self.node_name) {
            Ok(Some(n)) => serde_json::from_str::<Value>(&n.raw)
                .is_ok_and(|node| ready_overridden(&node, posted)),
            Ok(None) => false,
            Err(e) => {
                tracing::debug!(node = %self.node_name, error = %e, "cached Node unreadable");
                false
            }
        }
    }

    /// Runs a cycle every lease-renew interval, and at once when the link comes back: a Node
    /// that was away goes Ready again immediately, Lease first, then status.
    pub async fn run(
        mut self,
        mut link: watch::Receiver<LinkState>,
        mut shutdown: watch::Receiver<bool>,
    ) {
        let mut tick = tokio::time::interval(self.cfg.lease_renew);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut online = matches!(*link.borrow(), LinkState::Online);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                r = cache_changed(&mut self.cache) => {
                    if r.is_err() {
                        self.cache = None;
                        continue;
                    }
                    if !self.cloud_overrode_ready() {
                        continue;
                    }
                    tracing::info!(node = %self.node_name, "the Node's Ready was changed by another (the node lifecycle controller, after a long cut): posting status now");
                    self.last_status = None;
                }
                r = link.changed() => {
                    if r.is_err() {
                        // The sync stopped; keep the timer going.
                        link = watch::channel(LinkState::Unknown).1;
                        continue;
                    }
                    let now_online = matches!(*link.borrow_and_update(), LinkState::Online);
                    // A short outage can be missed between two reads of the link state; a
                    // failed last cycle says the same.
                    let back = now_online && (!online || !self.healthy);
                    online = now_online;
                    if !back {
                        continue;
                    }
                    // The node lifecycle controller may have set Ready=Unknown meanwhile. With
                    // the cache, the Node's watch says so when it resumes (a cut shorter than
                    // the controller's grace period then costs no status post); without it,
                    // post status now, changed or not.
                    if self.cache.is_some() {
                        tracing::info!(node = %self.node_name, "link is back: renewing the Lease now; status when the Node's watch shows it changed");
                    } else {
                        tracing::info!(node = %self.node_name, "link is back: renewing the Lease and posting status now");
                        self.last_status = None;
                    }
                    tick.reset();
                }
                _ = shutdown.changed() => break,
            }
            self.cycle().await;
        }
    }

    /// One round: register if needed, renew the Lease, patch status if due.
    pub async fn cycle(&mut self) {
        if !self.registered {
            match self.register().await {
                Ok(()) => self.registered = true,
                Err(e) => {
                    bump(&self.stats.errors);
                    self.healthy = false;
                    tracing::warn!(node = %self.node_name, error = %e, "node registration failed; will retry");
                    return;
                }
            }
        }
        let was_healthy = self.healthy;
        self.healthy = match self.renew_lease().await {
            Ok(()) => true,
            Err(e) => {
                bump(&self.stats.errors);
                // Offline, every 10 s: said once, then quietly until it works again.
                if was_healthy || !e.is_offline() {
                    tracing::warn!(node = %self.node_name, error = %e, "lease renewal failed");
                } else {
                    tracing::debug!(node = %self.node_name, error = %e, "lease renewal failed");
                }
                false
            }
        };
        if let Err(e) = self.patch_status().await {
            bump(&self.stats.errors);
            tracing::warn!(node = %self.node_name, error = %e, "node status update failed");
        }
    }

    async fn sample(&self) -> NodeSample {
        let probe = self.probe.clone();
        // Reading /proc and resolving the apiserver's address block.
        tokio::task::spawn_blocking(move || probe.sample())
            .await
            .unwrap_or_default()
    }

    async fn register(&mut self) -> Result<(), KubeError> {
        match self.client.get(&NODES, None, &self.node_name).await {
            Ok(raw) => {
                let existing: Value = serde_json::from_str(&raw).unwrap_or(Value::Null);
                if let Some(patch) =
                    reconcile_patch(&existing, &self.cfg, &self.node_name, goarch())
                {
                    self.client
                        .patch(
                            &NODES,
                            None,
                            &self.node_name,
                            None,
                            PatchType::StrategicMerge,
                            patch.to_string().into_bytes(),
                        )
                        .await?;
                    tracing::info!(node = %self.node_name, "existing Node reconciled");
                } else {
                    tracing::info!(node = %self.node_name, "Node already registered");
                }
            }
            Err(e) if e.code() == Some(404) => {
                let sample = self.sample().await;
                let body = new_node(&sample, &self.cfg, &self.node_name, &crate::time::now());
                match self
                    .client
                    .create(&NODES, None, body.to_string().into_bytes())
                    .await
                {
                    Ok(_) => tracing::info!(node = %self.node_name, "Node registered"),
                    Err(e) if e.code() == Some(409) => {}
                    Err(e) => return Err(e),
                }
            }
            Err(e) => return Err(e),
        }
        bump(&self.stats.registrations);
        Ok(())
    }

    async fn renew_lease(&mut self) -> Result<(), KubeError> {
        for _ in 0..2 {
            let renew = crate::time::rfc3339_micros(SystemTime::now());
            let Some(rv) = self.lease_rv.clone() else {
                match self
                    .client
                    .get(&LEASES, Some(LEASE_NAMESPACE), &self.node_name)
                    .await
                {
                    Ok(raw) => {
                        self.lease_rv = resource_version(&raw);
                        continue;
                    }
                    Err(e) if e.code() == Some(404) => {
                        let body =
                            lease(&self.node_name, self.cfg.lease_duration_secs, &renew, None);
                        let raw = self
                            .client
                            .create(
                                &LEASES,
                                Some(LEASE_NAMESPACE),
                                body.to_string().into_bytes(),
                            )
                            .await?;
                        self.lease_rv = resource_version(&raw);
                        bump(&self.stats.lease_renewals);
                        return Ok(());
                    }
                    Err(e) => return Err(e),
                }
            };
            let body = lease(
                &self.node_name,
                self.cfg.lease_duration_secs,
                &renew,
                Some(&rv),
            );
            match self
                .client
                .update(
                    &LEASES,
                    Some(LEASE_NAMESPACE),
                    &self.node_name,
                    body.to_string().into_bytes(),
                )
                .await
            {
                Ok(raw) => {
                    self.lease_rv = resource_version(&raw);
                    bump(&self.stats.lease_renewals);
                    return Ok(());
                }
                // Someone else wrote the Lease (or it was recreated): read it again and retry.
                Err(e) if matches!(e.code(), Some(409) | Some(404)) => {
                    tracing::info!(node = %self.node_name, code = e.code(), "lease changed under us; rereading");
                    self.lease_rv = None;
                }
                Err(e) => return Err(e),
            }
        }
        Err(KubeError::Stream {
            request: crate::kube::Request {
                verb: "update",
                resource: "leases.coordination.k8s.io".into(),
                namespace: Some(LEASE_NAMESPACE.into()),
                name: Some(self.node_name.clone()),
            },
            reason: "the Lease kept changing between read and write".into(),
        })
    }

    async fn patch_status(&mut self) -> Result<(), KubeError> {
        let sample = self.sample().await;
        let now = crate::time::now();
        let st = status(
            &sample,
            &self.cfg,
            &self.node_name,
            self.conditions.as_ref(),
            &now,
        );
        let sig = significant(&st);
        if let Some((last, at)) = &self.last_status {
            if *last == sig && at.elapsed() < self.cfg.status_report {
                return Ok(());
            }
        }
        let body = json!({"status": st});
        self.client
            .patch(
                &NODES,
                None,
                &self.node_name,
                Some("status"),
                PatchType::StrategicMerge,
                body.to_string().into_bytes(),
            )
            .await?;
        bump(&self.stats.status_patches);
        self.conditions = st.get("conditions").cloned();
        self.last_status = Some((sig, Instant::now()));
        Ok(())
    }
}

/// The cache's next change; never, without a cache.
async fn cache_changed(
    cache: &mut Option<(Arc<Store>, watch::Receiver<u64>)>,
) -> Result<(), watch::error::RecvError> {
    match cache {
        Some((_, rx)) => rx.changed().await,
        None => std::future::pending().await,
    }
}

fn resource_version(raw: &str) -> Option<String> {
    serde_json::from_str::<Value>(raw)
        .ok()?
        .pointer("/metadata/resourceVersion")?
        .as_str()
        .map(str::to_string)
}
