//! What a pass reads besides the CRI snapshot: the desired pods (cached, translated once per
//! store change), the pods waiting to be adopted, the upgrades that just ended, and the key
//! that says whether a settled pod's status can have changed.

use super::*;

impl<R: CriRuntime + 'static> Reconciler<R> {
    /// The store's rows this pass decides with: as last read, unless the store changed.
    pub(super) fn reads(&mut self) -> Result<&mut StoreReads, RuntimeError> {
        let fresh = StoreReads::refresh(self.reads.take(), &self.store, &self.node_name)?;
        Ok(self.reads.insert(fresh))
    }

    /// The upgrade uids on the snapshot's objects whose upgrades ended without committing.
    pub(super) fn ended_upgrades(
        &mut self,
        snapshot: &observe::Snapshot,
    ) -> Result<HashSet<String>, RuntimeError> {
        let mut uids: Vec<String> = snapshot
            .sandboxes
            .iter()
            .map(|s| &s.labels)
            .chain(snapshot.containers.iter().map(|c| &c.labels))
            .filter_map(|l| l.get(crate::cri::labels::UPGRADE_ID).cloned())
            .collect();
        if uids.is_empty() {
            return Ok(HashSet::new());
        }
        uids.sort_unstable();
        uids.dedup();
        let store = self.store.clone();
        Ok(self.reads()?.ended_without_commit(&store, uids)?)
    }

    /// A digest of what a settled pod's status is made of: the pod as read (its object, with
    /// the apiserver's status, and the cache it was read from: the need for an upgrade comes
    /// from there), its sandboxes and containers and their states (a state's facts never
    /// change), their addresses, its readiness verdicts and its pulled revision.
    pub(super) fn status_key(
        &self,
        pod: &DesiredPod,
        snapshot: &observe::Snapshot,
        pulled: Option<&String>,
    ) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        if let Some(c) = &self.desired {
            (Arc::as_ptr(&c.pods) as usize, c.store_gen).hash(&mut h);
        }
        let uid = pod.uid();
        let obs = snapshot.pod(uid);
        for sb in obs.sandboxes() {
            (&sb.id, sb.state, obs.sandbox_ip(&sb.id)).hash(&mut h);
        }
        for c in obs.containers() {
            (&c.id, c.state).hash(&mut h);
        }
        let mut ready: Vec<_> = self
            .probes
            .iter()
            .filter(|((u, _), _)| u == uid)
            .map(|((_, name), p)| (name, p.id.as_str(), p.ready()))
            .collect();
        ready.sort_unstable();
        ready.hash(&mut h);
        pulled.hash(&mut h);
        // A status the sender took off the queue (delivered or dropped) may be owed again.
        self.store.outbox_taken().hash(&mut h);
        h.finish()
    }

    /// The desired pods for `snapshot`: as last read, unless the cache or a sandbox changed
    /// since (what they are read from: the cached objects, their sources and the runtime map,
    /// all of whose writes bump the store's counter, and each sandbox's attempt and address).
    pub(super) fn desired_pods(
        &mut self,
        snapshot: &observe::Snapshot,
    ) -> Result<Arc<Vec<DesiredPod>>, RuntimeError> {
        // Read before the store is: a change while it is read is a change for the next pass.
        let store_gen = *self.store_gen.borrow_and_update();
        let sandboxes = snapshot.sandbox_key();
        if let Some(c) = &self.desired {
            if c.store_gen == store_gen
                && c.sandboxes == sandboxes
                && c.read_at.elapsed() < DESIRED_MAX_AGE
            {
                return Ok(c.pods.clone());
            }
        }
        let pods = Arc::new(desired::read(
            &self.store,
            snapshot,
            &self.data_dir,
            &self.node_name,
            self.host_ip.as_deref(),
        )?);
        self.desired = Some(DesiredCache {
            pods: pods.clone(),
            store_gen,
            sandboxes,
            read_at: Instant::now(),
        });
        Ok(pods)
    }

    /// Sandboxes awaiting their replacement pod, from the runtime map.
    pub(super) fn awaiting(&mut self) -> Result<Vec<decide::Awaiting>, RuntimeError> {
        let limit = self.adopt_timeout.as_millis() as i64;
        // On the boot clock: the wall clock of a vehicle jumps. Counted from when the pod
        // object's deletion was seen, not from the DELETE: a link that drops right after the
        // DELETE must not use up the replacement's time.
        Ok(self.reads()?.awaiting(crate::time::boot_ms(), limit))
    }

    pub(super) fn refused_waiting(&self, uid: &str, now: Instant) -> bool {
        self.refused
            .get(uid)
            .and_then(|r| r.next_allowed)
            .is_some_and(|t| now < t)
    }

    pub(super) fn note_unsynced(
        &mut self,
        desired: &[DesiredPod],
        snapshot: &observe::Snapshot,
        sources_ready: bool,
        held: &HashSet<String>,
        pass: &mut Pass,
    ) {
        if sources_ready {
            self.warned_unsynced = false;
            return;
        }
        let cached: HashSet<&str> = desired.iter().map(|p| p.uid()).collect();
        let kept = snapshot
            .sandbox_uids()
            .into_iter()
            .filter(|u| !cached.contains(u) && !held.contains(*u))
            .count();
        pass.kept_unsynced = kept;
        if kept > 0 && !self.warned_unsynced {
            tracing::warn!(
                pods = kept,
                "the cache has not seen this node's pod list yet; \
                leaving running pods it does not know alone until it has"
            );
            self.warned_unsynced = true;
        }
    }
}
