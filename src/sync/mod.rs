//! Reflectors: list, then watch, each resource the node needs into the store, and keep a link
//! health state the rest of the program can read.
//!
//! What is watched (see [`plan`]):
//! - the node's pods (`fieldSelector=spec.nodeName=<node>`);
//! - its own Node (`fieldSelector=metadata.name=<node>`);
//! - DaemonSets and ControllerRevisions, cluster-wide or in the configured namespaces.
//!   ControllerRevisions not owned by a DaemonSet (StatefulSets') are not stored.
//!
//! Behaviour, per reflector:
//! - on start, resume the watch from the stored resourceVersion: no list while it is valid;
//! - 410 Expired (list or watch ERROR event): list again, then replace the rows in one
//!   transaction, deleting what the server no longer has;
//! - a cursor ahead of the server (its etcd restored from a backup): the apiserver accepts a
//!   watch from a version it does not have and sends nothing until its own versions pass it,
//!   events in between lost; only a list with such a version answers 504 "Too large resource
//!   version". Such a watch is the only one that stays silent (a server that has the version
//!   sends events, or a bookmark every minute once it moved on; a too-old version gets 410),
//!   so when a watch the server answered delivers nothing until the idle timeout, a reflector
//!   asks the server whether it has that version ([`ApiClient::check_resource_version`], one
//!   small request), and on the 504 lists again, node-scoped as always, as it does on a 410.
//!   A start or a reconnect resumes the watches from their cursors with no other request:
//!   a fleet whose link returns sends its watches, not a version check before each;
//! - a watch that ends normally (server timeout) is restarted at once from the last version;
//! - errors back off exponentially with full jitter, capped; a 429's Retry-After is honoured;
//! - unchanged objects and bookmarks write nothing; the cursor travels with real changes, and
//!   bookmark-only progress is parked in the store, rides along with its next commit, and is
//!   written on its own at most every `cursor_checkpoint`, every reflector's in one
//!   transaction (`store::cursors`): on flash, a commit costs 20–28 KiB however little it
//!   holds.

mod reflector;

pub use crate::backoff::Backoff;
use crate::kube::resource::{CONTROLLER_REVISIONS, DAEMONSETS, NODES, PODS};
use crate::kube::{ApiClient, KubeError, ListParams, Resource, WatchEvent};
use crate::link::{LinkReporter, LinkState};
use crate::object::{Kind, ObjectIndex};
use crate::store::{Change, Store, StoredObject};
use reflector::Reflector;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// Knobs of the reflectors. Defaults suit a device on a flaky cellular link.
#[derive(Debug, Clone, PartialEq)]
pub struct SyncConfig {
    /// Namespaces whose DaemonSets and ControllerRevisions are watched; empty means all.
    /// Pods are always selected by node name, and the Node by its name.
    pub watch_namespaces: Vec<String>,
    /// Minimum time between cursor writes that carry no object change (bookmarks).
    pub cursor_checkpoint: Duration,
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    /// Timeout of a non-watch request, and of connecting.
    pub request_timeout: Duration,
    /// A watch with no bytes (not even a bookmark) for this long is considered stalled.
    pub watch_idle_timeout: Duration,
    /// Largest single watch event or list page accepted, in bytes.
    pub max_event_bytes: usize,
    pub list_page_size: u32,
}

/// Records a request's error on the link: offline if it says the link is down, the TLS
/// failure (what failed, as `kube::tls_error` names it) if the handshake failed, otherwise the
/// server answered. Here rather than in `link`, which knows nothing of the apiserver's errors.
fn link_error(link: &LinkReporter, e: &KubeError) {
    if let KubeError::Tls { reason, .. } = e {
        link.tls_failed(reason.clone());
    } else if e.is_offline() {
        link.offline(e.to_string());
    } else {
        link.online();
    }
}

/// Counters of one reflector, for tests, benchmarks and metrics.
#[derive(Debug, Default)]
pub struct ReflectorStats {
    pub lists: AtomicU64,
    pub watches: AtomicU64,
    pub events: AtomicU64,
    pub written: AtomicU64,
    pub malformed: AtomicU64,
    pub errors: AtomicU64,
}

