//! The engine's watch over open transactions: each transaction's commit deadline counts while
//! it is Verified (on the boot clock, written to the store every checkpoint so it survives a
//! reboot), and one nobody commits in time rolls back, as a bootloader falls back to the old
//! slot.

use super::*;
use crate::store::Decision;

impl<R: CriRuntime + 'static> Engine<R> {
    /// One look at every open transaction: brings its deadline's count up to now, and rolls
    /// back the ones whose deadline passed. Returns whether one is still waiting for a
    /// decision (its deadline then needs the next look a second later).
    pub(super) fn watch_transactions(&self) -> Result<bool, StoreError> {
        let boot = crate::time::boot_id();
        let now = crate::time::boot_ms();
        let mut undecided = false;
        for t in self.store.open_transactions()? {
            if t.decision.is_some() {
                continue;
            }
            undecided = true;
            let verified = txn::state(&t) == txn::TxnState::Verified;
            let (elapsed, write) =
                txn::Clock::of(&t).tick(verified, boot, now, t.commit_timeout_ms);
            if let Some(w) = write {
                let (b, at) = w.since.map_or((None, None), |(b, at)| (Some(b), Some(at)));
                self.store
                    .set_transaction_clock(&t.id, w.elapsed_ms, b.as_deref(), at)?;
            }
            if verified && elapsed >= t.commit_timeout_ms {
                let why = txn::deadline_reason(t.commit_timeout_ms);
                tracing::warn!(transaction = %t.id, reason = %why, "transaction not committed in time; rolling back");
                self.store
                    .decide_transaction(&t.id, Decision::Rollback, Some(&why))?;
                crate::failpoint::hit("transaction:after:deadline");
            }
        }
        Ok(undecided)
    }
}
