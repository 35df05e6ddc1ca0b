//! The handlers of the local API. Each takes the shared state and validated route parameters
//! and returns a [`Reply`]; none of them sees raw request bytes.

use super::podlist::{write_with_condition, POD_LIST_END, POD_LIST_START};
use super::{ApiState, Reply};
use crate::link::LinkState;
use crate::need_upgrade::Decider;
use crate::object::Kind;
use crate::store::{NewRequest, Recorded, RequestKind, RequestRecord};
use serde_json::json;
use std::sync::atomic::Ordering;

/// `GET /pods`: the node's pods from the cache, each with its `PodNeedUpgrade` condition.
pub fn pods(state: &ApiState) -> Reply {
    let pods = match state.store.list(Kind::Pod) {
        Ok(p) => p,
        Err(e) => return Reply::internal("Get pod list failed", &e),
    };
    let mut decider = Decider::new(&state.store);
    // What the device runs is the truth: the status edgehub has queued for the apiserver
    // (after an offline upgrade, the new images) is served before the cloud has it.
    let queued: std::collections::HashMap<String, String> = match state.store.queued_statuses() {
        Ok(q) => q.into_iter().map(|q| (q.pod_uid, q.status)).collect(),
        Err(e) => return Reply::internal("Get pod list failed", &e),
    };
    let size: usize = pods.iter().map(|p| p.raw.len() + 160).sum();
    let mut out = String::with_capacity(POD_LIST_START.len() + size + POD_LIST_END.len());
    out.push_str(POD_LIST_START);
    for (i, pod) in pods.iter().enumerate() {
        let need = match decider.decide(&pod.index) {
            Ok(n) => n,
            Err(e) => return Reply::internal("Get pod list failed", &e),
        };
        if i > 0 {
            out.push(',');
        }
        let uid = &pod.index.uid;
        // And the revision it runs, when an upgrade committed one the cloud has not heard of.
        let running = match decider.running_hash(uid) {
            Ok(h) => h,
            Err(e) => return Reply::internal("Get pod list failed", &e),
        };
        let overlaid = (queued.contains_key(uid) || running.is_some())
            .then(|| as_run(&pod.raw, queued.get(uid), running))
            .flatten();
        let raw = overlaid.as_deref().unwrap_or(&pod.raw);
        if let Err(e) = write_with_condition(&mut out, raw, &need.condition()) {
            // Serve what the apiserver sent rather than drop the pod from the list.
            tracing::warn!(pod = %pod.index.name, namespace = %pod.index.namespace, error = %e,
                "cached pod is not a JSON object; serving it without PodNeedUpgrade");
            out.push_str(&pod.raw);
        }
    }
    out.push_str(POD_LIST_END);
    Reply::json(200, out)
}

/// The pod JSON as the device runs it: the status edgehub queued merged onto the apiserver's
/// (edgehub's fields over the apiserver's), and the revision hash it runs.
fn as_run(raw: &str, status: Option<&String>, hash: Option<&str>) -> Option<String> {
    let mut pod: serde_json::Value = serde_json::from_str(raw).ok()?;
    if let Some(status) = status {
        let ours: serde_json::Value = serde_json::from_str(status).ok()?;
        let merged = crate::pod::status::merge_onto(&pod["status"], &ours);
        pod["status"] = merged;
    }
    if let Some(h) = hash {
        if let Some(labels) = pod
            .pointer_mut("/metadata/labels")
            .and_then(serde_json::Value::as_object_mut)
        {
            labels.insert(crate::object::REVISION_HASH_LABEL.to_string(), h.into());
        }
    }
    Some(pod.to_string())
}

