//! Each section of the file resolved into the type its module defines: defaults filled in,
//! every value checked and bounded, errors naming the field.

use super::checks::{check_label_key, check_label_value, check_node_label};
use super::file::{
    FileApi, FileIdentity, FileImages, FileLogs, FileNode, FileReport, FileSeal, FileSync,
    FileUpgrade,
};
use super::{invalid, ConfigError};
use crate::api::ApiConfig;
use crate::identity::IdentityConfig;
use crate::kubelet_api::KubeletApiConfig;
use crate::logs::LogsConfig;
use crate::node::NodeConfig;
use crate::outbox::ReportConfig;
use crate::store::seal::SealConfig;
use crate::sync::SyncConfig;
use std::path::Path;
use std::time::Duration;

pub(super) fn sync(s: FileSync) -> Result<SyncConfig, ConfigError> {
    let watch_namespaces = s.watch_namespaces.unwrap_or_default();
    for ns in &watch_namespaces {
        crate::names::check_label(ns)
            .map_err(|r| invalid("sync.watch_namespaces", format!("{ns:?}: {r}")))?;
    }
    let sync = SyncConfig {
        watch_namespaces,
        cursor_checkpoint: Duration::from_secs(secs(
            "sync.cursor_checkpoint_secs",
            s.cursor_checkpoint_secs,
            // A commit costs 20-28 KiB of flash writes however small it is (on ext4: a WAL
            // frame across two pages, two pages of the -shm index, the inode, and the
            // blocks a growing WAL allocates), and the budget is 100 KiB/h: every 10
            // minutes, checkpoints alone were over it. Bookmark progress only shortens the
            // replay after a power cut (a clean stop writes it), and a busy cluster's
            // watch cache rarely holds a version even 10 minutes old: a stale cursor
            // costs one node-scoped LIST after a 410.
            3600,
            86_400,
        )?),
        backoff_initial: Duration::from_millis(secs(
            "sync.backoff_initial_ms",
            s.backoff_initial_ms,
            500,
            600_000,
        )?),
        backoff_max: Duration::from_secs(secs(
            "sync.backoff_max_secs",
            s.backoff_max_secs,
            60,
            3_600,
        )?),
        request_timeout: Duration::from_secs(secs(
            "sync.request_timeout_secs",
            s.request_timeout_secs,
            30,
            600,
        )?),
        watch_idle_timeout: Duration::from_secs(secs(
            "sync.watch_idle_timeout_secs",
            s.watch_idle_timeout_secs,
            120,
            3_600,
        )?),
        max_event_bytes: s.max_event_bytes.unwrap_or(4 << 20),
        list_page_size: s.list_page_size.unwrap_or(100),
    };
    if sync.backoff_initial > sync.backoff_max {
        return Err(invalid(
            "sync.backoff_initial_ms",
            "must not be larger than sync.backoff_max_secs",
        ));
    }
    if !(64 << 10..=256 << 20).contains(&sync.max_event_bytes) {
        return Err(invalid(
            "sync.max_event_bytes",
            format!(
                "must be between 65536 and 268435456 (got {})",
                sync.max_event_bytes
            ),
        ));
    }
    if !(1..=5000).contains(&sync.list_page_size) {
        return Err(invalid(
            "sync.list_page_size",
            format!("must be between 1 and 5000 (got {})", sync.list_page_size),
        ));
    }
    Ok(sync)
}

/// `tcp_off`: `api_addr = "none"`, so the socket is the only way in and must be set.
pub(super) fn api(a: FileApi, tcp_off: bool) -> Result<ApiConfig, ConfigError> {
    if let Some(p) = &a.socket {
        absolute("api.socket", p)?;
    }
    if let Some(p) = &a.token_file {
        absolute("api.token_file", p)?;
    }
    let mode_s = a.socket_mode.unwrap_or_else(|| "0660".into());
    let socket_mode = u32::from_str_radix(&mode_s, 8)
        .ok()
        .filter(|m| *m <= 0o777)
        .ok_or_else(|| {
            invalid(
                "api.socket_mode",
                format!("{mode_s:?} is not an octal file mode like \"0660\""),
            )
        })?;
    if let Some(g) = &a.socket_group {
        if g.is_empty() || g.contains(':') || g.contains('\n') {
            return Err(invalid(
                "api.socket_group",
                format!("{g:?} is not a group name"),
            ));
        }
    }
    if tcp_off && a.socket.is_none() {
        return Err(invalid(
            "api_addr",
            "\"none\" turns the TCP listener off, so api.socket must be set: nothing could \
             reach the local API",
        ));
    }
    let api = ApiConfig {
        socket: a.socket,
        socket_mode,
        socket_group: a.socket_group,
        token_file: a.token_file,
    };
    Ok(api)
}

