//! Configuration: defaults, then the TOML file, then `EDGEHUB_*` environment variables, then
//! command-line flags, each layer overriding the one before.
//!
//! Each section's type is defined by the module that reads it (`sync::SyncConfig`,
//! `api::ApiConfig`, `node::NodeConfig`, `upgrade::UpgradeConfig`, `outbox::ReportConfig`,
//! `logs::LogsConfig`); this module only reads the file and composes them, so it sits above
//! them all and none of them imports it.
//!
//! [`Config::resolve`] is pure (it takes the file's text, the environment and the flags as
//! values) so every rule is unit-tested; [`Config::load`] does the I/O around it.

pub use crate::api::ApiConfig;
pub use crate::logs::LogsConfig;
pub use crate::node::{NodeConfig, Taint};
pub use crate::outbox::ReportConfig;
pub use crate::store::seal::SealConfig;
pub use crate::sync::SyncConfig;
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub const DEFAULT_CONFIG_PATH: &str = "/etc/edgehub/config.toml";
pub const DEFAULT_DATA_DIR: &str = "/var/lib/edgehub";
pub const DEFAULT_KUBECONFIG: &str = "/etc/edgehub/kubeconfig";
pub const DEFAULT_API_ADDR: &str = "127.0.0.1:10267";
pub const DEFAULT_CRI_SOCKET: &str = "/run/containerd/containerd.sock";

/// The validated configuration the program runs with.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub node_name: String,
    pub data_dir: PathBuf,
    pub kubeconfig: PathBuf,
    /// The local API's TCP address; `None` (`api_addr = "none"`) when it listens on the unix
    /// socket alone.
    pub api_addr: Option<SocketAddr>,
    pub cri_socket: PathBuf,
    /// A `tracing` filter, e.g. `info` or `edgehub::sync=debug`.
    pub log: String,
    pub sync: SyncConfig,
    pub api: ApiConfig,
    pub node: NodeConfig,
    pub upgrade: crate::upgrade::UpgradeConfig,
    pub report: ReportConfig,
    pub logs: LogsConfig,
    pub seal: SealConfig,
    pub images: crate::images::ImagesConfig,
}

impl Config {
    pub fn db_path(&self) -> PathBuf {
        self.data_dir.join("edgehub.db")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config field `{field}`: {reason}")]
    Invalid { field: String, reason: String },
    #[error("config file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
}

fn invalid(field: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.to_string(),
        reason: reason.into(),
    }
}

