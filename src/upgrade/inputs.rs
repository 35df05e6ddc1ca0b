//! What an upgrade needs before it can start, read from the cache: the pod and its
//! DaemonSet, the running and target revisions, both translated for the CRI, and the plan.

use super::*;

impl<R: CriRuntime + 'static> Engine<R> {
    /// The pod and its plan, from the cache and the journal.
    pub(super) fn context(
        &self,
        rec: &RequestRecord,
    ) -> Result<Result<Context, Blocked>, StoreError> {
        let Some(pod) = self.store.get_by_uid(Kind::Pod, &rec.pod_uid)? else {
            // An empty cache is not a verdict: a reset cache has not seen the pod yet.
            if !self.sources_ready()? {
                return Ok(Err(Blocked::Wait(
                    "the cache has not seen this node's pod list since it was created; \
                     waiting for the apiserver"
                        .into(),
                )));
            }
            return Ok(Err(Blocked::End(
                "the pod is no longer in the cache".into(),
            )));
        };
        let mut running: Value = match serde_json::from_str(&pod.raw) {
            Ok(v) => v,
            Err(e) => {
                return Ok(Err(Blocked::End(format!(
                    "the cached pod cannot be read: {e}"
                ))))
            }
        };
        desired::as_running(
            &mut running,
            self.store.running_revision(&rec.pod_uid)?.as_ref(),
        );
        let plan: UpgradePlan = match rec.plan.as_deref().map(serde_json::from_str) {
            Some(Ok(p)) => p,
            Some(Err(e)) => {
                return Ok(Err(Blocked::End(format!(
                    "the journal's plan cannot be read: {e}"
                ))))
            }
            None => match self.make_plan(&pod, &running, &rec.to_hash)? {
                Ok(p) => p,
                Err(why) => return Ok(Err(Blocked::End(why))),
            },
        };
        let mut target = running.clone();
        match (&plan.mode, &plan.target_spec) {
            (Mode::Recreate, Some(spec)) => {
                crate::pod::running::recreate_target(&mut target, spec, &rec.to_hash)
            }
            (Mode::Recreate, None) => {
                return Ok(Err(Blocked::End(
                    "the journal's recreate plan has no target spec".into(),
                )))
            }
            (Mode::InPlace, _) => {
                crate::pod::running::apply_images(&mut target, &plan::images(&plan), &rec.to_hash)
            }
        }
        let dir_uid = self
            .store
            .pod_aliases()?
            .into_iter()
            .find(|(_, pod)| *pod == rec.pod_uid)
            .map(|(label, _)| label);
        Ok(Ok(Context {
            pod,
            plan,
            running_json: running,
            target_json: target,
            dir_uid,
        }))
    }

    /// Translates both revisions with the addresses the pod has now: the running sandbox's
    /// (in place, both revisions run there), or the new sandbox's for a recreate's target.
    pub(super) fn translate(
        &self,
        ctx: &Context,
        now: &steps::PodNow,
        upgrade_uid: &str,
    ) -> Result<Plans, StoreError> {
        let place = Place {
            data_dir: &self.data_dir,
            node_name: &self.node_name,
            host_ip: self.host_ip.as_deref(),
        };
        let host_network = |v: &Value| {
            v.pointer("/spec/hostNetwork")
                .and_then(Value::as_bool)
                .unwrap_or(false)
        };
        let running_ip = now
            .sandbox()
            .filter(|_| !host_network(&ctx.running_json))
            .and_then(|sb| now.sandbox_ip(&sb.id))
            .map(str::to_string);
        let target_ip = match ctx.plan.mode {
            Mode::InPlace => running_ip.clone(),
            Mode::Recreate => now.new_pod_ip(upgrade_uid),
        }
        .filter(|_| !host_network(&ctx.target_json));
        let context = |v: &Value, ip: Option<String>| {
            desired::context(
                &self.store,
                place,
                &ctx.pod,
                v,
                0,
                ip,
                ctx.dir_uid.as_deref(),
            )
        };
        let old_ctx = context(&ctx.running_json, running_ip)?;
        let target_ctx = context(&ctx.target_json, target_ip)?;
        let mut permanent = None;
        let mut plan = |v: &Value, c: &podspec::PodContext| {
            podspec::translate(v, c).map_err(|e| {
                let on_its_way = matches!(&e, podspec::PlanError::Missing(m) if !m.known_absent);
                if !on_its_way {
                    permanent.get_or_insert_with(|| e.to_string());
                }
                e.to_string()
            })
        };
        let old = plan(&ctx.running_json, &old_ctx);
        let target = plan(&ctx.target_json, &target_ctx);
        Ok(Plans {
            old,
            target,
            permanent,
            target_ctx,
        })
    }

    pub(super) fn make_plan(
        &self,
        pod: &StoredObject,
        running: &Value,
        to_hash: &str,
    ) -> Result<Result<UpgradePlan, String>, StoreError> {
        let Some(owner) = pod.index.owner_uid.clone() else {
            return Ok(Err("the pod has no owner".into()));
        };
        let mut decider = Decider::new(&self.store);
        let Some(ds) = decider.daemonset(&owner)? else {
            return Ok(Err("the pod's DaemonSet is not cached".into()));
        };
        let min_ready = self
            .store
            .get_by_uid(Kind::DaemonSet, &owner)?
            .and_then(|d| serde_json::from_str::<Value>(&d.raw).ok())
            .and_then(|d| d.pointer("/spec/minReadySeconds").and_then(Value::as_i64))
            .unwrap_or(0);
        Ok(plan::make(
            crate::revision::pod_hash(running),
            to_hash,
            &ds.revisions,
            min_ready,
            self.config.min_ready_floor.as_millis() as u64,
        )
        .map_err(|e| e.to_string()))
    }
}
