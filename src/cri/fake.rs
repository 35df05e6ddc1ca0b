//! An in-memory [`CriRuntime`] for unit tests of the code above the CRI (the reconciler).
//! It keeps sandboxes, containers and images in maps and applies label selectors the way
//! containerd does; nothing runs.

use super::{api, CriError, CriRuntime, CriStreaming};
use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;

#[derive(Default)]
pub struct State {
    pub sandboxes: HashMap<String, api::PodSandbox>,
    pub containers: HashMap<String, api::Container>,
    pub images: HashSet<String>,
    pub pulls: Vec<String>,
    /// `ContainerStatus` calls answered, for tests of what asks the runtime how often.
    pub status_calls: usize,
    next: u64,
}

/// The fake runtime; `state` is open for tests to inspect and to inject events.
#[derive(Default)]
pub struct FakeCri {
    pub state: Mutex<State>,
}

fn matches(labels: &HashMap<String, String>, sel: &HashMap<String, String>) -> bool {
    sel.iter().all(|(k, v)| labels.get(k) == Some(v))
}

fn not_found(method: &'static str, id: &str) -> CriError {
    CriError::Call {
        method,
        code: "NotFound".into(),
        message: format!("{id} not found"),
    }
}

impl FakeCri {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Marks a container exited, as a crash would.
    pub fn exit(&self, id: &str) {
        if let Some(c) = self.lock().containers.get_mut(id) {
            c.state = api::ContainerState::ContainerExited as i32;
        }
    }
}

impl CriRuntime for FakeCri {
    async fn version(&self) -> Result<api::VersionResponse, CriError> {
        Ok(api::VersionResponse {
            version: "0.1.0".into(),
            runtime_name: "fake".into(),
            runtime_version: "1.0".into(),
            runtime_api_version: "v1".into(),
        })
    }

    async fn status(&self) -> Result<api::StatusResponse, CriError> {
        Ok(api::StatusResponse::default())
    }

    async fn pull_image(
        &self,
        image: &str,
        _auth: Option<api::AuthConfig>,
    ) -> Result<String, CriError> {
        let mut s = self.lock();
        s.images.insert(image.to_string());
        s.pulls.push(image.to_string());
        Ok(format!("sha256:{image}"))
    }

    async fn image_status(&self, image: &str) -> Result<Option<api::Image>, CriError> {
        Ok(self.lock().images.contains(image).then(|| api::Image {
            id: format!("sha256:{image}"),
            repo_tags: vec![image.to_string()],
            ..Default::default()
        }))
    }

    async fn list_images(&self) -> Result<Vec<api::Image>, CriError> {
        Ok(Vec::new())
    }

    async fn remove_image(&self, image: &str) -> Result<(), CriError> {
        self.lock().images.remove(image);
        Ok(())
    }

    async fn run_pod_sandbox(&self, config: api::PodSandboxConfig) -> Result<String, CriError> {
        let mut s = self.lock();
        s.next += 1;
        let id = format!("sb-{}", s.next);
        s.sandboxes.insert(
            id.clone(),
            api::PodSandbox {
                id: id.clone(),
                metadata: config.metadata,
                state: api::PodSandboxState::SandboxReady as i32,
                created_at: 1,
                labels: config.labels,
                annotations: config.annotations,
                ..Default::default()
            },
        );
        Ok(id)
    }

    async fn pod_sandbox_status(
        &self,
        id: &str,
    ) -> Result<Option<api::PodSandboxStatus>, CriError> {
        Ok(self
            .lock()
            .sandboxes
            .get(id)
            .map(|sb| api::PodSandboxStatus {
                id: sb.id.clone(),
                state: sb.state,
                ..Default::default()
            }))
    }

    async fn list_pod_sandbox(
        &self,
        labels: HashMap<String, String>,
    ) -> Result<Vec<api::PodSandbox>, CriError> {
        Ok(self
            .lock()
            .sandboxes
            .values()
            .filter(|s| matches(&s.labels, &labels))
            .cloned()
            .collect())
    }

