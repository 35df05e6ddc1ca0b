//! Side-loaded images, for devices that never see a registry: an OCI image layout archive
//! (`skopeo copy ... oci-archive:FILE:NAME`) or a docker-archive (`docker save`), gzip or not,
//! streamed into containerd's own content and images services in the CRI's namespace, so the
//! CRI's `ImageStatus`, the pre-pull and the upgrade see the image at once.
//!
//! Only what the cluster asked for goes in: every blob's digest is checked while it streams;
//! an image must be named by a cached DaemonSet revision (by digest where its template pins
//! one, by name and tag otherwise) unless the operator forces it. Everything an import writes
//! is held by a containerd lease until the image is named; a corrupt, truncated, refused or
//! interrupted import deletes the lease, and containerd collects what it held. Free space on
//! the image filesystem is checked first, before the lease, against the bytes the archive
//! will add (the blobs a scan of the file or the client's declaration lists that containerd
//! lacks, [`scan`], [`declare`]); and again before each blob the archive adds (the only
//! check for a stream that came with neither).
//!
//! The surfaces: `POST /v1/images/load` of the local API (`edgehub images load FILE|-`), and a
//! drop directory for OTA managers that only write files ([`drop`]).

mod collect;
pub mod declare;
pub mod drop;
mod entry;
pub mod gc;
pub use collect::{fs_use, list, named_images, GcError, GcStats, ImageGc, Listed, PassReport};
mod import;
pub mod inspect;
pub mod oci;
pub mod policy;
pub mod reference;
pub mod scan;
pub mod tarstream;

pub use import::{Loaded, CHUNK};

use crate::containerd::{Containerd, ContainerdError};
use crate::cri::{CriClient, CriRuntime};
use crate::object::Kind;
use crate::revision::Revision;
use crate::store::{Store, StoreError};
use policy::Wanted;
use reference::Reference;
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// The `[images]` section of the configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct ImagesConfig {
    /// Largest archive accepted through the local API, in bytes.
    pub max_archive_bytes: u64,
    /// Free space an import leaves on the image filesystem at the least, in bytes.
    pub reserve_bytes: u64,
    /// The drop directory; `None` turns it off.
    pub drop_dir: Option<PathBuf>,
    /// How often the drop directory is looked at.
    pub drop_interval: Duration,
    /// Image garbage collection's thresholds and what it keeps ([`gc`]).
    pub gc: gc::GcPolicy,
    /// How often image garbage collection looks at the image filesystem, besides after each
    /// commit.
    pub gc_interval: Duration,
    /// An upload through the local API must send at least `upload_min_bytes` (and at least
    /// one byte) in every `upload_window` of time spent waiting on it; one that does not is
    /// cut (408). Time the import spends on its own is not counted.
    pub upload_window: Duration,
    pub upload_min_bytes: u64,
    /// How long an import waits for the one running before it to end, before it gives up
    /// (503; the drop directory tries again later).
    pub import_wait: Duration,
}

