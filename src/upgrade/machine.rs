//! The upgrade's state machine, pure: from the journal row, what the container runtime shows
//! of the pod, and the time, to the one next [`Step`].
//!
//! Nothing is remembered between steps but the journal: every step is derived again from the
//! runtime's actual state, so a step that was cut short by a crash or a power cut is simply
//! decided again, and every step is idempotent. The containers an upgrade creates carry its
//! upgrade id as a label; that is how "new" and "old" are told apart after a restart.
//!
//! ```text
//! Requested -> Pulling -> Swapping -> Verifying -> Committed -> Done
//!     |           |          |            |   \
//!     +-----------+          +------------+    +-> Verified --commit--> Committed
//!     |  (nothing changed yet)          |               |  (a transaction: the OTA
//!     +--> RolledBack                   v               |   manager decides)
//!                                  RollingBack <--------+ rollback, deadline, a failure
//!                                       |
//!                                       +--> RolledBack, or Failed (even the rollback failed)
//! ```
//!
//! An upgrade of a transaction ([`super::txn`]) stops at Verified with the old revision kept,
//! and goes on only as its transaction says ([`decided`]); its members start one after
//! another ([`Journal::turn`]). A rollback ends once the old revision runs and is ready again.
//!
//! Every state but the terminal ones has a deadline, on the boot clock, and every deadline is
//! enforced, even when the runtime does not answer ([`timed_out`]) or an input the upgrade
//! needs never arrives.
//!
//! In place, an init container whose image changes runs once to completion in the running
//! sandbox, before any app container is swapped: exit 0 is success, as for any init
//! container, anything else rolls back. Its old instance completed long ago and is never
//! restored; the pod's app containers carry on as they were.

pub use super::txn::Verdict;
use std::time::Duration;

/// Where an upgrade is. Stored as its name in the journal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum State {
    Requested,
    /// The target images are on the node, or being pulled.
    Pulling,
    /// For each changed container: create the new one, stop the old one, start the new one.
    Swapping,
    /// The new containers run (and are ready) continuously for minReadySeconds.
    Verifying,
    /// A transaction's upgrade, verified: the new revision runs, the old one is kept, and the
    /// OTA manager decides (commit or rollback). No deadline of its own: the transaction's
    /// commit deadline rolls it back.
    Verified,
    /// The new revision is the pod's; the old containers are being removed.
    Committed,
    Done,
    /// Undoing: the new containers go, the old spec runs again.
    RollingBack,
    RolledBack,
    /// Even the rollback failed; the error says why.
    Failed,
}

impl State {
    pub const ALL: [State; 10] = [
        State::Requested,
        State::Pulling,
        State::Swapping,
        State::Verifying,
        State::Verified,
        State::Committed,
        State::Done,
        State::RollingBack,
        State::RolledBack,
        State::Failed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            State::Requested => "Requested",
            State::Pulling => "Pulling",
            State::Swapping => "Swapping",
            State::Verifying => "Verifying",
            State::Verified => "Verified",
            State::Committed => "Committed",
            State::Done => "Done",
            State::RollingBack => "RollingBack",
            State::RolledBack => "RolledBack",
            State::Failed => "Failed",
        }
    }

    pub fn parse(s: &str) -> Option<State> {
        State::ALL.into_iter().find(|st| st.as_str() == s)
    }

    pub fn is_terminal(self) -> bool {
        matches!(self, State::Done | State::RolledBack | State::Failed)
    }
}

impl std::fmt::Display for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How long each state may last (configurable; `[upgrade]` in the config file).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadlines {
    /// For what the upgrade needs before it can start (the pod's ConfigMaps and Secrets).
    pub requested: Duration,
    pub pulling: Duration,
    pub swapping: Duration,
    /// On top of the time the new containers must hold (minReadySeconds).
    pub verifying: Duration,
    pub committing: Duration,
    pub rolling_back: Duration,
}