/// `POST .../upgrade` and `POST .../imagepull`: validate against the cache, then record the
/// request for the upgrade engine. Works with the link down.
pub fn request(state: &ApiState, kind: RequestKind, namespace: &str, name: &str) -> Reply {
    let pod = match state.store.get(Kind::Pod, namespace, name) {
        Ok(Some(p)) => p,
        Ok(None) => return Reply::text(404, format!("Pod {namespace}/{name} not found")),
        Err(e) => return Reply::internal("Get pod failed", &e),
    };
    if pod.index.owner_kind.as_deref() != Some("DaemonSet") {
        return Reply::text(
            400,
            format!(
                "Not support ota upgrade pod type {}",
                pod.index.owner_kind.as_deref().unwrap_or("<none>")
            ),
        );
    }
    let need = match Decider::new(&state.store).decide(&pod.index) {
        Ok(n) => n,
        Err(e) => return Reply::internal("Get pod failed", &e),
    };
    let Some(target) = need.target().filter(|_| need.needed()) else {
        tracing::info!(pod = %name, namespace = %namespace, reason = need.reason(), "upgrade refused: pod is not updatable");
        return Reply::text(403, format!("Pod is not-updatable: {}", need.reason()));
    };
    // One already running is the answer, whatever the images: 409 before any 412 or 503.
    match state.store.active_request(kind, &pod.index.uid) {
        Ok(Some(r)) => return in_progress(kind, namespace, name, &r),
        Ok(None) => {}
        Err(e) => return Reply::internal("Get pod failed", &e),
    }
    if kind == RequestKind::Upgrade {
        if let Some(refused) = images_missing_offline(state, &pod.index.uid, target) {
            return refused;
        }
    }
    let req = NewRequest {
        kind,
        pod_uid: &pod.index.uid,
        namespace,
        name,
        from_hash: pod.index.revision_hash.as_deref(),
        to_hash: target,
    };
    match state.store.record_request(&req) {
        Ok(Recorded::New(r)) => {
            tracing::info!(pod = %name, namespace = %namespace, request = r.id, kind = kind.as_str(),
                from = ?r.from_hash, to = %r.to_hash, "request recorded");
            let body = match kind {
                RequestKind::Upgrade => format!("Start updating pod {namespace}/{name}"),
                RequestKind::ImagePull => {
                    format!("Image pre-pull requested for pod {namespace}/{name}")
                }
            };
            // OpenYurt answers with this content type and an unquoted body.
            Reply::json(200, body)
        }
        Ok(Recorded::Active(r)) => in_progress(kind, namespace, name, &r),
        Err(e) => Reply::internal("Apply update failed", &e),
    }
}

fn in_progress(kind: RequestKind, namespace: &str, name: &str, r: &RequestRecord) -> Reply {
    Reply::text(
        409,
        format!(
            "{} of pod {namespace}/{name} is already in progress (request {}, state {})",
            match kind {
                RequestKind::Upgrade => "Upgrade",
                RequestKind::ImagePull => "Image pre-pull",
            },
            r.id,
            r.state
        ),
    )
}

/// How long the image check before an upgrade may take in all, so that the request is
/// answered well inside the API's deadline (and the answer says what happened).
const IMAGE_CHECK_BUDGET: std::time::Duration = std::time::Duration::from_secs(4);

