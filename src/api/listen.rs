//! Opening the API's listeners: the TCP address, and optionally a unix socket with a file mode
//! and group. The socket keeps other local users out only when TCP is off (`api_addr =
//! "none"`): any local process can connect to a loopback port.

use super::ApiConfig;
use super::Listener;
use std::net::SocketAddr;
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
        let gid = gid_of(
            g,
            &std::fs::read_to_string("/etc/group").unwrap_or_default(),
        )
        .ok_or_else(|| err(format!("group {g:?} not found in /etc/group")))?;
        std::os::unix::fs::chown(path, None, Some(gid))
            .map_err(|e| err(format!("cannot chown to group {g}: {e}")))?;
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| err(format!("cannot set mode {mode:o}: {e}")))?;
    Ok(l)
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
}
