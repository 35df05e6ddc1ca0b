//! The disks and networks of `/stats/summary`, beyond the CRI's CPU and memory: what the
//! kubelet's summary says about a container's logs, a pod's emptyDir volumes and network,
//! and the node's filesystems. Parsing and shaping are pure; the few functions that read the
//! host (`du`, `statvfs`, `/proc/<pid>/net/dev`) are at the end and say so.

use crate::mountns::FsStats;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// Bytes and inodes some files take, as `du` counts them: 512-byte blocks, a hard link once,
/// nothing on another filesystem (as the kubelet's `DiskUsage`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub bytes: u64,
    pub inodes: u64,
}

impl std::ops::Add for Usage {
    type Output = Usage;
    fn add(self, o: Usage) -> Usage {
        Usage {
            bytes: self.bytes.saturating_add(o.bytes),
            inodes: self.inodes.saturating_add(o.inodes),
        }
    }
}

/// A filesystem's size and use, sampled at a time (unix nanoseconds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsSample {
    pub at_nanos: i64,
    pub fs: FsStats,
}

/// The runtime's image filesystem: what images use (from the CRI) and, when its mountpoint
/// can be read here, the filesystem around it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageFs {
    pub at_nanos: i64,
    pub used_bytes: Option<u64>,
    pub inodes_used: Option<u64>,
    pub fs: Option<FsStats>,
}

/// One interface's counters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Iface {
    pub name: String,
    pub rx_bytes: u64,
    pub rx_errors: u64,
    pub tx_bytes: u64,
    pub tx_errors: u64,
}

/// A network namespace's interfaces, sampled at a time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetSample {
    pub at_nanos: i64,
    pub interfaces: Vec<Iface>,
}

/// The interface the kubelet's summary reports at the top of a network's stats.
pub const DEFAULT_INTERFACE: &str = "eth0";

/// Interfaces cadvisor leaves out of a network's stats (by name prefix).
const IGNORED_PREFIXES: [&str; 4] = ["lo", "veth", "docker", "nerdctl"];

/// `/proc/<pid>/net/dev` as interfaces, without the ones cadvisor ignores (loopback, veth
/// ends, docker's); pure. A line that is not 17 fields makes the whole file untrusted
/// (`None`), as in cadvisor.
pub fn parse_net_dev(text: &str) -> Option<Vec<Iface>> {
    let mut out = Vec::new();
    for line in text.lines().skip(2) {
        let line = line.replace(':', " ");
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.is_empty() {
            continue;
        }
        if f.len() != 17 {
            return None;
        }
        let name = f[0];
        if IGNORED_PREFIXES
            .iter()
            .any(|p| name.to_ascii_lowercase().starts_with(p))
        {
            continue;
        }
        let n = |i: usize| f[i].parse::<u64>().ok();
        out.push(Iface {
            name: name.to_string(),
            rx_bytes: n(1)?,
            rx_errors: n(3)?,
            tx_bytes: n(9)?,
            tx_errors: n(11)?,
        });
    }
    Some(out)
}

