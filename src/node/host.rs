//! The sample read from this machine: /proc, the data dir's filesystem, the route to the
//! apiserver, the CRI's version.

use super::{NodeProbe, NodeSample};
use std::net::IpAddr;
use std::path::PathBuf;
use tokio::sync::watch;

/// Kubernetes' name for the architecture this binary was built for.
pub fn goarch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        other => other,
    }
}

/// Reads the sample from this machine.
pub struct HostProbe {
    /// Its filesystem's free space drives DiskPressure.
    pub data_dir: PathBuf,
    /// `host:port` of the apiserver: the local address that routes there is the InternalIP.
    pub apiserver: Option<String>,
    /// The container runtime's health, for nodeInfo and the Ready condition.
    pub cri: watch::Receiver<crate::cri::CriHealth>,
    /// Why the image filesystem is under disk pressure, from image garbage collection
    /// (`None` inside: it is not); `None`: nothing watches it.
    pub image_fs: Option<watch::Receiver<Option<String>>>,
}

fn read_trim(path: &str) -> String {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// `(MemTotal, MemAvailable)` in bytes from /proc/meminfo text.
pub fn parse_meminfo(text: &str) -> (u64, u64) {
    let field = |name: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| {
                rest.trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<u64>()
                    .ok()
            })
            .map(|kb| kb * 1024)
            .unwrap_or(0)
    };
    (field("MemTotal:"), field("MemAvailable:"))
}

/// `PRETTY_NAME` from /etc/os-release text.
pub fn parse_os_release(text: &str) -> String {
    text.lines()
        .find_map(|l| l.strip_prefix("PRETTY_NAME="))
        .map(|v| v.trim().trim_matches('"').to_string())
        .unwrap_or_else(|| "Linux".into())
}

fn disk_free_percent(path: &std::path::Path) -> Option<u8> {
    let st = crate::mountns::fs_stats(path).filter(|s| s.total_bytes > 0)?;
    Some(((u128::from(st.available_bytes) * 100) / u128::from(st.total_bytes)).min(100) as u8)
}

/// The local address that routes to `target` (`host:port`): the node's InternalIP.
pub fn local_ip_towards(target: &str) -> Option<IpAddr> {
    use std::net::{ToSocketAddrs, UdpSocket};
    let addr = target.to_socket_addrs().ok()?.next()?;
    let bind = if addr.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    };
    let sock = UdpSocket::bind(bind).ok()?;
    // A UDP connect sends nothing; it only picks the route and so the source address.
    sock.connect(addr).ok()?;
    Some(sock.local_addr().ok()?.ip())
}

impl NodeProbe for HostProbe {
    fn sample(&self) -> NodeSample {
        let (total, available) =
            parse_meminfo(&std::fs::read_to_string("/proc/meminfo").unwrap_or_default());
        let pids_used = std::fs::read_dir("/proc")
            .map(|d| {
                d.filter_map(Result::ok)
                    .filter(|e| {
                        e.file_name()
                            .to_string_lossy()
                            .bytes()
                            .all(|b| b.is_ascii_digit())
                    })
                    .count() as u64
            })
            .unwrap_or(0);
        NodeSample {
            cpus: std::thread::available_parallelism()
                .map(|n| n.get() as u32)
                .unwrap_or(1),
            memory_total_bytes: total,
            memory_available_bytes: available,
            disk_free_percent: disk_free_percent(&self.data_dir),
            pids_used,
            pid_max: read_trim("/proc/sys/kernel/pid_max").parse().unwrap_or(0),
            internal_ip: self.apiserver.as_deref().and_then(local_ip_towards),
            kernel_version: read_trim("/proc/sys/kernel/osrelease"),
            os_image: parse_os_release(
                &std::fs::read_to_string("/etc/os-release").unwrap_or_default(),
            ),
            architecture: goarch().to_string(),
            machine_id: read_trim("/etc/machine-id"),
            boot_id: read_trim("/proc/sys/kernel/random/boot_id"),
            system_uuid: read_trim("/sys/class/dmi/id/product_uuid"),
            container_runtime_version: self.cri.borrow().version().map(str::to_string),
            runtime_problem: self.cri.borrow().problem(),
            image_fs_pressure: self.image_fs.as_ref().and_then(|r| r.borrow().clone()),
        }
    }
}

/// `host:port` of a kubeconfig server URL.
pub fn server_host_port(server: &str) -> Option<String> {
    let uri: hyper::Uri = server.parse().ok()?;
    let host = uri.host()?;
    let port = uri.port_u16().unwrap_or(443);
    Some(if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    })
}
