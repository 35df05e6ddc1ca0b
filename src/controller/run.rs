//! The controller's I/O: kube-rs reflectors for DaemonSets, ControllerRevisions, pods and
//! Nodes; kube-rs's `applier` to run one reconcile per DaemonSet at a time (debounced, with
//! requeues); the deletions, condition writes and Events a [`decide::Decision`] asks for; the
//! leader Lease; `/metrics`; and a graceful shutdown.
//!
//! Every trigger maps to the DaemonSets it concerns: a DaemonSet to itself, a pod or a
//! ControllerRevision to its controlling DaemonSet, and a Node whose Ready condition flips to
//! every DaemonSet with a pod on it. That last one is beyond OpenYurt, whose controller hears
//! of a node coming back only through an unrelated DaemonSet event.

use super::lease::{Elector, Lost, Timings};
use super::metrics::{inc, Metrics};
use super::pending::Pending;
use super::reconcile::{lock, reconcile, Ctx, ReconcileError};
use super::views;
use super::COMPONENT;
use futures_util::{stream, FutureExt, StreamExt};
use http_body_util::Full;
use hyper::body::Bytes;
use k8s_openapi::api::apps::v1::{ControllerRevision, DaemonSet};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::Api;
use kube::runtime::controller::{self, Action, ReconcileReason, ReconcileRequest};
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Client, ResourceExt};
use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;

/// How long a shutdown waits for running reconciles (the Deployment allows 30 s).
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// How `edgehub controller` runs.
#[derive(Debug, Clone)]
pub struct Options {
    /// A kubeconfig file; without one, `KUBECONFIG`, `~/.kube/config` or the in-cluster
    /// service account, as kubectl finds them.
    pub kubeconfig: Option<PathBuf>,
    /// Where `/metrics`, `/healthz` and `/readyz` are served.
    pub metrics_addr: SocketAddr,
    /// Run only while holding the Lease `lease_namespace/lease_name`.
    pub leader_elect: bool,
    pub lease_namespace: String,
    pub lease_name: String,
    /// This replica's name in the Lease (the pod name in a Deployment).
    pub identity: String,
    pub lease: Timings,
    /// Reconcile every opted-in DaemonSet at least this often, watch events or not.
    pub resync: Duration,
    /// Triggers for one DaemonSet closer together than this are merged into one reconcile.
    pub debounce: Duration,
    /// Attested approval of first node certificates against the fleet CA found here (opt-in;
    /// `None`: off, CSRs are left to the cluster's approvers).
    pub attest_fleet_ca: Option<super::approve::CaSource>,
    /// Where attested approval records the keys it approved, one ConfigMap per node
    /// ([`super::approve::replay`]).
    pub attest_record_namespace: String,
    /// Approve nodes' kubelet-serving CSRs for the addresses their Node reports, deny the
    /// rest (opt-in; off: they wait for `kubectl certificate approve`).
    pub approve_serving: bool,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            kubeconfig: None,
            metrics_addr: SocketAddr::from(([0, 0, 0, 0], 8080)),
            leader_elect: true,
            lease_namespace: "kube-system".into(),
            lease_name: COMPONENT.into(),
            identity: COMPONENT.into(),
            lease: Timings::default(),
            resync: Duration::from_secs(300),
            debounce: Duration::from_millis(100),
            attest_fleet_ca: None,
            attest_record_namespace: super::approve::replay::DEFAULT_NAMESPACE.into(),
            approve_serving: false,
        }
    }
}

/// Why the controller stopped. The messages carry their cause's text (kube-rs's errors
/// already chain theirs), so none is marked as a `source` that would print it twice.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    #[error("kubeconfig {path}: {error}")]
    Kubeconfig {
        path: PathBuf,
        error: kube::config::KubeconfigError,
    },
    #[error("no kubeconfig given and none found (KUBECONFIG, ~/.kube/config, in-cluster): {0}")]
    Infer(kube::config::InferConfigError),
    #[error("cannot build the apiserver client: {0}")]
    Client(kube::Error),
    #[error("cannot serve metrics on {addr}: {error}")]
    Listen {
        addr: SocketAddr,
        error: std::io::Error,
    },
    #[error(transparent)]
    LostLease(#[from] Lost),
}

async fn client(opts: &Options) -> Result<Client, ControllerError> {
    let config = match &opts.kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path).map_err(|error| {
                ControllerError::Kubeconfig {
                    path: path.clone(),
                    error,
                }
            })?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|error| ControllerError::Kubeconfig {
                    path: path.clone(),
                    error,
                })?
        }
        None => kube::Config::infer()
            .await
            .map_err(ControllerError::Infer)?,
    };
    Client::try_from(config).map_err(ControllerError::Client)
}

