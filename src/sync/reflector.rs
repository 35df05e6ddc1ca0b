//! One reflector: list, then watch one resource into the store, resuming from its cursor,
//! relisting on 410 and on a cursor the server does not have, and checkpointing the cursor
//! (the behaviour the module's documentation lists).

use super::*;
use crate::kube::delay_after;

/// How a watch ended.
enum WatchEnd {
    /// The server closed it (timeoutSeconds): watch again at once.
    Closed,
    /// 410: the version is too old; list again.
    Expired,
    /// An ERROR event "Too large resource version": the server is behind the cursor.
    Behind,
    /// Shutdown was signalled.
    Shutdown,
}

#[derive(Debug, thiserror::Error)]
enum ReflectError {
    /// Boxed: a KubeError is large and this is the cold path.
    #[error(transparent)]
    Kube(Box<KubeError>),
    #[error("cannot write the cache: {0}")]
    Store(#[from] crate::store::StoreError),
}

impl From<KubeError> for ReflectError {
    fn from(e: KubeError) -> Self {
        ReflectError::Kube(Box::new(e))
    }
}

pub(super) struct Reflector {
    pub(super) spec: ReflectorSpec,
    pub(super) client: ApiClient,
    pub(super) store: Arc<Store>,
    pub(super) link: LinkReporter,
    pub(super) cfg: SyncConfig,
    pub(super) stats: Arc<ReflectorStats>,
}

/// The resourceVersion the reflector has reached, and what of it is on disk.
struct Cursor {
    key: String,
    /// Last version seen (events and bookmarks).
    seen: Option<String>,
    /// Last version written to the store.
    persisted: Option<String>,
    /// The current watch was answered and has delivered nothing yet, not even a bookmark.
    silent: bool,
}

impl Reflector {
    pub(super) async fn run(self, mut shutdown: watch::Receiver<bool>) {
        let key = self.spec.key();
        let persisted = match self.store.cursor(&key) {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(resource = %key, error = %e, "cannot read the sync cursor; listing afresh");
                None
            }
        };
        let mut cursor = Cursor {
            key: key.clone(),
            seen: persisted.clone(),
            persisted,
            silent: false,
        };
        if let Some(rv) = &cursor.seen {
            tracing::info!(resource = %key, resource_version = %rv, "resuming watch from the stored cursor");
        }
        let mut backoff = Backoff::new(self.cfg.backoff_initial, self.cfg.backoff_max);
        // Whether the server must confirm it has the cursor's version before a watch from it.
        // A stored cursor may be ahead of a server restored from a backup meanwhile, but a
        // watch from it says so itself, so the check waits for that: a watch from a version
        // the server has is answered with events or a bookmark (every minute once the server
        // moved on), one from a version too old ends with 410, and only one from a version
        // the server does not have yet stays silent (see `doubts`). Checking at every start
        // and after every error cost a request per resource per reconnect: a fleet whose link
        // returns sent as many version checks as watches.
        let mut check = false;
        loop {
            if *shutdown.borrow() {
                break;
            }
            let result = match cursor.seen.clone() {
                // A list can take up to the request timeout; shutdown must not wait for it.
                // Dropping it is safe: its only write is one synchronous transaction.
                None => tokio::select! {
                    r = self.relist(&mut cursor) => r.map(|()| {
                        check = false;
                        None
                    }),
                    _ = shutdown.changed() => break,
                },
                Some(rv) if check => tokio::select! {
                    r = self.check_cursor(&rv) => r.map(|()| {
                        check = false;
                        None
                    }),
                    _ = shutdown.changed() => break,
                },
                Some(rv) => self.watch(&rv, &mut cursor, &mut shutdown).await.map(Some),
            };
            match result {
                Ok(None) => backoff.reset(),
                Ok(Some(WatchEnd::Closed)) => {}
                Ok(Some(WatchEnd::Expired)) => {
                    tracing::info!(resource = %key, "resourceVersion expired; listing again");
                    cursor.seen = None;
                }
                Ok(Some(WatchEnd::Behind)) => {
                    self.behind(&cursor);
                    cursor.seen = None;
                }
                Ok(Some(WatchEnd::Shutdown)) => break,
                Err(e) => {
                    self.stats.errors.fetch_add(1, Ordering::Relaxed);
                    // A watch the server answered and then left silent past the idle
                    // timeout is the one sign of a cursor ahead of the server: confirm the
                    // cursor before watching from it again. Any other error (the link, the
                    // apiserver restarting) resumes the watch from the cursor.
                    check = doubts(&e, cursor.silent);
                    if check {
                        tracing::info!(resource = %key, resource_version = ?cursor.seen,
                            "the watch stayed silent; asking the apiserver whether it has this resourceVersion");
                    }
                    cursor.silent = false;
                    let delay = match &e {
                        ReflectError::Kube(k) if k.is_expired() => {
                            cursor.seen = None;
                            Duration::ZERO
                        }
                        ReflectError::Kube(k) if k.is_resource_version_too_large() => {
                            self.link.online();
                            self.behind(&cursor);
                            cursor.seen = None;
                            Duration::ZERO
                        }
                        ReflectError::Kube(k) => {
                            link_error(&self.link, k);
                            delay_after(k, &mut backoff)
                        }
                        ReflectError::Store(_) => {
                            // Unapplied events will be replayed from the persisted cursor.
                            cursor.seen = cursor.persisted.clone();
                            backoff.next_delay().max(Duration::from_secs(1))
                        }
                    };
                    let link_down = matches!(&e, ReflectError::Kube(k) if k.is_offline());
                    if link_down {
                        // "apiserver link is down" said it once; each retry is a detail.
                        tracing::debug!(resource = %key, error = %e, retry_in_ms = delay.as_millis() as u64, "sync retry");
                    } else if !delay.is_zero() {
                        tracing::warn!(resource = %key, error = %e, retry_in_ms = delay.as_millis() as u64, "sync error");
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(delay) => {}
                        _ = shutdown.changed() => {}
                    }
                }
            }
        }
        self.checkpoint(&mut cursor, true);
        tracing::debug!(resource = %key, "reflector stopped");
    }

