//! Leader election through a Lease (I/O side; the rules are in [`super::election`]). Only the
//! replica holding the Lease runs the controller, so two replicas never delete the same wave.
//!
//! Timings follow client-go's defaults: a 15 s Lease, renewed every 2 s, given up when no
//! renewal succeeded for 10 s. A replica that gives up stops the controller before the Lease
//! can expire for the others (10 s < 15 s). On shutdown the Lease is released (no holder), so
//! a standby takes over at once instead of after 15 s.

use super::election::{self, LeaseState, Observed, Step};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// Lease timings.
#[derive(Debug, Clone, Copy)]
pub struct Timings {
    pub lease_duration: Duration,
    pub renew_deadline: Duration,
    pub retry_period: Duration,
}

impl Default for Timings {
    fn default() -> Timings {
        Timings {
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }
}

/// The Lease could not be renewed in time, or another replica holds it now.
#[derive(Debug, thiserror::Error)]
#[error("lost the leader Lease {lease}: {why}")]
pub struct Lost {
    pub lease: String,
    pub why: String,
}

enum Attempt {
    Held,
    HeldByOther(String),
    /// Another writer got in between this replica's read and write (409): read again.
    Conflict,
    Failed(kube::Error),
    /// No answer before the renew deadline.
    TimedOut,
}

pub struct Elector {
    api: Api<Lease>,
    name: String,
    namespace: String,
    identity: String,
    timings: Timings,
    observed: Option<Observed>,
    /// The Lease as this replica last wrote it: renewals PUT it again without a GET first.
    mine: Option<Lease>,
    epoch: Instant,
}

impl Elector {
    pub fn new(
        client: kube::Client,
        namespace: &str,
        name: &str,
        identity: &str,
        timings: Timings,
    ) -> Elector {
        Elector {
            api: Api::namespaced(client, namespace),
            name: name.to_string(),
            namespace: namespace.to_string(),
            identity: identity.to_string(),
            timings,
            observed: None,
            mine: None,
            epoch: Instant::now(),
        }
    }

