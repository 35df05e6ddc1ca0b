//! The drop directory, for OTA managers that only write files.
//!
//! The contract (docs/images.md): write the archive under a name that does not end in
//! `.tar`, `.tar.gz` or `.tgz` (for example `app.tar.part`) in the same directory, then
//! rename it to its final name. A rename is atomic, so edgehub never sees half a file under
//! a name it reads. As a second guard, a file is read only once its size and mtime are the
//! same on two looks one interval apart. An imported file is removed. One that failed for a
//! reason that may pass (the runtime unavailable, no room, an I/O error) stays and is tried
//! again, with a backoff; one refused for good (corrupt, over a limit, not named by a cached
//! revision, not a regular file) is renamed to `NAME.failed`, with the reason in
//! `NAME.failed.txt`, and never read again. Nothing in the directory is trusted
//! ([`files`]), and every file operation runs off the async workers.

mod files;

use super::{scan, Expected, ImageError, Importer, LoadOptions};
use crate::backoff::BackoffPolicy;
use files::{Look, OpenError};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// Whether edgehub reads a file of this name from the drop directory.
pub fn is_archive_name(name: &str) -> bool {
    !name.starts_with('.')
        && [".tar", ".tar.gz", ".tgz"]
            .iter()
            .any(|s| name.len() > s.len() && name.ends_with(s))
}

/// The wait before a file that failed for a passing reason is tried again: 5 s doubling to
/// 5 min.
pub const RETRY: BackoffPolicy = BackoffPolicy {
    initial: Duration::from_secs(5),
    max: Duration::from_secs(300),
};

/// What a file looked like on the last pass: a file is read when it looks the same twice.
type Seen = HashMap<PathBuf, Look>;

/// What became of one attempt at a dropped file.
#[derive(Debug)]
enum Outcome {
    Imported(Vec<String>),
    /// Failed for a reason that may pass: try again later.
    Retry(String),
    /// Refused for good (parked, or to be left alone when it cannot be moved).
    Refused(String),
    /// Gone, or changed since it settled: look again.
    Skipped,
}

/// Files that failed, and when each may be tried again: pure, so the schedule is tested
/// without a runtime.
#[derive(Debug, Default)]
pub struct Retries {
    pending: HashMap<PathBuf, Pending>,
}

#[derive(Debug, Clone)]
struct Pending {
    look: Look,
    failures: u32,
    next: Instant,
    /// Refused for good but could not be moved aside: left alone while it looks the same.
    stuck: bool,
}

impl Retries {
    /// Whether `path`, looking `look`, may be tried at `now`: a file that changed since it
    /// failed starts afresh.
    pub fn due(&mut self, path: &Path, look: &Look, now: Instant) -> bool {
        match self.pending.get(path) {
            Some(p) if p.look != *look => {
                self.pending.remove(path);
                true
            }
            Some(p) => !p.stuck && now >= p.next,
            None => true,
        }
    }

    /// Counts a failure that may pass; returns the wait before the next try.
    pub fn failed(&mut self, path: &Path, look: Look, now: Instant) -> Duration {
        let p = self.pending.entry(path.to_path_buf()).or_insert(Pending {
            look,
            failures: 0,
            next: now,
            stuck: false,
        });
        p.look = look;
        p.failures = p.failures.saturating_add(1);
        let wait = RETRY.ceiling(p.failures);
        p.next = now + wait;
        wait
    }

    /// A file refused for good that could not be moved aside: never tried while it looks
    /// the same.
    pub fn stuck(&mut self, path: &Path, look: Look) {
        self.pending.insert(
            path.to_path_buf(),
            Pending {
                look,
                failures: 0,
                next: Instant::now(),
                stuck: true,
            },
        );
    }

    /// Forgets `path` (imported, parked, gone).
    pub fn done(&mut self, path: &Path) {
        self.pending.remove(path);
    }

    /// Forgets the files that are no longer in the directory.
    fn keep_only(&mut self, present: &Seen) {
        self.pending.retain(|p, _| present.contains_key(p));
    }
}

