//! One owner per pod: the runtime and the upgrade engine share [`PodLocks`], so two never act
//! on one pod at once, and a pod the engine holds gets no action, status or cleanup from the
//! runtime.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

/// Who holds a pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holder {
    /// A runtime task is working on it.
    Runtime,
    /// An upgrade owns it until it ends.
    Upgrade,
}

/// Which pods are held, shared by the runtime and the upgrade engine: one holder per pod, so
/// two never act on one pod at once.
#[derive(Debug, Clone, Default)]
pub struct PodLocks(Arc<Mutex<HashMap<String, Holder>>>);

impl PodLocks {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, Holder>> {
        // A poisoned lock only means a holder panicked mid-update; the map is still whole.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Holds `uid` for `holder` if nobody does; returns whether it did.
    pub fn try_hold(&self, uid: &str, holder: Holder) -> bool {
        let mut m = self.map();
        if m.contains_key(uid) {
            return false;
        }
        m.insert(uid.to_string(), holder);
        true
    }

    /// Releases `uid` if `holder` holds it.
    pub fn release(&self, uid: &str, holder: Holder) {
        let mut m = self.map();
        if m.get(uid) == Some(&holder) {
            m.remove(uid);
        }
    }

    pub fn holder(&self, uid: &str) -> Option<Holder> {
        self.map().get(uid).copied()
    }

    pub fn held(&self) -> HashSet<String> {
        self.map().keys().cloned().collect()
    }
}
