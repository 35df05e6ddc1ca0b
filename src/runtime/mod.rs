//! The pod runtime: edgehub is the node agent, so it runs the node's pods itself, from the
//! cache, with or without a link. Each pass:
//!
//! 1. [`observe`] reads the container runtime once into a snapshot (edgehub's objects only);
//! 2. [`desired`] reads the cached pods, each pod's JSON once, and translates them;
//! 3. [`decide`] (pure) turns both into actions;
//! 4. [`act`] carries out each pod's actions in that pod's own task, a bounded number at a
//!    time, so no pod waits on another's pull or grace period, and never two tasks for one pod;
//!    a task that pulls leaves that bound for one of pulls ([`slots`]), so slow pulls never
//!    hold up another pod's probes and restarts;
//! 5. [`status`] (pure) computes each settled pod's status; it is queued only when it differs
//!    from what the apiserver holds, and [`report`] delivers it in a task of its own.
//!
//! A pod can be held by someone else: [`PodLocks`] is shared with the upgrade engine, and a
//! pod the engine holds gets no action, no status and no cleanup from the runtime.
//!
//! What the runtime reports (statuses, Warning Events) is written to the store, and a store
//! that cannot write (a full disk) stops none of it: restarts, starts, stops and probes carry
//! on, and the reports wait in memory ([`Owed`]) and are written once the store can again.
//!
//! Until the pod list has completed since the cache was created ("sources ready"), nothing
//! edgehub runs is stopped for being missing from the cache: an empty cache (a new data dir,
//! `--reset-cache`, a corrupt file moved aside) must not kill a vehicle's workloads.

pub mod act;
pub mod decide;
mod inputs;
mod outcome;
mod reads;
mod report;

use report::Owed;

pub use crate::backoff::BackoffPolicy;

use crate::cri::{CriError, CriRuntime};
use crate::kube::ApiClient;
use crate::object::Kind;
use crate::pod::desired::DesiredPod;
use crate::pod::observe::Observer;
use crate::pod::probes::ContainerProbes;
use crate::pod::{desired, observe, probes, slots, status};
use crate::pod::{Holder, PodLocks};
use crate::podspec::{Missing, PlanError, Unsupported};
use crate::store::{QueuedEvent, QueuedStatus, Store, StoredObject};
use decide::{Action, Inputs, Memory, Restarts};
use reads::StoreReads;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tokio::task::JoinSet;

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(transparent)]
    Cri(#[from] CriError),
    #[error("cache: {0}")]
    Store(#[from] crate::store::StoreError),
}

/// What one pass did, for logs and tests.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Pass {
    pub sandboxes_created: usize,
    pub containers_started: usize,
    pub containers_restarted: usize,
    pub pods_removed: usize,
    pub pods_finalized: usize,
    /// File volumes rewritten (a renewed token, an edited ConfigMap).
    pub volumes_updated: usize,
    /// Pods waiting for a ConfigMap, Secret or token edgehub does not have.
    pub missing: Vec<(String, Missing)>,
    /// Pods the runtime or the host refused (image pull, container creation, volumes), and
    /// why.
    pub failed: Vec<(String, String)>,
    /// Liveness and readiness probes run.
    pub probes_run: usize,
    /// Containers stopped because their liveness probe failed.
    pub liveness_kills: usize,
    /// Pods that cannot run, and why.
    pub unsupported: Vec<(String, Unsupported)>,
    /// Sandboxes left running because the cache has not seen a full pod list yet.
    pub kept_unsynced: usize,
}

/// The desired pods of a pass, and what they were read from.
struct DesiredCache {
    pods: Arc<Vec<DesiredPod>>,
    store_gen: u64,
    sandboxes: u64,
    read_at: Instant,
}

/// Desired pods older than this are read again even if nothing said they changed: a write
/// that forgot to bump the store's counter costs at most this much delay, not a pod.
const DESIRED_MAX_AGE: Duration = Duration::from_secs(60);

