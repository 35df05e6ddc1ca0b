//! The kubelet's node duties, since no kubelet runs beside edgehub: register the Node, keep its
//! status current, and renew its Lease, so a stock control plane schedules DaemonSet pods onto
//! the device and does not mark it NotReady.
//!
//! None of this writes the local database: heartbeats would wear the flash for nothing.
//!
//! The Node and status bodies are built by pure functions from a [`NodeSample`] (what the
//! device looks like right now), so they are unit-tested; [`HostProbe`] reads the sample from
//! the machine, and tests substitute their own [`NodeProbe`].

//! The parts:
//! - `object`: the pure bodies (the Node, its status and conditions, the Lease, the patch);
//! - `agent`: [`NodeAgent`], the task that registers the Node, renews the Lease and patches
//!   the status;
//! - `host`: [`HostProbe`], the sample read from this machine.

mod agent;
mod host;
mod object;
#[cfg(test)]
mod tests;

pub use agent::{NodeAgent, NodeStats};
pub use host::{
    goarch, local_ip_towards, parse_meminfo, parse_os_release, server_host_port, HostProbe,
};
pub use object::{conditions, labels, lease, new_node, reconcile_patch, resources, status};

use std::net::IpAddr;

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
    /// Why the image filesystem is under disk pressure (over image garbage collection's high
    /// threshold with nothing left it may remove); the Node then reports `DiskPressure`.
    pub image_fs_pressure: Option<String>,
}

/// A source of samples.
pub trait NodeProbe: Send + Sync {
    fn sample(&self) -> NodeSample;
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
    /// The node API's port, advertised in `status.daemonEndpoints.kubeletEndpoint.Port`
    /// (`None`: the API is off, 0 is advertised).
    pub kubelet_port: Option<u16>,
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Taint {
    pub key: String,
    #[serde(default)]
    pub value: String,
    pub effect: String,
}
