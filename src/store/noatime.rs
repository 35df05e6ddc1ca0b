//! The database's files keep no access time: `FS_NOATIME_FL` (`chattr +A`) on the data dir,
//! the database, its WAL and its shared-memory index.
//!
//! Why: with `relatime` (the usual mount option) a read of a file whose modification time is
//! newer than its access time writes the access time into the inode. Every commit makes the
//! WAL newer; SQLite then reads the WAL (its page cache is 64 KiB, see `open.rs`) on the next
//! periodic pass, often after the kernel had written the commit's inode back, and the inode's
//! block was written again for the access time alone: a lone 4 KiB write per commit on the
//! bench's ext4 (benches/flash.rs, 24-48 KiB/h of the steady state without a device key), a
//! journal commit on a journaling file system. Nothing in edgehub reads access times.
//!
//! Set on the directory too, so that a database, WAL or index SQLite makes later (it removes
//! the WAL when the last connection closes) starts with the flag on the file systems that
//! pass it on to new files (ext4, f2fs); elsewhere they get it at the next start. A file
//! system without the flag (some do not implement the call) or a caller that may not set it
//! (not the owner, no CAP_FOWNER) only costs the writes above: logged at debug, never an
//! error.

use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// `FS_NOATIME_FL` of linux/fs.h; the libc crate has the ioctls but not the flag.
const FS_NOATIME_FL: libc::c_int = 0x0000_0080;

/// Sets the flag on the database's directory and on the database, `-wal` and `-shm` files
/// that exist. Returns how many now carry it. Only before SQLite has opened them: this
/// opens and closes each file, and a close drops the process's POSIX locks on it.
pub(super) fn apply(db: &Path) -> usize {
    let mut done = 0;
    if let Some(dir) = db.parent().filter(|d| !d.as_os_str().is_empty()) {
        done += usize::from(set(dir, true));
    }
    for p in super::database_files(db) {
        done += usize::from(set(&p, false));
    }
    done
}

fn set(path: &Path, dir: bool) -> bool {
    let flags = libc::O_NOFOLLOW | libc::O_NONBLOCK | if dir { libc::O_DIRECTORY } else { 0 };
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(flags)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return false,
        Err(e) => {
            tracing::debug!(path = %path.display(), error = %e, "cannot open to turn access times off");
            return false;
        }
    };
    let fd = file.as_raw_fd();
    let mut attr: libc::c_int = 0;
    // SAFETY: `fd` is open for the duration of the calls; FS_IOC_GETFLAGS writes one int
    // into `attr` and FS_IOC_SETFLAGS reads one (the kernel's ABI, whatever the ioctl
    // number's encoded size says).
    let rc = unsafe { libc::ioctl(fd, libc::FS_IOC_GETFLAGS, &mut attr) };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        tracing::debug!(path = %path.display(), error = %e, "the file system keeps no inode flags: access times stay on");
        return false;
    }
    if attr & FS_NOATIME_FL != 0 {
        return true;
    }
    attr |= FS_NOATIME_FL;
    // SAFETY: as above.
    let rc = unsafe { libc::ioctl(fd, libc::FS_IOC_SETFLAGS, &attr) };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        tracing::debug!(path = %path.display(), error = %e, "cannot turn access times off");
        return false;
    }
    true
}
