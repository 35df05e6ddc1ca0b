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
    /// The apiserver was reached but the TLS handshake failed (an unknown CA, a client
    /// certificate refused, a server that does not speak TLS): `reason` names what failed.
    /// Replaced by the next failure's reason, cleared by the next request that succeeds.
    TlsFailed {
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
            let was_tls = matches!(cur, LinkState::TlsFailed { .. });
            match &state {
                LinkState::Online => tracing::info!("apiserver link is up"),
                LinkState::Offline { reason } if !was_down => {
                    tracing::warn!(%reason, "apiserver link is down")
                }
                LinkState::TlsFailed { reason } if !was_tls => {
                    tracing::warn!(%reason, "TLS with the apiserver failed")
                }
                LinkState::Offline { .. } | LinkState::TlsFailed { .. } | LinkState::Unknown => {}
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

    /// The last TLS failure; a different reason replaces it.
    pub fn tls_failed(&self, reason: String) {
        self.set(LinkState::TlsFailed { reason });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_failure_is_kept_current_and_cleared() {
        let (r, rx) = LinkReporter::new();
        r.tls_failed("unknown CA".into());
        assert_eq!(
            *rx.borrow(),
            LinkState::TlsFailed {
                reason: "unknown CA".into()
            }
        );
        r.tls_failed("does not speak TLS".into());
        assert_eq!(
            *rx.borrow(),
            LinkState::TlsFailed {
                reason: "does not speak TLS".into()
            }
        );
        r.online();
        assert_eq!(*rx.borrow(), LinkState::Online);
    }
}
