//! `/v1/transactions`: upgrades the OTA manager commits or rolls back (docs/api.md,
//! "Transactions"). Bodies are parsed by pure functions ([`parse_start`], [`parse_rollback`]),
//! fuzzed and unit-tested; a request that does not pass every check records nothing.

use super::handlers::images_missing_offline;
use super::{ApiState, Reply};
use crate::need_upgrade::Decider;
use crate::object::Kind;
use crate::store::{Decided, Decision, NewRequest, RequestKind, TxnCreated, TxnRecord};
use crate::upgrade::txn;
use serde::Deserialize;
use serde_json::{json, Value};

/// Pods one transaction may name.
pub const MAX_PODS: usize = 16;
/// The longest commit deadline a transaction may ask for (7 days).
pub const MAX_TIMEOUT_SECS: u64 = 7 * 24 * 3600;
/// The longest rollback reason, in characters.
pub const MAX_REASON: usize = 512;
/// Transactions `GET /v1/transactions` lists.
const LISTED: i64 = 50;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct StartBody {
    pods: Vec<PodBody>,
    commit_timeout_seconds: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PodBody {
    namespace: String,
    name: String,
    revision: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RollbackBody {
    reason: Option<String>,
}

/// One pod of a transaction, as asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodRef {
    pub namespace: String,
    pub name: String,
    /// The revision hash the manager means to install, if it said.
    pub revision: Option<String>,
}

/// `POST /v1/transactions`, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Start {
    pub pods: Vec<PodRef>,
    /// `None`: the configured default.
    pub commit_timeout_secs: Option<u64>,
}

/// A revision hash as a label value may be: 1 to 63 of `A-Za-z0-9._-`.
fn check_revision(r: &str) -> Result<(), String> {
    let ok = !r.is_empty()
        && r.len() <= 63
        && r.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err("must be 1 to 63 letters, digits, '.', '_' or '-'".into())
    }
}

/// The body of `POST /v1/transactions`, or why it is refused (a 400).
pub fn parse_start(body: &[u8]) -> Result<Start, String> {
    let b: StartBody = serde_json::from_slice(body).map_err(|e| format!("Invalid body: {e}"))?;
    if b.pods.is_empty() {
        return Err("Invalid body: no pods".into());
    }
    if b.pods.len() > MAX_PODS {
        return Err(format!("Invalid body: more than {MAX_PODS} pods"));
    }
    if let Some(t) = b.commit_timeout_seconds {
        if !(1..=MAX_TIMEOUT_SECS).contains(&t) {
            return Err(format!(
                "Invalid body: commitTimeoutSeconds must be 1 to {MAX_TIMEOUT_SECS}"
            ));
        }
    }
    let mut pods: Vec<PodRef> = Vec::with_capacity(b.pods.len());
    for p in b.pods {
        crate::names::check_label(&p.namespace)
            .map_err(|r| format!("Invalid namespace {:?}: {r}", p.namespace))?;
        crate::names::check_subdomain(&p.name)
            .map_err(|r| format!("Invalid pod name {:?}: {r}", p.name))?;
        if let Some(r) = &p.revision {
            check_revision(r).map_err(|why| format!("Invalid revision {r:?}: {why}"))?;
        }
        if pods
            .iter()
            .any(|q| q.namespace == p.namespace && q.name == p.name)
        {
            return Err(format!(
                "Invalid body: pod {}/{} named twice",
                p.namespace, p.name
            ));
        }
        pods.push(PodRef {
            namespace: p.namespace,
            name: p.name,
            revision: p.revision,
        });
    }
    Ok(Start {
        pods,
        commit_timeout_secs: b.commit_timeout_seconds,
    })
}

/// The reason of `POST .../rollback` (an empty body: none), or why it is refused (a 400).
pub fn parse_rollback(body: &[u8]) -> Result<Option<String>, String> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    let b: RollbackBody = serde_json::from_slice(body).map_err(|e| format!("Invalid body: {e}"))?;
    match b.reason {
        None => Ok(None),
        Some(r) if r.chars().count() > MAX_REASON => Err(format!(
            "Invalid reason: longer than {MAX_REASON} characters"
        )),
        Some(r) if r.chars().any(char::is_control) => {
            Err("Invalid reason: control characters".into())
        }
        Some(r) if r.trim().is_empty() => Ok(None),
        Some(r) => Ok(Some(r)),
    }
}

/// A new transaction id: 16 lowercase hex digits (the first half of a request uid's 128
/// random bits).
fn new_id() -> String {
    crate::store::new_uid()[..16].to_string()
}