/// An upgrade whose images are not on the node while their registry cannot be reached is
/// refused before anything changes: 412, naming the images. (An image whose registry
/// answers is pulled by the upgrade; the apiserver link says nothing about the registry.)
/// A container runtime that does not answer is a 503 naming it: an upgrade accepted then
/// could only wait, and the OTA manager is better told now.
pub(super) fn images_missing_offline(
    state: &ApiState,
    pod_uid: &str,
    target: &str,
) -> Option<Reply> {
    let runtime = state.runtime.as_ref()?;
    let images = match crate::upgrade::target_images(&state.store, pod_uid, target) {
        Ok(Some(i)) => i,
        Ok(None) => return None,
        Err(e) => return Some(Reply::internal("Get pod failed", &e)),
    };
    use crate::cri::CriRuntime;
    enum Seen {
        Present,
        Pullable,
        Missing(String),
        Runtime(String),
    }
    let mut wanted: Vec<String> = images.into_values().collect();
    wanted.sort();
    wanted.dedup();
    // Handlers run on blocking threads (see `serve`), where waiting on the runtime is fine.
    // Every image is checked at once, all within one budget.
    let seen: Vec<Seen> = tokio::runtime::Handle::current().block_on(async {
        let mut checks = tokio::task::JoinSet::new();
        for img in wanted {
            let runtime = runtime.clone();
            checks.spawn(async move {
                match runtime.image_status(&img).await {
                    Ok(Some(_)) => Seen::Present,
                    Err(e) => Seen::Runtime(e.to_string()),
                    Ok(None) => {
                        let (host, port) = crate::upgrade::registry_of(&img);
                        let reachable = tokio::time::timeout(
                            std::time::Duration::from_secs(3),
                            tokio::net::TcpStream::connect((host.as_str(), port)),
                        )
                        .await
                        .is_ok_and(|c| c.is_ok());
                        if reachable {
                            Seen::Pullable
                        } else {
                            Seen::Missing(img)
                        }
                    }
                }
            });
        }
        let all = async {
            let mut seen = Vec::new();
            while let Some(s) = checks.join_next().await {
                seen.push(s.unwrap_or_else(|e| Seen::Runtime(e.to_string())));
            }
            seen
        };
        match tokio::time::timeout(IMAGE_CHECK_BUDGET, all).await {
            Ok(mut seen) => {
                seen.sort_by(|a, b| match (a, b) {
                    (Seen::Missing(x), Seen::Missing(y)) => x.cmp(y),
                    _ => std::cmp::Ordering::Equal,
                });
                seen
            }
            Err(_) => vec![Seen::Runtime(format!(
                "it did not answer within {} s",
                IMAGE_CHECK_BUDGET.as_secs()
            ))],
        }
    });
    if let Some(why) = seen.iter().find_map(|s| match s {
        Seen::Runtime(e) => Some(e),
        _ => None,
    }) {
        tracing::warn!(pod_uid = %pod_uid, error = %why, "upgrade refused: the container runtime does not answer");
        return Some(Reply::text(
            503,
            format!("The container runtime does not answer ({why}); the upgrade was not recorded, ask again when it is back"),
        ));
    }
    let missing: Vec<&str> = seen
        .iter()
        .filter_map(|s| match s {
            Seen::Missing(img) => Some(img.as_str()),
            _ => None,
        })
        .collect();
    if missing.is_empty() {
        return None;
    }
    tracing::info!(pod_uid = %pod_uid, images = ?missing, "upgrade refused: images missing and offline");
    Some(Reply::text(
        412,
        format!(
            "Images of revision {target} are not on the node and their registry cannot be reached: {}; \
             side-load them (an OCI archive, skopeo copy ... oci-archive:FILE:IMAGE, or docker save): \
             edgehub images load FILE, POST /v1/images/load, or a FILE.tar renamed into the image drop \
             directory; then ask again",
            missing.join(", ")
        ),
    ))
}

fn record_json(r: &RequestRecord) -> serde_json::Value {
    json!({
        "id": r.id,
        "kind": r.kind.as_str(),
        "namespace": r.namespace,
        "name": r.name,
        "podUID": r.pod_uid,
        "from": r.from_hash,
        "to": r.to_hash,
        "state": r.state,
        "error": r.error,
        "waiting": r.waiting,
        "uid": r.uid,
        "createdMs": r.created_ms,
        "updatedMs": r.updated_ms,
    })
}

/// `GET .../upgrade`: the pod's latest upgrade request.
pub fn upgrade_status(state: &ApiState, namespace: &str, name: &str) -> Reply {
    match state
        .store
        .latest_request(RequestKind::Upgrade, namespace, name)
    {
        Ok(Some(r)) => Reply::json(200, record_json(&r).to_string()),
        Ok(None) => Reply::text(
            404,
            format!("No upgrade requested for pod {namespace}/{name}"),
        ),
        Err(e) => Reply::internal("Get upgrade failed", &e),
    }
}

