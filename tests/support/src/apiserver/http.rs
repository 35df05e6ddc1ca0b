//! Request handling: paths and queries, responses and Status bodies, authentication, and routing to the verbs.

use super::*;

// ---------------------------------------------------------------------------------------------
// Request handling

pub(super) struct Route {
    pub(super) rt: &'static ResourceType,
    pub(super) namespace: Option<String>,
    pub(super) name: Option<String>,
    pub(super) sub: Option<String>,
}

pub(super) fn parse_path(path: &str) -> Option<Route> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, version, rest) = match segs.as_slice() {
        ["api", v, rest @ ..] => ("", *v, rest),
        ["apis", g, v, rest @ ..] => (*g, *v, rest),
        _ => return None,
    };
    let (namespace, rest) = match rest {
        ["namespaces", ns, rest @ ..] if !rest.is_empty() => (Some(ns.to_string()), rest),
        rest => (None, rest),
    };
    let (plural, name, sub) = match rest {
        [p] => (*p, None, None),
        [p, n] => (*p, Some(n.to_string()), None),
        [p, n, s] => (*p, Some(n.to_string()), Some(s.to_string())),
        _ => return None,
    };
    let rt = RESOURCES
        .iter()
        .find(|r| r.group == group && r.version == version && r.plural == plural)?;
    if namespace.is_some() && !rt.namespaced {
        return None;
    }
    Some(Route {
        rt,
        namespace,
        name,
        sub,
    })
}

pub(super) fn parse_query(q: Option<&str>) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for pair in q.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let dec = |s: &str| {
            percent_encoding::percent_decode_str(&s.replace('+', " "))
                .decode_utf8_lossy()
                .into_owned()
        };
        out.insert(dec(k), dec(v));
    }
    out
}

pub(super) fn full(code: StatusCode, content_type: &str, body: Vec<u8>) -> Response<Body> {
    Response::builder()
        .status(code)
        .header("content-type", content_type)
        .body(
            Full::new(Bytes::from(body))
                .map_err(|never| match never {})
                .boxed(),
        )
        .unwrap_or_else(|_| {
            Response::new(
                Full::new(Bytes::new())
                    .map_err(|never| match never {})
                    .boxed(),
            )
        })
}

pub(super) fn json_response(code: u16, v: &Value) -> Response<Body> {
    full(
        StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        "application/json",
        serde_json::to_vec(v).unwrap_or_default(),
    )
}

/// A Status body in the apiserver's field order.
pub fn status_body(code: u16, reason: &str, message: &str, details: Option<Value>) -> Value {
    let mut m = Map::new();
    m.insert("kind".into(), "Status".into());
    m.insert("apiVersion".into(), "v1".into());
    m.insert("metadata".into(), json!({}));
    m.insert("status".into(), "Failure".into());
    m.insert("message".into(), message.into());
    m.insert("reason".into(), reason.into());
    if let Some(d) = details {
        m.insert("details".into(), d);
    }
    m.insert("code".into(), code.into());
    Value::Object(m)
}

pub(super) fn status(
    code: u16,
    reason: &str,
    message: &str,
    details: Option<Value>,
) -> Response<Body> {
    json_response(code, &status_body(code, reason, message, details))
}

/// What a handler returns to close its connection instead of answering.
#[derive(Debug)]
pub(super) struct AnswerLost;

impl std::fmt::Display for AnswerLost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the answer was lost (injected)")
    }
}

impl std::error::Error for AnswerLost {}

pub(super) async fn handle(
    state: Arc<State>,
    cert_user: Option<Option<csr::CertIdentity>>,
    req: Request<Incoming>,
) -> Result<Response<Body>, AnswerLost> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let uri = req.uri().to_string();
    let at = std::time::Instant::now();
    let query = parse_query(req.uri().query());
    let bearer = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|t| t.trim().to_string());
    // A bearer token is tried first, then the client certificate, as the apiserver's union
    // authenticator does; a certificate the fake did not issue, or one outside its validity,
    // authenticates no one (401), as the x509 authenticator answers.
    let token_caller = bearer.as_deref().and_then(|t| {
        let static_user = lock(&state.tokens).get(t).cloned();
        match static_user {
            Some(u) => Some(csr::token_caller(&u)),
            None => csr::bootstrap_caller(&state, t),
        }
    });
    let caller = token_caller.or_else(|| cert_user.flatten().as_ref().and_then(csr::cert_caller));
    let user = caller.as_ref().map(|c| c.user.clone());
    // The node proxy streams both ways (logs that follow, upgraded exec): it takes the request
    // whole, body and upgrade, instead of a collected body.
    if let Some(target) = proxy::parse(&path) {
        let resource = target.resource();
        let verb = match method {
            Method::GET => "get",
            Method::POST => "create",
            _ => "unknown",
        };
        let resp = proxy::serve(&state, caller.as_ref(), target, req).await;
        lock(&state.log).push(LoggedRequest {
            verb,
            resource,
            method: method.to_string(),
            path,
            query,
            user,
            status: resp.status().as_u16(),
            answer_lost: false,
            at,
        });
        return Ok(resp);
    }
    let content_type = req
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => Bytes::new(),
    };

    if state.stalled.load(Ordering::SeqCst) {
        // Counted down on drop too: a client that gives up drops this future mid-wait.
        struct Held<'a>(&'a AtomicU64);
        impl Drop for Held<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::SeqCst);
            }
        }
        state.held.fetch_add(1, Ordering::SeqCst);
        let _held = Held(&state.held);
        while state.stalled.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let lost = {
        let mut f = lock(&state.faults);
        let pos = f.lose_answers.iter().position(|l| {
            l.method == method.as_str() && l.uri_contains.iter().all(|p| uri.contains(p.as_str()))
        });
        pos.and_then(|i| f.lose_answers.remove(i))
    };
    if lost.as_ref().is_some_and(|l| l.then_stall) {
        // Before the write commits: no watch may tell of it (they read the history under
        // the same lock the write takes, and look at this flag there).
        state.stalled.store(true, Ordering::SeqCst);
    }

    let resp = route(
        &state,
        caller.as_ref(),
        &method,
        &uri,
        &path,
        &query,
        &content_type,
        &body,
    )
    .await;
    let (verb, resource) = match parse_path(&path) {
        Some(r) => (
            verb(&method, &r, &query),
            match &r.sub {
                Some(sub) => format!("{}/{sub}", r.rt.plural),
                None => r.rt.plural.to_string(),
            },
        ),
        None => ("unknown", String::new()),
    };
    lock(&state.log).push(LoggedRequest {
        verb,
        resource,
        method: method.to_string(),
        path,
        query,
        user,
        status: resp.status().as_u16(),
        answer_lost: lost.is_some(),
        at,
    });
    match lost {
        Some(_) => Err(AnswerLost),
        None => Ok(resp),
    }
}

