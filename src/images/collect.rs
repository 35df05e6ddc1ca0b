//! Image garbage collection's I/O, around the pure plan in [`super::gc`]: what the CRI lists
//! (images, containers, the image filesystem, the sandbox image), what the cache names (each
//! DaemonSet's current and previous revision, every active upgrade's two revisions, what each
//! cached pod runs), the removals, and the pressure state the Node reports.
//!
//! It runs as a task of its own, woken by the store's changes and by a period: after an
//! upgrade commits (a `Done` upgrade newer than the last one it ran after; on the first pass,
//! any, so a power cut between a commit and its collection is made up), and whenever the image
//! filesystem is over the high threshold. It meets the upgrade engine at the store only.

use super::gc::{self, FsUse, GcPolicy, Named, NodeImage, Removal, Role};
use super::reference::Reference;
use crate::cri::{CriClient, CriError, CriRuntime};
use crate::object::Kind;
use crate::revision::{update_revision, Revision};
use crate::store::{RequestKind, Store, StoreError};
use serde_json::Value;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

#[derive(Debug, thiserror::Error)]
pub enum GcError {
    #[error("image garbage collection: {0}")]
    Cri(#[from] CriError),
    #[error("image garbage collection: {0}")]
    Store(#[from] StoreError),
}

/// Counters and the last reading, for `/metrics`, and the policy, for `GET /v1/images`.
#[derive(Debug, Default)]
pub struct GcStats {
    pub policy: GcPolicy,
    pub images_removed: AtomicU64,
    pub bytes_removed: AtomicU64,
    pub remove_errors: AtomicU64,
    /// The image filesystem's last reading.
    pub fs_used_bytes: AtomicU64,
    pub fs_capacity_bytes: AtomicU64,
}

/// What one pass did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PassReport {
    pub removed: Vec<Removal>,
    /// The image filesystem after the pass, when the runtime names it.
    pub fs: Option<FsUse>,
    /// Why the Node has disk pressure after the pass, if it has.
    pub pressure: Option<String>,
}

/// The collector. One per process.
pub struct ImageGc {
    cri: CriClient,
    store: Arc<Store>,
    policy: GcPolicy,
    /// When each image id was first seen (the kubelet's `firstDetected`), in memory as the
    /// kubelet keeps it: after a restart every image counts as seen then.
    first_seen: HashMap<String, i64>,
    /// The newest `Done` upgrade collected after; `None` before the first pass.
    last_done: Option<i64>,
    pressure: watch::Sender<Option<String>>,
    stats: Arc<GcStats>,
}

impl ImageGc {
    /// The collector and the pressure state the Node reads (`Some(why)` while the image
    /// filesystem stays over the high threshold).
    pub fn new(
        cri: CriClient,
        store: Arc<Store>,
        policy: GcPolicy,
    ) -> (ImageGc, watch::Receiver<Option<String>>) {
        let (tx, rx) = watch::channel(None);
        (
            ImageGc {
                cri,
                store,
                policy,
                first_seen: HashMap::new(),
                last_done: None,
                pressure: tx,
                stats: Arc::new(GcStats {
                    policy,
                    ..GcStats::default()
                }),
            },
            rx,
        )
    }

    pub fn stats(&self) -> Arc<GcStats> {
        self.stats.clone()
    }

    /// The node's images with their fates, for `edgehub images`.
    pub async fn listing(&mut self) -> Result<Vec<(NodeImage, gc::Fate)>, GcError> {
        let (images, in_use, named) = self.observe().await?;
        Ok(images
            .into_iter()
            .map(|i| {
                let f = gc::fate(&i, &in_use, &named);
                (i, f)
            })
            .collect())
    }

