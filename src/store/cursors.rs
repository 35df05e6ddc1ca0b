//! Sync cursors that moved without an object change (bookmarks), waiting to be written.
//!
//! A bookmark moves a reflector's resourceVersion and changes no object. Persisting it only
//! shortens the replay after a power cut (a clean stop writes it), and on flash a commit
//! costs 20–28 KiB of writes however little it holds (on ext4: a WAL frame across two pages,
//! two pages of the -shm index, the inode, the blocks of a growing WAL). So bookmark progress
//! waits here, in memory, and rides along with the next commit the store makes anyway (an
//! object change, a round of token renewals), or, when none comes, is written on its own
//! once `cursor_checkpoint` has passed since cursors were last written, all reflectors' in
//! one transaction.

use super::{objects, StoreError};
use std::collections::{BTreeMap, HashMap};
use std::sync::MutexGuard;
use std::time::{Duration, Instant};

/// A batch of `(resource key, resourceVersion)` to write.
pub type Batch = Vec<(String, String)>;

#[derive(Debug)]
pub struct ParkedCursors {
    pending: BTreeMap<String, String>,
    /// What the file holds for each key, as far as this store wrote or read it: parking a
    /// version that is already there is no progress.
    on_disk: HashMap<String, String>,
    last_write: Instant,
}

impl ParkedCursors {
    pub fn new(now: Instant) -> ParkedCursors {
        ParkedCursors {
            pending: BTreeMap::new(),
            on_disk: HashMap::new(),
            last_write: now,
        }
    }

    /// `key` reached `rv` with no object change.
    pub fn park(&mut self, key: &str, rv: &str) {
        if self.on_disk.get(key).map(String::as_str) == Some(rv) {
            self.pending.remove(key);
        } else {
            self.pending.insert(key.to_string(), rv.to_string());
        }
    }

    /// Everything parked, to ride along with a commit that happens anyway.
    pub fn batch(&self) -> Batch {
        self.pending
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// Everything parked, if the last write of cursors is at least `every` old (or `force`,
    /// at shutdown); `None` when there is nothing to write yet.
    pub fn due(&self, now: Instant, every: Duration, force: bool) -> Option<Batch> {
        let due = force || now.saturating_duration_since(self.last_write) >= every;
        (due && !self.pending.is_empty()).then(|| self.batch())
    }

    /// `batch` was committed at `now`. An entry parked again meanwhile with a newer version
    /// stays pending.
    pub fn written(&mut self, batch: &[(String, String)], now: Instant) {
        for (k, v) in batch {
            if self.pending.get(k) == Some(v) {
                self.pending.remove(k);
            }
            self.on_disk.insert(k.clone(), v.clone());
        }
        if !batch.is_empty() {
            self.last_write = now;
        }
    }

    /// `key`'s cursor is written (or was read) as `rv` on its own path, with an object change
    /// or a relist: its parked, older progress must not be written after that and move the
    /// cursor back.
    pub fn stored(&mut self, key: &str, rv: &str) {
        self.pending.remove(key);
        self.on_disk.insert(key.to_string(), rv.to_string());
    }

    /// `key`'s cursor was read from the file as `rv`.
    pub fn read(&mut self, key: &str, rv: &str) {
        self.on_disk.insert(key.to_string(), rv.to_string());
    }

    /// `key`'s cursor is about to be written with a change: drop its parked progress now,
    /// before the batch that rides along with that change is taken.
    pub fn forget(&mut self, key: &str) {
        self.pending.remove(key);
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }
}

impl super::Store {
    fn parked(&self) -> MutexGuard<'_, ParkedCursors> {
        // Poisoned only if a thread panicked holding it; the map is still a valid map.
        self.cursors.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn cursor(&self, resource: &str) -> Result<Option<String>, StoreError> {
        let rv = objects::cursor(&self.conn(), resource)?;
        if let Some(rv) = &rv {
            self.parked().read(resource, rv);
        }
        Ok(rv)
    }

    /// Stores a cursor on its own; the sync parks bookmark progress with [`Store::park_cursor`].
    pub fn set_cursor(&self, resource: &str, rv: &str) -> Result<(), StoreError> {
        let conn = self.conn();
        objects::set_cursor(&conn, resource, rv)?;
        self.parked().stored(resource, rv);
        Ok(())
    }

    /// `resource` reached `rv` with no object change (a bookmark): the progress waits in
    /// memory, rides along with the next commit, and is written by
    /// [`Store::checkpoint_cursors`] when none comes.
    pub fn park_cursor(&self, resource: &str, rv: &str) {
        self.parked().park(resource, rv);
    }