fn not_updatable(ns: &str, name: &str, reason: &str) -> Reply {
    tracing::info!(pod = %name, namespace = %ns, reason, "transaction refused: pod is not updatable");
    Reply::text(403, format!("Pod {ns}/{name} is not-updatable: {reason}"))
}

/// The transaction as every route answers it.
pub fn txn_json(t: &TxnRecord) -> Value {
    let state = txn::state(t);
    let left = t.decision.is_none().then(|| {
        let elapsed = txn::Clock::of(t).live(crate::time::boot_id(), crate::time::boot_ms());
        (t.commit_timeout_ms - elapsed).max(0) / 1000
    });
    json!({
        "id": t.id,
        "state": state.as_str(),
        "decision": t.decision.map(Decision::as_str),
        "reason": t.reason,
        "commitTimeoutSeconds": t.commit_timeout_ms / 1000,
        "commitDeadlineLeftSeconds": left,
        "createdMs": t.created_ms,
        "updatedMs": t.updated_ms,
        "pods": t.members.iter().map(|m| json!({
            "namespace": m.namespace,
            "name": m.name,
            "from": m.from_hash,
            "to": m.to_hash,
            "state": m.state,
            "error": m.error,
            "waiting": m.waiting,
            "request": m.id,
        })).collect::<Vec<_>>(),
    })
}

/// `POST /v1/transactions`: checks every pod against the cache (as OpenYurt's route does, and
/// its revision when given), then records them all, or nothing.
pub fn start(state: &ApiState, body: &[u8]) -> Reply {
    let start = match parse_start(body) {
        Ok(s) => s,
        Err(why) => return Reply::text(400, why),
    };
    let mut checked = Vec::with_capacity(start.pods.len());
    for p in &start.pods {
        let (ns, name) = (p.namespace.as_str(), p.name.as_str());
        let pod = match state.store.get(Kind::Pod, ns, name) {
            Ok(Some(pod)) => pod,
            Ok(None) => return Reply::text(404, format!("Pod {ns}/{name} not found")),
            Err(e) => return Reply::internal("Get pod failed", &e),
        };
        if pod.index.owner_kind.as_deref() != Some("DaemonSet") {
            return Reply::text(
                400,
                format!(
                    "Pod {ns}/{name}: not support ota upgrade pod type {}",
                    pod.index.owner_kind.as_deref().unwrap_or("<none>")
                ),
            );
        }
        let need = match Decider::new(&state.store).decide(&pod.index) {
            Ok(n) => n,
            Err(e) => return Reply::internal("Get pod failed", &e),
        };
        let Some(target) = need.target().map(str::to_string) else {
            return not_updatable(ns, name, need.reason());
        };
        // The manager must not install what the cloud did not decide.
        if let Some(asked) = p.revision.as_deref().filter(|r| *r != target) {
            tracing::info!(pod = %name, namespace = %ns, asked, target = %target, "transaction refused: another revision");
            return Reply::text(
                409,
                format!(
                    "Pod {ns}/{name}: revision {asked} was asked for, but the cache's target \
                     revision for its DaemonSet is {target}; nothing was changed"
                ),
            );
        }
        if !need.needed() {
            return not_updatable(ns, name, need.reason());
        }
        match state
            .store
            .active_request(RequestKind::Upgrade, &pod.index.uid)
        {
            Ok(Some(r)) => {
                return Reply::text(
                    409,
                    format!(
                        "Upgrade of pod {ns}/{name} is already in progress (request {}, state {})",
                        r.id, r.state
                    ),
                )
            }
            Ok(None) => {}
            Err(e) => return Reply::internal("Get pod failed", &e),
        }
        if let Some(refused) = images_missing_offline(state, &pod.index.uid, &target) {
            return refused;
        }
        checked.push((pod, target));
    }
    let reqs: Vec<NewRequest<'_>> = checked
        .iter()
        .map(|(pod, target)| NewRequest {
            kind: RequestKind::Upgrade,
            pod_uid: &pod.index.uid,
            namespace: &pod.index.namespace,
            name: &pod.index.name,
            from_hash: pod.index.revision_hash.as_deref(),
            to_hash: target,
        })
        .collect();
    let timeout_ms = start
        .commit_timeout_secs
        .map(|s| s as i64 * 1000)
        .unwrap_or(state.commit_deadline.as_millis() as i64);
    match state.store.create_transaction(&new_id(), timeout_ms, &reqs) {
        Ok(TxnCreated::New(t)) => {
            let pods: Vec<String> = t
                .members
                .iter()
                .map(|m| format!("{}/{}@{}", m.namespace, m.name, m.to_hash))
                .collect();
            tracing::info!(transaction = %t.id, pods = ?pods, commit_timeout_ms = timeout_ms, "transaction recorded");
            Reply::json(201, txn_json(&t).to_string())
        }
        Ok(TxnCreated::Active(r)) => Reply::text(
            409,
            format!(
                "Upgrade of pod {}/{} is already in progress (request {}, state {})",
                r.namespace, r.name, r.id, r.state
            ),
        ),
        Err(e) => Reply::internal("Apply update failed", &e),
    }
}

