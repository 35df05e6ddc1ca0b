//! The container runtime's mount namespace, when it is not edgehub's.
//!
//! The tmpfs that holds a pod's Secret, projected and downwardAPI files (volumes.rs) must be
//! the one containerd bind-mounts into the container. When edgehub runs in a mount namespace
//! of its own (a systemd unit with `PrivateTmp=`, `ProtectSystem=` and the like: systemd
//! makes it a slave of the host's, so nothing mounted in it reaches the host), a tmpfs it
//! mounts exists only there, and containerd bind-mounts the empty directory underneath: the
//! container sees no token. The shipped unit creates no mount namespace; this module is for
//! the edgehub that is started in one anyway: it finds containerd's namespace (the peer of
//! the CRI socket), says so once, and attaches each volume's tmpfs in both namespaces (a
//! clone of the mount, `open_tree` + `move_mount`, so both are the same file system and
//! every later write is seen by the container).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The CRI socket whose peer is the runtime; set once at start by `edgehub run`.
static SOCKET: Mutex<Option<PathBuf>> = Mutex::new(None);
/// The runtime's process, once found, and whether the foreign namespace was reported.
static PEER: Mutex<Option<(u32, bool)>> = Mutex::new(None);

/// Tells this module where the runtime listens. Without it (the library used in-process, as
/// the tests do) every mount is taken to be in the runtime's namespace.
pub fn set_runtime_socket(path: &Path) {
    if let Ok(mut s) = SOCKET.lock() {
        *s = Some(path.to_path_buf());
    }
}

fn ns_of(pid: &str) -> Option<PathBuf> {
    std::fs::read_link(format!("/proc/{pid}/ns/mnt")).ok()
}

