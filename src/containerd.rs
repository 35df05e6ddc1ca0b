//! containerd's own content, images and leases services, on the socket the CRI is served on.
//!
//! The CRI has no import call, so an image archive goes in here: blobs into the content store
//! (each checked by digest by containerd as well as by edgehub), a name into the images
//! service, all in the namespace the CRI uses (`k8s.io`), so the CRI's `ImageStatus` sees the
//! image at once and containerd's configuration is unchanged. What an import writes is held
//! by a lease until the image names it; a failed import deletes the lease and containerd's
//! garbage collector removes what it held.

use edgehub_containerd_api::content;
use edgehub_containerd_api::content::content_client::ContentClient;
use edgehub_containerd_api::images::images_client::ImagesClient;
use edgehub_containerd_api::images::{self, Image};
use edgehub_containerd_api::leases;
use edgehub_containerd_api::leases::leases_client::LeasesClient;
use edgehub_containerd_api::types::Descriptor;
use edgehub_containerd_api::{LEASE_HEADER, NAMESPACE_HEADER};
use hyper_util::rt::TokioIo;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::sync::mpsc;
use tonic::metadata::MetadataValue;
use tonic::transport::{Channel, Endpoint, Uri};

mod write;
pub use write::{rfc3339, BlobWriter};
use write::{ChanStream, WRITE_QUEUE};

/// The namespace the CRI plugin keeps its images in.
pub const CRI_NAMESPACE: &str = "k8s.io";
/// Deadline of a call that is not a blob's stream.
const CALL: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, thiserror::Error)]
pub enum ContainerdError {
    #[error("containerd {method}: {code}: {message}")]
    Call {
        method: &'static str,
        code: tonic::Code,
        message: String,
    },
    #[error("containerd {method} took longer than {timeout:?}")]
    Timeout {
        method: &'static str,
        timeout: Duration,
    },
    #[error("containerd {method}: a header value is not valid: {value}")]
    Header { method: &'static str, value: String },
    #[error("containerd Write of {reference}: {message}")]
    Write { reference: String, message: String },
}

impl ContainerdError {
    /// Whether the call may succeed if made again: containerd away or restarting, out of
    /// room or time, or a race with its garbage collector; not an argument or a state it
    /// refuses.
    pub fn is_transient(&self) -> bool {
        use tonic::Code;
        match self {
            ContainerdError::Call { code, .. } => matches!(
                code,
                Code::Unavailable
                    | Code::DeadlineExceeded
                    | Code::ResourceExhausted
                    | Code::Aborted
                    | Code::Unknown
                    | Code::Cancelled
                    | Code::Internal
                    | Code::NotFound
            ),
            ContainerdError::Timeout { .. } | ContainerdError::Write { .. } => true,
            ContainerdError::Header { .. } => false,
        }
    }

    pub fn is_not_found(&self) -> bool {
        matches!(
            self,
            ContainerdError::Call {
                code: tonic::Code::NotFound,
                ..
            }
        )
    }

    pub fn is_already_exists(&self) -> bool {
        matches!(
            self,
            ContainerdError::Call {
                code: tonic::Code::AlreadyExists,
                ..
            }
        )
    }
}

fn status(method: &'static str, s: tonic::Status) -> ContainerdError {
    let mut message = s.message().to_string();
    let mut src: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(&s);
    while let Some(e) = src {
        message = format!("{message}: {e}");
        src = e.source();
    }
    ContainerdError::Call {
        method,
        code: s.code(),
        message,
    }
}

/// A blob in the content store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlobInfo {
    pub digest: String,
    pub size: i64,
    pub labels: HashMap<String, String>,
}

/// A client of containerd's content, images and leases services. Cheap to clone; connects on
/// first use.
#[derive(Clone)]
pub struct Containerd {
    socket: PathBuf,
    namespace: String,
    content: ContentClient<Channel>,
    images: ImagesClient<Channel>,
    leases: LeasesClient<Channel>,
}