/// `[node] node_api_*`: the node's API on port 10250. Absent or empty: off. An IP alone
/// listens on the kubelet's port.
pub(super) fn node_api(n: &FileNode) -> Result<KubeletApiConfig, ConfigError> {
    let d = KubeletApiConfig::default();
    let addr = match n.node_api_addr.as_deref().map(str::trim) {
        None | Some("") => None,
        Some(a) => Some(
            a.parse::<std::net::SocketAddr>()
                .or_else(|_| {
                    a.parse::<std::net::IpAddr>()
                        .map(|ip| std::net::SocketAddr::new(ip, crate::kubelet_api::DEFAULT_PORT))
                })
                .map_err(|_| {
                    invalid(
                        "node.node_api_addr",
                        format!("{a:?} is not an IP or IP:port address (e.g. 0.0.0.0:10250)"),
                    )
                })?,
        ),
    };
    if let Some(p) = &n.node_api_client_ca_file {
        absolute("node.node_api_client_ca_file", p)?;
    }
    let count = |field: &str, v: Option<u64>, default: usize| -> Result<usize, ConfigError> {
        Ok(between(field, v, default as u64, 1, 1_024)? as usize)
    };
    Ok(KubeletApiConfig {
        addr,
        client_ca_file: n.node_api_client_ca_file.clone(),
        self_signed: n.node_api_self_signed.unwrap_or(false),
        max_connections: count(
            "node.node_api_max_connections",
            n.node_api_max_connections,
            d.max_connections,
        )?,
        max_streams: count(
            "node.node_api_max_streams",
            n.node_api_max_streams,
            d.max_streams,
        )?,
        idle_timeout: Duration::from_secs(between(
            "node.node_api_idle_timeout_secs",
            n.node_api_idle_timeout_secs,
            d.idle_timeout.as_secs(),
            1,
            3_600,
        )?),
    })
}

pub(super) fn node(n: FileNode) -> Result<NodeConfig, ConfigError> {
    let kubelet_port = node_api(&n)?.addr.map(|a| a.port());
    let labels = n.labels.unwrap_or_default();
    for (k, v) in &labels {
        check_node_label(k, v).map_err(|r| invalid("node.labels", format!("{k:?}: {r}")))?;
    }
    let taints = n.taints.unwrap_or_default();
    for t in &taints {
        check_label_key(&t.key)
            .map_err(|r| invalid("node.taints", format!("key {:?}: {r}", t.key)))?;
        check_label_value(&t.value)
            .map_err(|r| invalid("node.taints", format!("value {:?}: {r}", t.value)))?;
        if !["NoSchedule", "PreferNoSchedule", "NoExecute"].contains(&t.effect.as_str()) {
            return Err(invalid(
                "node.taints",
                format!(
                    "effect {:?} must be NoSchedule, PreferNoSchedule or NoExecute",
                    t.effect
                ),
            ));
        }
    }
    let max_pods = n.max_pods.unwrap_or(110);
    if !(1..=1000).contains(&max_pods) {
        return Err(invalid(
            "node.max_pods",
            format!("must be between 1 and 1000 (got {max_pods})"),
        ));
    }
    let lease_duration = between(
        "node.lease_duration_secs",
        n.lease_duration_secs.map(u64::from),
        40,
        2,
        3_600,
    )? as u32;
    let lease_renew = between("node.lease_renew_secs", n.lease_renew_secs, 10, 1, 3_600)?;
    if u64::from(lease_duration) <= lease_renew {
        return Err(invalid(
            "node.lease_renew_secs",
            format!("must be at least 1 and below node.lease_duration_secs ({lease_duration})"),
        ));
    }
    let status_report = between(
        "node.status_report_secs",
        n.status_report_secs,
        300,
        1,
        86_400,
    )?;
    // MiB to bytes: bounded first (1 TiB), so the shift cannot wrap into a huge reserve that
    // would make all memory allocatable.
    let mib = |field: &str, v: Option<u64>, default: u64| -> Result<u64, ConfigError> {
        Ok(between(field, v, default, 0, 1 << 20)? << 20)
    };
    let pct = |field: &str, v: Option<u8>, default: u8| {
        let v = v.unwrap_or(default);
        if v > 100 {
            return Err(invalid(field, format!("must be a percentage (got {v})")));
        }
        Ok(v)
    };
    Ok(NodeConfig {
        labels,
        taints,
        max_pods,
        memory_reserve_bytes: mib("node.memory_reserve_mib", n.memory_reserve_mib, 256)?,
        lease_renew: Duration::from_secs(lease_renew),
        lease_duration_secs: lease_duration,
        status_report: Duration::from_secs(status_report),
        memory_pressure_bytes: mib("node.memory_pressure_mib", n.memory_pressure_mib, 100)?,
        disk_pressure_percent: pct("node.disk_pressure_percent", n.disk_pressure_percent, 10)?,
        pid_pressure_percent: pct("node.pid_pressure_percent", n.pid_pressure_percent, 90)?,
        kubelet_port,
    })
}

