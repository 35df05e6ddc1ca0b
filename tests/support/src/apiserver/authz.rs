//! Authorization as the real cluster has it: RBAC for the node and NodeRestriction's limits, with the recorded 403 bodies.

use super::*;

pub(super) fn node_of(user: &str) -> Option<&str> {
    user.strip_prefix("system:node:")
}

pub(super) fn verb(
    method: &Method,
    route: &Route,
    query: &BTreeMap<String, String>,
) -> &'static str {
    match (method, route.name.is_some()) {
        (&Method::GET, false)
            if matches!(query.get("watch").map(String::as_str), Some("1" | "true")) =>
        {
            "watch"
        }
        (&Method::GET, false) => "list",
        (&Method::GET, true) => "get",
        (&Method::POST, _) => "create",
        (&Method::PUT, _) => "update",
        (&Method::PATCH, _) => "patch",
        (&Method::DELETE, _) => "delete",
        _ => "unknown",
    }
}

pub(super) fn forbidden(user: &str, verb: &str, route: &Route, suffix: &str) -> Response<Body> {
    let rt = route.rt;
    let subject = match &route.name {
        Some(n) => format!("{} \"{n}\"", rt.qualified()),
        None => rt.qualified(),
    };
    let scope = match &route.namespace {
        Some(ns) => format!("in the namespace \"{ns}\""),
        None => "at the cluster scope".into(),
    };
    let mut details = Map::new();
    if let Some(n) = &route.name {
        details.insert("name".into(), n.clone().into());
    }
    if !rt.group.is_empty() {
        details.insert("group".into(), rt.group.into());
    }
    details.insert("kind".into(), rt.plural.into());
    status(
        403,
        "Forbidden",
        &format!(
            "{subject} is forbidden: User \"{user}\" cannot {verb} resource \"{}\" in API group \"{}\" {scope}{suffix}",
            rt.plural, rt.group
        ),
        Some(Value::Object(details)),
    )
}

/// Whether a pod references ConfigMap or Secret `name`: the Node authorizer's graph edges.
pub(super) fn pod_references(pod: &Value, plural: &str, name: &str) -> bool {
    let is = |v: Option<&Value>| v.and_then(Value::as_str) == Some(name);
    let arr = |v: &Value, p: &str| -> Vec<Value> {
        v.pointer(p)
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default()
    };
    let (vol, proj, key_ref, env_from) = if plural == "secrets" {
        (
            "/secret/secretName",
            "/secret/name",
            "/valueFrom/secretKeyRef/name",
            "/secretRef/name",
        )
    } else {
        (
            "/configMap/name",
            "/configMap/name",
            "/valueFrom/configMapKeyRef/name",
            "/configMapRef/name",
        )
    };
    arr(pod, "/spec/volumes").iter().any(|v| {
        is(v.pointer(vol))
            || arr(v, "/projected/sources")
                .iter()
                .any(|s| is(s.pointer(proj)))
    }) || ["/spec/containers", "/spec/initContainers"]
        .iter()
        .any(|list| {
            arr(pod, list).iter().any(|c| {
                arr(c, "/env").iter().any(|e| is(e.pointer(key_ref)))
                    || arr(c, "/envFrom").iter().any(|e| is(e.pointer(env_from)))
            })
        })
        || (plural == "secrets"
            && arr(pod, "/spec/imagePullSecrets")
                .iter()
                .any(|s| is(s.get("name"))))
}