    async fn observe(&mut self) -> Result<(Vec<NodeImage>, HashSet<String>, Vec<Named>), GcError> {
        let listed = self.cri.list_images().await?;
        let now = crate::time::now_ms();
        self.first_seen
            .retain(|id, _| listed.iter().any(|i| &i.id == id));
        let images: Vec<NodeImage> = listed
            .into_iter()
            .map(|i| {
                let first_seen_ms = *self.first_seen.entry(i.id.clone()).or_insert(now);
                let mut names = i.repo_tags;
                names.extend(i.repo_digests);
                NodeImage {
                    id: i.id,
                    names,
                    size: i.size,
                    pinned: i.pinned,
                    first_seen_ms,
                }
            })
            .collect();
        // Every container counts, exited ones too: the kubelet keeps an exited container's
        // image, and removing it would make the CRI refuse (or a restart pull again).
        let in_use: HashSet<String> = self
            .cri
            .list_containers(HashMap::new())
            .await?
            .into_iter()
            .flat_map(|c| {
                let spec = c.image.map(|s| s.image).unwrap_or_default();
                [c.image_ref, spec]
            })
            .filter(|s| !s.is_empty())
            .collect();
        // A container's image may be named by id or by a reference: map references to ids.
        let in_use: HashSet<String> = images
            .iter()
            .filter(|i| in_use.contains(&i.id) || i.names.iter().any(|n| in_use.contains(n)))
            .map(|i| i.id.clone())
            .collect();
        let mut named = named_images(&self.store)?;
        // The sandbox image by the runtime's own configuration; a runtime that does not say
        // leaves it to the pin.
        match self.cri.sandbox_image().await {
            Ok(Some(s)) => match Reference::parse(&s) {
                Ok(reference) => named.push(Named {
                    reference,
                    role: Role::Sandbox,
                    by: "the runtime's sandbox image".into(),
                }),
                Err(e) => {
                    tracing::warn!(image = %s, error = %e, "the runtime's sandbox image does not parse")
                }
            },
            Ok(None) => {}
            Err(e) => return Err(e.into()),
        }
        Ok((images, in_use, named))
    }

    /// One pass: collect after a commit, relieve pressure, update the pressure state.
    pub async fn pass(&mut self) -> Result<PassReport, GcError> {
        let done = self.store.last_done_request(RequestKind::Upgrade)?;
        let committed = match (done, self.last_done) {
            (None, _) => false,
            (Some(_), None) => true,
            (Some(d), Some(l)) => d > l,
        };
        let mountpoint = self.cri.image_fs_mountpoint().await.ok().flatten();
        let fs = mountpoint.as_deref().and_then(fs_use);
        let over = fs.is_some_and(|f| gc::under_pressure(&f, &self.policy));
        let mut removed = Vec::new();
        if committed || over {
            let (images, in_use, named) = self.observe().await?;
            let mut plan = if committed {
                gc::after_commit(&images, &in_use, &named, &self.policy)
            } else {
                Vec::new()
            };
            if let Some(f) = fs.filter(|_| over) {
                let planned: u64 = plan.iter().map(|r| r.size).sum();
                let after = FsUse {
                    used_bytes: f.used_bytes.saturating_sub(planned),
                    ..f
                };
                let left: Vec<NodeImage> = images
                    .iter()
                    .filter(|i| !plan.iter().any(|r| r.id == i.id))
                    .cloned()
                    .collect();
                plan.extend(gc::under_pressure_removals(
                    &left,
                    &in_use,
                    &named,
                    &after,
                    &self.policy,
                ));
            }
            for r in plan {
                match self.cri.remove_image(&r.id).await {
                    Ok(()) => {
                        tracing::info!(image = %r.id, names = ?r.names, size = r.size,
                            why = r.why, "removed an image");
                        self.stats.images_removed.fetch_add(1, Ordering::Relaxed);
                        self.stats
                            .bytes_removed
                            .fetch_add(r.size, Ordering::Relaxed);
                        removed.push(r);
                    }
                    Err(e) if e.is_not_found() => {}
                    Err(e) => {
                        // A container that started with it meanwhile, or a runtime that is
                        // down: the next pass decides again.
                        self.stats.remove_errors.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(image = %r.id, error = %e, "cannot remove an image");
                    }
                }
            }
        }
        if committed {
            self.last_done = done;
        }
        let fs = if removed.is_empty() {
            fs
        } else {
            mountpoint.as_deref().and_then(fs_use)
        };
        if let Some(f) = fs {
            self.stats
                .fs_used_bytes
                .store(f.used_bytes, Ordering::Relaxed);
            self.stats
                .fs_capacity_bytes
                .store(f.capacity_bytes, Ordering::Relaxed);
        }
        let pressure = fs.filter(|f| gc::under_pressure(f, &self.policy)).map(|f| {
            format!(
                "the image filesystem is {} % full, over the {} % threshold, and no image \
                 garbage collection may remove is left",
                f.percent(),
                self.policy.high_percent
            )
        });
        self.pressure.send_if_modified(|cur| {
            if *cur == pressure {
                return false;
            }
            match &pressure {
                Some(why) => tracing::warn!(%why, "image filesystem under disk pressure"),
                None => tracing::info!("image filesystem no longer under disk pressure"),
            }
            *cur = pressure.clone();
            true
        });
        Ok(PassReport {
            removed,
            fs,
            pressure,
        })
    }

