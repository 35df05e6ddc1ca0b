//! `/metrics/resource` and `/stats/summary`: what metrics-server (and so `kubectl top`) reads
//! from a kubelet, from the CRI's `ListContainerStats` for the containers and `/proc` for the
//! node. The shapes are pure functions of the samples; the sampling is at the edge.

use super::usage::{self, rfc3339, FsSample, ImageFs, NetSample, Usage};
use crate::cri::api;
use crate::cri::labels;
use crate::mountns::FsStats;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::fmt::Write;

/// One container's numbers, as the runtime reports them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerSample {
    pub namespace: String,
    pub pod: String,
    pub pod_uid: String,
    pub container: String,
    /// Cumulative CPU time, nanoseconds.
    pub cpu_core_nanos: Option<u64>,
    pub cpu_nano_cores: Option<u64>,
    /// When the CPU sample was taken, unix nanoseconds.
    pub cpu_at_nanos: i64,
    pub memory_working_set: Option<u64>,
    pub memory_usage: Option<u64>,
    pub memory_rss: Option<u64>,
    pub memory_at_nanos: i64,
    /// The writable layer: what it uses, when sampled, and the filesystem it is on.
    pub rootfs_used: Option<u64>,
    pub rootfs_inodes_used: Option<u64>,
    pub rootfs_at_nanos: i64,
    pub rootfs_mountpoint: Option<String>,
    /// The runtime's container id, and when it created the container (unix nanoseconds;
    /// from `ListContainers`, see [`with_start_times`]).
    pub id: String,
    pub created_nanos: Option<i64>,
}

/// The node's numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeSample {
    pub cpu_core_nanos: u64,
    /// MemTotal − MemAvailable.
    pub memory_working_set: u64,
    pub memory_available: u64,
    pub at_nanos: i64,
}

/// A CRI `ContainerStats` as a sample; `None` without the pod's labels (not a pod's).
pub fn container_sample(s: &api::ContainerStats) -> Option<ContainerSample> {
    let a = s.attributes.as_ref()?;
    let l = |k: &str| a.labels.get(k).cloned();
    let v = |x: &Option<api::UInt64Value>| x.as_ref().map(|v| v.value);
    let cpu = s.cpu.as_ref();
    let mem = s.memory.as_ref();
    Some(ContainerSample {
        namespace: l(labels::POD_NAMESPACE)?,
        pod: l(labels::POD_NAME)?,
        pod_uid: l(labels::POD_UID).unwrap_or_default(),
        container: l(labels::CONTAINER_NAME)
            .or_else(|| a.metadata.as_ref().map(|m| m.name.clone()))?,
        cpu_core_nanos: cpu.and_then(|c| v(&c.usage_core_nano_seconds)),
        cpu_nano_cores: cpu.and_then(|c| v(&c.usage_nano_cores)),
        cpu_at_nanos: cpu.map(|c| c.timestamp).unwrap_or(0),
        memory_working_set: mem.and_then(|m| v(&m.working_set_bytes)),
        memory_usage: mem.and_then(|m| v(&m.usage_bytes)),
        memory_rss: mem.and_then(|m| v(&m.rss_bytes)),
        memory_at_nanos: mem.map(|m| m.timestamp).unwrap_or(0),
        rootfs_used: s.writable_layer.as_ref().and_then(|w| v(&w.used_bytes)),
        rootfs_inodes_used: s.writable_layer.as_ref().and_then(|w| v(&w.inodes_used)),
        rootfs_at_nanos: s.writable_layer.as_ref().map(|w| w.timestamp).unwrap_or(0),
        rootfs_mountpoint: s
            .writable_layer
            .as_ref()
            .and_then(|w| w.fs_id.as_ref())
            .map(|f| f.mountpoint.clone())
            .filter(|m| !m.is_empty()),
        id: a.id.clone(),
        created_nanos: None,
    })
}

