//! Container log rotation, as the kubelet's container log manager does it
//! (`pkg/kubelet/logs/container_log_manager.go`), since no kubelet runs beside edgehub and
//! the runtime never rotates a log itself: without this a chatty container fills the flash
//! the database lives on.
//!
//! Every `monitor_interval`, for each running container of this node's edgehub:
//! - its log path is asked of the runtime (ContainerStatus); a log that is missing (a
//!   rotation cut short) is reopened;
//! - once the log is `max_size` large it is rotated: leftovers of an earlier rotation are
//!   removed (`*.tmp`, and uncompressed files whose `.gz` exists), then the oldest rotated
//!   files beyond `max_files - 2`, the rest is gzip-compressed, and the log is renamed to
//!   `<log>.<YYYYMMDD-hhmmss>` and the runtime told to reopen it (ReopenContainerLog); the
//!   rename is undone if it cannot. So at most `max_files` files exist per container attempt:
//!   the one being written, the newest rotated one uncompressed (a reader following the log
//!   may still be reading it), and older ones compressed.
//!
//! The kubelet also removes a container's logs when it removes the container, keeping the
//! newest dead one per container for `kubectl logs --previous`. edgehub keeps the current
//! attempt's logs and the previous attempt's: older attempts' files (rotated ones included)
//! are removed, never those of an attempt the runtime still has a container for.
//!
//! The timestamp is UTC (the kubelet formats its local time; a device's clock is UTC).

use crate::cri::{api, CriError, CriRuntime};
use crate::pod::observe;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio::sync::watch;

/// The suffix of a compressed rotated log.
pub const COMPRESSED: &str = ".gz";
/// The suffix of a file being compressed.
pub const TEMPORARY: &str = ".tmp";

/// When a container's log is rotated and how many of its files are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    pub max_size: u64,
    /// Files per container attempt, the one being written included (at least 2).
    pub max_files: usize,
}

impl Policy {
    pub fn from_config(c: &super::LogsConfig) -> Policy {
        Policy {
            max_size: c.max_size_bytes,
            max_files: c.max_files,
        }
    }
}

/// What rotating one log does, decided from the names of the files beside it.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Rotation {
    /// Leftovers and rotated files beyond the limit, oldest first.
    pub remove: Vec<String>,
    /// Rotated files to gzip (each becomes `<name>.gz`).
    pub compress: Vec<String>,
    /// The name the log is renamed to.
    pub rotated: String,
}

/// The kubelet's `rotateLog` as a pure function: `log` is the log file's name, `names` the
/// names in its directory, `stamp` the rotation's timestamp.
pub fn plan(log: &str, names: &[String], policy: Policy, stamp: &str) -> Rotation {
    let prefix = format!("{log}.");
    let ours: Vec<&String> = names.iter().filter(|n| n.starts_with(&prefix)).collect();
    let mut remove = Vec::new();
    let mut in_use: Vec<&String> = Vec::new();
    for n in &ours {
        let compressed_too = || ours.iter().any(|o| **o == format!("{n}{COMPRESSED}"));
        if n.ends_with(TEMPORARY) || (!n.ends_with(COMPRESSED) && compressed_too()) {
            remove.push((*n).clone());
        } else {
            in_use.push(n);
        }
    }
    in_use.sort();
    // The log being written and the one rotated now come on top of these.
    let keep = policy.max_files.saturating_sub(2);
    let excess = in_use.len().saturating_sub(keep);
    remove.extend(in_use[..excess].iter().map(|n| (*n).clone()));
    let compress = in_use[excess..]
        .iter()
        .filter(|n| !n.ends_with(COMPRESSED))
        .map(|n| (*n).clone())
        .collect();
    Rotation {
        remove,
        compress,
        rotated: format!("{log}.{stamp}"),
    }
}

/// `20261130-231243`: the kubelet's timestamp format (`20060102-150405`), in UTC.
pub fn stamp(t: SystemTime) -> String {
    let r = crate::time::rfc3339(t);
    let d = |a: usize, b: usize| r.get(a..b).unwrap_or("00");
    format!(
        "{}{}{}-{}{}{}",
        d(0, 4),
        d(5, 7),
        d(8, 10),
        d(11, 13),
        d(14, 16),
        d(17, 19)
    )
}

