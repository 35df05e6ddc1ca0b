//! The drop directory, for OTA managers that only write files.
//!
//! The contract (docs/images.md): write the archive under a name that does not end in
//! `.tar`, `.tar.gz` or `.tgz` (for example `app.tar.part`) in the same directory, then
//! rename it to its final name. A rename is atomic, so edgehub never sees half a file under
//! a name it reads. As a second guard, a file is read only once its size and mtime are the
//! same on two looks one interval apart. An imported file is removed; a refused or broken
//! one is renamed to `NAME.failed`, with the reason in `NAME.failed.txt`, and never read
//! again.

use super::{scan, Expected, ImageError, Importer, LoadOptions};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;
use tokio::sync::watch;

/// Whether edgehub reads a file of this name from the drop directory.
pub fn is_archive_name(name: &str) -> bool {
    !name.starts_with('.')
        && [".tar", ".tar.gz", ".tgz"]
            .iter()
            .any(|s| name.len() > s.len() && name.ends_with(s))
}

/// What a file looked like on the last pass: a file is read when it looks the same twice.
type Seen = HashMap<PathBuf, (u64, Option<SystemTime>)>;

/// Looks at `dir` every `interval` and imports what settled there, until `shutdown` flips.
pub async fn run(importer: Arc<Importer>, dir: PathBuf, mut shutdown: watch::Receiver<bool>) {
    if let Err(e) = std::fs::create_dir_all(&dir) {
        tracing::warn!(dir = %dir.display(), error = %e, "cannot create the image drop directory; it is off");
        return;
    }
    let interval = importer.config.drop_interval;
    let mut seen: Seen = HashMap::new();
    loop {
        for path in settled(&dir, &mut seen) {
            seen.remove(&path);
            import_one(&importer, &path).await;
        }
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = shutdown.changed() => return,
        }
    }
}

/// The archives in `dir` that look as they did on the last pass.
fn settled(dir: &Path, seen: &mut Seen) -> Vec<PathBuf> {
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
        let Ok(meta) = e.metadata() else { continue };
        if !meta.is_file() {
            continue;
        }
        let look = (meta.len(), meta.modified().ok());
        if seen.get(&e.path()) == Some(&look) {
            ready.push(e.path());
        }
        now.insert(e.path(), look);
    }
    *seen = now;
    ready.sort();
    ready
}

async fn import_one(importer: &Arc<Importer>, path: &Path) {
    let file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) => {
            tracing::warn!(file = %path.display(), error = %e, "cannot open a dropped image archive");
            return;
        }
    };
    tracing::info!(file = %path.display(), "importing a dropped image archive");
    let imp = importer.clone();
    let rt = tokio::runtime::Handle::current();
    let result = tokio::task::spawn_blocking(move || {
        let mut file = file;
        // The file's blobs from its tar headers, so free space is checked first.
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        let scanned = scan::scan(&mut file);
        if let Err(e) = &scanned {
            tracing::debug!(error = %e, "cannot scan a dropped archive; the import reads it");
        }
        let expected = Expected::from_scan(scanned, len);
        std::io::Seek::seek(&mut file, std::io::SeekFrom::Start(0)).map_err(ImageError::Input)?;
        imp.load_blocking(
            &rt,
            std::io::BufReader::new(file),
            expected,
            LoadOptions::default(),
        )
    })
    .await;
    match result {
        Ok(Ok(loaded)) => {
            tracing::info!(file = %path.display(), images = ?loaded.images, "dropped image archive imported");
            if let Err(e) = std::fs::remove_file(path) {
                tracing::warn!(file = %path.display(), error = %e, "cannot remove an imported archive");
            }
            if let Err(e) = importer.images_arrived().await {
                tracing::warn!(error = %e, "cannot tell which pods' images are all here now");
            }
        }
        Ok(Err(e)) => {
            tracing::warn!(file = %path.display(), error = %e, "dropped image archive refused");
            let failed = path.with_extension(format!(
                "{}.failed",
                path.extension().and_then(|x| x.to_str()).unwrap_or("")
            ));
            let _ = std::fs::rename(path, &failed);
            let mut note = failed.clone().into_os_string();
            note.push(".txt");
            let _ = std::fs::write(note, format!("{e}\n"));
        }
        Err(e) => tracing::warn!(file = %path.display(), error = %e, "the import task failed"),
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
        assert_eq!(settled(dir.path(), &mut seen), vec![p]);
    }
}