pub(super) fn upgrade(u: FileUpgrade) -> Result<crate::upgrade::UpgradeConfig, ConfigError> {
    let upgrade = crate::upgrade::UpgradeConfig {
        deadlines: crate::upgrade::machine::Deadlines {
            requested: Duration::from_secs(secs(
                "upgrade.inputs_timeout_secs",
                u.inputs_timeout_secs,
                120,
                86_400,
            )?),
            pulling: Duration::from_secs(secs(
                "upgrade.pull_timeout_secs",
                u.pull_timeout_secs,
                600,
                86_400,
            )?),
            swapping: Duration::from_secs(secs(
                "upgrade.swap_timeout_secs",
                u.swap_timeout_secs,
                120,
                3_600,
            )?),
            verifying: Duration::from_secs(secs(
                "upgrade.verify_timeout_secs",
                u.verify_timeout_secs,
                120,
                3_600,
            )?),
            committing: Duration::from_secs(secs(
                "upgrade.commit_timeout_secs",
                u.commit_timeout_secs,
                60,
                3_600,
            )?),
            rolling_back: Duration::from_secs(secs(
                "upgrade.rollback_timeout_secs",
                u.rollback_timeout_secs,
                120,
                3_600,
            )?),
        },
        min_ready_floor: Duration::from_secs(between(
            "upgrade.min_ready_floor_secs",
            u.min_ready_floor_secs,
            2,
            0,
            3_600,
        )?),
        prepull: u.prepull.unwrap_or(true),
        manual_commit_deadline: Duration::from_secs(secs(
            "upgrade.manual_commit_deadline_secs",
            u.manual_commit_deadline_secs,
            1800,
            crate::api::transactions::MAX_TIMEOUT_SECS,
        )?),
        ..Default::default()
    };
    Ok(upgrade)
}

pub(super) fn report(r: FileReport) -> Result<ReportConfig, ConfigError> {
    let report = ReportConfig {
        mode: match r.mode.as_deref() {
            None | Some("adopt") => crate::outbox::RevisionReport::DeleteAndAdopt,
            Some("patch") => crate::outbox::RevisionReport::Patch,
            Some(other) => {
                return Err(invalid(
                    "report.mode",
                    format!("{other:?}: must be \"adopt\" (delete-and-adopt) or \"patch\""),
                ))
            }
        },
        adopt_timeout: Duration::from_secs(secs(
            "report.adopt_timeout_secs",
            r.adopt_timeout_secs,
            600,
            86_400,
        )?),
        reconnect_jitter: Duration::from_secs(between(
            "report.reconnect_jitter_secs",
            r.reconnect_jitter_secs,
            30,
            0,
            3_600,
        )?),
        max_rate: between("report.max_rate", r.max_rate.map(u64::from), 20, 0, 10_000)? as u32,
        retry_max: Duration::from_secs(secs(
            "report.retry_max_secs",
            r.retry_max_secs,
            300,
            86_400,
        )?),
    };
    Ok(report)
}

pub(super) fn logs(l: FileLogs) -> Result<LogsConfig, ConfigError> {
    let logs = LogsConfig {
        // The kubelet's defaults: 10 MiB, 5 files, every 10 s. At least 16 KiB: containerd
        // writes a long line in 16 KiB records, so anything smaller rotates on every line.
        max_size_bytes: between("logs.max_size_kib", l.max_size_kib, 10 << 10, 16, 4 << 20)? << 10,
        // The kubelet refuses fewer than 2: the file being written and one rotated.
        max_files: between("logs.max_files", l.max_files, 5, 2, 100)? as usize,
        monitor_interval: Duration::from_secs(between(
            "logs.monitor_interval_secs",
            l.monitor_interval_secs,
            10,
            1,
            3_600,
        )?),
    };
    Ok(logs)
}