/// `<container>_<attempt>.log`, or a rotated file of it (`<container>_<attempt>.log.<...>`).
pub fn parse_any_file_name(name: &str) -> Option<(&str, u32)> {
    let at = name.find(".log")?;
    let rest = &name[at + 4..];
    if !(rest.is_empty() || rest.starts_with('.')) {
        return None;
    }
    super::parse_file_name(&name[..at + 4])
}

/// The files of old attempts in one pod's log dir: per container, everything but the two
/// newest attempts (the current one, and the previous for `--previous`) and the attempts in
/// `live` (the runtime still has a container for them).
pub fn stale_attempts(names: &[String], live: &HashSet<(String, u32)>) -> Vec<String> {
    let mut by_container: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
    for n in names {
        if let Some((c, a)) = parse_any_file_name(n) {
            by_container.entry(c).or_default().push(a);
        }
    }
    let mut keep: HashSet<(&str, u32)> = HashSet::new();
    for (c, attempts) in &mut by_container {
        attempts.sort_unstable();
        attempts.dedup();
        for a in attempts.iter().rev().take(2) {
            keep.insert((c, *a));
        }
    }
    names
        .iter()
        .filter(|n| {
            parse_any_file_name(n).is_some_and(|(c, a)| {
                !keep.contains(&(c, a)) && !live.contains(&(c.to_string(), a))
            })
        })
        .cloned()
        .collect()
}

/// Gzips `path` to `<path>.gz` (through `<path>.gz.tmp`, renamed when complete), then
/// removes `path`, as the kubelet's compressLog does.
pub fn compress(path: &Path) -> io::Result<()> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let mode = std::fs::metadata(path)?.permissions().mode() & 0o777;
    let mut src = std::fs::File::open(path)?;
    let mut gz = path.as_os_str().to_owned();
    gz.push(COMPRESSED);
    let gz = PathBuf::from(gz);
    let mut tmp = gz.as_os_str().to_owned();
    tmp.push(TEMPORARY);
    let tmp = PathBuf::from(tmp);
    let result = (|| {
        let out = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode)
            .open(&tmp)?;
        let mut enc = flate2::write::GzEncoder::new(out, flate2::Compression::default());
        io::copy(&mut src, &mut enc)?;
        enc.finish()?.sync_all()?;
        std::fs::rename(&tmp, &gz)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result?;
    std::fs::remove_file(path)
}