impl ImagesConfig {
    /// The defaults, with the drop directory under `data_dir`.
    pub fn defaults(data_dir: &std::path::Path) -> ImagesConfig {
        ImagesConfig {
            max_archive_bytes: 8 << 30,
            reserve_bytes: 64 << 20,
            drop_dir: Some(data_dir.join("images")),
            drop_interval: Duration::from_secs(2),
            gc: gc::GcPolicy::default(),
            // The kubelet's image manager looks every 5 minutes; a small flash fills faster.
            gc_interval: Duration::from_secs(60),
            // 1 MiB a minute (17 KiB/s): a cellular link does better, a trickle does not.
            upload_window: Duration::from_secs(60),
            upload_min_bytes: 1 << 20,
            import_wait: Duration::from_secs(600),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("not a usable image archive: {0}")]
    Archive(String),
    #[error("the archive is truncated: {path} has {got} of its {want} bytes")]
    Truncated { path: String, got: u64, want: u64 },
    #[error("digest mismatch: {path} is {actual}, the archive says {expected}")]
    Digest {
        path: String,
        expected: String,
        actual: String,
    },
    #[error("the archive lacks the {what} {digest}, and containerd does not have it either")]
    Missing { what: String, digest: String },
    #[error("wrong platform: {0}")]
    Platform(String),
    #[error("refused: {0}")]
    Refused(String),
    #[error("not enough space on the image filesystem {path}: {need} more bytes would leave less than the {reserve} bytes kept free ({free} free)")]
    Space {
        path: String,
        need: u64,
        free: u64,
        reserve: u64,
        /// The filesystem's size: an archive that needs more could never fit.
        capacity: u64,
    },
    #[error("the archive does not match its declaration: {0}")]
    Undeclared(String),
    #[error("the archive is larger than the {limit} bytes accepted (images.max_archive_bytes)")]
    TooLarge { limit: u64 },
    #[error("over a limit: {0}")]
    Limit(String),
    #[error("another image import has run for {held_secs} s; waited {waited_secs} s for it to end (try again later)")]
    Busy { held_secs: u64, waited_secs: u64 },
    #[error("reading the archive: {0}")]
    Input(#[source] std::io::Error),
    #[error(transparent)]
    Containerd(#[from] ContainerdError),
    #[error("container runtime: {0}")]
    Cri(#[from] crate::cri::CriError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Json(#[from] oci::JsonError),
}

impl From<tarstream::TarError> for ImageError {
    fn from(e: tarstream::TarError) -> ImageError {
        match e {
            tarstream::TarError::Limit(m) => ImageError::Limit(m),
            tarstream::TarError::Io(e) => ImageError::from_io(e),
            other => ImageError::Archive(other.to_string()),
        }
    }
}

impl ImageError {
    /// An error reading the archive: a corrupt or cut-off stream (gzip's and the tar
    /// reader's errors) is the archive's fault; anything else is the input's (a client that
    /// stopped sending, a disk that failed).
    pub fn from_io(e: std::io::Error) -> ImageError {
        use std::io::ErrorKind::{InvalidData, InvalidInput, UnexpectedEof};
        match e.kind() {
            InvalidData | InvalidInput | UnexpectedEof => {
                ImageError::Archive(format!("reading the archive: {e}"))
            }
            _ => ImageError::Input(e),
        }
    }

    /// Whether the error may pass by itself (the runtime restarting, no room yet, an I/O
    /// error), so the same archive is worth trying again; the rest (a corrupt archive, one
    /// over a limit, refused by policy, for another platform) fail again every time.
    pub fn is_transient(&self) -> bool {
        match self {
            ImageError::Space {
                need,
                reserve,
                capacity,
                ..
            } => need.saturating_add(*reserve) <= *capacity,
            ImageError::Input(_)
            | ImageError::Cri(_)
            | ImageError::Store(_)
            | ImageError::Busy { .. } => true,
            ImageError::Containerd(e) => e.is_transient(),
            ImageError::Archive(_)
            | ImageError::Truncated { .. }
            | ImageError::Digest { .. }
            | ImageError::Missing { .. }
            | ImageError::Platform(_)
            | ImageError::Refused(_)
            | ImageError::Undeclared(_)
            | ImageError::TooLarge { .. }
            | ImageError::Limit(_)
            | ImageError::Json(_) => false,
        }
    }

    /// The local API's status for this error.
    pub fn http_status(&self) -> u16 {
        match self {
            ImageError::Refused(_) => 403,
            ImageError::TooLarge { .. } => 413,
            ImageError::Space { .. } => 507,
            ImageError::Containerd(_) | ImageError::Cri(_) | ImageError::Busy { .. } => 503,
            ImageError::Store(_) => 500,
            _ => 400,
        }
    }
}

/// What is known of an archive before it is read: what the space check that comes first
/// counts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Expected {
    /// Nothing: only the check before each blob guards the space.
    #[default]
    Unknown,
    /// The stream's length (a request's `Content-Length`): a bound on what a plain tar adds,
    /// none on a gzip one.
    Length(u64),
    /// The archive's blobs, from a scan of the file or the client's declaration; with
    /// `enforce`, a blob the list lacks, or holds with another size, fails the import.
    Blobs {
        blobs: Vec<declare::Declared>,
        enforce: bool,
    },
}

impl Expected {
    /// What a scan of an archive file of `len` bytes says: its blobs, or (a scan that failed)
    /// its length, which the import's own reading then judges.
    pub fn from_scan(scanned: Result<scan::Scanned, scan::ScanError>, len: u64) -> Expected {
        match scanned {
            Ok(s) => Expected::Blobs {
                blobs: declare::from_scan(&s),
                enforce: false,
            },
            Err(_) => Expected::Length(len),
        }
    }
}

/// Options of one load.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Import images no cached revision names (the operator's explicit override).
    pub force: bool,
}

/// The label on an import's lease: the node whose edgehub made it, so a restart removes its
/// own leftovers and never another node's (tests share one containerd).
const LEASE_LABEL: &str = "edgehub.io/import";
/// A lease outlives a dead edgehub by this much at most (containerd's `gc.expire`).
const LEASE_EXPIRY: Duration = Duration::from_secs(3600);

/// Imports archives into containerd. One import runs at a time; others wait for it, for
/// `import_wait` at most.
pub struct Importer {
    pub containerd: Containerd,
    pub cri: CriClient,
    pub store: Arc<Store>,
    pub config: ImagesConfig,
    pub node_name: String,
    /// The one import running holds it.
    one: tokio::sync::Mutex<()>,
    /// When the import holding `one` started, for a waiting one's message.
    since: std::sync::Mutex<Option<std::time::Instant>>,
}

impl Importer {
    pub fn new(
        cri: CriClient,
        store: Arc<Store>,
        config: ImagesConfig,
        node_name: &str,
    ) -> Importer {
        Importer {
            containerd: Containerd::new(cri.socket()),
            cri,
            store,
            config,
            node_name: node_name.to_string(),
            one: tokio::sync::Mutex::new(()),
            since: std::sync::Mutex::new(None),
        }
    }

    /// Imports one archive read from `reader`, of which `expected` is known ahead. Blocking:
    /// call it on a blocking thread of the runtime `rt`.
    pub fn load_blocking(
        &self,
        rt: &tokio::runtime::Handle,
        reader: impl Read,
        expected: Expected,
        opts: LoadOptions,
    ) -> Result<Loaded, ImageError> {
        let asked = std::time::Instant::now();
        let wait = self.config.import_wait;
        let Ok(_one) = rt.block_on(tokio::time::timeout(wait, self.one.lock())) else {
            // Poisoned only if an import panicked; it is only a timestamp.
            let since = *self.since.lock().unwrap_or_else(|p| p.into_inner());
            return Err(ImageError::Busy {
                held_secs: since.map_or(0, |s| s.elapsed().as_secs()),
                waited_secs: asked.elapsed().as_secs(),
            });
        };
        *self.since.lock().unwrap_or_else(|p| p.into_inner()) = Some(std::time::Instant::now());
        let wanted = wanted_images(&self.store)?;
        let mountpoint = rt.block_on(self.cri.image_fs_mountpoint())?;
        let reserve = self.config.reserve_bytes;
        let space = move |need: u64| -> Result<(), ImageError> {
            let Some(m) = &mountpoint else { return Ok(()) };
            match crate::mountns::fs_stats(m) {
                Some(fs) if fs.available_bytes < need.saturating_add(reserve) => {
                    Err(ImageError::Space {
                        path: m.display().to_string(),
                        need,
                        free: fs.available_bytes,
                        reserve,
                        capacity: fs.total_bytes,
                    })
                }
                _ => Ok(()),
            }
        };
        // Free space first, before the lease and the first blob.
        let mut reader = std::io::BufReader::with_capacity(64 << 10, reader);
        let ledger = self.check_first(rt, &mut reader, &expected, &space)?;
        let lease = format!(
            "edgehub-import-{}-{:08x}",
            crate::time::now_ms(),
            fastrand::u32(..)
        );
        let mut labels = HashMap::new();
        labels.insert(LEASE_LABEL.to_string(), self.node_name.clone());
        rt.block_on(self.containerd.create_lease(&lease, LEASE_EXPIRY, labels))?;
        let device = oci::device_platform();
        let mut run = import::Run::new(rt, &self.containerd, &lease, &space, ledger);
        let result = run
            .walk(reader)
            .and_then(|()| run.finish(&wanted, opts.force, &device));
        let current = run.current.take();
        match &result {
            Ok(_) => {
                // The images hold their content now.
                if let Err(e) = rt.block_on(self.containerd.delete_lease(&lease, false)) {
                    tracing::warn!(lease = %lease, error = %e, "cannot delete an import's lease; it expires by itself");
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "image import failed; removing what it wrote");
                self.discard(rt, &lease, current.as_deref());
            }
        }
        result
    }

    /// The check before anything is written: `space` for the bytes the archive will add, as
    /// far as `expected` tells them, and the ledger that holds the stream to a declaration.
    fn check_first<R: Read>(
        &self,
        rt: &tokio::runtime::Handle,
        reader: &mut std::io::BufReader<R>,
        expected: &Expected,
        space: &dyn Fn(u64) -> Result<(), ImageError>,
    ) -> Result<Option<declare::Ledger>, ImageError> {
        use std::io::BufRead;
        match expected {
            Expected::Unknown => Ok(None),
            Expected::Length(n) => {
                let head = reader.fill_buf().map_err(ImageError::Input)?;
                // A gzip archive unpacks to more than its length; its blobs are checked one by
                // one as they come.
                if !head.starts_with(&[0x1f, 0x8b]) {
                    space(*n)?;
                }
                Ok(None)
            }
            Expected::Blobs { blobs, enforce } => {
                let mut present = HashMap::new();
                for d in blobs.iter().filter_map(|b| b.digest.as_deref()) {
                    if present.contains_key(d) {
                        continue;
                    }
                    if let Some(info) = rt.block_on(self.containerd.info(d))? {
                        present.insert(d.to_string(), info.size as u64);
                    }
                }
                let need = declare::bytes_to_add(blobs, &present);
                tracing::debug!(
                    blobs = blobs.len(),
                    need,
                    "free space checked before the import"
                );
                space(need)?;
                Ok(enforce.then(|| declare::Ledger::new(blobs)))
            }
        }
    }

    /// Removes what a failed import wrote: its write in progress, then its lease, collected
    /// at once.
    fn discard(&self, rt: &tokio::runtime::Handle, lease: &str, current: Option<&str>) {
        if let Some(r) = current {
            if let Err(e) = rt.block_on(self.containerd.abort(r)) {
                tracing::warn!(reference = %r, error = %e, "cannot abort an import's write");
            }
        }
        if let Err(e) = rt.block_on(self.containerd.delete_lease(lease, true)) {
            tracing::warn!(lease = %lease, error = %e, "cannot delete an import's lease; it expires by itself");
        }
    }

    /// Removes the leftovers of imports a killed edgehub of this node left (at start).
    pub async fn clean_leftovers(&self) -> Result<usize, ImageError> {
        let filter = format!("labels.\"{LEASE_LABEL}\"=={}", self.node_name);
        let leases = self.containerd.leases(&filter).await?;
        let ingests = self.containerd.ingests().await?;
        for l in &leases {
            for r in ingests.iter().filter(|r| r.starts_with(&format!("{l}-"))) {
                self.containerd.abort(r).await?;
            }
            self.containerd.delete_lease(l, true).await?;
            tracing::info!(lease = %l, "removed what an interrupted image import left");
        }
        Ok(leases.len())
    }

    /// After a load: asks for a pre-pull of every pod whose needed revision's images are now
    /// all on the node, so `PodImageReady` turns True (the pre-pull finds them and pulls
    /// nothing).
    pub async fn images_arrived(&self) -> Result<usize, ImageError> {
        let mut asked = 0;
        let pods = self.store.list_index(Kind::Pod)?;
        for pod in pods {
            let need = crate::need_upgrade::Decider::new(&self.store).decide(&pod)?;
            let Some(target) = need.target().filter(|_| need.needed()) else {
                continue;
            };
            let Some(images) = crate::upgrade::target_images(&self.store, &pod.uid, target)? else {
                continue;
            };
            let mut all = true;
            for img in images.values() {
                if self.cri.image_status(img).await?.is_none() {
                    all = false;
                    break;
                }
            }
            if !all {
                continue;
            }
            let req = crate::store::NewRequest {
                kind: crate::store::RequestKind::ImagePull,
                pod_uid: &pod.uid,
                namespace: &pod.namespace,
                name: &pod.name,
                from_hash: pod.revision_hash.as_deref(),
                to_hash: target,
            };
            if let crate::store::Recorded::New(r) = self.store.record_request(&req)? {
                tracing::info!(pod = %r.name, namespace = %r.namespace, revision = %r.to_hash,
                    "the revision's images are all on the node after a side-load");
                asked += 1;
            }
        }
        Ok(asked)
    }
}

/// Every image the cached DaemonSet revisions name, with the revision naming it.
pub fn wanted_images(store: &Store) -> Result<Vec<Wanted>, StoreError> {
    let mut out: BTreeMap<Reference, String> = BTreeMap::new();
    for cr in store.list(Kind::ControllerRevision)? {
        let Ok(rev) = Revision::from_raw(&cr.raw) else {
            continue;
        };
        for list in ["containers", "initContainers"] {
            for c in rev
                .template
                .pointer(&format!("/spec/{list}"))
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                if let Some(Ok(r)) = c.get("image").and_then(Value::as_str).map(Reference::parse) {
                    out.entry(r)
                        .or_insert_with(|| format!("{}/{}", cr.index.namespace, rev.name));
                }
            }
        }
    }
    Ok(out
        .into_iter()
        .map(|(reference, revision)| Wanted {
            reference,
            revision,
        })
        .collect())
}

/// Bytes an unprivileged writer may still use on the filesystem holding `path`.
pub fn free_bytes(path: &std::path::Path) -> Option<u64> {
    crate::mountns::fs_stats(path).map(|s| s.available_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 31: the drop directory parks only what fails every time.
    #[test]
    fn only_a_fault_that_may_pass_is_transient() {
        let call = |code| {
            ImageError::Containerd(ContainerdError::Call {
                method: "Content.Write",
                code,
                message: String::new(),
            })
        };
        let io = |kind| std::io::Error::new(kind, "x");
        for e in [
            call(tonic::Code::Unavailable),
            call(tonic::Code::ResourceExhausted),
            call(tonic::Code::Unknown),
            ImageError::Containerd(ContainerdError::Timeout {
                method: "Content.Info",
                timeout: Duration::from_secs(30),
            }),
            ImageError::Space {
                path: "/".into(),
                need: 1,
                free: 0,
                reserve: 0,
                capacity: 100,
            },
            ImageError::from_io(io(std::io::ErrorKind::Other)),
            ImageError::Busy {
                held_secs: 1,
                waited_secs: 1,
            },
        ] {
            assert!(e.is_transient(), "{e}");
        }
        for e in [
            // More than the whole filesystem: it will never fit.
            ImageError::Space {
                path: "/".into(),
                need: 90,
                free: 0,
                reserve: 20,
                capacity: 100,
            },
            call(tonic::Code::InvalidArgument),
            call(tonic::Code::FailedPrecondition),
            ImageError::from_io(io(std::io::ErrorKind::InvalidData)),
            ImageError::from_io(io(std::io::ErrorKind::UnexpectedEof)),
            ImageError::Archive("x".into()),
            ImageError::Limit("x".into()),
            ImageError::Refused("x".into()),
            ImageError::Platform("x".into()),
            ImageError::Missing {
                what: "layer".into(),
                digest: "sha256:x".into(),
            },
        ] {
            assert!(!e.is_transient(), "{e}");
        }
    }
}