impl std::fmt::Debug for Containerd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Containerd")
            .field("socket", &self.socket)
            .field("namespace", &self.namespace)
            .finish()
    }
}

impl Containerd {
    /// A client for containerd's socket (the CRI socket), in the CRI's namespace.
    pub fn new(socket: &Path) -> Containerd {
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
        Containerd {
            socket: socket.to_path_buf(),
            namespace: CRI_NAMESPACE.to_string(),
            content: ContentClient::new(channel.clone()),
            images: ImagesClient::new(channel.clone()),
            leases: LeasesClient::new(channel),
        }
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// A request in this client's namespace, under `lease` when given.
    fn req<T>(
        &self,
        method: &'static str,
        msg: T,
        lease: Option<&str>,
    ) -> Result<tonic::Request<T>, ContainerdError> {
        let mut r = tonic::Request::new(msg);
        let value = |v: &str| {
            MetadataValue::try_from(v).map_err(|_| ContainerdError::Header {
                method,
                value: v.to_string(),
            })
        };
        r.metadata_mut()
            .insert(NAMESPACE_HEADER, value(&self.namespace)?);
        if let Some(l) = lease {
            r.metadata_mut().insert(LEASE_HEADER, value(l)?);
        }
        Ok(r)
    }

    async fn call<T, Fut>(method: &'static str, fut: Fut) -> Result<T, ContainerdError>
    where
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let t = std::time::Instant::now();
        let out = match tokio::time::timeout(CALL, fut).await {
            Err(_) => Err(ContainerdError::Timeout {
                method,
                timeout: CALL,
            }),
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(s)) => Err(status(method, s)),
        };
        tracing::trace!(
            method,
            ms = t.elapsed().as_millis() as u64,
            ok = out.is_ok(),
            "containerd call"
        );
        out
    }

    /// Creates a lease that expires by itself after `expire` (containerd's `gc.expire`), so
    /// an import whose edgehub died still leaves nothing behind for long.
    pub async fn create_lease(
        &self,
        id: &str,
        expire: Duration,
        mut labels: HashMap<String, String>,
    ) -> Result<(), ContainerdError> {
        let until = std::time::SystemTime::now() + expire;
        labels.insert("containerd.io/gc.expire".into(), rfc3339(until));
        let msg = leases::CreateRequest {
            id: id.to_string(),
            labels,
        };
        let r = self.req("Leases.Create", msg, None)?;
        let mut c = self.leases.clone();
        Self::call("Leases.Create", c.create(r)).await.map(|_| ())
    }

    /// Deletes a lease; with `sync`, containerd collects what only it held before answering.
    pub async fn delete_lease(&self, id: &str, sync: bool) -> Result<(), ContainerdError> {
        let msg = leases::DeleteRequest {
            id: id.to_string(),
            sync,
        };
        let r = self.req("Leases.Delete", msg, None)?;
        let mut c = self.leases.clone();
        match Self::call("Leases.Delete", c.delete(r)).await {
            Err(e) if e.is_not_found() => Ok(()),
            other => other.map(|_| ()),
        }
    }

    /// The ids of the leases matching a containerd filter (`labels."k"==v`).
    pub async fn leases(&self, filter: &str) -> Result<Vec<String>, ContainerdError> {
        let msg = leases::ListRequest {
            filters: vec![filter.to_string()],
        };
        let r = self.req("Leases.List", msg, None)?;
        let mut c = self.leases.clone();
        let out = Self::call("Leases.List", c.list(r)).await?;
        Ok(out.leases.into_iter().map(|l| l.id).collect())
    }

    /// Holds a blob that is already in the store under `lease` too, so the garbage collector
    /// cannot take it between now and the moment the image names it.
    pub async fn lease_blob(&self, lease: &str, digest: &str) -> Result<(), ContainerdError> {
        let msg = leases::AddResourceRequest {
            id: lease.to_string(),
            resource: Some(leases::Resource {
                id: digest.to_string(),
                r#type: "content".into(),
            }),
        };
        let r = self.req("Leases.AddResource", msg, None)?;
        let mut c = self.leases.clone();
        Self::call("Leases.AddResource", c.add_resource(r))
            .await
            .map(|_| ())
    }