/// The Node authorizer and NodeRestriction, for the requests the fixtures recorded.
pub(super) fn authorize(
    state: &State,
    user: &str,
    method: &Method,
    route: &Route,
    query: &BTreeMap<String, String>,
    body: &[u8],
) -> Option<Response<Body>> {
    let node = node_of(user)?;
    let v = verb(method, route, query);
    let rt = route.rt;
    match rt.plural {
        "daemonsets" | "controllerrevisions" => {
            let read = matches!(v, "get" | "list" | "watch");
            if !read || !state.rbac_edgehub.load(Ordering::SeqCst) {
                return Some(forbidden(user, v, route, ""));
            }
        }
        "events" => {
            // A node may create and patch Events but never read them, not even its own
            // (fixtures `event_get_forbidden_as_node`, `events_list_forbidden_as_node`): an
            // Event series lives in its sender's own records.
            if matches!(v, "get" | "list" | "watch") {
                return Some(forbidden(user, v, route, ""));
            }
        }
        "secrets" | "configmaps" => {
            // A list or watch narrowed to one name by `fieldSelector=metadata.name=<name>` is
            // authorized as a read of that object, as the apiserver's request info does: the
            // kubelet's watch-based ConfigMap and Secret managers rely on it.
            let by_selector = query
                .get("fieldSelector")
                .and_then(|f| f.strip_prefix("metadata.name="))
                .filter(|n| !n.is_empty() && !n.contains(','));
            let named;
            let route = match (&route.name, by_selector) {
                (None, Some(n)) if matches!(v, "list" | "watch") => {
                    named = Route {
                        rt: route.rt,
                        namespace: route.namespace.clone(),
                        name: Some(n.to_string()),
                        sub: None,
                    };
                    &named
                }
                _ => route,
            };
            let Some(name) = &route.name else {
                return Some(forbidden(user, v, route, ": No Object name found"));
            };
            let ns = route.namespace.clone().unwrap_or_default();
            let lag = Duration::from_millis(state.authorizer_lag_ms.load(Ordering::SeqCst));
            let db = lock(&state.db);
            let related = matches!(v, "get" | "list" | "watch")
                && db.objects.iter().any(|((plural, pns, _), p)| {
                    plural == "pods"
                        && *pns == ns
                        && p.pointer("/spec/nodeName").and_then(Value::as_str) == Some(node)
                        && pod_references(p, rt.plural, name)
                        && p.pointer("/metadata/uid")
                            .and_then(Value::as_str)
                            .and_then(|u| db.bound_at.get(u))
                            .is_none_or(|at| at.elapsed() >= lag)
                });
            if !related {
                return Some(forbidden(
                    user,
                    v,
                    route,
                    &format!(": no relationship found between node '{node}' and this object"),
                ));
            }
        }
        "pods" => {
            if let Some(name) = &route.name {
                let ns = route.namespace.clone().unwrap_or_default();
                let bound = lock(&state.db)
                    .objects
                    .get(&("pods".into(), ns, name.clone()))
                    .and_then(|p| {
                        p.pointer("/spec/nodeName")
                            .and_then(Value::as_str)
                            .map(|n| n == node)
                    })
                    .unwrap_or(false);
                if !bound {
                    return Some(forbidden(
                        user,
                        v,
                        route,
                        &format!(": no relationship found between node '{node}' and this object"),
                    ));
                }
                if v == "patch" && route.sub.is_none() {
                    return Some(forbidden(user, v, route, ""));
                }
            }
        }
        "nodes" => {
            let target = match &route.name {
                Some(n) => Some(n.clone()),
                None if v == "create" => serde_json::from_slice::<Value>(body).ok().and_then(|b| {
                    b.pointer("/metadata/name")
                        .and_then(Value::as_str)
                        .map(str::to_string)
                }),
                None => None,
            };
            if matches!(v, "create" | "update" | "patch" | "delete") {
                if let Some(t) = target {
                    if t != node {
                        return Some(status(
                            403,
                            "Forbidden",
                            &format!("nodes \"{t}\" is forbidden: node \"{node}\" is not allowed to modify node \"{t}\""),
                            Some(json!({"name": t, "kind": "nodes"})),
                        ));
                    }
                    let labels: Vec<String> = serde_json::from_slice::<Value>(body)
                        .ok()
                        .and_then(|b| {
                            b.pointer("/metadata/labels")
                                .and_then(Value::as_object)
                                .cloned()
                        })
                        .map(|m| {
                            m.keys()
                                .filter(|k| k.starts_with("node-role.kubernetes.io/"))
                                .cloned()
                                .collect()
                        })
                        .unwrap_or_default();
                    if !labels.is_empty() {
                        return Some(status(
                            403,
                            "Forbidden",
                            &format!(
                                "nodes \"{t}\" is forbidden: node \"{node}\" is not allowed to set the following labels: {}",
                                labels.join(", ")
                            ),
                            Some(json!({"name": t, "kind": "nodes"})),
                        ));
                    }
                }
            }
        }
        _ => {}
    }
    None
}