fn link_json(link: &LinkState) -> serde_json::Value {
    match link {
        LinkState::Unknown => json!({"state": "Unknown"}),
        LinkState::Online => json!({"state": "Online"}),
        LinkState::Offline { reason } => json!({"state": "Offline", "reason": reason}),
        LinkState::TlsFailed { reason } => json!({"state": "TlsFailed", "reason": reason}),
    }
}

/// `GET /v1/status`: link, cache sizes and active requests.
pub fn status(state: &ApiState) -> Reply {
    let count = |k| state.store.count(k);
    let (pods, ds, crs, nodes) = match (
        count(Kind::Pod),
        count(Kind::DaemonSet),
        count(Kind::ControllerRevision),
        count(Kind::Node),
    ) {
        (Ok(a), Ok(b), Ok(c), Ok(d)) => (a, b, c, d),
        (Err(e), ..) | (_, Err(e), ..) | (_, _, Err(e), _) | (_, _, _, Err(e)) => {
            return Reply::internal("Get status failed", &e)
        }
    };
    let active = match state.store.active_requests() {
        Ok(a) => a,
        Err(e) => return Reply::internal("Get status failed", &e),
    };
    let cri = state.cri.borrow().clone();
    let synced = match cache_synced(state) {
        Ok(s) => s,
        Err(e) => return Reply::internal("Get status failed", &e),
    };
    let outbox = match (state.store.outbox_counts(), state.store.outbox_parked()) {
        (Ok((queued, _)), Ok(parked)) => json!({
            "queued": queued,
            "parked": parked.iter().map(|r| json!({
                "kind": r.kind.as_str(), "namespace": r.namespace, "name": r.name,
                "attempts": r.attempts, "error": r.last_error,
            })).collect::<Vec<_>>(),
        }),
        (Err(e), _) | (_, Err(e)) => return Reply::internal("Get status failed", &e),
    };
    let secrets = match state.store.seal_status() {
        Ok(s) => json!({
            "sealed": s.key.is_some(),
            "key": s.key,
            "rows": {"sealed": s.counts.sealed, "clear": s.counts.clear,
                "unreadable": s.counts.unreadable},
        }),
        Err(e) => return Reply::internal("Get status failed", &e),
    };
    let body = json!({
        "node": state.node_name,
        "link": link_json(&state.link.borrow()),
        "runtime": match &cri {
            crate::cri::CriHealth::Ready { version } => json!({"state": "Ready", "version": version}),
            other => json!({"state": "Unavailable", "reason": other.problem()}),
        },
        "cache": {"pods": pods, "daemonSets": ds, "controllerRevisions": crs, "nodes": nodes,
            "synced": synced},
        "activeRequests": active.iter().map(record_json).collect::<Vec<_>>(),
        "outbox": outbox,
        "secrets": secrets,
        "identity": super::identity::status_json(state),
    });
    Reply::json(200, body.to_string())
}

/// `GET /v1/readyz`: ready when the store and the container runtime answer; otherwise 503
/// saying which does not.
pub fn readyz(state: &ApiState) -> Reply {
    let synced = match cache_synced(state) {
        Ok(s) => s,
        Err(e) => return Reply::text(503, format!("store: {e}")),
    };
    match state.cri.borrow().problem() {
        None if synced => Reply::text(200, "ok"),
        None => Reply::text(200, format!("ok; {UNSYNCED}")),
        Some(p) => Reply::text(503, format!("cri: {p}")),
    }
}

const UNSYNCED: &str = "cache not synced yet: this node's pod list has not completed since \
the cache was created, so pods it does not know keep running";

/// Whether the cache has seen this node's pod list (the runtime's "sources ready").
fn cache_synced(state: &ApiState) -> Result<bool, crate::store::StoreError> {
    Ok(state
        .store
        .cursor(&crate::sync::pods_cursor_key(&state.node_name))?
        .is_some())
}

