//! Writes: create (with the service-account admission), token requests, update, patch and delete.

use super::*;

pub(super) fn create(
    state: &Arc<State>,
    rt: &'static ResourceType,
    namespace: Option<&str>,
    body: &[u8],
) -> Response<Body> {
    let mut obj = match parse_body(body) {
        Ok(o) => o,
        Err(r) => return *r,
    };
    fill_type(&mut obj, rt);
    if let (Some(ns), true) = (namespace, rt.namespaced) {
        obj["metadata"]["namespace"] = ns.into();
    }
    if obj
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("")
        .is_empty()
    {
        return status(
            422,
            "Invalid",
            &format!(
                "{} \"\" is invalid: metadata.name: Required value: name is required",
                rt.kind
            ),
            None,
        );
    }
    if let Some(invalid) = validate_object(rt, &obj) {
        return invalid;
    }
    let key = key_of(rt, &obj);
    let mut db = lock(&state.db);
    if db.objects.contains_key(&key) {
        return status(
            409,
            "AlreadyExists",
            &format!("{} \"{}\" already exists", rt.qualified(), key.2),
            Some(json!({"name": key.2, "kind": rt.plural})),
        );
    }
    obj["metadata"]["uid"] = state.new_uid().into();
    obj["metadata"]["creationTimestamp"] = now_rfc3339().into();
    if rt.plural == "pods" {
        admit_service_account(&mut obj);
    }
    if rt.plural == "nodes" {
        // What the apiserver's Go types write for a Node created without them (fixture
        // `node_create_with_issued_cert`).
        if let Value::Object(m) = &mut obj {
            m.entry("spec").or_insert(json!({}));
            let st = m.entry("status").or_insert(json!({}));
            if let Value::Object(st) = st {
                st.entry("daemonEndpoints")
                    .or_insert(json!({"kubeletEndpoint": {"Port": 0}}));
                st.entry("nodeInfo").or_insert(json!({"machineID": "", "systemUUID": "", "bootID": "", "kernelVersion": "", "osImage": "", "containerRuntimeVersion": "", "kubeletVersion": "", "kubeProxyVersion": "", "operatingSystem": "", "architecture": ""}));
            }
        }
    }
    if rt.plural == "events" {
        // The apiserver's defaults for core/v1 Events.
        if let Value::Object(m) = &mut obj {
            m.entry("eventTime").or_insert(Value::Null);
            m.entry("reportingComponent").or_insert("".into());
            m.entry("reportingInstance").or_insert("".into());
        }
    }
    let out = commit(state, &mut db, rt, key, obj, None);
    json_response(201, &out)
}

/// The ServiceAccount admission plugin, as the recorded replacement pod shows it
/// (fixture `pods_list_after_delete`): a pod created without a token volume gets
/// `kube-api-access-<5 random characters>` (token, CA bundle, namespace) mounted read-only
/// in every container, unless `automountServiceAccountToken` is false. Run on every pod
/// created through the API; objects a test puts in place with `apply` are stored as given.
pub fn admit_service_account(pod: &mut Value) {
    const MOUNT: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
    let Some(spec) = pod.get_mut("spec").and_then(Value::as_object_mut) else {
        return;
    };
    if spec.get("automountServiceAccountToken") == Some(&Value::Bool(false)) {
        return;
    }
    let has_token = |v: &Value| {
        v.pointer("/projected/sources")
            .and_then(Value::as_array)
            .is_some_and(|s| s.iter().any(|s| s.get("serviceAccountToken").is_some()))
    };
    let volumes = spec.entry("volumes").or_insert_with(|| json!([]));
    let Some(list) = volumes.as_array_mut() else {
        return;
    };
    if list.iter().any(has_token) {
        return;
    }
    // The apiserver's name generator's alphabet (no vowels, no look-alikes).
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut n = NAME_SEQ.fetch_add(1, Ordering::SeqCst) * 7919 + 104_729;
    let suffix: String = (0..5)
        .map(|_| {
            let c = ALPHABET[(n % ALPHABET.len() as u64) as usize] as char;
            n /= ALPHABET.len() as u64;
            c
        })
        .collect();
    let name = format!("kube-api-access-{suffix}");
    list.push(json!({"name": name, "projected": {"sources": [
        {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}},
    ], "defaultMode": 420}}));
    for kind in ["initContainers", "containers"] {
        for c in spec
            .get_mut(kind)
            .and_then(Value::as_array_mut)
            .into_iter()
            .flatten()
        {
            let mounts = c
                .as_object_mut()
                .map(|c| c.entry("volumeMounts").or_insert_with(|| json!([])));
            if let Some(Value::Array(m)) = mounts {
                if !m.iter().any(|m| m["mountPath"] == MOUNT) {
                    m.push(json!({"name": name, "readOnly": true, "mountPath": MOUNT}));
                }
            }
        }
    }
    spec.entry("serviceAccountName")
        .or_insert_with(|| json!("default"));
    spec.entry("serviceAccount")
        .or_insert_with(|| json!("default"));
}

/// Feeds the token volumes' name suffixes.
pub(super) static NAME_SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

