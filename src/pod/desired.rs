//! The desired pods of one pass: every cached pod, its JSON read once, translated for the
//! runtime with what it references (from the cache) and what the snapshot knows (its
//! sandbox's attempt and address).

use super::observe::Snapshot;
use crate::object::Kind;
use crate::podspec::{self, PlanError, PodContext, PodPlan, Unsupported};
use crate::sources::fetch;
use crate::store::{RunningRevision, Store, StoreError, StoredObject};
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;

/// A cached pod, read once per pass and translated for the runtime.
#[derive(Debug, Clone)]
pub struct DesiredPod {
    pub obj: StoredObject,
    /// `metadata.deletionGracePeriodSeconds`, else `spec.terminationGracePeriodSeconds`, else 30.
    pub grace_secs: i64,
    /// `None` when the pod is being deleted or its JSON cannot be read (it is still wanted as
    /// it runs: an unreadable row must not stop a running pod).
    pub plan: Option<Result<PodPlan, PlanError>>,
    /// The context the plan was translated with, for a sandbox start that translates again
    /// once the sandbox has its address.
    pub ctx: Option<PodContext>,
    /// The pod's `status` as the apiserver last returned it (null when it has none).
    pub status: serde_json::Value,
}

impl DesiredPod {
    pub fn uid(&self) -> &str {
        &self.obj.index.uid
    }
}

/// A pod uid that cannot name a directory (see [`crate::names::check_uid`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("pod uid {uid:?} cannot name the pod's directory: {reason}")]
pub struct BadUid {
    pub uid: String,
    pub reason: String,
}

/// Where the runtime keeps a pod's files: `<data_dir>/pods/<uid>`. The uid is checked first:
/// a uid of `..` would make the pod's directory the data dir itself, and its cleanup remove
/// everything edgehub has.
pub fn pod_dir(data_dir: &Path, uid: &str) -> Result<std::path::PathBuf, BadUid> {
    crate::names::check_uid(uid).map_err(|reason| BadUid {
        uid: uid.to_string(),
        reason,
    })?;
    Ok(data_dir.join("pods").join(uid))
}

/// The grace period a pod is stopped with.
pub fn grace_of(pod: &Value) -> i64 {
    pod.pointer("/metadata/deletionGracePeriodSeconds")
        .or_else(|| pod.pointer("/spec/terminationGracePeriodSeconds"))
        .and_then(Value::as_i64)
        .unwrap_or(30)
        .max(0)
}

/// Where a pod runs and what it references: what translating it for the CRI needs.
#[derive(Debug, Clone, Copy)]
pub struct Place<'a> {
    pub data_dir: &'a Path,
    pub node_name: &'a str,
    pub host_ip: Option<&'a str>,
}

/// The context to translate `pod` (parsed from `obj`) with: its directories, the sources it
/// references from the cache, its sandbox attempt and address.
/// `dir_uid` is the uid the pod's directory is named by: its own, or, for a pod that adopted
/// the sandbox of the pod it replaced, that pod's (the running containers mount it).
pub fn context(
    store: &Store,
    place: Place<'_>,
    obj: &StoredObject,
    pod: &Value,
    attempt: u32,
    pod_ip: Option<String>,
    dir_uid: Option<&str>,
) -> Result<PodContext, StoreError> {
    let dir = pod_dir(place.data_dir, dir_uid.unwrap_or(&obj.index.uid)).map_err(|e| {
        StoreError::BadObject {
            kind: "Pod",
            namespace: obj.index.namespace.clone(),
            name: obj.index.name.clone(),
            reason: e.to_string(),
        }
    })?;
    Ok(PodContext {
        node_name: place.node_name.to_string(),
        host_ip: place.host_ip.map(str::to_string),
        volume_dir: dir.join("volumes"),
        log_dir: dir.join("logs"),
        attempt,
        pod_ip,
        sources: fetch::load(store, obj, pod)?,
    })
}

