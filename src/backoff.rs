//! Exponential backoff, the one kind edgehub uses everywhere: reconnects to the apiserver,
//! crash-looping containers, pods the runtime refused, reports the apiserver turned away.
//!
//! The ceiling doubles from `initial` to `max`. Network retries add full jitter (a uniform
//! wait in `[0, ceiling]`), so a fleet that lost its link together does not come back in
//! lockstep; the kubelet's crash-loop backoff has none, and [`Backoff::steady`] keeps it so.

use std::time::Duration;

/// The shape of a backoff: where it starts and where it stops growing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackoffPolicy {
    pub initial: Duration,
    pub max: Duration,
}

impl BackoffPolicy {
    /// The kubelet's crash-loop backoff: 10 s doubling to 5 min.
    pub const CRASH_LOOP: BackoffPolicy = BackoffPolicy {
        initial: Duration::from_secs(10),
        max: Duration::from_secs(300),
    };

    /// The ceiling after `failures` consecutive failures (the first failure waits `initial`).
    pub fn ceiling(&self, failures: u32) -> Duration {
        let factor = 1u32
            .checked_shl(failures.saturating_sub(1).min(20))
            .unwrap_or(u32::MAX);
        self.initial.saturating_mul(factor).min(self.max)
    }

    /// A network wait after `failures` consecutive failures, jittered into the upper half of
    /// its ceiling (it never collapses to zero, so a persisted retry always waits a little).
    /// Unjittered under the same test-only knob as [`Backoff::new`].
    pub fn jittered(&self, failures: u32) -> Duration {
        let c = self.ceiling(failures);
        if !network_jitter() {
            return c;
        }
        let ms = c.as_millis().min(u64::MAX as u128) as u64;
        Duration::from_millis(fastrand::u64(ms / 2..=ms))
    }

    /// The crash-loop wait before restart number `restarts` (1 for the first restart).
    pub fn delay(&self, restarts: u32) -> Duration {
        self.ceiling(restarts)
    }
}

impl Default for BackoffPolicy {
    fn default() -> Self {
        BackoffPolicy::CRASH_LOOP
    }
}

/// Whether network backoffs are jittered: always, except when the test-only
/// `EDGEHUB_TEST_BACKOFF_JITTER=0` is set, so `benches/fleet.rs` can show the apiserver what a
/// fleet reconnecting in lockstep would look like. Read once per process.
fn network_jitter() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("EDGEHUB_TEST_BACKOFF_JITTER").is_none_or(|v| v != "0"))
}

/// A running backoff: counts failures and hands out the next wait.
#[derive(Debug, Clone)]
pub struct Backoff {
    policy: BackoffPolicy,
    failures: u32,
    jitter: bool,
}

impl Backoff {
    /// A jittered backoff, for requests over the network.
    pub fn new(initial: Duration, max: Duration) -> Backoff {
        Backoff {
            policy: BackoffPolicy { initial, max },
            failures: 0,
            jitter: network_jitter(),
        }
    }

    /// A backoff without jitter: the wait is the ceiling.
    pub fn steady(policy: BackoffPolicy) -> Backoff {
        Backoff {
            policy,
            failures: 0,
            jitter: false,
        }
    }

    /// The ceiling of the next wait (before jitter).
    pub fn ceiling(&self) -> Duration {
        self.policy.ceiling(self.failures.saturating_add(1))
    }

    /// The next wait, and count one more failure.
    pub fn next_delay(&mut self) -> Duration {
        let ceiling = self.ceiling();
        self.failures = self.failures.saturating_add(1);
        if !self.jitter {
            return ceiling;
        }
        let ms = ceiling.as_millis().min(u64::MAX as u128) as u64;
        Duration::from_millis(fastrand::u64(0..=ms))
    }

    /// Failures counted since the last reset.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    pub fn reset(&mut self) {
        self.failures = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crash_loop_backoff_doubles_to_the_cap() {
        let b = BackoffPolicy::CRASH_LOOP;
        let d: Vec<u64> = (1..=7).map(|n| b.delay(n).as_secs()).collect();
        assert_eq!(d, [10, 20, 40, 80, 160, 300, 300]);
        assert_eq!(b.delay(1000).as_secs(), 300);
        assert_eq!(b.delay(0).as_secs(), 10);
    }

    #[test]
    fn steady_has_no_jitter_and_jittered_stays_under_the_ceiling() {
        let mut s = Backoff::steady(BackoffPolicy::CRASH_LOOP);
        assert_eq!(s.next_delay(), Duration::from_secs(10));
        assert_eq!(s.next_delay(), Duration::from_secs(20));
        assert_eq!(s.failures(), 2);
        s.reset();
        assert_eq!(s.ceiling(), Duration::from_secs(10));

        let mut j = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        for _ in 0..50 {
            let ceiling = j.ceiling();
            assert!(j.next_delay() <= ceiling);
        }
        assert_eq!(j.ceiling(), Duration::from_secs(1));
    }
}
