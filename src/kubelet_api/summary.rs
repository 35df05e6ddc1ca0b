//! The kubelet's `/stats/summary` shape (pure): the CPU and memory samples of
//! [`super::stats`] and what [`super::sampling`] measured of the disks and networks, as the
//! summary API's JSON.

use super::stats::{ContainerSample, NodeSample};
use super::usage::{self, rfc3339, FsSample, ImageFs, NetSample, Usage};
use crate::mountns::FsStats;
use serde_json::{json, Value};
use std::collections::BTreeMap;

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

#[cfg(test)]
mod tests {
    use super::super::stats::tests::sample;
    use super::*;

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
