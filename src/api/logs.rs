//! `GET /v1/namespaces/{ns}/pods/{name}/log`: a container's log, read from the files the CRI
//! runtime writes, printed as `kubectl logs` prints it. It needs the cache (for the pod's uid
//! and containers) and local files only, so it works with the link down.
//!
//! The body is streamed, never assembled in memory: a log the runtime never rotates can be
//! large, and with `follow` the response lasts as long as the container writes. A task reads
//! the file in chunks on the blocking pool and sends them through a small channel, so a slow
//! client slows the reading instead of growing a buffer.

use super::{ApiState, Reply};
use crate::logs::{self, Choice, LogReader, LogsError, Options};
use crate::object::Kind;
use crate::store::Store;
use bytes::Bytes;
use hyper::body::Frame;
use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::mpsc;

/// Chunks in flight between the reading task and the connection.
const CHANNEL: usize = 4;

/// An opened log, ready to stream.
pub struct LogStream {
    reader: LogReader<std::fs::File>,
    follow: bool,
    dir: PathBuf,
    /// The attempt being read, to notice when a newer one replaces it.
    attempt: u32,
    path: PathBuf,
    pub choice: Choice,
    /// The pod, to notice when it leaves the cache.
    store: Arc<Store>,
    namespace: String,
    name: String,
    uid: String,
    /// A follower's place among the API's followers, released when the stream ends.
    follower: Option<tokio::sync::OwnedSemaphorePermit>,
    /// A follower with nothing new for this long is ended.
    idle: Duration,
}

impl std::fmt::Debug for LogStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogStream")
            .field("path", &self.path)
            .field("follow", &self.follow)
            .finish()
    }
}

/// The data directory: the store's file lives in it (`Config::db_path`), and so do the
/// pods' directories the runtime writes logs to.
fn data_dir(state: &ApiState) -> &Path {
    state.store.path().parent().unwrap_or(Path::new("."))
}

/// Finds the pod in the cache and opens the log file the request asks for. Blocking (the
/// store and the file system); the errors are the API's usual short texts.
pub fn open(
    state: &ApiState,
    namespace: &str,
    name: &str,
    query: Option<&str>,
) -> Result<LogStream, Reply> {
    let opts = Options::from_query(query).map_err(|e| reply(&e))?;
    let pod = match state.store.get(Kind::Pod, namespace, name) {
        Ok(Some(p)) => p,
        Ok(None) => {
            return Err(Reply::text(
                404,
                format!("Pod {namespace}/{name} not found"),
            ))
        }
        Err(e) => return Err(Reply::internal("Get pod failed", &e)),
    };
    let raw: serde_json::Value = serde_json::from_str(&pod.raw)
        .map_err(|e| Reply::internal("Cached pod is not JSON", &e))?;
    let pod_name = format!("{namespace}/{name}");
    let choice = logs::choose_container(&raw, &pod_name, opts.container.as_deref())
        .map_err(|e| reply(&e))?;
    let dir = logs::pod_log_dir(data_dir(state), &pod.index.uid).ok_or_else(|| {
        reply(&LogsError::NotStarted {
            container: choice.container.clone(),
            pod: pod_name.clone(),
        })
    })?;
    let found = logs::attempts(&dir, &choice.container).map_err(|source| {
        reply(&LogsError::Io {
            dir: dir.clone(),
            source,
        })
    })?;
    let (attempt, path) =
        logs::pick(&found, opts.previous, &choice.container, &pod_name).map_err(|e| reply(&e))?;
    let reader = LogReader::open(&path, opts.tail_lines).map_err(|source| {
        reply(&LogsError::Io {
            dir: dir.clone(),
            source,
        })
    })?;
    tracing::debug!(pod = %pod_name, container = %choice.container, attempt, follow = opts.follow,
        tail = ?opts.tail_lines, "serving container log");
    Ok(LogStream {
        reader,
        follow: opts.follow,
        dir,
        attempt,
        path,
        choice,
        store: state.store.clone(),
        namespace: namespace.to_string(),
        name: name.to_string(),
        uid: pod.index.uid,
        follower: None,
        idle: super::FOLLOW_IDLE,
    })
}

fn reply(e: &LogsError) -> Reply {
    match e {
        LogsError::Io { .. } => Reply::internal("Read logs failed", e),
        _ => Reply::text(400, e.to_string()),
    }
}

impl LogStream {
    /// Whether the request follows the log (`follow=true`): the stream lasts while the
    /// container writes.
    pub fn follows(&self) -> bool {
        self.follow
    }

    /// Holds a follower's place for as long as the stream lasts, and ends the stream after
    /// `idle` without anything new.
    pub fn hold(&mut self, follower: tokio::sync::OwnedSemaphorePermit, idle: Duration) {
        self.follower = Some(follower);
        self.idle = idle;
    }

    /// Starts the task that reads the log and returns the body it feeds. Must run inside the
    /// tokio runtime.
    pub fn into_body(self) -> LogBody {
        let (tx, rx) = mpsc::channel(CHANNEL);
        let ending = logs::follow::Ending {
            follow: self.follow,
            idle: self.idle,
            limit_bytes: None,
        };
        tokio::spawn(logs::follow::pump(self, ending, tx));
        LogBody { rx }
    }
}

impl logs::follow::Followed for LogStream {
    fn parts(&mut self) -> (&mut LogReader<std::fs::File>, &Path) {
        (&mut self.reader, &self.path)
    }

    /// Whether there is nothing more to wait for, as `kubectl logs -f` ends when its
    /// container stops: the container was replaced (a newer attempt's file exists), its
    /// pod's log directory was removed, or the pod left the cache (deleted, or replaced by
    /// one of another uid). A missing file alone is not the end: a rotation renames it for
    /// the moment until the runtime reopens it. A container that stops for good without a
    /// restart is not seen here (the API has no view of container states); the client ends
    /// such a follow.
    fn superseded(&self) -> bool {
        if !self.dir.exists() {
            return true;
        }
        let replaced = logs::attempts(&self.dir, &self.choice.container)
            .map(|found| found.iter().any(|(a, _)| *a > self.attempt))
            .unwrap_or(true);
        // A store error is passing (a busy database): keep following.
        let gone = match self.store.get(Kind::Pod, &self.namespace, &self.name) {
            Ok(p) => p.is_none_or(|p| p.index.uid != self.uid),
            Err(_) => false,
        };
        replaced || gone
    }
}

/// The body of a log response: chunks from the reading task until it ends.
#[derive(Debug)]
pub struct LogBody {
    rx: mpsc::Receiver<Bytes>,
}

impl hyper::body::Body for LogBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.rx.poll_recv(cx).map(|c| c.map(|b| Ok(Frame::data(b))))
    }
}
