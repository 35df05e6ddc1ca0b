//! Sending one row of each kind: a pod status (a merge patch of what the apiserver holds),
//! an Event (created once, then its series patched, never read back: a node may not read
//! Events), and a revision report (delete-and-adopt, or a patch in patch mode).

use super::*;

impl<C: Cloud> Sender<C> {
    pub(super) async fn send_status(
        &mut self,
        row: &OutboxRow,
        d: &mut Drained,
    ) -> Result<(), Failure> {
        let Some(pod) = self.store.get_by_uid(Kind::Pod, &row.pod_uid)? else {
            // An empty cache is not a verdict: one that has not seen the pod list since it
            // was created (--reset-cache) cannot say the pod is gone.
            if !self.store.pod_list_seen()? {
                return Err(Failure::Verdict(
                    Verdict::Retry(None),
                    "the cache has not seen this node's pod list yet".into(),
                ));
            }
            return Err(Failure::Verdict(
                Verdict::Drop,
                "the pod is no longer cached".into(),
            ));
        };
        let ours: Value = serde_json::from_str(&row.body).map_err(|e| {
            Failure::Verdict(Verdict::Drop, format!("unreadable queued status: {e}"))
        })?;
        let cached: Value = serde_json::from_str(&pod.raw).unwrap_or(Value::Null);
        let current = cached.get("status").cloned().unwrap_or_else(|| json!({}));
        let Some(patch) = two_way_patch(&row.pod_uid, &current, &merge_onto(&current, &ours))
        else {
            // The apiserver already holds it.
            return Ok(());
        };
        self.pace().await;
        d.requests += 1;
        let raw = self
            .cloud
            .patch_pod_status(
                &pod.index.namespace,
                &pod.index.name,
                patch.to_string().into_bytes(),
            )
            .await?;
        match StoredObject::from_raw(Kind::Pod, raw) {
            Ok(obj) => {
                self.store.put_if_newer(&obj)?;
            }
            Err(e) => {
                tracing::debug!(pod = %row.name, error = %e, "status patch answer not stored")
            }
        }
        tracing::debug!(pod = %row.name, namespace = %row.namespace, "pod status reported");
        Ok(())
    }

    pub(super) async fn send_event(
        &mut self,
        row: &OutboxRow,
        d: &mut Drained,
    ) -> Result<(), Failure> {
        let mut body: Value = serde_json::from_str(&row.body).map_err(|e| {
            Failure::Verdict(Verdict::Drop, format!("unreadable queued Event: {e}"))
        })?;
        // A row queued before its series was kept (none in practice: both are written in one
        // transaction) starts one from what it holds.
        let series = self.store.event_series(row)?.unwrap_or(EventSeries {
            count: row.occurrences,
            first_timestamp: None,
            created: false,
        });
        body["count"] = series.count.into();
        if let Some(first) = &series.first_timestamp {
            body["firstTimestamp"] = first.as_str().into();
        }
        if series.created {
            match self.patch_series(&body, row, d).await {
                // The apiserver's event TTL removed it: created again, with the whole count.
                Err(e) if e.code() == Some(404) => {}
                r => return r.map_err(Failure::from),
            }
        }
        self.pace().await;
        d.requests += 1;
        match self
            .cloud
            .create_event(&row.namespace, body.to_string().into_bytes())
            .await
        {
            Ok(_) => Ok(()),
            // It exists: this series' own create whose answer was lost, or an Event of this
            // name the device kept no record of. The count is the series' total either way.
            Err(e) if e.code() == Some(409) => Ok(self.patch_series(&body, row, d).await?),
            Err(e) => Err(e.into()),
        }
    }

