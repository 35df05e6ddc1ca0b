//! The kubelet's node duties, since no kubelet runs beside edgehub: register the Node, keep its
//! status current, and renew its Lease, so a stock control plane schedules DaemonSet pods onto
//! the device and does not mark it NotReady.
//!
//! None of this writes the local database: heartbeats would wear the flash for nothing.
//!
//! The Node and status bodies are built by pure functions from a [`NodeSample`] (what the
//! device looks like right now), so they are unit-tested; [`HostProbe`] reads the sample from
//! the machine, and tests substitute their own [`NodeProbe`].

use crate::kube::resource::{LEASES, NODES};
use crate::kube::{ApiClient, KubeError, PatchType};
use crate::link::LinkState;
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Instant, SystemTime};
use tokio::sync::watch;

/// Annotation saying which agent manages the Node.
pub const MANAGED_BY_ANNOTATION: &str = "edgehub.io/managed-by";
/// The version edgehub reports in `nodeInfo.kubeletVersion`: the Kubernetes API level it was
/// recorded against, marked as edgehub.
pub const KUBELET_VERSION: &str = "v1.36.2-edgehub";
pub const LEASE_NAMESPACE: &str = "kube-node-lease";

/// What the device looks like right now.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NodeSample {
    pub cpus: u32,
    pub memory_total_bytes: u64,
    pub memory_available_bytes: u64,
    /// Free space on the data dir's filesystem, in percent; `None` when unknown.
    pub disk_free_percent: Option<u8>,
    pub pids_used: u64,
    pub pid_max: u64,
    pub internal_ip: Option<IpAddr>,
    pub kernel_version: String,
    pub os_image: String,
    /// Kubernetes' name (GOARCH) of the architecture.
    pub architecture: String,
    pub machine_id: String,
    pub boot_id: String,
    pub system_uuid: String,
    /// `containerd://1.6.20`, once the CRI has answered.
    pub container_runtime_version: Option<String>,
    /// Why the container runtime cannot be used; the Node is then not Ready.
    pub runtime_problem: Option<String>,
}

/// A source of samples.
pub trait NodeProbe: Send + Sync {
    fn sample(&self) -> NodeSample;
}

/// Kubernetes' name for the architecture this binary was built for.
pub fn goarch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        other => other,
    }
}

/// The Node object edgehub registers and keeps current, as a kubelet would.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeConfig {
    /// Extra labels on self-registration (NodeRestriction-allowed ones only).
    pub labels: std::collections::BTreeMap<String, String>,
    pub taints: Vec<Taint>,
    pub max_pods: u32,
    /// Memory kept back from allocatable for the system.
    pub memory_reserve_bytes: u64,
    pub lease_renew: std::time::Duration,
    pub lease_duration_secs: u32,
    /// Status is patched on change, and at least this often.
    pub status_report: std::time::Duration,
    /// MemoryPressure when MemAvailable drops below this.
    pub memory_pressure_bytes: u64,
    /// DiskPressure when the data dir's filesystem has less free space than this share.
    pub disk_pressure_percent: u8,
    /// PIDPressure when more than this share of pid_max is in use.
    pub pid_pressure_percent: u8,
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Taint {
    pub key: String,
    #[serde(default)]
    pub value: String,
    pub effect: String,
}

/// The labels of the Node: the kubelet's well-known ones and the configured ones.
pub fn labels(cfg: &NodeConfig, node_name: &str, arch: &str) -> BTreeMap<String, String> {
    let mut l = BTreeMap::new();
    l.insert("kubernetes.io/hostname".to_string(), node_name.to_string());
    l.insert("kubernetes.io/os".to_string(), "linux".to_string());
    l.insert("kubernetes.io/arch".to_string(), arch.to_string());
    for (k, v) in &cfg.labels {
        l.insert(k.clone(), v.clone());
    }
    l
}

fn quantity_ki(bytes: u64) -> String {
    format!("{}Ki", bytes / 1024)
}

