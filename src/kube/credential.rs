//! The credential an [`ApiClient`](super::ApiClient) sends, shared by all its clones and
//! swapped in place: a rotated client certificate takes effect on the next request, with no
//! restart and no new client, so the reflectors' watches resume from their cursors.

use super::kubeconfig::TokenSource;
use bytes::Bytes;
use http_body_util::Full;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use std::sync::{Arc, Mutex};

/// One credential: the connection pool whose TLS config presents it, and its bearer token.
pub(super) struct Transport {
    pub http: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    pub token: Option<TokenSource>,
    pub generation: u64,
}

/// What the credential in use has met, for the identity task.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CredentialState {
    /// Bumped at each swap.
    pub generation: u64,
    /// A request with this generation got an answer other than 401.
    pub worked: bool,
    /// 401s answered to requests made with this generation since one last worked.
    pub unauthorized: u64,
}

enum Slot {
    Ready(Arc<Transport>),
    /// No usable credential; requests fail as offline with this reason.
    Empty(String),
}

struct Inner {
    slot: Slot,
    state: CredentialState,
}

#[derive(Clone)]
pub(super) struct Shared(Arc<Mutex<Inner>>);

impl Shared {
    pub fn new(
        http: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
        token: Option<TokenSource>,
    ) -> Shared {
        Shared(Arc::new(Mutex::new(Inner {
            slot: Slot::Ready(Arc::new(Transport {
                http,
                token,
                generation: 0,
            })),
            state: CredentialState::default(),
        })))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A poisoned lock only means a panic elsewhere mid-swap; the slot is still whole.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn current(&self) -> Result<Arc<Transport>, String> {
        match &self.lock().slot {
            Slot::Ready(t) => Ok(t.clone()),
            Slot::Empty(reason) => Err(reason.clone()),
        }
    }

    pub fn set(
        &self,
        http: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
        token: Option<TokenSource>,
    ) {
        let mut g = self.lock();
        let generation = g.state.generation + 1;
        g.state = CredentialState {
            generation,
            ..Default::default()
        };
        g.slot = Slot::Ready(Arc::new(Transport {
            http,
            token,
            generation,
        }));
    }

    pub fn clear(&self, reason: &str) {
        let mut g = self.lock();
        let generation = g.state.generation + 1;
        g.state = CredentialState {
            generation,
            ..Default::default()
        };
        g.slot = Slot::Empty(reason.to_string());
    }

    pub fn worked(&self, generation: u64) {
        let mut g = self.lock();
        if g.state.generation == generation {
            g.state.worked = true;
            g.state.unauthorized = 0;
        }
    }

    pub fn unauthorized(&self, generation: u64) {
        let mut g = self.lock();
        if g.state.generation == generation {
            g.state.unauthorized += 1;
        }
    }

    pub fn state(&self) -> CredentialState {
        self.lock().state
    }
}
