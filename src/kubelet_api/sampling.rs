//! What `/stats/summary` says beyond the CRI's CPU and memory, sampled from the runtime and
//! the host (I/O, at the edge): the runtime's image filesystem, the sandboxes' network
//! namespaces, the node's filesystems, and each pod's log files and emptyDir volumes.
//!
//! A pod decides how many files its emptyDirs hold, so walking them is bounded: a volume's
//! measure is reused for [`VOLUME_FRESH`] (the kubelet's housekeeping measures as seldom),
//! however often the summary is asked for, and one walk visits at most
//! [`WALK_MAX_ENTRIES`] entries (past that the volume's usage is a lower bound, logged).

use super::stats::ContainerSample;
use super::summary::{Extra, PodExtra};
use super::usage::{self, ImageFs, Usage};
use crate::cri::{api, labels};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a volume's measure is reused.
pub const VOLUME_FRESH: Duration = Duration::from_secs(15);
/// The most entries (files, directories, links) one walk of a volume visits.
pub const WALK_MAX_ENTRIES: u64 = 100_000;

/// The emptyDir volumes measured lately, by path, with when.
#[derive(Debug, Default)]
pub struct Volumes {
    measured: Mutex<HashMap<PathBuf, (Instant, Usage)>>,
}

impl Volumes {
    pub fn new() -> Arc<Volumes> {
        Arc::new(Volumes::default())
    }
}

/// `path`'s usage: measured within [`VOLUME_FRESH`] of `now`, or walked now (blocking).
fn volume_usage(
    measured: &mut HashMap<PathBuf, (Instant, Usage)>,
    path: &Path,
    now: Instant,
) -> Usage {
    if let Some((at, u)) = measured.get(path) {
        if now.saturating_duration_since(*at) < VOLUME_FRESH {
            return *u;
        }
    }
    let walk = usage::du(path, WALK_MAX_ENTRIES);
    if !walk.complete {
        tracing::info!(volume = %path.display(), entries = WALK_MAX_ENTRIES,
            "node API: an emptyDir holds more entries than one walk visits; its usage is a lower bound");
    }
    measured.insert(path.to_path_buf(), (now, walk.usage));
    walk.usage
}

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
    volumes: &Arc<Volumes>,
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
    let volumes = volumes.clone();
    let job = tokio::task::spawn_blocking(move || {
        // Held for the whole sample: a second summary asked meanwhile waits, then finds
        // the volumes measured instead of walking them again.
        let mut measured = volumes.measured.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        // Volumes of pods gone, or not asked about for a while.
        measured.retain(|_, (at, _)| now.saturating_duration_since(*at) < VOLUME_FRESH * 4);
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
                            volume_usage(&mut measured, &e.path(), now),
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

#[cfg(test)]
mod tests {
    use super::super::stats::tests::sample;
    use super::super::usage::Usage;
    use super::*;

    const UID: &str = "6f1c0a52-8c1e-4bde-9a77-0f8a3a1f0a01";

    fn files(dir: &std::path::Path, from: usize, to: usize) {
        std::fs::create_dir_all(dir).unwrap();
        for i in from..to {
            std::fs::File::create(dir.join(format!("f{i}"))).unwrap();
        }
    }

    async fn volume(data: &std::path::Path, name: &str, volumes: &Arc<Volumes>) -> Usage {
        let mut c = sample("app", 1, 1);
        c.pod_uid = UID.into();
        let extra = sample_extra(None, "edge-1", data, &[c], volumes).await;
        extra.pods[UID].volumes[name]
    }

    /// Issue 31: every `/stats/summary` walked every emptyDir again, with no cache and no
    /// limit: a pod with millions of files made each scrape expensive. A volume measured is
    /// reused for 15 s, as the kubelet's housekeeping does.
    #[tokio::test]
    async fn a_volume_is_walked_at_most_once_in_15_seconds() {
        let data = tempfile::tempdir().unwrap();
        let vol = data
            .path()
            .join(format!("pods/{UID}/volumes/empty-dir/data"));
        files(&vol, 0, 10);
        let volumes = Volumes::new();
        let first = volume(data.path(), "data", &volumes).await;
        assert_eq!(first.inodes, 11);
        files(&vol, 10, 1000);
        assert_eq!(
            volume(data.path(), "data", &volumes).await,
            first,
            "walked again"
        );
        // Measured 15 s ago: walked again.
        for (at, _) in volumes.measured.lock().unwrap().values_mut() {
            *at -= VOLUME_FRESH;
        }
        assert_eq!(volume(data.path(), "data", &volumes).await.inodes, 1001);
    }

    /// One walk visits at most [`WALK_MAX_ENTRIES`] (100 000) entries.
    #[tokio::test]
    async fn a_volume_walk_is_bounded() {
        let data = tempfile::tempdir().unwrap();
        let vol = data
            .path()
            .join(format!("pods/{UID}/volumes/empty-dir/big"));
        files(&vol, 0, 100_100);
        let got = volume(data.path(), "big", &Volumes::new()).await;
        assert!(got.inodes <= WALK_MAX_ENTRIES, "{got:?}");
    }
}
