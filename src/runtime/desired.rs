//! The desired pods of one pass: every cached pod, its JSON read once, translated for the
//! runtime with what it references (from the cache) and what the snapshot knows (its
//! sandbox's attempt and address).

use super::decide::DesiredPod;
use super::observe::Snapshot;
use crate::object::Kind;
use crate::podspec::{self, PodContext};
use crate::sources::fetch;
use crate::store::{Store, StoreError};
use serde_json::Value;
use std::path::Path;

/// Where the runtime keeps a pod's files: `<data_dir>/pods/<uid>`.
pub fn pod_dir(data_dir: &Path, uid: &str) -> std::path::PathBuf {
    data_dir.join("pods").join(uid)
}

/// The grace period a pod is stopped with.
pub fn grace_of(pod: &Value) -> i64 {
    pod.pointer("/metadata/deletionGracePeriodSeconds")
        .or_else(|| pod.pointer("/spec/terminationGracePeriodSeconds"))
        .and_then(Value::as_i64)
        .unwrap_or(30)
        .max(0)
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
    let mut out = Vec::with_capacity(pods.len());
    for obj in pods {
        let parsed: Value = match serde_json::from_str(&obj.raw) {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(pod = %obj.index.name, namespace = %obj.index.namespace, error = %e,
                    "cached pod is not valid JSON; leaving it as it runs");
                out.push(DesiredPod {
                    grace_secs: 30,
                    plan: None,
                    ctx: None,
                    obj,
                });
                continue;
            }
        };
        let grace_secs = grace_of(&parsed);
        if obj.index.deleting {
            out.push(DesiredPod {
                obj,
                grace_secs,
                plan: None,
                ctx: None,
            });
            continue;
        }
        let uid = obj.index.uid.clone();
        let obs = snapshot.pod(&uid);
        let host_network = parsed
            .pointer("/spec/hostNetwork")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let pod_ip = match obs.ready_sandbox() {
            Some(sb) if !host_network => obs.sandbox_ip(&sb.id).map(str::to_string),
            _ => None,
        };
        let dir = pod_dir(data_dir, &uid);
        let ctx = PodContext {
            node_name: node_name.to_string(),
            host_ip: host_ip.map(str::to_string),
            volume_dir: dir.join("volumes"),
            log_dir: dir.join("logs"),
            attempt: obs.next_sandbox_attempt(),
            pod_ip,
            sources: fetch::load(store, &obj, &parsed)?,
        };
        let plan = podspec::translate(&parsed, &ctx);
        out.push(DesiredPod {
            obj,
            grace_secs,
            plan: Some(plan),
            ctx: Some(ctx),
        });
    }
    Ok(out)
}