/// Looks at `dir` every `interval` and imports what settled there, until `shutdown` flips.
pub async fn run(importer: Arc<Importer>, dir: PathBuf, mut shutdown: watch::Receiver<bool>) {
    let d = dir.clone();
    match tokio::task::spawn_blocking(move || std::fs::create_dir_all(&d)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            tracing::warn!(dir = %dir.display(), error = %e, "cannot create the image drop directory; it is off");
            return;
        }
        Err(e) => {
            tracing::warn!(error = %e, "the image drop directory's task failed; it is off");
            return;
        }
    }
    let interval = importer.config.drop_interval;
    let mut seen: Seen = HashMap::new();
    let mut retries = Retries::default();
    loop {
        let d = dir.clone();
        let (ready, now_seen) = match tokio::task::spawn_blocking(move || {
            let mut s = seen;
            let r = settled(&d, &mut s);
            (r, s)
        })
        .await
        {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(error = %e, "reading the image drop directory failed");
                (Vec::new(), HashMap::new())
            }
        };
        seen = now_seen;
        retries.keep_only(&seen);
        for (path, look) in ready {
            if !retries.due(&path, &look, Instant::now()) {
                continue;
            }
            seen.remove(&path);
            let outcome = attempt(&importer, &path, look).await;
            match outcome {
                Outcome::Imported(images) => {
                    retries.done(&path);
                    tracing::info!(file = %path.display(), images = ?images, "dropped image archive imported");
                    if let Err(e) = importer.images_arrived().await {
                        tracing::warn!(error = %e, "cannot tell which pods' images are all here now");
                    }
                }
                Outcome::Retry(why) => {
                    let wait = retries.failed(&path, look, Instant::now());
                    tracing::warn!(file = %path.display(), error = %why, retry_in_secs = wait.as_secs(),
                        "dropped image archive not imported this time; it stays and is tried again");
                }
                Outcome::Refused(why) => {
                    tracing::warn!(file = %path.display(), error = %why, "dropped image archive refused");
                    let p = path.clone();
                    match tokio::task::spawn_blocking(move || files::park(&p, &why)).await {
                        Ok(Ok(_)) => retries.done(&path),
                        Ok(Err(e)) => {
                            tracing::warn!(file = %path.display(), error = %e, "cannot rename a refused archive; it is left alone while it stays as it is");
                            retries.stuck(&path, look);
                        }
                        Err(e) => tracing::warn!(error = %e, "the drop directory's task failed"),
                    }
                }
                Outcome::Skipped => {}
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = shutdown.changed() => return,
        }
    }
}

/// The archives in `dir` that look as they did on the last pass, with how they look. Every
/// kind of entry under an archive's name counts (by its own look, links not followed): what
/// is not a regular file is refused when opened, not ignored forever.
fn settled(dir: &Path, seen: &mut Seen) -> Vec<(PathBuf, Look)> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut now: Seen = HashMap::new();
    let mut ready = Vec::new();
    for e in rd.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        if !is_archive_name(name) {
            continue;
        }
        // The entry's own metadata: a link is not followed.
        let Ok(meta) = e.metadata() else { continue };
        let look = (meta.len(), meta.modified().ok());
        if seen.get(&e.path()) == Some(&look) {
            ready.push((e.path(), look));
        }
        now.insert(e.path(), look);
    }
    *seen = now;
    ready.sort();
    ready
}

