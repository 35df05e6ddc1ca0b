//! The CRI v1 client over a unix socket.

use super::{api, CriError, CriRuntime, CriStreaming};
use api::image_service_client::ImageServiceClient;
use api::runtime_service_client::RuntimeServiceClient;
use hyper_util::rt::TokioIo;
use std::collections::HashMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tonic::transport::{Channel, Endpoint, Uri};

/// Deadline of ordinary calls.
const CALL: Duration = Duration::from_secs(10);
/// Deadline of an image pull (a cellular link can be slow).
pub const PULL_DEADLINE: Duration = Duration::from_secs(300);
/// Deadline of the streaming calls (`Exec`, `Attach`, `PortForward`): they only hand out a
/// URL; the stream itself runs on the runtime's streaming server.
const STREAM_CALL: Duration = CALL;
/// A sandbox start may pull the pause image and set up networking.
const SANDBOX: Duration = Duration::from_secs(120);

/// A CRI client. Cheap to clone; the connection is made on first use and remade after a
/// runtime restart, so a socket that appears later is picked up without a restart.
#[derive(Clone)]
pub struct CriClient {
    socket: PathBuf,
    runtime: RuntimeServiceClient<Channel>,
    images: ImageServiceClient<Channel>,
    pull_deadline: Duration,
}

impl std::fmt::Debug for CriClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CriClient")
            .field("socket", &self.socket)
            .finish()
    }
}

impl CriClient {
    /// A client for `socket`. Nothing is connected yet: a missing socket shows up as
    /// [`CriError::Unavailable`] on the first call.
    pub fn new(socket: &Path) -> CriClient {
        let path = socket.to_path_buf();
        // The URI is required by tonic and ignored by the connector.
        let channel = Endpoint::from_static("http://[::]:0")
            .connect_timeout(Duration::from_secs(5))
            .connect_with_connector_lazy(tower::service_fn(move |_: Uri| {
                let path = path.clone();
                async move {
                    Ok::<_, std::io::Error>(TokioIo::new(
                        tokio::net::UnixStream::connect(path).await?,
                    ))
                }
            }));
        CriClient {
            socket: socket.to_path_buf(),
            runtime: RuntimeServiceClient::new(channel.clone()),
            images: ImageServiceClient::new(channel),
            pull_deadline: PULL_DEADLINE,
        }
    }

    /// The same client with another deadline for image pulls.
    pub fn with_pull_deadline(mut self, d: Duration) -> CriClient {
        self.pull_deadline = d;
        self
    }

