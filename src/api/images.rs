//! `POST /v1/images/load`: an image archive streamed in the request body into the importer
//! ([`crate::images`]). It has its own size limit (`images.max_archive_bytes`) instead of
//! [`super::MAX_BODY`], and a pace instead of the request deadline ([`Pace`]): a large
//! archive over a slow pipe takes as long as it takes, while a client that stops sending, or
//! trickles (holding the one import slot), is cut off.

use super::{ApiState, Reply};
use crate::images::{declare, Expected, ImageError, LoadOptions};
use bytes::{Buf, Bytes};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::Request;
use std::io::Read;
use std::time::Duration;
use tokio::sync::mpsc;

/// How long the rest of a refused upload is read, so the client gets the answer.
const DRAIN: Duration = Duration::from_secs(60);
/// Body frames queued ahead of the importer (a frame is at most hyper's read buffer).
const QUEUE: usize = 8;

/// Whether the query string asks for the override (`force=true` or `force=1`).
pub fn force(query: Option<&str>) -> bool {
    query
        .unwrap_or("")
        .split('&')
        .any(|kv| kv == "force=true" || kv == "force=1")
}

/// What the request says of its archive ahead of the body: the blobs of an `Edgehub-Blobs`
/// declaration (held to while streaming), else the `Content-Length`.
pub fn expected(
    headers: &hyper::HeaderMap,
    length: Option<u64>,
) -> Result<Expected, declare::DeclareError> {
    let values: Vec<&str> = headers
        .get_all(declare::HEADER)
        .iter()
        .map(|v| v.to_str().unwrap_or("\u{fffd}"))
        .collect();
    if !values.is_empty() {
        return Ok(Expected::Blobs {
            blobs: declare::parse(&values.join(","))?,
            enforce: true,
        });
    }
    Ok(length.map_or(Expected::Unknown, Expected::Length))
}

/// The pace an upload must keep: at least `min` bytes, and at least one, in every `window` of
/// time spent waiting on the client (time the importer keeps it waiting does not count, so a
/// slow import never cuts a fast client). Pure.
#[derive(Debug, Clone)]
pub struct Pace {
    window: Duration,
    min: u64,
    spent: Duration,
    bytes: u64,
}

impl Pace {
    pub fn new(window: Duration, min: u64) -> Pace {
        Pace {
            window,
            min,
            spent: Duration::ZERO,
            bytes: 0,
        }
    }

    /// How long the client may still take before the current window closes.
    pub fn left(&self) -> Duration {
        self.window.saturating_sub(self.spent)
    }

    /// Counts `waited` on the client and the `bytes` it sent then; `Err` says why it is cut
    /// when a window closed short.
    pub fn record(&mut self, waited: Duration, bytes: u64) -> Result<(), String> {
        self.spent += waited;
        self.bytes = self.bytes.saturating_add(bytes);
        if self.spent < self.window {
            return Ok(());
        }
        let (got, secs) = (self.bytes, self.window.as_secs());
        if got == 0 || got < self.min {
            return Err(format!(
                "the client sent {got} bytes in {secs} s, less than the {} KiB every {secs} s \
                 an upload must send (images.upload_min_kib, images.upload_window_secs)",
                self.min >> 10
            ));
        }
        self.spent = Duration::ZERO;
        self.bytes = 0;
        Ok(())
    }
}

/// The request body as the blocking importer reads it.
struct BodyReader {
    rx: mpsc::Receiver<std::io::Result<Bytes>>,
    cur: Bytes,
}

impl Read for BodyReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.cur.is_empty() {
            match self.rx.blocking_recv() {
                Some(Ok(b)) => self.cur = b,
                Some(Err(e)) => return Err(e),
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.cur.len());
        buf[..n].copy_from_slice(&self.cur[..n]);
        self.cur.advance(n);
        Ok(n)
    }
}

