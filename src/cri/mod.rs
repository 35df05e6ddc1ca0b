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
