//! One import: an archive's tar stream, entry by entry, into containerd's content store under
//! a lease; then the archive's images checked (every blob they need present, sized and
//! hashed; the device's platform) and named in the images service. Runs on a blocking
//! thread, reading the archive as a stream and never holding more than a chunk of a blob.

pub use super::entry::MAX_JSON;
use super::entry::{resolve, sha256_hex, Judge, Step};
use super::oci::{self, Descriptor};
use super::policy::{self, Offer, Verdict, Wanted};
use super::reference::Reference;
use super::tarstream::read_full;
use super::tarstream::{Streamed, TarReader};
use super::ImageError;
use crate::containerd::Containerd;
use edgehub_containerd_api::types::Descriptor as CdDescriptor;
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read};
use tokio::runtime::Handle;

/// The bytes of a blob sent to containerd in one message.
pub const CHUNK: usize = 256 << 10;
/// containerd's garbage-collection references from a blob to the blobs it needs.
const GC_REF: &str = "containerd.io/gc.ref.content";

/// The tar stream of an archive, gzip-compressed or not.
pub(super) fn tar_stream<'a>(reader: impl Read + 'a) -> Result<Box<dyn Read + 'a>, ImageError> {
    let mut br = BufReader::with_capacity(64 << 10, reader);
    let head = br.fill_buf().map_err(ImageError::from_io)?;
    if head.is_empty() {
        return Err(ImageError::Archive("the archive is empty".into()));
    }
    Ok(if head.starts_with(&[0x1f, 0x8b]) {
        Box::new(flate2::read::GzDecoder::new(br))
    } else {
        Box::new(br)
    })
}

/// What an import did.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Loaded {
    /// The names the images got.
    pub images: Vec<String>,
    /// The digest of each image's top-level entry (index or manifest), as named.
    pub digests: Vec<String>,
    #[serde(rename = "blobsWritten")]
    pub blobs_written: usize,
    #[serde(rename = "blobsPresent")]
    pub blobs_present: usize,
    #[serde(rename = "bytesWritten")]
    pub bytes_written: u64,
}

/// A blob of the archive, by its path in the archive.
#[derive(Debug, Clone)]
struct Blob {
    digest: String,
    size: i64,
    gzip: bool,
}

/// An image of the archive, checked, waiting for the verdict.
struct Prepared {
    offer: Offer,
    target: Descriptor,
    /// Labels to set on blobs once accepted (gc references).
    labels: Vec<(String, HashMap<String, String>)>,
}

/// One import's state. `space` checks that a blob of that many bytes fits.
pub(super) struct Run<'a> {
    pub rt: &'a Handle,
    pub cd: &'a Containerd,
    pub lease: &'a str,
    pub space: &'a (dyn Fn(u64) -> Result<(), ImageError> + Sync),
    blobs: HashMap<String, Blob>,
    links: HashMap<String, String>,
    /// Decides each entry (and holds the stream to a declaration, if any).
    judge: Judge,
    meta: HashMap<String, Vec<u8>>,
    /// The ingest being written, to abort when the import fails.
    pub current: Option<String>,
    n: usize,
    written: usize,
    present: usize,
    bytes: u64,
}