/// The config file's shape. Every field is optional; unknown fields are errors, so a typo does
/// not silently fall back to a default.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    node_name: Option<String>,
    data_dir: Option<PathBuf>,
    kubeconfig: Option<PathBuf>,
    api_addr: Option<String>,
    cri_socket: Option<PathBuf>,
    log: Option<String>,
    #[serde(default)]
    sync: FileSync,
    #[serde(default)]
    api: FileApi,
    #[serde(default)]
    node: FileNode,
    #[serde(default)]
    upgrade: FileUpgrade,
    #[serde(default)]
    report: FileReport,
    #[serde(default)]
    logs: FileLogs,
    #[serde(default)]
    seal: FileSeal,
    #[serde(default)]
    images: FileImages,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileImages {
    max_archive_mib: Option<u64>,
    reserve_mib: Option<u64>,
    /// A path, or "none" for no drop directory.
    drop_dir: Option<String>,
    drop_interval_secs: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileSeal {
    key_file: Option<PathBuf>,
    credential: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileLogs {
    max_size_kib: Option<u64>,
    max_files: Option<u64>,
    monitor_interval_secs: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileReport {
    mode: Option<String>,
    adopt_timeout_secs: Option<u64>,
    reconnect_jitter_secs: Option<u64>,
    max_rate: Option<u32>,
    retry_max_secs: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileUpgrade {
    inputs_timeout_secs: Option<u64>,
    pull_timeout_secs: Option<u64>,
    swap_timeout_secs: Option<u64>,
    verify_timeout_secs: Option<u64>,
    commit_timeout_secs: Option<u64>,
    rollback_timeout_secs: Option<u64>,
    min_ready_floor_secs: Option<u64>,
    prepull: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileNode {
    labels: Option<std::collections::BTreeMap<String, String>>,
    taints: Option<Vec<Taint>>,
    max_pods: Option<u32>,
    memory_reserve_mib: Option<u64>,
    lease_renew_secs: Option<u64>,
    lease_duration_secs: Option<u32>,
    status_report_secs: Option<u64>,
    memory_pressure_mib: Option<u64>,
    disk_pressure_percent: Option<u8>,
    pid_pressure_percent: Option<u8>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileApi {
    socket: Option<PathBuf>,
    socket_mode: Option<String>,
    socket_group: Option<String>,
    token_file: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileSync {
    watch_namespaces: Option<Vec<String>>,
    cursor_checkpoint_secs: Option<u64>,
    backoff_initial_ms: Option<u64>,
    backoff_max_secs: Option<u64>,
    request_timeout_secs: Option<u64>,
    watch_idle_timeout_secs: Option<u64>,
    max_event_bytes: Option<usize>,
    list_page_size: Option<u32>,
}

/// Values given on the command line; `None` means not given.
#[derive(Debug, Default, Clone)]
pub struct Overrides {
    pub node_name: Option<String>,
    pub data_dir: Option<PathBuf>,
    pub kubeconfig: Option<PathBuf>,
    pub api_addr: Option<String>,
    pub cri_socket: Option<PathBuf>,
    pub log: Option<String>,
}

/// Where the config file comes from.
#[derive(Debug, Clone)]
pub enum Source {
    /// The default path: a missing file just means "all defaults".
    Default,
    /// Named by the user: it must exist.
    Explicit(PathBuf),
}

impl Config {
    /// Reads the file (if any), the process environment and the hostname, then resolves.
    pub fn load(source: &Source, flags: &Overrides) -> Result<Config, ConfigError> {
        let (path, required) = match source {
            Source::Default => (Path::new(DEFAULT_CONFIG_PATH), false),
            Source::Explicit(p) => (p.as_path(), true),
        };
        let text = match std::fs::read_to_string(path) {
            Ok(t) => Some(t),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !required => None,
            Err(source) => {
                return Err(ConfigError::Read {
                    path: path.to_path_buf(),
                    source,
                })
            }
        };
        let env: Vec<(String, String)> = std::env::vars()
            .filter(|(k, _)| k.starts_with("EDGEHUB_"))
            .collect();
        Config::resolve(text.as_deref(), path, &env, flags, hostname())
    }

    /// The pure layering and validation.
    pub fn resolve(
        file_text: Option<&str>,
        file_path: &Path,
        env: &[(String, String)],
        flags: &Overrides,
        hostname: Option<String>,
    ) -> Result<Config, ConfigError> {
        let file: FileConfig = match file_text {
            Some(t) => toml::from_str(t).map_err(|e| ConfigError::Parse {
                path: file_path.to_path_buf(),
                message: e.to_string().trim_end().to_string(),
            })?,
            None => FileConfig::default(),
        };
        let env_get = |name: &str| {
            env.iter()
                .rev()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        };
        // flag > env > file > default
        let pick = |flag: Option<String>, env_name: &str, file: Option<String>| {
            flag.or_else(|| env_get(env_name)).or(file)
        };
        let pick_path = |flag: &Option<PathBuf>, env_name: &str, file: Option<PathBuf>| {
            flag.clone()
                .or_else(|| env_get(env_name).map(PathBuf::from))
                .or(file)
        };

        let node_name = pick(flags.node_name.clone(), "EDGEHUB_NODE_NAME", file.node_name);
        let node_name = match node_name {
            Some(n) => {
                crate::names::check_subdomain(&n).map_err(|r| invalid("node_name", r))?;
                n
            }
            None => {
                let h = hostname.ok_or_else(|| {
                    invalid("node_name", "not set and the hostname could not be read")
                })?;
                let h = h.trim().to_string();
                crate::names::check_subdomain(&h).map_err(|r| {
                    invalid(
                        "node_name",
                        format!("not set, and the hostname {h:?} is not a valid node name ({r}); set node_name"),
                    )
                })?;
                h
            }
        };

        let data_dir = pick_path(&flags.data_dir, "EDGEHUB_DATA_DIR", file.data_dir)
            .unwrap_or_else(|| PathBuf::from(DEFAULT_DATA_DIR));
        absolute("data_dir", &data_dir)?;
        let kubeconfig = pick_path(&flags.kubeconfig, "EDGEHUB_KUBECONFIG", file.kubeconfig)
            .unwrap_or_else(|| PathBuf::from(DEFAULT_KUBECONFIG));
        if kubeconfig.as_os_str().is_empty() {
            return Err(invalid("kubeconfig", "must not be empty"));
        }
        let api_addr_s = pick(flags.api_addr.clone(), "EDGEHUB_API_ADDR", file.api_addr)
            .unwrap_or_else(|| DEFAULT_API_ADDR.to_string());
        // "none": no TCP listener, the unix socket alone (checked below, once the socket is
        // known). While TCP is bound, any local process and any web page's browser can reach
        // the API there, whatever the socket's mode and group say.
        let api_addr: Option<SocketAddr> = if api_addr_s == "none" {
            None
        } else {
            Some(api_addr_s.parse().map_err(|_| {
                invalid(
                    "api_addr",
                    format!(
                        "{api_addr_s:?} is not an IP:port address (e.g. 127.0.0.1:10267) or \"none\""
                    ),
                )
            })?)
        };
        let cri_socket = pick_path(&flags.cri_socket, "EDGEHUB_CRI_SOCKET", file.cri_socket)
            .unwrap_or_else(|| PathBuf::from(DEFAULT_CRI_SOCKET));
        absolute("cri_socket", &cri_socket)?;
        let log = pick(flags.log.clone(), "EDGEHUB_LOG", file.log).unwrap_or_else(|| "info".into());
        check_log_filter(&log).map_err(|r| invalid("log", r))?;

        let s = file.sync;
        let watch_namespaces = s.watch_namespaces.unwrap_or_default();
        for ns in &watch_namespaces {
            crate::names::check_label(ns)
                .map_err(|r| invalid("sync.watch_namespaces", format!("{ns:?}: {r}")))?;
        }
        let secs = |field: &str, v: Option<u64>, default: u64, max: u64| {
            between(field, v, default, 1, max)
        };
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
        let a = file.api;
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
        if api_addr.is_none() && a.socket.is_none() {
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
        let node = node_config(file.node)?;
        let u = file.upgrade;
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
            ..Default::default()
        };
        let r = file.report;
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
        let l = file.logs;
        let logs = LogsConfig {
            // The kubelet's defaults: 10 MiB, 5 files, every 10 s. At least 16 KiB: containerd
            // writes a long line in 16 KiB records, so anything smaller rotates on every line.
            max_size_bytes: between("logs.max_size_kib", l.max_size_kib, 10 << 10, 16, 4 << 20)?
                << 10,
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
        let seal = SealConfig {
            key_file: file.seal.key_file,
            credential: file.seal.credential,
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
        let im = file.images;
        let mut images = crate::images::ImagesConfig::defaults(&data_dir);
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
                let p = PathBuf::from(p);
                absolute("images.drop_dir", &p)?;
                images.drop_dir = Some(p);
            }
        }
        Ok(Config {
            node_name,
            data_dir,
            kubeconfig,
            api_addr,
            cri_socket,
            log,
            sync,
            api,
            node,
            upgrade,
            report,
            logs,
            seal,
            images,
        })
    }
}

/// A numeric setting: `default` when unset, else it must lie in `min..=max`. Every numeric
/// field goes through here, so a value out of range is an error naming the field, never
/// clamped or wrapped without a word.
fn between(
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

/// Checks a `tracing` filter before it is used. `EnvFilter` reads any bare word as a target
/// to enable, so a mistyped level (`warning`, `verbose`), a level with a space (`"info "`) or
/// an empty filter parses, matches nothing edgehub logs, and silences every line, errors
/// included. A directive here is a level (`info`, `warn`, ...), or `TARGET=LEVEL`.
pub fn check_log_filter(filter: &str) -> Result<(), String> {
    use std::str::FromStr;
    use tracing_subscriber::filter::LevelFilter;
    const HINT: &str = "use a level (error, warn, info, debug, trace, off) or TARGET=LEVEL directives, e.g. \"info,edgehub::sync=debug\"";
    if filter.trim().is_empty() {
        return Err(format!(
            "the log filter is empty, which would silence every line, errors included; {HINT}"
        ));
    }
    let level = |l: &str| !l.is_empty() && LevelFilter::from_str(l).is_ok();
    for d in filter.split(',') {
        if d.is_empty() {
            return Err(format!("{filter:?} has an empty directive; {HINT}"));
        }
        if d.trim() != d {
            return Err(format!(
                "{filter:?}: directive {d:?} has spaces around it, and would match nothing; {HINT}"
            ));
        }
        match d.rsplit_once('=') {
            Some((target, l)) => {
                if target.is_empty() || !level(l) {
                    return Err(format!(
                        "{filter:?}: directive {d:?} is not TARGET=LEVEL; {HINT}"
                    ));
                }
            }
            None if level(d) => {}
            None => {
                return Err(format!(
                    "{filter:?}: {d:?} is not a log level (it would be read as a target and \
                     silence everything else, errors included); {HINT}"
                ))
            }
        }
    }
    tracing_subscriber::EnvFilter::try_new(filter)
        .map(|_| ())
        .map_err(|e| format!("{filter:?} is not a valid log filter: {e}"))
}

fn node_config(n: FileNode) -> Result<NodeConfig, ConfigError> {
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
    })
}

/// A label key: optional DNS-subdomain prefix, then a name of at most 63 characters.
fn check_label_key(k: &str) -> Result<(), String> {
    let (prefix, name) = match k.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, k),
    };
    if let Some(p) = prefix {
        crate::names::check_subdomain(p).map_err(|r| format!("prefix {r}"))?;
    }
    check_label_value(name)?;
    if name.is_empty() {
        return Err("name must not be empty".into());
    }
    Ok(())
}

/// A label value: at most 63 characters of alphanumerics, '-', '_' and '.', alphanumeric at
/// both ends.
fn check_label_value(v: &str) -> Result<(), String> {
    if v.len() > 63 {
        return Err(format!("must be at most 63 characters (got {})", v.len()));
    }
    if !v
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    {
        return Err("only letters, digits, '-', '_' and '.' are allowed".into());
    }
    let alnum = |c: Option<char>| c.is_none_or(|c| c.is_ascii_alphanumeric());
    if !(alnum(v.chars().next()) && alnum(v.chars().last())) {
        return Err("must start and end with a letter or digit".into());
    }
    Ok(())
}

/// What NodeRestriction lets a node set on itself: labels outside the kubernetes.io and k8s.io
/// namespaces, plus the kubelet's own ones. `node-role.kubernetes.io/*` is refused here, before
/// any request, with the reason.
pub fn check_node_label(k: &str, v: &str) -> Result<(), String> {
    check_label_key(k)?;
    check_label_value(v)?;
    let prefix = k.rsplit_once('/').map(|(p, _)| p).unwrap_or("");
    if prefix == "node-role.kubernetes.io" {
        return Err("NodeRestriction forbids a node to set node-role.kubernetes.io/* labels on itself; an administrator sets roles with kubectl label".into());
    }
    let restricted = prefix == "kubernetes.io"
        || prefix.ends_with(".kubernetes.io")
        || prefix == "k8s.io"
        || prefix.ends_with(".k8s.io");
    let allowed_prefix = ["kubelet.kubernetes.io", "node.kubernetes.io"]
        .iter()
        .any(|a| prefix == *a || prefix.ends_with(&format!(".{a}")));
    const WELL_KNOWN: &[&str] = &[
        "kubernetes.io/hostname",
        "kubernetes.io/arch",
        "kubernetes.io/os",
        "beta.kubernetes.io/arch",
        "beta.kubernetes.io/os",
        "beta.kubernetes.io/instance-type",
        "failure-domain.beta.kubernetes.io/region",
        "failure-domain.beta.kubernetes.io/zone",
        "topology.kubernetes.io/region",
        "topology.kubernetes.io/zone",
    ];
    if restricted && !allowed_prefix && !WELL_KNOWN.contains(&k) {
        return Err(format!(
            "NodeRestriction forbids a node to set labels in {prefix} other than the kubelet's well-known ones"
        ));
    }
    Ok(())
}

fn absolute(field: &str, p: &Path) -> Result<(), ConfigError> {
    if p.is_absolute() {
        Ok(())
    } else {
        Err(invalid(
            field,
            format!("{} must be an absolute path", p.display()),
        ))
    }
}

/// The kernel's hostname; `None` if it cannot be read.
fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve(
        file: Option<&str>,
        env: &[(&str, &str)],
        flags: &Overrides,
    ) -> Result<Config, ConfigError> {
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::resolve(
            file,
            Path::new("/etc/edgehub/config.toml"),
            &env,
            flags,
            Some("edge-1".into()),
        )
    }

    fn field_of(e: ConfigError) -> String {
        match e {
            ConfigError::Invalid { field, .. } => field,
            other => panic!("expected Invalid, got {other}"),
        }
    }

    #[test]
    fn defaults_suit_a_device() {
        let c = resolve(None, &[], &Overrides::default()).unwrap();
        assert_eq!(c.node_name, "edge-1");
        assert_eq!(c.data_dir, Path::new("/var/lib/edgehub"));
        assert_eq!(c.db_path(), Path::new("/var/lib/edgehub/edgehub.db"));
        assert_eq!(c.kubeconfig, Path::new("/etc/edgehub/kubeconfig"));
        assert_eq!(c.api_addr, Some("127.0.0.1:10267".parse().unwrap()));
        assert_eq!(c.cri_socket, Path::new("/run/containerd/containerd.sock"));
        assert!(c.sync.watch_namespaces.is_empty());
        assert_eq!(c.sync.list_page_size, 100);
    }

    #[test]
    fn flags_beat_env_beat_file() {
        let file = "node_name = \"from-file\"\ndata_dir = \"/file\"\napi_addr = \"127.0.0.1:1\"\n";
        let env = [
            ("EDGEHUB_NODE_NAME", "from-env"),
            ("EDGEHUB_DATA_DIR", "/env"),
        ];
        let flags = Overrides {
            node_name: Some("from-flag".into()),
            ..Default::default()
        };
        let c = resolve(Some(file), &env, &flags).unwrap();
        assert_eq!(c.node_name, "from-flag");
        assert_eq!(c.data_dir, Path::new("/env"));
        assert_eq!(c.api_addr, Some("127.0.0.1:1".parse().unwrap()));
    }

    #[test]
    fn sync_section_is_read() {
        let file =
            "[sync]\nwatch_namespaces = [\"vehicle\"]\nbackoff_max_secs = 5\nlist_page_size = 7\n";
        let c = resolve(Some(file), &[], &Overrides::default()).unwrap();
        assert_eq!(c.sync.watch_namespaces, ["vehicle"]);
        assert_eq!(c.sync.backoff_max, Duration::from_secs(5));
        assert_eq!(c.sync.list_page_size, 7);
    }

    #[test]
    fn invalid_values_name_the_field() {
        let cases: &[(&str, &str)] = &[
            ("node_name = \"Edge_1\"", "node_name"),
            ("data_dir = \"relative/dir\"", "data_dir"),
            ("api_addr = \"localhost\"", "api_addr"),
            ("cri_socket = \"containerd.sock\"", "cri_socket"),
            ("log = \"info,,=[\"", "log"),
            (
                "[sync]\nwatch_namespaces = [\"Bad NS\"]",
                "sync.watch_namespaces",
            ),
            ("[sync]\nbackoff_max_secs = 0", "sync.backoff_max_secs"),
            (
                "[sync]\nbackoff_initial_ms = 9000\nbackoff_max_secs = 1",
                "sync.backoff_initial_ms",
            ),
            ("[sync]\nmax_event_bytes = 10", "sync.max_event_bytes"),
            ("[sync]\nlist_page_size = 0", "sync.list_page_size"),
            ("[api]\nsocket = \"rel.sock\"", "api.socket"),
            ("[api]\nsocket_mode = \"999\"", "api.socket_mode"),
            ("[api]\nsocket_mode = \"01777\"", "api.socket_mode"),
            ("[api]\ntoken_file = \"token\"", "api.token_file"),
            ("[api]\nsocket_group = \"a:b\"", "api.socket_group"),
        ];
        for (file, field) in cases {
            let e = resolve(Some(file), &[], &Overrides::default()).unwrap_err();
            let msg = e.to_string();
            assert_eq!(field_of(e), *field, "{file}: {msg}");
        }
    }

    #[test]
    fn unknown_and_mistyped_keys_are_parse_errors() {
        for file in [
            "nodename = \"x\"",
            "[sync]\nlist_page_size = \"ten\"",
            "this is = not toml [",
        ] {
            let e = resolve(Some(file), &[], &Overrides::default()).unwrap_err();
            assert!(matches!(e, ConfigError::Parse { .. }), "{file}: {e}");
            assert!(e.to_string().contains("/etc/edgehub/config.toml"));
        }
    }

    #[test]
    fn bad_hostname_asks_for_node_name() {
        let e = Config::resolve(
            None,
            Path::new("x"),
            &[],
            &Overrides::default(),
            Some("My_Laptop".into()),
        )
        .unwrap_err();
        assert!(e.to_string().contains("set node_name"), "{e}");
        let e =
            Config::resolve(None, Path::new("x"), &[], &Overrides::default(), None).unwrap_err();
        assert_eq!(field_of(e), "node_name");
    }

    #[test]
    fn node_section_is_read_and_checked() {
        let file = "[node]\nmax_pods = 32\nlabels = { \"openyurt.io/is-edge-worker\" = \"true\", \"node.kubernetes.io/instance-type\" = \"vehicle-ecu\" }\ntaints = [{ key = \"edge\", value = \"true\", effect = \"NoSchedule\" }]\n";
        let c = resolve(Some(file), &[], &Overrides::default()).unwrap();
        assert_eq!(c.node.max_pods, 32);
        assert_eq!(c.node.labels.len(), 2);
        assert_eq!(c.node.taints[0].effect, "NoSchedule");
        let d = resolve(None, &[], &Overrides::default()).unwrap().node;
        assert_eq!(
            (d.max_pods, d.lease_renew, d.lease_duration_secs),
            (110, Duration::from_secs(10), 40)
        );
        assert_eq!(d.status_report, Duration::from_secs(300));

        for (file, field, why) in [
            (
                "[node]\nlabels = { \"node-role.kubernetes.io/edge\" = \"\" }",
                "node.labels",
                "node-role.kubernetes.io",
            ),
            (
                "[node]\nlabels = { \"kubernetes.io/custom\" = \"x\" }",
                "node.labels",
                "NodeRestriction",
            ),
            ("[node]\nlabels = { \"a/b/c\" = \"x\" }", "node.labels", ""),
            (
                "[node]\nlabels = { \"ok\" = \"bad value!\" }",
                "node.labels",
                "",
            ),
            (
                "[node]\ntaints = [{ key = \"k\", effect = \"Sometimes\" }]",
                "node.taints",
                "NoSchedule",
            ),
            ("[node]\nlease_renew_secs = 40", "node.lease_renew_secs", ""),
            ("[node]\nmax_pods = 0", "node.max_pods", ""),
            (
                "[node]\ndisk_pressure_percent = 101",
                "node.disk_pressure_percent",
                "",
            ),
        ] {
            let e = resolve(Some(file), &[], &Overrides::default()).unwrap_err();
            let msg = e.to_string();
            assert_eq!(field_of(e), field, "{file}");
            assert!(msg.contains(why), "{msg}");
        }
        for ok in [
            "kubernetes.io/hostname",
            "node.kubernetes.io/instance-type",
            "kubelet.kubernetes.io/x",
            "example.com/team",
            "plain",
        ] {
            assert!(check_node_label(ok, "v").is_ok(), "{ok}");
        }
    }

    #[test]
    fn tcp_can_be_turned_off_when_the_socket_is_set() {
        let c = resolve(
            Some("api_addr = \"none\"\n[api]\nsocket = \"/run/edgehub/api.sock\"\n"),
            &[],
            &Overrides::default(),
        )
        .unwrap();
        assert_eq!(c.api_addr, None);
        let flag = Overrides {
            api_addr: Some("none".into()),
            ..Default::default()
        };
        assert_eq!(
            field_of(resolve(None, &[], &flag).unwrap_err()),
            "api_addr",
            "no socket: nothing could reach the API"
        );
    }

    #[test]
    fn seal_section_is_read_and_checked() {
        let c = resolve(
            Some("[seal]\nkey_file = \"/mnt/protected/edgehub.key\"\ncredential = \"k\"\n"),
            &[],
            &Overrides::default(),
        )
        .unwrap();
        assert_eq!(
            c.seal.key_file.as_deref(),
            Some(Path::new("/mnt/protected/edgehub.key"))
        );
        assert_eq!(c.seal.credential.as_deref(), Some("k"));
        assert_eq!(
            resolve(None, &[], &Overrides::default()).unwrap().seal,
            SealConfig::default()
        );
        for bad in [
            "[seal]\nkey_file = \"rel.key\"",
            "[seal]\ncredential = \"a/b\"",
            "[seal]\ncredential = \"\"",
        ] {
            let f = field_of(resolve(Some(bad), &[], &Overrides::default()).unwrap_err());
            assert!(f.starts_with("seal."), "{bad}: {f}");
        }
    }

    #[test]
    fn api_section_is_read() {
        let file = "[api]\nsocket = \"/run/edgehub/api.sock\"\nsocket_mode = \"0600\"\nsocket_group = \"ota\"\ntoken_file = \"/etc/edgehub/api-token\"\n";
        let c = resolve(Some(file), &[], &Overrides::default()).unwrap();
        assert_eq!(
            c.api.socket.as_deref(),
            Some(Path::new("/run/edgehub/api.sock"))
        );
        assert_eq!(c.api.socket_mode, 0o600);
        assert_eq!(c.api.socket_group.as_deref(), Some("ota"));
        assert_eq!(
            c.api.token_file.as_deref(),
            Some(Path::new("/etc/edgehub/api-token"))
        );
        let d = resolve(None, &[], &Overrides::default()).unwrap();
        assert_eq!(
            d.api,
            ApiConfig {
                socket_mode: 0o660,
                ..Default::default()
            }
        );
    }

    #[test]
    fn mistyped_log_filters_are_refused() {
        for bad in [
            "warning",
            "verbose",
            "info ",
            " info",
            "",
            "  ",
            "edgehub",
            "edgehub=verbose",
            "info,",
            "=debug",
            "edgehub::sync=",
        ] {
            let e =
                resolve(Some(&format!("log = {bad:?}")), &[], &Overrides::default()).unwrap_err();
            let msg = e.to_string();
            assert_eq!(field_of(e), "log", "{bad:?}: {msg}");
        }
        // From the environment and the flag too: an empty EDGEHUB_LOG is not "the default".
        let e = resolve(None, &[("EDGEHUB_LOG", "")], &Overrides::default()).unwrap_err();
        assert!(e.to_string().contains("empty"), "{e}");
        let flags = Overrides {
            log: Some("warning".into()),
            ..Default::default()
        };
        let e = resolve(None, &[], &flags).unwrap_err();
        assert!(
            e.to_string().contains("\"warning\" is not a log level"),
            "{e}"
        );
        for good in [
            "info",
            "WARN",
            "off",
            "3",
            "info,edgehub::sync=debug",
            "edgehub=trace,hyper=warn",
            "warn,edgehub::runtime[pass]=debug",
        ] {
            let c = resolve(Some(&format!("log = {good:?}")), &[], &Overrides::default());
            assert!(c.is_ok(), "{good:?}: {:?}", c.err());
        }
    }

    #[test]
    fn every_numeric_field_is_bounded() {
        // Each of these was wrapped or clamped without a word before.
        for (file, field) in [
            (
                "[node]\nmemory_reserve_mib = 17592186044416",
                "node.memory_reserve_mib",
            ),
            (
                "[node]\nmemory_pressure_mib = 17592186044416",
                "node.memory_pressure_mib",
            ),
            (
                "[upgrade]\nmin_ready_floor_secs = 86400",
                "upgrade.min_ready_floor_secs",
            ),
            (
                "[report]\nreconnect_jitter_secs = 86400",
                "report.reconnect_jitter_secs",
            ),
            ("[report]\nmax_rate = 1000000", "report.max_rate"),
            ("[node]\nstatus_report_secs = 0", "node.status_report_secs"),
            (
                "[node]\nstatus_report_secs = 9999999",
                "node.status_report_secs",
            ),
            (
                "[node]\nlease_duration_secs = 99999",
                "node.lease_duration_secs",
            ),
            ("[node]\nlease_renew_secs = 0", "node.lease_renew_secs"),
            ("[logs]\nmax_size_kib = 1", "logs.max_size_kib"),
            ("[logs]\nmax_files = 1", "logs.max_files"),
            (
                "[logs]\nmonitor_interval_secs = 0",
                "logs.monitor_interval_secs",
            ),
        ] {
            let e = resolve(Some(file), &[], &Overrides::default()).unwrap_err();
            let msg = e.to_string();
            assert_eq!(field_of(e), field, "{file}: {msg}");
            assert!(msg.contains("must be between"), "{msg}");
        }
        let d = resolve(None, &[], &Overrides::default()).unwrap();
        assert_eq!(d.node.memory_reserve_bytes, 256 << 20);
        assert_eq!(d.upgrade.min_ready_floor, Duration::from_secs(2));
        assert_eq!(d.report.reconnect_jitter, Duration::from_secs(30));
        assert_eq!(
            d.logs,
            LogsConfig {
                max_size_bytes: 10 << 20,
                max_files: 5,
                monitor_interval: Duration::from_secs(10),
            }
        );
        // The edges are allowed.
        let c = resolve(
            Some("[node]\nmemory_reserve_mib = 1048576\n[upgrade]\nmin_ready_floor_secs = 0\n[report]\nreconnect_jitter_secs = 0\n[logs]\nmax_size_kib = 16\nmax_files = 2\n"),
            &[],
            &Overrides::default(),
        )
        .unwrap();
        assert_eq!(c.node.memory_reserve_bytes, 1 << 40);
        assert_eq!((c.logs.max_size_bytes, c.logs.max_files), (16 << 10, 2));
    }

    #[test]
    fn env_overrides_apply() {
        let env = [
            ("EDGEHUB_KUBECONFIG", "/k"),
            ("EDGEHUB_API_ADDR", "0.0.0.0:9"),
            ("EDGEHUB_CRI_SOCKET", "/run/x.sock"),
            ("EDGEHUB_LOG", "debug"),
        ];
        let c = resolve(None, &env, &Overrides::default()).unwrap();
        assert_eq!(c.kubeconfig, Path::new("/k"));
        assert_eq!(c.api_addr, Some("0.0.0.0:9".parse().unwrap()));
        assert_eq!(c.cri_socket, Path::new("/run/x.sock"));
        assert_eq!(c.log, "debug");
    }
}
