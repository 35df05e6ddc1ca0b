//! A unix-socket proxy in front of the real containerd, for tests where the runtime goes away
//! and comes back: [`CriProxy::cut`] closes every connection and refuses new ones (as a dead
//! containerd's socket does), [`CriProxy::restore`] serves again.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use tokio::net::{UnixListener, UnixStream};
use tokio::task::JoinHandle;

pub struct CriProxy {
    pub path: PathBuf,
    target: PathBuf,
    accept: Option<JoinHandle<()>>,
    conns: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl CriProxy {
    /// Listens on `path` and forwards every connection to the socket `target`.
    pub fn start(target: &Path, path: &Path) -> CriProxy {
        let mut p = CriProxy {
            path: path.to_path_buf(),
            target: target.to_path_buf(),
            accept: None,
            conns: Arc::new(Mutex::new(Vec::new())),
        };
        p.restore();
        p
    }

    /// Serves again after a cut.
    pub fn restore(&mut self) {
        if self.accept.is_some() {
            return;
        }
        let _ = std::fs::remove_file(&self.path);
        let listener = UnixListener::bind(&self.path).expect("bind the CRI proxy socket");
        let target = self.target.clone();
        let conns = self.conns.clone();
        self.accept = Some(tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let target = target.clone();
                let task = tokio::spawn(async move {
                    if let Ok(mut upstream) = UnixStream::connect(&target).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
                    }
                });
                conns.lock().unwrap().push(task);
            }
        }));
    }

    /// Drops every connection; new ones are refused until [`CriProxy::restore`].
    pub fn cut(&mut self) {
        if let Some(a) = self.accept.take() {
            a.abort();
        }
        for c in self.conns.lock().unwrap().drain(..) {
            c.abort();
        }
        // The socket file stays with nobody listening: connect(2) answers ECONNREFUSED.
    }
}

impl Drop for CriProxy {
    fn drop(&mut self) {
        self.cut();
        let _ = std::fs::remove_file(&self.path);
    }
}