    /// Connects and checks that the runtime speaks CRI v1.
    pub async fn connect(socket: &Path) -> Result<(CriClient, api::VersionResponse), CriError> {
        let c = CriClient::new(socket);
        let v = c.version().await?;
        if v.runtime_api_version != "v1" {
            return Err(CriError::Version {
                found: v.runtime_api_version,
            });
        }
        Ok((c, v))
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The mountpoint of the runtime's image filesystem (CRI `ImageFsInfo`), where image
    /// imports take their space from; `None` when the runtime reports none.
    pub async fn image_fs_mountpoint(&self) -> Result<Option<PathBuf>, CriError> {
        Ok(self
            .image_fs_info()
            .await?
            .into_iter()
            .filter_map(|f| f.fs_id.map(|i| i.mountpoint))
            .find(|m| !m.is_empty())
            .map(PathBuf::from))
    }

    /// The runtime's image filesystems and what images use on them (CRI `ImageFsInfo`).
    pub async fn image_fs_info(&self) -> Result<Vec<api::FilesystemUsage>, CriError> {
        let mut c = self.images.clone();
        let r = self
            .call("ImageFsInfo", CALL, || {
                c.image_fs_info(req(api::ImageFsInfoRequest {}, CALL))
            })
            .await?;
        Ok(r.image_filesystems)
    }

    /// The runtime's sandbox (pause) image, from its verbose `Status` (containerd's
    /// configuration); `None` when the runtime does not say.
    pub async fn sandbox_image(&self) -> Result<Option<String>, CriError> {
        let mut c = self.runtime.clone();
        let r = self
            .call("Status", CALL, || {
                c.status(req(api::StatusRequest { verbose: true }, CALL))
            })
            .await?;
        Ok(super::sandbox_image_from_info(&r.info))
    }

    /// The pid of a sandbox's process (the pause container, whose namespaces the pod's
    /// containers join), from the runtime's verbose `PodSandboxStatus` (containerd: `pid` in
    /// the `info` JSON); `None` when the runtime does not say.
    pub async fn sandbox_pid(&self, id: &str) -> Result<Option<u32>, CriError> {
        let mut c = self.runtime.clone();
        let msg = api::PodSandboxStatusRequest {
            pod_sandbox_id: id.to_string(),
            verbose: true,
        };
        let r = self
            .call("PodSandboxStatus", CALL, || {
                c.pod_sandbox_status(req(msg, CALL))
            })
            .await?;
        Ok(super::sandbox_info_pid(&r.info))
    }

    /// The runtime's statistics of the containers whose labels include `labels` (CRI
    /// `ListContainerStats`): CPU time, memory working set, writable layer.
    pub async fn list_container_stats(
        &self,
        labels: HashMap<String, String>,
    ) -> Result<Vec<api::ContainerStats>, CriError> {
        let mut c = self.runtime.clone();
        let msg = api::ListContainerStatsRequest {
            filter: Some(api::ContainerStatsFilter {
                label_selector: labels,
                ..Default::default()
            }),
        };
        Ok(self
            .call("ListContainerStats", CALL, || {
                c.list_container_stats(req(msg, CALL))
            })
            .await?
            .stats)
    }

    /// `containerd://1.6.20`, as a Node's nodeInfo carries it.
    pub fn runtime_version_string(v: &api::VersionResponse) -> String {
        format!("{}://{}", v.runtime_name, v.runtime_version)
    }

    /// Runs one call under a deadline, sent to the runtime as well (grpc-timeout).
    async fn call<T, F, Fut>(
        &self,
        method: &'static str,
        timeout: Duration,
        f: F,
    ) -> Result<T, CriError>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        // Each call's duration at trace level: what the start path waits on, with timestamps.
        let t = std::time::Instant::now();
        let out = match tokio::time::timeout(timeout, f()).await {
            Err(_) => Err(CriError::Timeout { method, timeout }),
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(s)) => Err(self.map_status(method, timeout, s)),
        };
        tracing::trace!(
            method,
            ms = t.elapsed().as_millis() as u64,
            ok = out.is_ok(),
            "CRI call"
        );
        out
    }

    fn map_status(&self, method: &'static str, timeout: Duration, s: tonic::Status) -> CriError {
        use tonic::Code;
        match s.code() {
            Code::Unavailable => {
                // Connection failures carry the io error as the source.
                let mut reason = s.message().to_string();
                let mut src: Option<&(dyn std::error::Error + 'static)> =
                    std::error::Error::source(&s);
                while let Some(e) = src {
                    reason = format!("{reason}: {e}");
                    src = e.source();
                }
                CriError::Unavailable {
                    socket: self.socket.clone(),
                    reason,
                }
            }
            Code::DeadlineExceeded => CriError::Timeout { method, timeout },
            code => CriError::Call {
                method,
                code: format!("{code:?}"),
                message: s.message().to_string(),
            },
        }
    }
}

fn req<T>(msg: T, timeout: Duration) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.set_timeout(timeout);
    r
}

impl CriRuntime for CriClient {
    async fn version(&self) -> Result<api::VersionResponse, CriError> {
        let mut c = self.runtime.clone();
        self.call("Version", CALL, || {
            c.version(req(
                api::VersionRequest {
                    version: "v1".into(),
                },
                CALL,
            ))
        })
        .await
    }

    async fn status(&self) -> Result<api::StatusResponse, CriError> {
        let mut c = self.runtime.clone();
        self.call("Status", CALL, || {
            c.status(req(api::StatusRequest { verbose: false }, CALL))
        })
        .await
    }