/// Runs the controller until `shutdown` resolves (Ok) or the leader Lease is lost (Err).
pub async fn run(
    opts: Options,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ControllerError> {
    // kube-rs's rustls needs a process-wide provider; the crate uses ring everywhere.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = client(&opts).await?;
    let metrics = Arc::new(Metrics::default());
    let ready = Arc::new(AtomicBool::new(false));
    let (stop_tx, stop_rx) = watch::channel(false);
    let stop_tx = Arc::new(stop_tx);
    {
        let stop_tx = stop_tx.clone();
        tokio::spawn(async move {
            shutdown.await;
            let _ = stop_tx.send(true);
        });
    }
    let listener = tokio::net::TcpListener::bind(opts.metrics_addr)
        .await
        .map_err(|error| ControllerError::Listen {
            addr: opts.metrics_addr,
            error,
        })?;
    let addr = listener.local_addr().unwrap_or(opts.metrics_addr);
    tracing::info!(%addr, "serving /metrics, /healthz and /readyz");
    let http = tokio::spawn(serve_http(
        listener,
        metrics.clone(),
        ready.clone(),
        stop_rx.clone(),
    ));

    let mut elector = opts.leader_elect.then(|| {
        Elector::new(
            client.clone(),
            &opts.lease_namespace,
            &opts.lease_name,
            &opts.identity,
            opts.lease,
        )
    });
    if let Some(e) = elector.as_mut() {
        // A standby is ready: it is doing its job, which is waiting.
        ready.store(true, Ordering::Relaxed);
        tracing::info!(lease = %format!("{}/{}", opts.lease_namespace, opts.lease_name), identity = %opts.identity, "waiting for the leader Lease");
        let mut stop = stop_rx.clone();
        if !e.acquire(&mut stop).await {
            let _ = http.await;
            tracing::info!("stopped before leading");
            return Ok(());
        }
        tracing::info!(identity = %opts.identity, "leading");
    }
    ready.store(false, Ordering::Relaxed);
    metrics.leader.store(true, Ordering::Relaxed);

    let hold = {
        let stop_tx = stop_tx.clone();
        let mut stop = stop_rx.clone();
        async move {
            let Some(mut e) = elector else {
                return (None, Ok(()));
            };
            let held = e.hold(&mut stop).await;
            if let Err(lost) = &held {
                tracing::error!(error = %lost, "stopping the controller");
                let _ = stop_tx.send(true);
            }
            (Some(e), held)
        }
    };
    let approver = opts.attest_fleet_ca.clone().map(|ca| {
        tokio::spawn(super::approve::run(
            client.clone(),
            ca,
            opts.attest_record_namespace.clone(),
            metrics.clone(),
            stop_rx.clone(),
        ))
    });
    let serving_approver = opts.approve_serving.then(|| {
        tokio::spawn(super::approve::run_serving(
            client.clone(),
            metrics.clone(),
            stop_rx.clone(),
        ))
    });
    let controller = async {
        run_controller(client, &opts, metrics.clone(), ready, stop_rx).await;
        if let Some(a) = approver {
            let _ = a.await;
        }
        if let Some(a) = serving_approver {
            let _ = a.await;
        }
    };
    tokio::pin!(controller, hold);
    // `hold` ends when stop fires (shutdown, or the Lease lost), and so does the controller.
    let mut controller_done = false;
    let (elector, held) = tokio::select! {
        r = &mut hold => r,
        () = &mut controller => {
            controller_done = true;
            hold.await
        }
    };
    // A shutdown lets running reconciles finish, within reason. A lost Lease does not: another
    // replica may be leading already, so whatever is still in flight is dropped now.
    let grace = if held.is_ok() {
        SHUTDOWN_GRACE
    } else {
        Duration::ZERO
    };
    if !controller_done && tokio::time::timeout(grace, &mut controller).await.is_err() {
        tracing::warn!(?grace, "not waiting any longer for running reconciles");
    }
    metrics.leader.store(false, Ordering::Relaxed);
    if let (Some(mut e), Ok(())) = (elector, &held) {
        e.release().await;
    }
    let _ = http.await;
    tracing::info!("stopped");
    held.map_err(ControllerError::from)
}

type Request = Result<ReconcileRequest<DaemonSet>, watcher::Error>;
type Requests = Pin<Box<dyn futures_util::Stream<Item = Request> + Send>>;

fn request(ns: &str, name: &str, reason: &str) -> ReconcileRequest<DaemonSet> {
    ReconcileRequest {
        obj_ref: ObjectRef::new(name).within(ns),
        reason: ReconcileReason::Custom {
            reason: reason.to_string(),
        },
    }
}

/// Turns a reflector's events into reconcile requests with `map`, passing errors through.
fn requests<K: Send + 'static>(
    events: impl futures_util::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
    mut map: impl FnMut(watcher::Event<K>) -> Vec<ReconcileRequest<DaemonSet>> + Send + 'static,
) -> Requests {
    events
        .flat_map(move |ev| {
            let out: Vec<Request> = match ev {
                Ok(ev) => map(ev).into_iter().map(Ok).collect(),
                Err(e) => vec![Err(e)],
            };
            stream::iter(out)
        })
        .boxed()
}