    /// Asks the server whether it has `rv` (see [`ApiClient::check_resource_version`]).
    async fn check_cursor(&self, rv: &str) -> Result<(), ReflectError> {
        self.client
            .check_resource_version(
                &self.spec.resource,
                self.spec.namespace.as_deref(),
                &self.spec.params,
                rv,
            )
            .await?;
        self.link.online();
        Ok(())
    }

    /// The server is behind the cursor: said once per occurrence, since it means the cloud's
    /// etcd went back in time and the cache is about to be corrected by a list.
    fn behind(&self, cursor: &Cursor) {
        tracing::warn!(resource = %cursor.key, resource_version = ?cursor.seen,
            "the apiserver does not have this resourceVersion yet (was its etcd restored from a backup?); listing again");
    }

    /// Lists every page, then replaces the rows in one transaction.
    async fn relist(&self, cursor: &mut Cursor) -> Result<(), ReflectError> {
        self.stats.lists.fetch_add(1, Ordering::Relaxed);
        let ns = self.spec.namespace.as_deref();
        let mut items = Vec::new();
        let mut token: Option<String> = None;
        let mut restarted = false;
        let rv = loop {
            let page = match self
                .client
                .list(
                    &self.spec.resource,
                    ns,
                    &self.spec.params,
                    Some(self.cfg.list_page_size),
                    token.as_deref(),
                )
                .await
            {
                // The continue token expired between pages: start over, once.
                Err(e) if e.is_expired() && token.is_some() && !restarted => {
                    restarted = true;
                    items.clear();
                    token = None;
                    continue;
                }
                r => r?,
            };
            self.link.online();
            for raw in page.items {
                match StoredObject::from_raw(self.spec.kind, raw) {
                    Ok(obj) if self.spec.keep(&obj.index) => items.push(obj),
                    Ok(_) => {}
                    Err(e) => {
                        self.stats.malformed.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(resource = %cursor.key, error = %e, "skipping malformed object in list");
                    }
                }
            }
            match page.continue_token {
                Some(t) => token = Some(t),
                None => break page.resource_version,
            }
        };
        let stats = self
            .store
            .replace_all(self.spec.kind, ns, &items, (&cursor.key, &rv))?;
        self.stats
            .written
            .fetch_add((stats.written + stats.deleted) as u64, Ordering::Relaxed);
        tracing::info!(resource = %cursor.key, resource_version = %rv, objects = items.len(),
            written = stats.written, deleted = stats.deleted, "listed");
        cursor.seen = Some(rv.clone());
        cursor.persisted = Some(rv);
        Ok(())
    }