/// `(capacity, allocatable)`.
pub fn resources(s: &NodeSample, cfg: &NodeConfig) -> (Value, Value) {
    let cap = json!({
        "cpu": s.cpus.max(1).to_string(),
        "memory": quantity_ki(s.memory_total_bytes),
        "pods": cfg.max_pods.to_string(),
    });
    let alloc = json!({
        "cpu": s.cpus.max(1).to_string(),
        "memory": quantity_ki(s.memory_total_bytes.saturating_sub(cfg.memory_reserve_bytes)),
        "pods": cfg.max_pods.to_string(),
    });
    (cap, alloc)
}

struct Cond {
    kind: &'static str,
    status: bool,
    reason: &'static str,
    message: String,
}

/// The node conditions, keeping each one's `lastTransitionTime` from `prev` while its status
/// is unchanged. The messages are fixed texts, as the kubelet's are: a live figure in them
/// (MiB available, PIDs in use) made every report a change, rewriting the Node in etcd and in
/// edgehub's cache on flash each time (the flash bench found it). No NetworkUnavailable:
/// edgehub's pods use the host network or the runtime's
/// CNI, and that condition belongs to whoever manages routes.
pub fn conditions(s: &NodeSample, cfg: &NodeConfig, prev: Option<&Value>, now: &str) -> Value {
    let mem_low = s.memory_available_bytes < cfg.memory_pressure_bytes;
    let disk_low = s
        .disk_free_percent
        .is_some_and(|f| f < cfg.disk_pressure_percent);
    let pid_high =
        s.pid_max > 0 && s.pids_used * 100 > s.pid_max * u64::from(cfg.pid_pressure_percent);
    let list = [
        match &s.runtime_problem {
            None => Cond {
                kind: "Ready",
                status: true,
                reason: "EdgehubReady",
                message: "edgehub is posting ready status".into(),
            },
            Some(p) => Cond {
                kind: "Ready",
                status: false,
                reason: "ContainerRuntimeNotReady",
                message: format!("container runtime is down: {p}"),
            },
        },
        Cond {
            kind: "MemoryPressure",
            status: mem_low,
            reason: if mem_low {
                "NodeHasInsufficientMemory"
            } else {
                "NodeHasSufficientMemory"
            },
            message: if mem_low {
                "edgehub has insufficient memory available"
            } else {
                "edgehub has sufficient memory available"
            }
            .into(),
        },
        Cond {
            kind: "DiskPressure",
            status: disk_low,
            reason: if disk_low {
                "NodeHasDiskPressure"
            } else {
                "NodeHasNoDiskPressure"
            },
            message: match (s.disk_free_percent, disk_low) {
                (None, _) => "free space unknown",
                (Some(_), true) => "edgehub has disk pressure",
                (Some(_), false) => "edgehub has no disk pressure",
            }
            .into(),
        },
        Cond {
            kind: "PIDPressure",
            status: pid_high,
            reason: if pid_high {
                "NodeHasInsufficientPID"
            } else {
                "NodeHasSufficientPID"
            },
            message: if pid_high {
                "edgehub has insufficient PID available"
            } else {
                "edgehub has sufficient PID available"
            }
            .into(),
        },
    ];
    let prev_of =
        |kind: &str| -> Option<&Value> { prev?.as_array()?.iter().find(|c| c["type"] == kind) };
    Value::Array(
        list.into_iter()
            .map(|c| {
                let status = if c.status { "True" } else { "False" };
                let since = prev_of(c.kind)
                    .filter(|p| p["status"] == status)
                    .and_then(|p| p["lastTransitionTime"].as_str())
                    .unwrap_or(now)
                    .to_string();
                json!({
                    "type": c.kind,
                    "status": status,
                    "reason": c.reason,
                    "message": c.message,
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": since,
                })
            })
            .collect(),
    )
}

