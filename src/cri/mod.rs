//! The container runtime, through the CRI v1 API over a unix socket (containerd, CRI-O).
//!
//! [`CriRuntime`] is the narrow interface the rest of edgehub uses, so the runtime reconciler
//! and the upgrade engine can be unit-tested with an in-memory fake; [`CriClient`] is the real
//! client (tonic over the socket, the `k8s-cri` crate's CRI v1 proto). Every call has a
//! deadline.

mod client;
#[cfg(test)]
pub mod fake;
mod health;

pub use client::CriClient;
pub use edgehub_cri_api::v1 as api;
pub use health::{spawn_monitor, CriHealth};

use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

/// Labels on every CRI object edgehub creates, so a restart finds them and foreign objects are
/// never touched. The kubelet-compatible ones come first.
pub mod labels {
    pub const POD_NAME: &str = "io.kubernetes.pod.name";
    pub const POD_NAMESPACE: &str = "io.kubernetes.pod.namespace";
    pub const POD_UID: &str = "io.kubernetes.pod.uid";
    pub const CONTAINER_NAME: &str = "io.kubernetes.container.name";
    /// Marks an object as edgehub's.
    pub const MANAGED_BY: &str = "edgehub.io/managed-by";
    /// The node whose edgehub owns the object: edgehubs of different nodes sharing one
    /// runtime (tests, simulators) never touch each other's pods.
    pub const NODE: &str = "edgehub.io/node";
    pub const REVISION_HASH: &str = "edgehub.io/revision-hash";
    pub const UPGRADE_ID: &str = "edgehub.io/upgrade-id";
    /// A sandbox annotation (the kubelet's key): the pod's termination grace period.
    pub const GRACE_PERIOD: &str = "io.kubernetes.pod.terminationGracePeriod";
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum CriError {
    /// The socket is missing, refuses connections, or the runtime is not serving.
    #[error("CRI socket {socket}: runtime unavailable: {reason}")]
    Unavailable { socket: PathBuf, reason: String },
    #[error("CRI {method} took longer than {timeout:?}")]
    Timeout {
        method: &'static str,
        timeout: Duration,
    },
    #[error("CRI {method}: {code}: {message}")]
    Call {
        method: &'static str,
        code: String,
        message: String,
    },
    #[error("CRI runtime speaks {found}, edgehub needs runtime API v1")]
    Version { found: String },
}

impl CriError {
    /// The object does not exist (already removed, never created).
    pub fn is_not_found(&self) -> bool {
        matches!(self, CriError::Call { code, .. } if code == "NotFound")
    }

    pub fn is_unavailable(&self) -> bool {
        matches!(self, CriError::Unavailable { .. })
    }
}

/// The sandbox's pid in a verbose `PodSandboxStatus`'s `info` (containerd puts a JSON
/// document under `info` whose `pid` is the pause process); pure.
pub fn sandbox_info_pid(info: &HashMap<String, String>) -> Option<u32> {
    let doc: serde_json::Value = serde_json::from_str(info.get("info")?).ok()?;
    doc.get("pid")?
        .as_u64()
        .and_then(|p| u32::try_from(p).ok())
        .filter(|p| *p > 0)
}

/// The sandbox (pause) image in a verbose `Status`'s `info`: containerd 1.x's configuration
/// has `sandboxImage`, 2.x's `pinnedImages.sandbox`; looked for in every JSON document of
/// `info`, a few levels deep; pure.
pub fn sandbox_image_from_info(info: &HashMap<String, String>) -> Option<String> {
    fn find(v: &serde_json::Value, depth: u8) -> Option<String> {
        let o = v.as_object()?;
        if let Some(s) = o.get("sandboxImage").and_then(|s| s.as_str()) {
            return Some(s.to_string()).filter(|s| !s.is_empty());
        }
        if let Some(s) = o
            .get("pinnedImages")
            .and_then(|p| p.get("sandbox"))
            .and_then(|s| s.as_str())
        {
            return Some(s.to_string()).filter(|s| !s.is_empty());
        }
        if depth == 0 {
            return None;
        }
        o.values().find_map(|v| find(v, depth - 1))
    }
    let mut keys: Vec<&String> = info.keys().collect();
    keys.sort();
    keys.into_iter().find_map(|k| {
        let doc: serde_json::Value = serde_json::from_str(&info[k]).ok()?;
        find(&doc, 4)
    })
}

/// What edgehub needs from a container runtime.
pub trait CriRuntime: Send + Sync {
    fn version(&self) -> impl Future<Output = Result<api::VersionResponse, CriError>> + Send;
    /// Runtime conditions (RuntimeReady, NetworkReady).
    fn status(&self) -> impl Future<Output = Result<api::StatusResponse, CriError>> + Send;

