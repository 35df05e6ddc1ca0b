//! Delegated authentication and authorization, as the kubelet's webhook mode does them: a
//! bearer token is sent to the apiserver in a `TokenReview`, every request is checked with a
//! `SubjectAccessReview` about this node. Answers are cached briefly (the kubelet's defaults:
//! a token 2 minutes, an allowed review 5 minutes, a denied one 30 seconds), so a busy
//! `kubectl logs -f` or metrics-server costs the apiserver little; the cache is bounded.

use crate::kube::resource::Resource;
use crate::kube::{ApiClient, KubeError};
use serde_json::{json, Value};
use std::collections::HashMap;
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

/// Entries kept per cache; when full it is emptied (a burst of distinct tokens is an attack
/// or a bug, not a working set).
const CACHE_MAX: usize = 1024;

/// Who a request is.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct User {
    pub name: String,
    pub uid: Option<String>,
    pub groups: Vec<String>,
}

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

/// Token digests and what their reviews said, with when.
type TokenCache = HashMap<[u8; 32], (Instant, Option<User>)>;
/// (user, verb, subresource) and whether it was allowed, with when.
type DecisionCache = HashMap<(User, &'static str, &'static str), (Instant, bool)>;

/// The reviewer: the node's apiserver client and the caches.
pub struct Reviewer {
    client: ApiClient,
    node_name: String,
    ttl: CacheTtl,
    tokens: Mutex<TokenCache>,
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
    Some(User {
        name,
        uid: u.get("uid").and_then(Value::as_str).map(str::to_string),
        groups: strings(&u["groups"]),
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
    json!({"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": spec})
}

impl Reviewer {
    pub fn new(client: ApiClient, node_name: &str, ttl: CacheTtl) -> Reviewer {
        Reviewer {
            client,
            node_name: node_name.to_string(),
            ttl,
            tokens: Mutex::new(HashMap::new()),
            decisions: Mutex::new(HashMap::new()),
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
        if let Some((at, who)) = lock(&self.tokens).get(&key) {
            let ttl = if who.is_some() {
                self.ttl.token
            } else {
                self.ttl.token_rejected
            };
            if at.elapsed() < ttl {
                return Ok(who.clone());
            }
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
        let mut cache = lock(&self.tokens);
        if cache.len() >= CACHE_MAX {
            cache.clear();
        }
        cache.insert(key, (Instant::now(), who.clone()));
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
        if let Some((at, allowed)) = lock(&self.decisions).get(&key) {
            let ttl = if *allowed {
                self.ttl.allowed
            } else {
                self.ttl.denied
            };
            if at.elapsed() < ttl {
                return Ok(*allowed);
            }
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
        let mut cache = lock(&self.decisions);
        if cache.len() >= CACHE_MAX {
            cache.clear();
        }
        cache.insert(key, (Instant::now(), allowed));
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
            })
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
        };
        let r = access_review(&u, "edge-1", "get", "log");
        assert_eq!(
            r["spec"]["resourceAttributes"],
            json!({"verb": "get", "version": "v1", "resource": "nodes", "subresource": "log", "name": "edge-1"})
        );
        assert_eq!(r["spec"]["user"], "jane");
        assert_eq!(r["spec"]["groups"], json!(["devs"]));
        assert!(r["spec"].get("uid").is_none());
    }
}
