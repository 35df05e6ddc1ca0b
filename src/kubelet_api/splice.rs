//! Two upgraded connections joined both ways, as the kubelet's upgrade-aware proxy joins
//! them: when either end closes (or fails), its close is passed on and both are closed; after
//! an idle time with no bytes in either direction both are closed too, and so they are when
//! one write makes no progress for that long (an end that stopped reading).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::time::Instant;

/// How a splice ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ended {
    /// Bytes from `a` to `b`.
    pub a_to_b: u64,
    /// Bytes from `b` to `a`.
    pub b_to_a: u64,
    /// Closed for being idle (rather than by an end).
    pub idle: bool,
    /// Closed because an end took nothing of a write for the idle time.
    pub stalled: bool,
}

const BUF: usize = 16 << 10;
/// How long closing both ends may take.
const CLOSING: Duration = Duration::from_secs(5);

/// Why one direction stopped.
enum Stop {
    /// The reading side closed, or the writing side failed.
    Closed,
    /// A write took nothing for the idle time.
    Stalled,
}

/// When bytes last moved, either way (nanoseconds after the splice began), and how many
/// writes wait for their end to take them.
struct Progress {
    began: Instant,
    last: AtomicU64,
    writing: AtomicUsize,
}

impl Progress {
    fn mark(&self) {
        let at = u64::try_from(self.began.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.last.store(at, Ordering::Relaxed);
    }

    fn idle_from(&self, idle: Duration) -> Instant {
        self.began + Duration::from_nanos(self.last.load(Ordering::Relaxed)) + idle
    }
}

/// Copies `r` to `w` until `r` closes or fails, `w` fails, or one write (or flush) makes
/// no progress for `idle`.
async fn copy<R, W>(
    r: &mut R,
    w: &mut W,
    moved: &mut u64,
    progress: &Progress,
    idle: Duration,
) -> Stop
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; BUF];
    loop {
        let n = match r.read(&mut buf).await {
            Ok(0) | Err(_) => return Stop::Closed,
            Ok(n) => n,
        };
        progress.mark();
        progress.writing.fetch_add(1, Ordering::Relaxed);
        let passed = pass(&buf[..n], w, moved, progress, idle).await;
        progress.writing.fetch_sub(1, Ordering::Relaxed);
        if let Some(stop) = passed {
            return stop;
        }
    }
}

/// Writes `bytes` to `w` and flushes; `None` when all of it went, else why not.
async fn pass<W: AsyncWrite + Unpin>(
    bytes: &[u8],
    w: &mut W,
    moved: &mut u64,
    progress: &Progress,
    idle: Duration,
) -> Option<Stop> {
    let mut done = 0;
    while done < bytes.len() {
        match tokio::time::timeout(idle, w.write(&bytes[done..])).await {
            Err(_) => return Some(Stop::Stalled),
            Ok(Ok(0) | Err(_)) => return Some(Stop::Closed),
            Ok(Ok(k)) => {
                done += k;
                *moved += k as u64;
                progress.mark();
            }
        }
    }
    match tokio::time::timeout(idle, w.flush()).await {
        Err(_) => Some(Stop::Stalled),
        Ok(Err(_)) => Some(Stop::Closed),
        Ok(Ok(())) => None,
    }
}

