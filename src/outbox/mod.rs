//! The outbox's sender: delivers what the runtime and the upgrade engine queued for the
//! apiserver (`store::outbox`), in one task of its own, independent of the container runtime,
//! so a dead or blackholed link never holds up a pod.
//!
//! - Rows go in order per pod; a row waiting for its retry holds back the later rows of its
//!   pod only. What a failure means is [`classify::classify`]'s: retry later (with backoff and
//!   jitter, or the server's `Retry-After`), drop (the target is gone), or park (refused for
//!   good: kept with its error, shown in `edgehub status` and `/metrics`, out of the way).
//! - A status is sent as the two-way patch from the status the apiserver holds (the cached
//!   pod) to the queued one merged onto it; the answer goes back into the cache.
//! - An Event is a series kept on the device (`store::EventSeries`), since a node may create
//!   and patch Events but never read them (403): the first delivery creates it, later ones
//!   PATCH `count`, `lastTimestamp` and `message`. The count sent is the series' total, never
//!   an increment, so a delivery whose answer was lost and that is sent again sets the same
//!   count. A create answered 409 (an Event of that name the device has no record of, or its
//!   own create whose answer was lost) is PATCHed; a PATCH answered 404 (the apiserver's
//!   event TTL removed it) is created again.
//! - The revision a pod runs after an offline upgrade is reported by delete-and-adopt: once
//!   its DaemonSet's update revision is still that revision, the pod object is deleted (uid
//!   precondition, grace 0); the DaemonSet controller creates its replacement at that
//!   revision, and the runtime binds the replacement to the running sandbox. A node identity
//!   may delete its pods but not patch their spec or labels. With `report.mode = "patch"`
//!   (identities that may), the images and the hash label are patched instead.
//! - When the link comes back, the sender waits a random part of `reconnect_jitter` before it
//!   drains, and sends at most `max_rate` requests a second: ten thousand devices regaining
//!   the link together do not arrive together.

pub mod classify;
pub mod cloud;
mod send;

use crate::backoff::BackoffPolicy;
use crate::kube::KubeError;
use crate::link::LinkState;
use crate::object::Kind;
use crate::pod::status::{merge_onto, two_way_patch};
use crate::store::{
    EventSeries, OutboxRow, RowKind, RunningRevision, Store, StoreError, StoredObject,
};
use classify::{classify, Deletion, Verdict};
use cloud::Cloud;
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// How long a deleted pod object may stay in the cache (its watch event on the way) before
/// the deletion is asked again.
const AWAIT_RESEND: Duration = Duration::from_secs(30);

/// How reports reach the cloud when the link returns (`[report]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReportConfig {
    /// How an upgrade's new revision is reported.
    pub mode: RevisionReport,
    /// How long a sandbox whose pod object was deleted waits for its replacement to adopt it.
    pub adopt_timeout: Duration,
    /// The longest random wait before draining when the link comes back.
    pub reconnect_jitter: Duration,
    /// Requests a second the outbox sends at most (0: no limit).
    pub max_rate: u32,
    /// The longest wait before a refused report is tried again (its backoff's ceiling).
    pub retry_max: Duration,
}

/// How the revision an upgrade committed offline reaches the cloud.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RevisionReport {
    /// Delete the pod object; its replacement adopts the running sandbox (a node identity).
    #[default]
    DeleteAndAdopt,
    /// Patch the pod's images and hash label (identities allowed to patch pods).
    Patch,
}

/// What one drain did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Drained {
    pub statuses_sent: usize,
    pub events_sent: usize,
    /// Revisions reported (pods deleted for adoption, or patched).
    pub revisions_reported: usize,
    /// Dropped: the target is gone.
    pub dropped: usize,
    /// Parked: refused for good.
    pub parked: usize,
    /// Requests sent to the apiserver.
    pub requests: usize,
    /// The link is down; the rest waits.
    pub offline: bool,
    /// The apiserver refused edgehub's credentials (401); the rest waits.
    pub unauthorized: bool,
}

