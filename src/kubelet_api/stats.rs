//! `/metrics/resource` and the CPU and memory of `/stats/summary`: what metrics-server (and so
//! `kubectl top`) reads from a kubelet, from the CRI's `ListContainerStats` for the containers
//! and `/proc` for the node. The samples and the metrics text are pure; reading `/proc` is at
//! the edge. The summary's shape is [`super::summary`]; its disks and networks are sampled in
//! [`super::sampling`].

use crate::cri::api;
use crate::cri::labels;
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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A container of pod vehicle/web with every number set.
    pub(crate) fn sample(container: &str, cpu: u64, mem: u64) -> ContainerSample {
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
}