/// `GET /v1/transactions`: the newest first.
pub fn list(state: &ApiState) -> Reply {
    match state.store.transactions(LISTED) {
        Ok(all) => Reply::json(
            200,
            json!({"transactions": all.iter().map(txn_json).collect::<Vec<_>>()}).to_string(),
        ),
        Err(e) => Reply::internal("Get transactions failed", &e),
    }
}

fn unknown(id: &str) -> Reply {
    Reply::text(404, format!("Transaction {id} not found"))
}

/// `GET /v1/transactions/{id}`.
pub fn get(state: &ApiState, id: &str) -> Reply {
    match state.store.transaction(id) {
        Ok(Some(t)) => Reply::json(200, txn_json(&t).to_string()),
        Ok(None) => unknown(id),
        Err(e) => Reply::internal("Get transaction failed", &e),
    }
}

/// `POST /v1/transactions/{id}/commit`: only once every pod is Verified; again: 200.
pub fn commit(state: &ApiState, id: &str) -> Reply {
    // The crash sweep kills edgehub before and after the decision's write: the manager, told
    // nothing, asks again, and gets the same answer.
    crate::failpoint::hit("transaction:before:commit");
    let decided = state.store.decide_transaction(id, Decision::Commit, None);
    crate::failpoint::hit("transaction:after:commit");
    match decided {
        Ok(Decided::Now(t)) => {
            tracing::info!(transaction = %t.id, "transaction committed by the OTA manager");
            Reply::json(200, txn_json(&t).to_string())
        }
        Ok(Decided::Already(t)) => Reply::json(200, txn_json(&t).to_string()),
        Ok(Decided::Refused(t)) => Reply::text(409, refusal(&t, "committed")),
        Ok(Decided::Unknown) => unknown(id),
        Err(e) => Reply::internal("Commit failed", &e),
    }
}

/// `POST /v1/transactions/{id}/rollback`: also before Verified (an abort); again: 200, and the
/// first reason stays.
pub fn rollback(state: &ApiState, id: &str, body: &[u8]) -> Reply {
    let reason = match parse_rollback(body) {
        Ok(r) => r.unwrap_or_else(|| "rolled back by the OTA manager".into()),
        Err(why) => return Reply::text(400, why),
    };
    crate::failpoint::hit("transaction:before:rollback");
    let decided = state
        .store
        .decide_transaction(id, Decision::Rollback, Some(&reason));
    crate::failpoint::hit("transaction:after:rollback");
    match decided {
        Ok(Decided::Now(t)) => {
            tracing::info!(transaction = %t.id, reason = %reason, "transaction rolled back by the OTA manager");
            Reply::json(200, txn_json(&t).to_string())
        }
        Ok(Decided::Already(t)) => Reply::json(200, txn_json(&t).to_string()),
        Ok(Decided::Refused(t)) => Reply::text(409, refusal(&t, "rolled back")),
        Ok(Decided::Unknown) => unknown(id),
        Err(e) => Reply::internal("Rollback failed", &e),
    }
}