/// The sender.
pub struct Sender<C: Cloud> {
    cloud: C,
    store: Arc<Store>,
    pub revision_report: RevisionReport,
    /// The longest random wait before draining after the link comes back.
    pub reconnect_jitter: Duration,
    /// Requests a second, at most.
    pub max_rate: u32,
    /// Retries of a row: its attempts count up the ceiling, and each wait is jittered.
    pub retry: BackoffPolicy,
    /// Revision reports that failed, by pod uid: when they may be tried again.
    revision_retry: HashMap<String, (Instant, u32)>,
    last_request: Option<Instant>,
    /// The apiserver is refusing edgehub's credentials (said once per period in the log).
    unauthorized: bool,
}

enum Failure {
    /// The apiserver's (or the link's) answer, judged with the row's attempts.
    Kube(KubeError),
    Verdict(Verdict, String),
    Store(StoreError),
}

impl Failure {
    /// What it means for a row (or a revision report) tried `attempts` times before.
    fn verdict(self, attempts: i64) -> Result<(Verdict, String), StoreError> {
        match self {
            Failure::Kube(e) => Ok((classify(&e, attempts), e.to_string())),
            Failure::Verdict(v, why) => Ok((v, why)),
            Failure::Store(e) => Err(e),
        }
    }
}

impl From<StoreError> for Failure {
    fn from(e: StoreError) -> Self {
        Failure::Store(e)
    }
}

impl From<KubeError> for Failure {
    fn from(e: KubeError) -> Self {
        Failure::Kube(e)
    }
}

fn now_ms() -> i64 {
    crate::time::now_ms()
}

impl<C: Cloud> Sender<C> {
    pub fn new(cloud: C, store: Arc<Store>) -> Sender<C> {
        Sender {
            cloud,
            store,
            revision_report: RevisionReport::default(),
            reconnect_jitter: Duration::ZERO,
            max_rate: 0,
            retry: BackoffPolicy {
                initial: Duration::from_secs(1),
                max: Duration::from_secs(300),
            },
            revision_retry: HashMap::new(),
            last_request: None,
            unauthorized: false,
        }
    }

