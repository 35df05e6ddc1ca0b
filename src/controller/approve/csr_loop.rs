//! The loop both approvers run: watch one signer's CSRs, hand each new or changed one to the
//! approver, and try the ones it could not finish again every [`RETRY`] until the watch
//! brings news of them.

use futures_util::StreamExt;
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use kube::api::Api;
use kube::runtime::{watcher, WatchStreamExt};
use kube::ResourceExt;
use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;
use tokio::sync::watch;

/// How long a CSR that could not be finished waits before it is tried again.
pub(super) const RETRY: Duration = Duration::from_secs(10);

/// What became of one CSR.
pub(super) enum Outcome {
    /// Decided, not ours, or gone: nothing more to do until the watch brings news.
    Done,
    /// Try again in [`RETRY`].
    Retry,
}

/// An approver: decides one CSR, writing its decision.
pub(super) trait CsrHandler: Send {
    fn handle_csr(
        &mut self,
        csr: &CertificateSigningRequest,
    ) -> impl Future<Output = Outcome> + Send;
}

/// Resolves once `stop` is true (or its sender is gone); holds no borrow of it after.
pub(super) async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// Runs `approver` on `signer`'s CSRs until `stop` turns true or the watch ends.
pub(super) async fn run<H: CsrHandler>(
    api: Api<CertificateSigningRequest>,
    signer: &str,
    approver: &mut H,
    stop: &mut watch::Receiver<bool>,
) {
    let wc = watcher::Config::default()
        .fields(&format!("spec.signerName={signer}"))
        .any_semantic();
    let mut events = watcher(api, wc).default_backoff().boxed();
    // CSRs to try again, by name, as last seen.
    let mut waiting: BTreeMap<String, CertificateSigningRequest> = BTreeMap::new();
    // The first retry one period on (a plain interval's first tick is at once).
    let mut retry = tokio::time::interval_at(tokio::time::Instant::now() + RETRY, RETRY);
    retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stopped(stop) => break,
            ev = events.next() => match ev {
                None => break,
                Some(Ok(watcher::Event::Apply(csr) | watcher::Event::InitApply(csr))) => {
                    let name = csr.name_any();
                    match approver.handle_csr(&csr).await {
                        Outcome::Done => waiting.remove(&name),
                        Outcome::Retry => waiting.insert(name, csr),
                    };
                }
                Some(Ok(watcher::Event::Delete(csr))) => {
                    waiting.remove(&csr.name_any());
                }
                Some(Ok(watcher::Event::Init | watcher::Event::InitDone)) => {}
                Some(Err(e)) => tracing::warn!(signer, error = %e, "CSR watch failed; retrying with backoff"),
            },
            _ = retry.tick(), if !waiting.is_empty() => {
                for (name, csr) in std::mem::take(&mut waiting) {
                    if let Outcome::Retry = approver.handle_csr(&csr).await {
                        waiting.insert(name, csr);
                    }
                }
            }
        }
    }
}