/// What one reflector watches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReflectorSpec {
    pub resource: Resource,
    /// The cached kind the resource's objects are stored as.
    pub kind: Kind,
    pub namespace: Option<String>,
    pub params: ListParams,
    /// Store only ControllerRevisions owned by a DaemonSet.
    pub daemonset_owned_only: bool,
}

impl ReflectorSpec {
    /// The cursor key: resource, namespace and selectors, so a changed node name or namespace
    /// list never resumes from a cursor that belonged to another selection.
    pub fn key(&self) -> String {
        let mut k = self.resource.qualified();
        if let Some(ns) = &self.namespace {
            k.push('@');
            k.push_str(ns);
        }
        if let Some(f) = &self.params.field_selector {
            k.push_str("?fieldSelector=");
            k.push_str(f);
        }
        k
    }

    fn keep(&self, ix: &ObjectIndex) -> bool {
        !self.daemonset_owned_only || ix.owner_kind.as_deref() == Some("DaemonSet")
    }
}

/// The reflector of the pods bound to this node.
fn pods_spec(node_name: &str) -> ReflectorSpec {
    ReflectorSpec {
        resource: PODS,
        kind: Kind::Pod,
        namespace: None,
        params: ListParams {
            field_selector: Some(format!("spec.nodeName={node_name}")),
            label_selector: None,
        },
        daemonset_owned_only: false,
    }
}

/// The cursor of this node's pod list. Its presence in the store is the kubelet's "sources
/// ready": a list of the node's pods has completed since the cache was created, so the cache
/// may be trusted to say which pods should *not* run.
pub fn pods_cursor_key(node_name: &str) -> String {
    pods_spec(node_name).key()
}

/// The reflectors a node runs. Pure, so the selection is unit-tested.
pub fn plan(node_name: &str, sync: &SyncConfig) -> Vec<ReflectorSpec> {
    let mut specs = vec![
        pods_spec(node_name),
        ReflectorSpec {
            resource: NODES,
            kind: Kind::Node,
            namespace: None,
            params: ListParams {
                field_selector: Some(format!("metadata.name={node_name}")),
                label_selector: None,
            },
            daemonset_owned_only: false,
        },
    ];
    let namespaces: Vec<Option<String>> = if sync.watch_namespaces.is_empty() {
        vec![None]
    } else {
        sync.watch_namespaces.iter().cloned().map(Some).collect()
    };
    for ns in namespaces {
        for (resource, kind, owned) in [
            (DAEMONSETS, Kind::DaemonSet, false),
            (CONTROLLER_REVISIONS, Kind::ControllerRevision, true),
        ] {
            specs.push(ReflectorSpec {
                resource,
                kind,
                namespace: ns.clone(),
                params: ListParams::default(),
                daemonset_owned_only: owned,
            });
        }
    }
    specs
}

