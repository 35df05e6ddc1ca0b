//! Opening the API's listeners: the TCP address, and optionally a unix socket with a file mode
//! and group; and who a socket peer is. The socket keeps other local users out of the open
//! routes only when TCP is off (`api_addr = "none"`): any local process can connect to a
//! loopback port. The privileged routes check the socket peer's credentials themselves
//! ([`peer`]), whatever the socket's mode.

use super::guard::{privileged_peer, Peer, SocketAccess};
use super::ApiConfig;
use super::Listener;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    #[error("local API: cannot listen on {addr}: {source}")]
    Tcp {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("local API: unix socket {path}: {reason}")]
    Unix { path: PathBuf, reason: String },
    #[error("local API: token file {path}: {reason}")]
    Token { path: PathBuf, reason: String },
}

/// Binds every configured listener: TCP on `addr` unless `api_addr = "none"` turned it off
/// (`None`), and the unix socket if `api` names one.
pub async fn bind(addr: Option<SocketAddr>, api: &ApiConfig) -> Result<Vec<Listener>, ListenError> {
    let mut out = Vec::new();
    if let Some(addr) = addr {
        let tcp = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| ListenError::Tcp { addr, source })?;
        out.push(Listener::Tcp(tcp));
    }
    if let Some(path) = &api.socket {
        out.push(Listener::Unix(bind_unix(
            path,
            api.socket_mode,
            api.socket_group.as_deref(),
        )?));
    }
    Ok(out)
}

fn bind_unix(
    path: &Path,
    mode: u32,
    group: Option<&str>,
) -> Result<tokio::net::UnixListener, ListenError> {
    let err = |reason: String| ListenError::Unix {
        path: path.to_path_buf(),
        reason,
    };
    match std::fs::symlink_metadata(path) {
        // A socket left by a previous run; anything else at that path is not ours to delete.
        Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path)
            .map_err(|e| err(format!("cannot remove the old socket: {e}")))?,
        Ok(_) => return Err(err("exists and is not a socket".into())),
        Err(_) => {}
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)
            .map_err(|e| err(format!("cannot create its directory: {e}")))?;
    }
    let l = tokio::net::UnixListener::bind(path).map_err(|e| err(e.to_string()))?;
    if let Some(g) = group {
        let gid = group_gid(path, g)?;
        std::os::unix::fs::chown(path, None, Some(gid))
            .map_err(|e| err(format!("cannot chown to group {g}: {e}")))?;
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| err(format!("cannot set mode {mode:o}: {e}")))?;
    Ok(l)
}

fn group_gid(path: &Path, name: &str) -> Result<u32, ListenError> {
    gid_of(
        name,
        &std::fs::read_to_string("/etc/group").unwrap_or_default(),
    )
    .ok_or_else(|| ListenError::Unix {
        path: path.to_path_buf(),
        reason: format!("group {name:?} not found in /etc/group"),
    })
}

/// Who may call privileged routes over the socket besides root: `[api] socket_group`, by
/// name and gid (from `/etc/group`, read once at start as for the socket's owner).
pub fn socket_access(api: &ApiConfig) -> Result<SocketAccess, ListenError> {
    let group = match (&api.socket, &api.socket_group) {
        (Some(path), Some(g)) => Some((g.clone(), group_gid(path, g)?)),
        _ => None,
    };
    Ok(SocketAccess {
        path: api.socket.clone(),
        group,
    })
}

/// What the kernel says of a unix-socket peer: its uid and gid as they were at `connect()`
/// (`SO_PEERCRED`), and its supplementary groups as they were then (`SO_PEERGROUPS`, Linux
/// 4.13). Unreadable credentials make an unprivileged peer, never a privileged one.
pub fn peer(stream: &tokio::net::UnixStream, group: Option<u32>) -> Peer {
    let Ok(cred) = stream.peer_cred() else {
        return Peer {
            uid: None,
            privileged: false,
        };
    };
    let (uid, gid) = (cred.uid(), cred.gid());
    // The groups matter only for a group check of a non-root peer.
    let groups = match group {
        Some(g) if uid != 0 && gid != g => match peer_groups(stream.as_raw_fd()) {
            Ok(groups) => groups,
            // A kernel before 4.13: the groups the peer process has now, from /proc.
            Err(e) if e.raw_os_error() == Some(libc::ENOPROTOOPT) => cred
                .pid()
                .and_then(|pid| std::fs::read_to_string(format!("/proc/{pid}/status")).ok())
                .map(|s| status_groups(&s))
                .unwrap_or_default(),
            Err(e) => {
                tracing::debug!(error = %e, "cannot read a socket peer's groups");
                Vec::new()
            }
        },
        _ => Vec::new(),
    };
    Peer {
        uid: Some(uid),
        privileged: privileged_peer(uid, gid, &groups, group),
    }
}