pub struct Reconciler<R: CriRuntime> {
    pub cri: Arc<R>,
    pub store: Arc<Store>,
    /// Finishes deletions on the apiserver; `None` runs without one.
    pub client: Option<ApiClient>,
    pub data_dir: PathBuf,
    pub node_name: String,
    pub host_ip: Option<String>,
    pub backoff: BackoffPolicy,
    /// Pods whose actions run at once, not counting those waiting for a pull.
    pub parallel: usize,
    /// Pulls at once, across pods.
    pub parallel_pulls: usize,
    /// How often the runtime is relisted to notice exits, as the kubelet's PLEG does; a pass
    /// follows only when something changed.
    pub relist: Duration,
    /// How long a sandbox whose pod object edgehub deleted waits for the replacement pod to
    /// adopt it (delete-and-adopt) before it is stopped.
    pub adopt_timeout: Duration,
    pub locks: PodLocks,
    observer: Observer,
    restarts: HashMap<(String, String), Restarts>,
    refused: HashMap<String, Restarts>,
    probes: HashMap<(String, String), ContainerProbes>,
    volumes: HashMap<String, u64>,
    /// What was last warned about per pod uid (a Warning Event each time it changes).
    reported: HashMap<String, String>,
    /// The status last queued per pod uid, and the store's [`Store::outbox_taken`] when the
    /// queue was read (`None` until it was): read again once the sender took rows off it, or
    /// a status it dropped would never be queued again until it changed.
    queued: Option<(u64, HashMap<String, Value>)>,
    tasks: JoinSet<act::Outcome>,
    /// The bounds of `parallel` and `parallel_pulls`, made at the first pass.
    pool: Option<slots::Pool>,
    /// A pod's actions waited for a free slot in the last pass.
    deferred: bool,
    /// The pod each task works on (so a task that panicked still releases its pod), and
    /// `decided` when it was spawned.
    task_pods: HashMap<tokio::task::Id, (String, u64)>,
    /// Passes that decided (went past the relist's "nothing changed"), counted: a task whose
    /// pod sat out a decision while it ran makes its pod decided again when it ends.
    decided: u64,
    /// The desired pods as last read, and what they were read from: read again only when the
    /// cache changed (`store_gen`) or a sandbox did, or on the period tick. Reading them is
    /// most of a pass (each pod's JSON parsed and translated, its sources decoded), and an
    /// idle node's passes are its probes'.
    desired: Option<DesiredCache>,
    /// The store's change counter ([`Store::subscribe`]).
    store_gen: watch::Receiver<u64>,
    /// The other store rows a pass decides with, as of a store generation.
    reads: Option<StoreReads>,
    /// [`Self::status_key`] of each pod's status as last queued (or found queued already):
    /// a pod whose key is the same needs no new one.
    status_keys: HashMap<String, u64>,
    /// The runtime failed on the last pass (logged once).
    failing: bool,
    /// Reports the store could not take yet.
    owed: Owed,
    /// Reports could not be written (logged once).
    reports_failing: bool,
    warned_unsynced: bool,
    /// What the last snapshot looked like, so an unchanged relist is not a full pass.
    last_seen: u64,
    /// The next relist is a full pass even if the runtime looks the same: the last pass left
    /// out a pod that was let go during it.
    again: bool,
}

