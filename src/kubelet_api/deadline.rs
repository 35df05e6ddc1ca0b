//! A connection whose writes fail once they have made no progress for a time. hyper has no
//! write timeout: a client that stops reading an answer (`kubectl logs -f`, then Ctrl-Z)
//! would hold its connection, and its place among the node API's connections, for ever.
//! Under TLS, this wrapper turns such a stall into an error, and hyper closes the
//! connection. Only a write that moves bytes counts as progress; a flush of a socket is no
//! proof that the peer read anything.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// `io`, its writes failing with `TimedOut` after `limit` without progress.
#[derive(Debug)]
pub struct WriteDeadline<IO> {
    io: IO,
    limit: Duration,
    /// Armed when a write could not go on; disarmed when one moves bytes.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl<IO> WriteDeadline<IO> {
    pub fn new(io: IO, limit: Duration) -> WriteDeadline<IO> {
        WriteDeadline {
            io,
            limit,
            stalled: None,
        }
    }

    /// A write that could not go on: an error once the stall has lasted `limit`.
    fn waiting<T>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        let limit = self.limit;
        let timer = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the peer read nothing for {limit:?}"),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn wrote(
        &mut self,
        r: Poll<io::Result<usize>>,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<usize>> {
        match r {
            Poll::Ready(Ok(n)) if n > 0 => {
                self.stalled = None;
                Poll::Ready(Ok(n))
            }
            Poll::Ready(r) => Poll::Ready(r),
            Poll::Pending => self.waiting(cx),
        }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for WriteDeadline<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for WriteDeadline<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write(cx, buf);
        self.wrote(r, cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.wrote(r, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match Pin::new(&mut self.io).poll_flush(cx) {
            Poll::Pending => self.waiting(cx),
            r => r,
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match Pin::new(&mut self.io).poll_shutdown(cx) {
            Poll::Pending => self.waiting(cx),
            r => r,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn a_peer_that_reads_nothing_fails_the_write_after_the_limit() {
        let (ours, mut theirs) = tokio::io::duplex(64);
        let mut w = WriteDeadline::new(ours, Duration::from_millis(300));
        let started = tokio::time::Instant::now();
        let err = tokio::time::timeout(Duration::from_secs(20), async {
            loop {
                if let Err(e) = w.write_all(&[b'x'; 16]).await {
                    return e;
                }
            }
        })
        .await
        .expect("the write fails");
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(started.elapsed() >= Duration::from_millis(300));
        // What was written before is there to read.
        let mut got = [0u8; 64];
        theirs.read_exact(&mut got).await.unwrap();
    }

    #[tokio::test]
    async fn a_slow_reader_that_keeps_reading_is_no_stall() {
        let (ours, mut theirs) = tokio::io::duplex(64);
        let mut w = WriteDeadline::new(ours, Duration::from_millis(300));
        let reader = tokio::spawn(async move {
            let mut got = 0usize;
            let mut buf = [0u8; 16];
            while got < 1024 {
                tokio::time::sleep(Duration::from_millis(20)).await;
                got += theirs.read(&mut buf).await.unwrap();
            }
            got
        });
        // 1 KiB through a 64-byte pipe read 16 bytes each 20 ms: more than a second in all,
        // each write waiting far less than the limit.
        for _ in 0..64 {
            w.write_all(&[b'y'; 16]).await.unwrap();
        }
        w.flush().await.unwrap();
        assert_eq!(reader.await.unwrap(), 1024);
    }
}