/// The Node's `status`.
pub fn status(
    s: &NodeSample,
    cfg: &NodeConfig,
    node_name: &str,
    prev_conditions: Option<&Value>,
    now: &str,
) -> Value {
    let (cap, alloc) = resources(s, cfg);
    let mut addresses = Vec::new();
    if let Some(ip) = s.internal_ip {
        addresses.push(json!({"type": "InternalIP", "address": ip.to_string()}));
    }
    addresses.push(json!({"type": "Hostname", "address": node_name}));
    json!({
        "capacity": cap,
        "allocatable": alloc,
        "conditions": conditions(s, cfg, prev_conditions, now),
        "addresses": addresses,
        "nodeInfo": {
            "machineID": s.machine_id,
            "systemUUID": s.system_uuid,
            "bootID": s.boot_id,
            "kernelVersion": s.kernel_version,
            "osImage": s.os_image,
            "containerRuntimeVersion": s.container_runtime_version.clone().unwrap_or_default(),
            "kubeletVersion": KUBELET_VERSION,
            "kubeProxyVersion": "",
            "operatingSystem": "linux",
            "architecture": s.architecture,
        },
    })
}

fn taints_json(taints: &[Taint]) -> Value {
    Value::Array(
        taints
            .iter()
            .map(|t| json!({"key": t.key, "value": t.value, "effect": t.effect}))
            .collect(),
    )
}

/// The Node to create on first registration (NodeRestriction keeps status set at creation).
pub fn new_node(s: &NodeSample, cfg: &NodeConfig, node_name: &str, now: &str) -> Value {
    let mut spec = Map::new();
    if !cfg.taints.is_empty() {
        spec.insert("taints".into(), taints_json(&cfg.taints));
    }
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": node_name,
            "labels": labels(cfg, node_name, &s.architecture),
            "annotations": {MANAGED_BY_ANNOTATION: concat!("edgehub/", env!("CARGO_PKG_VERSION"))},
        },
        "spec": spec,
        "status": status(s, cfg, node_name, None, now),
    })
}

/// The metadata patch that brings an existing Node's labels and annotation to what edgehub
/// registers, or `None` when nothing differs. Taints are set only at creation:
/// NodeRestriction does not let a node change its own taints afterwards.
pub fn reconcile_patch(
    existing: &Value,
    cfg: &NodeConfig,
    node_name: &str,
    arch: &str,
) -> Option<Value> {
    let mut want_labels = Map::new();
    for (k, v) in labels(cfg, node_name, arch) {
        if existing
            .pointer("/metadata/labels")
            .and_then(|l| l.get(&k))
            .and_then(Value::as_str)
            != Some(v.as_str())
        {
            want_labels.insert(k, v.into());
        }
    }
    let managed = concat!("edgehub/", env!("CARGO_PKG_VERSION"));
    let annotation_ok = existing
        .pointer("/metadata/annotations")
        .and_then(|a| a.get(MANAGED_BY_ANNOTATION))
        .and_then(Value::as_str)
        == Some(managed);
    if want_labels.is_empty() && annotation_ok {
        return None;
    }
    let mut meta = Map::new();
    if !want_labels.is_empty() {
        meta.insert("labels".into(), Value::Object(want_labels));
    }
    if !annotation_ok {
        meta.insert(
            "annotations".into(),
            json!({MANAGED_BY_ANNOTATION: managed}),
        );
    }
    Some(json!({"metadata": meta}))
}

/// The Lease body for a create (`resource_version` None) or a conditional replace.
pub fn lease(
    node_name: &str,
    duration_secs: u32,
    renew_time: &str,
    resource_version: Option<&str>,
) -> Value {
    let mut meta = json!({"name": node_name, "namespace": LEASE_NAMESPACE});
    if let Some(rv) = resource_version {
        meta["resourceVersion"] = rv.into();
    }
    json!({
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": meta,
        "spec": {
            "holderIdentity": node_name,
            "leaseDurationSeconds": duration_secs,
            "renewTime": renew_time,
        },
    })
}

/// The parts of a status whose change warrants a patch before the report interval: everything
/// but the heartbeat times and the free-text messages.
fn significant(status: &Value) -> Value {
    let mut s = status.clone();
    if let Some(cs) = s.get_mut("conditions").and_then(Value::as_array_mut) {
        for c in cs {
            if let Some(m) = c.as_object_mut() {
                m.remove("lastHeartbeatTime");
                m.remove("lastTransitionTime");
                m.remove("message");
            }
        }
    }
    s
}

