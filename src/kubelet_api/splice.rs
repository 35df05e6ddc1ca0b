//! Two upgraded connections joined both ways, closed after an idle time with no bytes in
//! either direction. An end that closes its sending side has that passed on (a half close),
//! and the other direction goes on until it closes too.

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

/// Copies `a` to `b` and `b` to `a` until both have closed, one fails, or nothing moved
/// either way for `idle`.
pub async fn splice<A, B>(a: A, b: B, idle: Duration) -> Ended
where
    A: AsyncRead + AsyncWrite + Unpin,
    B: AsyncRead + AsyncWrite + Unpin,
{
    let (mut ar, mut aw) = tokio::io::split(a);
    let (mut br, mut bw) = tokio::io::split(b);
    let (mut abuf, mut bbuf) = (vec![0u8; BUF], vec![0u8; BUF]);
    let (mut a_open, mut b_open) = (true, true);
    let mut end = Ended {
        a_to_b: 0,
        b_to_a: 0,
        idle: false,
    };
    let timer = tokio::time::sleep(idle);
    tokio::pin!(timer);
    while a_open || b_open {
        tokio::select! {
            r = ar.read(&mut abuf), if a_open => match r {
                Ok(0) | Err(_) => {
                    a_open = false;
                    let _ = bw.shutdown().await;
                }
                Ok(n) => {
                    if bw.write_all(&abuf[..n]).await.is_err() || bw.flush().await.is_err() {
                        break;
                    }
                    end.a_to_b += n as u64;
                    timer.as_mut().reset(tokio::time::Instant::now() + idle);
                }
            },
            r = br.read(&mut bbuf), if b_open => match r {
                Ok(0) | Err(_) => {
                    b_open = false;
                    let _ = aw.shutdown().await;
                }
                Ok(n) => {
                    if aw.write_all(&bbuf[..n]).await.is_err() || aw.flush().await.is_err() {
                        break;
                    }
                    end.b_to_a += n as u64;
                    timer.as_mut().reset(tokio::time::Instant::now() + idle);
                }
            },
            _ = &mut timer => {
                end.idle = true;
                break;
            }
        }
    }
    let _ = aw.shutdown().await;
    let _ = bw.shutdown().await;
    end
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn bytes_go_both_ways_and_a_half_close_is_passed_on() {
        let (client, a) = tokio::io::duplex(64);
        let (b, runtime) = tokio::io::duplex(64);
        let task = tokio::spawn(splice(a, b, Duration::from_secs(10)));
        let (mut cr, mut cw) = tokio::io::split(client);
        let (mut rr, mut rw) = tokio::io::split(runtime);
        cw.write_all(b"ping").await.unwrap();
        let mut got = [0u8; 4];
        rr.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ping");
        // The client is done sending: the runtime sees the end, and still answers.
        cw.shutdown().await.unwrap();
        let mut rest = Vec::new();
        rr.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty());
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