    async fn pull_image(
        &self,
        image: &str,
        auth: Option<api::AuthConfig>,
    ) -> Result<String, CriError> {
        let mut c = self.images.clone();
        let msg = api::PullImageRequest {
            image: Some(api::ImageSpec {
                image: image.to_string(),
                ..Default::default()
            }),
            auth,
            sandbox_config: None,
        };
        let r = self
            .call("PullImage", self.pull_deadline, || {
                c.pull_image(req(msg, self.pull_deadline))
            })
            .await?;
        Ok(r.image_ref)
    }

    async fn image_status(&self, image: &str) -> Result<Option<api::Image>, CriError> {
        let mut c = self.images.clone();
        let msg = api::ImageStatusRequest {
            image: Some(api::ImageSpec {
                image: image.to_string(),
                ..Default::default()
            }),
            verbose: false,
        };
        Ok(self
            .call("ImageStatus", CALL, || c.image_status(req(msg, CALL)))
            .await?
            .image)
    }

    async fn list_images(&self) -> Result<Vec<api::Image>, CriError> {
        let mut c = self.images.clone();
        let r = self
            .call("ListImages", CALL, || {
                c.list_images(req(api::ListImagesRequest { filter: None }, CALL))
            })
            .await?;
        Ok(r.images)
    }

    async fn remove_image(&self, image: &str) -> Result<(), CriError> {
        let mut c = self.images.clone();
        let msg = api::RemoveImageRequest {
            image: Some(api::ImageSpec {
                image: image.to_string(),
                ..Default::default()
            }),
        };
        self.call("RemoveImage", CALL, || c.remove_image(req(msg, CALL)))
            .await?;
        Ok(())
    }

    async fn run_pod_sandbox(&self, config: api::PodSandboxConfig) -> Result<String, CriError> {
        let mut c = self.runtime.clone();
        let msg = api::RunPodSandboxRequest {
            config: Some(config),
            runtime_handler: String::new(),
        };
        Ok(self
            .call("RunPodSandbox", SANDBOX, || {
                c.run_pod_sandbox(req(msg, SANDBOX))
            })
            .await?
            .pod_sandbox_id)
    }

    async fn pod_sandbox_status(
        &self,
        id: &str,
    ) -> Result<Option<api::PodSandboxStatus>, CriError> {
        let mut c = self.runtime.clone();
        let msg = api::PodSandboxStatusRequest {
            pod_sandbox_id: id.to_string(),
            verbose: false,
        };
        Ok(self
            .call("PodSandboxStatus", CALL, || {
                c.pod_sandbox_status(req(msg, CALL))
            })
            .await?
            .status)
    }

    async fn list_pod_sandbox(
        &self,
        labels: HashMap<String, String>,
    ) -> Result<Vec<api::PodSandbox>, CriError> {
        let mut c = self.runtime.clone();
        let msg = api::ListPodSandboxRequest {
            filter: Some(api::PodSandboxFilter {
                label_selector: labels,
                ..Default::default()
            }),
        };
        Ok(self
            .call("ListPodSandbox", CALL, || {
                c.list_pod_sandbox(req(msg, CALL))
            })
            .await?
            .items)
    }

    async fn stop_pod_sandbox(&self, id: &str) -> Result<(), CriError> {
        let mut c = self.runtime.clone();
        let msg = api::StopPodSandboxRequest {
            pod_sandbox_id: id.to_string(),
        };
        self.call("StopPodSandbox", SANDBOX, || {
            c.stop_pod_sandbox(req(msg, SANDBOX))
        })
        .await?;
        Ok(())
    }

    async fn remove_pod_sandbox(&self, id: &str) -> Result<(), CriError> {
        let mut c = self.runtime.clone();
        let msg = api::RemovePodSandboxRequest {
            pod_sandbox_id: id.to_string(),
        };
        self.call("RemovePodSandbox", SANDBOX, || {
            c.remove_pod_sandbox(req(msg, SANDBOX))
        })
        .await?;
        Ok(())
    }

    async fn create_container(
        &self,
        sandbox_id: &str,
        config: api::ContainerConfig,
        sandbox_config: api::PodSandboxConfig,
    ) -> Result<String, CriError> {
        let mut c = self.runtime.clone();
        let msg = api::CreateContainerRequest {
            pod_sandbox_id: sandbox_id.to_string(),
            config: Some(config),
            sandbox_config: Some(sandbox_config),
        };
        Ok(self
            .call("CreateContainer", SANDBOX, || {
                c.create_container(req(msg, SANDBOX))
            })
            .await?
            .container_id)
    }