/// The controlling DaemonSet of an object, as a reconcile request.
fn owner_request(meta: &ObjectMeta, what: &str) -> Option<ReconcileRequest<DaemonSet>> {
    let owner = meta
        .owner_references
        .as_ref()?
        .iter()
        .find(|o| o.controller == Some(true) && o.kind == "DaemonSet")?;
    Some(request(meta.namespace.as_deref()?, &owner.name, what))
}

/// Strips what the controller never reads from a cached object's metadata.
fn slim(meta: &mut ObjectMeta) {
    meta.managed_fields = None;
}

async fn run_controller(
    client: Client,
    opts: &Options,
    metrics: Arc<Metrics>,
    ready: Arc<AtomicBool>,
    stop: watch::Receiver<bool>,
) {
    let (ds_reader, ds_writer) = reflector::store::<DaemonSet>();
    let (pod_reader, pod_writer) = reflector::store::<Pod>();
    let (node_reader, node_writer) = reflector::store::<Node>();
    let (cr_reader, cr_writer) = reflector::store::<ControllerRevision>();
    let (synced_tx, synced_rx) = watch::channel(false);
    let ctx = Arc::new(Ctx {
        synced: synced_rx,
        client: client.clone(),
        pods: pod_reader.clone(),
        nodes: node_reader.clone(),
        revisions: cr_reader.clone(),
        pending: Mutex::new(Pending::default()),
        metrics: metrics.clone(),
        identity: opts.identity.clone(),
        resync: opts.resync,
        warned: Mutex::new(HashSet::new()),
        event_seq: AtomicU64::new(0),
    });
    let wc = watcher::Config::default().any_semantic();

    let ds_ctx = ctx.clone();
    let ds_events = reflector::reflector(
        ds_writer,
        watcher(Api::<DaemonSet>::all(client.clone()), wc.clone())
            .modify(|d| slim(&mut d.metadata))
            .default_backoff(),
    );
    let ds_requests = requests(ds_events, move |ev| match ev {
        watcher::Event::Apply(ds) | watcher::Event::InitApply(ds) => {
            vec![ReconcileRequest {
                obj_ref: ObjectRef::from_obj(&ds),
                reason: ReconcileReason::ObjectUpdated,
            }]
        }
        watcher::Event::Delete(ds) => {
            let key = format!("{}/{}", ds.namespace().unwrap_or_default(), ds.name_any());
            lock(&ds_ctx.pending).forget(&key);
            ds_ctx
                .metrics
                .set_daemonset(&ds.namespace().unwrap_or_default(), &ds.name_any(), None);
            Vec::new()
        }
        watcher::Event::Init | watcher::Event::InitDone => Vec::new(),
    });

    // DaemonSet pods carry the revision hash label; pods of other workloads are not cached.
    let pod_events = reflector::reflector(
        pod_writer,
        watcher(
            Api::<Pod>::all(client.clone()),
            wc.clone().labels(crate::object::REVISION_HASH_LABEL),
        )
        .modify(views::slim_pod)
        .default_backoff(),
    );
    let pod_requests = requests(pod_events, |ev| match ev {
        watcher::Event::Apply(p) | watcher::Event::InitApply(p) | watcher::Event::Delete(p) => {
            owner_request(&p.metadata, "pod changed")
                .into_iter()
                .collect()
        }
        watcher::Event::Init | watcher::Event::InitDone => Vec::new(),
    });

    let cr_events = reflector::reflector(
        cr_writer,
        watcher(Api::<ControllerRevision>::all(client.clone()), wc.clone())
            .modify(|c| slim(&mut c.metadata))
            .default_backoff(),
    );
    let cr_requests = requests(cr_events, |ev| match ev {
        watcher::Event::Apply(c) | watcher::Event::InitApply(c) | watcher::Event::Delete(c) => {
            owner_request(&c.metadata, "controllerrevision changed")
                .into_iter()
                .collect()
        }
        watcher::Event::Init | watcher::Event::InitDone => Vec::new(),
    });

    // Nodes: only a change of readiness matters, and it matters to every DaemonSet with a pod
    // on the node. Heartbeat-only updates map to nothing.
    let node_events = reflector::reflector(
        node_writer,
        watcher(Api::<Node>::all(client.clone()), wc.clone())
            .modify(views::slim_node)
            .default_backoff(),
    );
    let mut last_ready: HashMap<String, bool> = HashMap::new();
    let node_pods = pod_reader.clone();
    let node_requests = requests(node_events, move |ev| {
        let (name, flipped) = match &ev {
            watcher::Event::Apply(n) | watcher::Event::InitApply(n) => {
                let ready = views::node_ready(n);
                let before = last_ready.insert(n.name_any(), ready);
                let flipped = matches!(ev, watcher::Event::Apply(_)) && before != Some(ready);
                if flipped {
                    tracing::info!(node = %n.name_any(), ready, "node readiness changed");
                }
                (n.name_any(), flipped)
            }
            watcher::Event::Delete(n) => {
                last_ready.remove(&n.name_any());
                (n.name_any(), true)
            }
            watcher::Event::Init | watcher::Event::InitDone => return Vec::new(),
        };
        if !flipped {
            return Vec::new();
        }
        let mut seen = HashSet::new();
        node_pods
            .state()
            .iter()
            .filter(|p| views::pod_node(p).as_deref() == Some(name.as_str()))
            .filter_map(|p| owner_request(&p.metadata, "node readiness changed"))
            .filter(|r| seen.insert(r.obj_ref.clone()))
            .collect()
    });

    let mut stop_queue = stop.clone();
    let queue = stream::select_all([ds_requests, pod_requests, cr_requests, node_requests])
        .take_until(async move {
            let _ = stop_queue.wait_for(|s| *s).await;
        });

    // One task waits for the stores and tells everyone else through a watch channel: a kube-rs
    // store wakes only the last of several concurrent `wait_until_ready` callers.
    let (pods, nodes, revisions) = (pod_reader.clone(), node_reader.clone(), cr_reader.clone());
    let synced = tokio::spawn(async move {
        let ok = pods.wait_until_ready().await.is_ok()
            && nodes.wait_until_ready().await.is_ok()
            && revisions.wait_until_ready().await.is_ok();
        if ok {
            ready.store(true, Ordering::Relaxed);
            let _ = synced_tx.send(true);
            tracing::info!(
                pods = pods.len(),
                nodes = nodes.len(),
                controllerrevisions = revisions.len(),
                "caches synced"
            );
        }
    });

    let config = controller::Config::default().debounce(opts.debounce);
    let mut results = controller::applier(
        |ds, ctx| reconcile(ds, ctx).boxed(),
        error_policy,
        ctx,
        ds_reader,
        queue,
        config,
    )
    .boxed();
    while let Some(r) = results.next().await {
        match r {
            Ok((obj, action)) => tracing::trace!(daemonset = %obj, ?action, "reconciled"),
            Err(controller::Error::QueueError(e)) => {
                tracing::warn!(error = %e, "watch failed; retrying with backoff")
            }
            Err(controller::Error::ReconcilerFailed(e, obj)) => {
                tracing::warn!(daemonset = %obj, error = %e, "reconcile failed; retrying")
            }
            Err(e) => tracing::debug!(error = %e, "applier"),
        }
    }
    synced.abort();
}

