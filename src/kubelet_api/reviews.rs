//! Delegated authentication and authorization, as the kubelet's webhook mode does them: a
//! bearer token is sent to the apiserver in a `TokenReview`, every request is checked with a
//! `SubjectAccessReview` about this node, with the user's `extra` as the kubelet sends it.
//! Answers are cached briefly (the kubelet's defaults: a token 2 minutes, an allowed review
//! 5 minutes, a denied one 30 seconds; a rejected token 10 seconds), so a busy `kubectl logs
//! -f` or metrics-server costs the apiserver little. Each cache is bounded and drops one
//! entry at a time ([`super::cache`]); rejected tokens have a cache of their own, so a flood
//! of bogus tokens never pushes out an accepted one's answer. Decisions are keyed by the
//! whole user, `extra` too, as the kubelet's webhook authorizer keys them by the review's
//! spec: two tokens of one service account (two pods) do not share a decision.

use super::cache::Bounded;
use crate::kube::resource::Resource;
use crate::kube::{ApiClient, KubeError};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

const TOKEN_REVIEWS: Resource = Resource {
    group: "authentication.k8s.io",
    version: "v1",
    plural: "tokenreviews",
    namespaced: false,
};

const SUBJECT_ACCESS_REVIEWS: Resource = Resource {
    group: "authorization.k8s.io",
    version: "v1",
    plural: "subjectaccessreviews",
    namespaced: false,
};

/// Accepted tokens and decisions kept (the kubelet's webhook caches hold 1024 too).
const CACHE_MAX: usize = 1024;
/// Rejected tokens kept, each only [`CacheTtl::token_rejected`]: enough that a client
/// retrying one bad token costs one review, and a flood of them costs little memory.
const REJECTED_MAX: usize = 256;

/// Who a request is.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct User {
    pub name: String,
    pub uid: Option<String>,
    pub groups: Vec<String>,
    /// What the authenticator adds (a service-account token's pod and credential id, a
    /// certificate's credential id): sent in the SubjectAccessReview, as the kubelet sends
    /// it, for authorizers that decide by it.
    pub extra: BTreeMap<String, Vec<String>>,
}

/// The key of `extra` the authenticators put a credential's id under.
pub const CREDENTIAL_ID: &str = "authentication.kubernetes.io/credential-id";

/// How long answers are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheTtl {
    pub token: Duration,
    pub token_rejected: Duration,
    pub allowed: Duration,
    pub denied: Duration,
}

impl Default for CacheTtl {
    fn default() -> Self {
        CacheTtl {
            token: Duration::from_secs(120),
            token_rejected: Duration::from_secs(10),
            allowed: Duration::from_secs(300),
            denied: Duration::from_secs(30),
        }
    }
}

/// (user, verb, subresource) and whether it was allowed.
type DecisionCache = Bounded<(User, &'static str, &'static str), bool>;

/// The reviewer: the node's apiserver client and the caches.
pub struct Reviewer {
    client: ApiClient,
    node_name: String,
    ttl: CacheTtl,
    /// By the token's SHA-256: who an accepted token is.
    tokens: Mutex<Bounded<[u8; 32], User>>,
    /// The SHA-256 of tokens the apiserver did not accept.
    rejected: Mutex<Bounded<[u8; 32], ()>>,
    decisions: Mutex<DecisionCache>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// A TokenReview's answer: the user, or `None` when the token was not authenticated (pure).
pub fn token_review_user(answer: &Value) -> Option<User> {
    let st = answer.get("status")?;
    if st.get("authenticated").and_then(Value::as_bool) != Some(true) {
        return None;
    }
    let u = st.get("user")?;
    let name = u.get("username").and_then(Value::as_str)?.to_string();
    let extra = u
        .get("extra")
        .and_then(Value::as_object)
        .map(|m| m.iter().map(|(k, v)| (k.clone(), strings(v))).collect())
        .unwrap_or_default();
    Some(User {
        name,
        uid: u.get("uid").and_then(Value::as_str).map(str::to_string),
        groups: strings(&u["groups"]),
        extra,
    })
}

/// The SubjectAccessReview the kubelet sends for `user` doing `verb` to this node's
/// `subresource` (pure).
pub fn access_review(user: &User, node_name: &str, verb: &str, subresource: &str) -> Value {
    let mut spec = json!({
        "resourceAttributes": {
            "verb": verb, "version": "v1", "resource": "nodes",
            "subresource": subresource, "name": node_name,
        },
        "user": user.name,
        "groups": user.groups,
    });
    if let Some(uid) = &user.uid {
        spec["uid"] = uid.clone().into();
    }
    if !user.extra.is_empty() {
        spec["extra"] = json!(user.extra);
    }
    json!({"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": spec})
}

impl Reviewer {
    pub fn new(client: ApiClient, node_name: &str, ttl: CacheTtl) -> Reviewer {
        Reviewer {
            client,
            node_name: node_name.to_string(),
            ttl,
            tokens: Mutex::new(Bounded::new(CACHE_MAX)),
            rejected: Mutex::new(Bounded::new(REJECTED_MAX)),
            decisions: Mutex::new(Bounded::new(CACHE_MAX)),
        }
    }