    async fn start_container(&self, id: &str) -> Result<(), CriError> {
        let mut c = self.runtime.clone();
        let msg = api::StartContainerRequest {
            container_id: id.to_string(),
        };
        self.call("StartContainer", SANDBOX, || {
            c.start_container(req(msg, SANDBOX))
        })
        .await?;
        Ok(())
    }

    async fn stop_container(&self, id: &str, timeout_secs: i64) -> Result<(), CriError> {
        let mut c = self.runtime.clone();
        let deadline = CALL + Duration::from_secs(timeout_secs.max(0) as u64);
        let msg = api::StopContainerRequest {
            container_id: id.to_string(),
            timeout: timeout_secs,
        };
        self.call("StopContainer", deadline, || {
            c.stop_container(req(msg, deadline))
        })
        .await?;
        Ok(())
    }

    async fn remove_container(&self, id: &str) -> Result<(), CriError> {
        let mut c = self.runtime.clone();
        let msg = api::RemoveContainerRequest {
            container_id: id.to_string(),
        };
        self.call("RemoveContainer", CALL, || {
            c.remove_container(req(msg, CALL))
        })
        .await?;
        Ok(())
    }

    async fn container_status(&self, id: &str) -> Result<Option<api::ContainerStatus>, CriError> {
        let mut c = self.runtime.clone();
        let msg = api::ContainerStatusRequest {
            container_id: id.to_string(),
            verbose: false,
        };
        Ok(self
            .call("ContainerStatus", CALL, || {
                c.container_status(req(msg, CALL))
            })
            .await?
            .status)
    }

    async fn list_containers(
        &self,
        labels: HashMap<String, String>,
    ) -> Result<Vec<api::Container>, CriError> {
        let mut c = self.runtime.clone();
        let msg = api::ListContainersRequest {
            filter: Some(api::ContainerFilter {
                label_selector: labels,
                ..Default::default()
            }),
        };
        Ok(self
            .call("ListContainers", CALL, || c.list_containers(req(msg, CALL)))
            .await?
            .containers)
    }

    async fn reopen_container_log(&self, id: &str) -> Result<(), CriError> {
        let mut c = self.runtime.clone();
        let msg = api::ReopenContainerLogRequest {
            container_id: id.to_string(),
        };
        self.call("ReopenContainerLog", CALL, || {
            c.reopen_container_log(req(msg, CALL))
        })
        .await?;
        Ok(())
    }

    async fn exec_sync(
        &self,
        id: &str,
        cmd: Vec<String>,
        timeout: Duration,
    ) -> Result<api::ExecSyncResponse, CriError> {
        let mut c = self.runtime.clone();
        let deadline = timeout + Duration::from_secs(5);
        let msg = api::ExecSyncRequest {
            container_id: id.to_string(),
            cmd,
            timeout: timeout.as_secs() as i64,
        };
        self.call("ExecSync", deadline, || c.exec_sync(req(msg, deadline)))
            .await
    }
}

impl CriStreaming for CriClient {
    async fn exec(&self, msg: api::ExecRequest) -> Result<String, CriError> {
        let mut c = self.runtime.clone();
        Ok(self
            .call("Exec", STREAM_CALL, || c.exec(req(msg, STREAM_CALL)))
            .await?
            .url)
    }

    async fn attach(&self, msg: api::AttachRequest) -> Result<String, CriError> {
        let mut c = self.runtime.clone();
        Ok(self
            .call("Attach", STREAM_CALL, || c.attach(req(msg, STREAM_CALL)))
            .await?
            .url)
    }

    async fn port_forward(&self, msg: api::PortForwardRequest) -> Result<String, CriError> {
        let mut c = self.runtime.clone();
        Ok(self
            .call("PortForward", STREAM_CALL, || {
                c.port_forward(req(msg, STREAM_CALL))
            })
            .await?
            .url)
    }
}