    /// Runs passes on the store's changes (debounced by `period`'s floor) and every `period`,
    /// until `shutdown`.
    pub async fn run(mut self, period: Duration, mut shutdown: watch::Receiver<bool>) {
        let mut changes = self.store.subscribe();
        loop {
            if let Err(e) = self.pass().await {
                tracing::warn!(error = %e, "image garbage collection pass failed");
            }
            tokio::select! {
                _ = shutdown.changed() => return,
                _ = changes.changed() => {
                    // Many changes come in bursts (a sync, an upgrade's steps): one pass after.
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    changes.borrow_and_update();
                }
                _ = tokio::time::sleep(period) => {}
            }
            if *shutdown.borrow() {
                return;
            }
        }
    }
}

/// The filesystem at `mountpoint`: used and total bytes, as `df` counts them (the kubelet's
/// image filesystem reading, from cAdvisor, is the same).
pub fn fs_use(mountpoint: &Path) -> Option<FsUse> {
    crate::mountns::fs_stats(mountpoint).map(|s| FsUse {
        used_bytes: s.total_bytes.saturating_sub(s.free_bytes),
        capacity_bytes: s.total_bytes,
    })
}

/// The images a template names (containers and init containers).
fn template_images(template: &Value) -> Vec<Reference> {
    ["containers", "initContainers"]
        .iter()
        .flat_map(|list| {
            template
                .pointer(&format!("/spec/{list}"))
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
        })
        .filter_map(|c| c.get("image").and_then(Value::as_str))
        .filter_map(|i| Reference::parse(i).ok())
        .collect()
}

/// What the cache names: each DaemonSet's current (update) and previous revision, and both
/// revisions of every upgrade that has not ended.
pub fn named_images(store: &Store) -> Result<Vec<Named>, StoreError> {
    let mut by_owner: BTreeMap<String, Vec<(String, Revision)>> = BTreeMap::new();
    for cr in store.list(Kind::ControllerRevision)? {
        let Ok(rev) = Revision::from_raw(&cr.raw) else {
            continue;
        };
        let owner = cr.index.owner_uid.clone().unwrap_or_default();
        by_owner
            .entry(owner)
            .or_default()
            .push((cr.index.namespace.clone(), rev));
    }
    let mut out = Vec::new();
    let mut push = |ns: &str, rev: &Revision, role: Role| {
        for reference in template_images(&rev.template) {
            out.push(Named {
                reference,
                role,
                by: format!("{ns}/{}", rev.name),
            });
        }
    };
    let mut all: Vec<(String, Revision)> = Vec::new();
    for (_, revs) in by_owner {
        let plain: Vec<Revision> = revs.iter().map(|(_, r)| r.clone()).collect();
        let ns = revs.first().map(|(n, _)| n.clone()).unwrap_or_default();
        if let Some(cur) = update_revision(&plain) {
            push(&ns, cur, Role::Current);
            let prev = plain
                .iter()
                .filter(|r| r.number < cur.number)
                .max_by_key(|r| r.number);
            if let Some(prev) = prev {
                push(&ns, prev, Role::Previous);
            }
            let kept_from = prev.map_or(cur.number, |p| p.number);
            for r in plain.iter().filter(|r| r.number < kept_from) {
                push(&ns, r, Role::Old);
            }
        }
        all.extend(revs);
    }
    for req in store.active_requests()? {
        if req.kind != RequestKind::Upgrade {
            continue;
        }
        for hash in std::iter::once(req.to_hash.as_str()).chain(req.from_hash.as_deref()) {
            if let Some((_, rev)) = all
                .iter()
                .find(|(ns, r)| *ns == req.namespace && r.hash == hash)
            {
                push(&req.namespace, rev, Role::Upgrade);
            }
        }
    }
    // What each cached pod runs, or is about to: its spec as the device runs it (a committed
    // revision the cloud has not heard of yet included), and its own revision's template.
    let running: HashMap<String, crate::store::RunningRevision> = store
        .running_revisions()?
        .into_iter()
        .map(|r| (r.pod_uid.clone(), r))
        .collect();
    for obj in store.list(Kind::Pod)? {
        let Ok(mut pod) = serde_json::from_str::<Value>(&obj.raw) else {
            continue;
        };
        crate::pod::desired::as_running(&mut pod, running.get(&obj.index.uid));
        let by = format!("{}/{}", obj.index.namespace, obj.index.name);
        let spec = pod.get("spec").cloned().unwrap_or(Value::Null);
        let mut refs = template_images(&serde_json::json!({ "spec": spec }));
        if let Some(hash) = crate::revision::pod_hash(&pod) {
            for (ns, rev) in &all {
                if *ns == obj.index.namespace && rev.hash == hash {
                    refs.extend(template_images(&rev.template));
                }
            }
        }
        for reference in refs {
            out.push(Named {
                reference,
                role: Role::Pod,
                by: by.clone(),
            });
        }
    }
    Ok(out)
}

/// One image on the node, as `GET /v1/images` and `edgehub images` show it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Listed {
    pub id: String,
    pub names: Vec<String>,
    pub size: u64,
    /// `in use`, `pinned`, `upgrade`, `current`, `previous`, `older` or `unnamed`.
    pub role: &'static str,
    /// The revisions (`namespace/name`) that name it.
    pub revisions: Vec<String>,
    /// Whether collection after the next commit removes it.
    pub removed_after_commit: bool,
    /// Whether collection under disk pressure may remove it.
    pub removable_under_pressure: bool,
}

/// Every image on the node with what collection would do with it.
pub async fn list(
    cri: CriClient,
    store: Arc<Store>,
    policy: &GcPolicy,
) -> Result<Vec<Listed>, GcError> {
    let (mut gc, _) = ImageGc::new(cri, store, *policy);
    gc.listing().await.map(|all| {
        all.into_iter()
            .map(|(i, fate)| {
                let (role, revisions) = match &fate {
                    gc::Fate::InUse => ("in use", Vec::new()),
                    gc::Fate::Pinned => ("pinned", Vec::new()),
                    gc::Fate::Unnamed => ("unnamed", Vec::new()),
                    gc::Fate::Named { role, by } => (
                        match role {
                            Role::Old => "older",
                            Role::Previous => "previous",
                            Role::Current => "current",
                            Role::Upgrade => "upgrade",
                            Role::Pod => "pod",
                            Role::Sandbox => "sandbox",
                        },
                        by.clone(),
                    ),
                };
                Listed {
                    removed_after_commit: fate.removable_after_commit(policy),
                    removable_under_pressure: fate.removable_under_pressure(),
                    id: i.id,
                    names: i.names,
                    size: i.size,
                    role,
                    revisions,
                }
            })
            .collect()
    })
}