#[allow(clippy::too_many_arguments)]
pub(super) async fn route(
    state: &Arc<State>,
    caller: Option<&csr::Caller>,
    method: &Method,
    uri: &str,
    path: &str,
    query: &BTreeMap<String, String>,
    content_type: &str,
    body: &[u8],
) -> Response<Body> {
    let Some(caller) = caller else {
        return status(401, "Unauthorized", "Unauthorized", None);
    };
    let user = caller.user.as_str();
    let injected = {
        let mut f = lock(&state.faults);
        let pos = f
            .fail_next
            .iter()
            .position(|x| x.uri_contains.iter().all(|p| uri.contains(p.as_str())));
        pos.and_then(|i| f.fail_next.remove(i))
    };
    if let Some(fail) = injected {
        let (reason, message) = match fail.status {
            429 => ("TooManyRequests", "Too many requests, please try again later."),
            410 => ("Expired", "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter, or use the continue value from the response to retrieve the remainder of the results."),
            503 => ("ServiceUnavailable", "The server is currently unable to handle the request"),
            _ => ("InternalError", "Internal error occurred: injected failure"),
        };
        let mut resp = status(fail.status, reason, message, None);
        if let Some(ra) = fail.retry_after {
            if let Ok(v) = hyper::header::HeaderValue::from_str(&ra.to_string()) {
                resp.headers_mut().insert("retry-after", v);
            }
        }
        return resp;
    }
    if method == Method::GET {
        if let Some(doc) = discovery::document(state, path) {
            return json_response(200, &doc);
        }
    }
    if let Some(answer) = metrics::serve(state, caller, method, path).await {
        return answer;
    }
    if method == Method::POST && path == "/apis/authentication.k8s.io/v1/selfsubjectreviews" {
        return csr::self_subject_review(caller);
    }
    if method == Method::POST && path == reviews::TOKEN_REVIEWS {
        return reviews::token_review(state, caller, body);
    }
    if method == Method::POST && path == reviews::SUBJECT_ACCESS_REVIEWS {
        return reviews::subject_access_review(state, caller, body);
    }
    let Some(route) = parse_path(path) else {
        return status(
            404,
            "NotFound",
            "the server could not find the requested resource",
            None,
        );
    };
    let v = verb(method, &route, query);
    if let Some(denied) = csr::bootstrap_forbidden(caller, v, &route) {
        return denied;
    }
    if route.rt.plural == csr::CSR.plural {
        if let Some(answer) = csr::handle(state, caller, v, method, &route, body) {
            return answer;
        }
    }
    if let Some(denied) = authorize(state, user, method, &route, query, body) {
        return denied;
    }
    let rt = route.rt;
    match (method, route.name.as_deref(), route.sub.as_deref()) {
        (&Method::GET, None, None) => {
            if matches!(query.get("watch").map(String::as_str), Some("1" | "true")) {
                watch(state, rt, route.namespace, query)
            } else if let Some(too_large) = list_from_the_future(state, query).await {
                too_large
            } else {
                list(state, rt, route.namespace.as_deref(), query)
            }
        }
        (&Method::GET, Some(name), None) => get(state, rt, route.namespace.as_deref(), name),
        (&Method::POST, None, None) => create(state, rt, route.namespace.as_deref(), body),
        (&Method::POST, Some(sa), Some("token")) => {
            token_request(state, user, route.namespace.as_deref(), sa, body)
        }
        (&Method::PUT, Some(name), None) => {
            update(state, rt, route.namespace.as_deref(), name, body)
        }
        (&Method::PATCH, Some(name), sub @ (None | Some("status"))) => patch(
            state,
            rt,
            route.namespace.as_deref(),
            name,
            sub.is_some(),
            content_type,
            body,
        ),
        (&Method::DELETE, Some(name), None) => {
            delete(state, rt, route.namespace.as_deref(), name, body)
        }
        _ => status(
            405,
            "MethodNotAllowed",
            "the server does not allow this method on the requested resource",
            None,
        ),
    }
}