    /// A blob's info, or `None` when the store does not have it.
    pub async fn info(&self, digest: &str) -> Result<Option<BlobInfo>, ContainerdError> {
        let msg = content::InfoRequest {
            digest: digest.to_string(),
        };
        let r = self.req("Content.Info", msg, None)?;
        let mut c = self.content.clone();
        match Self::call("Content.Info", c.info(r)).await {
            Ok(resp) => Ok(resp.info.map(|i| BlobInfo {
                digest: i.digest,
                size: i.size,
                labels: i.labels,
            })),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Every blob in the store (for tests and listings).
    pub async fn blobs(&self) -> Result<Vec<BlobInfo>, ContainerdError> {
        let r = self.req("Content.List", content::ListContentRequest::default(), None)?;
        let mut c = self.content.clone();
        let mut stream = Self::call("Content.List", c.list(r)).await?;
        let mut out = Vec::new();
        while let Some(m) = stream
            .message()
            .await
            .map_err(|s| status("Content.List", s))?
        {
            out.extend(m.info.into_iter().map(|i| BlobInfo {
                digest: i.digest,
                size: i.size,
                labels: i.labels,
            }));
        }
        Ok(out)
    }

    /// The refs of the writes in progress (ingests).
    pub async fn ingests(&self) -> Result<Vec<String>, ContainerdError> {
        let r = self.req(
            "Content.ListStatuses",
            content::ListStatusesRequest::default(),
            None,
        )?;
        let mut c = self.content.clone();
        let out = Self::call("Content.ListStatuses", c.list_statuses(r)).await?;
        Ok(out.statuses.into_iter().map(|s| s.r#ref).collect())
    }

    /// Abandons a write in progress; one that is not there is fine.
    pub async fn abort(&self, reference: &str) -> Result<(), ContainerdError> {
        let msg = content::AbortRequest {
            r#ref: reference.to_string(),
        };
        let r = self.req("Content.Abort", msg, None)?;
        let mut c = self.content.clone();
        match Self::call("Content.Abort", c.abort(r)).await {
            Err(e) if e.is_not_found() => Ok(()),
            other => other.map(|_| ()),
        }
    }

    /// Reads a whole blob of at most `max` bytes (manifests, indexes, configs).
    pub async fn read(&self, digest: &str, max: usize) -> Result<Vec<u8>, ContainerdError> {
        let msg = content::ReadContentRequest {
            digest: digest.to_string(),
            offset: 0,
            size: 0,
        };
        let r = self.req("Content.Read", msg, None)?;
        let mut c = self.content.clone();
        let mut stream = Self::call("Content.Read", c.read(r)).await?;
        let mut out = Vec::new();
        while let Some(m) = stream
            .message()
            .await
            .map_err(|s| status("Content.Read", s))?
        {
            if out.len() + m.data.len() > max {
                return Err(ContainerdError::Call {
                    method: "Content.Read",
                    code: tonic::Code::OutOfRange,
                    message: format!("{digest} is larger than {max} bytes"),
                });
            }
            out.extend_from_slice(&m.data);
        }
        Ok(out)
    }

    /// Sets labels on a blob (the `containerd.io/gc.ref.*` labels that keep a manifest's
    /// config and layers alive for as long as the manifest is).
    pub async fn set_labels(
        &self,
        digest: &str,
        labels: HashMap<String, String>,
    ) -> Result<(), ContainerdError> {
        let paths = labels.keys().map(|k| format!("labels.{k}")).collect();
        let msg = content::UpdateRequest {
            info: Some(content::Info {
                digest: digest.to_string(),
                labels,
                ..Default::default()
            }),
            update_mask: Some(edgehub_containerd_api::prost_types::FieldMask { paths }),
        };
        let r = self.req("Content.Update", msg, None)?;
        let mut c = self.content.clone();
        Self::call("Content.Update", c.update(r)).await.map(|_| ())
    }

    /// Starts writing a blob of `total` bytes under `lease`. With `expected`, containerd
    /// refuses a commit whose bytes do not hash to it.
    pub fn writer(
        &self,
        lease: &str,
        reference: &str,
        total: i64,
        expected: Option<&str>,
    ) -> Result<BlobWriter, ContainerdError> {
        let (tx, rx) = mpsc::channel(WRITE_QUEUE);
        let r = self.req("Content.Write", ChanStream(rx), Some(lease))?;
        let mut c = self.content.clone();
        let task = tokio::spawn(async move {
            let mut stream = c
                .write(r)
                .await
                .map_err(|s| status("Content.Write", s))?
                .into_inner();
            let mut last = None;
            while let Some(m) = stream
                .message()
                .await
                .map_err(|s| status("Content.Write", s))?
            {
                last = Some(m);
            }
            Ok(last)
        });
        Ok(BlobWriter {
            tx,
            task: Some(task),
            reference: reference.to_string(),
            total,
            expected: expected.unwrap_or_default().to_string(),
            offset: 0,
        })
    }

    /// Names `target` as image `name` (created, or moved when the name exists, keeping the
    /// labels it had that `labels` does not set).
    pub async fn put_image(
        &self,
        name: &str,
        target: Descriptor,
        labels: HashMap<String, String>,
        lease: Option<&str>,
    ) -> Result<(), ContainerdError> {
        let image = Image {
            name: name.to_string(),
            labels,
            target: Some(target),
            ..Default::default()
        };
        let msg = images::CreateImageRequest {
            image: Some(image.clone()),
            source_date_epoch: None,
        };
        let r = self.req("Images.Create", msg, lease)?;
        let mut c = self.images.clone();
        match Self::call("Images.Create", c.create(r)).await {
            Ok(_) => Ok(()),
            Err(e) if e.is_already_exists() => {
                // The target and the labels set here, and nothing else: without a mask,
                // Update replaces every label, and drops the CRI's pin on the sandbox image.
                let mut paths = vec!["target".to_string()];
                paths.extend(image.labels.keys().map(|k| format!("labels.{k}")));
                let msg = images::UpdateImageRequest {
                    image: Some(image),
                    update_mask: Some(edgehub_containerd_api::prost_types::FieldMask { paths }),
                    source_date_epoch: None,
                };
                let r = self.req("Images.Update", msg, lease)?;
                Self::call("Images.Update", c.update(r)).await.map(|_| ())
            }
            Err(e) => Err(e),
        }
    }

    /// The image named `name`, or `None`.
    pub async fn image(&self, name: &str) -> Result<Option<Image>, ContainerdError> {
        let msg = images::GetImageRequest {
            name: name.to_string(),
        };
        let r = self.req("Images.Get", msg, None)?;
        let mut c = self.images.clone();
        match Self::call("Images.Get", c.get(r)).await {
            Ok(resp) => Ok(resp.image),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The names of every image in the namespace.
    pub async fn image_names(&self) -> Result<Vec<String>, ContainerdError> {
        let r = self.req("Images.List", images::ListImagesRequest::default(), None)?;
        let mut c = self.images.clone();
        let out = Self::call("Images.List", c.list(r)).await?;
        Ok(out.images.into_iter().map(|i| i.name).collect())
    }

    /// Removes an image name (its content goes with the garbage collector).
    pub async fn delete_image(&self, name: &str) -> Result<(), ContainerdError> {
        let msg = images::DeleteImageRequest {
            name: name.to_string(),
            sync: true,
            target: None,
        };
        let r = self.req("Images.Delete", msg, None)?;
        let mut c = self.images.clone();
        match Self::call("Images.Delete", c.delete(r)).await {
            Err(e) if e.is_not_found() => Ok(()),
            other => other.map(|_| ()),
        }
    }
}
