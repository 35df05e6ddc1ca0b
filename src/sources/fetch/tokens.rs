//! Service-account tokens for pods' projected volumes: when to renew (after 80 % of their
//! life, as the kubelet does, and a node's tokens together), and the TokenRequest itself.

use super::*;

/// Whether a token issued at `issued_ms` and valid until `expires_ms` should be renewed.
/// A clock that went backwards (a device without a real-time clock, before NTP) makes the
/// record meaningless, so it is renewed too.
pub fn token_due(now_ms: i64, issued_ms: i64, expires_ms: i64) -> bool {
    let life = (expires_ms - issued_ms).max(0);
    now_ms < issued_ms || now_ms >= issued_ms + life * 8 / 10 || now_ms >= expires_ms
}

/// Which of a pass's tokens to request, given each one's cached `(issued_ms, expires_ms)`
/// (`None`: not cached). Nothing, unless one is missing or [`token_due`]; then those, and
/// with them every token past 40 % of its life.
///
/// Why the early ones: every renewal is a database commit, and on flash a commit costs
/// 20–28 KiB of writes whatever it holds (`store::cursors` says where they go). Tokens
/// renewed each on its own cost one commit per pod every 48 minutes (80 % of the usual
/// 3607 s): about the whole 100 KiB/h budget for 5 pods. Renewed together, they are one
/// commit. 40 % is half of the 80 % renewal point, so any two groups of tokens issued at
/// different times merge at the first renewal of either: afterwards all of a node's tokens
/// fall due together, and none is requested earlier than the kubelet would; only the merge
/// itself renews some early, once.
pub fn tokens_to_renew(now_ms: i64, cached: &[Option<(i64, i64)>]) -> Vec<bool> {
    let due = |t: &Option<(i64, i64)>| t.is_none_or(|(i, e)| token_due(now_ms, i, e));
    if !cached.iter().any(due) {
        return vec![false; cached.len()];
    }
    cached
        .iter()
        .map(|t| {
            t.is_none_or(|(issued, expires)| {
                let life = (expires - issued).max(0);
                due(t) || now_ms >= issued + life * 4 / 10
            })
        })
        .collect()
}

/// A projected token a pod's volume needs.
pub(super) struct WantedToken<'a> {
    pub(super) pod: &'a ObjectIndex,
    pub(super) service_account: &'a str,
    pub(super) audience: &'a str,
    pub(super) expiration_secs: i64,
}

impl WantedToken<'_> {
    pub(super) fn key(&self) -> Key {
        (
            "token".into(),
            self.pod.uid.clone(),
            format!("{}/{}", self.audience, self.expiration_secs),
        )
    }
}

/// The TokenRequest body for a pod's projected token.
pub fn token_request(pod: &ObjectIndex, audience: &str, expiration_secs: i64) -> Value {
    let mut spec = serde_json::json!({
        "expirationSeconds": expiration_secs,
        "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": pod.name, "uid": pod.uid},
    });
    if !audience.is_empty() {
        spec["audiences"] = serde_json::json!([audience]);
    }
    serde_json::json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec})
}

impl Fetcher {
    /// Requests the tokens [`tokens_to_renew`] picks and caches what came back in one
    /// transaction.
    pub(super) async fn renew_tokens(
        &mut self,
        wanted: &[WantedToken<'_>],
        st: &mut FetchStats,
    ) -> Result<(), StoreError> {
        let mut cached = Vec::with_capacity(wanted.len());
        for w in wanted {
            cached.push(
                self.store
                    .get_token(&w.pod.uid, w.audience, w.expiration_secs)?
                    .map(|t| (t.issued_ms, t.expires_ms)),
            );
        }
        let now = crate::time::now_ms();
        let picked = tokens_to_renew(now, &cached);
        let mut fresh = Vec::new();
        for ((w, was), pick) in wanted.iter().zip(&cached).zip(picked) {
            if !pick || !self.due(&w.key()) {
                continue;
            }
            match self.request_token(w, now).await {
                Ok(Some(t)) => {
                    self.succeeded(&w.key());
                    tracing::debug!(pod = %w.pod.name, namespace = %w.pod.namespace,
                        service_account = %w.service_account,
                        expires_in_s = (t.expires_ms - now) / 1000, "service-account token received");
                    if was.is_none() {
                        tracing::info!(pod = %w.pod.name, namespace = %w.pod.namespace,
                            service_account = %w.service_account, "service-account token cached");
                    }
                    fresh.push(t);
                }
                Ok(None) => {
                    st.failed += 1;
                    tracing::warn!(pod = %w.pod.name, "TokenRequest answer has no token");
                }
                Err(e) if e.is_offline() => {
                    st.offline = true;
                    break;
                }
                Err(e) => {
                    st.failed += 1;
                    self.failed(w.key(), &e);
                }
            }
        }
        if !fresh.is_empty() {
            self.store.put_tokens(&fresh)?;
            st.tokens += fresh.len();
            tracing::debug!(tokens = fresh.len(), "service-account tokens stored");
        }
        Ok(())
    }

    /// One TokenRequest: the token, or `None` when the answer holds none.
    pub(super) async fn request_token(
        &self,
        w: &WantedToken<'_>,
        now: i64,
    ) -> Result<Option<CachedToken>, KubeError> {
        let body = token_request(w.pod, w.audience, w.expiration_secs);
        let resp = self
            .client
            .create_sub(
                &SERVICE_ACCOUNTS,
                Some(&w.pod.namespace),
                w.service_account,
                "token",
                body.to_string().into_bytes(),
            )
            .await?;
        let v: Value = serde_json::from_str(&resp).unwrap_or(Value::Null);
        let Some(token) = v.pointer("/status/token").and_then(Value::as_str) else {
            return Ok(None);
        };
        let expires_ms = v
            .pointer("/status/expirationTimestamp")
            .and_then(Value::as_str)
            .and_then(crate::time::parse_rfc3339)
            .map(|s| s * 1000)
            .unwrap_or(now + w.expiration_secs * 1000);
        Ok(Some(CachedToken {
            pod_uid: w.pod.uid.clone(),
            audience: w.audience.to_string(),
            expiration_secs: w.expiration_secs,
            token: token.to_string(),
            issued_ms: now,
            expires_ms,
        }))
    }
}