/// Counters, for tests and metrics.
#[derive(Debug, Default)]
pub struct NodeStats {
    pub registrations: std::sync::atomic::AtomicU64,
    pub lease_renewals: std::sync::atomic::AtomicU64,
    pub status_patches: std::sync::atomic::AtomicU64,
    pub errors: std::sync::atomic::AtomicU64,
}

/// Registers the Node, renews the Lease and patches status, until shutdown.
pub struct NodeAgent {
    pub client: ApiClient,
    pub probe: Arc<dyn NodeProbe>,
    pub cfg: NodeConfig,
    pub node_name: String,
    pub stats: Arc<NodeStats>,
    registered: bool,
    lease_rv: Option<String>,
    last_status: Option<(Value, Instant)>,
    conditions: Option<Value>,
    /// The last cycle renewed the Lease.
    healthy: bool,
}

fn bump(c: &std::sync::atomic::AtomicU64) {
    c.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

impl NodeAgent {
    pub fn new(
        client: ApiClient,
        probe: Arc<dyn NodeProbe>,
        cfg: NodeConfig,
        node_name: String,
    ) -> NodeAgent {
        NodeAgent {
            client,
            probe,
            cfg,
            node_name,
            stats: Arc::default(),
            registered: false,
            lease_rv: None,
            last_status: None,
            conditions: None,
            healthy: false,
        }
    }

    /// Runs a cycle every lease-renew interval, and at once when the link comes back: a Node
    /// that was away goes Ready again immediately, Lease first, then status.
    pub async fn run(
        mut self,
        mut link: watch::Receiver<LinkState>,
        mut shutdown: watch::Receiver<bool>,
    ) {
        let mut tick = tokio::time::interval(self.cfg.lease_renew);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut online = matches!(*link.borrow(), LinkState::Online);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                r = link.changed() => {
                    if r.is_err() {
                        // The sync stopped; keep the timer going.
                        link = watch::channel(LinkState::Unknown).1;
                        continue;
                    }
                    let now_online = matches!(*link.borrow_and_update(), LinkState::Online);
                    // A short outage can be missed between two reads of the link state; a
                    // failed last cycle says the same.
                    let back = now_online && (!online || !self.healthy);
                    online = now_online;
                    if !back {
                        continue;
                    }
                    tracing::info!(node = %self.node_name, "link is back: renewing the Lease and posting status now");
                    // The node lifecycle controller may have set Ready=Unknown meanwhile:
                    // post status now, changed or not.
                    self.last_status = None;
                    tick.reset();
                }
                _ = shutdown.changed() => break,
            }
            self.cycle().await;
        }
    }

    /// One round: register if needed, renew the Lease, patch status if due.
    pub async fn cycle(&mut self) {
        if !self.registered {
            match self.register().await {
                Ok(()) => self.registered = true,
                Err(e) => {
                    bump(&self.stats.errors);
                    self.healthy = false;
                    tracing::warn!(node = %self.node_name, error = %e, "node registration failed; will retry");
                    return;
                }
            }
        }
        let was_healthy = self.healthy;
        self.healthy = match self.renew_lease().await {
            Ok(()) => true,
            Err(e) => {
                bump(&self.stats.errors);
                // Offline, every 10 s: said once, then quietly until it works again.
                if was_healthy || !e.is_offline() {
                    tracing::warn!(node = %self.node_name, error = %e, "lease renewal failed");
                } else {
                    tracing::debug!(node = %self.node_name, error = %e, "lease renewal failed");
                }
                false
            }
        };
        if let Err(e) = self.patch_status().await {
            bump(&self.stats.errors);
            tracing::warn!(node = %self.node_name, error = %e, "node status update failed");
        }
    }

    async fn sample(&self) -> NodeSample {
        let probe = self.probe.clone();
        // Reading /proc and resolving the apiserver's address block.
        tokio::task::spawn_blocking(move || probe.sample())
            .await
            .unwrap_or_default()
    }

    async fn register(&mut self) -> Result<(), KubeError> {
        match self.client.get(&NODES, None, &self.node_name).await {
            Ok(raw) => {
                let existing: Value = serde_json::from_str(&raw).unwrap_or(Value::Null);
                if let Some(patch) =
                    reconcile_patch(&existing, &self.cfg, &self.node_name, goarch())
                {
                    self.client
                        .patch(
                            &NODES,
                            None,
                            &self.node_name,
                            None,
                            PatchType::StrategicMerge,
                            patch.to_string().into_bytes(),
                        )
                        .await?;
                    tracing::info!(node = %self.node_name, "existing Node reconciled");
                } else {
                    tracing::info!(node = %self.node_name, "Node already registered");
                }
            }
            Err(e) if e.code() == Some(404) => {
                let sample = self.sample().await;
                let body = new_node(&sample, &self.cfg, &self.node_name, &crate::time::now());
                match self
                    .client
                    .create(&NODES, None, body.to_string().into_bytes())
                    .await
                {
                    Ok(_) => tracing::info!(node = %self.node_name, "Node registered"),
                    Err(e) if e.code() == Some(409) => {}
                    Err(e) => return Err(e),
                }
            }
            Err(e) => return Err(e),
        }
        bump(&self.stats.registrations);
        Ok(())
    }

    async fn renew_lease(&mut self) -> Result<(), KubeError> {
        for _ in 0..2 {
            let renew = crate::time::rfc3339_micros(SystemTime::now());
            let Some(rv) = self.lease_rv.clone() else {
                match self
                    .client
                    .get(&LEASES, Some(LEASE_NAMESPACE), &self.node_name)
                    .await
                {
                    Ok(raw) => {
                        self.lease_rv = resource_version(&raw);
                        continue;
                    }
                    Err(e) if e.code() == Some(404) => {
                        let body =
                            lease(&self.node_name, self.cfg.lease_duration_secs, &renew, None);
                        let raw = self
                            .client
                            .create(
                                &LEASES,
                                Some(LEASE_NAMESPACE),
                                body.to_string().into_bytes(),
                            )
                            .await?;
                        self.lease_rv = resource_version(&raw);
                        bump(&self.stats.lease_renewals);
                        return Ok(());
                    }
                    Err(e) => return Err(e),
                }
            };
            let body = lease(
                &self.node_name,
                self.cfg.lease_duration_secs,
                &renew,
                Some(&rv),
            );
            match self
                .client
                .update(
                    &LEASES,
                    Some(LEASE_NAMESPACE),
                    &self.node_name,
                    body.to_string().into_bytes(),
                )
                .await
            {
                Ok(raw) => {
                    self.lease_rv = resource_version(&raw);
                    bump(&self.stats.lease_renewals);
                    return Ok(());
                }
                // Someone else wrote the Lease (or it was recreated): read it again and retry.
                Err(e) if matches!(e.code(), Some(409) | Some(404)) => {
                    tracing::info!(node = %self.node_name, code = e.code(), "lease changed under us; rereading");
                    self.lease_rv = None;
                }
                Err(e) => return Err(e),
            }
        }
        Err(KubeError::Stream {
            request: crate::kube::Request {
                verb: "update",
                resource: "leases.coordination.k8s.io".into(),
                namespace: Some(LEASE_NAMESPACE.into()),
                name: Some(self.node_name.clone()),
            },
            reason: "the Lease kept changing between read and write".into(),
        })
    }

    async fn patch_status(&mut self) -> Result<(), KubeError> {
        let sample = self.sample().await;
        let now = crate::time::now();
        let st = status(
            &sample,
            &self.cfg,
            &self.node_name,
            self.conditions.as_ref(),
            &now,
        );
        let sig = significant(&st);
        if let Some((last, at)) = &self.last_status {
            if *last == sig && at.elapsed() < self.cfg.status_report {
                return Ok(());
            }
        }
        let body = json!({"status": st});
        self.client
            .patch(
                &NODES,
                None,
                &self.node_name,
                Some("status"),
                PatchType::StrategicMerge,
                body.to_string().into_bytes(),
            )
            .await?;
        bump(&self.stats.status_patches);
        self.conditions = st.get("conditions").cloned();
        self.last_status = Some((sig, Instant::now()));
        Ok(())
    }
}

