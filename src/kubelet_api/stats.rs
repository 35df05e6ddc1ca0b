//! `/metrics/resource` and `/stats/summary`: what metrics-server (and so `kubectl top`) reads
//! from a kubelet, from the CRI's `ListContainerStats` for the containers and `/proc` for the
//! node. The shapes are pure functions of the samples; the sampling is at the edge.

use crate::cri::api;
use crate::cri::labels;
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
    pub rootfs_used: Option<u64>,
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
    })
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
    let mut family = |name: &str, help: &str, kind: &str, rows: Vec<(String, f64, i64)>| {
        let _ = writeln!(out, "# HELP {name} [STABLE] {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        for (labels, v, at) in rows {
            let _ = writeln!(out, "{name}{labels} {v} {at}");
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
    family(
        "container_cpu_usage_seconds_total",
        "Cumulative cpu time consumed by the container in core-seconds",
        "counter",
        containers
            .iter()
            .filter_map(|c| Some((lbl(c), secs(c.cpu_core_nanos?), ms(c.cpu_at_nanos))))
            .collect(),
    );
    family(
        "container_memory_working_set_bytes",
        "Current working set of the container in bytes",
        "gauge",
        containers
            .iter()
            .filter_map(|c| Some((lbl(c), c.memory_working_set? as f64, ms(c.memory_at_nanos))))
            .collect(),
    );
    let node_rows = |f: &dyn Fn(&NodeSample) -> f64| {
        node.map(|n| vec![(String::new(), f(n), ms(n.at_nanos))])
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
            .map(|((ns, p), v)| (pl(ns, p), secs(v.0), ms(v.2)))
            .collect(),
    );
    family(
        "pod_memory_working_set_bytes",
        "Current working set of the pod in bytes",
        "gauge",
        pods.iter()
            .map(|((ns, p), v)| (pl(ns, p), v.1 as f64, ms(v.3)))
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

fn rfc3339(nanos: i64) -> String {
    let secs = nanos.div_euclid(1_000_000_000);
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    // civil_from_days (Howard Hinnant).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if m <= 2 { y + 1 } else { y };
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
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

/// The kubelet's `/stats/summary` (the fields metrics-server and `kubectl top` read).
pub fn summary(
    node_name: &str,
    node: Option<&NodeSample>,
    containers: &[ContainerSample],
) -> Value {
    let mut node_v = json!({"nodeName": node_name});
    if let Some(n) = node {
        let t = rfc3339(n.at_nanos);
        node_v["cpu"] = json!({"time": t, "usageCoreNanoSeconds": n.cpu_core_nanos});
        node_v["memory"] = json!({"time": t, "workingSetBytes": n.memory_working_set,
                                  "availableBytes": n.memory_available});
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
            let containers: Vec<Value> = cs
                .iter()
                .map(|c| {
                    let mut v = json!({"name": c.container});
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
                    if let Some(u) = c.rootfs_used {
                        v["rootfs"] = json!({"usedBytes": u});
                    }
                    v
                })
                .collect();
            let cpu: u64 = cs.iter().filter_map(|c| c.cpu_core_nanos).sum();
            let mem: u64 = cs.iter().filter_map(|c| c.memory_working_set).sum();
            let at = cs.iter().map(|c| c.cpu_at_nanos).max().unwrap_or(0);
            json!({
                "podRef": {"name": name, "namespace": ns, "uid": uid},
                "containers": containers,
                "cpu": {"time": rfc3339(at), "usageCoreNanoSeconds": cpu},
                "memory": {"time": rfc3339(at), "workingSetBytes": mem},
            })
        })
        .collect();
    json!({"node": node_v, "pods": pods})
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
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing from:\n{text}");
        }
        assert!(metrics_resource(None, &[], true).contains("scrape_error 1"));
    }

    #[test]
    fn the_summary_has_metrics_servers_fields() {
        let s = summary("edge-1", None, &[sample("app", 7, 8)]);
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
    }
}
