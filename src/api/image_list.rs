//! `GET /v1/images`: every image on the node, its size, the revisions that name it and what
//! image garbage collection would do with it (`edgehub images` prints it as a table).

use super::{ApiState, Reply};

/// Runs on a blocking thread (as every handler): the CRI calls are awaited on the runtime.
pub fn list(state: &ApiState) -> Reply {
    let (Some(cri), Some(gc)) = (state.runtime.clone(), state.image_gc.as_ref()) else {
        return Reply::text(503, "The container runtime is not configured for this API");
    };
    let policy = gc.policy;
    let store = state.store.clone();
    let listed = tokio::runtime::Handle::current()
        .block_on(async move { crate::images::list(cri, store, &policy).await });
    match listed {
        Ok(images) => match serde_json::to_string(&serde_json::json!({ "images": images })) {
            Ok(body) => Reply::json(200, body),
            Err(e) => Reply::internal("List images failed", &e),
        },
        Err(crate::images::GcError::Cri(e)) if e.is_unavailable() => {
            Reply::text(503, format!("The container runtime does not answer: {e}"))
        }
        Err(e) => Reply::internal("List images failed", &e),
    }
}
