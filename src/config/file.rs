//! The file's shape, as serde reads it: every field optional, unknown fields refused.

use super::Taint;
use serde::Deserialize;
use std::path::PathBuf;

/// The config file's shape. Every field is optional; unknown fields are errors, so a typo does
/// not silently fall back to a default.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileConfig {
    pub(super) node_name: Option<String>,
    pub(super) data_dir: Option<PathBuf>,
    pub(super) kubeconfig: Option<PathBuf>,
    pub(super) api_addr: Option<String>,
    pub(super) cri_socket: Option<PathBuf>,
    pub(super) log: Option<String>,
    #[serde(default)]
    pub(super) sync: FileSync,
    #[serde(default)]
    pub(super) api: FileApi,
    #[serde(default)]
    pub(super) node: FileNode,
    #[serde(default)]
    pub(super) upgrade: FileUpgrade,
    #[serde(default)]
    pub(super) report: FileReport,
    #[serde(default)]
    pub(super) logs: FileLogs,
    #[serde(default)]
    pub(super) seal: FileSeal,
    #[serde(default)]
    pub(super) images: FileImages,
    #[serde(default)]
    pub(super) identity: FileIdentity,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileImages {
    pub(super) max_archive_mib: Option<u64>,
    pub(super) reserve_mib: Option<u64>,
    /// A path, or "none" for no drop directory.
    pub(super) drop_dir: Option<String>,
    pub(super) drop_interval_secs: Option<u64>,
    pub(super) gc_keep_previous: Option<bool>,
    pub(super) gc_high_percent: Option<u64>,
    pub(super) gc_low_percent: Option<u64>,
    pub(super) gc_interval_secs: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileIdentity {
    pub(super) bootstrap_kubeconfig: Option<PathBuf>,
    pub(super) cert_expiration_secs: Option<u64>,
    pub(super) factory_key_file: Option<PathBuf>,
    pub(super) factory_cert_file: Option<PathBuf>,
    pub(super) node_name_file: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileSeal {
    pub(super) key_file: Option<PathBuf>,
    pub(super) credential: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileLogs {
    pub(super) max_size_kib: Option<u64>,
    pub(super) max_files: Option<u64>,
    pub(super) monitor_interval_secs: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileReport {
    pub(super) mode: Option<String>,
    pub(super) adopt_timeout_secs: Option<u64>,
    pub(super) reconnect_jitter_secs: Option<u64>,
    pub(super) max_rate: Option<u32>,
    pub(super) retry_max_secs: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileUpgrade {
    pub(super) inputs_timeout_secs: Option<u64>,
    pub(super) pull_timeout_secs: Option<u64>,
    pub(super) swap_timeout_secs: Option<u64>,
    pub(super) verify_timeout_secs: Option<u64>,
    pub(super) commit_timeout_secs: Option<u64>,
    pub(super) rollback_timeout_secs: Option<u64>,
    pub(super) min_ready_floor_secs: Option<u64>,
    pub(super) prepull: Option<bool>,
    pub(super) manual_commit_deadline_secs: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileNode {
    pub(super) labels: Option<std::collections::BTreeMap<String, String>>,
    pub(super) taints: Option<Vec<Taint>>,
    pub(super) max_pods: Option<u32>,
    pub(super) memory_reserve_mib: Option<u64>,
    pub(super) lease_renew_secs: Option<u64>,
    pub(super) lease_duration_secs: Option<u32>,
    pub(super) status_report_secs: Option<u64>,
    pub(super) memory_pressure_mib: Option<u64>,
    pub(super) disk_pressure_percent: Option<u8>,
    pub(super) pid_pressure_percent: Option<u8>,
    pub(super) node_api_addr: Option<String>,
    pub(super) node_api_client_ca_file: Option<PathBuf>,
    pub(super) node_api_self_signed: Option<bool>,
    pub(super) node_api_max_connections: Option<u64>,
    pub(super) node_api_max_streams: Option<u64>,
    pub(super) node_api_idle_timeout_secs: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileApi {
    pub(super) socket: Option<PathBuf>,
    pub(super) socket_mode: Option<String>,
    pub(super) socket_group: Option<String>,
    pub(super) token_file: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileSync {
    pub(super) watch_namespaces: Option<Vec<String>>,
    pub(super) cursor_checkpoint_secs: Option<u64>,
    pub(super) backoff_initial_ms: Option<u64>,
    pub(super) backoff_max_secs: Option<u64>,
    pub(super) request_timeout_secs: Option<u64>,
    pub(super) watch_idle_timeout_secs: Option<u64>,
    pub(super) max_event_bytes: Option<usize>,
    pub(super) list_page_size: Option<u32>,
}