/// A running set of reflectors.
pub struct Sync {
    pub link: watch::Receiver<LinkState>,
    pub stats: Vec<(String, Arc<ReflectorStats>)>,
    pending: Vec<Reflector>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Sync {
    /// Starts one task per reflector of [`plan`].
    pub fn spawn(
        node_name: &str,
        config: &SyncConfig,
        client: ApiClient,
        store: Arc<Store>,
        shutdown: watch::Receiver<bool>,
    ) -> Sync {
        let mut sync = Sync::prepare(node_name, config, client, store);
        sync.start(shutdown);
        sync
    }

    /// Plans the reflectors and prunes the cache to their selection, without starting
    /// them: the link state and stats exist for the local API before the sync begins.
    pub fn prepare(
        node_name: &str,
        config: &SyncConfig,
        client: ApiClient,
        store: Arc<Store>,
    ) -> Sync {
        let (reporter, link) = LinkReporter::new();
        let specs = plan(node_name, config);
        // A changed node name or namespace list must not leave objects or cursors of the old
        // selection behind, where nothing would ever update or delete them.
        let keys: Vec<String> = specs.iter().map(ReflectorSpec::key).collect();
        let ns = &config.watch_namespaces;
        match store.prune(
            &keys,
            &[(Kind::DaemonSet, ns), (Kind::ControllerRevision, ns)],
        ) {
            Ok(0) => {}
            Ok(n) => tracing::info!(
                rows = n,
                "forgot cached objects and cursors outside the sync selection"
            ),
            Err(e) => tracing::warn!(error = %e, "cannot prune the cache to the sync selection"),
        }
        let mut stats = Vec::new();
        let mut pending = Vec::new();
        for spec in specs {
            let st = Arc::new(ReflectorStats::default());
            stats.push((spec.key(), st.clone()));
            let r = Reflector {
                spec,
                client: client.clone(),
                store: store.clone(),
                link: reporter.clone(),
                cfg: config.clone(),
                stats: st,
            };
            pending.push(r);
        }
        Sync {
            link,
            stats,
            pending,
            tasks: Vec::new(),
        }
    }

    /// Starts the reflectors [`Sync::prepare`] planned.
    pub fn start(&mut self, shutdown: watch::Receiver<bool>) {
        for r in self.pending.drain(..) {
            self.tasks.push(tokio::spawn(r.run(shutdown.clone())));
        }
    }

    /// Waits for every reflector to stop (after shutdown was signalled).
    pub async fn join(self) {
        for t in self.tasks {
            if let Err(e) = t.await {
                tracing::error!(error = %e, "reflector task failed");
            }
        }
    }

    pub fn stats_for(&self, key_prefix: &str) -> Option<&Arc<ReflectorStats>> {
        self.stats
            .iter()
            .find(|(k, _)| k.starts_with(key_prefix))
            .map(|(_, s)| s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sync_cfg(ns: &[&str]) -> SyncConfig {
        SyncConfig {
            watch_namespaces: ns.iter().map(|s| s.to_string()).collect(),
            cursor_checkpoint: Duration::from_secs(3600),
            backoff_initial: Duration::from_millis(500),
            backoff_max: Duration::from_secs(60),
            request_timeout: Duration::from_secs(30),
            watch_idle_timeout: Duration::from_secs(120),
            max_event_bytes: 4 << 20,
            list_page_size: 100,
        }
    }

    #[test]
    fn plan_watches_only_what_the_node_needs() {
        let keys: Vec<String> = plan("edge-1", &sync_cfg(&[]))
            .iter()
            .map(|s| s.key())
            .collect();
        assert_eq!(
            keys,
            [
                "pods?fieldSelector=spec.nodeName=edge-1",
                "nodes?fieldSelector=metadata.name=edge-1",
                "daemonsets.apps",
                "controllerrevisions.apps",
            ]
        );
        let keys: Vec<String> = plan("edge-1", &sync_cfg(&["vehicle", "infra"]))
            .iter()
            .map(|s| s.key())
            .collect();
        assert_eq!(keys.len(), 6);
        assert!(keys.contains(&"daemonsets.apps@vehicle".to_string()));
        assert!(keys.contains(&"controllerrevisions.apps@infra".to_string()));
    }

    #[test]
    fn only_daemonset_revisions_are_kept() {
        let spec = plan("n", &sync_cfg(&[])).pop().unwrap();
        assert_eq!(spec.resource, CONTROLLER_REVISIONS);
        let ix = |owner: Option<&str>| ObjectIndex {
            kind: crate::object::Kind::ControllerRevision,
            namespace: "ns".into(),
            name: "r".into(),
            uid: "u".into(),
            resource_version: "1".into(),
            owner_uid: owner.map(|_| "o".into()),
            owner_kind: owner.map(str::to_string),
            revision_hash: None,
            revision: Some(1),
            deleting: false,
        };
        assert!(spec.keep(&ix(Some("DaemonSet"))));
        assert!(!spec.keep(&ix(Some("StatefulSet"))));
        assert!(!spec.keep(&ix(None)));
    }

    #[test]
    fn backoff_grows_to_the_cap_with_jitter_below_the_ceiling() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
        let mut ceilings = Vec::new();
        for _ in 0..8 {
            let c = b.ceiling();
            let d = b.next_delay();
            assert!(d <= c, "{d:?} > {c:?}");
            ceilings.push(c.as_millis());
        }
        assert_eq!(ceilings, [100, 200, 400, 800, 1600, 2000, 2000, 2000]);
        b.reset();
        assert_eq!(b.ceiling(), Duration::from_millis(100));
        // Many attempts never overflow.
        for _ in 0..100 {
            b.next_delay();
        }
        assert_eq!(b.ceiling(), Duration::from_secs(2));
    }
}