/// Copies `a` to `b` and `b` to `a` until one closes or fails, nothing moved either way for
/// `idle`, or one write made no progress for `idle`; then closes both. Both directions run
/// at once, so a write blocked on one end never keeps the other direction or the timers
/// waiting.
pub async fn splice<A, B>(a: A, b: B, idle: Duration) -> Ended
where
    A: AsyncRead + AsyncWrite + Unpin,
    B: AsyncRead + AsyncWrite + Unpin,
{
    let (mut ar, mut aw) = tokio::io::split(a);
    let (mut br, mut bw) = tokio::io::split(b);
    let mut end = Ended {
        a_to_b: 0,
        b_to_a: 0,
        idle: false,
        stalled: false,
    };
    let progress = Progress {
        began: Instant::now(),
        last: AtomicU64::new(0),
        writing: AtomicUsize::new(0),
    };
    let quiet = async {
        loop {
            let until = progress.idle_from(idle);
            if Instant::now() >= until {
                return;
            }
            tokio::time::sleep_until(until).await;
        }
    };
    let stop = tokio::select! {
        s = copy(&mut ar, &mut bw, &mut end.a_to_b, &progress, idle) => Some(s),
        s = copy(&mut br, &mut aw, &mut end.b_to_a, &progress, idle) => Some(s),
        _ = quiet => None,
    };
    match stop {
        // Nothing moved for the idle time while a write waited: that end stopped reading.
        None if progress.writing.load(Ordering::Relaxed) > 0 => end.stalled = true,
        None => end.idle = true,
        Some(Stop::Stalled) => end.stalled = true,
        Some(Stop::Closed) => {}
    }
    // A peer that reads nothing more must not hold the splice open.
    let _ = tokio::time::timeout(CLOSING, async {
        let _ = aw.shutdown().await;
        let _ = bw.shutdown().await;
    })
    .await;
    end
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn bytes_go_both_ways_until_one_end_closes() {
        let (client, a) = tokio::io::duplex(64);
        let (b, runtime) = tokio::io::duplex(64);
        let task = tokio::spawn(splice(a, b, Duration::from_secs(10)));
        let (mut cr, mut cw) = tokio::io::split(client);
        let (mut rr, mut rw) = tokio::io::split(runtime);
        cw.write_all(b"ping").await.unwrap();
        let mut got = [0u8; 4];
        rr.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ping");
        // The runtime answers and closes: the client gets all of it, then the end, and the
        // client's side is closed too.
        rw.write_all(b"pong!").await.unwrap();
        rw.shutdown().await.unwrap();
        let mut back = Vec::new();
        cr.read_to_end(&mut back).await.unwrap();
        assert_eq!(back, b"pong!");
        let end = task.await.unwrap();
        assert_eq!(
            end,
            Ended {
                a_to_b: 4,
                b_to_a: 5,
                idle: false,
                stalled: false,
            }
        );
        let mut rest = Vec::new();
        rr.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty());
    }

    #[tokio::test]
    async fn a_splice_with_nothing_moving_is_closed() {
        let (client, a) = tokio::io::duplex(64);
        let (b, runtime) = tokio::io::duplex(64);
        let task = tokio::spawn(splice(a, b, Duration::from_millis(200)));
        let (mut cr, mut cw) = tokio::io::split(client);
        let (mut rr, _rw) = tokio::io::split(runtime);
        // Traffic keeps it open past the idle time...
        for _ in 0..4 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            cw.write_all(b"x").await.unwrap();
            let mut one = [0u8; 1];
            rr.read_exact(&mut one).await.unwrap();
        }
        assert!(!task.is_finished());
        // ...silence closes it, and both ends see it closed.
        let end = task.await.unwrap();
        assert_eq!((end.a_to_b, end.idle), (4, true));
        let mut rest = Vec::new();
        cr.read_to_end(&mut rest).await.unwrap();
        rr.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty());
    }

    /// Issue 31: a client that stops reading while the runtime keeps writing (`kubectl exec`
    /// of a chatty command, then Ctrl-Z) blocked the splice in a write, where its idle timer
    /// was not polled: the session, and its stream slot, lasted for ever. A write that makes
    /// no progress for the idle time ends it.
    #[tokio::test]
    async fn a_client_that_stops_reading_ends_the_splice_after_the_idle_time() {
        let (client, a) = tokio::io::duplex(64);
        let (b, runtime) = tokio::io::duplex(64);
        let task = tokio::spawn(splice(a, b, Duration::from_millis(300)));
        let (_cr, _cw) = tokio::io::split(client);
        let (_rr, mut rw) = tokio::io::split(runtime);
        // The runtime writes all the time; the client reads nothing.
        let writer = tokio::spawn(async move {
            loop {
                if rw.write_all(&[b'x'; 32]).await.is_err() {
                    return;
                }
            }
        });
        let end = tokio::time::timeout(Duration::from_secs(20), task).await;
        writer.abort();
        let end = end.expect("the splice still waits on its client").unwrap();
        assert!(end.stalled && !end.idle, "{end:?}");
        assert!(end.b_to_a >= 64, "{end:?}");
    }

    /// Bytes going the other way (a client typing into its session) do not keep a write to
    /// a client that reads nothing waiting for ever.
    #[tokio::test]
    async fn traffic_the_other_way_does_not_keep_a_stalled_write() {
        let (client, a) = tokio::io::duplex(64);
        let (b, runtime) = tokio::io::duplex(64);
        let task = tokio::spawn(splice(a, b, Duration::from_millis(300)));
        let (_cr, mut cw) = tokio::io::split(client);
        let (mut rr, mut rw) = tokio::io::split(runtime);
        let typing = tokio::spawn(async move {
            while cw.write_all(b"k").await.is_ok() {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
        let reading = tokio::spawn(async move {
            let mut one = [0u8; 1];
            while rr.read_exact(&mut one).await.is_ok() {}
        });
        let writing = tokio::spawn(async move { while rw.write_all(&[b'x'; 32]).await.is_ok() {} });
        let end = tokio::time::timeout(Duration::from_secs(20), task).await;
        for t in [typing, reading, writing] {
            t.abort();
        }
        let end = end.expect("the splice still waits on its client").unwrap();
        assert!(end.stalled && end.a_to_b > 0, "{end:?}");
    }
}