/// One attempt at a dropped file, on a blocking thread: opened safely, scanned, imported.
async fn attempt(importer: &Arc<Importer>, path: &Path, look: Look) -> Outcome {
    let imp = importer.clone();
    let rt = tokio::runtime::Handle::current();
    let p = path.to_path_buf();
    let job = tokio::task::spawn_blocking(move || {
        let mut file = match files::open_payload(&p) {
            Ok((f, l)) if l == look => f,
            Ok(_) | Err(OpenError::Gone) => return Outcome::Skipped,
            Err(OpenError::Refused(why)) => return Outcome::Refused(why),
            Err(e @ OpenError::Io(_)) => return Outcome::Retry(e.to_string()),
        };
        tracing::info!(file = %p.display(), "importing a dropped image archive");
        // The file's blobs from its tar headers, so free space is checked first.
        let scanned = scan::scan(&mut file);
        if let Err(e) = &scanned {
            tracing::debug!(error = %e, "cannot scan a dropped archive; the import reads it");
        }
        let expected = Expected::from_scan(scanned, look.0);
        let result = std::io::Seek::seek(&mut file, std::io::SeekFrom::Start(0))
            .map_err(ImageError::Input)
            .and_then(|_| {
                imp.load_blocking(
                    &rt,
                    std::io::BufReader::new(file),
                    expected,
                    LoadOptions::default(),
                )
            });
        match result {
            Ok(loaded) => {
                if let Err(e) = std::fs::remove_file(&p) {
                    tracing::warn!(file = %p.display(), error = %e, "cannot remove an imported archive");
                }
                Outcome::Imported(loaded.images)
            }
            Err(e) if e.is_transient() => Outcome::Retry(e.to_string()),
            Err(e) => Outcome::Refused(e.to_string()),
        }
    });
    match job.await {
        Ok(o) => o,
        Err(e) => Outcome::Retry(format!("the import task failed: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_finished_archive_names_are_read() {
        for ok in ["app.tar", "app.tar.gz", "x.tgz"] {
            assert!(is_archive_name(ok), "{ok}");
        }
        for no in [
            "app.tar.part",
            ".app.tar",
            "app.tar.failed",
            "tar",
            ".tar",
            "app.tmp",
            "app.tar.failed.txt",
        ] {
            assert!(!is_archive_name(no), "{no}");
        }
    }

    /// Issue 31: a FIFO under an archive's name (swapped in after the look) must not hang
    /// the opener; it is refused at once.
    #[test]
    fn a_fifo_is_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("a.tar");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(files::open_payload(&fifo).map(|_| ()));
        });
        let r = rx
            .recv_timeout(std::time::Duration::from_secs(5))
            .expect("opening a FIFO returned within 5 s");
        let e = r.expect_err("a FIFO is refused");
        assert!(e.to_string().contains("not a regular file"), "{e}");
    }

    /// Issue 31: a dropped symlink is refused, not followed (to a file edgehub may read as
    /// root and the dropper may not).
    #[test]
    fn a_symlink_is_refused_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let secret = outside.path().join("secret.tar");
        std::fs::write(&secret, b"not for the dropper").unwrap();
        let link = dir.path().join("a.tar");
        std::os::unix::fs::symlink(&secret, &link).unwrap();
        let e = files::open_payload(&link)
            .map(|_| ())
            .expect_err("a symlink is refused");
        assert!(e.to_string().contains("symbolic link"), "{e}");
    }

    /// Issue 31: a symlink planted at the reason file's name is replaced, not written
    /// through (edgehub runs as root: that would overwrite any file).
    #[test]
    fn the_reason_is_not_written_through_a_planted_symlink() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let victim = outside.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let payload = dir.path().join("bad.tar");
        std::fs::write(&payload, b"garbage").unwrap();
        std::os::unix::fs::symlink(&victim, dir.path().join("bad.tar.failed.txt")).unwrap();
        files::park(&payload, "not a usable image archive").unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        let note = dir.path().join("bad.tar.failed.txt");
        let meta = std::fs::symlink_metadata(&note).unwrap();
        assert!(meta.file_type().is_file(), "{meta:?}");
        assert_eq!(
            std::fs::read_to_string(&note).unwrap(),
            "not a usable image archive\n"
        );
        assert_eq!(
            std::fs::read(dir.path().join("bad.tar.failed")).unwrap(),
            b"garbage"
        );
        assert!(!payload.exists());
    }

    #[test]
    fn a_passing_failure_is_tried_again_later_and_a_changed_file_at_once() {
        let mut r = Retries::default();
        let p = Path::new("/d/a.tar");
        let t0 = Instant::now();
        let look = (10, None);
        assert!(r.due(p, &look, t0));
        assert_eq!(r.failed(p, look, t0), Duration::from_secs(5));
        assert!(!r.due(p, &look, t0 + Duration::from_secs(4)));
        assert!(r.due(p, &look, t0 + Duration::from_secs(5)));
        let t1 = t0 + Duration::from_secs(5);
        assert_eq!(r.failed(p, look, t1), Duration::from_secs(10));
        for _ in 0..10 {
            r.failed(p, look, t1);
        }
        assert_eq!(r.failed(p, look, t1), Duration::from_secs(300), "capped");
        // A new file under the name starts afresh.
        assert!(r.due(p, &(11, None), t1));
        assert_eq!(r.failed(p, (11, None), t1), Duration::from_secs(5));
        // Stuck: left alone while it looks the same, whatever the time.
        r.stuck(p, look);
        assert!(!r.due(p, &look, t1 + Duration::from_secs(3600)));
        r.done(p);
        assert!(r.due(p, &look, t1));
    }

    #[test]
    fn a_file_is_ready_when_it_looked_the_same_twice() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.tar");
        std::fs::write(&p, b"1").unwrap();
        std::fs::write(dir.path().join("b.tar.part"), b"1").unwrap();
        let mut seen = Seen::new();
        assert!(settled(dir.path(), &mut seen).is_empty());
        // Grows between looks: not ready.
        std::fs::write(&p, b"12").unwrap();
        assert!(settled(dir.path(), &mut seen).is_empty());
        let ready: Vec<PathBuf> = settled(dir.path(), &mut seen)
            .into_iter()
            .map(|(p, _)| p)
            .collect();
        assert_eq!(ready, vec![p]);
    }
}
