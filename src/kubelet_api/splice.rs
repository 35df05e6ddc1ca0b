//! Two upgraded connections joined both ways, as the kubelet's upgrade-aware proxy joins
//! them: when either end closes (or fails), its close is passed on and both are closed; and
//! after an idle time with no bytes in either direction, both are closed too.

use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// How a splice ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ended {
    /// Bytes from `a` to `b`.
    pub a_to_b: u64,
    /// Bytes from `b` to `a`.
    pub b_to_a: u64,
    /// Closed for being idle (rather than by an end).
    pub idle: bool,
}

const BUF: usize = 16 << 10;
/// How long closing both ends may take.
const CLOSING: Duration = Duration::from_secs(5);

enum Step {
    /// Bytes went across.
    Moved,
    /// The reading side closed, or the writing side failed: the splice is over.
    Over,
}

/// Passes one read's outcome (`r` bytes of `buf`) on to `w`.
async fn pass<W: AsyncWrite + Unpin>(
    r: std::io::Result<usize>,
    buf: &[u8],
    w: &mut W,
    moved: &mut u64,
) -> Step {
    match r {
        Ok(0) | Err(_) => Step::Over,
        Ok(n) => {
            if w.write_all(&buf[..n]).await.is_err() || w.flush().await.is_err() {
                return Step::Over;
            }
            *moved += n as u64;
            Step::Moved
        }
    }
}

/// Copies `a` to `b` and `b` to `a` until one closes or fails, or nothing moved either way
/// for `idle`; then closes both.
pub async fn splice<A, B>(a: A, b: B, idle: Duration) -> Ended
where
    A: AsyncRead + AsyncWrite + Unpin,
    B: AsyncRead + AsyncWrite + Unpin,
{
    let (mut ar, mut aw) = tokio::io::split(a);
    let (mut br, mut bw) = tokio::io::split(b);
    let (mut abuf, mut bbuf) = (vec![0u8; BUF], vec![0u8; BUF]);
    let mut end = Ended {
        a_to_b: 0,
        b_to_a: 0,
        idle: false,
    };
    let timer = tokio::time::sleep(idle);
    tokio::pin!(timer);
    loop {
        let step = tokio::select! {
            r = ar.read(&mut abuf) => pass(r, &abuf, &mut bw, &mut end.a_to_b).await,
            r = br.read(&mut bbuf) => pass(r, &bbuf, &mut aw, &mut end.b_to_a).await,
            _ = &mut timer => {
                end.idle = true;
                break;
            }
        };
        match step {
            Step::Moved => timer.as_mut().reset(tokio::time::Instant::now() + idle),
            Step::Over => break,
        }
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
                idle: false
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
}
