//! Moving the journal: each move is one transaction with what it reports (the Events, the
//! pod status, the revision the pod now runs) and the next state's deadline on the boot clock.

use super::*;

impl<R: CriRuntime + 'static> Engine<R> {
    /// An overdue state whose next step cannot be decided (the runtime does not answer, the
    /// pod runtime keeps the pod): the journal moves on anyway.
    pub(super) fn timed_out(
        &self,
        rec: &RequestRecord,
        state: State,
        cause: &str,
    ) -> Result<(), StoreError> {
        if let Some(Step::Go(to, error)) = machine::timed_out(state, cause) {
            let ctx = self.context(rec)?.ok();
            self.go(rec, state, to, error, ctx.as_ref(), None)?;
        }
        Ok(())
    }

    /// Drops the changes whose target image is, by digest, what the old container runs.
    pub(super) async fn without_noops(
        &self,
        ctx: &Context,
        now: &steps::PodNow,
    ) -> Result<String, UpgradeError> {
        let mut plan = ctx.plan.clone();
        if plan.mode == Mode::Recreate {
            return Ok(serde_json::to_string(&plan).unwrap_or_default());
        }
        let mut keep = Vec::new();
        for ch in plan.changes.drain(..) {
            let (old, _) = now.pair(&ch.container, "");
            let same = match old {
                Some(o) => steps::same_image(&*self.cri, now, o, &ch.to).await?,
                None => false,
            };
            if same {
                tracing::info!(container = %ch.container, image = %ch.to, "same digest as running: no swap");
            } else {
                keep.push(ch);
            }
        }
        plan.changes = keep;
        Ok(serde_json::to_string(&plan).unwrap_or_default())
    }

    /// Moves the journal, with what the move reports, in one transaction.
    pub(super) fn go(
        &self,
        rec: &RequestRecord,
        from: State,
        to: State,
        error: Option<String>,
        ctx: Option<&Context>,
        plan: Option<String>,
    ) -> Result<(), StoreError> {
        let hold = ctx
            .map(|c| Duration::from_millis(c.plan.hold_ms))
            .unwrap_or_default();
        let deadline = self
            .config
            .deadlines
            .of(to, hold)
            .map(|d| crate::time::boot_ms() + d.as_millis() as i64);
        let mut effects = Effects {
            plan: plan.or_else(|| {
                ctx.filter(|_| from == State::Requested)
                    .map(|c| serde_json::to_string(&c.plan).unwrap_or_default())
            }),
            // An upgrade of a transaction that fails takes the others with it (applied only
            // to a member, and only while nothing is decided).
            txn_rollback: matches!(to, State::RollingBack | State::RolledBack | State::Failed)
                .then(|| {
                    format!(
                        "pod {}/{}: {}",
                        rec.namespace,
                        rec.name,
                        error.as_deref().unwrap_or("rolled back")
                    )
                }),
            ..Default::default()
        };
        let event = |kind: &str, reason: &str, message: String| -> Option<QueuedEvent> {
            let pod = &ctx?.pod;
            let ev = crate::pod::status::pod_event(
                pod,
                kind,
                reason,
                &message,
                &self.node_name,
                &crate::time::now(),
            );
            let name = ev["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            Some(QueuedEvent {
                pod_uid: pod.index.uid.clone(),
                key: format!("{}/{name}", pod.index.namespace),
                namespace: pod.index.namespace.clone(),
                body: ev.to_string(),
                occurrences: 1,
            })
        };
        let from_hash = rec.from_hash.as_deref().unwrap_or("?");
        // Why it ends: said by this move, or by the move into RollingBack before it (the
        // manager's reason, the container that exited).
        let why = error
            .as_deref()
            .or(rec.error.as_deref())
            .unwrap_or("no reason recorded");
        match to {
            State::Pulling => effects.events.extend(event(
                "Normal",
                "UpgradeStarted",
                format!(
                    "Upgrading from revision {from_hash} to {} (request {})",
                    rec.to_hash, rec.id
                ),
            )),
            State::Committed => {
                if let Some(c) = ctx {
                    let how = match (&c.plan.mode, &c.plan.target_spec) {
                        (Mode::Recreate, Some(spec)) => RunningAs::Spec(spec.clone()),
                        _ => {
                            // Images committed earlier stay, unless this upgrade changes them.
                            let mut images = match self
                                .store
                                .running_revision(&rec.pod_uid)?
                                .and_then(|r| serde_json::from_str::<RunningAs>(&r.images).ok())
                            {
                                Some(RunningAs::Images(i)) => i,
                                _ => BTreeMap::new(),
                            };
                            images.extend(plan::images(&c.plan));
                            RunningAs::Images(images)
                        }
                    };
                    effects.running = Some(RunningRevision {
                        pod_uid: rec.pod_uid.clone(),
                        hash: rec.to_hash.clone(),
                        images: serde_json::to_string(&how).unwrap_or_default(),
                        committed_ms: now_ms(),
                        namespace: Some(c.pod.index.namespace.clone()),
                        owner_uid: c.pod.index.owner_uid.clone(),
                        awaiting_since_ms: None,
                    });
                }
                effects.events.extend(event(
                    "Normal",
                    "UpgradeSucceeded",
                    format!("Now running revision {} (request {})", rec.to_hash, rec.id),
                ));
            }
            State::RolledBack => effects.events.extend(event(
                "Warning",
                "UpgradeRolledBack",
                format!("Upgrade to revision {} rolled back: {why}", rec.to_hash,),
            )),
            State::Failed => effects.events.extend(event(
                "Warning",
                "UpgradeFailed",
                format!("Upgrade to revision {} failed: {why}", rec.to_hash,),
            )),
            _ => {}
        }
        if self.store.transition(
            rec.id,
            from.as_str(),
            to.as_str(),
            error.as_deref(),
            deadline,
            &effects,
        )? {
            tracing::info!(upgrade = rec.id, pod = %rec.name, namespace = %rec.namespace,
                from = %from, to = %to, error = error.as_deref().unwrap_or(""), "upgrade state");
            crate::failpoint::hit(&format!("upgrade:after:{to}"));
        }
        Ok(())
    }
}
