//! A crash on purpose, for the crash-point tests: with `EDGEHUB_FAILPOINT=<name>` in its
//! environment, edgehub kills itself with SIGKILL the moment it reaches the named point, as a
//! power cut would. Unset (always, outside tests), a point costs one comparison.

use std::sync::OnceLock;

fn armed() -> Option<&'static str> {
    static POINT: OnceLock<Option<String>> = OnceLock::new();
    POINT
        .get_or_init(|| std::env::var("EDGEHUB_FAILPOINT").ok())
        .as_deref()
}

/// Dies here if this is the armed point.
pub fn hit(point: &str) {
    if armed() == Some(point) {
        tracing::error!(point, "failpoint reached: killing edgehub");
        // SAFETY: kill(2) on our own pid with a constant signal has no memory effects.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
    }
}
