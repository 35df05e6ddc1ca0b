//! The upgrade engine: carries out the upgrade requests the local API records, offline too.
//!
//! Each active request is driven by its own task: it holds the pod (the runtime leaves a held
//! pod alone), reads the journal row and the runtime's state, asks the pure
//! [`machine::next`] for one step, and carries it out; a state change is a compare-and-set on
//! the journal row committed (with the Events and the revision it reports) before the side
//! effect it describes. After a crash or a power cut the tasks start again from the journal
//! and the runtime's state, before the runtime's first pass ([`Engine::claim_active`]).
//!
//! In place (only images differ): only the changed containers are replaced, in the running
//! sandbox, so the pod's IP, volumes and other containers stay. A committed upgrade records
//! the revision the pod now runs (the runtime map), so the runtime keeps running the new
//! images and `GET /pods` shows `PodNeedUpgrade` False, until the cloud catches up.

mod inputs;
pub mod machine;
pub mod plan;
mod prepull;
mod record;
pub mod steps;
pub mod txn;
mod txn_watch;

pub use prepull::{registry_of, target_images};

use crate::cri::{CriError, CriRuntime};
use crate::need_upgrade::Decider;
use crate::object::Kind;
use crate::pod::desired::{self, Place};
use crate::pod::observe::Observer;
use crate::pod::running::RunningAs;
use crate::pod::{Holder, PodLocks};
use crate::podspec::{self, PodPlan};
use crate::store::{
    Effects, QueuedEvent, RequestKind, RequestRecord, RunningRevision, Store, StoreError,
    StoredObject,
};
use machine::{Deadlines, Journal, State, Step};
use plan::{Mode, UpgradePlan};
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;

#[derive(Debug, thiserror::Error)]
pub enum UpgradeError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Cri(#[from] CriError),
    #[error("journal row {0} has an unknown state {1:?}")]
    BadState(i64, String),
}

/// The engine's settings (`[upgrade]` in the config file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpgradeConfig {
    pub deadlines: Deadlines,
    /// The least time new containers must hold, whatever the DaemonSet's minReadySeconds.
    pub min_ready_floor: Duration,
    /// How often a driving task looks again while it waits.
    pub poll: Duration,
    /// While online, pull a new update revision's images as soon as it appears.
    pub prepull: bool,
    /// A transaction's commit deadline when it asks for none: nobody committing within it
    /// rolls the transaction back.
    pub manual_commit_deadline: Duration,
}

impl Default for UpgradeConfig {
    fn default() -> Self {
        UpgradeConfig {
            deadlines: Deadlines::default(),
            min_ready_floor: Duration::from_secs(2),
            poll: Duration::from_millis(200),
            prepull: true,
            manual_commit_deadline: Duration::from_secs(1800),
        }
    }
}

pub struct Engine<R: CriRuntime> {
    pub cri: Arc<R>,
    pub store: Arc<Store>,
    pub locks: PodLocks,
    pub node_name: String,
    pub data_dir: PathBuf,
    pub host_ip: Option<String>,
    pub config: UpgradeConfig,
    /// The apiserver link: pre-pulls start only while it is up (a registry is then likely to
    /// answer too).
    pub link: Option<watch::Receiver<crate::link::LinkState>>,
}

/// What a driving task works from, read again each round.
struct Context {
    pod: StoredObject,
    plan: UpgradePlan,
    /// The pod as it runs before the upgrade (for a rollback), and after it, as JSON.
    running_json: Value,
    target_json: Value,
    /// The uid the pod's directory is named by (a pod that adopted another's sandbox keeps
    /// that pod's directory).
    dir_uid: Option<String>,
}

/// Both revisions translated for the runtime, each `Err(why)` when it cannot be now (a
/// ConfigMap it references is not cached).
struct Plans {
    old: Result<PodPlan, String>,
    target: Result<PodPlan, String>,
    /// A revision can never run as it is (a field edgehub does not run, a Secret known to
    /// be absent), rather than not yet.
    permanent: Option<String>,
    /// The target's translation context (a recreate runs a sandbox from it).
    target_ctx: podspec::PodContext,
}

