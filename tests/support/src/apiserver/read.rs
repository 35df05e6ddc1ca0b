//! Reads: lists (paged, from the watch cache, a version from the future) and gets.

use super::*;

/// How long the apiserver's watch cache waits for a resourceVersion it does not have yet
/// (`blockTimeout` in k8s.io/apiserver's watch_cache.go).
pub(super) const BLOCK_TIMEOUT: Duration = Duration::from_secs(3);

/// The Status of `storage.NewTooLargeResourceVersionError(asked, current, retry)`: an
/// apimachinery Timeout error with the `ResourceVersionTooLarge` cause.
pub(super) fn too_large_body(asked: u64, current: u64, retry_secs: u32) -> Value {
    status_body(
        504,
        "Timeout",
        &format!("Timeout: Too large resource version: {asked}, current: {current}"),
        Some(json!({
            "causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}],
            "retryAfterSeconds": retry_secs,
        })),
    )
}

/// Waits up to [`BLOCK_TIMEOUT`] for the server to reach `asked`; returns the version it has.
pub(super) async fn wait_fresh(state: &State, asked: u64) -> u64 {
    let mut rv = state.rv_tx.subscribe();
    let deadline = tokio::time::Instant::now() + BLOCK_TIMEOUT;
    loop {
        let current = lock(&state.db).rv;
        if current >= asked {
            return current;
        }
        tokio::select! {
            r = rv.changed() => if r.is_err() { return current; },
            _ = tokio::time::sleep_until(deadline) => return current,
        }
    }
}

/// A list asking for a resourceVersion the server does not have yet, answered as the real
/// apiserver answers it (k8s.io/apiserver v1.36: cacher/delegator.go, watch_cache.go,
/// etcd3/store.go): `NotOlderThan` (or a version without a match or a limit) is served from
/// the watch cache, which waits 3 s for the version and then answers 504 with
/// `retryAfterSeconds: 1` (and the Retry-After header the response writer derives from it);
/// `Exact` (or a version with a limit and no match) goes to etcd, whose "future revision"
/// is the same 504 at once, with no retry hint. `None`: an ordinary list.
pub(super) async fn list_from_the_future(
    state: &State,
    q: &BTreeMap<String, String>,
) -> Option<Response<Body>> {
    let asked: u64 = q
        .get("resourceVersion")
        .and_then(|s| s.parse().ok())
        .filter(|&n| n > 0)?;
    if q.get("continue").is_some_and(|c| !c.is_empty()) {
        return None;
    }
    let exact = match q.get("resourceVersionMatch").map(String::as_str) {
        Some("Exact") => true,
        Some("NotOlderThan") => false,
        _ => q.get("limit").is_some_and(|l| l != "0"),
    };
    let current = lock(&state.db).rv;
    if current >= asked {
        return None;
    }
    if exact {
        return Some(json_response(504, &too_large_body(asked, current, 0)));
    }
    let current = wait_fresh(state, asked).await;
    if current >= asked {
        return None;
    }
    let mut resp = json_response(504, &too_large_body(asked, current, 1));
    resp.headers_mut()
        .insert("retry-after", hyper::header::HeaderValue::from_static("1"));
    Some(resp)
}

#[derive(serde::Serialize, serde::Deserialize)]
pub(super) struct ContinueToken {
    pub(super) v: String,
    pub(super) rv: u64,
    pub(super) start: String,
}

pub(super) fn list(
    state: &State,
    rt: &'static ResourceType,
    namespace: Option<&str>,
    q: &BTreeMap<String, String>,
) -> Response<Body> {
    let filter = match Filter::from_query(namespace.map(str::to_string), rt, q) {
        Ok(f) => f,
        Err(r) => return *r,
    };
    let db = lock(&state.db);
    if q.get("resourceVersionMatch").map(String::as_str) == Some("Exact") {
        let asked: u64 = q
            .get("resourceVersion")
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        if asked < db.compacted {
            return status(
                410,
                "Expired",
                "The resourceVersion for the provided list is too old.",
                None,
            );
        }
    }
    let limit: usize = q
        .get("limit")
        .and_then(|s| s.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(usize::MAX);
    let start = match q.get("continue").filter(|c| !c.is_empty()) {
        None => None,
        Some(c) => {
            let tok = base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(c)
                .ok()
                .and_then(|b| serde_json::from_slice::<ContinueToken>(&b).ok());
            match tok {
                None => return status(400, "BadRequest", "continue key is not valid: illegal base64 data", None),
                Some(t) if t.rv < db.compacted => {
                    return status(
                        410,
                        "Expired",
                        "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter, or use the continue value from the response to retrieve the remainder of the results.",
                        None,
                    )
                }
                Some(t) => Some(t.start),
            }
        }
    };
    let mut items = Vec::new();
    let mut next = None;
    let mut more = false;
    for ((p, ns, name), obj) in &db.objects {
        if p != rt.plural || !filter.matches(obj) {
            continue;
        }
        let k = if ns.is_empty() {
            format!("/{name}")
        } else {
            format!("/{ns}/{name}")
        };
        if start.as_ref().is_some_and(|s| k.as_str() < s.as_str()) {
            continue;
        }
        if items.len() == limit {
            more = true;
            break;
        }
        // As the real apiserver does: the next page starts just after the last key sent.
        next = Some(format!("{k}\u{0}"));
        items.push(strip_type(obj));
    }
    let mut meta = Map::new();
    meta.insert("resourceVersion".into(), db.rv.to_string().into());
    if let Some(start) = next.filter(|_| more) {
        let tok = serde_json::to_vec(&ContinueToken {
            v: "meta.k8s.io/v1".into(),
            rv: db.rv,
            start,
        })
        .unwrap_or_default();
        meta.insert(
            "continue".into(),
            base64::engine::general_purpose::URL_SAFE_NO_PAD
                .encode(tok)
                .into(),
        );
    }
    let mut out = Map::new();
    out.insert("kind".into(), format!("{}List", rt.kind).into());
    out.insert("apiVersion".into(), rt.api_version().into());
    out.insert("metadata".into(), Value::Object(meta));
    out.insert("items".into(), Value::Array(items));
    json_response(200, &Value::Object(out))
}

pub(super) fn get(
    state: &State,
    rt: &'static ResourceType,
    namespace: Option<&str>,
    name: &str,
) -> Response<Body> {
    let key = (
        rt.plural.to_string(),
        namespace.unwrap_or("").to_string(),
        name.to_string(),
    );
    match lock(&state.db).objects.get(&key) {
        Some(o) => json_response(200, o),
        None => not_found(rt, name),
    }
}

pub(super) fn not_found(rt: &ResourceType, name: &str) -> Response<Body> {
    let mut details = Map::new();
    details.insert("name".into(), name.into());
    if !rt.group.is_empty() {
        details.insert("group".into(), rt.group.into());
    }
    details.insert("kind".into(), rt.plural.into());
    status(
        404,
        "NotFound",
        &format!("{} \"{name}\" not found", rt.qualified()),
        Some(Value::Object(details)),
    )
}

pub(super) fn parse_body(body: &[u8]) -> Result<Value, Reject> {
    serde_json::from_slice::<Value>(body)
        .ok()
        .filter(Value::is_object)
        .ok_or_else(|| {
            Box::new(status(
                400,
                "BadRequest",
                "the request body is not a JSON object",
                None,
            ))
        })
}