impl Default for Deadlines {
    fn default() -> Self {
        Deadlines {
            requested: Duration::from_secs(120),
            pulling: Duration::from_secs(600),
            swapping: Duration::from_secs(120),
            verifying: Duration::from_secs(120),
            committing: Duration::from_secs(60),
            rolling_back: Duration::from_secs(120),
        }
    }
}

impl Deadlines {
    /// How long `state` may last; `hold` is how long the new containers must stay ready.
    pub fn of(&self, state: State, hold: Duration) -> Option<Duration> {
        match state {
            State::Requested => Some(self.requested),
            State::Pulling => Some(self.pulling),
            State::Swapping => Some(self.swapping),
            State::Verifying => Some(self.verifying + hold),
            State::Committed => Some(self.committing),
            State::RollingBack => Some(self.rolling_back),
            State::Verified | State::Done | State::RolledBack | State::Failed => None,
        }
    }
}

/// The journal row, as the machine needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Journal {
    pub state: State,
    /// When the current state must be over (boot clock, ms).
    pub deadline_ms: Option<i64>,
    /// Since when every new container has been running and ready, in Verifying (boot clock).
    pub ready_since_ms: Option<i64>,
    /// How long they must hold: minReadySeconds, at least the configured floor.
    pub hold: Duration,
    /// A transaction's upgrade: it stops at Verified for the OTA manager's decision.
    pub manual: bool,
    /// Its transaction's decision, if one stands.
    pub verdict: Option<Verdict>,
    /// Whether it may start: the members of its transaction before it are Verified (always,
    /// outside a transaction).
    pub turn: bool,
}

/// A container as the machine sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub id: String,
    pub state: Run,
    /// The readiness verdict where the container has a readiness probe; `None` without one.
    pub ready: Option<bool>,
    pub exit_code: i32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Run {
    Created,
    Running,
    Exited,
    Unknown,
}

/// One container the upgrade replaces: the one running the old spec (newest attempt without
/// this upgrade's label) and the one this upgrade created, if any. For an init container the
/// old one has completed, and the new one runs to completion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pair {
    pub name: String,
    pub old: Option<Seen>,
    pub new: Option<Seen>,
}

/// What the runtime shows of the pod, for the containers the upgrade replaces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observed {
    /// Target images not on the node yet.
    pub missing_images: Vec<String>,
    /// In place: each changed app container. Recreate: each app container of the target, its
    /// old one in the old sandbox and its new one in the new sandbox.
    pub pairs: Vec<Pair>,
    /// The pod has a ready sandbox to swap containers in (in place).
    pub sandbox_ready: bool,
    /// The recreate path's sandboxes; `None` in place.
    pub recreate: Option<Sandboxes>,
    /// Init containers, in order. In place: each changed one, old and new. Recreate: the
    /// target's, in the new sandbox (only `new`).
    pub inits: Vec<Pair>,
    /// Why the target revision cannot be translated now (a ConfigMap it references is not
    /// cached), if it cannot.
    pub target_unavailable: Option<String>,
    /// Why the old revision cannot be translated now: nothing can be restored from it.
    pub old_unavailable: Option<String>,
    /// Recreate: each app container of the old revision, its instance in the old sandbox (what
    /// a rollback restores there); empty in place, where `pairs` says it.
    pub restore: Vec<Pair>,
}

/// A sandbox as the machine sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pod {
    pub id: String,
    pub ready: bool,
    /// Some container of it runs.
    pub running: bool,
}

/// The recreate path: the pod's old sandbox and the one this upgrade made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sandboxes {
    pub old: Option<Pod>,
    pub new: Option<Pod>,
    /// What of the old pod must stop before the new sandbox starts.
    pub stop_first: StopFirst,
}

/// What of the old pod must stop before a new sandbox starts beside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopFirst {
    /// On the pod network without host ports: nothing, the two run side by side.
    Nothing,
    /// Host network: its containers (they bind the host's ports); the sandbox, which has no
    /// network of its own, stays for a rollback.
    Containers,
    /// Host ports on the pod network: the sandbox itself (its port mappings).
    Sandbox,
}

