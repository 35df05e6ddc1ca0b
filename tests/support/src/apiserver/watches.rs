//! Watches: events, bookmarks and the per-watch task that streams them.

use super::*;

pub(super) fn event_line(kind: &str, object: &Value) -> Vec<u8> {
    let mut m = Map::new();
    m.insert("type".into(), kind.into());
    m.insert("object".into(), object.clone());
    let mut line = serde_json::to_vec(&Value::Object(m)).unwrap_or_default();
    line.push(b'\n');
    line
}

pub(super) fn bookmark(rt: &ResourceType, rv: u64, initial_end: bool) -> Value {
    let mut meta = Map::new();
    meta.insert("resourceVersion".into(), rv.to_string().into());
    if initial_end {
        meta.insert(
            "annotations".into(),
            json!({"k8s.io/initial-events-end": "true"}),
        );
    }
    let mut m = Map::new();
    m.insert("kind".into(), rt.kind.into());
    m.insert("apiVersion".into(), rt.api_version().into());
    m.insert("metadata".into(), Value::Object(meta));
    if rt.plural == "pods" {
        m.insert("spec".into(), json!({"containers": null}));
        m.insert("status".into(), json!({}));
    }
    if rt.plural == csr::CSR.plural {
        csr::bookmark_fields(&mut m);
    }
    Value::Object(m)
}

pub(super) type Chunk = Result<Frame<Bytes>, std::io::Error>;

pub(super) fn watch(
    state: &Arc<State>,
    rt: &'static ResourceType,
    namespace: Option<String>,
    q: &BTreeMap<String, String>,
) -> Response<Body> {
    let filter = match Filter::from_query(namespace, rt, q) {
        Ok(f) => f,
        Err(r) => return *r,
    };
    let send_initial = q.get("sendInitialEvents").map(String::as_str) == Some("true");
    let rv_param = q.get("resourceVersion").cloned().unwrap_or_default();
    let bookmarks = q.get("allowWatchBookmarks").map(String::as_str) == Some("true");
    let timeout = q
        .get("timeoutSeconds")
        .and_then(|s| s.parse::<u64>().ok())
        .map(Duration::from_secs)
        .unwrap_or(Duration::from_secs(1800));
    let (tx, rx) = mpsc::channel::<Chunk>(64);
    let state = state.clone();
    tokio::spawn(async move {
        let _ = watch_task(
            state,
            rt,
            filter,
            send_initial,
            rv_param,
            bookmarks,
            timeout,
            tx,
        )
        .await;
    });
    let stream =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|c| (c, rx)) });
    Response::builder()
        .status(200)
        .header("content-type", "application/json")
        .body(StreamBody::new(stream).boxed())
        .unwrap_or_else(|_| {
            Response::new(
                Full::new(Bytes::new())
                    .map_err(|never| match never {})
                    .boxed(),
            )
        })
}