/// `GET /metrics`: Prometheus text.
pub fn metrics(state: &ApiState) -> Reply {
    use super::metrics::family;
    let mut out = String::new();
    let kinds = [
        (Kind::Pod, "Pod"),
        (Kind::DaemonSet, "DaemonSet"),
        (Kind::ControllerRevision, "ControllerRevision"),
        (Kind::Node, "Node"),
    ];
    let samples: Vec<(String, u64)> = kinds
        .iter()
        .map(|(k, n)| (format!("kind=\"{n}\""), state.store.count(*k).unwrap_or(0)))
        .collect();
    family(
        &mut out,
        "edgehub_cache_objects",
        "gauge",
        "Objects in the local cache.",
        &samples,
    );
    let (queued, parked) = state.store.outbox_counts().unwrap_or((0, 0));
    family(
        &mut out,
        "edgehub_outbox_rows",
        "gauge",
        "Reports waiting for the apiserver: queued, or parked (refused for good).",
        &[
            ("state=\"queued\"".to_string(), queued),
            ("state=\"parked\"".to_string(), parked),
        ],
    );
    let online = matches!(*state.link.borrow(), LinkState::Online) as u64;
    family(
        &mut out,
        "edgehub_link_online",
        "gauge",
        "1 when the apiserver is reachable.",
        &[(String::new(), online)],
    );
    if let Some(gc) = &state.image_gc {
        let g = |v: &std::sync::atomic::AtomicU64| vec![(String::new(), v.load(Ordering::Relaxed))];
        family(
            &mut out,
            "edgehub_image_fs_used_bytes",
            "gauge",
            "Bytes used on the container runtime's image filesystem, at the last look.",
            &g(&gc.fs_used_bytes),
        );
        family(
            &mut out,
            "edgehub_image_fs_capacity_bytes",
            "gauge",
            "Size of the container runtime's image filesystem.",
            &g(&gc.fs_capacity_bytes),
        );
        family(
            &mut out,
            "edgehub_image_gc_removed_total",
            "counter",
            "Images removed by image garbage collection.",
            &g(&gc.images_removed),
        );
        family(
            &mut out,
            "edgehub_image_gc_removed_bytes_total",
            "counter",
            "Bytes of the images garbage collection removed.",
            &g(&gc.bytes_removed),
        );
        family(
            &mut out,
            "edgehub_image_gc_errors_total",
            "counter",
            "Image removals the runtime refused.",
            &g(&gc.remove_errors),
        );
    }
    let per = |f: fn(&crate::sync::ReflectorStats) -> u64| -> Vec<(String, u64)> {
        state
            .sync_stats
            .iter()
            .map(|(k, s)| (format!("resource=\"{}\"", k.replace('"', "")), f(s)))
            .collect()
    };
    family(
        &mut out,
        "edgehub_sync_lists_total",
        "counter",
        "Full lists per watched resource.",
        &per(|s| s.lists.load(Ordering::Relaxed)),
    );
    family(
        &mut out,
        "edgehub_sync_events_total",
        "counter",
        "Watch events received.",
        &per(|s| s.events.load(Ordering::Relaxed)),
    );
    family(
        &mut out,
        "edgehub_sync_writes_total",
        "counter",
        "Objects written or deleted in the cache.",
        &per(|s| s.written.load(Ordering::Relaxed)),
    );
    family(
        &mut out,
        "edgehub_sync_malformed_total",
        "counter",
        "Malformed events or objects skipped.",
        &per(|s| s.malformed.load(Ordering::Relaxed)),
    );
    family(
        &mut out,
        "edgehub_sync_errors_total",
        "counter",
        "Sync errors (each followed by a backoff).",
        &per(|s| s.errors.load(Ordering::Relaxed)),
    );
    state.metrics.render_requests(&mut out);
    Reply {
        status: 200,
        content_type: "text/plain; version=0.0.4",
        body: out.into(),
        allow: None,
        challenge: None,
    }
}