/// The one next thing to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Compare-and-set the journal to this state (with an error, for rollbacks and failures).
    Go(State, Option<String>),
    Pull(Vec<String>),
    /// Create the new container for this name (from the target spec, labelled with the
    /// upgrade id), not started yet.
    CreateNew(String),
    StopOld(String),
    /// Start a created container (the new one while swapping, a restored one in rollback).
    Start(String),
    StopNew(String),
    RemoveNew(String),
    /// Create and start a container from the old spec for this name, removing the stopped old
    /// one it replaces (a stopped container cannot start again).
    RestoreOld {
        name: String,
        replace: Option<String>,
    },
    RemoveOld(String),
    /// Recreate: run the new sandbox from the target template and create its containers.
    CreatePod,
    /// Recreate: stop a sandbox and its containers (grace period), keeping them.
    StopPod(String),
    /// Recreate: stop a sandbox's containers (grace period), keeping them and the sandbox
    /// running, so a rollback restores the old revision in it.
    StopContainers(String),
    /// Recreate: stop and remove a sandbox and its containers.
    RemovePod(String),
    /// Record since when all new containers have been ready (`None`: they are not).
    MarkReady(Option<i64>),
    /// Nothing to do until the runtime changes or time passes.
    Wait,
}

fn past(deadline: Option<i64>, now_ms: i64) -> bool {
    deadline.is_some_and(|d| now_ms >= d)
}

fn exited(s: &Option<Seen>) -> Option<&Seen> {
    s.as_ref().filter(|s| s.state == Run::Exited)
}

/// What the upgrade's transaction decides for it, whatever the runtime shows: a rollback
/// (nothing changed yet: it ends; otherwise it rolls back), a commit of a Verified upgrade, or
/// a wait for its turn. `None`: the runtime decides. The engine asks this before it looks at
/// the runtime, so a decision is carried out even while the runtime does not answer.
pub fn decided(j: &Journal) -> Option<Step> {
    match (&j.verdict, j.state) {
        (Some(Verdict::Rollback(why)), State::Requested | State::Pulling) => {
            Some(Step::Go(State::RolledBack, Some(why.clone())))
        }
        (Some(Verdict::Rollback(why)), State::Swapping | State::Verifying | State::Verified) => {
            Some(Step::Go(State::RollingBack, Some(why.clone())))
        }
        (Some(Verdict::Commit), State::Verified) => Some(Step::Go(State::Committed, None)),
        (None, State::Requested) if !j.turn => Some(Step::Wait),
        _ => None,
    }
}