    /// Writes every parked cursor in one transaction once cursors were last written at least
    /// `every` ago (or when `force`d, at shutdown); returns how many it wrote.
    pub fn checkpoint_cursors(&self, every: Duration, force: bool) -> Result<usize, StoreError> {
        let mut conn = self.conn();
        let Some(batch) = self.parked().due(Instant::now(), every, force) else {
            return Ok(0);
        };
        let tx = conn.transaction()?;
        for (resource, rv) in &batch {
            objects::set_cursor(&tx, resource, rv)?;
        }
        tx.commit()?;
        self.parked().written(&batch, Instant::now());
        Ok(batch.len())
    }

    /// The parked cursors to ride along with a commit about to happen: taken after `conn` is
    /// locked, so no other write can take them meanwhile; `own` is the cursor the commit
    /// writes itself, whose older parked progress is dropped.
    pub(super) fn ride_along(&self, own: Option<&str>) -> Batch {
        let mut p = self.parked();
        if let Some(k) = own {
            p.forget(k);
        }
        p.batch()
    }

    /// After a commit that carried `batch` (and `own`, its own cursor).
    pub(super) fn rode_along(&self, batch: &[(String, String)], own: Option<(&str, &str)>) {
        let mut p = self.parked();
        p.written(batch, Instant::now());
        if let Some((k, rv)) = own {
            p.stored(k, rv);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(pairs: &[(&str, &str)]) -> Batch {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn progress_waits_for_the_interval_then_goes_in_one_batch() {
        let t0 = Instant::now();
        let every = Duration::from_secs(300);
        let mut c = ParkedCursors::new(t0);
        c.park("pods", "10");
        c.park("ds", "11");
        assert_eq!(c.due(t0 + Duration::from_secs(299), every, false), None);
        // A later bookmark of the same reflector replaces its parked version.
        c.park("pods", "12");
        c.park("cr", "13");
        let at = t0 + every;
        let b = c.due(at, every, false).unwrap();
        assert_eq!(b, batch(&[("cr", "13"), ("ds", "11"), ("pods", "12")]));
        c.written(&b, at);
        assert!(c.is_empty());
        // The interval counts from the last write.
        c.park("pods", "14");
        assert_eq!(c.due(at + Duration::from_secs(299), every, false), None);
        assert!(c.due(at + every, every, false).is_some());
    }

    #[test]
    fn shutdown_forces_the_batch_out_and_nothing_parked_writes_nothing() {
        let t0 = Instant::now();
        let mut c = ParkedCursors::new(t0);
        assert_eq!(c.due(t0, Duration::ZERO, true), None);
        c.park("ds", "5");
        assert_eq!(c.due(t0, Duration::from_secs(300), true).unwrap().len(), 1);
    }

    #[test]
    fn a_ride_along_resets_the_interval() {
        let t0 = Instant::now();
        let every = Duration::from_secs(300);
        let mut c = ParkedCursors::new(t0);
        c.park("pods", "10");
        let b = c.batch();
        c.written(&b, t0 + Duration::from_secs(200));
        c.park("pods", "11");
        assert_eq!(c.due(t0 + every, every, false), None, "written 100 s ago");
        assert!(c.due(t0 + Duration::from_secs(500), every, false).is_some());
    }

    #[test]
    fn reading_a_cursor_keeps_what_is_parked() {
        let t0 = Instant::now();
        let mut c = ParkedCursors::new(t0);
        c.park("pods", "10");
        c.read("pods", "9");
        assert_eq!(c.batch(), batch(&[("pods", "10")]));
    }

    #[test]
    fn a_version_already_on_disk_is_no_progress() {
        let t0 = Instant::now();
        let mut c = ParkedCursors::new(t0);
        c.read("pods", "9");
        c.park("pods", "9");
        assert!(c.is_empty(), "a bookmark at the version read");
        c.stored("pods", "10");
        c.park("pods", "10");
        assert!(c.is_empty(), "a bookmark at the stored version");
        c.park("pods", "11");
        let b = c.batch();
        c.written(&b, t0);
        c.park("pods", "11");
        assert!(c.is_empty(), "a bookmark at the version a ride-along wrote");
    }

    #[test]
    fn a_cursor_written_with_a_change_drops_the_older_parked_one() {
        let t0 = Instant::now();
        let every = Duration::from_secs(300);
        let mut c = ParkedCursors::new(t0);
        c.park("pods", "10");
        c.park("ds", "11");
        c.forget("pods");
        c.stored("pods", "12");
        assert_eq!(
            c.due(t0 + every, every, false),
            Some(batch(&[("ds", "11")]))
        );
    }

    #[test]
    fn progress_parked_during_a_write_stays_pending() {
        let t0 = Instant::now();
        let mut c = ParkedCursors::new(t0);
        c.park("pods", "10");
        let b = c.batch();
        // Written as "10", but "pods" moved on to "12" meanwhile.
        c.park("pods", "12");
        c.written(&b, t0);
        assert_eq!(c.batch(), batch(&[("pods", "12")]));
    }
}
