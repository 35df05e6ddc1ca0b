//! What `/stats/summary` says beyond the CRI's CPU and memory, sampled from the runtime and
//! the host (I/O, at the edge): the runtime's image filesystem, the sandboxes' network
//! namespaces, the node's filesystems, and each pod's log files and emptyDir volumes.

use super::stats::ContainerSample;
use super::summary::{Extra, PodExtra};
use super::usage::{self, ImageFs};
use crate::cri::{api, labels};
use std::collections::BTreeMap;

fn now_nanos() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

/// Samples what `/stats/summary` says beyond CPU and memory, for the pods of `containers`
/// and this node's ready sandboxes: the runtime's image filesystem and the sandboxes' pids
/// from the CRI, then (on the blocking pool) the filesystems, the log and emptyDir files
/// under `data_dir`, and the network namespaces. What cannot be read is left out.
pub async fn sample_extra(
    cri: Option<&crate::cri::CriClient>,
    node_name: &str,
    data_dir: &std::path::Path,
    containers: &[ContainerSample],
) -> Extra {
    use crate::cri::CriRuntime;
    let at_nanos = now_nanos();
    let mut image_fs: Option<(ImageFs, Option<String>)> = None;
    // By pod UID: the sandbox's pid and creation time.
    let mut by_pod: BTreeMap<String, (Option<u32>, Option<i64>)> = containers
        .iter()
        .map(|c| (c.pod_uid.clone(), (None, None)))
        .collect();
    if let Some(cri) = cri {
        match cri.image_fs_info().await {
            Ok(fss) => {
                // The first, as the kubelet reports it.
                image_fs = fss.first().map(|f| {
                    let fs = ImageFs {
                        at_nanos: f.timestamp,
                        used_bytes: f.used_bytes.as_ref().map(|v| v.value),
                        inodes_used: f.inodes_used.as_ref().map(|v| v.value),
                        fs: None,
                    };
                    let mountpoint = f.fs_id.as_ref().map(|i| i.mountpoint.clone());
                    (fs, mountpoint.filter(|m| !m.is_empty()))
                })
            }
            Err(e) => tracing::debug!(error = %e, "node API: ImageFsInfo failed"),
        }
        let filter =
            std::collections::HashMap::from([(labels::NODE.to_string(), node_name.to_string())]);
        match cri.list_pod_sandbox(filter).await {
            Ok(sandboxes) => {
                for sb in sandboxes
                    .iter()
                    .filter(|s| s.state == api::PodSandboxState::SandboxReady as i32)
                {
                    let Some(uid) = sb.labels.get(labels::POD_UID) else {
                        continue;
                    };
                    match cri.sandbox_pid(&sb.id).await {
                        Ok(pid) => {
                            by_pod.insert(uid.clone(), (pid, Some(sb.created_at)));
                        }
                        Err(e) => {
                            tracing::debug!(error = %e, sandbox = %sb.id, "node API: PodSandboxStatus failed")
                        }
                    }
                }
            }
            Err(e) => tracing::debug!(error = %e, "node API: ListPodSandbox failed"),
        }
    }
    let mounts: std::collections::BTreeSet<String> = containers
        .iter()
        .filter_map(|c| c.rootfs_mountpoint.clone())
        .collect();
    let data_dir = data_dir.to_path_buf();
    let job = tokio::task::spawn_blocking(move || {
        let pods = by_pod
            .into_iter()
            .filter_map(|(uid, (pid, created_nanos))| {
                let dir = crate::logs::pod_log_dir(&data_dir, &uid)?;
                let empty_dirs = dir.parent()?.join("volumes/empty-dir");
                let volumes = std::fs::read_dir(&empty_dirs)
                    .into_iter()
                    .flatten()
                    .flatten()
                    .map(|e| {
                        (
                            e.file_name().to_string_lossy().into_owned(),
                            usage::du(&e.path()),
                        )
                    })
                    .collect();
                let extra = PodExtra {
                    logs: usage::logs_by_container(&usage::log_files(&dir)),
                    volumes,
                    network: pid.and_then(|p| usage::net_of(Some(p), at_nanos)),
                    created_nanos,
                };
                Some((uid, extra))
            })
            .collect();
        Extra {
            at_nanos,
            node_fs: crate::mountns::fs_stats(&data_dir),
            image_fs: image_fs.map(|(mut i, mountpoint)| {
                i.fs = mountpoint.and_then(|m| crate::mountns::fs_stats(std::path::Path::new(&m)));
                i
            }),
            node_network: usage::net_of(None, at_nanos),
            mounts: mounts
                .into_iter()
                .filter_map(|m| {
                    Some((
                        m.clone(),
                        crate::mountns::fs_stats(std::path::Path::new(&m))?,
                    ))
                })
                .collect(),
            pods,
        }
    });
    match job.await {
        Ok(e) => e,
        Err(e) => {
            tracing::warn!(error = %e, "node API: sampling the disks failed");
            Extra::default()
        }
    }
}
