//! Streaming one container log file to a client, following it if asked: the loop behind both
//! the local API's `GET /v1/pods/{ns}/{name}/log` (`edgehub logs`) and the node API's
//! `/containerLogs` (`kubectl logs`). Reading happens on the blocking pool, a chunk at a
//! time; the caller says how to tell that the followed attempt is over.

use super::LogReader;
use bytes::Bytes;
use std::fs::File;
use std::path::Path;
use std::time::Duration;
use tokio::sync::mpsc;

/// How often a followed file is checked for new lines.
pub const FOLLOW_POLL: Duration = Duration::from_millis(200);

/// A log being streamed.
pub trait Followed: Send + 'static {
    /// The reader and the path of the file it follows (the path a rotation renames away).
    fn parts(&mut self) -> (&mut LogReader<File>, &Path);
    /// At the end of a followed file: whether there is nothing more to wait for (a newer
    /// attempt replaced this one, or the pod is gone). Called on the blocking pool.
    fn superseded(&self) -> bool;
}

/// How a stream ends.
#[derive(Debug, Clone, Copy)]
pub struct Ending {
    /// Wait for new lines at the end of the file (`-f`).
    pub follow: bool,
    /// A follow with nothing new for this long is ended; so is any stream whose receiver
    /// takes nothing for this long.
    pub idle: Duration,
    /// Stop after this many bytes (`limitBytes`).
    pub limit_bytes: Option<u64>,
}

/// One step of reading on the blocking pool: a chunk of output, the bytes read (0 at the
/// current end) and, at the end of a followed file, whether it was superseded.
type Step = std::io::Result<(Vec<u8>, usize, bool)>;

/// Hands `chunk` to the receiver; `false` when it is gone (the client went away) or took
/// nothing for `idle`: a client that stopped reading (`kubectl logs -f`, then Ctrl-Z) must
/// not hold the stream, and its place among the API's streams, for ever.
async fn send(tx: &mpsc::Sender<Bytes>, chunk: Vec<u8>, idle: Duration) -> bool {
    match tokio::time::timeout(idle, tx.send(Bytes::from(chunk))).await {
        Ok(sent) => sent.is_ok(),
        Err(_) => {
            tracing::info!(idle = ?idle, "ending a log stream whose client read nothing for its idle limit");
            false
        }
    }
}

/// Reads `log` into `tx` until it ends as `ending` says, the receiver goes away, or it takes
/// nothing for `ending.idle`.
pub async fn pump<L: Followed>(mut log: L, ending: Ending, tx: mpsc::Sender<Bytes>) {
    let follow = ending.follow;
    let mut left = ending.limit_bytes;
    let mut finishing = false;
    let mut quiet_since = tokio::time::Instant::now();
    loop {
        let job = tokio::task::spawn_blocking(move || {
            let mut out = Vec::new();
            let step: Step = (|| {
                let (reader, path) = log.parts();
                let mut n = reader.read_some(&mut out)?;
                // At the end of a followed file that a rotation renamed away: what the
                // runtime wrote before it reopened the log is read to the end (it writes
                // nothing more there), then the new file from its start.
                if n == 0 && follow && reader.rotated_away(path) {
                    while reader.read_some(&mut out)? > 0 {}
                    reader.follow_to(path)?;
                    n = reader.read_some(&mut out)?;
                    // Bytes from the old file count as progress too: keep reading.
                    n = n.max(usize::from(!out.is_empty()));
                }
                let superseded = n == 0 && follow && log.superseded();
                Ok((out, n, superseded))
            })();
            (log, step)
        });
        let step;
        (log, step) = match job.await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "log reading task failed");
                return;
            }
        };
        let (mut out, n, superseded) = match step {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(path = %log.parts().1.display(), error = %e, "reading a container log failed");
                return;
            }
        };
        if let Some(l) = left.as_mut() {
            if out.len() as u64 >= *l {
                // usize::MAX bytes cannot be in memory, so the limit fits a usize here.
                out.truncate(usize::try_from(*l).unwrap_or(usize::MAX));
                let _ = send(&tx, out, ending.idle).await;
                break;
            }
            *l -= out.len() as u64;
        }
        if !out.is_empty() {
            if !send(&tx, out, ending.idle).await {
                return;
            }
            quiet_since = tokio::time::Instant::now();
        }
        if n > 0 {
            continue;
        }
        if !follow || finishing {
            break;
        }
        if quiet_since.elapsed() >= ending.idle {
            tracing::debug!(path = %log.parts().1.display(), idle = ?ending.idle,
                "ending a log follow that had nothing new for its idle limit");
            break;
        }
        // Replaced: read what was written in the meantime, once more, then stop.
        finishing = superseded;
        tokio::select! {
            _ = tokio::time::sleep(FOLLOW_POLL) => {}
            _ = tx.closed() => return,
        }
    }
    let (reader, path) = log.parts();
    if reader.malformed() > 0 {
        tracing::debug!(path = %path.display(), skipped = reader.malformed(),
            "container log had records not in the CRI format");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    struct Plain {
        reader: LogReader<File>,
        path: PathBuf,
    }

    impl Followed for Plain {
        fn parts(&mut self) -> (&mut LogReader<File>, &Path) {
            (&mut self.reader, &self.path)
        }
        fn superseded(&self) -> bool {
            false
        }
    }

    /// Issue 31: a client that stops reading (`kubectl logs -f`, then Ctrl-Z) left the pump
    /// waiting on a full channel for ever, holding the stream's slot. A send that waits the
    /// idle time ends the stream, followed or not.
    #[tokio::test]
    async fn a_reader_that_takes_nothing_ends_the_stream_after_the_idle_time() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("app_0.log");
        let line = "2026-11-30T23:12:43.713137255Z stdout F ".to_string() + &"x".repeat(60) + "\n";
        std::fs::write(&path, line.repeat(20_000)).unwrap();
        for follow in [false, true] {
            let log = Plain {
                reader: LogReader::open(&path, None).unwrap(),
                path: path.clone(),
            };
            let (tx, rx) = mpsc::channel(1);
            let ending = Ending {
                follow,
                idle: Duration::from_millis(300),
                limit_bytes: None,
            };
            let pump = tokio::spawn(pump(log, ending, tx));
            // The receiver stays, and takes nothing.
            let ended = tokio::time::timeout(Duration::from_secs(20), pump).await;
            assert!(
                ended.is_ok(),
                "follow={follow}: the pump still waits on its reader"
            );
            drop(rx);
        }
    }
}