pub async fn load(
    state: &std::sync::Arc<ApiState>,
    req: Request<Incoming>,
    query: Option<&str>,
) -> Reply {
    let Some(importer) = state.images.clone() else {
        return Reply::text(
            503,
            "Image loads need the container runtime (containerd's socket)",
        );
    };
    let limit = importer.config.max_archive_bytes;
    let declared = req
        .headers()
        .get(hyper::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Reply::text(413, ImageError::TooLarge { limit }.to_string());
    }
    let expected = match expected(req.headers(), declared) {
        Ok(e) => e,
        Err(e) => return Reply::text(400, e.to_string()),
    };
    let opts = LoadOptions {
        force: force(query),
    };
    let (tx, rx) = mpsc::channel(QUEUE);
    let rt = tokio::runtime::Handle::current();
    let imp = importer.clone();
    let job = tokio::task::spawn_blocking(move || {
        imp.load_blocking(
            &rt,
            BodyReader {
                rx,
                cur: Bytes::new(),
            },
            expected,
            opts,
        )
    });
    let mut body = req.into_body();
    let (mut total, mut cut, mut stopped) = (0u64, None, false);
    let mut pace = Pace::new(
        importer.config.upload_window,
        importer.config.upload_min_bytes,
    );
    let idle = importer.config.upload_window;
    loop {
        let asked = tokio::time::Instant::now();
        let polled = tokio::time::timeout(pace.left(), body.frame()).await;
        let got = match &polled {
            Ok(Some(Ok(f))) => f.data_ref().map_or(0, |d| d.len() as u64),
            _ => 0,
        };
        if let Err(why) = pace.record(asked.elapsed(), got) {
            cut = Some(408);
            tracing::warn!(error = %why, "an image upload is cut off");
            let _ = tx
                .send(Err(std::io::Error::new(std::io::ErrorKind::TimedOut, why)))
                .await;
            break;
        }
        let frame = match polled {
            // The window closed with enough bytes: a new one starts.
            Err(_) => continue,
            Ok(None) => break,
            Ok(Some(Err(e))) => {
                let _ = tx
                    .send(Err(std::io::Error::other(format!(
                        "the upload broke off: {e}"
                    ))))
                    .await;
                break;
            }
            Ok(Some(Ok(f))) => f,
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        total += data.len() as u64;
        if total > limit {
            cut = Some(413);
            let _ = tx
                .send(Err(std::io::Error::other(
                    ImageError::TooLarge { limit }.to_string(),
                )))
                .await;
            break;
        }
        if tx.send(Ok(data)).await.is_err() {
            stopped = true; // The importer stopped reading: it has its answer.
            break;
        }
    }
    drop(tx);
    let result = job.await;
    if stopped {
        // The client is still sending: read the rest (bounded) so it gets the answer rather
        // than a connection reset mid-upload.
        let drain = async {
            while let Ok(Some(Ok(f))) = tokio::time::timeout(idle, body.frame()).await {
                total += f.data_ref().map_or(0, |d| d.len() as u64);
                if total > limit {
                    break;
                }
            }
        };
        let _ = tokio::time::timeout(DRAIN, drain).await;
    }
    match result {
        Ok(Ok(loaded)) => {
            if let Err(e) = importer.images_arrived().await {
                tracing::warn!(error = %e, "cannot tell which pods' images are all here now");
            }
            Reply::json(200, serde_json::to_string(&loaded).unwrap_or_default())
        }
        Ok(Err(e)) => {
            let status = match (cut, &e) {
                (Some(413), _) => {
                    return Reply::text(413, ImageError::TooLarge { limit }.to_string())
                }
                (Some(s), ImageError::Input(_)) => s,
                _ => e.http_status(),
            };
            Reply::text(status, format!("Image load failed: {e}"))
        }
        Err(e) => Reply::internal("Image load failed", &e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_declaration_wins_over_the_length() {
        let d = "sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
        let mut h = hyper::HeaderMap::new();
        assert_eq!(expected(&h, None), Ok(Expected::Unknown));
        assert_eq!(expected(&h, Some(9)), Ok(Expected::Length(9)));
        h.insert("Edgehub-Blobs", format!("{d}=3").parse().unwrap());
        h.append("edgehub-blobs", "4".parse().unwrap());
        let Ok(Expected::Blobs { blobs, enforce }) = expected(&h, Some(9)) else {
            panic!("{:?}", expected(&h, Some(9)));
        };
        assert!(enforce);
        assert_eq!(declare::format(&blobs), format!("{d}=3,4"));
        h.insert("edgehub-blobs", "x".parse().unwrap());
        assert!(expected(&h, None).is_err());
    }

    /// Issue 31: a byte a second keeps under any idle timeout, not under a pace.
    #[test]
    fn a_trickle_is_cut_at_the_end_of_its_window_and_a_steady_client_is_not() {
        let s = Duration::from_secs;
        let mut p = Pace::new(s(60), 1 << 20);
        for _ in 0..59 {
            assert!(p.record(s(1), 1).is_ok());
        }
        assert_eq!(p.left(), s(1));
        let e = p.record(s(1), 1).unwrap_err();
        assert!(
            e.contains("60 bytes in 60 s") && e.contains("1024 KiB"),
            "{e}"
        );
        // 64 KiB a second: a new window each minute, for as long as it takes.
        let mut p = Pace::new(s(60), 1 << 20);
        for _ in 0..600 {
            assert!(p.record(s(1), 64 << 10).is_ok());
        }
        // Nothing at all for a window: cut, even with no minimum.
        let mut p = Pace::new(s(60), 0);
        assert!(p.record(s(30), 1).is_ok());
        assert!(p.record(s(30), 0).is_ok(), "a byte in the window is enough");
        assert!(p.record(s(60), 0).is_err());
        // A window that closed with enough bytes while waiting: a new one starts.
        let mut p = Pace::new(s(10), 100);
        assert!(p.record(s(2), 100).is_ok());
        assert!(p.record(p.left(), 0).is_ok());
        assert_eq!(p.left(), s(10));
    }

    #[test]
    fn the_override_is_explicit() {
        assert!(super::force(Some("force=true")));
        assert!(super::force(Some("a=b&force=1")));
        assert!(!super::force(Some("force=false")));
        assert!(!super::force(Some("forced=true")));
        assert!(!super::force(None));
    }
}
