//! Whether the apiserver is reachable: a small value the sync's reflectors write and the
//! workers and surfaces read (the outbox waits for `Online`, the API and the Node report it),
//! over a `tokio::sync::watch` channel. A foundation, so none of its readers depends on sync.

use std::sync::Arc;
use tokio::sync::watch;

/// Whether the apiserver is reachable, as last seen by any reflector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkState {
    /// Nothing tried yet.
    Unknown,
    Online,
    Offline {
        reason: String,
    },
}

/// The writing side of the link state, shared by the reflectors (and anything else that
/// talks to the apiserver and learns whether it is reachable).
#[derive(Debug, Clone)]
pub struct LinkReporter(Arc<watch::Sender<LinkState>>);

impl LinkReporter {
    pub fn new() -> (LinkReporter, watch::Receiver<LinkState>) {
        let (tx, rx) = watch::channel(LinkState::Unknown);
        (LinkReporter(Arc::new(tx)), rx)
    }

    /// Sets the state; a receiver wakes only when it changed.
    pub fn set(&self, state: LinkState) {
        self.0.send_if_modified(|cur| {
            if *cur == state {
                return false;
            }
            // Said once per transition: while the link stays down, the reason may change with
            // each reflector's retry, and the log would repeat it several times a second.
            let was_down = matches!(cur, LinkState::Offline { .. });
            match &state {
                LinkState::Online => tracing::info!("apiserver link is up"),
                LinkState::Offline { reason } if !was_down => {
                    tracing::warn!(%reason, "apiserver link is down")
                }
                LinkState::Offline { .. } | LinkState::Unknown => {}
            }
            *cur = state;
            true
        });
    }

    pub fn online(&self) {
        self.set(LinkState::Online);
    }

    pub fn offline(&self, reason: String) {
        self.set(LinkState::Offline { reason });
    }
}