pub(super) fn images(
    im: FileImages,
    data_dir: &Path,
) -> Result<crate::images::ImagesConfig, ConfigError> {
    let mut images = crate::images::ImagesConfig::defaults(data_dir);
    images.max_archive_bytes = between(
        "images.max_archive_mib",
        im.max_archive_mib,
        images.max_archive_bytes >> 20,
        1,
        1 << 20,
    )? << 20;
    images.reserve_bytes = between(
        "images.reserve_mib",
        im.reserve_mib,
        images.reserve_bytes >> 20,
        0,
        1 << 20,
    )? << 20;
    images.drop_interval = Duration::from_secs(between(
        "images.drop_interval_secs",
        im.drop_interval_secs,
        images.drop_interval.as_secs(),
        1,
        3_600,
    )?);
    match im.drop_dir.as_deref() {
        None => {}
        Some("none") => images.drop_dir = None,
        Some(p) => {
            let p = std::path::PathBuf::from(p);
            absolute("images.drop_dir", &p)?;
            images.drop_dir = Some(p);
        }
    }
    if let Some(k) = im.gc_keep_previous {
        images.gc.keep_previous = k;
    }
    images.gc.high_percent = between(
        "images.gc_high_percent",
        im.gc_high_percent,
        u64::from(images.gc.high_percent),
        1,
        100,
    )? as u8;
    images.gc.low_percent = between(
        "images.gc_low_percent",
        im.gc_low_percent,
        u64::from(images.gc.low_percent),
        0,
        100,
    )? as u8;
    if images.gc.low_percent >= images.gc.high_percent {
        return Err(invalid(
            "images.gc_low_percent",
            format!(
                "must be below images.gc_high_percent ({}), as the kubelet requires",
                images.gc.high_percent
            ),
        ));
    }
    images.gc_interval = Duration::from_secs(between(
        "images.gc_interval_secs",
        im.gc_interval_secs,
        images.gc_interval.as_secs(),
        1,
        86_400,
    )?);
    Ok(images)
}

pub(super) fn seal(s: FileSeal) -> Result<SealConfig, ConfigError> {
    let seal = SealConfig {
        key_file: s.key_file,
        credential: s.credential,
    };
    if let Some(p) = &seal.key_file {
        absolute("seal.key_file", p)?;
    }
    if let Some(c) = &seal.credential {
        if c.is_empty() || c.contains('/') || c.contains('\0') || c == "." || c == ".." {
            return Err(invalid(
                "seal.credential",
                format!("{c:?} is not a credential name"),
            ));
        }
    }
    Ok(seal)
}

/// A duration in seconds (or milliseconds, as the field says): at least 1.
fn secs(field: &str, v: Option<u64>, default: u64, max: u64) -> Result<u64, ConfigError> {
    between(field, v, default, 1, max)
}

/// A numeric setting: `default` when unset, else it must lie in `min..=max`. Every numeric
/// field goes through here, so a value out of range is an error naming the field, never
/// clamped or wrapped without a word.
pub(super) fn between(
    field: &str,
    v: Option<u64>,
    default: u64,
    min: u64,
    max: u64,
) -> Result<u64, ConfigError> {
    let v = v.unwrap_or(default);
    if !(min..=max).contains(&v) {
        return Err(invalid(
            field,
            format!("must be between {min} and {max} (got {v})"),
        ));
    }
    Ok(v)
}

pub(super) fn absolute(field: &str, p: &Path) -> Result<(), ConfigError> {
    if p.is_absolute() {
        Ok(())
    } else {
        Err(invalid(
            field,
            format!("{} must be an absolute path", p.display()),
        ))
    }
}

pub(super) fn identity(i: FileIdentity) -> Result<IdentityConfig, ConfigError> {
    let cert_expiration_secs = match i.cert_expiration_secs {
        None => None,
        Some(v) => Some(between(
            "identity.cert_expiration_secs",
            Some(v),
            v,
            600,
            u32::MAX as u64,
        )? as u32),
    };
    if let Some(p) = &i.bootstrap_kubeconfig {
        absolute("identity.bootstrap_kubeconfig", p)?;
    }
    for (key, p) in [
        ("identity.factory_key_file", &i.factory_key_file),
        ("identity.factory_cert_file", &i.factory_cert_file),
    ] {
        if let Some(p) = p {
            absolute(key, p)?;
        }
    }
    if i.factory_key_file.is_some() != i.factory_cert_file.is_some() {
        return Err(invalid(
            "identity.factory_key_file",
            "factory_key_file and factory_cert_file go together (the device attestation needs both)",
        ));
    }
    if i.factory_key_file.is_some() && i.bootstrap_kubeconfig.is_none() {
        return Err(invalid(
            "identity.factory_key_file",
            "the device attestation signs the CSRs of TLS bootstrap: set identity.bootstrap_kubeconfig too",
        ));
    }
    Ok(IdentityConfig {
        bootstrap_kubeconfig: i.bootstrap_kubeconfig,
        cert_expiration_secs,
        factory_key_file: i.factory_key_file,
        factory_cert_file: i.factory_cert_file,
    })
}