    async fn stop_pod_sandbox(&self, id: &str) -> Result<(), CriError> {
        let mut s = self.lock();
        let sb = s
            .sandboxes
            .get_mut(id)
            .ok_or_else(|| not_found("StopPodSandbox", id))?;
        sb.state = api::PodSandboxState::SandboxNotready as i32;
        Ok(())
    }

    async fn remove_pod_sandbox(&self, id: &str) -> Result<(), CriError> {
        let mut s = self.lock();
        s.sandboxes.remove(id);
        s.containers.retain(|_, c| c.pod_sandbox_id != id);
        Ok(())
    }

    async fn create_container(
        &self,
        sandbox_id: &str,
        config: api::ContainerConfig,
        _sandbox_config: api::PodSandboxConfig,
    ) -> Result<String, CriError> {
        let mut s = self.lock();
        if !s.sandboxes.contains_key(sandbox_id) {
            return Err(not_found("CreateContainer", sandbox_id));
        }
        s.next += 1;
        let id = format!("ctr-{}", s.next);
        s.containers.insert(
            id.clone(),
            api::Container {
                id: id.clone(),
                pod_sandbox_id: sandbox_id.to_string(),
                metadata: config.metadata,
                image: config.image,
                state: api::ContainerState::ContainerCreated as i32,
                labels: config.labels,
                annotations: config.annotations,
                ..Default::default()
            },
        );
        Ok(id)
    }

    async fn start_container(&self, id: &str) -> Result<(), CriError> {
        let mut s = self.lock();
        let c = s
            .containers
            .get_mut(id)
            .ok_or_else(|| not_found("StartContainer", id))?;
        c.state = api::ContainerState::ContainerRunning as i32;
        Ok(())
    }

    async fn stop_container(&self, id: &str, _timeout_secs: i64) -> Result<(), CriError> {
        self.exit(id);
        Ok(())
    }

    async fn remove_container(&self, id: &str) -> Result<(), CriError> {
        self.lock()
            .containers
            .remove(id)
            .map(|_| ())
            .ok_or_else(|| not_found("RemoveContainer", id))
    }

    async fn container_status(&self, id: &str) -> Result<Option<api::ContainerStatus>, CriError> {
        let mut s = self.lock();
        s.status_calls += 1;
        let c = s
            .containers
            .get(id)
            .ok_or_else(|| not_found("ContainerStatus", id))?;
        Ok(Some(api::ContainerStatus {
            id: c.id.clone(),
            metadata: c.metadata.clone(),
            state: c.state,
            image: c.image.clone(),
            image_ref: "fake@sha256:1".into(),
            exit_code: if c.state == api::ContainerState::ContainerExited as i32 {
                137
            } else {
                0
            },
            ..Default::default()
        }))
    }

    async fn list_containers(
        &self,
        labels: HashMap<String, String>,
    ) -> Result<Vec<api::Container>, CriError> {
        Ok(self
            .lock()
            .containers
            .values()
            .filter(|c| matches(&c.labels, &labels))
            .cloned()
            .collect())
    }

    async fn reopen_container_log(&self, id: &str) -> Result<(), CriError> {
        self.lock()
            .containers
            .get(id)
            .map(|_| ())
            .ok_or_else(|| not_found("ReopenContainerLog", id))
    }

    async fn exec_sync(
        &self,
        _id: &str,
        _cmd: Vec<String>,
        _timeout: Duration,
    ) -> Result<api::ExecSyncResponse, CriError> {
        Ok(api::ExecSyncResponse::default())
    }
}

/// The fake has no streaming server: each call says so, and hands out no URL.
fn no_streaming(method: &'static str) -> CriError {
    CriError::Call {
        method,
        code: "Unimplemented".into(),
        message: "the fake runtime has no streaming server".into(),
    }
}

impl CriStreaming for FakeCri {
    async fn exec(&self, _req: api::ExecRequest) -> Result<String, CriError> {
        Err(no_streaming("Exec"))
    }
    async fn attach(&self, _req: api::AttachRequest) -> Result<String, CriError> {
        Err(no_streaming("Attach"))
    }
    async fn port_forward(&self, _req: api::PortForwardRequest) -> Result<String, CriError> {
        Err(no_streaming("PortForward"))
    }
}