/// What a pass did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PassStats {
    pub rotated: usize,
    pub compressed: usize,
    /// Rotated files beyond the limit, leftovers, and old attempts' files.
    pub removed: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum RotateError {
    #[error(transparent)]
    Cri(#[from] CriError),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

fn io_at(path: &Path) -> impl FnOnce(io::Error) -> RotateError + '_ {
    move |source| RotateError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// What a pass keeps for the next, so that an idle node's pass every 10 s asks the runtime
/// one list and nothing per container (the kubelet asks each container's status each time).
#[derive(Debug, Default)]
struct Memo {
    /// Each running container's log path: the runtime fixes it when the container is created.
    log_paths: HashMap<String, String>,
    /// The containers (per pod uid: name and attempt) the last prune of old attempts kept.
    pruned: Option<BTreeMap<String, HashSet<(String, u32)>>>,
    passes_since_prune: u32,
}

/// With the same containers, the old attempts are looked for again every this many passes
/// (a minute at the kubelet's 10 s).
const PRUNE_EVERY: u32 = 6;

/// Runs the rotation of this node's containers' logs.
pub struct Manager<R> {
    pub cri: Arc<R>,
    pub node_name: String,
    pub data_dir: PathBuf,
    pub policy: Policy,
    pub interval: Duration,
}

impl<R: CriRuntime + 'static> Manager<R> {
    /// A pass every `interval` until shutdown.
    pub async fn run(self, mut shutdown: watch::Receiver<bool>) {
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failing = false;
        let mut memo = Memo::default();
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = shutdown.changed() => break,
            }
            match self.pass_with(&mut memo).await {
                Ok(stats) => {
                    failing = false;
                    if stats != PassStats::default() {
                        tracing::debug!(?stats, "container logs rotated");
                    }
                }
                // The runtime being down is said by its health monitor; once here is enough.
                Err(e) if !failing => {
                    failing = true;
                    tracing::warn!(error = %e, "cannot check the container logs for rotation");
                }
                Err(_) => {}
            }
        }
    }

    /// One pass over the node's containers, then their pods' old attempts.
    pub async fn pass(&self) -> Result<PassStats, CriError> {
        self.pass_with(&mut Memo::default()).await
    }

    async fn pass_with(&self, memo: &mut Memo) -> Result<PassStats, CriError> {
        let containers: Vec<api::Container> = self
            .cri
            .list_containers(observe::managed(&self.node_name))
            .await?
            .into_iter()
            .filter(|c| observe::is_managed(&c.labels, &self.node_name))
            .collect();
        let mut stats = PassStats::default();
        for c in &containers {
            if c.state != api::ContainerState::ContainerRunning as i32 {
                continue;
            }
            match self.check(&c.id, memo).await {
                Ok(s) => {
                    stats.rotated += s.rotated;
                    stats.compressed += s.compressed;
                    stats.removed += s.removed;
                }
                Err(RotateError::Cri(e)) if e.is_unavailable() => return Err(e),
                // One container's trouble does not hold up the others'.
                Err(e) => {
                    tracing::warn!(container_id = %c.id, error = %e, "cannot rotate the container's log")
                }
            }
        }
        let mut live: BTreeMap<String, HashSet<(String, u32)>> = BTreeMap::new();
        for c in &containers {
            let uid = c.labels.get(crate::cri::labels::POD_UID).cloned();
            if let (Some(uid), Some(m)) = (uid, &c.metadata) {
                live.entry(uid)
                    .or_default()
                    .insert((m.name.clone(), m.attempt));
            }
        }
        memo.log_paths
            .retain(|id, _| containers.iter().any(|c| c.id == *id));
        // Old attempts appear when a container is replaced, which changes this set; a new
        // attempt's log may come a moment after the container is listed, so the prune also
        // runs every `PRUNE_EVERY` passes while the set stays the same.
        memo.passes_since_prune += 1;
        if memo.pruned.as_ref() != Some(&live) || memo.passes_since_prune >= PRUNE_EVERY {
            memo.passes_since_prune = 0;
            let pods = self.data_dir.join("pods");
            let kept = live.clone();
            let removed = tokio::task::spawn_blocking(move || prune_old_attempts(&pods, &kept))
                .await
                .unwrap_or(0);
            stats.removed += removed;
            memo.pruned = Some(live);
        }
        Ok(stats)
    }

    /// The kubelet's per-container step: stat the log (reopen a missing one), rotate it once
    /// it is large enough.
    async fn check(&self, id: &str, memo: &mut Memo) -> Result<PassStats, RotateError> {
        let log_path = match memo.log_paths.get(id) {
            Some(p) => p.clone(),
            None => {
                let Some(status) = self.cri.container_status(id).await? else {
                    return Ok(PassStats::default());
                };
                memo.log_paths
                    .insert(id.to_string(), status.log_path.clone());
                status.log_path
            }
        };
        let path = PathBuf::from(&log_path);
        // Only logs in the pods' directories: anything else is not edgehub's to rename.
        if log_path.is_empty() || !path.starts_with(self.data_dir.join("pods")) {
            return Ok(PassStats::default());
        }
        let size = match std::fs::metadata(&path) {
            Ok(m) => m.len(),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                // A rotation cut short (a crash between the rename and the reopen).
                self.cri.reopen_container_log(id).await?;
                std::fs::metadata(&path).map_err(io_at(&path))?.len()
            }
            Err(e) => return Err(io_at(&path)(e)),
        };
        if size < self.policy.max_size {
            return Ok(PassStats::default());
        }
        self.rotate(id, &path).await
    }

    async fn rotate(&self, id: &str, path: &Path) -> Result<PassStats, RotateError> {
        let (Some(dir), Some(name)) = (
            path.parent().map(Path::to_path_buf),
            path.file_name()
                .and_then(|n| n.to_str())
                .map(str::to_string),
        ) else {
            return Ok(PassStats::default());
        };
        let policy = self.policy;
        let now = SystemTime::now();
        let prepared = {
            let dir = dir.clone();
            tokio::task::spawn_blocking(move || prepare(&dir, &name, policy, now))
        };
        let (stats, rotated) = match prepared.await {
            Ok(r) => r?,
            Err(e) => {
                return Err(RotateError::Io {
                    path: path.to_path_buf(),
                    source: io::Error::other(e),
                })
            }
        };
        let Some(rotated) = rotated else {
            return Ok(stats);
        };
        std::fs::rename(path, &rotated).map_err(io_at(path))?;
        if let Err(e) = self.cri.reopen_container_log(id).await {
            // Renamed back, to try again next pass: the container still writes to it.
            if let Err(back) = std::fs::rename(&rotated, path) {
                tracing::error!(log = %path.display(), error = %back, "cannot rename a rotated log back");
            }
            return Err(e.into());
        }
        tracing::debug!(container_id = %id, log = %path.display(), rotated = %rotated.display(), "container log rotated");
        Ok(PassStats {
            rotated: 1,
            ..stats
        })
    }
}