/// Why a round cannot work from the cache.
enum Blocked {
    /// The cache cannot say yet (it has not seen this node's pod list since it was created):
    /// nothing is decided, the upgrade waits as it is.
    Wait(String),
    /// The upgrade cannot happen: the pod is gone, or its journal row cannot be read.
    End(String),
}

/// A driving task's own memory between rounds.
struct Drive {
    readiness: steps::Readiness,
    /// Store changes: a wait ends early when something changed (a transaction's decision, the
    /// cache), so a decision is carried out at once, not a poll later.
    changes: watch::Receiver<u64>,
    observer: Observer,
    /// The engine holds the pod (from the first step that touches a container).
    held: bool,
    last_error: String,
}

fn now_ms() -> i64 {
    crate::time::now_ms()
}

/// Whether an upgrade in `state` must hold its pod: from the first step that touches a
/// container. Requested and Pulling leave the runtime free to restart, probe and report it.
fn holds_pod(state: State) -> bool {
    !matches!(state, State::Requested | State::Pulling) && !state.is_terminal()
}

fn past(deadline: Option<i64>, now: i64) -> bool {
    deadline.is_some_and(|d| now >= d)
}

impl<R: CriRuntime + 'static> Engine<R> {
    /// Holds every pod with an unfinished upgrade for the engine, before the runtime's first
    /// pass: after a crash, the runtime must not "repair" a half-swapped pod.
    pub fn claim_active(&self) -> Result<usize, StoreError> {
        let mut n = 0;
        for r in self.store.active_requests()? {
            let touching = State::parse(&r.state).is_some_and(holds_pod);
            if r.kind == RequestKind::Upgrade
                && touching
                && self.locks.try_hold(&r.pod_uid, Holder::Upgrade)
            {
                n += 1;
            }
        }
        Ok(n)
    }

    /// Drives every active request, on every cache change and link change, and every second
    /// while something is under way (a request driven, a transaction's deadline counting, a
    /// look that failed), until shutdown. An idle node's engine sleeps until the store or the
    /// link changes: its look once a second (two SQLite reads) was 4 % of the idle process's
    /// CPU samples, and each one a wake-up of the runtime (benches/idle.rs under `perf record`).
    pub async fn run(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        let mut changes = self.store.subscribe();
        let mut link = self.link.clone();
        let mut driving: HashMap<i64, JoinHandle<()>> = HashMap::new();
        // The cache generation and link state the runtime map and the pre-pulls were last
        // looked at for: both read every pod and DaemonSet, which an idle node must not do
        // once a second.
        let mut looked: Option<(u64, bool)> = None;
        loop {
            // Seen now, so that the wait below ends on the next change, not on this one.
            if let Some(l) = link.as_mut() {
                l.borrow_and_update();
            }
            changes.borrow_and_update();
            driving.retain(|_, h| !h.is_finished());
            let mut busy = false;
            match self.store.active_requests() {
                Ok(active) => {
                    for r in active {
                        if driving.contains_key(&r.id) {
                            continue;
                        }
                        let me = self.clone();
                        let id = r.id;
                        let task = match r.kind {
                            RequestKind::Upgrade => tokio::spawn(me.drive(r)),
                            RequestKind::ImagePull => tokio::spawn(me.prepull(r)),
                        };
                        driving.insert(id, task);
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read the upgrade requests");
                    busy = true;
                }
            }
            match self.watch_transactions() {
                Ok(undecided) => busy |= undecided,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot look at the open transactions");
                    busy = true;
                }
            }
            busy |= !driving.is_empty();
            let now = (*changes.borrow(), self.online());
            if looked != Some(now) {
                let tidied = self.tidy();
                if let Err(e) = &tidied {
                    tracing::warn!(error = %e, "cannot tidy the runtime map");
                }
                let requested = self.request_prepulls();
                if let Err(e) = &requested {
                    tracing::warn!(error = %e, "cannot request pre-pulls");
                }
                // A failure is looked at again on the next tick.
                looked = (tidied.is_ok() && requested.is_ok()).then_some(now);
                busy |= looked.is_none();
            }
            let link_changed = async {
                let gone = match link.as_mut() {
                    Some(l) => l.changed().await.is_err(),
                    None => true,
                };
                if gone {
                    // No link (offline-only), or its sender is gone: nothing to wait for.
                    std::future::pending::<()>().await;
                }
            };
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(1)), if busy => {}
                r = changes.changed() => { if r.is_err() { break; } }
                _ = link_changed => {}
                _ = shutdown.changed() => break,
            }
        }
        // A task stops between steps; the journal says where, and the next start resumes.
        for (_, t) in driving {
            t.abort();
        }
    }

    fn online(&self) -> bool {
        self.link
            .as_ref()
            .is_some_and(|l| matches!(*l.borrow(), crate::link::LinkState::Online))
    }

    /// Forgets the revision a pod ran on the device once its cached pod has caught up (the
    /// cloud heard) or is gone.
    fn tidy(&self) -> Result<(), StoreError> {
        // A cache that has not seen the pod list since it was created (a reset cache) says
        // nothing about which pods are gone.
        if !self.sources_ready()? {
            return Ok(());
        }
        for r in self.store.running_revisions()? {
            if r.awaiting_since_ms.is_some() {
                // Deleted for its replacement to adopt it: the runtime closes it.
                continue;
            }
            let done = match self.store.get_by_uid(Kind::Pod, &r.pod_uid)? {
                None => true,
                Some(p) => p.index.revision_hash.as_deref() == Some(r.hash.as_str()),
            };
            if done {
                self.store.forget_running_revision(&r.pod_uid)?;
            }
        }
        Ok(())
    }

    /// Whether the cache has seen this node's pod list since it was created ("sources ready"):
    /// only then does a pod missing from it mean the pod is gone.
    fn sources_ready(&self) -> Result<bool, StoreError> {
        Ok(self
            .store
            .cursor(&crate::sync::pods_cursor_key(&self.node_name))?
            .is_some())
    }

    /// Drives one upgrade to a terminal state, holding its pod from the first step that
    /// touches a container.
    async fn drive(self: Arc<Self>, req: RequestRecord) {
        let uid = req.pod_uid.clone();
        let mut st = Drive {
            readiness: steps::Readiness::default(),
            changes: self.store.subscribe(),
            observer: Observer::default(),
            // Claimed before the runtime's first pass, after a restart.
            held: self.locks.holder(&uid) == Some(Holder::Upgrade),
            last_error: String::new(),
        };
        loop {
            match self.round(req.id, &mut st).await {
                Ok(true) => break,
                Ok(false) => st.last_error.clear(),
                Err(e) => {
                    // Said once per cause, not every second while the runtime is away.
                    let msg = match &e {
                        UpgradeError::Cri(c) => format!("the container runtime: {c}"),
                        other => other.to_string(),
                    };
                    if msg != st.last_error {
                        tracing::warn!(upgrade = req.id, upgrade_uid = %req.uid, pod = %req.name, error = %msg, "upgrade cannot go on yet; retrying");
                        if let Err(e) = self.store.set_request_waiting(req.id, Some(&msg)) {
                            tracing::warn!(upgrade = req.id, error = %e, "cannot record why the upgrade waits");
                        }
                        st.last_error = msg;
                    }
                    // What the observer knew may be stale once the runtime failed.
                    st.observer.forget();
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
        if st.held {
            self.locks.release(&uid, Holder::Upgrade);
        }
    }

    /// Waits a poll, or less when the store changes.
    async fn pause(&self, st: &mut Drive) {
        self.pause_for(st, self.config.poll).await
    }

    /// Waits `d`, or less when the store changes.
    async fn pause_for(&self, st: &mut Drive, d: Duration) {
        let changed = async {
            if st.changes.changed().await.is_err() {
                // The store is gone: only the poll is left.
                std::future::pending::<()>().await;
            }
        };
        tokio::select! {
            _ = tokio::time::sleep(d) => {}
            _ = changed => {}
        }
    }

    /// Records why the upgrade cannot go on now (`None`: it can), for `GET .../upgrade`.
    fn waiting(&self, rec: &RequestRecord, why: Option<&str>) -> Result<(), StoreError> {
        if rec.waiting.as_deref() != why {
            self.store.set_request_waiting(rec.id, why)?;
        }
        Ok(())
    }

    /// One step. Returns whether the upgrade has ended.
    async fn round(&self, id: i64, st: &mut Drive) -> Result<bool, UpgradeError> {
        let Some(rec) = self.store.request(id)? else {
            return Ok(true);
        };
        let state = State::parse(&rec.state)
            .ok_or_else(|| UpgradeError::BadState(id, rec.state.clone()))?;
        if state.is_terminal() {
            return Ok(true);
        }
        // A transaction's upgrade starts once the one before it is Verified, and goes on as
        // the transaction decides.
        let gate = self.store.transaction_of(id)?.map(|t| txn::gate(&t, id));
        if let Some(g) = gate
            .as_ref()
            .filter(|g| state == State::Requested && !g.turn && g.verdict.is_none())
        {
            // No deadline yet: the wait for its turn is not the state's time.
            let why = format!(
                "waiting for {} of its transaction to be Verified",
                g.after.as_deref().unwrap_or("the pod before it")
            );
            self.waiting(&rec, Some(&why))?;
            self.pause(st).await;
            return Ok(false);
        }
        let clock = crate::time::boot_ms();
        let hold_ms = rec
            .plan
            .as_deref()
            .and_then(|p| serde_json::from_str::<UpgradePlan>(p).ok())
            .map(|p| p.hold_ms)
            .unwrap_or(0);
        // Every state's deadline is on this boot's clock. A row without one (a new request)
        // or with one from another boot (a reboot mid-upgrade: how much of it is left is
        // unknown) gets the state's whole budget from now.
        let deadline = match rec.deadline() {
            Some(d) => Some(d),
            None => match self
                .config
                .deadlines
                .of(state, Duration::from_millis(hold_ms))
            {
                Some(budget) => {
                    if rec.deadline_from_another_boot() {
                        tracing::info!(upgrade = id, pod = %rec.name, state = %state,
                            "the deadline was set in another boot; the state's budget starts again");
                    }
                    let at = clock + budget.as_millis() as i64;
                    self.store
                        .set_request_deadline(id, state.as_str(), Some(at))?;
                    Some(at)
                }
                None => None,
            },
        };

        // The pod is held from the first step that touches a container. The runtime may be in
        // the middle of something for it: wait, within the state's deadline.
        if holds_pod(state) && !st.held {
            if self.locks.try_hold(&rec.pod_uid, Holder::Upgrade) {
                st.held = true;
            } else {
                if past(deadline, clock) {
                    self.timed_out(&rec, state, "the pod runtime kept the pod busy")?;
                } else {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                return Ok(false);
            }
        }

        let mut journal = Journal {
            state,
            deadline_ms: deadline,
            ready_since_ms: rec.ready_since(),
            hold: Duration::from_millis(hold_ms),
            manual: gate.is_some(),
            verdict: gate.as_ref().and_then(|g| g.verdict.clone()),
            turn: gate.as_ref().is_none_or(|g| g.turn),
        };
        let ctx = match self.context(&rec)? {
            Ok(c) => c,
            Err(Blocked::Wait(why)) => {
                self.waiting(&rec, Some(&why))?;
                tokio::time::sleep(Duration::from_secs(1)).await;
                return Ok(false);
            }
            Err(Blocked::End(why)) => {
                // Nothing changed yet, or the pod is gone and its sandbox goes with it.
                let to = if matches!(state, State::Requested | State::Pulling) {
                    State::RolledBack
                } else {
                    State::Failed
                };
                self.go(&rec, state, to, Some(why), None, None)?;
                return Ok(true);
            }
        };
        journal.hold = Duration::from_millis(ctx.plan.hold_ms);
        // The transaction's decision needs nothing of the runtime: carried out at once, even
        // while the runtime does not answer.
        if let Some(step) = machine::decided(&journal) {
            match step {
                Step::Go(to, error) => self.go(&rec, state, to, error, Some(&ctx), None)?,
                _ => self.pause(st).await,
            }
            return Ok(false);
        }
        let now = match steps::pod_now(
            &mut st.observer,
            &*self.cri,
            &self.node_name,
            &self.data_dir.join("pods"),
            &rec.pod_uid,
            self.store.pod_aliases()?,
        )
        .await
        {
            Ok(n) => n,
            Err(e) => {
                // A runtime that does not answer cannot be observed, but the deadline holds.
                if past(deadline, clock) {
                    self.timed_out(&rec, state, &format!("the container runtime: {e}"))?;
                    return Ok(false);
                }
                return Err(e.into());
            }
        };
        let plans = self.translate(&ctx, &now, &rec.uid)?;
        if let (Some(why), State::Requested | State::Pulling) = (&plans.permanent, state) {
            // Nothing changed yet, and waiting would not help.
            self.go(
                &rec,
                state,
                State::RolledBack,
                Some(why.clone()),
                Some(&ctx),
                None,
            )?;
            return Ok(true);
        }
        let observed = steps::observe(
            &*self.cri,
            &now,
            &ctx.plan,
            plans.target.as_ref().map_err(String::as_str),
            plans.old.as_ref().map_err(String::as_str),
            &rec.uid,
            steps::Look::at(state),
            &mut st.readiness,
        )
        .await?;
        let step = machine::next(&journal, &observed, crate::time::boot_ms());
        tracing::debug!(upgrade = id, pod = %rec.name, state = %state, step = ?step, "upgrade step");
        // What stands in the way while the machine waits, for the OTA manager to read.
        let blocked_by = match &step {
            Step::Wait => observed
                .target_unavailable
                .as_deref()
                .or(observed.old_unavailable.as_deref()),
            _ => None,
        };
        self.waiting(&rec, blocked_by)?;
        let point = step_name(&step);
        // The crash-point sweep kills edgehub before a step's side effect as well as after
        // it (a transition's "before" is the previous step's "after").
        if !matches!(step, Step::Go(..) | Step::Wait) {
            crate::failpoint::hit(&format!("upgrade:before:{point}"));
        }
        let cri = &*self.cri;
        let upgrade_uid = rec.uid.as_str();
        // The old revision's grace period, whatever the target says.
        let grace = plans
            .old
            .as_ref()
            .map(|p| p.grace_period_secs)
            .unwrap_or_else(|_| desired::grace_of(&ctx.running_json));
        match step {
            Step::Go(to, error) => {
                // From Swapping on the engine holds the pod; the next round takes the hold
                // and looks again before it touches anything.
                let plan = match (state, to) {
                    (State::Pulling, State::Swapping) => {
                        Some(self.without_noops(&ctx, &now).await?)
                    }
                    // The pod stopped running while Verified (a reboot): its new revision
                    // starts again as a new sandbox from the target spec.
                    (State::Verified, State::Swapping) if ctx.plan.mode == Mode::InPlace => {
                        tracing::info!(upgrade = id, pod = %rec.name,
                            "the pod no longer runs; its new revision starts again in a new sandbox");
                        let again = plan::rerun(&ctx.plan, &ctx.target_json);
                        Some(serde_json::to_string(&again).unwrap_or_default())
                    }
                    _ => None,
                };
                self.go(&rec, state, to, error, Some(&ctx), plan)?;
            }
            Step::Pull(images) => {
                if let Ok(target) = &plans.target {
                    for img in &images {
                        tracing::info!(upgrade = id, pod = %rec.name, image = %img, "pulling");
                        // No longer than the state has left: a registry that accepts and
                        // never answers must not hold the deadline off.
                        let left = deadline
                            .map(|d| {
                                Duration::from_millis((d - crate::time::boot_ms()).max(0) as u64)
                            })
                            .unwrap_or(Duration::MAX);
                        let pulled =
                            match tokio::time::timeout(left, steps::pull(cri, img, target)).await {
                                Ok(r) => r,
                                Err(_) => Err(CriError::Timeout {
                                    method: "PullImage",
                                    timeout: left,
                                }),
                            };
                        if let Err(e) = pulled {
                            tracing::warn!(upgrade = id, image = %img, error = %e, "pull failed; retrying until the deadline");
                            self.waiting(&rec, Some(&format!("pulling {img}: {e}")))?;
                            tokio::time::sleep(self.config.poll.max(Duration::from_secs(1))).await;
                        }
                    }
                }
            }
            Step::CreateNew(name) => {
                if let Some(c) = plans.target.as_ref().ok().and_then(|t| find(t, &name)) {
                    if let Ok(target) = &plans.target {
                        steps::create_new(cri, &now, target, c, upgrade_uid).await?;
                    }
                }
            }
            Step::StopOld(cid) | Step::StopNew(cid) => {
                crate::pod::start::ignore_missing(cri.stop_container(&cid, grace).await)?;
            }
            Step::Start(cid) => cri.start_container(&cid).await?,
            Step::RemoveNew(cid) | Step::RemoveOld(cid) => {
                crate::pod::start::ignore_missing(cri.remove_container(&cid).await)?;
            }
            Step::RestoreOld { name, replace } => {
                if let Ok(old) = &plans.old {
                    if let Some(old_id) = replace {
                        crate::pod::start::ignore_missing(cri.remove_container(&old_id).await)?;
                    }
                    if let Some(c) = find(old, &name) {
                        let fresh = steps::pod_now(
                            &mut st.observer,
                            cri,
                            &self.node_name,
                            &self.data_dir.join("pods"),
                            &rec.pod_uid,
                            self.store.pod_aliases()?,
                        )
                        .await?;
                        steps::restore(cri, &fresh, old, c).await?;
                    }
                }
            }
            Step::CreatePod => {
                match steps::create_pod(
                    cri,
                    &now,
                    &ctx.target_json,
                    plans.target_ctx.clone(),
                    upgrade_uid,
                )
                .await
                {
                    Ok(_) => {}
                    Err(steps::StepFailure::Cri(e)) => return Err(e.into()),
                    Err(steps::StepFailure::Other(why)) => {
                        self.go(&rec, state, State::RollingBack, Some(why), Some(&ctx), None)?;
                    }
                }
            }
            Step::StopPod(sb) => steps::stop_pod(cri, &now, &sb, grace, false).await?,
            Step::StopContainers(sb) => steps::stop_containers(cri, &now, &sb, grace).await?,
            Step::RemovePod(sb) => steps::stop_pod(cri, &now, &sb, grace, true).await?,
            Step::MarkReady(since) => self.store.set_ready_since(id, state.as_str(), since)?,
            // Verified may wait half an hour for the manager: a slower look at the runtime
            // (a decision still wakes it at once).
            Step::Wait if state == State::Verified => {
                self.pause_for(st, self.config.poll.max(Duration::from_secs(1)))
                    .await
            }
            Step::Wait => self.pause(st).await,
        }
        crate::failpoint::hit(&format!("upgrade:step:{point}"));
        Ok(false)
    }
}

/// A step's name, for logs and failpoints.
fn step_name(s: &Step) -> &'static str {
    match s {
        Step::Go(..) => "Go",
        Step::Pull(_) => "Pull",
        Step::CreateNew(_) => "CreateNew",
        Step::StopOld(_) => "StopOld",
        Step::Start(_) => "Start",
        Step::StopNew(_) => "StopNew",
        Step::RemoveNew(_) => "RemoveNew",
        Step::RestoreOld { .. } => "RestoreOld",
        Step::RemoveOld(_) => "RemoveOld",
        Step::CreatePod => "CreatePod",
        Step::StopPod(_) => "StopPod",
        Step::StopContainers(_) => "StopContainers",
        Step::RemovePod(_) => "RemovePod",
        Step::MarkReady(_) => "MarkReady",
        Step::Wait => "Wait",
    }
}

fn find<'a>(p: &'a PodPlan, name: &str) -> Option<&'a podspec::ContainerPlan> {
    p.containers
        .iter()
        .chain(&p.init_containers)
        .find(|c| c.name == name)
}