pub(super) fn token_request(
    state: &Arc<State>,
    user: &str,
    namespace: Option<&str>,
    sa: &str,
    body: &[u8],
) -> Response<Body> {
    let req = match parse_body(body) {
        Ok(o) => o,
        Err(r) => return *r,
    };
    let pod = req
        .pointer("/spec/boundObjectRef/name")
        .and_then(Value::as_str)
        .unwrap_or("");
    let ns = namespace.unwrap_or("");
    if !lock(&state.db)
        .objects
        .contains_key(&("pods".into(), ns.into(), pod.into()))
    {
        return status(
            404,
            "NotFound",
            &format!("pod \"{pod}\" not found"),
            Some(json!({"name": pod, "kind": "pod"})),
        );
    }
    // NodeRestriction: a node may only ask for audiences its pods' volumes name; the test
    // pods name none.
    let audiences = req
        .pointer("/spec/audiences")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    if let (Some(_), Some(aud)) = (node_of(user), audiences.first().and_then(Value::as_str)) {
        return status(
            403,
            "Forbidden",
            &format!("serviceaccounts \"{sa}\" is forbidden: audience \"{aud}\" not found in pod spec volume, {user} is not authorized to request tokens for this audience"),
            Some(json!({"name": sa, "kind": "serviceaccounts"})),
        );
    }
    let mut spec = req.get("spec").cloned().unwrap_or(json!({}));
    if audiences.is_empty() {
        spec["audiences"] = json!(["https://kubernetes.default.svc.cluster.local"]);
    }
    let ttl = spec
        .get("expirationSeconds")
        .and_then(Value::as_i64)
        .unwrap_or(3600);
    let mut token = format!("fake-token-for-{pod}");
    let len = state.token_len.load(Ordering::SeqCst) as usize;
    if token.len() < len {
        // Distinct per request, as a JWT's iat and signature are: equal bytes would let a
        // storage layer's comparison skip the write.
        let seq = state.uid_counter.fetch_add(1, Ordering::SeqCst);
        token.push('.');
        while token.len() < len {
            token.push_str(&format!("{seq:016x}"));
        }
        token.truncate(len);
    }
    let out = json!({
        "kind": "TokenRequest",
        "apiVersion": "authentication.k8s.io/v1",
        "metadata": {"name": sa, "namespace": ns, "uid": state.new_uid(), "creationTimestamp": now_rfc3339()},
        "spec": spec,
        "status": {"token": token, "expirationTimestamp": rfc3339(unix_now() + ttl)},
    });
    json_response(201, &out)
}

/// The apiserver's validation of what a create or update would store.
fn validate_object(rt: &ResourceType, obj: &Value) -> Option<Response<Body>> {
    match rt.plural {
        "configmaps" => super::validate::configmap(obj),
        _ => None,
    }
}

pub(super) fn update(
    state: &Arc<State>,
    rt: &'static ResourceType,
    namespace: Option<&str>,
    name: &str,
    body: &[u8],
) -> Response<Body> {
    let mut obj = match parse_body(body) {
        Ok(o) => o,
        Err(r) => return *r,
    };
    fill_type(&mut obj, rt);
    let key = (
        rt.plural.to_string(),
        namespace.unwrap_or("").to_string(),
        name.to_string(),
    );
    // The apiserver's check on an update: the body names the object the URL names.
    let named = obj
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("");
    if named != name {
        return status(
            400,
            "BadRequest",
            &format!(
                "the name of the object ({named}) does not match the name on the URL ({name})"
            ),
            None,
        );
    }
    if let Some(invalid) = validate_object(rt, &obj) {
        return invalid;
    }
    let mut db = lock(&state.db);
    let Some(cur) = db.objects.get(&key).cloned() else {
        return not_found(rt, name);
    };
    let want = obj
        .pointer("/metadata/resourceVersion")
        .and_then(Value::as_str)
        .unwrap_or("");
    let have = cur
        .pointer("/metadata/resourceVersion")
        .and_then(Value::as_str)
        .unwrap_or("");
    if !want.is_empty() && want != have {
        return status(
            409,
            "Conflict",
            &format!(
                "Operation cannot be fulfilled on {} \"{name}\": the object has been modified; please apply your changes to the latest version and try again",
                rt.qualified()
            ),
            Some(json!({"name": name, "group": rt.group, "kind": rt.plural})),
        );
    }
    obj["metadata"]["uid"] = cur["metadata"]["uid"].clone();
    obj["metadata"]["creationTimestamp"] = cur["metadata"]["creationTimestamp"].clone();
    let out = commit(state, &mut db, rt, key, obj, Some(cur));
    json_response(200, &out)
}