    async fn watch(
        &self,
        rv: &str,
        cursor: &mut Cursor,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<WatchEnd, ReflectError> {
        self.stats.watches.fetch_add(1, Ordering::Relaxed);
        // Like client-go: a random 5-10 minute server-side timeout spreads re-watches.
        let timeout = fastrand::u32(300..600);
        let mut stream = self
            .client
            .watch(
                &self.spec.resource,
                self.spec.namespace.as_deref(),
                &self.spec.params,
                rv,
                timeout,
            )
            .await?;
        self.link.online();
        cursor.silent = true;
        loop {
            let ev = tokio::select! {
                ev = stream.next() => ev?,
                _ = shutdown.changed() => return Ok(WatchEnd::Shutdown),
            };
            cursor.silent = false;
            let Some(ev) = ev else {
                self.checkpoint(cursor, false);
                return Ok(WatchEnd::Closed);
            };
            self.link.online();
            self.stats.events.fetch_add(1, Ordering::Relaxed);
            match ev {
                WatchEvent::Added(raw) | WatchEvent::Modified(raw) => {
                    self.apply_object(raw, false, cursor)?
                }
                WatchEvent::Deleted(raw) => self.apply_object(raw, true, cursor)?,
                WatchEvent::Bookmark {
                    resource_version, ..
                } => {
                    cursor.seen = Some(resource_version);
                    self.checkpoint(cursor, false);
                }
                WatchEvent::Error(status) if status.code == 410 => return Ok(WatchEnd::Expired),
                WatchEvent::Error(status) if status.is_resource_version_too_large() => {
                    return Ok(WatchEnd::Behind)
                }
                WatchEvent::Error(status) => {
                    return Err(ReflectError::from(KubeError::Status {
                        request: crate::kube::Request {
                            verb: "watch",
                            resource: self.spec.resource.qualified(),
                            namespace: self.spec.namespace.clone(),
                            name: None,
                        },
                        status,
                        retry_after: None,
                        node: String::new(),
                    }))
                }
                WatchEvent::Malformed { reason } => {
                    self.stats.malformed.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(resource = %cursor.key, %reason, "skipping malformed watch event");
                }
            }
        }
    }

    fn apply_object(
        &self,
        raw: String,
        deleted: bool,
        cursor: &mut Cursor,
    ) -> Result<(), ReflectError> {
        let obj = match StoredObject::from_raw(self.spec.kind, raw) {
            Ok(o) => o,
            Err(e) => {
                self.stats.malformed.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(resource = %cursor.key, error = %e, "skipping malformed object in watch event");
                return Ok(());
            }
        };
        let rv = obj.index.resource_version.clone();
        let change = if deleted || !self.spec.keep(&obj.index) {
            Change::Delete {
                namespace: obj.index.namespace.clone(),
                name: obj.index.name.clone(),
            }
        } else {
            Change::Upsert(obj)
        };
        // The change carries the cursor (the store drops the reflector's older parked
        // progress); if it turns out to change nothing, the progress is parked again below.
        let stats = self
            .store
            .apply(self.spec.kind, &[change], Some((&cursor.key, &rv)))?;
        cursor.seen = Some(rv.clone());
        if stats.touched() {
            self.stats
                .written
                .fetch_add((stats.written + stats.deleted) as u64, Ordering::Relaxed);
            cursor.persisted = Some(rv);
        } else {
            self.checkpoint(cursor, false);
        }
        Ok(())
    }

    /// Parks the seen version if it is not on disk yet (the store writes it with the next
    /// commit it makes anyway), and writes every reflector's parked progress in one
    /// transaction once cursors were last written `cursor_checkpoint` ago (or when `force`d,
    /// at shutdown).
    fn checkpoint(&self, cursor: &mut Cursor, force: bool) {
        let Some(seen) = &cursor.seen else { return };
        if cursor.persisted.as_ref() == Some(seen) {
            return;
        }
        self.store.park_cursor(&cursor.key, seen);
        match self
            .store
            .checkpoint_cursors(self.cfg.cursor_checkpoint, force)
        {
            Ok(0) => {}
            Ok(n) => {
                cursor.persisted = Some(seen.clone());
                tracing::debug!(cursors = n, "checkpointed the sync cursors");
            }
            Err(e) => {
                tracing::warn!(resource = %cursor.key, error = %e, "cannot checkpoint the sync cursors")
            }
        }
    }
}

/// Whether a reflector's error gives reason to doubt its cursor: the watch was answered, then
/// nothing came (not an event, not a bookmark) until the idle timeout. That is how a watch
/// from a version the server does not have yet behaves (an etcd restored from a backup): the
/// apiserver accepts it and stays silent until its own versions pass it. A cut link, a
/// refused connection, an error status or a watch that delivered something say nothing about
/// the cursor; a too-old cursor gets its 410.
fn doubts(e: &ReflectError, silent: bool) -> bool {
    silent && matches!(e, ReflectError::Kube(k) if matches!(**k, KubeError::Timeout { .. }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kube::Request;

    fn timeout() -> ReflectError {
        ReflectError::from(KubeError::Timeout {
            request: Request {
                verb: "watch",
                resource: "pods".into(),
                namespace: None,
                name: None,
            },
            timeout: Duration::from_secs(120),
        })
    }

    #[test]
    fn only_a_silent_watch_that_timed_out_doubts_the_cursor() {
        assert!(doubts(&timeout(), true));
        assert!(!doubts(&timeout(), false), "it delivered something first");
        let cut = ReflectError::from(KubeError::Stream {
            request: Request {
                verb: "watch",
                resource: "pods".into(),
                namespace: None,
                name: None,
            },
            reason: "watch connection lost".into(),
        });
        assert!(!doubts(&cut, true), "a cut link says nothing of the cursor");
    }
}