impl<R: CriRuntime + 'static> Reconciler<R> {
    pub fn new(
        cri: R,
        store: Arc<Store>,
        client: Option<ApiClient>,
        data_dir: PathBuf,
        node_name: String,
    ) -> Self {
        Reconciler {
            store_gen: store.subscribe(),
            reads: None,
            cri: Arc::new(cri),
            store,
            client,
            data_dir,
            node_name,
            host_ip: None,
            backoff: BackoffPolicy::default(),
            parallel: 4,
            parallel_pulls: 4,
            relist: Duration::from_secs(1),
            adopt_timeout: Duration::from_secs(600),
            locks: PodLocks::default(),
            observer: Observer::default(),
            restarts: HashMap::new(),
            refused: HashMap::new(),
            probes: HashMap::new(),
            volumes: HashMap::new(),
            reported: HashMap::new(),
            queued: None,
            tasks: JoinSet::new(),
            pool: None,
            deferred: false,
            task_pods: HashMap::new(),
            decided: 0,
            desired: None,
            status_keys: HashMap::new(),
            failing: false,
            owed: Owed::default(),
            reports_failing: false,
            warned_unsynced: false,
            last_seen: 0,
            again: false,
        }
    }

    /// Reconciles on every cache change, every finished task and every `period`, and when a
    /// probe is due, until shutdown. Errors (a dead CRI socket) are logged and retried.
    pub async fn run(mut self, period: Duration, mut shutdown: watch::Receiver<bool>) {
        let mut changes = self.store.subscribe();
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut relist = tokio::time::interval(self.relist.max(Duration::from_millis(100)));
        relist.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let wake_at = probe_wake(self.next_wake(), Instant::now());
            let due = async move {
                match wake_at {
                    Some(t) => tokio::time::sleep_until(t.into()).await,
                    None => std::future::pending().await,
                }
            };
            let pool = self.pool.clone();
            let deferred = self.deferred;
            let freed = async move {
                match pool {
                    Some(p) if deferred => p.freed().await,
                    _ => std::future::pending().await,
                }
            };
            let mut pass = Pass::default();
            let mut forced = true;
            tokio::select! {
                // A pulling task's work slot, for a pod that waited for one.
                _ = freed => {}
                _ = tick.tick() => {}
                _ = relist.tick() => forced = false,
                _ = due => {}
                r = changes.changed() => { if r.is_err() { break; } }
                Some(done) = self.tasks.join_next_with_id() => {
                    // A probe that changed no verdict (an idle node's every task) needs no
                    // pass: the next probe's time wakes the loop.
                    if !self.finished(done, &mut pass) {
                        continue;
                    }
                }
                _ = shutdown.changed() => break,
            }
            let result = self.pass_if(forced, false, &mut pass).await;
            self.log_pass(result, &pass);
            // Every pass relisted: the next relist is due a full interval after this one, so
            // a probe's pass every second (an idle node's) is the only relist it needs.
            relist.reset();
        }
        // Tasks in flight finish their step (a stop, a pull); nothing new starts.
        self.tasks.abort_all();
        while let Some(done) = self.tasks.join_next_with_id().await {
            let mut pass = Pass::default();
            self.finished(done, &mut pass);
        }
    }

    fn log_pass(&mut self, result: Result<(), RuntimeError>, pass: &Pass) {
        match result {
            Ok(()) => {
                if self.failing {
                    tracing::info!("pod runtime reconciling again");
                    self.failing = false;
                }
                if *pass != Pass::default() {
                    tracing::debug!(pass = ?pass, "reconciled");
                }
            }
            Err(e) => {
                if !self.failing {
                    tracing::warn!(error = %e, "pod runtime cannot reconcile; retrying");
                }
                self.failing = true;
                // What the probes and the observer knew is stale once the runtime went away
                // (its ids may be reused). A store that could not be read changes nothing
                // of it: liveness must still reach its threshold.
                if matches!(e, RuntimeError::Cri(_)) {
                    self.probes.clear();
                    self.observer.forget();
                }
            }
        }
    }

    /// One pass that waits for the actions it started: for tests, benchmarks and tools.
    pub async fn reconcile(&mut self) -> Result<Pass, RuntimeError> {
        let mut pass = Pass::default();
        self.pass(true, &mut pass).await?;
        Ok(pass)
    }

    /// When the next probe or the end of a backoff is due, so the loop wakes for it.
    fn next_wake(&self) -> Option<Instant> {
        let probes = self.probes.values().filter_map(ContainerProbes::next_due);
        let waits = self
            .restarts
            .values()
            .chain(self.refused.values())
            .filter_map(|r| r.next_allowed)
            .filter(|t| *t > Instant::now());
        probes.chain(waits).min()
    }

    async fn pass(&mut self, wait: bool, pass: &mut Pass) -> Result<(), RuntimeError> {
        self.pass_if(true, wait, pass).await
    }

    /// A pass; unless `forced`, only when the runtime's state changed since the last one (an
    /// idle relist reads the CRI and nothing else).
    async fn pass_if(
        &mut self,
        forced: bool,
        wait: bool,
        pass: &mut Pass,
    ) -> Result<(), RuntimeError> {
        while let Some(done) = self.tasks.try_join_next_with_id() {
            self.finished(done, pass);
        }
        self.pay_owed();
        let now = Instant::now();
        // Who holds which pod, read before the snapshot: a pod the engine held while the
        // runtime was observed may be mid-swap in it, and must get nothing from this pass
        // even if the engine lets go before the decision.
        let held_before = self.locks.held();
        let mut snapshot = self
            .observer
            .observe(&*self.cri, &self.node_name, &self.data_dir.join("pods"))
            .await?;
        snapshot.apply_aliases(self.reads()?.aliases.clone());
        let seen = snapshot.fingerprint();
        if !forced && !self.again && !self.owed.settled && seen == self.last_seen {
            return Ok(());
        }
        self.last_seen = seen;
        self.again = false;
        self.decided += 1;
        let sources_ready = self.reads()?.sources_ready;
        let desired = self.desired_pods(&snapshot)?;
        let desired = &desired[..];
        probes::track(&mut self.probes, desired, &snapshot, now);
        let awaiting = self.awaiting()?;
        // With those taken since: theirs are no longer the runtime's to act on. A pod let go
        // meanwhile gets its pass on the next relist, from a snapshot taken after.
        let mut held = self.locks.held();
        self.again = held_before.iter().any(|u| !held.contains(u));
        held.extend(held_before);
        held.extend(
            awaiting
                .iter()
                .filter(|a| !a.expired)
                .map(|a| a.label_uid.clone()),
        );
        let ended_upgrades = self.ended_upgrades(&snapshot)?;
        let actions = decide::decide(&Inputs {
            desired,
            snapshot: &snapshot,
            memory: Memory {
                restarts: &self.restarts,
                refused: &self.refused,
                probes: &self.probes,
                volumes: &self.volumes,
            },
            held: &held,
            sources_ready,
            policy: self.backoff,
            now,
            awaiting: &awaiting,
            ended_upgrades: &ended_upgrades,
        });
        self.note_unsynced(desired, &snapshot, sources_ready, &held, pass);

        let by_uid: HashMap<&str, &DesiredPod> = desired.iter().map(|p| (p.uid(), p)).collect();
        // Every settled pod's status reached the store (else the next relist tries again).
        let mut settled_ok = true;
        let mut io: BTreeMap<String, Vec<Action>> = BTreeMap::new();
        for a in actions {
            match a {
                Action::WaitRestart {
                    uid,
                    container,
                    restarts,
                } => {
                    tracing::info!(pod_uid = %uid, container = %container, restarts = restarts.count,
                        "container exited; restarting after backoff");
                    self.restarts.insert((uid, container), restarts);
                }
                Action::Blocked {
                    uid,
                    reason,
                    message,
                    warn,
                    error,
                } => {
                    if let Some(pod) = by_uid.get(uid.as_str()) {
                        settled_ok &= self.blocked(pod, reason, &message, warn);
                        match error {
                            PlanError::Unsupported(u) => {
                                pass.unsupported.push((pod.obj.index.name.clone(), u))
                            }
                            PlanError::Missing(m) => {
                                pass.missing.push((pod.obj.index.name.clone(), m))
                            }
                        }
                    }
                }
                Action::Adopt { label_uid, uid } => {
                    tracing::info!(pod_uid = %uid, adopts = %label_uid,
                        "the replacement pod adopts the running sandbox; nothing restarts");
                    // Not adopted yet (the store cannot write): the next pass decides again.
                    if let Err(e) = self.store.adopt(&label_uid, &uid) {
                        tracing::warn!(pod_uid = %uid, error = %e, "cannot record the adoption; trying again");
                        self.again = true;
                        continue;
                    }
                    if let Some(pod) = by_uid.get(uid.as_str()) {
                        self.link_token_volume(&label_uid, pod);
                    }
                }
                Action::GiveUpAdoption { uid } => {
                    tracing::warn!(pod_uid = %uid,
                        "no replacement pod can adopt the sandbox (none came in time, or one came \
                         at another revision); stopping it");
                    if let Err(e) = self.store.forget_running_revision(&uid) {
                        tracing::warn!(pod_uid = %uid, error = %e, "cannot forget the adoption; trying again");
                        self.again = true;
                    }
                }
                a => io.entry(a.uid().to_string()).or_default().push(a),
            }
        }

        // Settled pods: report their status, unless nothing it is made of changed since the
        // last pass queued them all (an idle node's passes are its probes', which change
        // nothing but a verdict now and then).
        let pulled = self.reads()?.pulled.clone();
        self.status_keys
            .retain(|uid, _| by_uid.contains_key(uid.as_str()));
        let store = self.store.clone();
        let mut decider = crate::need_upgrade::Decider::new(&store);
        for pod in desired {
            let uid = pod.uid();
            if held.contains(uid) || io.contains_key(uid) || self.refused_waiting(uid, now) {
                continue;
            }
            let key = self.status_key(pod, &snapshot, pulled.get(uid));
            if self.status_keys.get(uid) == Some(&key) {
                continue;
            }
            if let Some(Ok(plan)) = &pod.plan {
                let mut ours = status::observed(
                    plan,
                    snapshot.pod(uid),
                    &self.probes,
                    self.host_ip.as_deref(),
                    &snapshot.runtime_name,
                );
                if let Some(hash) = pulled.get(uid) {
                    let target = decider.decide(&pod.obj.index)?;
                    status::image_ready(
                        &mut ours,
                        hash,
                        target.target().filter(|_| target.needed()),
                    );
                }
                match self.queue_status(pod, ours) {
                    Ok(()) => {
                        self.status_keys.insert(uid.to_string(), key);
                    }
                    Err(e) => {
                        self.report_failed(&e);
                        settled_ok = false;
                    }
                }
            }
        }
        self.owed.settled = !settled_ok;

        let env = act::Env {
            cri: self.cri.clone(),
            client: self.client.clone(),
            data_dir: self.data_dir.clone(),
        };
        let (work, pulls) = (self.parallel, self.parallel_pulls);
        let pool = self
            .pool
            .get_or_insert_with(|| slots::Pool::new(work, pulls));
        self.deferred = false;
        for (uid, actions) in io {
            let Some(slot) = pool.try_slot() else {
                // The rest waits for the next pass, which a finishing task or a pull that
                // gives its slot back starts.
                self.deferred = true;
                break;
            };
            if !self.locks.try_hold(&uid, Holder::Runtime) {
                continue;
            }
            let handle =
                self.tasks
                    .spawn(slot.scope(act::run_pod(env.clone(), uid.clone(), actions)));
            self.task_pods.insert(handle.id(), (uid, self.decided));
        }
        if wait {
            while let Some(done) = self.tasks.join_next_with_id().await {
                self.finished(done, pass);
            }
        }
        Ok(())
    }

    /// The adopted containers mount the replaced pod's token volume: the replacement's, under
    /// its new name, is linked to it, so renewed tokens reach them.
    fn link_token_volume(&self, label_uid: &str, pod: &DesiredPod) {
        let raw: Value = serde_json::from_str(&pod.obj.raw).unwrap_or(Value::Null);
        let names = raw
            .pointer("/spec/volumes")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter(|v| v.get("projected").is_some())
            .filter_map(|v| v["name"].as_str());
        let Ok(dir) = desired::pod_dir(&self.data_dir, label_uid) else {
            return;
        };
        let volumes = dir.join("volumes");
        for name in names {
            match crate::volumes::link_adopted_token_volume(&volumes, name) {
                Ok(true) => tracing::info!(pod = %pod.obj.index.name, volume = name,
                    "the adopted containers' token volume now receives the replacement's token"),
                Ok(false) => {}
                Err(e) => tracing::warn!(pod = %pod.obj.index.name, volume = name, error = %e,
                    "cannot link the adopted token volume; its token will not be renewed"),
            }
        }
    }
}

/// When the loop wakes for the next probe: never sooner than shortly after now, so a probe
/// that could not run (the runtime is down) cannot turn the loop into a busy one.
pub fn probe_wake(next_due: Option<Instant>, now: Instant) -> Option<Instant> {
    next_due.map(|t| t.max(now + Duration::from_millis(200)))
}

#[cfg(test)]
mod tests;