pub(super) fn patch(
    state: &Arc<State>,
    rt: &'static ResourceType,
    namespace: Option<&str>,
    name: &str,
    status_only: bool,
    content_type: &str,
    body: &[u8],
) -> Response<Body> {
    let p = match parse_body(body) {
        Ok(o) => o,
        Err(r) => return *r,
    };
    let ct = content_type.split(';').next().unwrap_or("").trim();
    let strategic = match ct {
        "application/merge-patch+json" => false,
        "application/strategic-merge-patch+json" => true,
        other => {
            return status(
                415,
                "UnsupportedMediaType",
                &format!("the body of the request was in an unknown format - accepted media types include: application/merge-patch+json, application/strategic-merge-patch+json (got {other:?})"),
                None,
            )
        }
    };
    let key = (
        rt.plural.to_string(),
        namespace.unwrap_or("").to_string(),
        name.to_string(),
    );
    let mut db = lock(&state.db);
    let Some(cur) = db.objects.get(&key).cloned() else {
        return not_found(rt, name);
    };
    // metadata.uid in a patch must be the object's: a report meant for an earlier pod of the
    // same name is refused (fixture `pod_status_patch_stale_uid`).
    if let Some(uid) = p.pointer("/metadata/uid").and_then(Value::as_str) {
        if Some(uid) != cur.pointer("/metadata/uid").and_then(Value::as_str) {
            let msg = format!("Invalid value: \"{uid}\": field is immutable");
            let cause =
                json!({"reason": "FieldValueInvalid", "message": msg, "field": "metadata.uid"});
            return status(
                422,
                "Invalid",
                &format!("{} \"{name}\" is invalid: metadata.uid: {msg}", rt.kind),
                Some(json!({"name": name, "kind": rt.kind, "causes": [cause.clone(), cause]})),
            );
        }
    }
    let mut next = cur.clone();
    let p = if status_only {
        json!({"status": p.get("status").cloned().unwrap_or(json!({}))})
    } else {
        p
    };
    if strategic {
        strategic_merge_patch(&mut next, &p);
    } else {
        merge_patch(&mut next, &p);
    }
    if rt.plural == "pods" && !status_only && next.get("spec") != cur.get("spec") {
        let strip_images = |v: &Value| {
            let mut s = v.get("spec").cloned().unwrap_or(Value::Null);
            for list in ["containers", "initContainers"] {
                if let Some(Value::Array(cs)) = s.get_mut(list) {
                    for c in cs {
                        if let Value::Object(m) = c {
                            m.shift_remove("image");
                        }
                    }
                }
            }
            s
        };
        if strip_images(&next) != strip_images(&cur) {
            return status(
                422,
                "Invalid",
                &format!("Pod \"{name}\" is invalid: spec: Forbidden: pod updates may not change fields other than `spec.containers[*].image`,`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` (only additions to existing tolerations),`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was previously negative)"),
                Some(json!({"name": name, "kind": "Pod"})),
            );
        }
    }
    if rt.plural == "pods" {
        pod_status_defaults(&mut next);
        if let Some(invalid) = invalid_pod_ips(name, &next) {
            return invalid;
        }
    }
    if next == cur {
        // The apiserver answers a no-op patch without a new resourceVersion.
        return json_response(200, &cur);
    }
    let out = commit(state, &mut db, rt, key, next, Some(cur));
    json_response(200, &out)
}

pub(super) fn delete(
    state: &Arc<State>,
    rt: &'static ResourceType,
    namespace: Option<&str>,
    name: &str,
    body: &[u8],
) -> Response<Body> {
    let opts: Value = if body.is_empty() {
        json!({})
    } else {
        match parse_body(body) {
            Ok(o) => o,
            Err(r) => return *r,
        }
    };
    let key = (
        rt.plural.to_string(),
        namespace.unwrap_or("").to_string(),
        name.to_string(),
    );
    let mut db = lock(&state.db);
    let Some(cur) = db.objects.get(&key).cloned() else {
        return not_found(rt, name);
    };
    if let Some(want) = opts.pointer("/preconditions/uid").and_then(Value::as_str) {
        let have = cur
            .pointer("/metadata/uid")
            .and_then(Value::as_str)
            .unwrap_or("");
        if want != have {
            return status(
                409,
                "Conflict",
                &format!(
                    "Operation cannot be fulfilled on {} \"{name}\": the UID in the precondition ({want}) does not match the UID in record ({have}). The object might have been deleted and then recreated",
                    rt.kind
                ),
                Some(json!({"name": name, "kind": rt.kind})),
            );
        }
    }
    // Pods get a graceful delete (deletionTimestamp) unless the grace period is 0; the node
    // then finishes it with a delete at grace 0, as a kubelet does.
    let grace = opts
        .get("gracePeriodSeconds")
        .and_then(Value::as_i64)
        .or_else(|| {
            cur.pointer("/spec/terminationGracePeriodSeconds")
                .and_then(Value::as_i64)
                .or(Some(30))
        });
    if rt.plural == "pods" && grace.unwrap_or(0) > 0 {
        if cur.pointer("/metadata/deletionTimestamp").is_some() {
            return json_response(200, &cur);
        }
        let mut next = cur.clone();
        next["metadata"]["deletionTimestamp"] = now_rfc3339().into();
        next["metadata"]["deletionGracePeriodSeconds"] = grace.unwrap_or(30).into();
        let out = commit(state, &mut db, rt, key, next, Some(cur));
        return json_response(200, &out);
    }
    let out = remove_locked(state, &mut db, rt, namespace.unwrap_or(""), name);
    match out {
        Some(o) => json_response(200, &o),
        None => not_found(rt, name),
    }
}