fn error_policy(_ds: Arc<DaemonSet>, _e: &ReconcileError, ctx: Arc<Ctx>) -> Action {
    inc(&ctx.metrics.reconcile_errors);
    Action::requeue(Duration::from_secs(5))
}

/// `/metrics`, `/healthz` and `/readyz` over plain HTTP/1.1, until `stop`.
async fn serve_http(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    ready: Arc<AtomicBool>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let tcp = tokio::select! {
            r = listener.accept() => match r {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    tracing::debug!(error = %e, "accept failed");
                    continue;
                }
            },
            _ = stop.wait_for(|s| *s) => return,
        };
        let metrics = metrics.clone();
        let ready = ready.clone();
        tokio::spawn(async move {
            let svc =
                hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let (code, body) = match (req.method() == hyper::Method::GET, req.uri().path())
                    {
                        (true, "/metrics") => (200, metrics.render()),
                        (true, "/healthz") => (200, "ok\n".to_string()),
                        (true, "/readyz") if ready.load(Ordering::Relaxed) => (200, "ok\n".into()),
                        (true, "/readyz") => (503, "caches not synced\n".into()),
                        (true, _) => (404, "not found\n".into()),
                        (false, _) => (405, "method not allowed\n".into()),
                    };
                    let resp = hyper::Response::builder()
                        .status(code)
                        .header("content-type", "text/plain; version=0.0.4")
                        .body(Full::new(Bytes::from(body)));
                    async move { resp }
                });
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(tcp), svc);
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "metrics connection");
            }
        });
    }
}