/// The next step of an upgrade.
pub fn next(j: &Journal, o: &Observed, now_ms: i64) -> Step {
    if let Some(step) = decided(j) {
        return step;
    }
    let overdue = past(j.deadline_ms, now_ms);
    if let Some(sb) = &o.recreate {
        if let Some(step) = recreate::next(j, o, sb, overdue) {
            return step;
        }
    }
    match j.state {
        State::Requested | State::Pulling => {
            // Nothing has changed yet: an upgrade that cannot start ends with the pod as it
            // was, saying why.
            if let Some(why) = o.target_unavailable.as_ref().or(o.old_unavailable.as_ref()) {
                return if overdue {
                    Step::Go(
                        State::RolledBack,
                        Some(format!(
                            "what the upgrade needs did not arrive in time: {why}"
                        )),
                    )
                } else {
                    Step::Wait
                };
            }
            if j.state == State::Requested {
                return Step::Go(State::Pulling, None);
            }
            if o.missing_images.is_empty() {
                Step::Go(State::Swapping, None)
            } else if overdue {
                // Nothing has changed yet: the pod still runs its old revision.
                Step::Go(
                    State::RolledBack,
                    Some(format!(
                        "images not pulled in time: {}",
                        o.missing_images.join(", ")
                    )),
                )
            } else {
                Step::Pull(o.missing_images.clone())
            }
        }
        State::Swapping => {
            if overdue {
                return Step::Go(
                    State::RollingBack,
                    Some("the swap did not finish in time".into()),
                );
            }
            if let Some(why) = &o.target_unavailable {
                return Step::Go(
                    State::RollingBack,
                    Some(format!("the target revision cannot run: {why}")),
                );
            }
            if !o.sandbox_ready {
                return Step::Go(
                    State::RollingBack,
                    Some("the pod's sandbox is not ready".into()),
                );
            }
            if let Some(step) = run_inits(&o.inits) {
                return step;
            }
            for p in &o.pairs {
                if let Some(n) = exited(&p.new) {
                    return Step::Go(
                        State::RollingBack,
                        Some(format!(
                            "new container {} exited with code {}",
                            p.name, n.exit_code
                        )),
                    );
                }
                let Some(n) = &p.new else {
                    return Step::CreateNew(p.name.clone());
                };
                if let Some(old) = p.old.as_ref().filter(|o| o.state == Run::Running) {
                    return Step::StopOld(old.id.clone());
                }
                if n.state == Run::Created {
                    return Step::Start(n.id.clone());
                }
            }
            Step::Go(State::Verifying, None)
        }
        State::Verifying => {
            for p in &o.pairs {
                match &p.new {
                    None => {
                        return Step::Go(
                            State::RollingBack,
                            Some(format!("new container {} is gone", p.name)),
                        )
                    }
                    Some(n) if n.state == Run::Exited => {
                        return Step::Go(
                            State::RollingBack,
                            Some(format!(
                                "new container {} exited with code {}",
                                p.name, n.exit_code
                            )),
                        )
                    }
                    Some(_) => {}
                }
            }
            let all_ready = o.pairs.iter().all(|p| {
                p.new
                    .as_ref()
                    .is_some_and(|n| n.state == Run::Running && n.ready != Some(false))
            });
            if overdue {
                let why = if all_ready {
                    "the new containers did not stay ready long enough in time".to_string()
                } else {
                    let not: Vec<&str> = o
                        .pairs
                        .iter()
                        .filter(|p| p.new.as_ref().is_none_or(|n| n.ready == Some(false)))
                        .map(|p| p.name.as_str())
                        .collect();
                    format!("not ready in time: {}", not.join(", "))
                };
                return Step::Go(State::RollingBack, Some(why));
            }
            match (all_ready, j.ready_since_ms) {
                (false, None) => Step::Wait,
                (false, Some(_)) => Step::MarkReady(None),
                (true, None) => Step::MarkReady(Some(now_ms)),
                (true, Some(since)) if now_ms - since >= j.hold.as_millis() as i64 => {
                    // A transaction's upgrade waits there for the OTA manager.
                    Step::Go(
                        if j.manual {
                            State::Verified
                        } else {
                            State::Committed
                        },
                        None,
                    )
                }
                (true, Some(_)) => Step::Wait,
            }
        }
        State::Verified => {
            // The pod no longer runs (a reboot stopped its sandbox): the new revision is
            // started again, and verified again, still uncommitted.
            if !o.sandbox_ready {
                return Step::Go(State::Swapping, None);
            }
            for p in &o.pairs {
                match &p.new {
                    None => {
                        return Step::Go(
                            State::RollingBack,
                            Some(format!(
                                "new container {} is gone before the commit",
                                p.name
                            )),
                        )
                    }
                    Some(n) if n.state == Run::Exited => {
                        return Step::Go(
                            State::RollingBack,
                            Some(format!(
                                "new container {} exited with code {} before the commit",
                                p.name, n.exit_code
                            )),
                        )
                    }
                    Some(_) => {}
                }
            }
            Step::Wait
        }
        State::Committed => {
            if overdue {
                // The new revision runs and is recorded; what is left of the old one is
                // stopped, and the runtime's own cleanup takes it.
                return Step::Go(State::Done, None);
            }
            // The old containers go; one whose new container vanished stays for the runtime
            // to replace, so the pod is never left with nothing.
            for p in o.inits.iter().chain(&o.pairs) {
                if let (Some(old), Some(_)) = (&p.old, &p.new) {
                    return Step::RemoveOld(old.id.clone());
                }
            }
            Step::Go(State::Done, None)
        }
        State::RollingBack => {
            if overdue {
                return Step::Go(State::Failed, Some(rollback_overdue(&o.pairs)));
            }
            // The new init containers go; the old ones completed long ago and stay as they are.
            for p in &o.inits {
                if let Some(step) = remove_new(p) {
                    return step;
                }
            }
            for p in &o.pairs {
                if let Some(step) = remove_new(p) {
                    return step;
                }
                match &p.old {
                    Some(old) if old.state == Run::Running => {}
                    Some(old) if old.state == Run::Created => return Step::Start(old.id.clone()),
                    // Nothing to restore it from until the old revision's inputs are back;
                    // the deadline ends the wait.
                    _ if o.old_unavailable.is_some() => return Step::Wait,
                    old => {
                        return Step::RestoreOld {
                            name: p.name.clone(),
                            replace: old.as_ref().map(|o| o.id.clone()),
                        }
                    }
                }
            }
            // Verified again: the restored containers pass their readiness probes.
            if unready(&o.pairs).next().is_some() {
                return Step::Wait;
            }
            Step::Go(State::RolledBack, None)
        }
        State::Done | State::RolledBack | State::Failed => Step::Wait,
    }
}