    fn pull_image(
        &self,
        image: &str,
        auth: Option<api::AuthConfig>,
    ) -> impl Future<Output = Result<String, CriError>> + Send;
    fn image_status(
        &self,
        image: &str,
    ) -> impl Future<Output = Result<Option<api::Image>, CriError>> + Send;
    fn list_images(&self) -> impl Future<Output = Result<Vec<api::Image>, CriError>> + Send;
    fn remove_image(&self, image: &str) -> impl Future<Output = Result<(), CriError>> + Send;

    fn run_pod_sandbox(
        &self,
        config: api::PodSandboxConfig,
    ) -> impl Future<Output = Result<String, CriError>> + Send;
    fn pod_sandbox_status(
        &self,
        id: &str,
    ) -> impl Future<Output = Result<Option<api::PodSandboxStatus>, CriError>> + Send;
    fn list_pod_sandbox(
        &self,
        labels: HashMap<String, String>,
    ) -> impl Future<Output = Result<Vec<api::PodSandbox>, CriError>> + Send;
    fn stop_pod_sandbox(&self, id: &str) -> impl Future<Output = Result<(), CriError>> + Send;
    fn remove_pod_sandbox(&self, id: &str) -> impl Future<Output = Result<(), CriError>> + Send;

    fn create_container(
        &self,
        sandbox_id: &str,
        config: api::ContainerConfig,
        sandbox_config: api::PodSandboxConfig,
    ) -> impl Future<Output = Result<String, CriError>> + Send;
    fn start_container(&self, id: &str) -> impl Future<Output = Result<(), CriError>> + Send;
    fn stop_container(
        &self,
        id: &str,
        timeout_secs: i64,
    ) -> impl Future<Output = Result<(), CriError>> + Send;
    fn remove_container(&self, id: &str) -> impl Future<Output = Result<(), CriError>> + Send;
    fn container_status(
        &self,
        id: &str,
    ) -> impl Future<Output = Result<Option<api::ContainerStatus>, CriError>> + Send;
    fn list_containers(
        &self,
        labels: HashMap<String, String>,
    ) -> impl Future<Output = Result<Vec<api::Container>, CriError>> + Send;
    fn exec_sync(
        &self,
        id: &str,
        cmd: Vec<String>,
        timeout: Duration,
    ) -> impl Future<Output = Result<api::ExecSyncResponse, CriError>> + Send;
    /// Has the runtime reopen a running container's log file: after a rotation renamed it,
    /// the runtime writes to a new file at the log path.
    fn reopen_container_log(&self, id: &str) -> impl Future<Output = Result<(), CriError>> + Send;
}

/// The runtime's streaming calls (`Exec`, `Attach`, `PortForward`): each answers with a URL
/// on the runtime's own streaming server (containerd: a 127.0.0.1 port of its own), where the
/// caller's upgraded connection is to be proxied. The URL is good for one connection, soon.
pub trait CriStreaming: Send + Sync {
    fn exec(&self, req: api::ExecRequest) -> impl Future<Output = Result<String, CriError>> + Send;
    fn attach(
        &self,
        req: api::AttachRequest,
    ) -> impl Future<Output = Result<String, CriError>> + Send;
    fn port_forward(
        &self,
        req: api::PortForwardRequest,
    ) -> impl Future<Output = Result<String, CriError>> + Send;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sandbox_pid_from_containerds_verbose_status() {
        let info = |v: &str| HashMap::from([("info".to_string(), v.to_string())]);
        assert_eq!(
            sandbox_info_pid(&info(r#"{"pid":4242,"processStatus":"running"}"#)),
            Some(4242)
        );
        assert_eq!(sandbox_info_pid(&info(r#"{"pid":0}"#)), None);
        assert_eq!(sandbox_info_pid(&info("not json")), None);
        assert_eq!(sandbox_info_pid(&HashMap::new()), None);
    }

    #[test]
    fn the_sandbox_image_from_the_runtimes_verbose_status() {
        let info = |k: &str, v: &str| HashMap::from([(k.to_string(), v.to_string())]);
        // containerd 1.6/1.7: the CRI plugin's configuration.
        let v1 = r#"{"containerd":{"snapshotter":"overlayfs"},"sandboxImage":"registry.k8s.io/pause:3.6","cni":{}}"#;
        assert_eq!(
            sandbox_image_from_info(&info("config", v1)).as_deref(),
            Some("registry.k8s.io/pause:3.6")
        );
        // containerd 2.x: the pinned images of the image service's configuration.
        let v2 =
            r#"{"runtime":{},"images":{"pinnedImages":{"sandbox":"registry.k8s.io/pause:3.10"}}}"#;
        assert_eq!(
            sandbox_image_from_info(&info("imageConfig", v2)).as_deref(),
            Some("registry.k8s.io/pause:3.10")
        );
        assert_eq!(
            sandbox_image_from_info(&info("config", r#"{"sandboxImage":""}"#)),
            None
        );
        assert_eq!(sandbox_image_from_info(&info("config", "not json")), None);
        assert_eq!(sandbox_image_from_info(&HashMap::new()), None);
    }
}