/// The samples with their containers' creation times from the runtime's container list (the
/// kubelet's container `startTime`); pure.
pub fn with_start_times(
    mut samples: Vec<ContainerSample>,
    containers: &[api::Container],
) -> Vec<ContainerSample> {
    let created: std::collections::HashMap<&str, i64> = containers
        .iter()
        .filter(|c| c.created_at > 0)
        .map(|c| (c.id.as_str(), c.created_at))
        .collect();
    for s in &mut samples {
        s.created_nanos = created.get(s.id.as_str()).copied();
    }
    samples
}

/// The node's CPU time from `/proc/stat`'s first line (USER_HZ ticks, 100 a second on
/// Linux): user, nice, system, irq, softirq and steal.
pub fn proc_stat_cpu_nanos(stat: &str) -> Option<u64> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let f: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let at = |i: usize| f.get(i).copied().unwrap_or(0);
    let ticks = at(0) + at(1) + at(2) + at(5) + at(6) + at(7);
    Some(ticks * 10_000_000)
}

fn secs(nanos: u64) -> f64 {
    nanos as f64 / 1e9
}

fn ms(nanos: i64) -> i64 {
    nanos / 1_000_000
}

fn esc(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

/// The kubelet's `/metrics/resource` text (Prometheus exposition, timestamps in ms).
pub fn metrics_resource(
    node: Option<&NodeSample>,
    containers: &[ContainerSample],
    scrape_error: bool,
) -> String {
    let mut out = String::new();
    let mut family = |name: &str, help: &str, kind: &str, rows: Vec<(String, f64, Option<i64>)>| {
        let _ = writeln!(out, "# HELP {name} [STABLE] {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        for (labels, v, at) in rows {
            match at {
                Some(at) => writeln!(out, "{name}{labels} {v} {at}"),
                None => writeln!(out, "{name}{labels} {v}"),
            }
            .unwrap_or(());
        }
    };
    let lbl = |c: &ContainerSample| {
        format!(
            "{{container=\"{}\",namespace=\"{}\",pod=\"{}\"}}",
            esc(&c.container),
            esc(&c.namespace),
            esc(&c.pod)
        )
    };
    // The kubelet's STABLE start time: seconds since the epoch, no sample timestamp.
    family(
        "container_start_time_seconds",
        "Start time of the container since unix epoch in seconds",
        "gauge",
        containers
            .iter()
            .filter_map(|c| Some((lbl(c), c.created_nanos? as f64 / 1e9, None)))
            .collect(),
    );
    family(
        "container_cpu_usage_seconds_total",
        "Cumulative cpu time consumed by the container in core-seconds",
        "counter",
        containers
            .iter()
            .filter_map(|c| Some((lbl(c), secs(c.cpu_core_nanos?), Some(ms(c.cpu_at_nanos)))))
            .collect(),
    );
    family(
        "container_memory_working_set_bytes",
        "Current working set of the container in bytes",
        "gauge",
        containers
            .iter()
            .filter_map(|c| {
                Some((
                    lbl(c),
                    c.memory_working_set? as f64,
                    Some(ms(c.memory_at_nanos)),
                ))
            })
            .collect(),
    );
    let node_rows = |f: &dyn Fn(&NodeSample) -> f64| {
        node.map(|n| vec![(String::new(), f(n), Some(ms(n.at_nanos)))])
            .unwrap_or_default()
    };
    family(
        "node_cpu_usage_seconds_total",
        "Cumulative cpu time consumed by the node in core-seconds",
        "counter",
        node_rows(&|n| secs(n.cpu_core_nanos)),
    );
    family(
        "node_memory_working_set_bytes",
        "Current working set of the node in bytes",
        "gauge",
        node_rows(&|n| n.memory_working_set as f64),
    );
    // Pods: the sums of their containers.
    let mut pods: BTreeMap<(String, String), (u64, u64, i64, i64)> = BTreeMap::new();
    for c in containers {
        let e = pods
            .entry((c.namespace.clone(), c.pod.clone()))
            .or_default();
        e.0 += c.cpu_core_nanos.unwrap_or(0);
        e.1 += c.memory_working_set.unwrap_or(0);
        e.2 = e.2.max(c.cpu_at_nanos);
        e.3 = e.3.max(c.memory_at_nanos);
    }
    let pl = |ns: &str, p: &str| format!("{{namespace=\"{}\",pod=\"{}\"}}", esc(ns), esc(p));
    family(
        "pod_cpu_usage_seconds_total",
        "Cumulative cpu time consumed by the pod in core-seconds",
        "counter",
        pods.iter()
            .map(|((ns, p), v)| (pl(ns, p), secs(v.0), Some(ms(v.2))))
            .collect(),
    );
    family(
        "pod_memory_working_set_bytes",
        "Current working set of the pod in bytes",
        "gauge",
        pods.iter()
            .map(|((ns, p), v)| (pl(ns, p), v.1 as f64, Some(ms(v.3))))
            .collect(),
    );
    let _ = writeln!(
        out,
        "# HELP scrape_error [ALPHA] 1 if there was an error while getting container metrics, 0 otherwise"
    );
    let _ = writeln!(out, "# TYPE scrape_error gauge");
    let _ = writeln!(out, "scrape_error {}", u8::from(scrape_error));
    out
}

/// The node's sample now, from `/proc` (`None` where it cannot be read).
pub fn node_sample() -> Option<NodeSample> {
    let cpu = proc_stat_cpu_nanos(&std::fs::read_to_string("/proc/stat").ok()?)?;
    let (total, available) =
        crate::node::parse_meminfo(&std::fs::read_to_string("/proc/meminfo").ok()?);
    let at_nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0);
    Some(NodeSample {
        cpu_core_nanos: cpu,
        memory_working_set: total.saturating_sub(available),
        memory_available: available,
        at_nanos,
    })
}

