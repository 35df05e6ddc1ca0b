//! One blob's write stream to containerd's content service, and the time format of its
//! lease expiry.

use super::ContainerdError;
use edgehub_containerd_api::content::{self, WriteAction};
use std::collections::HashMap;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::sync::mpsc;

/// Messages queued ahead of containerd per blob: with [`crate::images`]' chunk size this
/// bounds what one write holds in memory.
pub(super) const WRITE_QUEUE: usize = 2;

/// One blob's write stream.
pub struct BlobWriter {
    pub(super) tx: mpsc::Sender<content::WriteContentRequest>,
    pub(super) task: Option<
        tokio::task::JoinHandle<Result<Option<content::WriteContentResponse>, ContainerdError>>,
    >,
    pub(super) reference: String,
    pub(super) total: i64,
    pub(super) expected: String,
    pub(super) offset: i64,
}

impl BlobWriter {
    fn msg(&self, action: WriteAction, data: Vec<u8>) -> content::WriteContentRequest {
        content::WriteContentRequest {
            action: action as i32,
            r#ref: self.reference.clone(),
            total: self.total,
            expected: self.expected.clone(),
            offset: self.offset,
            data,
            labels: HashMap::new(),
        }
    }

    /// Sends the next bytes.
    pub async fn write(&mut self, data: Vec<u8>) -> Result<(), ContainerdError> {
        let n = data.len() as i64;
        let m = self.msg(WriteAction::Write, data);
        if self.tx.send(m).await.is_err() {
            return Err(self.failed().await);
        }
        self.offset += n;
        Ok(())
    }

    /// Commits the blob with `labels`: containerd checks size and digest, and answers with
    /// the digest it computed.
    pub async fn commit(
        mut self,
        expected: &str,
        labels: HashMap<String, String>,
    ) -> Result<String, ContainerdError> {
        let mut m = self.msg(WriteAction::Commit, Vec::new());
        m.expected = expected.to_string();
        m.labels = labels;
        if self.tx.send(m).await.is_err() {
            return Err(self.failed().await);
        }
        let (tx, _) = mpsc::channel(1);
        drop(std::mem::replace(&mut self.tx, tx));
        let task = self.task.take();
        let answer = match task {
            Some(t) => t.await.map_err(|e| self.error(e.to_string()))?,
            None => return Err(self.error("the write stream is gone".into())),
        };
        match answer? {
            Some(r) if r.action == WriteAction::Commit as i32 => Ok(r.digest),
            Some(r) => Err(self.error(format!(
                "containerd answered the commit with action {}",
                r.action
            ))),
            None => Err(self.error("containerd closed the write stream without committing".into())),
        }
    }

    fn error(&self, message: String) -> ContainerdError {
        ContainerdError::Write {
            reference: self.reference.clone(),
            message,
        }
    }

    /// Why the stream's receiver is gone: the call's own error when it has one.
    async fn failed(&mut self) -> ContainerdError {
        match self.task.take() {
            Some(t) => match t.await {
                Ok(Err(e)) => e,
                Ok(Ok(_)) => self.error("containerd ended the write stream early".into()),
                Err(e) => self.error(e.to_string()),
            },
            None => self.error("the write stream is gone".into()),
        }
    }
}

impl Drop for BlobWriter {
    fn drop(&mut self) {
        // An unfinished write: ending the call leaves an ingest, which the importer aborts
        // and the lease's deletion collects.
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

/// A tokio channel as the request stream tonic sends.
pub(super) struct ChanStream<T>(pub(super) mpsc::Receiver<T>);

impl<T> futures_core::Stream for ChanStream<T> {
    type Item = T;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T>> {
        self.0.poll_recv(cx)
    }
}

/// A time as RFC 3339 UTC (`2026-01-02T03:04:05Z`), the form containerd's `gc.expire` reads.
pub fn rfc3339(t: std::time::SystemTime) -> String {
    let secs = t
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil from days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    #[test]
    fn rfc3339_times() {
        assert_eq!(super::rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        assert_eq!(
            super::rfc3339(UNIX_EPOCH + Duration::from_secs(1_798_761_599)),
            "2026-12-31T23:59:59Z"
        );
        assert_eq!(
            super::rfc3339(UNIX_EPOCH + Duration::from_secs(951_782_400)),
            "2000-02-29T00:00:00Z"
        );
    }
}