/// The pid of the process listening on the unix socket `path` (SO_PEERCRED).
fn peer_pid(path: &Path) -> Option<u32> {
    let s = std::os::unix::net::UnixStream::connect(path).ok()?;
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`, which is that large.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (rc == 0 && cred.pid > 0).then_some(cred.pid as u32)
}

/// The runtime's pid when it lives in another mount namespace than edgehub; `None` when it is
/// the same one, or cannot be told (no socket configured, the runtime not up yet).
pub fn foreign_runtime() -> Option<u32> {
    let socket = SOCKET.lock().ok()?.clone()?;
    let mut peer = PEER.lock().ok()?;
    let alive = |pid: u32| ns_of(&pid.to_string()).is_some();
    let pid = match *peer {
        Some((pid, _)) if alive(pid) => pid,
        _ => {
            let pid = peer_pid(&socket)?;
            *peer = Some((pid, false));
            pid
        }
    };
    let (ours, theirs) = (ns_of("self")?, ns_of(&pid.to_string())?);
    if ours == theirs {
        return None;
    }
    if let Some((_, reported)) = peer.as_mut() {
        if !*reported {
            *reported = true;
            tracing::warn!(runtime_pid = pid, ours = %ours.display(), theirs = %theirs.display(),
                "edgehub runs in another mount namespace than the container runtime (a unit with PrivateTmp=, ProtectSystem= or similar, or unshare): each Secret and token volume is attached in the runtime's namespace as well; run edgehub in the host's (the shipped unit does)");
        }
    }
    Some(pid)
}

fn dev(p: &Path) -> Option<u64> {
    std::fs::metadata(p).ok().map(|m| m.dev())
}

/// `path` as the process `pid` sees it.
fn seen_by(pid: u32, path: &Path) -> PathBuf {
    Path::new(&format!("/proc/{pid}/root")).join(path.strip_prefix("/").unwrap_or(path))
}

/// Whether `path` is the same file system for edgehub and for process `pid`.
pub fn same_mount(pid: u32, path: &Path) -> bool {
    matches!((dev(path), dev(&seen_by(pid, path))), (Some(a), Some(b)) if a == b)
}

/// Whether `path` is the root of a mount (its device differs from its parent's).
pub fn is_mount_point(path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let (Ok(me), Some(Ok(parent))) = (
        std::fs::metadata(path),
        path.parent().map(std::fs::metadata),
    ) else {
        return false;
    };
    me.dev() != parent.dev()
}

/// Whether `path` is a mount point in process `pid`'s namespace.
pub fn is_mount_point_for(pid: u32, path: &Path) -> bool {
    is_mount_point(&seen_by(pid, path))
}

fn last_error() -> std::io::Error {
    std::io::Error::last_os_error()
}

fn cpath(p: &Path) -> std::io::Result<std::ffi::CString> {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(p.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "path has a NUL byte"))
}

/// A detached clone of the mount at `path` in the calling thread's namespace.
fn clone_tree(path: &std::ffi::CStr) -> std::io::Result<OwnedFd> {
    // SAFETY: open_tree takes a dirfd, a NUL-terminated path that outlives the call and
    // flags; it returns a new fd or -1.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            path.as_ptr(),
            libc::OPEN_TREE_CLONE | libc::OPEN_TREE_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(last_error());
    }
    // SAFETY: a fresh fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Attaches the detached mount `tree` at `path` in the calling thread's namespace.
fn attach(tree: &OwnedFd, path: &std::ffi::CStr) -> std::io::Result<()> {
    // SAFETY: move_mount takes two (dirfd, path) pairs, both paths NUL-terminated and alive
    // for the call, and flags; it returns 0 or -1.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            tree.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_FDCWD,
            path.as_ptr(),
            libc::MOVE_MOUNT_F_EMPTY_PATH,
        )
    };
    if rc != 0 {
        return Err(last_error());
    }
    Ok(())
}

/// Runs `f` on a thread of its own that has entered process `pid`'s mount namespace. The
/// thread first unshares its file-system attributes (setns into a mount namespace is refused
/// to a thread that shares them with others), and ends with `f`, so no other code ever runs
/// in that namespace.
fn in_namespace_of<T: Send + 'static>(
    pid: u32,
    f: impl FnOnce() -> std::io::Result<T> + Send + 'static,
) -> std::io::Result<T> {
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/mnt"))?;
    std::thread::spawn(move || {
        // SAFETY: unshare and setns take flags and an open fd; they touch only this thread.
        if unsafe { libc::unshare(libc::CLONE_FS) } != 0 {
            return Err(last_error());
        }
        // SAFETY: as above.
        if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNS) } != 0 {
            return Err(last_error());
        }
        f()
    })
    .join()
    .map_err(|_| std::io::Error::other("the namespace thread panicked"))?
}

/// Makes the tmpfs at `path` (mounted in edgehub's namespace) the same one at `path` in
/// process `pid`'s namespace.
pub fn export(pid: u32, path: &Path) -> std::io::Result<()> {
    let target = cpath(path)?;
    let tree = clone_tree(&target)?;
    in_namespace_of(pid, move || attach(&tree, &target))?;
    if !same_mount(pid, path) {
        return Err(std::io::Error::other(
            "attached, yet the runtime sees another file system",
        ));
    }
    Ok(())
}

/// Mounts at `path`, in edgehub's namespace, the mount process `pid` has there (a volume
/// of a pod that was running before this edgehub started in a namespace of its own).
pub fn import(pid: u32, path: &Path) -> std::io::Result<()> {
    let target = cpath(path)?;
    let source = target.clone();
    let tree = in_namespace_of(pid, move || clone_tree(&source))?;
    attach(&tree, &target)
}

/// A filesystem's size and free space, as `statvfs(3)` reports them, in bytes, and its inodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsStats {
    pub total_bytes: u64,
    /// Free to root.
    pub free_bytes: u64,
    /// Free to an unprivileged writer (root's reserve excluded).
    pub available_bytes: u64,
    /// Inodes in all, and free ones.
    pub inodes: u64,
    pub inodes_free: u64,
}

/// The filesystem holding `path`; `None` when it cannot be read.
pub fn fs_stats(path: &Path) -> Option<FsStats> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c` is a valid NUL-terminated path and `st` a properly sized out-parameter;
    // statvfs only writes into it, and it is read only when the call succeeded.
    let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: initialized by the successful call above.
    let st = unsafe { st.assume_init() };
    // The field types differ between libc targets (u64 here, u32 on some 32-bit ones).
    #[allow(clippy::unnecessary_cast)]
    let (blocks, free, avail, frsize, files, ffree) = (
        st.f_blocks as u64,
        st.f_bfree as u64,
        st.f_bavail as u64,
        st.f_frsize as u64,
        st.f_files as u64,
        st.f_ffree as u64,
    );
    Some(FsStats {
        total_bytes: blocks.saturating_mul(frsize),
        free_bytes: free.saturating_mul(frsize),
        available_bytes: avail.saturating_mul(frsize),
        inodes: files,
        inodes_free: ffree,
    })
}