/// One pod's disks and network, beyond its containers' CRI samples.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodExtra {
    /// Each container's log files (all its attempts, rotated ones too), by container name.
    pub logs: BTreeMap<String, Usage>,
    /// The pod's emptyDir volumes on disk, by volume name.
    pub volumes: BTreeMap<String, Usage>,
    /// The network namespace of the pod's sandbox (the host's for a hostNetwork pod).
    pub network: Option<NetSample>,
    /// When the runtime created the pod's sandbox (the kubelet's pod `startTime`).
    pub created_nanos: Option<i64>,
}

/// What `/stats/summary` says beyond CPU and memory: the node's filesystems and network, and
/// each pod's disks and network.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Extra {
    /// When the files were measured.
    pub at_nanos: i64,
    /// The data directory's filesystem (the kubelet's root directory's): the node's `fs`,
    /// and where logs and emptyDir volumes take their space.
    pub node_fs: Option<FsStats>,
    pub image_fs: Option<ImageFs>,
    pub node_network: Option<NetSample>,
    /// The filesystems of the containers' writable layers, by mountpoint.
    pub mounts: BTreeMap<String, FsStats>,
    /// By pod UID.
    pub pods: BTreeMap<String, PodExtra>,
}

/// A container's `rootfs` and `logs` and what they add to the pod's ephemeral storage.
fn container_disks(c: &ContainerSample, extra: &Extra, pod: Option<&PodExtra>) -> (Value, Usage) {
    let mut v = json!({});
    let mut used = Usage::default();
    if c.rootfs_used.is_some() || c.rootfs_inodes_used.is_some() {
        let fs = c
            .rootfs_mountpoint
            .as_ref()
            .and_then(|m| extra.mounts.get(m));
        v["rootfs"] =
            usage::part_fs_json(c.rootfs_at_nanos, c.rootfs_used, c.rootfs_inodes_used, fs);
        used = Usage {
            bytes: c.rootfs_used.unwrap_or(0),
            inodes: c.rootfs_inodes_used.unwrap_or(0),
        };
        // The kubelet counts a container's logs in the pod's ephemeral storage only with its
        // rootfs.
        if let Some(l) = pod.and_then(|p| p.logs.get(&c.container)) {
            used = used + *l;
        }
    }
    if let Some(l) = pod.and_then(|p| p.logs.get(&c.container)) {
        v["logs"] = usage::part_fs_json(
            extra.at_nanos,
            Some(l.bytes),
            Some(l.inodes),
            extra.node_fs.as_ref(),
        );
    }
    (v, used)
}

