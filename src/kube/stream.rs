//! A running watch: the response body cut into events as it arrives, with an idle deadline.

use super::error::{KubeError, Request};
use super::watch::{parse_event, Frame, LineFramer, WatchEvent};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use std::collections::VecDeque;
use std::time::Duration;

/// A running watch, read event by event.
pub struct WatchStream {
    pub(super) body: Incoming,
    pub(super) framer: LineFramer,
    pub(super) pending: VecDeque<Frame>,
    pub(super) idle: Duration,
    pub(super) request: Request,
    pub(super) ended: bool,
}

impl WatchStream {
    /// The next event; `Ok(None)` when the server ended the watch cleanly (its timeout).
    /// A connection cut in the middle of an event is an error, and that partial event is
    /// discarded: watching again from the last resourceVersion replays it.
    pub async fn next(&mut self) -> Result<Option<WatchEvent>, KubeError> {
        loop {
            if let Some(frame) = self.pending.pop_front() {
                return Ok(Some(match frame {
                    Frame::Line(l) => parse_event(&l),
                    Frame::Oversized { bytes } => WatchEvent::Malformed {
                        reason: format!("event of {bytes} bytes is over the size cap; dropped"),
                    },
                }));
            }
            if self.ended {
                return Ok(None);
            }
            let frame = match tokio::time::timeout(self.idle, self.body.frame()).await {
                Err(_) => {
                    return Err(KubeError::Timeout {
                        request: self.request.clone(),
                        timeout: self.idle,
                    })
                }
                Ok(f) => f,
            };
            match frame {
                None => {
                    self.ended = true;
                    let cut = self.framer.pending();
                    if cut > 0 {
                        return Err(KubeError::Stream {
                            request: self.request.clone(),
                            reason: format!(
                                "watch stream ended in the middle of an event ({cut} bytes)"
                            ),
                        });
                    }
                }
                Some(Err(e)) => {
                    self.ended = true;
                    return Err(KubeError::Stream {
                        request: self.request.clone(),
                        reason: format!("watch connection lost: {e}"),
                    });
                }
                Some(Ok(f)) => {
                    if let Some(d) = f.data_ref() {
                        self.pending.extend(self.framer.push(d));
                    }
                }
            }
        }
    }
}