fn resource_version(raw: &str) -> Option<String> {
    serde_json::from_str::<Value>(raw)
        .ok()?
        .pointer("/metadata/resourceVersion")?
        .as_str()
        .map(str::to_string)
}

/// Reads the sample from this machine.
pub struct HostProbe {
    /// Its filesystem's free space drives DiskPressure.
    pub data_dir: PathBuf,
    /// `host:port` of the apiserver: the local address that routes there is the InternalIP.
    pub apiserver: Option<String>,
    /// The container runtime's health, for nodeInfo and the Ready condition.
    pub cri: watch::Receiver<crate::cri::CriHealth>,
}

fn read_trim(path: &str) -> String {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// `(MemTotal, MemAvailable)` in bytes from /proc/meminfo text.
pub fn parse_meminfo(text: &str) -> (u64, u64) {
    let field = |name: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| {
                rest.trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<u64>()
                    .ok()
            })
            .map(|kb| kb * 1024)
            .unwrap_or(0)
    };
    (field("MemTotal:"), field("MemAvailable:"))
}

/// `PRETTY_NAME` from /etc/os-release text.
pub fn parse_os_release(text: &str) -> String {
    text.lines()
        .find_map(|l| l.strip_prefix("PRETTY_NAME="))
        .map(|v| v.trim().trim_matches('"').to_string())
        .unwrap_or_else(|| "Linux".into())
}

