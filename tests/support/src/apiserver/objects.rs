//! The object store: types filled in, keys, commits with resourceVersions and events, the defaults and validations the real apiserver applies to pods.

use super::*;

impl State {
    pub(super) fn new_uid(&self) -> String {
        let n = self.uid_counter.fetch_add(1, Ordering::Relaxed);
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let a = seed ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        format!(
            "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
            (a >> 32) as u32,
            (a >> 16) as u16,
            (a & 0xfff) as u16,
            (n & 0xfff) as u16,
            n
        )
    }
}

pub(super) fn fill_type(obj: &mut Value, rt: &ResourceType) {
    if let Value::Object(m) = obj {
        let mut out = Map::new();
        out.insert("kind".into(), rt.kind.into());
        out.insert("apiVersion".into(), rt.api_version().into());
        for (k, v) in std::mem::take(m) {
            if k != "kind" && k != "apiVersion" {
                out.insert(k, v);
            }
        }
        *m = out;
    }
}

pub(super) fn key_of(rt: &ResourceType, obj: &Value) -> (String, String, String) {
    let s = |p: &str| {
        obj.pointer(p)
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string()
    };
    (
        rt.plural.to_string(),
        if rt.namespaced {
            s("/metadata/namespace")
        } else {
            String::new()
        },
        s("/metadata/name"),
    )
}

/// Stores `obj` at a new resourceVersion and records the event.
pub(super) fn commit(
    state: &State,
    db: &mut Db,
    rt: &'static ResourceType,
    key: (String, String, String),
    mut obj: Value,
    prev: Option<Value>,
) -> Value {
    db.rv += 1;
    obj["metadata"]["resourceVersion"] = db.rv.to_string().into();
    if obj.pointer("/metadata/creationTimestamp").is_none() {
        obj["metadata"]["creationTimestamp"] = now_rfc3339().into();
    }
    if obj.pointer("/metadata/uid").is_none() {
        obj["metadata"]["uid"] = state.new_uid().into();
    }
    if rt.plural == "pods" {
        pod_status_defaults(&mut obj);
        if obj
            .pointer("/spec/nodeName")
            .and_then(Value::as_str)
            .is_some()
        {
            let uid = obj["metadata"]["uid"].as_str().unwrap_or("").to_string();
            db.bound_at
                .entry(uid)
                .or_insert_with(std::time::Instant::now);
        }
    }
    db.objects.insert(key, obj.clone());
    db.history.push(Event {
        rv: db.rv,
        kind: if prev.is_some() { "MODIFIED" } else { "ADDED" },
        plural: rt.plural,
        object: obj.clone(),
        prev,
    });
    // Watchers wake up and take the db lock after the caller releases it.
    state.rv_tx.send_replace(db.rv);
    obj
}

/// What the apiserver's Go types write for a pod status whatever the client sent: a
/// condition's unset times are `null`, a container status always has `state`, `lastState`,
/// `ready`, `restartCount`, `image` and `imageID`. A client that compares the status it wants
/// with the one it reads back must expect these.
pub(super) fn pod_status_defaults(pod: &mut Value) {
    let Some(status) = pod.get_mut("status").and_then(Value::as_object_mut) else {
        return;
    };
    if let Some(Value::Array(conds)) = status.get_mut("conditions") {
        for c in conds.iter_mut().filter_map(Value::as_object_mut) {
            c.entry("lastProbeTime").or_insert(Value::Null);
            c.entry("lastTransitionTime").or_insert(Value::Null);
        }
    }
    for list in [
        "containerStatuses",
        "initContainerStatuses",
        "ephemeralContainerStatuses",
    ] {
        if let Some(Value::Array(cs)) = status.get_mut(list) {
            for c in cs.iter_mut().filter_map(Value::as_object_mut) {
                for (k, default) in [
                    ("state", json!({})),
                    ("lastState", json!({})),
                    ("ready", json!(false)),
                    ("restartCount", json!(0)),
                    ("image", json!("")),
                    ("imageID", json!("")),
                ] {
                    c.entry(k).or_insert(default);
                }
                for st in ["state", "lastState"] {
                    if let Some(Value::Object(m)) = c.get_mut(st) {
                        if let Some(Value::Object(r)) = m.get_mut("running") {
                            r.entry("startedAt").or_insert(Value::Null);
                        }
                        if let Some(Value::Object(t)) = m.get_mut("terminated") {
                            t.entry("startedAt").or_insert(Value::Null);
                            t.entry("finishedAt").or_insert(Value::Null);
                        }
                    }
                }
            }
        }
    }
}

/// The apiserver's pod status validation that a node's patches can trip: at most one IP per
/// family in `podIPs` and `hostIPs` (fixture `pod_status_patch_new_ip_merged_invalid`).
pub(super) fn invalid_pod_ips(name: &str, pod: &Value) -> Option<Response<Body>> {
    for field in ["podIPs", "hostIPs"] {
        let Some(ips) = pod
            .pointer(&format!("/status/{field}"))
            .and_then(Value::as_array)
        else {
            continue;
        };
        let addrs: Vec<&str> = ips.iter().filter_map(|i| i["ip"].as_str()).collect();
        let v6 = addrs.iter().filter(|a| a.contains(':')).count();
        if v6 > 1 || addrs.len() - v6 > 1 {
            let value = format!(
                "[{}]",
                addrs
                    .iter()
                    .map(|a| format!("{{\"IP\":\"{a}\"}}"))
                    .collect::<Vec<_>>()
                    .join(",")
            );
            let msg = format!(
                "Invalid value: {value}: may specify no more than one IP for each IP family"
            );
            return Some(status(
                422,
                "Invalid",
                &format!("Pod \"{name}\" is invalid: status.{field}: {msg}"),
                Some(json!({"name": name, "kind": "Pod", "causes": [
                    {"reason": "FieldValueInvalid", "message": msg, "field": format!("status.{field}")}]})),
            ));
        }
    }
    None
}

pub(super) fn remove_locked(
    state: &State,
    db: &mut Db,
    rt: &'static ResourceType,
    namespace: &str,
    name: &str,
) -> Option<Value> {
    let key = (
        rt.plural.to_string(),
        if rt.namespaced {
            namespace.to_string()
        } else {
            String::new()
        },
        name.to_string(),
    );
    let mut obj = db.objects.remove(&key)?;
    db.rv += 1;
    obj["metadata"]["resourceVersion"] = db.rv.to_string().into();
    db.history.push(Event {
        rv: db.rv,
        kind: "DELETED",
        plural: rt.plural,
        object: obj.clone(),
        prev: Some(obj.clone()),
    });
    state.rv_tx.send_replace(db.rv);
    Some(obj)
}

pub(super) fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// RFC 3339 UTC time of now.
pub fn now_rfc3339() -> String {
    rfc3339(unix_now())
}

/// RFC 3339 UTC time of a unix time, without pulling in a date crate.
pub fn rfc3339(secs: i64) -> String {
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}
