//! The drop directory's file operations, which trust nothing in it: whoever can write the
//! directory can plant symbolic links, FIFOs and devices under any name, and edgehub runs as
//! root. A payload is opened without following a link and without blocking, and read only
//! when the open descriptor is a regular file; a reason file is written under a fresh name
//! (`O_CREAT | O_EXCL | O_NOFOLLOW`) and renamed over its final one, which replaces whatever
//! was planted there rather than writing through it. All of it blocks: call it off the async
//! workers.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// How a file looked (size, mtime).
pub type Look = (u64, Option<SystemTime>);

/// Why a dropped file was not opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// Gone since the directory was read.
    #[error("it is gone")]
    Gone,
    /// Never to be read: a link, a FIFO, a device, a directory.
    #[error("{0}")]
    Refused(String),
    /// Maybe next time (a permission, an I/O error).
    #[error("cannot open it: {0}")]
    Io(#[source] std::io::Error),
}

/// Opens a dropped file to read: refused when it is a symbolic link or anything but a regular
/// file (checked on the open descriptor, so a swap after the look cannot slip one in), and
/// never blocking (a FIFO opens at once and is refused). Returns the file and how it looks.
pub fn open_payload(path: &Path) -> Result<(File, Look), OpenError> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC)
        .open(path);
    let file = match file {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(OpenError::Gone),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(OpenError::Refused(
                "refused: it is a symbolic link; drop the archive itself".into(),
            ))
        }
        Err(e) => return Err(OpenError::Io(e)),
    };
    let meta = file.metadata().map_err(OpenError::Io)?;
    let ft = meta.file_type();
    if !ft.is_file() {
        let what = if ft.is_fifo() {
            "a FIFO"
        } else if ft.is_dir() {
            "a directory"
        } else if ft.is_socket() {
            "a socket"
        } else if ft.is_char_device() || ft.is_block_device() {
            "a device"
        } else {
            "something else"
        };
        return Err(OpenError::Refused(format!(
            "refused: it is not a regular file ({what})"
        )));
    }
    Ok((file, (meta.len(), meta.modified().ok())))
}

/// `path` with `suffix` added to its file name.
fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_os_string();
    s.push(suffix);
    PathBuf::from(s)
}

/// Writes `text` as `path` (in the drop directory): into a fresh hidden file beside it,
/// created exclusively and never through a link, then renamed over `path`, so a link or file
/// planted at `path` is replaced, never written through.
pub fn write_new(path: &Path, text: &str) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut last = None;
    for _ in 0..8 {
        let tmp = dir.join(format!(".{name}.{:08x}.tmp", fastrand::u32(..)));
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&tmp);
        let mut f = match f {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                last = Some(e);
                continue;
            }
            Err(e) => return Err(e),
        };
        let written = f
            .write_all(text.as_bytes())
            .and_then(|()| std::fs::rename(&tmp, path));
        if written.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        return written;
    }
    Err(last.unwrap_or_else(|| std::io::Error::other("no fresh name for a temporary file")))
}

/// Parks a refused file for good: renamed `NAME.failed` (a rename moves a link itself, never
/// its target), with `reason` in `NAME.failed.txt`. `Err` when it could not be moved.
pub fn park(path: &Path, reason: &str) -> std::io::Result<PathBuf> {
    let failed = with_suffix(path, ".failed");
    std::fs::rename(path, &failed)?;
    let note = with_suffix(&failed, ".txt");
    if let Err(e) = write_new(&note, &format!("{reason}\n")) {
        tracing::warn!(file = %note.display(), error = %e, "cannot write why a dropped archive was refused");
    }
    Ok(failed)
}