fn disk_free_percent(path: &std::path::Path) -> Option<u8> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c` is a valid NUL-terminated path and `st` is a properly sized out-parameter;
    // statvfs only writes into it, and we read it only when the call succeeded.
    let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0, so it initialized the struct.
    let st = unsafe { st.assume_init() };
    if st.f_blocks == 0 {
        return None;
    }
    Some(((st.f_bavail as u128 * 100) / st.f_blocks as u128).min(100) as u8)
}

/// The local address that routes to `target` (`host:port`): the node's InternalIP.
pub fn local_ip_towards(target: &str) -> Option<IpAddr> {
    use std::net::{ToSocketAddrs, UdpSocket};
    let addr = target.to_socket_addrs().ok()?.next()?;
    let bind = if addr.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    };
    let sock = UdpSocket::bind(bind).ok()?;
    // A UDP connect sends nothing; it only picks the route and so the source address.
    sock.connect(addr).ok()?;
    Some(sock.local_addr().ok()?.ip())
}

impl NodeProbe for HostProbe {
    fn sample(&self) -> NodeSample {
        let (total, available) =
            parse_meminfo(&std::fs::read_to_string("/proc/meminfo").unwrap_or_default());
        let pids_used = std::fs::read_dir("/proc")
            .map(|d| {
                d.filter_map(Result::ok)
                    .filter(|e| {
                        e.file_name()
                            .to_string_lossy()
                            .bytes()
                            .all(|b| b.is_ascii_digit())
                    })
                    .count() as u64
            })
            .unwrap_or(0);
        NodeSample {
            cpus: std::thread::available_parallelism()
                .map(|n| n.get() as u32)
                .unwrap_or(1),
            memory_total_bytes: total,
            memory_available_bytes: available,
            disk_free_percent: disk_free_percent(&self.data_dir),
            pids_used,
            pid_max: read_trim("/proc/sys/kernel/pid_max").parse().unwrap_or(0),
            internal_ip: self.apiserver.as_deref().and_then(local_ip_towards),
            kernel_version: read_trim("/proc/sys/kernel/osrelease"),
            os_image: parse_os_release(
                &std::fs::read_to_string("/etc/os-release").unwrap_or_default(),
            ),
            architecture: goarch().to_string(),
            machine_id: read_trim("/etc/machine-id"),
            boot_id: read_trim("/proc/sys/kernel/random/boot_id"),
            system_uuid: read_trim("/sys/class/dmi/id/product_uuid"),
            container_runtime_version: self.cri.borrow().version().map(str::to_string),
            runtime_problem: self.cri.borrow().problem(),
        }
    }
}

/// `host:port` of a kubeconfig server URL.
pub fn server_host_port(server: &str) -> Option<String> {
    let uri: hyper::Uri = server.parse().ok()?;
    let host = uri.host()?;
    let port = uri.port_u16().unwrap_or(443);
    Some(if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    })
}

#[cfg(test)]
mod tests;
