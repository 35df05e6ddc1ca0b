//! `edgehub images load FILE|-`: an image archive streamed to `POST /v1/images/load`, read
//! a chunk at a time (a file with its length and its blobs declared, stdin chunked), never
//! whole.

use super::{Answer, ClientError, LocalClient, Target};
use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use std::io::Read;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::sync::mpsc;

/// Bytes read from the archive per body frame.
const CHUNK: usize = 256 << 10;

type Chunk = Result<Frame<Bytes>, std::io::Error>;

struct Chunks(mpsc::Receiver<Chunk>);

impl futures_core::Stream for Chunks {
    type Item = Chunk;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Chunk>> {
        self.0.poll_recv(cx)
    }
}

impl LocalClient {
    /// POSTs `reader` (of `len` bytes when known) to `path`, with `headers` added, and
    /// returns the answer. The client's timeout covers connecting only: an archive takes as
    /// long as it takes.
    pub fn upload(
        &self,
        path: &str,
        mut reader: Box<dyn Read + Send>,
        len: Option<u64>,
        headers: &[(&str, String)],
    ) -> Result<Answer, ClientError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .map_err(|e| self.http(format!("cannot start a runtime: {e}")))?;
        rt.block_on(async {
            let (tx, rx) = mpsc::channel::<Chunk>(4);
            let feeder = tokio::task::spawn_blocking(move || loop {
                let mut buf = vec![0u8; CHUNK];
                match reader.read(&mut buf) {
                    Ok(0) => return,
                    Ok(n) => {
                        buf.truncate(n);
                        if tx.blocking_send(Ok(Frame::data(Bytes::from(buf)))).is_err() {
                            return; // The server answered before reading it all.
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        let _ = tx.blocking_send(Err(e));
                        return;
                    }
                }
            });
            let connect = |e: std::io::Error| ClientError::Connect {
                addr: self.target.clone(),
                reason: e.to_string(),
            };
            let io: Box<dyn IoStream> = match &self.target {
                Target::Tcp(a) => Box::new(
                    tokio::time::timeout(self.timeout, tokio::net::TcpStream::connect(a))
                        .await
                        .map_err(|_| self.http(format!("no connection within {:?}", self.timeout)))?
                        .map_err(connect)?,
                ),
                Target::Unix(p) => {
                    Box::new(tokio::net::UnixStream::connect(p).await.map_err(connect)?)
                }
            };
            let host = match &self.target {
                Target::Tcp(a) => a.to_string(),
                Target::Unix(_) => "localhost".to_string(),
            };
            let (mut send, conn) =
                hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(io))
                    .await
                    .map_err(|e| self.http(e.to_string()))?;
            tokio::spawn(conn);
            let mut req = hyper::Request::builder()
                .method("POST")
                .uri(path)
                .header(hyper::header::HOST, host)
                .header(hyper::header::CONTENT_TYPE, "application/x-tar");
            if let Some(n) = len {
                req = req.header(hyper::header::CONTENT_LENGTH, n);
            }
            if let Some(t) = &self.token {
                req = req.header(hyper::header::AUTHORIZATION, format!("Bearer {t}"));
            }
            for (k, v) in headers {
                req = req.header(*k, v.as_str());
            }
            let req = req
                .body(StreamBody::new(Chunks(rx)))
                .map_err(|e| self.http(e.to_string()))?;
            let resp = send
                .send_request(req)
                .await
                .map_err(|e| self.http(e.to_string()))?;
            let status = resp.status().as_u16();
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| self.http(e.to_string()))?
                .to_bytes();
            feeder.abort();
            Ok(Answer {
                status,
                body: String::from_utf8_lossy(&body).into_owned(),
            })
        })
    }
}

trait IoStream: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> IoStream for T {}