/// In place: the changed init containers, in order, each run once to completion before any
/// app container is swapped. `None` once all have succeeded.
fn run_inits(inits: &[Pair]) -> Option<Step> {
    for p in inits {
        match &p.new {
            None => return Some(Step::CreateNew(p.name.clone())),
            Some(n) if n.state == Run::Created => return Some(Step::Start(n.id.clone())),
            Some(n) if n.state == Run::Exited && n.exit_code == 0 => continue,
            Some(n) if n.state == Run::Exited => {
                return Some(Step::Go(
                    State::RollingBack,
                    Some(format!(
                        "new init container {} exited with code {}",
                        p.name, n.exit_code
                    )),
                ))
            }
            Some(_) => return Some(Step::Wait),
        }
    }
    None
}

/// Rollback: stop, then remove, what this upgrade created for one container.
fn remove_new(p: &Pair) -> Option<Step> {
    let n = p.new.as_ref()?;
    Some(if matches!(n.state, Run::Running | Run::Unknown) {
        Step::StopNew(n.id.clone())
    } else {
        Step::RemoveNew(n.id.clone())
    })
}

/// The restored old containers not ready yet.
fn unready(pairs: &[Pair]) -> impl Iterator<Item = &str> {
    pairs
        .iter()
        .filter(|p| p.old.as_ref().is_some_and(|o| o.ready == Some(false)))
        .map(|p| p.name.as_str())
}

/// Why an overdue rollback failed: the old revision runs but is not ready, or it did not
/// come back at all.
fn rollback_overdue(pairs: &[Pair]) -> String {
    let running = pairs
        .iter()
        .all(|p| p.old.as_ref().is_some_and(|o| o.state == Run::Running));
    let not: Vec<&str> = unready(pairs).collect();
    if running && !not.is_empty() {
        format!(
            "the old revision runs again but is not ready in time: {}",
            not.join(", ")
        )
    } else {
        "the rollback did not finish in time".into()
    }
}

/// What an overdue state becomes when the runtime cannot even be observed (it does not
/// answer): the journal moves on by itself, so no state outlives its deadline. `cause` says
/// what stood in the way.
pub fn timed_out(state: State, cause: &str) -> Option<Step> {
    let (to, why) = match state {
        State::Requested | State::Pulling => (State::RolledBack, "the upgrade could not start"),
        State::Swapping | State::Verifying => (State::RollingBack, "the upgrade did not finish"),
        State::RollingBack => (State::Failed, "the rollback did not finish"),
        // Committed: the new revision is recorded; only old containers may be left over.
        State::Committed => return Some(Step::Go(State::Done, None)),
        // Verified has no deadline: its transaction's commit deadline decides for it.
        State::Verified | State::Done | State::RolledBack | State::Failed => return None,
    };
    Some(Step::Go(to, Some(format!("{why} in time: {cause}"))))
}

#[path = "machine_recreate.rs"]
mod recreate;

#[cfg(test)]
#[path = "machine_tests.rs"]
mod tests;