    fn lease_name(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// Waits until this replica holds the Lease. False when `stop` fired first.
    pub async fn acquire(&mut self, stop: &mut watch::Receiver<bool>) -> bool {
        loop {
            match self.attempt().await {
                Attempt::Held => return true,
                Attempt::HeldByOther(holder) => {
                    tracing::debug!(lease = %self.lease_name(), %holder, "standing by")
                }
                Attempt::Conflict | Attempt::TimedOut => {}
                Attempt::Failed(e) => {
                    tracing::warn!(lease = %self.lease_name(), error = %e, "cannot read or write the leader Lease")
                }
            }
            if *stop.borrow() {
                return false;
            }
            tokio::select! {
                _ = tokio::time::sleep(self.timings.retry_period) => {}
                _ = stop.changed() => return false,
            }
        }
    }

    /// Keeps the Lease renewed until `stop` fires (Ok), or until it is lost (Err).
    pub async fn hold(&mut self, stop: &mut watch::Receiver<bool>) -> Result<(), Lost> {
        let mut last_renewal = Instant::now();
        loop {
            if *stop.borrow() {
                return Ok(());
            }
            tokio::select! {
                _ = tokio::time::sleep(self.timings.retry_period) => {}
                _ = stop.changed() => return Ok(()),
            }
            // A request that hangs must not outlast the renew deadline: by then a standby may
            // take the Lease over, and this replica has to have stopped first.
            let left = self
                .timings
                .renew_deadline
                .saturating_sub(last_renewal.elapsed())
                .max(Duration::from_millis(100));
            let round = async {
                if self.renew().await {
                    Attempt::Held
                } else {
                    // Someone wrote the Lease since, or the write failed: read it and decide.
                    self.attempt().await
                }
            };
            let attempt = match tokio::time::timeout(left, round).await {
                Ok(a) => a,
                Err(_) => Attempt::TimedOut,
            };
            match attempt {
                Attempt::Held => last_renewal = Instant::now(),
                Attempt::HeldByOther(holder) => {
                    return Err(Lost {
                        lease: self.lease_name(),
                        why: format!("{holder} holds it now"),
                    })
                }
                Attempt::Conflict | Attempt::Failed(_) | Attempt::TimedOut => {
                    let error = match &attempt {
                        Attempt::Failed(e) => e.to_string(),
                        Attempt::TimedOut => "the apiserver did not answer in time".to_string(),
                        _ => "conflicting write".to_string(),
                    };
                    tracing::warn!(lease = %self.lease_name(), %error, "cannot renew the leader Lease");
                    if last_renewal.elapsed() >= self.timings.renew_deadline {
                        return Err(Lost {
                            lease: self.lease_name(),
                            why: format!(
                                "no renewal succeeded for {:?}: {error}",
                                self.timings.renew_deadline
                            ),
                        });
                    }
                }
            }
        }
    }

    /// Gives the Lease up, so a standby replica need not wait for it to expire.
    pub async fn release(&mut self) {
        let Some(mut lease) = self.mine.take() else {
            return;
        };
        if let Some(spec) = lease.spec.as_mut() {
            spec.holder_identity = None;
            spec.lease_duration_seconds = Some(1);
            spec.renew_time = Some(MicroTime(Timestamp::now()));
        }
        match self
            .api
            .replace(&self.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => tracing::info!(lease = %self.lease_name(), "released the leader Lease"),
            Err(e) => {
                tracing::warn!(lease = %self.lease_name(), error = %e, "cannot release the leader Lease; it expires on its own")
            }
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn duration_secs(&self) -> i32 {
        i32::try_from(self.timings.lease_duration.as_secs()).unwrap_or(i32::MAX)
    }

    /// Renews the Lease as last written, without reading it first. False when there is
    /// nothing to renew or the write failed.
    async fn renew(&mut self) -> bool {
        let Some(mut lease) = self.mine.take() else {
            return false;
        };
        if let Some(spec) = lease.spec.as_mut() {
            spec.renew_time = Some(MicroTime(Timestamp::now()));
        }
        match self
            .api
            .replace(&self.name, &PostParams::default(), &lease)
            .await
        {
            Ok(written) => {
                self.mine = Some(written);
                true
            }
            Err(e) => {
                tracing::debug!(lease = %self.lease_name(), error = %e, "renewal without a read failed");
                false
            }
        }
    }

    /// One read-decide-write round.
    async fn attempt(&mut self) -> Attempt {
        let current = match self.api.get_opt(&self.name).await {
            Ok(c) => c,
            Err(e) => return Attempt::Failed(e),
        };
        let state = current.as_ref().map(|l| {
            let spec = l.spec.as_ref();
            LeaseState {
                holder: spec.and_then(|s| s.holder_identity.clone()),
                duration_secs: spec
                    .and_then(|s| s.lease_duration_seconds)
                    .map_or(15, i64::from),
                resource_version: l.metadata.resource_version.clone().unwrap_or_default(),
            }
        });
        let now = self.now_ms();
        let step = election::step(state.as_ref(), &self.identity, &mut self.observed, now);
        let stamp = MicroTime(Timestamp::now());
        let result = match (step, current) {
            (Step::Wait, _) => {
                let holder = state.and_then(|s| s.holder).unwrap_or_default();
                self.mine = None;
                return Attempt::HeldByOther(holder);
            }
            (Step::Create, _) | (Step::Write, None) => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(self.name.clone()),
                        namespace: Some(self.namespace.clone()),
                        ..ObjectMeta::default()
                    },
                    spec: Some(LeaseSpec {
                        holder_identity: Some(self.identity.clone()),
                        lease_duration_seconds: Some(self.duration_secs()),
                        acquire_time: Some(stamp.clone()),
                        renew_time: Some(stamp),
                        lease_transitions: Some(0),
                        ..LeaseSpec::default()
                    }),
                };
                self.api.create(&PostParams::default(), &lease).await
            }
            (Step::Write, Some(mut lease)) => {
                let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
                if spec.holder_identity.as_deref() != Some(self.identity.as_str()) {
                    spec.holder_identity = Some(self.identity.clone());
                    spec.acquire_time = Some(stamp.clone());
                    spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
                }
                spec.lease_duration_seconds = Some(self.duration_secs());
                spec.renew_time = Some(stamp);
                self.api
                    .replace(&self.name, &PostParams::default(), &lease)
                    .await
            }
        };
        match result {
            Ok(written) => {
                self.mine = Some(written);
                Attempt::Held
            }
            // Another replica wrote first (409 Conflict or AlreadyExists): read again next time.
            Err(kube::Error::Api(s)) if s.code == 409 => {
                self.mine = None;
                Attempt::Conflict
            }
            Err(e) => Attempt::Failed(e),
        }
    }
}