/// `2023-11-14T22:13:20Z` from unix nanoseconds (the kubelet's `metav1.Time`, seconds).
pub fn rfc3339(nanos: i64) -> String {
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

fn iface_json(i: &Iface) -> Value {
    json!({"name": i.name, "rxBytes": i.rx_bytes, "rxErrors": i.rx_errors,
           "txBytes": i.tx_bytes, "txErrors": i.tx_errors})
}

/// The kubelet's `NetworkStats`: every interface, and the default one's counters at the top.
pub fn network_json(n: &NetSample) -> Value {
    let mut v = json!({
        "time": rfc3339(n.at_nanos),
        "interfaces": n.interfaces.iter().map(iface_json).collect::<Vec<_>>(),
    });
    if let Some(d) = n.interfaces.iter().find(|i| i.name == DEFAULT_INTERFACE) {
        if let (Value::Object(top), Value::Object(d)) = (&mut v, iface_json(d)) {
            top.extend(d);
        }
    }
    v
}

/// The kubelet's `FsStats` of a whole filesystem (the node's `fs`): its size, free space and
/// inodes, and what is used of it.
pub fn node_fs_json(s: &FsSample) -> Value {
    json!({
        "time": rfc3339(s.at_nanos),
        "availableBytes": s.fs.available_bytes,
        "capacityBytes": s.fs.total_bytes,
        "usedBytes": s.fs.total_bytes.saturating_sub(s.fs.free_bytes),
        "inodesFree": s.fs.inodes_free,
        "inodes": s.fs.inodes,
        "inodesUsed": s.fs.inodes.saturating_sub(s.fs.inodes_free),
    })
}

/// The kubelet's `FsStats` of something on a filesystem (a container's logs or writable
/// layer, a pod's ephemeral storage): its own use, and the filesystem's size and free space
/// when known.
pub fn part_fs_json(
    at_nanos: i64,
    used_bytes: Option<u64>,
    inodes_used: Option<u64>,
    fs: Option<&FsStats>,
) -> Value {
    let mut v = json!({"time": rfc3339(at_nanos)});
    if let Some(fs) = fs {
        v["availableBytes"] = fs.available_bytes.into();
        v["capacityBytes"] = fs.total_bytes.into();
        v["inodesFree"] = fs.inodes_free.into();
        v["inodes"] = fs.inodes.into();
    }
    if let Some(u) = used_bytes {
        v["usedBytes"] = u.into();
    }
    if let Some(i) = inodes_used {
        v["inodesUsed"] = i.into();
    }
    v
}

/// The runtime's `imageFs` (also its `containerFs`: one filesystem, as the kubelet reports
/// for a CRI runtime without a separate one).
pub fn image_fs_json(i: &ImageFs) -> Value {
    part_fs_json(i.at_nanos, i.used_bytes, i.inodes_used, i.fs.as_ref())
}

/// The logs of each container in a pod's log directory, by container name, from the file
/// names and their usage (`<container>_<attempt>.log`, rotated ones too); pure.
pub fn logs_by_container(files: &[(String, Usage)]) -> BTreeMap<String, Usage> {
    let mut out: BTreeMap<String, Usage> = BTreeMap::new();
    for (name, u) in files {
        if let Some((c, _)) = crate::logs::rotate::parse_any_file_name(name) {
            let e = out.entry(c.to_string()).or_default();
            *e = *e + *u;
        }
    }
    out
}

// ---- Reading the host. ----

/// What a walk of a directory counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Walk {
    pub usage: Usage,
    /// Every entry was visited (else the usage is a lower bound).
    pub complete: bool,
}

/// What `path` takes on its filesystem, as `du` counts it, visiting at most `max_entries`
/// entries (each one `lstat`; memory stays within that many paths too). Blocking; a path
/// that vanishes meanwhile counts as nothing.
pub fn du(path: &Path, max_entries: u64) -> Walk {
    let Ok(top) = std::fs::symlink_metadata(path) else {
        return Walk {
            usage: Usage::default(),
            complete: true,
        };
    };
    let dev = top.dev();
    let mut seen = std::collections::HashSet::new();
    let mut total = Usage::default();
    let mut visited: u64 = 1;
    let mut complete = true;
    let mut stack = vec![(path.to_path_buf(), top)];
    while let Some((p, m)) = stack.pop() {
        // Not into other filesystems (a mount inside a volume), a hard link once.
        if m.dev() != dev || (m.nlink() > 1 && !m.is_dir() && !seen.insert(m.ino())) {
            continue;
        }
        total = total
            + Usage {
                bytes: m.blocks().saturating_mul(512),
                inodes: 1,
            };
        if m.is_dir() {
            for e in std::fs::read_dir(&p).into_iter().flatten().flatten() {
                if visited >= max_entries {
                    complete = false;
                    break;
                }
                visited += 1;
                if let Ok(em) = std::fs::symlink_metadata(e.path()) {
                    stack.push((e.path(), em));
                }
            }
        }
    }
    Walk {
        usage: total,
        complete,
    }
}

/// The files of a pod's log directory with what each takes (blocking; none when it is
/// missing).
pub fn log_files(dir: &Path) -> Vec<(String, Usage)> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| {
            let m = e.metadata().ok()?;
            m.is_file().then(|| {
                (
                    e.file_name().to_string_lossy().into_owned(),
                    Usage {
                        bytes: m.blocks().saturating_mul(512),
                        inodes: 1,
                    },
                )
            })
        })
        .collect()
}

