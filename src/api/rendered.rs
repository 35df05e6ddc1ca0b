//! `GET /pods` kept rendered: the PodList is built once and served as it is (a reference to
//! the same bytes, no copy) until the store changes, instead of being rebuilt per request.
//!
//! What the list depends on (the pods, their DaemonSets and revisions, the statuses queued
//! for the apiserver, the revisions upgrades committed) all lives in the store, so the kept
//! body is tagged with [`Store::generation`](crate::store::Store::generation), which moves
//! with every row the store writes: a body is served only while the generation it was built
//! at is still the store's. A write between the first and the last read of a render leaves
//! the body unkept (it may mix the two states); the next request renders again.
//!
//! One render at a time: the slot's lock is held while rendering, so sixteen clients arriving
//! together after a change cost one render, not sixteen, and the memory of one body.
//!
//! Memory: a kept body costs its size (549 KiB with 100 pods of 5.5 KB, 5.4 MiB with 1000).
//! It is dropped once no request asked for it for [`KEEP`], so an idle device does not carry
//! it; musl's allocator maps a block that large on its own and unmaps it when freed.

use bytes::Bytes;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long a rendered list is kept without a request for it.
pub const KEEP: Duration = Duration::from_secs(60);

/// The slot of one kept response.
#[derive(Debug, Default)]
pub struct Rendered {
    slot: Mutex<Option<Kept>>,
    /// Whether a task is already waiting to drop the kept body once unused.
    sweeping: AtomicBool,
}

#[derive(Debug)]
struct Kept {
    generation: u64,
    body: Bytes,
    used: Instant,
}

impl Rendered {
    fn lock(&self) -> MutexGuard<'_, Option<Kept>> {
        // Poisoned only if a render panicked; the slot is then emptied below or replaced.
        self.slot.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The body for the store's current `generation`: the kept one when it was rendered at
    /// that generation, else a new one from `render`, kept if no write happened while it
    /// rendered. Returns the body and whether it was rendered now.
    pub fn get_or_render<E>(
        &self,
        generation: impl Fn() -> u64,
        render: impl FnOnce() -> Result<Bytes, E>,
    ) -> Result<(Bytes, bool), E> {
        let mut slot = self.lock();
        let before = generation();
        if let Some(k) = slot.as_mut().filter(|k| k.generation == before) {
            k.used = Instant::now();
            return Ok((k.body.clone(), false));
        }
        // The old body goes before the new one is built: one body's memory at a time.
        *slot = None;
        let body = render()?;
        if generation() == before {
            *slot = Some(Kept {
                generation: before,
                body: body.clone(),
                used: Instant::now(),
            });
        }
        Ok((body, true))
    }

    /// Whether a body is kept (for tests and the footprint bench's reasoning).
    pub fn is_kept(&self) -> bool {
        self.lock().is_some()
    }

    /// Drops the kept body if no request used it for `keep`; returns whether one is still
    /// kept (and so whether to look again later).
    pub fn expire(&self, keep: Duration) -> bool {
        let mut slot = self.lock();
        if slot.as_ref().is_some_and(|k| k.used.elapsed() >= keep) {
            *slot = None;
        }
        slot.is_some()
    }

    /// Starts, on the current tokio runtime, the task that drops the kept body once no
    /// request used it for `keep`, unless one is already waiting. Outside a runtime (unit
    /// tests) the body is simply kept.
    pub fn sweep_later(self: &Arc<Self>, keep: Duration) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.sweeping.swap(true, Ordering::AcqRel) {
            return;
        }
        let me = self.clone();
        rt.spawn(async move {
            loop {
                tokio::time::sleep(keep).await;
                if !me.expire(keep) {
                    break;
                }
            }
            me.sweeping.store(false, Ordering::Release);
            // A body kept between the last look and the flag's reset gets its own sweep.
            if me.is_kept() {
                me.sweep_later(keep);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    fn body(s: &'static str) -> Result<Bytes, ()> {
        Ok(Bytes::from_static(s.as_bytes()))
    }

    fn b(s: &'static str) -> Bytes {
        Bytes::from_static(s.as_bytes())
    }

    #[test]
    fn kept_while_the_generation_stays_and_rendered_again_when_it_moves() {
        let r = Rendered::default();
        let g = Cell::new(1);
        let renders = Cell::new(0);
        let render = || {
            renders.set(renders.get() + 1);
            body("a")
        };
        assert_eq!(r.get_or_render(|| g.get(), render), Ok((b("a"), true)));
        assert_eq!(
            r.get_or_render(|| g.get(), || body("b")),
            Ok((b("a"), false)),
            "the same generation serves the kept body"
        );
        g.set(2);
        assert_eq!(
            r.get_or_render(|| g.get(), || body("b")),
            Ok((b("b"), true))
        );
        assert_eq!(renders.get(), 1);
    }

    #[test]
    fn a_write_during_the_render_leaves_nothing_kept() {
        let r = Rendered::default();
        let g = Cell::new(1);
        let got = r.get_or_render(
            || g.get(),
            || {
                g.set(2); // a write lands between the render's reads
                body("torn")
            },
        );
        assert_eq!(got, Ok((b("torn"), true)));
        assert!(!r.is_kept());
        assert_eq!(
            r.get_or_render(|| g.get(), || body("whole")),
            Ok((b("whole"), true))
        );
        assert!(r.is_kept());
    }

    #[test]
    fn a_failed_render_keeps_nothing_and_the_error_is_returned() {
        let r = Rendered::default();
        assert_eq!(r.get_or_render(|| 1, || Err::<Bytes, _>("no")), Err("no"));
        assert!(!r.is_kept());
    }

    #[test]
    fn an_unused_body_expires() {
        let r = Rendered::default();
        r.get_or_render(|| 1, || body("a")).unwrap();
        assert!(r.expire(Duration::from_secs(3600)), "used just now");
        assert!(!r.expire(Duration::ZERO), "unused for long enough");
        assert!(!r.is_kept());
    }

    #[tokio::test]
    async fn the_sweep_drops_it_once_unused() {
        let keep = Duration::from_millis(100);
        let r = Arc::new(Rendered::default());
        r.get_or_render(|| 1, || body("a")).unwrap();
        r.sweep_later(keep);
        r.sweep_later(keep); // one sweeper at a time
        let deadline = Instant::now() + Duration::from_secs(10);
        while (r.is_kept() || r.sweeping.load(Ordering::Acquire)) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(!r.is_kept(), "dropped");
        assert!(!r.sweeping.load(Ordering::Acquire), "and the sweeper ended");
    }
}