impl<'a> Run<'a> {
    pub fn new(
        rt: &'a Handle,
        cd: &'a Containerd,
        lease: &'a str,
        space: &'a (dyn Fn(u64) -> Result<(), ImageError> + Sync),
        ledger: Option<super::declare::Ledger>,
    ) -> Run<'a> {
        Run {
            rt,
            cd,
            lease,
            space,
            judge: Judge::new(ledger),
            blobs: HashMap::new(),
            links: HashMap::new(),
            meta: HashMap::new(),
            current: None,
            n: 0,
            written: 0,
            present: 0,
            bytes: 0,
        }
    }

    /// Reads the whole archive (gzip or not) and writes its blobs.
    pub fn walk(&mut self, reader: impl Read) -> Result<(), ImageError> {
        let mut tr = TarReader::new(Streamed(tar_stream(reader)?));
        let mut any = false;
        while let Some(h) = tr.next_entry()? {
            any = true;
            let size = h.size;
            match self.judge.judge(&h)? {
                Step::Skip => {}
                Step::Link { path, target } => {
                    self.links.insert(path, target);
                }
                Step::Meta { path } => {
                    // Bounded above by the judge: at most MAX_JSON.
                    let mut buf = vec![0u8; size as usize];
                    let n = read_full(&mut tr.data(), &mut buf).map_err(ImageError::from_io)?;
                    if n as u64 != size {
                        return Err(ImageError::Truncated {
                            path,
                            got: n as u64,
                            want: size,
                        });
                    }
                    self.meta.insert(path, buf);
                }
                Step::Blob { path, digest } => {
                    let blob = self.put(&mut tr.data(), size, digest.as_deref(), &path)?;
                    self.blobs.insert(path, blob);
                }
            }
        }
        if !any {
            return Err(ImageError::Archive("the archive has no entries".into()));
        }
        Ok(())
    }

    /// Streams one blob into the content store (or leases the one already there).
    fn put(
        &mut self,
        r: &mut impl Read,
        size: u64,
        expected: Option<&str>,
        path: &str,
    ) -> Result<Blob, ImageError> {
        let (rt, cd) = (self.rt, self.cd);
        if let Some(d) = expected {
            if let Some(info) = rt.block_on(cd.info(d))? {
                if info.size as u64 == size {
                    rt.block_on(cd.lease_blob(self.lease, d))?;
                    self.present += 1;
                    return Ok(Blob {
                        digest: d.to_string(),
                        size: size as i64,
                        gzip: false,
                    });
                }
            }
        }
        (self.space)(size)?;
        self.n += 1;
        let reference = format!("{}-{}", self.lease, self.n);
        self.current = Some(reference.clone());
        let mut w = cd.writer(self.lease, &reference, size as i64, expected)?;
        let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
        let (mut total, mut gzip) = (0u64, false);
        loop {
            let mut buf = vec![0u8; CHUNK];
            let n = read_full(r, &mut buf).map_err(ImageError::from_io)?;
            if n == 0 {
                break;
            }
            buf.truncate(n);
            if total == 0 {
                gzip = buf.starts_with(&[0x1f, 0x8b]);
            }
            ctx.update(&buf);
            total += n as u64;
            rt.block_on(w.write(buf))?;
        }
        if total != size {
            return Err(ImageError::Truncated {
                path: path.to_string(),
                got: total,
                want: size,
            });
        }
        let digest = sha256_hex(ctx.finish());
        if let Some(d) = expected.filter(|d| *d != digest) {
            return Err(ImageError::Digest {
                path: path.to_string(),
                expected: d.to_string(),
                actual: digest,
            });
        }
        match rt.block_on(w.commit(&digest, HashMap::new())) {
            Ok(_) => {
                self.written += 1;
                self.bytes += size;
            }
            // The same bytes arrived meanwhile (or a docker layer already there).
            Err(e) if e.is_already_exists() => {
                rt.block_on(cd.lease_blob(self.lease, &digest))?;
                self.present += 1;
            }
            Err(e) => return Err(e.into()),
        }
        self.current = None;
        Ok(Blob {
            digest,
            size: size as i64,
            gzip,
        })
    }

    /// Puts a small blob edgehub made (a docker-archive's manifest), with labels.
    fn put_bytes(
        &mut self,
        bytes: &[u8],
        labels: HashMap<String, String>,
    ) -> Result<String, ImageError> {
        let digest = sha256_hex(ring::digest::digest(&ring::digest::SHA256, bytes));
        let (rt, cd) = (self.rt, self.cd);
        if rt.block_on(cd.info(&digest))?.is_some() {
            rt.block_on(cd.lease_blob(self.lease, &digest))?;
            rt.block_on(cd.set_labels(&digest, labels))?;
            return Ok(digest);
        }
        self.n += 1;
        let reference = format!("{}-{}", self.lease, self.n);
        self.current = Some(reference.clone());
        let mut w = cd.writer(self.lease, &reference, bytes.len() as i64, Some(&digest))?;
        rt.block_on(w.write(bytes.to_vec()))?;
        rt.block_on(w.commit(&digest, labels))?;
        self.current = None;
        Ok(digest)
    }

    /// A blob the images need: in the store with its size (written now, or already there, as
    /// a delta archive expects), and held by the lease.
    fn require(&self, d: &Descriptor, what: &str) -> Result<(), ImageError> {
        let (rt, cd) = (self.rt, self.cd);
        match rt.block_on(cd.info(&d.digest))? {
            Some(i) if i.size == d.size => {
                rt.block_on(cd.lease_blob(self.lease, &d.digest))?;
                Ok(())
            }
            Some(i) => Err(ImageError::Archive(format!(
                "{what} {} is {} bytes, its descriptor says {}",
                d.digest, i.size, d.size
            ))),
            None => Err(ImageError::Missing {
                what: what.to_string(),
                digest: d.digest.clone(),
            }),
        }
    }

    /// A JSON blob of the store, of `size` bytes as its descriptor says (and [`Self::require`]
    /// checked), refused unread when larger than [`MAX_JSON`].
    fn read_json(&self, digest: &str, size: i64) -> Result<Vec<u8>, ImageError> {
        if size > MAX_JSON as i64 {
            return Err(ImageError::Limit(format!(
                "{digest} is {size} bytes; the most accepted for a manifest, an index or a \
                 config is {MAX_JSON} bytes"
            )));
        }
        Ok(self.rt.block_on(self.cd.read(digest, MAX_JSON))?)
    }

    /// The blob at `path`, following the archive's links.
    fn blob_at(&self, path: &str) -> Result<&Blob, ImageError> {
        resolve(&self.blobs, &self.links, path)
    }

    /// Reads a manifest, requires its config and layers, and checks its platform.
    fn check_manifest(
        &self,
        d: &Descriptor,
        device: &oci::Platform,
    ) -> Result<oci::Manifest, ImageError> {
        let m = oci::parse_manifest(&d.digest, &self.read_json(&d.digest, d.size)?)?;
        self.require(&m.config, "config")?;
        for l in &m.layers {
            self.require(l, "layer")?;
        }
        let config = oci::parse_config(
            &m.config.digest,
            &self.read_json(&m.config.digest, m.config.size)?,
        )?;
        if !oci::runs_on(&config.platform(), device) {
            return Err(ImageError::Platform(format!(
                "image {} is for {}, this device is {device}",
                d.digest,
                config.platform()
            )));
        }
        Ok(m)
    }

    fn manifest_labels(m: &oci::Manifest) -> HashMap<String, String> {
        let mut l = HashMap::new();
        l.insert(format!("{GC_REF}.config"), m.config.digest.clone());
        for (i, layer) in m.layers.iter().enumerate() {
            l.insert(format!("{GC_REF}.l.{i}"), layer.digest.clone());
        }
        l
    }

    /// The images of an OCI layout.
    fn oci(&self, index_json: &[u8], device: &oci::Platform) -> Result<Vec<Prepared>, ImageError> {
        let index = oci::parse_index("index.json", index_json)?;
        if index.manifests.is_empty() {
            return Err(ImageError::Archive("index.json lists no image".into()));
        }
        let mut out = Vec::new();
        for top in &index.manifests {
            self.require(top, "manifest")?;
            let mut labels = Vec::new();
            let chosen = if top.is_index() {
                let inner = oci::parse_index(&top.digest, &self.read_json(&top.digest, top.size)?)?;
                let Some(m) = oci::pick_platform(&inner, device).cloned() else {
                    let have: Vec<String> = inner
                        .manifests
                        .iter()
                        .filter_map(|d| d.platform.as_ref().map(ToString::to_string))
                        .collect();
                    return Err(ImageError::Platform(format!(
                        "index {} has no manifest for {device} (it has: {})",
                        top.digest,
                        have.join(", ")
                    )));
                };
                self.require(&m, "manifest")?;
                let mut l = HashMap::new();
                l.insert(format!("{GC_REF}.m.0"), m.digest.clone());
                labels.push((top.digest.clone(), l));
                m
            } else {
                top.clone()
            };
            let m = self.check_manifest(&chosen, device)?;
            labels.push((chosen.digest.clone(), Self::manifest_labels(&m)));
            let names = match top.archive_name() {
                Some(n) => vec![Reference::parse(n)
                    .map_err(|e| ImageError::Archive(format!("index.json: {e}")))?],
                None => Vec::new(),
            };
            let mut digests = vec![top.digest.clone()];
            if chosen.digest != top.digest {
                digests.push(chosen.digest.clone());
            }
            out.push(Prepared {
                offer: Offer { names, digests },
                target: top.clone(),
                labels,
            });
        }
        Ok(out)
    }

    /// The images of a docker-archive: a manifest made from manifest.json, with every layer
    /// checked against the config's diff ids.
    fn docker(
        &mut self,
        manifest_json: &[u8],
        device: &oci::Platform,
    ) -> Result<Vec<Prepared>, ImageError> {
        let images = oci::parse_docker_manifest(manifest_json)?;
        if images.is_empty() {
            return Err(ImageError::Archive("manifest.json lists no image".into()));
        }
        let mut out = Vec::new();
        for img in images {
            let cfg = self.blob_at(&img.config)?.clone();
            let config = oci::parse_config(&img.config, &self.read_json(&cfg.digest, cfg.size)?)?;
            if !oci::runs_on(&config.platform(), device) {
                return Err(ImageError::Platform(format!(
                    "image {} is for {}, this device is {device}",
                    img.config,
                    config.platform()
                )));
            }
            let diff_ids = config.rootfs.map(|r| r.diff_ids).unwrap_or_default();
            if diff_ids.len() != img.layers.len() {
                return Err(ImageError::Archive(format!(
                    "{} has {} layers, its config {} diff ids",
                    img.config,
                    img.layers.len(),
                    diff_ids.len()
                )));
            }
            let mut layers = Vec::new();
            for (path, diff_id) in img.layers.iter().zip(&diff_ids) {
                let b = self.blob_at(path)?;
                // An uncompressed layer's digest is its diff id: the config vouches for it.
                if !b.gzip && &b.digest != diff_id {
                    return Err(ImageError::Digest {
                        path: path.clone(),
                        expected: diff_id.clone(),
                        actual: b.digest.clone(),
                    });
                }
                layers.push(Descriptor {
                    media_type: if b.gzip {
                        oci::DOCKER_LAYER_GZIP
                    } else {
                        oci::DOCKER_LAYER
                    }
                    .into(),
                    digest: b.digest.clone(),
                    size: b.size,
                    annotations: Default::default(),
                    platform: None,
                });
            }
            let config_desc = Descriptor {
                media_type: oci::DOCKER_CONFIG.into(),
                digest: cfg.digest.clone(),
                size: cfg.size,
                annotations: Default::default(),
                platform: None,
            };
            let bytes = oci::docker_manifest(&config_desc, &layers);
            let m = oci::Manifest {
                media_type: Some(oci::DOCKER_MANIFEST.into()),
                config: config_desc,
                layers,
            };
            let digest = self.put_bytes(&bytes, Self::manifest_labels(&m))?;
            let mut names = Vec::new();
            for t in img.repo_tags.unwrap_or_default() {
                names.push(
                    Reference::parse(&t)
                        .map_err(|e| ImageError::Archive(format!("manifest.json: {e}")))?,
                );
            }
            out.push(Prepared {
                offer: Offer {
                    names,
                    digests: vec![digest.clone()],
                },
                target: Descriptor {
                    media_type: oci::DOCKER_MANIFEST.into(),
                    digest,
                    size: bytes.len() as i64,
                    annotations: Default::default(),
                    platform: None,
                },
                labels: Vec::new(),
            });
        }
        Ok(out)
    }

    /// After the walk: the archive's images checked, judged, and named.
    pub fn finish(
        &mut self,
        wanted: &[Wanted],
        force: bool,
        device: &oci::Platform,
    ) -> Result<Loaded, ImageError> {
        let prepared = if let Some(idx) = self.meta.get("index.json").cloned() {
            self.oci(&idx, device)?
        } else if let Some(m) = self.meta.get("manifest.json").cloned() {
            self.docker(&m, device)?
        } else {
            return Err(ImageError::Archive(
                "the archive has neither index.json (an OCI layout) nor manifest.json (docker \
                 save); is it complete?"
                    .into(),
            ));
        };
        let mut named = Vec::new();
        for p in &prepared {
            match policy::decide(&p.offer, wanted, force) {
                Verdict::Accept(names) => named.push(names),
                Verdict::Refuse(why) => return Err(ImageError::Refused(why)),
            }
        }
        let (rt, cd) = (self.rt, self.cd);
        let mut loaded = Loaded {
            images: Vec::new(),
            digests: Vec::new(),
            blobs_written: self.written,
            blobs_present: self.present,
            bytes_written: self.bytes,
        };
        for (p, names) in prepared.iter().zip(named) {
            for (digest, labels) in &p.labels {
                rt.block_on(cd.set_labels(digest, labels.clone()))?;
            }
            for name in names {
                let target = CdDescriptor {
                    media_type: p.target.media_type.clone(),
                    digest: p.target.digest.clone(),
                    size: p.target.size,
                    annotations: Default::default(),
                };
                let mut labels = HashMap::new();
                labels.insert("io.cri-containerd.image".into(), "managed".into());
                rt.block_on(cd.put_image(&name, target, labels, Some(self.lease)))?;
                tracing::info!(image = %name, digest = %p.target.digest, "image side-loaded");
                loaded.images.push(name);
                loaded.digests.push(p.target.digest.clone());
            }
        }
        Ok(loaded)
    }
}