/// The interfaces of the network namespace process `pid` is in (blocking).
pub fn net_of(pid: Option<u32>, at_nanos: i64) -> Option<NetSample> {
    let path = match pid {
        Some(p) => format!("/proc/{p}/net/dev"),
        None => "/proc/net/dev".to_string(),
    };
    let interfaces = parse_net_dev(&std::fs::read_to_string(path).ok()?)?;
    Some(NetSample {
        at_nanos,
        interfaces,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const NET_DEV: &str = "Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo: 4363534585  932954    0    0    0     0          0         0 4363534585  932954    0    0    0     0       0          0
  eth0: 616958417   16560    2    0    0     0          0         0   740432    9039    1    0    0     0       0          0
vethab12:   30752     374    0    0    0     0          0       116    27030     327    0    3    0     0       0          0
  cni0:     100       1    0    0    0     0          0         0      200       2    0    0    0     0       0          0
";

    #[test]
    fn net_dev_as_cadvisor_reads_it() {
        let got = parse_net_dev(NET_DEV).unwrap();
        assert_eq!(
            got,
            vec![
                Iface {
                    name: "eth0".into(),
                    rx_bytes: 616958417,
                    rx_errors: 2,
                    tx_bytes: 740432,
                    tx_errors: 1
                },
                Iface {
                    name: "cni0".into(),
                    rx_bytes: 100,
                    rx_errors: 0,
                    tx_bytes: 200,
                    tx_errors: 0
                },
            ]
        );
        assert_eq!(parse_net_dev("h\nh\n  eth0: 1 2 3\n"), None);
        let v = network_json(&NetSample {
            at_nanos: 1_700_000_000_000_000_000,
            interfaces: got,
        });
        assert_eq!(v["name"], "eth0");
        assert_eq!(v["rxBytes"], 616958417u64);
        assert_eq!(v["txErrors"], 1);
        assert_eq!(v["interfaces"][1]["name"], "cni0");
        assert_eq!(v["time"], "2023-11-14T22:13:20Z");
        // No eth0: the interfaces alone, nothing at the top.
        let v = network_json(&NetSample {
            at_nanos: 0,
            interfaces: vec![],
        });
        assert!(v.get("name").is_none());
    }

    #[test]
    fn filesystems_as_the_kubelets_fs_stats() {
        let fs = FsStats {
            total_bytes: 1000,
            free_bytes: 300,
            available_bytes: 250,
            inodes: 50,
            inodes_free: 20,
        };
        let v = node_fs_json(&FsSample { at_nanos: 0, fs });
        assert_eq!(
            v,
            json!({"time": "1970-01-01T00:00:00Z", "availableBytes": 250, "capacityBytes": 1000,
                   "usedBytes": 700, "inodesFree": 20, "inodes": 50, "inodesUsed": 30})
        );
        let v = part_fs_json(0, Some(12), None, Some(&fs));
        assert_eq!(v["usedBytes"], 12);
        assert_eq!(v["capacityBytes"], 1000);
        assert!(v.get("inodesUsed").is_none());
        let v = image_fs_json(&ImageFs {
            at_nanos: 0,
            used_bytes: Some(5),
            inodes_used: Some(2),
            fs: None,
        });
        assert_eq!(
            v,
            json!({"time": "1970-01-01T00:00:00Z", "usedBytes": 5, "inodesUsed": 2})
        );
    }

    #[test]
    fn log_files_by_container() {
        let u = |b| Usage {
            bytes: b,
            inodes: 1,
        };
        let files = vec![
            ("app_0.log".to_string(), u(4096)),
            ("app_1.log".to_string(), u(8192)),
            ("app_1.log.20261130-101010.gz".to_string(), u(512)),
            ("side_0.log".to_string(), u(1024)),
            ("stray".to_string(), u(7)),
        ];
        let got = logs_by_container(&files);
        assert_eq!(
            got.get("app"),
            Some(&Usage {
                bytes: 12800,
                inodes: 3
            })
        );
        assert_eq!(got.get("side"), Some(&u(1024)));
        assert_eq!(got.len(), 2);
    }

    #[test]
    fn du_counts_blocks_and_inodes() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a"), vec![1u8; 10_000]).unwrap();
        std::fs::create_dir(dir.path().join("d")).unwrap();
        std::fs::write(dir.path().join("d/b"), vec![1u8; 5000]).unwrap();
        std::fs::hard_link(dir.path().join("a"), dir.path().join("d/a2")).unwrap();
        let got = du(dir.path(), u64::MAX);
        assert!(got.complete);
        let got = got.usage;
        // The dir, a, d, b: a's hard link once.
        assert_eq!(got.inodes, 4);
        assert!(got.bytes >= 15_000, "{got:?}");
        assert_eq!(du(&dir.path().join("missing"), 10).usage, Usage::default());
        // Three entries visited of five: cut short, a lower bound.
        let cut = du(dir.path(), 3);
        assert!(!cut.complete);
        assert!(cut.usage.inodes <= 3, "{cut:?}");
    }
}
