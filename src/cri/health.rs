//! Whether the container runtime answers, watched in the background: edgehub keeps serving
//! its API while the CRI socket is missing or dead, retries with backoff, and `readyz` and the
//! Node's Ready condition say why.

use super::{CriError, CriRuntime};
use crate::backoff::Backoff;
use std::time::Duration;
use tokio::sync::watch;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CriHealth {
    /// Not checked yet.
    Unknown,
    /// Answered Version with CRI v1; `version` is `containerd://1.6.20`.
    Ready {
        version: String,
    },
    Unavailable {
        reason: String,
    },
}

impl CriHealth {
    pub fn version(&self) -> Option<&str> {
        match self {
            CriHealth::Ready { version } => Some(version),
            _ => None,
        }
    }

    /// Why the runtime cannot be used, if it cannot.
    pub fn problem(&self) -> Option<String> {
        match self {
            CriHealth::Ready { .. } => None,
            CriHealth::Unknown => Some("container runtime not checked yet".into()),
            CriHealth::Unavailable { reason } => Some(reason.clone()),
        }
    }
}

/// How often a healthy runtime is checked again.
const RECHECK: Duration = Duration::from_secs(10);

/// Checks the runtime now and then until shutdown, publishing what it finds.
pub fn spawn_monitor<R: CriRuntime + 'static>(
    runtime: R,
    mut shutdown: watch::Receiver<bool>,
) -> watch::Receiver<CriHealth> {
    let (tx, rx) = watch::channel(CriHealth::Unknown);
    tokio::spawn(async move {
        let mut backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(30));
        loop {
            let health = match runtime.version().await {
                Ok(v) if v.runtime_api_version == "v1" => CriHealth::Ready {
                    version: format!("{}://{}", v.runtime_name, v.runtime_version),
                },
                Ok(v) => CriHealth::Unavailable {
                    reason: CriError::Version {
                        found: v.runtime_api_version,
                    }
                    .to_string(),
                },
                Err(e) => CriHealth::Unavailable {
                    reason: e.to_string(),
                },
            };
            let wait = match &health {
                CriHealth::Ready { .. } => {
                    backoff.reset();
                    RECHECK
                }
                _ => backoff.next_delay().max(Duration::from_millis(200)),
            };
            tx.send_if_modified(|cur| {
                if *cur == health {
                    return false;
                }
                match &health {
                    CriHealth::Ready { version } => {
                        tracing::info!(runtime = %version, "container runtime ready")
                    }
                    CriHealth::Unavailable { reason } => {
                        tracing::warn!(%reason, "container runtime unavailable; retrying")
                    }
                    CriHealth::Unknown => {}
                }
                *cur = health;
                true
            });
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = shutdown.changed() => return,
            }
        }
    });
    rx
}
