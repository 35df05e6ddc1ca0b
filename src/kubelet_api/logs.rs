//! `GET /containerLogs/{namespace}/{pod}/{container}`: what the apiserver forwards
//! `kubectl logs` to, read from the same files `edgehub logs` reads ([`crate::logs`]), with
//! the kubelet's options: `follow`, `tailLines`, `sinceSeconds`, `sinceTime`, `timestamps`,
//! `previous`, `limitBytes`. The body is streamed from a task on the blocking pool through a
//! small channel, so a slow client slows the reading, not the memory.

use crate::logs::{self, LogReader, Shape};
use crate::object::Kind;
use crate::store::Store;
use bytes::Bytes;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::sync::mpsc;

/// The kubelet's log options, from the query string.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LogQuery {
    pub follow: bool,
    pub previous: bool,
    pub timestamps: bool,
    pub tail_lines: Option<u64>,
    pub since_seconds: Option<u64>,
    /// `sinceTime`, as unix nanoseconds.
    pub since_time: Option<i128>,
    pub limit_bytes: Option<u64>,
}

fn boolean(key: &str, v: &str) -> Result<bool, String> {
    match v {
        "" | "true" | "1" => Ok(true),
        "false" | "0" => Ok(false),
        _ => Err(format!("{key}: {v:?} is not a boolean")),
    }
}

fn positive(key: &str, v: &str, zero_ok: bool) -> Result<u64, String> {
    match v.parse::<u64>() {
        Ok(n) if n > 0 || zero_ok => Ok(n),
        _ => Err(format!(
            "{key}: {v:?} must be a {}integer",
            if zero_ok {
                "non-negative "
            } else {
                "positive "
            }
        )),
    }
}

impl LogQuery {
    /// Parses the query string (pure). Unknown parameters are ignored, as the kubelet does.
    pub fn parse(query: Option<&str>) -> Result<LogQuery, String> {
        let mut q = LogQuery::default();
        for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            let (key, raw) = pair.split_once('=').unwrap_or((pair, ""));
            let v = percent_encoding::percent_decode_str(raw)
                .decode_utf8()
                .map_err(|_| format!("{key}: not UTF-8"))?;
            match key {
                "follow" => q.follow = boolean(key, &v)?,
                "previous" => q.previous = boolean(key, &v)?,
                "timestamps" => q.timestamps = boolean(key, &v)?,
                "tailLines" => q.tail_lines = Some(positive(key, &v, true)?),
                "sinceSeconds" => q.since_seconds = Some(positive(key, &v, false)?),
                "sinceTime" => {
                    q.since_time = Some(
                        logs::rfc3339_nanos(&v)
                            .ok_or_else(|| format!("sinceTime: {v:?} is not RFC 3339"))?,
                    )
                }
                "limitBytes" => q.limit_bytes = Some(positive(key, &v, false)?),
                _ => {}
            }
        }
        if q.since_seconds.is_some() && q.since_time.is_some() {
            return Err("at most one of sinceTime or sinceSeconds may be specified".into());
        }
        Ok(q)
    }

    /// The start time the options ask for, as unix nanoseconds, given `now_nanos`.
    pub fn since_nanos(&self, now_nanos: i128) -> Option<i128> {
        self.since_time.or_else(|| {
            self.since_seconds
                .map(|s| now_nanos - s as i128 * 1_000_000_000)
        })
    }
}

/// Why a log cannot be served: the status and the text the kubelet answers with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub status: u16,
    pub text: String,
}

fn refuse(status: u16, text: impl Into<String>) -> Refusal {
    Refusal {
        status,
        text: text.into(),
    }
}

/// How a follow asks the runtime whether its container still runs: the kubelet ends a follow
/// once the container has stopped, not when the next attempt starts (a crash-looping one
/// waits out its backoff in between).
pub struct Liveness {
    pub cri: crate::cri::CriClient,
    /// The labels that find the pod's containers of that name (this node's).
    pub labels: std::collections::HashMap<String, String>,
    /// The runtime the asking task blocks on (it runs on the blocking pool).
    pub handle: tokio::runtime::Handle,
}

/// How often a follow at the end of its file asks the runtime.
const LIVENESS_EVERY: Duration = Duration::from_secs(1);

/// An opened log, ready to stream.
pub struct LogStream {
    reader: LogReader<std::fs::File>,
    q: LogQuery,
    dir: PathBuf,
    path: PathBuf,
    attempt: u32,
    container: String,
    idle: Duration,
    live: Option<Liveness>,
    /// When the runtime may be asked next.
    next_ask: std::sync::Mutex<std::time::Instant>,
}

fn now_nanos() -> i128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as i128)
        .unwrap_or(0)
}