/// Why transaction `t` cannot be `what` now.
fn refusal(t: &TxnRecord, what: &str) -> String {
    let state = txn::state(t);
    match t.decision {
        Some(Decision::Commit) => format!(
            "Transaction {} cannot be {what}: it was committed ({})",
            t.id,
            state.as_str()
        ),
        Some(Decision::Rollback) => format!(
            "Transaction {} cannot be {what}: it rolls back ({}): {}",
            t.id,
            state.as_str(),
            t.reason.as_deref().unwrap_or("no reason recorded")
        ),
        None => {
            let not: Vec<String> = t
                .members
                .iter()
                .filter(|m| m.state != "Verified")
                .map(|m| format!("{}/{} is {}", m.namespace, m.name, m.state))
                .collect();
            format!(
                "Transaction {} cannot be {what} yet: not every pod is Verified ({})",
                t.id,
                not.join(", ")
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_start_body_is_checked_before_anything() {
        let ok = parse_start(
            br#"{"pods":[{"namespace":"vehicle","name":"telemetry-sv74m","revision":"55778fbb9f"},
                {"namespace":"vehicle","name":"gateway-v9hb2"}],"commitTimeoutSeconds":90}"#,
        )
        .unwrap();
        assert_eq!(ok.pods.len(), 2);
        assert_eq!(ok.pods[0].revision.as_deref(), Some("55778fbb9f"));
        assert_eq!(ok.commit_timeout_secs, Some(90));
        assert_eq!(
            parse_start(br#"{"pods":[{"namespace":"a","name":"b"}]}"#)
                .unwrap()
                .commit_timeout_secs,
            None
        );
        let many = format!(
            r#"{{"pods":[{}]}}"#,
            (0..17)
                .map(|i| format!(r#"{{"namespace":"a","name":"p{i}"}}"#))
                .collect::<Vec<_>>()
                .join(",")
        );
        for (body, says) in [
            (&b""[..], "Invalid body"),
            (b"{}", "Invalid body"),
            (b"[]", "Invalid body"),
            (br#"{"pods":[]}"#, "no pods"),
            (many.as_bytes(), "more than 16"),
            (
                br#"{"pods":[{"namespace":"a","name":"b"}],"extra":1}"#,
                "unknown field",
            ),
            (
                br#"{"pods":[{"namespace":"a","name":"b","x":1}]}"#,
                "unknown field",
            ),
            (
                br#"{"pods":[{"namespace":"A","name":"b"}]}"#,
                "Invalid namespace",
            ),
            (
                br#"{"pods":[{"namespace":"a","name":"b/../c"}]}"#,
                "Invalid pod name",
            ),
            (
                br#"{"pods":[{"namespace":"a","name":"b","revision":""}]}"#,
                "Invalid revision",
            ),
            (
                br#"{"pods":[{"namespace":"a","name":"b","revision":"a b"}]}"#,
                "Invalid revision",
            ),
            (
                br#"{"pods":[{"namespace":"a","name":"b"},{"namespace":"a","name":"b"}]}"#,
                "twice",
            ),
            (
                br#"{"pods":[{"namespace":"a","name":"b"}],"commitTimeoutSeconds":0}"#,
                "1 to",
            ),
            (
                br#"{"pods":[{"namespace":"a","name":"b"}],"commitTimeoutSeconds":604801}"#,
                "1 to",
            ),
            (
                br#"{"pods":[{"namespace":"a","name":"b"}],"commitTimeoutSeconds":-1}"#,
                "Invalid body",
            ),
        ] {
            let err = parse_start(body).unwrap_err();
            assert!(
                err.contains(says),
                "{}: {err}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn a_rollback_body_says_why_or_nothing() {
        assert_eq!(parse_rollback(b""), Ok(None));
        assert_eq!(parse_rollback(b" \n"), Ok(None));
        assert_eq!(parse_rollback(b"{}"), Ok(None));
        assert_eq!(parse_rollback(br#"{"reason":"  "}"#), Ok(None));
        assert_eq!(
            parse_rollback(br#"{"reason":"rootfs health check failed"}"#),
            Ok(Some("rootfs health check failed".into()))
        );
        let long = format!(r#"{{"reason":"{}"}}"#, "x".repeat(513));
        assert!(parse_rollback(long.as_bytes()).is_err());
        let fits = format!(r#"{{"reason":"{}"}}"#, "é".repeat(512));
        assert!(parse_rollback(fits.as_bytes()).is_ok());
        assert!(parse_rollback(br#"{"reason":"a\nb"}"#).is_err());
        assert!(parse_rollback(br#"{"reason":"a\u001bb"}"#).is_err());
        assert!(parse_rollback(br#"{"why":"x"}"#).is_err());
        assert!(parse_rollback(b"not json").is_err());
    }

    #[test]
    fn random_bodies_never_panic() {
        let mut rng = fastrand::Rng::with_seed(32);
        let pieces: [&[u8]; 12] = [
            b"{",
            b"}",
            b"\"pods\":",
            b"[",
            b"]",
            b",",
            b"\"namespace\":\"a\"",
            b"\"name\":\"b\"",
            b"\"revision\":\"r\"",
            b"\"reason\":\"x\"",
            b"\"commitTimeoutSeconds\":9",
            b"\xff",
        ];
        for _ in 0..20_000 {
            let mut body = Vec::new();
            for _ in 0..rng.usize(0..16) {
                body.extend_from_slice(pieces[rng.usize(..pieces.len())]);
            }
            let _ = parse_start(&body);
            let _ = parse_rollback(&body);
        }
    }
}