/// Removes and compresses what [`plan`] says; returns the stats and the path to rename the
/// log to (`None` when that name is taken: a second rotation within one second).
fn prepare(
    dir: &Path,
    name: &str,
    policy: Policy,
    now: SystemTime,
) -> Result<(PassStats, Option<PathBuf>), RotateError> {
    let names = names_in(dir).map_err(io_at(dir))?;
    let r = plan(name, &names, policy, &stamp(now));
    let mut stats = PassStats::default();
    for n in &r.remove {
        let p = dir.join(n);
        match std::fs::remove_file(&p) {
            Ok(()) => stats.removed += 1,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_at(&p)(e)),
        }
    }
    for n in &r.compress {
        let p = dir.join(n);
        compress(&p).map_err(io_at(&p))?;
        stats.compressed += 1;
    }
    let rotated = dir.join(&r.rotated);
    Ok((stats, (!rotated.exists()).then_some(rotated)))
}

fn names_in(dir: &Path) -> io::Result<Vec<String>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir)? {
        if let Some(n) = e?.file_name().to_str() {
            out.push(n.to_string());
        }
    }
    Ok(out)
}

/// Removes old attempts' log files in every pod's log dir under `pods`; returns how many.
fn prune_old_attempts(pods: &Path, live: &BTreeMap<String, HashSet<(String, u32)>>) -> usize {
    let Ok(entries) = std::fs::read_dir(pods) else {
        return 0;
    };
    let none = HashSet::new();
    let mut removed = 0;
    for pod in entries.filter_map(Result::ok) {
        let uid = pod.file_name().to_string_lossy().into_owned();
        let dir = pod.path().join("logs");
        let Ok(names) = names_in(&dir) else { continue };
        for n in stale_attempts(&names, live.get(&uid).unwrap_or(&none)) {
            match std::fs::remove_file(dir.join(&n)) {
                Ok(()) => removed += 1,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(file = %dir.join(&n).display(), error = %e, "cannot remove an old attempt's log")
                }
            }
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_containers_status_is_asked_once_and_old_attempts_pruned_when_the_set_changes() {
        use crate::cri::fake::FakeCri;
        let dir = tempfile::tempdir().unwrap();
        let cri = Arc::new(FakeCri::default());
        let container = |id: &str, attempt: u32| api::Container {
            id: id.into(),
            metadata: Some(api::ContainerMetadata {
                name: "app".into(),
                attempt,
            }),
            state: api::ContainerState::ContainerRunning as i32,
            labels: observe::managed("n")
                .into_iter()
                .chain([(crate::cri::labels::POD_UID.to_string(), "u".to_string())])
                .collect(),
            ..Default::default()
        };
        cri.state
            .lock()
            .unwrap()
            .containers
            .insert("c1".into(), container("c1", 0));
        let logs = dir.path().join("pods/u/logs");
        std::fs::create_dir_all(&logs).unwrap();
        let m = Manager {
            cri: cri.clone(),
            node_name: "n".into(),
            data_dir: dir.path().to_path_buf(),
            policy: P,
            interval: Duration::from_secs(10),
        };
        let mut memo = Memo::default();
        m.pass_with(&mut memo).await.unwrap();
        m.pass_with(&mut memo).await.unwrap();
        assert_eq!(
            cri.state.lock().unwrap().status_calls,
            1,
            "the log path is kept"
        );
        // Replaced twice: the oldest attempt's log goes on the next pass (the newest two
        // stay, for `logs --previous`).
        for a in 0..3 {
            std::fs::write(logs.join(format!("app_{a}.log")), "line").unwrap();
        }
        {
            let mut s = cri.state.lock().unwrap();
            s.containers.remove("c1");
            s.containers.insert("c2".into(), container("c2", 2));
        }
        let stats = m.pass_with(&mut memo).await.unwrap();
        assert_eq!(stats.removed, 1, "{stats:?}");
        assert!(!logs.join("app_0.log").exists());
        assert_eq!(cri.state.lock().unwrap().status_calls, 2);
        assert_eq!(
            memo.log_paths.len(),
            1,
            "the gone container's path is forgotten"
        );
        // An old attempt's log that shows up while the containers stay the same goes within
        // `PRUNE_EVERY` passes.
        std::fs::write(logs.join("app_0.log"), "late").unwrap();
        for _ in 0..PRUNE_EVERY {
            m.pass_with(&mut memo).await.unwrap();
        }
        assert!(!logs.join("app_0.log").exists());
        assert!(logs.join("app_1.log").exists() && logs.join("app_2.log").exists());
    }

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    const P: Policy = Policy {
        max_size: 100,
        max_files: 5,
    };

    #[test]
    fn the_first_rotation_only_renames() {
        let r = plan(
            "app_0.log",
            &names(&["app_0.log", "other_0.log"]),
            P,
            "20261130-231243",
        );
        assert_eq!(
            r,
            Rotation {
                remove: vec![],
                compress: vec![],
                rotated: "app_0.log.20261130-231243".into()
            }
        );
    }

    #[test]
    fn older_rotated_files_are_compressed_and_the_oldest_removed() {
        let have = names(&[
            "app_0.log",
            "app_0.log.20261130-100000.gz",
            "app_0.log.20261130-100100.gz",
            "app_0.log.20261130-100200.gz",
            "app_0.log.20261130-100300",
            "app_1.log",
        ]);
        let r = plan("app_0.log", &have, P, "20261130-100400");
        // Five files at most: the log, the new rotated one, and three before it.
        assert_eq!(r.remove, ["app_0.log.20261130-100000.gz"]);
        assert_eq!(r.compress, ["app_0.log.20261130-100300"]);
        let two = Policy { max_files: 2, ..P };
        let r = plan("app_0.log", &have, two, "20261130-100400");
        assert_eq!(r.remove.len(), 4, "{r:?}");
        assert!(r.compress.is_empty());
    }

    #[test]
    fn leftovers_of_a_rotation_cut_short_are_removed() {
        let have = names(&[
            "app_0.log",
            "app_0.log.20261130-100000",
            "app_0.log.20261130-100000.gz",
            "app_0.log.20261130-100100.gz.tmp",
        ]);
        let r = plan("app_0.log", &have, P, "20261130-100400");
        assert_eq!(
            r.remove,
            [
                "app_0.log.20261130-100000",
                "app_0.log.20261130-100100.gz.tmp"
            ]
        );
        assert!(r.compress.is_empty());
    }

    #[test]
    fn stamps_are_the_kubelets_format() {
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1_796_080_363);
        assert_eq!(stamp(t), "20261130-231243");
    }

    #[test]
    fn the_current_and_the_previous_attempt_are_kept() {
        let have = names(&[
            "app_0.log",
            "app_0.log.20261130-100000.gz",
            "app_1.log",
            "app_2.log",
            "app_2.log.20261130-100000",
            "app_3.log",
            "side_0.log",
            "not-a-log",
        ]);
        let gone = stale_attempts(&have, &HashSet::new());
        assert_eq!(
            gone,
            ["app_0.log", "app_0.log.20261130-100000.gz", "app_1.log"]
        );
        // An attempt the runtime still has a container for stays.
        let live = HashSet::from([("app".to_string(), 1)]);
        assert_eq!(
            stale_attempts(&have, &live),
            ["app_0.log", "app_0.log.20261130-100000.gz"]
        );
        assert_eq!(
            parse_any_file_name("app_2.log.20261130-100000.gz"),
            Some(("app", 2))
        );
        assert_eq!(parse_any_file_name("app_2.logx"), None);
    }

    #[test]
    fn compressing_keeps_the_bytes_and_removes_the_original() {
        use std::io::Read;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("app_0.log.20261130-100000");
        let body = "2026-11-30T10:00:00.000000000Z stdout F hello\n".repeat(1000);
        std::fs::write(&p, &body).unwrap();
        compress(&p).unwrap();
        assert!(!p.exists());
        let gz = dir.path().join("app_0.log.20261130-100000.gz");
        let mut out = String::new();
        flate2::read::GzDecoder::new(std::fs::File::open(&gz).unwrap())
            .read_to_string(&mut out)
            .unwrap();
        assert_eq!(out, body);
        assert!(std::fs::metadata(&gz).unwrap().len() < body.len() as u64 / 10);
    }
}