/// Finds the pod in the cache and opens the file asked for (blocking: the store, the files).
pub fn open(
    store: &Store,
    data_dir: &Path,
    namespace: &str,
    pod: &str,
    container: &str,
    query: Option<&str>,
    idle: Duration,
) -> Result<LogStream, Refusal> {
    let q = LogQuery::parse(query).map_err(|e| refuse(400, e))?;
    let cached = match store.get(Kind::Pod, namespace, pod) {
        Ok(Some(p)) => p,
        Ok(None) => return Err(refuse(404, format!("pod {namespace}/{pod} not found"))),
        Err(e) => return Err(refuse(500, format!("reading the pod: {e}"))),
    };
    let raw: serde_json::Value = serde_json::from_str(&cached.raw)
        .map_err(|e| refuse(500, format!("the cached pod is not JSON: {e}")))?;
    let pod_name = format!("{namespace}/{pod}");
    let choice = logs::choose_container(&raw, &pod_name, Some(container))
        .map_err(|e| refuse(400, e.to_string()))?;
    let dir = logs::pod_log_dir(data_dir, &cached.index.uid)
        .ok_or_else(|| refuse(400, format!("pod {pod_name} has no log directory")))?;
    let found = logs::attempts(&dir, &choice.container)
        .map_err(|e| refuse(500, format!("reading {}: {e}", dir.display())))?;
    let (attempt, path) =
        logs::pick(&found, q.previous, &choice.container, &pod_name).map_err(|e| match e {
            // The kubelet's words (kubectl prints them), with the pod's name alone.
            logs::LogsError::NoPrevious { container, .. } => refuse(
                400,
                format!("previous terminated container {container:?} in pod {pod:?} not found"),
            ),
            e => refuse(400, e.to_string()),
        })?;
    let mut reader = LogReader::open(&path, q.tail_lines)
        .map_err(|e| refuse(500, format!("opening {}: {e}", path.display())))?;
    reader.set_shape(Shape {
        timestamps: q.timestamps,
        since_nanos: q.since_nanos(now_nanos()),
    });
    Ok(LogStream {
        reader,
        q,
        dir,
        path,
        attempt,
        container: choice.container,
        idle,
        live: None,
        next_ask: std::sync::Mutex::new(std::time::Instant::now()),
    })
}

impl LogStream {
    pub fn follows(&self) -> bool {
        self.q.follow
    }

    /// A follow that also ends once the runtime says the container stopped.
    pub fn with_liveness(mut self, live: Liveness) -> LogStream {
        self.live = Some(live);
        self
    }

    /// The runtime has this attempt's container, and it no longer runs (at most once a
    /// second; a runtime that cannot answer ends nothing).
    fn stopped(&self) -> bool {
        use crate::cri::{api, CriRuntime};
        let Some(live) = &self.live else {
            return false;
        };
        {
            let mut next = self.next_ask.lock().unwrap_or_else(|p| p.into_inner());
            let now = std::time::Instant::now();
            if now < *next {
                return false;
            }
            *next = now + LIVENESS_EVERY;
        }
        match live
            .handle
            .block_on(live.cri.list_containers(live.labels.clone()))
        {
            Ok(cs) => cs
                .iter()
                .find(|c| {
                    c.metadata
                        .as_ref()
                        .is_some_and(|m| m.name == self.container && m.attempt == self.attempt)
                })
                .is_some_and(|c| c.state != api::ContainerState::ContainerRunning as i32),
            Err(e) => {
                tracing::debug!(error = %e, "node API: cannot ask the runtime whether a followed container runs");
                false
            }
        }
    }

    /// Starts the reading task; chunks come out of the receiver until the log ends.
    pub fn spawn(self, permit: Option<tokio::sync::OwnedSemaphorePermit>) -> mpsc::Receiver<Bytes> {
        let (tx, rx) = mpsc::channel(4);
        let ending = logs::follow::Ending {
            follow: self.q.follow,
            idle: self.idle,
            limit_bytes: self.q.limit_bytes,
        };
        tokio::spawn(async move {
            // The stream's place among the node API's streams, released when it ends.
            let _permit = permit;
            logs::follow::pump(self, ending, tx).await
        });
        rx
    }
}

impl logs::follow::Followed for LogStream {
    fn parts(&mut self) -> (&mut LogReader<std::fs::File>, &Path) {
        (&mut self.reader, &self.path)
    }
    /// A newer attempt replaced the one followed, the pod's logs are gone, or the runtime
    /// says the container stopped.
    fn superseded(&self) -> bool {
        !self.dir.exists()
            || logs::attempts(&self.dir, &self.container)
                .map(|f| f.iter().any(|(a, _)| *a > self.attempt))
                .unwrap_or(true)
            || self.stopped()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kubelets_log_options() {
        let q = LogQuery::parse(Some(
            "follow=true&tailLines=10&timestamps=1&previous=false&limitBytes=100&sinceSeconds=5&pretty=x",
        ))
        .unwrap();
        assert_eq!(
            q,
            LogQuery {
                follow: true,
                previous: false,
                timestamps: true,
                tail_lines: Some(10),
                since_seconds: Some(5),
                since_time: None,
                limit_bytes: Some(100),
            }
        );
        assert_eq!(q.since_nanos(10_000_000_000), Some(5_000_000_000));
        let q = LogQuery::parse(Some("sinceTime=2026-11-30T10%3A00%3A05Z")).unwrap();
        assert_eq!(q.since_time, logs::rfc3339_nanos("2026-11-30T10:00:05Z"));
        assert_eq!(LogQuery::parse(None).unwrap(), LogQuery::default());
        for bad in [
            "tailLines=-1",
            "limitBytes=0",
            "sinceSeconds=0",
            "follow=maybe",
            "sinceTime=yesterday",
            "sinceSeconds=1&sinceTime=2026-11-30T10:00:05Z",
        ] {
            assert!(LogQuery::parse(Some(bad)).is_err(), "{bad}");
        }
    }

    /// Issue 31: the request that aborted edgehub (`sinceTime` with an `é` in its offset) is
    /// a 400's error, as the kubelet answers it.
    #[test]
    fn a_since_time_with_a_character_in_its_offset_is_refused() {
        let e = LogQuery::parse(Some("sinceTime=2026-01-01T00:00:00%2B00%C3%A90")).unwrap_err();
        assert!(e.starts_with("sinceTime: "), "{e}");
    }
}