    /// Sets the Event's `count`, `lastTimestamp` and `message` from the device's series, as
    /// the kubelet's series PATCH does (fixture `event_patch_series_without_get_as_node`).
    pub(super) async fn patch_series(
        &mut self,
        body: &Value,
        row: &OutboxRow,
        d: &mut Drained,
    ) -> Result<(), KubeError> {
        let name = body
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or(&row.name)
            .to_string();
        let patch = json!({
            "count": body["count"],
            "lastTimestamp": body["lastTimestamp"],
            "message": body["message"],
        });
        self.pace().await;
        d.requests += 1;
        self.cloud
            .patch_event(&row.namespace, &name, patch.to_string().into_bytes())
            .await?;
        Ok(())
    }

    /// Reports the revision a pod runs after an offline upgrade, when its DaemonSet still
    /// wants that revision (if it moved on, the pod's status says what runs and
    /// PodNeedUpgrade stays True). Returns whether a request went out.
    pub(super) async fn send_revision(
        &mut self,
        r: &RunningRevision,
        d: &mut Drained,
    ) -> Result<bool, Failure> {
        let Some(pod) = self.store.get_by_uid(Kind::Pod, &r.pod_uid)? else {
            return Ok(false);
        };
        if pod.index.revision_hash.as_deref() == Some(r.hash.as_str()) {
            return Ok(false);
        }
        let Some(owner) = pod.index.owner_uid.as_deref() else {
            return Ok(false);
        };
        let wanted = {
            let mut decider = crate::need_upgrade::Decider::new(&self.store);
            decider
                .daemonset(owner)?
                .and_then(|ds| crate::revision::update_revision(&ds.revisions))
                .map(|rev| rev.hash.clone())
        };
        if wanted.as_deref() != Some(r.hash.as_str()) {
            return Ok(false);
        }
        let (ns, name) = (pod.index.namespace.clone(), pod.index.name.clone());
        let images = match serde_json::from_str(&r.images) {
            Ok(crate::pod::running::RunningAs::Images(i)) => Some(i),
            _ => None,
        };
        if let (RevisionReport::Patch, Some(images)) = (self.revision_report, images) {
            let containers: Vec<Value> = images
                .iter()
                .map(|(n, i)| json!({"name": n, "image": i}))
                .collect();
            let patch = json!({
                "metadata": {"uid": r.pod_uid, "labels": {crate::object::REVISION_HASH_LABEL: r.hash}},
                "spec": {"containers": containers},
            });
            self.pace().await;
            d.requests += 1;
            self.cloud
                .patch_pod(&ns, &name, patch.to_string().into_bytes())
                .await?;
            tracing::info!(pod = %name, namespace = %ns, revision = %r.hash, "revision reported by patch");
            return Ok(true);
        }
        // Awaiting first, committed before the request: the watch may deliver the deletion,
        // and the runtime act on it, before the answer arrives here. A sandbox not yet marked
        // would be a gone pod's, and stopped.
        self.store.mark_awaiting_adoption(&r.pod_uid)?;
        self.pace().await;
        d.requests += 1;
        let answer = self.cloud.delete_pod(&ns, &name, &r.pod_uid).await;
        let verdict = classify::deletion(&answer);
        if let Err(e) = answer {
            match verdict {
                Deletion::Done => {}
                Deletion::Refused => {
                    self.store.unmark_awaiting_adoption(&r.pod_uid)?;
                    return Err(e.into());
                }
                // Taking the mark back here would have the watch's deletion, if the DELETE
                // did land, stop the upgraded sandbox as a gone pod's, and its replacement
                // start from scratch. Kept; asked again while the pod object is cached.
                Deletion::Unknown => {
                    tracing::warn!(pod = %name, namespace = %ns, revision = %r.hash, error = %e,
                        "no answer to the pod object's deletion; it may have landed, so the \
                         sandbox keeps awaiting its replacement");
                    return Err(e.into());
                }
            }
        }
        tracing::info!(pod = %name, namespace = %ns, revision = %r.hash,
            "pod object deleted; its replacement will adopt the running sandbox");
        Ok(true)
    }
}