#[allow(clippy::too_many_arguments)]
pub(super) async fn watch_task(
    state: Arc<State>,
    rt: &'static ResourceType,
    filter: Filter,
    send_initial: bool,
    rv_param: String,
    bookmarks: bool,
    timeout: Duration,
    tx: mpsc::Sender<Chunk>,
) -> Result<(), ()> {
    let send = |bytes: Vec<u8>| {
        let tx = tx.clone();
        async move {
            tx.send(Ok(Frame::data(Bytes::from(bytes))))
                .await
                .map_err(|_| ())
        }
    };
    let mut rv_rx = state.rv_tx.subscribe();
    enum Start {
        Expired(Value),
        From(u64, Vec<Value>),
    }
    // A watch list (sendInitialEvents) from a version the server does not have: the watch
    // cache waits 3 s for it, then ends the stream with the "too large" Status as an ERROR
    // event (cacher.go, waitUntilWatchCacheFreshAndForceAllEvents). A plain watch from such a
    // version is accepted and sends nothing until the server's versions pass it.
    if let Some(asked) = rv_param
        .parse::<u64>()
        .ok()
        .filter(|&n| n > 0 && send_initial)
    {
        let current = wait_fresh(&state, asked).await;
        if current < asked {
            send(event_line("ERROR", &too_large_body(asked, current, 1))).await?;
            return Ok(());
        }
    }
    let start = {
        let db = lock(&state.db);
        let asked: Option<u64> = rv_param.parse().ok().filter(|&n| n > 0);
        match asked {
            Some(n) if !send_initial && n < db.compacted => Start::Expired(status_body(
                410,
                "Expired",
                &format!("too old resource version: {n} ({})", db.compacted),
                None,
            )),
            Some(n) if !send_initial => Start::From(n, vec![]),
            _ => Start::From(
                db.rv,
                db.objects
                    .iter()
                    .filter(|((p, _, _), o)| p == rt.plural && filter.matches(o))
                    .map(|(_, o)| o.clone())
                    .collect(),
            ),
        }
    };
    let (mut last, initial) = match start {
        Start::Expired(st) => {
            send(event_line("ERROR", &st)).await?;
            return Ok(());
        }
        Start::From(rv, initial) => (rv, initial),
    };
    // A CSR watch's bookmark goes out only once the cache holds a version newer than the
    // watch's start (fixtures `csr_watch_timeout_no_bookmark`, `csr_watch_timeout_bookmark`).
    let started_at = last;
    for obj in initial {
        send(event_line("ADDED", &obj)).await?;
    }
    if send_initial {
        send(event_line("BOOKMARK", &bookmark(rt, last, true))).await?;
    }
    let deadline = tokio::time::Instant::now() + timeout;
    let bookmark_every = Duration::from_millis(state.bookmark_ms.load(Ordering::SeqCst));
    let mut next_bookmark = tokio::time::Instant::now() + bookmark_every;
    loop {
        while state.stalled.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(20)).await;
            if tx.is_closed() {
                return Err(());
            }
        }
        // Read the events and the version they lead up to under one lock, so a bookmark never
        // claims a version whose events were not sent.
        let (events, current): (Vec<(u64, &'static str, Value)>, u64) = {
            let db = lock(&state.db);
            if state.stalled.load(Ordering::SeqCst) {
                continue;
            }
            let evs = db
                .history
                .iter()
                .filter(|e| e.rv > last && e.plural == rt.plural)
                .filter_map(|e| {
                    let now = filter.matches(&e.object) && e.kind != "DELETED";
                    let before = e.prev.as_ref().is_some_and(|p| filter.matches(p));
                    let kind = match (before, now, e.kind) {
                        (true, _, "DELETED") => "DELETED",
                        (false, true, _) => "ADDED",
                        (true, true, _) => "MODIFIED",
                        (true, false, _) => "DELETED",
                        _ => return None,
                    };
                    Some((e.rv, kind, e.object.clone()))
                })
                .collect();
            (evs, db.rv)
        };
        for (rv, kind, obj) in events {
            let line = event_line(kind, &obj);
            let (cut, corrupt) = {
                let mut f = lock(&state.faults);
                let cut = f.cut_watch_events > 0;
                if cut {
                    f.cut_watch_events -= 1;
                }
                let corrupt = f.corrupt_watch_events > 0;
                if corrupt {
                    f.corrupt_watch_events -= 1;
                }
                (cut, corrupt)
            };
            if corrupt {
                send(b"{\"type\":\"MODIFIED\",\"object\":{\"metadata\":{\"name\": tru\n".to_vec())
                    .await?;
            }
            if cut {
                send(line[..line.len() / 2].to_vec()).await?;
                // An error frame makes hyper abort the connection without the final chunk.
                let _ = tx.send(Err(std::io::Error::other("injected cut"))).await;
                return Ok(());
            }
            send(line).await?;
            last = last.max(rv);
        }
        tokio::select! {
            r = rv_rx.changed() => { if r.is_err() { return Ok(()); } }
            _ = tokio::time::sleep_until(deadline) => return Ok(()),
            _ = tokio::time::sleep_until(next_bookmark), if bookmarks => {
                // A bookmark carries the server's version, and only goes to a watcher that
                // has not been told a newer one: one watching from a version the server
                // does not have yet gets none (cache_watcher.go sends events newer than the
                // watcher's version only).
                let newer = rt.plural != csr::CSR.plural || current > started_at;
                if !state.stalled.load(Ordering::SeqCst) && current >= last && newer {
                    last = current;
                    send(event_line("BOOKMARK", &bookmark(rt, last, false))).await?;
                }
                next_bookmark = tokio::time::Instant::now() + bookmark_every;
            }
            _ = tx.closed() => return Err(()),
        }
    }
}
