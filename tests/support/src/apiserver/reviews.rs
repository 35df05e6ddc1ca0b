//! The reviews a kubelet's server asks of the apiserver (delegated authentication and
//! authorization, `--authentication-token-webhook` and `--authorization-mode=Webhook`):
//! `TokenReview` (who a bearer token is, from the fake's own token tables) and
//! `SubjectAccessReview` (whether that user may do this to the node, from the fake's RBAC
//! table). A node identity may create both (the `system:node` role's rules), as may the
//! administrator; anyone else gets a 403.

use super::csr::{bootstrap_caller, token_caller, Caller};
use super::{json_response, lock, parse_body, status, Body, State};
use hyper::Response;
use serde_json::{json, Map, Value};
use std::collections::{HashMap, HashSet};

pub(super) const TOKEN_REVIEWS: &str = "/apis/authentication.k8s.io/v1/tokenreviews";
pub(super) const SUBJECT_ACCESS_REVIEWS: &str =
    "/apis/authorization.k8s.io/v1/subjectaccessreviews";

/// The apiserver's audience when a TokenReview names none (`--service-account-issuer`).
const API_AUDIENCE: &str = "https://kubernetes.default.svc.cluster.local";

/// The user kubeadm gives the apiserver's kubelet-client certificate.
pub const APISERVER_KUBELET_CLIENT: &str = "kube-apiserver-kubelet-client";

/// Who holds `system:kubelet-api-admin` (full access to the kubelet's API: `nodes/proxy`,
/// `nodes/log`, `nodes/stats`, `nodes/metrics`), by user and by group. kubeadm binds it to
/// the apiserver's kubelet-client user; `system:masters` may do anything anyway.
/// Also what the reviews carry beyond a user's name and groups: the `extra` a token's
/// TokenReview answers with (the real apiserver's service-account tokens carry the pod's
/// name and uid, the node's, a credential id), and the SubjectAccessReviews received.
pub(super) struct Rbac {
    users: HashSet<String>,
    groups: HashSet<String>,
    pub(super) extra: HashMap<String, Value>,
    pub(super) received: Vec<Value>,
}

impl Default for Rbac {
    fn default() -> Self {
        Rbac {
            users: HashSet::from([APISERVER_KUBELET_CLIENT.to_string()]),
            groups: HashSet::new(),
            extra: HashMap::new(),
            received: Vec::new(),
        }
    }
}

impl Rbac {
    pub(super) fn bind_user(&mut self, user: &str) {
        self.users.insert(user.into());
    }

    pub(super) fn bind_group(&mut self, group: &str) {
        self.groups.insert(group.into());
    }

    pub(super) fn unbind_user(&mut self, user: &str) {
        self.users.remove(user);
    }
}

fn may_review(caller: &Caller) -> bool {
    caller
        .groups
        .iter()
        .any(|g| g == "system:nodes" || g == "system:masters")
}

fn forbidden(caller: &Caller, plural: &str, group: &str) -> Response<Body> {
    status(
        403,
        "Forbidden",
        &format!(
            "{plural}.{group} is forbidden: User \"{}\" cannot create resource \"{plural}\" in API group \"{group}\" at the cluster scope",
            caller.user
        ),
        Some(json!({"group": group, "kind": plural})),
    )
}

/// `POST /apis/authentication.k8s.io/v1/tokenreviews`.
pub(super) fn token_review(state: &State, caller: &Caller, body: &[u8]) -> Response<Body> {
    if !may_review(caller) {
        return forbidden(caller, "tokenreviews", "authentication.k8s.io");
    }
    let obj = match parse_body(body) {
        Ok(o) => o,
        Err(r) => return *r,
    };
    let token = obj
        .pointer("/spec/token")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let audiences: Vec<String> = obj
        .pointer("/spec/audiences")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    let static_user = lock(&state.tokens).get(&token).cloned();
    let who = match static_user {
        Some(u) => Some(token_caller(&u)),
        None => bootstrap_caller(state, &token),
    };
    // Static and bootstrap tokens are valid for the apiserver's own audience only.
    let audience_ok = audiences.is_empty() || audiences.iter().any(|a| a == API_AUDIENCE);
    let mut st = Map::new();
    match who.filter(|_| audience_ok) {
        Some(c) => {
            let mut user = Map::new();
            user.insert("username".into(), c.user.into());
            if let Some(uid) = c.uid {
                user.insert("uid".into(), uid.into());
            }
            user.insert("groups".into(), json!(c.groups));
            if let Some(extra) = lock(&state.reviews).extra.get(&token) {
                user.insert("extra".into(), extra.clone());
            }
            st.insert("authenticated".into(), true.into());
            st.insert("user".into(), Value::Object(user));
            st.insert("audiences".into(), json!([API_AUDIENCE]));
        }
        // Fixture `tokenreview_bogus_as_node`.
        None => {
            st.insert("user".into(), json!({}));
            st.insert("error".into(), "invalid bearer token".into());
        }
    }
    let mut spec = Map::new();
    spec.insert("token".into(), token.into());
    if !audiences.is_empty() {
        spec.insert("audiences".into(), json!(audiences));
    }
    json_response(
        201,
        &json!({
            "kind": "TokenReview",
            "apiVersion": "authentication.k8s.io/v1",
            "metadata": {},
            "spec": Value::Object(spec),
            "status": Value::Object(st),
        }),
    )
}

/// The kubelet API's subresources `system:kubelet-api-admin` grants.
const KUBELET_API: &[&str] = &["proxy", "log", "stats", "metrics", "spec", "configz"];

/// Whether `user` in `groups` may do what `attrs` (a SAR's resourceAttributes) says: the
/// privileged group, then `system:kubelet-api-admin`'s bindings. Nodes get nothing here: the
/// Node authorizer gives a node no access to any node's kubelet API.
pub(super) fn allowed(rbac: &Rbac, user: &str, groups: &[String], attrs: &Value) -> bool {
    if groups.iter().any(|g| g == "system:masters") {
        return true;
    }
    let admin = rbac.users.contains(user) || groups.iter().any(|g| rbac.groups.contains(g));
    let s = |k: &str| attrs.get(k).and_then(Value::as_str).unwrap_or("");
    admin
        && s("group").is_empty()
        && s("resource") == "nodes"
        && (KUBELET_API.contains(&s("subresource"))
            || (s("subresource").is_empty() && matches!(s("verb"), "get" | "list" | "watch")))
}

/// `POST /apis/authorization.k8s.io/v1/subjectaccessreviews`.
pub(super) fn subject_access_review(state: &State, caller: &Caller, body: &[u8]) -> Response<Body> {
    if !may_review(caller) {
        return forbidden(caller, "subjectaccessreviews", "authorization.k8s.io");
    }
    let obj = match parse_body(body) {
        Ok(o) => o,
        Err(r) => return *r,
    };
    let spec = obj.get("spec").cloned().unwrap_or(json!({}));
    lock(&state.reviews).received.push(spec.clone());
    let user = spec.get("user").and_then(Value::as_str).unwrap_or("");
    let groups: Vec<String> = spec
        .get("groups")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    let yes = match spec.get("resourceAttributes") {
        Some(attrs) => allowed(&lock(&state.reviews), user, &groups, attrs),
        None => groups.iter().any(|g| g == "system:masters"),
    };
    let mut st = Map::new();
    st.insert("allowed".into(), yes.into());
    json_response(
        201,
        &json!({
            "kind": "SubjectAccessReview",
            "apiVersion": "authorization.k8s.io/v1",
            "metadata": {},
            "spec": spec,
            "status": Value::Object(st),
        }),
    )
}