    /// Who `token` is (`None`: the apiserver does not know it).
    pub async fn authenticate(&self, token: &str) -> Result<Option<User>, KubeError> {
        let key: [u8; 32] = {
            let d = ring::digest::digest(&ring::digest::SHA256, token.as_bytes());
            let mut k = [0u8; 32];
            k.copy_from_slice(d.as_ref());
            k
        };
        let now = Instant::now();
        if let Some(who) = lock(&self.tokens).get(&key, now) {
            return Ok(Some(who));
        }
        if lock(&self.rejected).get(&key, now).is_some() {
            return Ok(None);
        }
        let body = json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                          "spec": {"token": token}});
        let answer = self
            .client
            .create(&TOKEN_REVIEWS, None, body.to_string().into_bytes())
            .await?;
        let who = serde_json::from_str::<Value>(&answer)
            .ok()
            .and_then(|v| token_review_user(&v));
        match &who {
            Some(u) => lock(&self.tokens).put(key, u.clone(), self.ttl.token, Instant::now()),
            None => lock(&self.rejected).put(key, (), self.ttl.token_rejected, Instant::now()),
        }
        Ok(who)
    }

    /// Whether `user` may `verb` this node's `subresource`.
    pub async fn authorize(
        &self,
        user: &User,
        verb: &'static str,
        subresource: &'static str,
    ) -> Result<bool, KubeError> {
        let key = (user.clone(), verb, subresource);
        if let Some(allowed) = lock(&self.decisions).get(&key, Instant::now()) {
            return Ok(allowed);
        }
        let body = access_review(user, &self.node_name, verb, subresource);
        let answer = self
            .client
            .create(&SUBJECT_ACCESS_REVIEWS, None, body.to_string().into_bytes())
            .await?;
        let allowed = serde_json::from_str::<Value>(&answer)
            .ok()
            .and_then(|v| v.pointer("/status/allowed").and_then(Value::as_bool))
            .unwrap_or(false);
        let ttl = if allowed {
            self.ttl.allowed
        } else {
            self.ttl.denied
        };
        lock(&self.decisions).put(key, allowed, ttl, Instant::now());
        Ok(allowed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_reviews_answer() {
        let ok = json!({"status": {"authenticated": true, "user": {"username": "admin",
            "uid": "admin", "groups": ["system:masters", "system:authenticated"]}}});
        assert_eq!(
            token_review_user(&ok),
            Some(User {
                name: "admin".into(),
                uid: Some("admin".into()),
                groups: vec!["system:masters".into(), "system:authenticated".into()],
                extra: BTreeMap::new(),
            })
        );
        // A service account's bound token: the pod and the credential in extra.
        let sa = json!({"status": {"authenticated": true, "user": {
            "username": "system:serviceaccount:vehicle:default", "uid": "9d1c",
            "groups": ["system:serviceaccounts"],
            "extra": {"authentication.kubernetes.io/pod-name": ["telemetry-h6wk8"],
                      "authentication.kubernetes.io/credential-id": ["JTI=7e0a"]}}}});
        let u = token_review_user(&sa).unwrap();
        assert_eq!(
            u.extra,
            BTreeMap::from([
                (CREDENTIAL_ID.to_string(), vec!["JTI=7e0a".to_string()]),
                (
                    "authentication.kubernetes.io/pod-name".to_string(),
                    vec!["telemetry-h6wk8".to_string()]
                ),
            ])
        );
        assert_eq!(
            access_review(&u, "edge-1", "get", "proxy")["spec"]["extra"],
            sa["status"]["user"]["extra"]
        );
        assert_eq!(token_review_user(&json!({"status": {"user": {}}})), None);
        assert_eq!(
            token_review_user(&json!({"status": {"authenticated": false}})),
            None
        );
        assert_eq!(token_review_user(&json!({})), None);
    }

    #[test]
    fn the_access_review_names_the_node() {
        let u = User {
            name: "jane".into(),
            uid: None,
            groups: vec!["devs".into()],
            extra: BTreeMap::new(),
        };
        let r = access_review(&u, "edge-1", "get", "log");
        assert_eq!(
            r["spec"]["resourceAttributes"],
            json!({"verb": "get", "version": "v1", "resource": "nodes", "subresource": "log", "name": "edge-1"})
        );
        assert_eq!(r["spec"]["user"], "jane");
        assert_eq!(r["spec"]["groups"], json!(["devs"]));
        assert!(r["spec"].get("uid").is_none());
        assert!(r["spec"].get("extra").is_none());
    }
}