/// The pod as the device runs it: an upgrade that committed a revision the cached pod object
/// does not have yet (the cloud has not heard) runs that revision's images. Returns whether
/// it changed the pod.
pub fn as_running(pod: &mut Value, running: Option<&RunningRevision>) -> bool {
    let Some(r) = running else {
        return false;
    };
    if crate::revision::pod_hash(pod) == Some(r.hash.as_str()) {
        return false;
    }
    match serde_json::from_str::<super::running::RunningAs>(&r.images) {
        Ok(how) => how.apply(pod, &r.hash),
        Err(e) => {
            tracing::warn!(pod_uid = %r.pod_uid, error = %e, "the runtime map's entry cannot be read; running the cached pod");
            return false;
        }
    }
    true
}

/// Reads the cached pods. Each pod's JSON is parsed once and dropped after translation: a
/// parsed pod is about ten times its JSON.
pub fn read(
    store: &Store,
    snapshot: &Snapshot,
    data_dir: &Path,
    node_name: &str,
    host_ip: Option<&str>,
) -> Result<Vec<DesiredPod>, StoreError> {
    let pods = store.list(Kind::Pod)?;
    let running: HashMap<String, RunningRevision> = store
        .running_revisions()?
        .into_iter()
        .map(|r| (r.pod_uid.clone(), r))
        .collect();
    // Pod uid -> the uid its directory has, for pods that adopted another's sandbox.
    let dirs: HashMap<&str, &str> = snapshot
        .aliases
        .iter()
        .map(|(label, pod)| (pod.as_str(), label.as_str()))
        .collect();
    let place = Place {
        data_dir,
        node_name,
        host_ip,
    };
    let mut out = Vec::with_capacity(pods.len());
    for mut obj in pods {
        let mut parsed: Value = match serde_json::from_str(&obj.raw) {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(pod = %obj.index.name, namespace = %obj.index.namespace, error = %e,
                    "cached pod is not valid JSON; leaving it as it runs");
                out.push(DesiredPod {
                    grace_secs: 30,
                    plan: None,
                    ctx: None,
                    status: Value::Null,
                    obj,
                });
                continue;
            }
        };
        let grace_secs = grace_of(&parsed);
        let status = parsed.get("status").cloned().unwrap_or(Value::Null);
        if obj.index.deleting {
            out.push(DesiredPod {
                obj,
                grace_secs,
                plan: None,
                ctx: None,
                status,
            });
            continue;
        }
        let uid = obj.index.uid.clone();
        // A uid that cannot name a directory: refused with the reason in its status, and
        // nothing of it ever touches the disk (the cache still holds it as the server sent it).
        let dir_uid = dirs.get(uid.as_str()).copied();
        if let Err(e) = pod_dir(data_dir, dir_uid.unwrap_or(&uid)) {
            out.push(DesiredPod {
                obj,
                grace_secs,
                plan: Some(Err(PlanError::Unsupported(Unsupported {
                    field: "metadata.uid".into(),
                    reason: e.to_string(),
                }))),
                ctx: None,
                status,
            });
            continue;
        }
        let obs = snapshot.pod(&uid);
        let host_network = parsed
            .pointer("/spec/hostNetwork")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let pod_ip = match obs.ready_sandbox() {
            Some(sb) if !host_network => obs.sandbox_ip(&sb.id).map(str::to_string),
            _ => None,
        };
        if as_running(&mut parsed, running.get(&uid)) {
            // A sandbox start translates the pod again from its JSON: the running one.
            obj.raw = parsed.to_string();
        }
        let ctx = context(
            store,
            place,
            &obj,
            &parsed,
            obs.next_sandbox_attempt(),
            pod_ip,
            dir_uid,
        )?;
        let plan = podspec::translate(&parsed, &ctx);
        out.push(DesiredPod {
            obj,
            grace_secs,
            plan: Some(plan),
            ctx: Some(ctx),
            status,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pod_dir_is_always_inside_the_pods_directory() {
        let data = Path::new("/var/lib/edgehub");
        assert_eq!(
            pod_dir(data, "b6a7f3c2-0d5e-4f8a").unwrap(),
            Path::new("/var/lib/edgehub/pods/b6a7f3c2-0d5e-4f8a")
        );
        // `..` was the data dir itself, which Finalize then removed.
        for bad in ["..", ".", "", "../x", "a/b", "/etc", ".hidden"] {
            let e = pod_dir(data, bad).unwrap_err();
            assert_eq!(e.uid, bad);
        }
    }
}