/// Most supplementary groups a process can have (the kernel's `NGROUPS_MAX`).
const NGROUPS_MAX: usize = 65536;
/// `SO_PEERGROUPS` (asm-generic, so x86_64 and aarch64 alike); not in every libc release.
const SO_PEERGROUPS: libc::c_int = 59;

/// The peer's supplementary groups at `connect()`, by `getsockopt(SO_PEERGROUPS)`.
fn peer_groups(fd: std::os::fd::RawFd) -> std::io::Result<Vec<u32>> {
    let mut buf: Vec<libc::gid_t> = vec![0; 64];
    loop {
        let mut len = (buf.len() * std::mem::size_of::<libc::gid_t>()) as libc::socklen_t;
        // SAFETY: `buf` is a live, writable buffer of `len` bytes that outlives the call; the
        // kernel writes at most `len` bytes and sets `len` to what it wrote (or, with ERANGE,
        // to what it needs).
        let r = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                SO_PEERGROUPS,
                buf.as_mut_ptr().cast(),
                &mut len,
            )
        };
        let n = len as usize / std::mem::size_of::<libc::gid_t>();
        if r == 0 {
            buf.truncate(n);
            return Ok(buf);
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::ERANGE) || n <= buf.len() || n > NGROUPS_MAX {
            return Err(e);
        }
        buf.resize(n, 0);
    }
}

/// The supplementary groups of a `/proc/<pid>/status` text (its `Groups:` line).
pub fn status_groups(status: &str) -> Vec<u32> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("Groups:"))
        .map(|g| {
            g.split_whitespace()
                .filter_map(|x| x.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// The gid of group `name` in `/etc/group` text.
pub fn gid_of(name: &str, etc_group: &str) -> Option<u32> {
    etc_group.lines().find_map(|l| {
        let mut f = l.split(':');
        (f.next()? == name).then_some(())?;
        f.next()?;
        f.next()?.parse().ok()
    })
}

/// Reads the API's bearer token, if one is configured.
pub fn read_token(api: &ApiConfig) -> Result<Option<String>, ListenError> {
    let Some(path) = &api.token_file else {
        return Ok(None);
    };
    let err = |reason: String| ListenError::Token {
        path: path.clone(),
        reason,
    };
    let t = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
    let t = t.trim();
    if t.is_empty() {
        return Err(err("is empty".into()));
    }
    if t.bytes().any(|b| !b.is_ascii_graphic()) {
        return Err(err("contains characters not allowed in a header".into()));
    }
    Ok(Some(t.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_lookup() {
        let g = "root:x:0:\nota:x:1234:alice,bob\nbroken\nnum:x:abc:\n";
        assert_eq!(gid_of("ota", g), Some(1234));
        assert_eq!(gid_of("root", g), Some(0));
        assert_eq!(gid_of("missing", g), None);
        assert_eq!(gid_of("broken", g), None);
        assert_eq!(gid_of("num", g), None);
    }

    #[test]
    fn groups_of_a_proc_status() {
        let s = "Name:\tsh\nUid:\t1000\t1000\t1000\t1000\nGroups:\t4 24 1001 \nNSpid:\t9\n";
        assert_eq!(status_groups(s), [4, 24, 1001]);
        assert_eq!(status_groups("Groups:\t\n"), Vec::<u32>::new());
        assert_eq!(status_groups("Name:\tx\n"), Vec::<u32>::new());
    }

    /// The kernel's answer over a real socket pair: this process's own groups.
    #[test]
    fn the_peer_groups_are_the_kernels() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut mine = vec![0 as libc::gid_t; 256];
        // SAFETY: the buffer holds 256 gids, as the call is told.
        let n = unsafe { libc::getgroups(256, mine.as_mut_ptr()) };
        assert!(n >= 0);
        mine.truncate(n as usize);
        let mut got = peer_groups(a.as_raw_fd()).unwrap();
        got.sort();
        mine.sort();
        assert_eq!(got, mine);
    }
}
