//! systemd's readiness protocol (`sd_notify`) without libsystemd: one datagram to the socket
//! named by `NOTIFY_SOCKET`. With `Type=notify`, systemd starts units ordered after edgehub
//! only once the local API answers.

use std::ffi::OsStr;
use std::os::unix::net::UnixDatagram;

/// Sends `state` (e.g. `READY=1`) to `socket`: a path, or `@name` for the abstract namespace.
pub fn notify_to(socket: &OsStr, state: &str) -> std::io::Result<()> {
    let sock = UnixDatagram::unbound()?;
    let bytes = socket.as_encoded_bytes();
    if let Some(name) = bytes.strip_prefix(b"@") {
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
        sock.send_to_addr(state.as_bytes(), &addr)?;
    } else {
        sock.send_to(state.as_bytes(), socket)?;
    }
    Ok(())
}

/// Tells systemd, if it is listening, and logs (but otherwise ignores) a failure: running
/// outside systemd is normal.
pub fn notify(state: &str) {
    if let Some(socket) = std::env::var_os("NOTIFY_SOCKET") {
        if let Err(e) = notify_to(&socket, state) {
            tracing::warn!(error = %e, state, "sd_notify failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sends_to_a_path_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let rx = UnixDatagram::bind(&path).unwrap();
        notify_to(path.as_os_str(), "READY=1").unwrap();
        let mut buf = [0u8; 64];
        let n = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1");
    }

    #[test]
    fn sends_to_an_abstract_socket() {
        use std::os::linux::net::SocketAddrExt;
        let name = format!("edgehub-test-{}", std::process::id());
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let rx = UnixDatagram::bind_addr(&addr).unwrap();
        notify_to(OsStr::new(&format!("@{name}")), "STOPPING=1").unwrap();
        let mut buf = [0u8; 64];
        let n = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"STOPPING=1");
    }

    #[test]
    fn a_missing_socket_is_an_error_not_a_panic() {
        assert!(notify_to(OsStr::new("/nonexistent/notify"), "READY=1").is_err());
    }
}