/// The kubelet's `/stats/summary`: CPU and memory (what metrics-server and `kubectl top`
/// read), and the disks and networks the CRI and the host can tell.
pub fn summary(
    node_name: &str,
    node: Option<&NodeSample>,
    containers: &[ContainerSample],
    extra: &Extra,
) -> Value {
    let mut node_v = json!({"nodeName": node_name});
    if let Some(n) = node {
        let t = rfc3339(n.at_nanos);
        node_v["cpu"] = json!({"time": t, "usageCoreNanoSeconds": n.cpu_core_nanos});
        node_v["memory"] = json!({"time": t, "workingSetBytes": n.memory_working_set,
                                  "availableBytes": n.memory_available});
    }
    if let Some(n) = &extra.node_network {
        node_v["network"] = usage::network_json(n);
    }
    if let Some(fs) = extra.node_fs {
        node_v["fs"] = usage::node_fs_json(&FsSample {
            at_nanos: extra.at_nanos,
            fs,
        });
    }
    if let Some(i) = &extra.image_fs {
        let v = usage::image_fs_json(i);
        node_v["runtime"] = json!({"imageFs": v, "containerFs": v});
    }
    let mut pods: BTreeMap<(String, String, String), Vec<&ContainerSample>> = BTreeMap::new();
    for c in containers {
        pods.entry((c.namespace.clone(), c.pod.clone(), c.pod_uid.clone()))
            .or_default()
            .push(c);
    }
    let pods: Vec<Value> = pods
        .into_iter()
        .map(|((ns, name, uid), cs)| {
            let pod_extra = extra.pods.get(&uid);
            let mut ephemeral = Usage::default();
            let containers: Vec<Value> = cs
                .iter()
                .map(|c| {
                    let mut v = json!({"name": c.container});
                    if let Some(t) = c.created_nanos {
                        v["startTime"] = rfc3339(t).into();
                    }
                    if let Some(n) = c.cpu_core_nanos {
                        v["cpu"] =
                            json!({"time": rfc3339(c.cpu_at_nanos), "usageCoreNanoSeconds": n});
                        if let Some(nc) = c.cpu_nano_cores {
                            v["cpu"]["usageNanoCores"] = nc.into();
                        }
                    }
                    if let Some(w) = c.memory_working_set {
                        v["memory"] =
                            json!({"time": rfc3339(c.memory_at_nanos), "workingSetBytes": w});
                        if let Some(u) = c.memory_usage {
                            v["memory"]["usageBytes"] = u.into();
                        }
                        if let Some(r) = c.memory_rss {
                            v["memory"]["rssBytes"] = r.into();
                        }
                    }
                    let (disks, used) = container_disks(c, extra, pod_extra);
                    if let (Value::Object(v), Value::Object(d)) = (&mut v, disks) {
                        v.extend(d);
                    }
                    ephemeral = ephemeral + used;
                    v
                })
                .collect();
            let cpu: u64 = cs.iter().filter_map(|c| c.cpu_core_nanos).sum();
            let mem: u64 = cs.iter().filter_map(|c| c.memory_working_set).sum();
            let at = cs.iter().map(|c| c.cpu_at_nanos).max().unwrap_or(0);
            let mut v = json!({
                "podRef": {"name": name, "namespace": ns, "uid": uid},
                "containers": containers,
                "cpu": {"time": rfc3339(at), "usageCoreNanoSeconds": cpu},
                "memory": {"time": rfc3339(at), "workingSetBytes": mem},
            });
            if let Some(p) = pod_extra {
                if let Some(t) = p.created_nanos {
                    v["startTime"] = rfc3339(t).into();
                }
                let volumes: Vec<Value> = p
                    .volumes
                    .iter()
                    .map(|(name, u)| {
                        let mut v = usage::part_fs_json(
                            extra.at_nanos,
                            Some(u.bytes),
                            Some(u.inodes),
                            extra.node_fs.as_ref(),
                        );
                        v["name"] = name.as_str().into();
                        ephemeral = ephemeral + *u;
                        v
                    })
                    .collect();
                if !volumes.is_empty() {
                    v["volume"] = volumes.into();
                }
                if let Some(n) = &p.network {
                    v["network"] = usage::network_json(n);
                }
                v["ephemeral-storage"] = usage::part_fs_json(
                    extra.at_nanos,
                    Some(ephemeral.bytes),
                    Some(ephemeral.inodes),
                    extra.node_fs.as_ref(),
                );
            }
            v
        })
        .collect();
    json!({"node": node_v, "pods": pods})
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

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(container: &str, cpu: u64, mem: u64) -> ContainerSample {
        ContainerSample {
            namespace: "vehicle".into(),
            pod: "web".into(),
            pod_uid: "u1".into(),
            container: container.into(),
            cpu_core_nanos: Some(cpu),
            cpu_nano_cores: None,
            cpu_at_nanos: 1_700_000_000_000_000_000,
            memory_working_set: Some(mem),
            memory_usage: None,
            memory_rss: None,
            memory_at_nanos: 1_700_000_000_000_000_000,
            rootfs_used: Some(4096),
            rootfs_inodes_used: Some(3),
            rootfs_at_nanos: 1_700_000_000_000_000_000,
            rootfs_mountpoint: Some("/var/lib/containerd".into()),
            id: format!("id-{container}"),
            created_nanos: Some(1_600_000_000_500_000_000),
        }
    }

    #[test]
    fn the_node_cpu_from_proc_stat() {
        let stat = "cpu  100 5 50 1000 20 3 2 1 0 0\ncpu0 1 2 3 4\n";
        // user + nice + system + irq + softirq + steal = 161 ticks of 10 ms.
        assert_eq!(proc_stat_cpu_nanos(stat), Some(1_610_000_000));
        assert_eq!(proc_stat_cpu_nanos("nothing"), None);
    }

    #[test]
    fn metrics_resource_as_metrics_server_reads_it() {
        let node = NodeSample {
            cpu_core_nanos: 2_500_000_000,
            memory_working_set: 1 << 30,
            memory_available: 1 << 29,
            at_nanos: 1_700_000_000_000_000_000,
        };
        let text = metrics_resource(
            Some(&node),
            &[
                sample("app", 1_500_000_000, 1000),
                sample("side", 500_000_000, 24),
            ],
            false,
        );
        for line in [
            "# TYPE container_cpu_usage_seconds_total counter",
            "container_cpu_usage_seconds_total{container=\"app\",namespace=\"vehicle\",pod=\"web\"} 1.5 1700000000000",
            "container_memory_working_set_bytes{container=\"side\",namespace=\"vehicle\",pod=\"web\"} 24 1700000000000",
            "node_cpu_usage_seconds_total 2.5 1700000000000",
            "node_memory_working_set_bytes 1073741824 1700000000000",
            "pod_cpu_usage_seconds_total{namespace=\"vehicle\",pod=\"web\"} 2 1700000000000",
            "pod_memory_working_set_bytes{namespace=\"vehicle\",pod=\"web\"} 1024 1700000000000",
            "scrape_error 0",
            "# TYPE container_start_time_seconds gauge",
            "container_start_time_seconds{container=\"app\",namespace=\"vehicle\",pod=\"web\"} 1600000000.5",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing from:\n{text}");
        }
        assert!(metrics_resource(None, &[], true).contains("scrape_error 1"));
    }

    #[test]
    fn the_summary_has_metrics_servers_fields() {
        let s = summary("edge-1", None, &[sample("app", 7, 8)], &Extra::default());
        assert_eq!(s["node"]["nodeName"], "edge-1");
        let pod = &s["pods"][0];
        assert_eq!(
            pod["podRef"],
            json!({"name": "web", "namespace": "vehicle", "uid": "u1"})
        );
        assert_eq!(pod["containers"][0]["cpu"]["usageCoreNanoSeconds"], 7);
        assert_eq!(pod["containers"][0]["memory"]["workingSetBytes"], 8);
        assert_eq!(pod["containers"][0]["rootfs"]["usedBytes"], 4096);
        assert_eq!(pod["cpu"]["time"], "2023-11-14T22:13:20Z");
        assert_eq!(pod["containers"][0]["startTime"], "2020-09-13T12:26:40Z");
    }

    #[test]
    fn start_times_from_the_runtimes_container_list() {
        let mut fresh = sample("app", 1, 1);
        fresh.created_nanos = None;
        let listed = |id: &str, at: i64| api::Container {
            id: id.into(),
            created_at: at,
            ..Default::default()
        };
        let got = with_start_times(
            vec![fresh.clone(), sample("side", 1, 1)],
            &[listed("id-app", 42), listed("other", 7)],
        );
        assert_eq!(got[0].created_nanos, Some(42));
        assert_eq!(got[1].created_nanos, None, "not listed: none");
    }

    #[test]
    fn the_summary_has_the_kubelets_disks_and_networks() {
        let fs = FsStats {
            total_bytes: 10_000_000,
            free_bytes: 4_000_000,
            available_bytes: 3_000_000,
            inodes: 1000,
            inodes_free: 400,
        };
        let image = FsStats {
            total_bytes: 50_000_000,
            ..fs
        };
        let net = NetSample {
            at_nanos: 1_700_000_000_000_000_000,
            interfaces: vec![usage::Iface {
                name: "eth0".into(),
                rx_bytes: 10,
                rx_errors: 0,
                tx_bytes: 20,
                tx_errors: 0,
            }],
        };
        let extra = Extra {
            at_nanos: 1_700_000_000_000_000_000,
            node_fs: Some(fs),
            image_fs: Some(ImageFs {
                at_nanos: 1_700_000_000_000_000_000,
                used_bytes: Some(777),
                inodes_used: Some(7),
                fs: Some(image),
            }),
            node_network: Some(net.clone()),
            mounts: BTreeMap::from([("/var/lib/containerd".to_string(), image)]),
            pods: BTreeMap::from([(
                "u1".to_string(),
                PodExtra {
                    logs: BTreeMap::from([(
                        "app".to_string(),
                        Usage {
                            bytes: 8192,
                            inodes: 2,
                        },
                    )]),
                    volumes: BTreeMap::from([(
                        "data".to_string(),
                        Usage {
                            bytes: 1024,
                            inodes: 3,
                        },
                    )]),
                    network: Some(net),
                    created_nanos: Some(1_600_000_000_000_000_000),
                },
            )]),
        };
        let s = summary(
            "edge-1",
            None,
            &[sample("app", 7, 8), sample("side", 1, 1)],
            &extra,
        );
        let node = &s["node"];
        assert_eq!(node["fs"]["capacityBytes"], 10_000_000);
        assert_eq!(node["fs"]["usedBytes"], 6_000_000);
        assert_eq!(node["fs"]["inodesUsed"], 600);
        assert_eq!(node["runtime"]["imageFs"]["usedBytes"], 777);
        assert_eq!(node["runtime"]["imageFs"]["capacityBytes"], 50_000_000);
        assert_eq!(node["runtime"]["containerFs"], node["runtime"]["imageFs"]);
        assert_eq!(node["network"]["rxBytes"], 10);
        let pod = &s["pods"][0];
        let app = &pod["containers"][0];
        assert_eq!(app["rootfs"]["usedBytes"], 4096);
        assert_eq!(app["rootfs"]["inodesUsed"], 3);
        assert_eq!(app["rootfs"]["capacityBytes"], 50_000_000);
        assert_eq!(app["logs"]["usedBytes"], 8192);
        assert_eq!(app["logs"]["capacityBytes"], 10_000_000);
        assert!(pod["containers"][1].get("logs").is_none());
        assert_eq!(pod["startTime"], "2020-09-13T12:26:40Z");
        assert_eq!(pod["network"]["name"], "eth0");
        assert_eq!(pod["network"]["txBytes"], 20);
        assert_eq!(pod["volume"][0]["name"], "data");
        assert_eq!(pod["volume"][0]["usedBytes"], 1024);
        // Both rootfs, app's logs and the emptyDir.
        let eph = &pod["ephemeral-storage"];
        assert_eq!(eph["usedBytes"], 4096 * 2 + 8192 + 1024);
        assert_eq!(eph["inodesUsed"], 3 * 2 + 2 + 3);
        assert_eq!(eph["availableBytes"], 3_000_000);
    }
}