    /// Drains on every queued report, when the link comes back (after a random part of
    /// `reconnect_jitter`), and when a retry is due, until shutdown.
    pub async fn run(
        mut self,
        mut link: Option<watch::Receiver<LinkState>>,
        mut shutdown: watch::Receiver<bool>,
    ) {
        let mut queued = self.store.subscribe_reports();
        let mut wait = Duration::ZERO;
        // How often to try again while the link is down: the link watch also wakes it.
        let offline_for = BackoffPolicy {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(30),
        };
        let mut offline_rounds = 0u32;
        let mut unauthorized_rounds = 0u32;
        loop {
            // Jitter is for a link that came back, not the first connection after boot:
            // devices boot at their own times.
            let was_offline = link.as_ref().is_some_and(|l| {
                matches!(
                    *l.borrow(),
                    LinkState::Offline { .. } | LinkState::TlsFailed { .. }
                )
            });
            let link_changed = async {
                match link.as_mut() {
                    Some(l) => {
                        if l.changed().await.is_err() {
                            std::future::pending::<()>().await
                        }
                    }
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                r = queued.changed() => { if r.is_err() { return; } }
                _ = link_changed => {}
                _ = shutdown.changed() => return,
            }
            let online = link
                .as_ref()
                .is_none_or(|l| matches!(*l.borrow(), LinkState::Online));
            if online && was_offline && !self.reconnect_jitter.is_zero() {
                // A fleet that lost the link together must not drain together.
                let ms = fastrand::u64(0..=self.reconnect_jitter.as_millis() as u64);
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(ms)) => {}
                    _ = shutdown.changed() => return,
                }
            }
            wait = match self.drain().await {
                Ok(d) if d.offline => {
                    offline_rounds += 1;
                    offline_for.jittered(offline_rounds)
                }
                // Nothing but renewed (or restored) credentials ends this, and nothing tells
                // the sender when: it asks again with the retry backoff.
                Ok(d) if d.unauthorized => {
                    offline_rounds = 0;
                    unauthorized_rounds += 1;
                    self.retry.jittered(unauthorized_rounds)
                }
                Ok(_) => {
                    offline_rounds = 0;
                    unauthorized_rounds = 0;
                    self.next_due().unwrap_or(Duration::from_secs(3600))
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read the outbox");
                    Duration::from_secs(10)
                }
            };
        }
    }

    /// How long until a retry is due.
    fn next_due(&self) -> Option<Duration> {
        let now = now_ms();
        // Only the earliest time, not every row's body: this runs after every drain.
        let rows = match self.store.outbox_next_attempt_after(now) {
            Ok(t) => t.map(|t| Duration::from_millis((t - now) as u64)),
            // Looked at again soon rather than never.
            Err(_) => Some(Duration::from_secs(10)),
        };
        let instant = Instant::now();
        let revisions = self
            .revision_retry
            .values()
            .map(|(t, _)| t.saturating_duration_since(instant))
            .min();
        rows.into_iter().chain(revisions).min()
    }

    /// Waits so that requests go out at most `max_rate` a second.
    async fn pace(&mut self) {
        if self.max_rate > 0 {
            let gap = Duration::from_secs(1) / self.max_rate;
            if let Some(last) = self.last_request {
                let since = last.elapsed();
                if since < gap {
                    tokio::time::sleep(gap - since).await;
                }
            }
        }
        self.last_request = Some(Instant::now());
    }

    /// When a row that failed `attempts` times may be tried again: its backoff ceiling,
    /// jittered into its upper half, or the server's Retry-After when longer.
    fn retry_at(&self, attempts: i64, retry_after: Option<Duration>) -> i64 {
        let wait = self.retry.jittered(attempts.clamp(0, 30) as u32 + 1);
        let wait = retry_after.map_or(wait, |ra| wait.max(ra));
        now_ms() + wait.as_millis().min(i64::MAX as u128) as i64
    }

    /// When a parked row, refused `attempts` times, is tried again on its own: a refusal
    /// can pass (a fixed RBAC binding, an admission webhook that stopped refusing), so it is
    /// never given up, only asked seldom, from the retry ceiling up to twelve times that
    /// (an hour with the default five minutes).
    fn park_until(&self, attempts: i64) -> i64 {
        let policy = BackoffPolicy {
            initial: self.retry.max,
            max: self.retry.max.saturating_mul(12),
        };
        let wait = policy.jittered(attempts.clamp(0, 30) as u32 + 1);
        now_ms() + wait.as_millis().min(i64::MAX as u128) as i64
    }

    /// Sends what is queued and due, in order per pod; stops at the first sign the link is
    /// down.
    pub async fn drain(&mut self) -> Result<Drained, StoreError> {
        let mut d = Drained::default();
        let now = now_ms();
        // A pod with a row waiting for its retry: its later rows wait too.
        let mut held: HashSet<String> = HashSet::new();
        for row in self.store.outbox()? {
            if held.contains(&row.pod_uid) {
                continue;
            }
            if row.next_attempt_ms > now {
                // A parked row is out of the way of the rows behind it.
                if !row.parked {
                    held.insert(row.pod_uid.clone());
                }
                continue;
            }
            let sent = match row.kind {
                RowKind::Status => self.send_status(&row, &mut d).await,
                RowKind::Event => self.send_event(&row, &mut d).await,
            };
            match sent {
                Ok(()) => {
                    self.store.outbox_delivered(&row)?;
                    match row.kind {
                        RowKind::Status => d.statuses_sent += 1,
                        RowKind::Event => d.events_sent += 1,
                    }
                }
                Err(f) => match f.verdict(row.attempts)? {
                    (Verdict::Offline, _) => {
                        d.offline = true;
                        return Ok(d);
                    }
                    (Verdict::Unauthorized, why) => {
                        if !self.unauthorized {
                            tracing::warn!(error = %why,
                                "the apiserver does not accept edgehub's credentials; reports \
                                 stay queued until it does");
                            self.unauthorized = true;
                        }
                        d.unauthorized = true;
                        return Ok(d);
                    }
                    (Verdict::Drop, why) => {
                        tracing::info!(kind = row.kind.as_str(), pod = %row.name, namespace = %row.namespace,
                            reason = %why, "report dropped: its target is gone");
                        self.store.outbox_drop(row.id)?;
                        d.dropped += 1;
                    }
                    (Verdict::Park, why) => {
                        if !row.parked {
                            tracing::warn!(kind = row.kind.as_str(), pod = %row.name, namespace = %row.namespace,
                                error = %why, "the apiserver refused a report; parked, and tried again now and then");
                        }
                        self.store
                            .outbox_park(row.id, self.park_until(row.attempts), &why)?;
                        d.parked += 1;
                    }
                    (Verdict::Retry(after), why) => {
                        if row.attempts == 0 {
                            tracing::warn!(kind = row.kind.as_str(), pod = %row.name, error = %why,
                                "report not delivered; retrying with backoff");
                        }
                        self.store.outbox_retry(
                            row.id,
                            self.retry_at(row.attempts, after),
                            &why,
                        )?;
                        if !row.parked {
                            held.insert(row.pod_uid.clone());
                        }
                    }
                },
            }
            if self.unauthorized && !d.unauthorized {
                tracing::info!("the apiserver accepts edgehub's credentials again");
                self.unauthorized = false;
            }
        }
        if d.events_sent + d.dropped > 0 {
            // The series of pods that are gone go with them (after a delivery or a drop, not
            // on every wake-up).
            self.store.prune_event_series()?;
        }
        // A pod whose upgrade is still going (Committed, not yet Done) is the engine's: its
        // revision is reported once it finishes, so the deletion cannot pull the pod out
        // from under the engine's last step.
        let upgrading: HashSet<String> = self
            .store
            .active_requests()?
            .into_iter()
            .map(|r| r.pod_uid)
            .collect();
        let revisions = self.store.running_revisions()?;
        // Only pods still owed a report keep a retry time (an expired one would make
        // `next_due` wake the sender at once, again and again).
        self.revision_retry
            .retain(|uid, _| revisions.iter().any(|r| &r.pod_uid == uid));
        for r in revisions {
            if upgrading.contains(&r.pod_uid) {
                // Looked at again shortly: nothing else wakes the sender when it ends.
                self.revision_retry.insert(
                    r.pod_uid.clone(),
                    (Instant::now() + Duration::from_secs(1), 0),
                );
                continue;
            }
            // Awaiting with its pod object still cached: the deletion was cut off (a power
            // cut between the mark and the request), or its watch event is on its way. Asked
            // again (a 404 is fine), at most once a [`AWAIT_RESEND`].
            let deleted = r.awaiting_since_ms.is_some()
                && self.store.get_by_uid(Kind::Pod, &r.pod_uid)?.is_none();
            if deleted {
                self.revision_retry.remove(&r.pod_uid);
                continue;
            }
            if self
                .revision_retry
                .get(&r.pod_uid)
                .is_some_and(|(t, _)| Instant::now() < *t)
            {
                continue;
            }
            match self.send_revision(&r, &mut d).await {
                Ok(true) => {
                    self.revision_retry
                        .insert(r.pod_uid.clone(), (Instant::now() + AWAIT_RESEND, 0));
                    d.revisions_reported += 1;
                }
                Ok(false) => {
                    self.revision_retry.remove(&r.pod_uid);
                }
                Err(f) => {
                    let n = self.revision_retry.get(&r.pod_uid).map_or(0, |(_, n)| *n);
                    let (v, why) = f.verdict(n as i64)?;
                    match v {
                        Verdict::Offline => {
                            d.offline = true;
                            return Ok(d);
                        }
                        Verdict::Unauthorized => {
                            d.unauthorized = true;
                            return Ok(d);
                        }
                        _ => {}
                    }
                    let after = match v {
                        Verdict::Retry(ra) => ra,
                        _ => None,
                    };
                    let at = self.retry_at(n as i64, after) - now_ms();
                    tracing::warn!(pod_uid = %r.pod_uid, error = %why, "revision report failed; retrying");
                    self.revision_retry.insert(
                        r.pod_uid.clone(),
                        (
                            Instant::now() + Duration::from_millis(at.max(0) as u64),
                            n + 1,
                        ),
                    );
                }
            }
        }
        Ok(d)
    }
}

#[cfg(test)]
mod tests;
