//! How many pods' tasks work at once, and how many pull at once: two bounds, not one.
//!
//! A pod's task holds a work slot for its runtime calls (a probe, a restart, a stop). A pull
//! is different: it waits on a registry, for minutes on a slow link or forever on a black
//! hole until its deadline, and uses nothing of the node meanwhile. So a task that pulls
//! gives its work slot back for the pull, takes a pull slot instead, and takes a work slot
//! again once the image is in: four slow pulls cannot starve every other pod's probes and
//! crash restarts, and at most `pulls` pulls load the link at once.
//!
//! The slots reach the pull through a task-local ([`Slots::scope`]), so
//! [`super::act::create_and_start`] keeps its signature for the upgrade engine, whose pulls
//! are its own and are not bounded here.

use crate::cri::{api, CriError, CriRuntime};
use std::future::Future;
use std::sync::{Arc, Mutex};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

tokio::task_local! {
    static SLOTS: Slots;
}

/// The two bounds, shared by every task of one runtime.
#[derive(Debug, Clone)]
pub struct Pool {
    work: Arc<Semaphore>,
    pulls: Arc<Semaphore>,
    /// Told when a task gave its work slot back before finishing (it started a pull), so the
    /// runtime can hand the slot to a pod that was waiting for one.
    freed: Arc<Notify>,
}

impl Pool {
    pub fn new(work: usize, pulls: usize) -> Pool {
        Pool {
            work: Arc::new(Semaphore::new(work.max(1))),
            pulls: Arc::new(Semaphore::new(pulls.max(1))),
            freed: Arc::new(Notify::new()),
        }
    }

    /// A work slot for a new task, if one is free.
    pub fn try_slot(&self) -> Option<Slots> {
        let permit = self.work.clone().try_acquire_owned().ok()?;
        Some(Slots {
            pool: self.clone(),
            held: Arc::new(Mutex::new(Some(permit))),
        })
    }

    /// Resolves when a pulling task gave its work slot back.
    pub async fn freed(&self) {
        self.freed.notified().await
    }

    /// Free work slots now.
    pub fn free_work(&self) -> usize {
        self.work.available_permits()
    }
}

/// One task's slot: its work permit while it works, none while it pulls.
#[derive(Debug, Clone)]
pub struct Slots {
    pool: Pool,
    held: Arc<Mutex<Option<OwnedSemaphorePermit>>>,
}

impl Slots {
    fn held(&self) -> std::sync::MutexGuard<'_, Option<OwnedSemaphorePermit>> {
        // Poisoned only if a thread panicked holding it; an Option of a permit is still whole.
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` (one pod's task) with these slots; the work slot is given back when it ends.
    pub async fn scope<F: Future>(self, f: F) -> F::Output {
        SLOTS.scope(self, f).await
    }

    /// Runs `pull` out of the work slot and in a pull slot, then takes a work slot again.
    async fn pulling<T>(&self, pull: impl Future<Output = T>) -> T {
        if self.held().take().is_some() {
            self.pool.freed.notify_one();
        }
        let out = match self.pool.pulls.acquire().await {
            Ok(_pulling) => pull.await,
            // Never closed; if it were, pulling unbounded beats not pulling.
            Err(_) => pull.await,
        };
        if let Ok(permit) = self.pool.work.clone().acquire_owned().await {
            *self.held() = Some(permit);
        }
        out
    }
}

/// Pulls `image`: inside a pod's task of the runtime, in a pull slot and out of its work slot
/// ([`Slots`]); anywhere else, as it is.
pub async fn pull<R: CriRuntime>(
    cri: &R,
    image: &str,
    auth: Option<api::AuthConfig>,
) -> Result<String, CriError> {
    match SLOTS.try_with(Slots::clone) {
        Ok(slots) => slots.pulling(cri.pull_image(image, auth)).await,
        Err(_) => cri.pull_image(image, auth).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cri::fake::FakeCri;

    #[tokio::test]
    async fn a_pulling_task_gives_its_work_slot_to_another_and_takes_one_back() {
        let pool = Pool::new(1, 1);
        let slots = pool.try_slot().expect("one slot");
        assert!(pool.try_slot().is_none(), "the only work slot is taken");
        let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
        let (other_tx, other_rx) = tokio::sync::oneshot::channel::<Slots>();
        let task = slots.clone().scope(async {
            // A pull that lasts until another task took the freed slot and gave it back.
            slots.pulling(async { done_rx.await.unwrap() }).await;
            assert_eq!(pool.free_work(), 0, "the task took its work slot back");
        });
        let other = async {
            pool.freed().await;
            let s = pool
                .try_slot()
                .expect("the pulling task's slot is free for another");
            assert!(pool.try_slot().is_none());
            other_tx.send(s).unwrap();
        };
        let pulls = async {
            let s = other_rx.await.unwrap();
            let second = Slots {
                pool: pool.clone(),
                held: Arc::new(Mutex::new(None)),
            };
            let blocked = second.pulling(async {});
            tokio::pin!(blocked);
            assert!(
                futures_poll_once(blocked.as_mut()).await.is_none(),
                "one pull slot: a second pull waits"
            );
            drop(s);
            done_tx.send(()).unwrap();
        };
        tokio::join!(task, other, pulls);
        drop(slots);
        assert_eq!(pool.free_work(), 1, "the slot is free once the task ended");
    }

    /// Polls once: `Some` if it finished.
    async fn futures_poll_once<F: Future + Unpin>(mut f: F) -> Option<F::Output> {
        std::future::poll_fn(|cx| {
            std::task::Poll::Ready(match std::pin::Pin::new(&mut f).poll(cx) {
                std::task::Poll::Ready(v) => Some(v),
                std::task::Poll::Pending => None,
            })
        })
        .await
    }

    #[tokio::test]
    async fn pulls_outside_a_runtime_task_are_not_bounded() {
        let pool = Pool::new(1, 1);
        let _all = pool.try_slot().expect("the only slot");
        let cri = FakeCri::default();
        pull(&cri, "img:1", None).await.unwrap();
        assert_eq!(cri.state.lock().unwrap().pulls, ["img:1"]);
    }
}
