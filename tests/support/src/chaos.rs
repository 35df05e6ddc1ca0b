//! A TCP fault proxy: put between edgehub and the fake apiserver, it passes bytes through
//! (TLS and all) or misbehaves the way a vehicle's link does. Switching the fault applies to
//! new connections and to the open ones alike.

use std::net::SocketAddr;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What the link does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Bytes flow both ways.
    Pass,
    /// Connections are closed as soon as they open (a FIN), open ones too.
    Drop,
    /// Connections open but nothing flows either way (a blackholed link); open ones freeze.
    Stall,
    /// Every connection is reset (an RST), open ones too.
    Reset,
}

/// The proxy; it stops when dropped.
pub struct ChaosProxy {
    pub addr: SocketAddr,
    fault: watch::Sender<Fault>,
    task: tokio::task::JoinHandle<()>,
}

impl ChaosProxy {
    /// Listens on a free local port and forwards to `upstream`.
    pub async fn start(upstream: SocketAddr) -> anyhow::Result<ChaosProxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (fault, rx) = watch::channel(Fault::Pass);
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(serve(client, upstream, rx.clone()));
            }
        });
        Ok(ChaosProxy { addr, fault, task })
    }

    pub fn set(&self, f: Fault) {
        self.fault.send_replace(f);
    }

    pub fn fault(&self) -> Fault {
        *self.fault.borrow()
    }

    /// `https://` URL of the proxy, for a kubeconfig.
    pub fn url(&self) -> String {
        format!("https://{}", self.addr)
    }
}

impl Drop for ChaosProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A zero linger makes the close send an RST. (tokio deprecates `set_linger` because a
/// non-zero linger blocks the thread on drop; a zero one does not.)
#[allow(deprecated)]
fn reset(s: &TcpStream) {
    let _ = s.set_linger(Some(Duration::ZERO));
}

async fn serve(client: TcpStream, upstream: SocketAddr, mut fault: watch::Receiver<Fault>) {
    // A connection opened while stalled waits to learn its fate.
    loop {
        let f = *fault.borrow_and_update();
        match f {
            Fault::Pass => break,
            Fault::Drop => return,
            Fault::Reset => return reset(&client),
            Fault::Stall => {
                if fault.changed().await.is_err() {
                    return;
                }
            }
        }
    }
    let Ok(up) = TcpStream::connect(upstream).await else {
        return reset(&client);
    };
    pipe(client, up, fault).await;
}

async fn pipe(mut c: TcpStream, mut u: TcpStream, mut fault: watch::Receiver<Fault>) {
    let mut from_c = vec![0u8; 16 * 1024];
    let mut from_u = vec![0u8; 16 * 1024];
    loop {
        let f = *fault.borrow_and_update();
        match f {
            Fault::Pass => {}
            Fault::Drop => return,
            Fault::Reset => {
                reset(&c);
                reset(&u);
                return;
            }
            Fault::Stall => {
                if fault.changed().await.is_err() {
                    return;
                }
                continue;
            }
        }
        tokio::select! {
            r = c.read(&mut from_c) => match r {
                Ok(0) | Err(_) => return,
                Ok(n) => if u.write_all(&from_c[..n]).await.is_err() { return },
            },
            r = u.read(&mut from_u) => match r {
                Ok(0) | Err(_) => return,
                Ok(n) => if c.write_all(&from_u[..n]).await.is_err() { return },
            },
            r = fault.changed() => if r.is_err() { return },
        }
    }
}
